"""save / load / info / verify of one checkpoint at a URL: composes tree, format, storage and
engine (API layer).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import math
import os
import posixpath
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from ._checksum import DEFAULT_ALGORITHM, checksum_function
from ._commit import (
    check_free,
    discard_unless_committed,
    publish,
    raise_out_of_space,
    read_manifest,
    remove_unreferenced,
)
from ._dist import (
    Group,
    Primed,
    check_same_url,
    exchange,
    group_for,
    prime_optimizers,
    raise_together,
    save_pieces,
    state_shapes,
    unprime,
)
from ._engine import (
    IOOptions,
    Part,
    PartsRead,
    read_parts,
    read_segments,
    scratch_dest,
    write_file,
)
from ._events import ERROR, LOAD, SAVE, Event, EventCallback, emit
from ._format import (
    BLOCK_BYTES,
    Box,
    Chunk,
    Entry,
    Manifest,
    data_file_name,
    decode,
    encode,
    records,
    version_for,
)
from ._incremental import Increment
from ._leaves import (
    ALIAS,
    NDARRAY,
    PICKLE,
    SHARDED,
    TENSOR,
    VALUE,
    Pickled,
    flag,
    is_dtensor,
    is_tensor,
    is_uninitialized,
    piece_of,
)
from ._plan import WriteItem, group_ranges, match_target, meeting, plan_reads, wrapper_hint
from ._reshard import Want, read_pieces, whole
from ._snapshot import Stager
from ._staging import (
    Destination,
    HostData,
    SaveData,
    check_makeable,
    describe,
    destination,
    destinations,
    device_batches,
    finish,
    host_data,
    same_tensor,
)
from ._tree import (
    MAX_DEPTH,
    Flat,
    KeepEmpty,
    Memo,
    checked_keys,
    flatten,
    join,
    nodes_at,
    open_keys,
    optional_paths,
    parameter_groups,
    per_rank_paths,
    rebuild,
    renumbered,
    replaces,
    select,
    selects,
    write_back,
)
from ._types import StatePath
from ._version import __version__
from .errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
    PickleNotAllowed,
    SafepointError,
    StateMismatch,
    UnsupportedLeaf,
)
from .storage import Storage, open_storage

__all__ = [
    "CheckpointInfo",
    "EntryInfo",
    "PreparedSave",
    "Progress",
    "VerifyReport",
    "info",
    "info_of",
    "load",
    "load_from",
    "metadata_not_a_dict",
    "prepare_save",
    "save",
    "save_collective",
    "verify",
    "write_and_commit",
]

logger = logging.getLogger(__name__)

_OPTIONS = IOOptions()
#: Loads land straight in their destinations, so reads may be long at no memory cost; on a cold
#: page cache 128 MiB reads (each a fresh file descriptor, whose readahead starts anew) loaded
#: W3 in 0.57 s where 32 MiB ones took 0.75-0.85 s.
_LOAD_OPTIONS = replace(_OPTIONS, max_read_bytes=128 << 20)
#: A load plans its reads this many entries at a time, and the first are read while it plans
#: the rest (W2: `_read` 0.135-0.143 s -> 0.123-0.138 s).
_PLAN_BATCH = 2048
#: Reading entries this small on average is Python's work (the GIL) more than the kernel's:
#: more reading threads than CPUs only contend for it (W2 warm on 2 CPUs: 0.262 s with 4
#: threads, 0.242 s with 2; W1's 16 MiB tensors read faster with 4).
_SMALL_ENTRY_BYTES = 1 << 20


class _GcPauses:
    """The bulk operations running now, in any thread, that paused the collector, and
    whether it was enabled before the first of them (each thread saving its own `isenabled`
    left it off for good when another thread's pause ended in between). Re-entrant: a signal
    handler's save may run inside this thread's own load."""

    lock = threading.RLock()
    running = 0
    enabled = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk operation: a state of many thousands of
    tensors makes the manifest and plans allocate hundreds of thousands of small objects, and
    the collections they trigger would cost more than the I/O (measured: 2x on W2). It is
    enabled again, if it was, when the last operation running ends."""
    # Counted first and what to restore read first: a signal handler's save that runs
    # between two of these lines sees this one running and leaves the collector to it.
    with _GcPauses.lock:
        _GcPauses.running += 1
        if _GcPauses.running == 1:
            _GcPauses.enabled = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _GcPauses.lock:
            enabled = _GcPauses.enabled
            _GcPauses.running -= 1
            if _GcPauses.running == 0 and enabled:
                gc.enable()


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """One saved leaf as `sp.info` describes it.

    Attributes:
        path: its `/`-joined path.
        kind: "tensor", "ndarray", "bytes", "pickle", "sharded", "value" or "alias" (a tied
            tensor, stored once under the entry its `value` names).
        dtype: element type name (F32, BF16, ...) of tensors and arrays.
        shape: shape of tensors and arrays.
        nbytes: bytes of data.
        value: the value itself for kind "value"; for kind "alias", the path of the entry
            whose tensor it is.
        big_endian: an array saved big-endian (and loaded back so).
    """

    path: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    value: Any = None
    big_endian: bool = False


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What a committed checkpoint holds, read from its manifest alone.

    Attributes:
        url: where it is.
        save_id: unique id of the save that wrote it.
        created: UTC time of the commit, ISO 8601.
        format_version: the manifest's format version.
        library_version: the safepoint version that wrote it.
        torch_version: the torch version of the writer, if it had torch.
        world_size: how many ranks wrote it.
        metadata: the user's metadata.
        entries: every leaf, in tree order.
        nbytes: bytes of all data files.
        files: how many data files.
    """

    url: str
    save_id: str
    created: str
    format_version: int
    library_version: str
    torch_version: str | None
    world_size: int
    metadata: dict[str, Any]
    entries: list[EntryInfo]
    nbytes: int
    files: int


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The outcome of `sp.verify`.

    Attributes:
        url: the checkpoint.
        ok: True when every byte matched its checksum and the manifest is sound.
        problems: one line per problem.
        nbytes: bytes read and checked.
        seconds: how long it took.
    """

    url: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0


def info_of(url: str, manifest: Manifest) -> CheckpointInfo:
    """What `info` says of the checkpoint at `url` whose manifest is `manifest` (its entries
    made a column at a time, see `records`)."""
    rows = list(manifest.entries.values())
    return CheckpointInfo(
        url=url,
        save_id=manifest.save_id,
        created=manifest.created,
        format_version=manifest.version,
        library_version=manifest.library_version,
        torch_version=manifest.torch_version,
        world_size=manifest.world_size,
        metadata=manifest.metadata,
        entries=records(
            EntryInfo, len(rows), manifest.entries, [e.kind for e in rows],
            [e.dtype for e in rows], [e.shape for e in rows], [e.nbytes for e in rows],
            [e.value if e.kind in (VALUE, ALIAS) else None for e in rows],
            [e.big_endian for e in rows],
        ),
        nbytes=manifest.nbytes,
        files=len(manifest.files),
    )


def _checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    try:
        text = json.dumps(metadata, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate: a manifest no reader takes
        non_str_key = _has_non_str_key(metadata)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnsupportedLeaf(
            f"metadata is not JSON ({type(exc).__name__}: {str(exc)[:200]}): use str keys and "
            "str, number, bool, None, list or dict values nested a few levels deep, or put "
            "the value in the state instead",
            path="<metadata>",
        ) from exc
    if not isinstance(metadata, dict):
        raise metadata_not_a_dict(metadata)
    if non_str_key:
        raise UnsupportedLeaf(
            "metadata has a dict key that is not a str, which JSON would silently turn into "
            "one: convert its keys to str, or put the value in the state instead",
            path="<metadata>",
        )
    # A copy, as stored: a background save encodes it later, after the caller moved on.
    copied: dict[str, Any] = json.loads(text)
    return copied


def metadata_not_a_dict(metadata: object) -> UnsupportedLeaf:
    """The refusal of `metadata=` that is not a dict."""
    return UnsupportedLeaf(
        f"metadata must be a dict, not a {type(metadata).__name__}: pass a dict of str keys "
        "and JSON values, or None", path="<metadata>")


def _has_non_str_key(value: Any) -> bool:
    if isinstance(value, dict):
        return any(type(key) is not str or _has_non_str_key(v) for key, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_non_str_key(v) for v in value)
    return False


@dataclass(slots=True)
class PreparedSave:
    """A save checked and flattened in the caller's thread, ready for `write_and_commit`
    (possibly in another thread). Closing it releases the storage.

    Attributes:
        url: where it goes.
        storage: the open storage at `url`.
        leaves: the flattened state's leaves, in tree order.
        kinds: each leaf's kind (see `_leaves`).
        tree: the skeleton the manifest stores.
        metadata: the checked user metadata.
        overwrite: whether a committed checkpoint at `url` may be replaced.
        save_id: unique id of this save (names its data files).
        started: `time.perf_counter()` when the save began.
    """

    url: str
    storage: Storage
    leaves: dict[StatePath, Any]
    kinds: dict[StatePath, str]
    tree: Any
    metadata: dict[str, Any]
    overwrite: bool
    save_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.perf_counter)

    @property
    def data_file(self) -> str:
        """The name of the data file this save writes."""
        return data_file_name(self.save_id, 0, 0)

    def host_data(self) -> HostData:
        """The leaves' bytes as views of their own memory (no staging copy).

        Raises:
            UnsupportedLeaf: a leaf that cannot be stored.
        """
        return host_data(self.leaves, self.kinds)

    def staged(self) -> None:
        """Drop the data leaves (their paths stay), staged by a snapshot: the write needs
        the plain values alone, and holding the state's arrays until it ends would keep
        NumPy from resizing one in place (it counts references)."""
        self.leaves = {path: leaf if self.kinds[path] == VALUE else None
                       for path, leaf in self.leaves.items()}

    def close(self) -> None:
        """Release the storage."""
        self.storage.close()

    def __enter__(self) -> PreparedSave:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@_gc_paused()
def prepare_save(
    url: str,
    state: Any,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    memo: Memo | None = None,
    parent_check: bool = True,
) -> PreparedSave:
    """The first half of `save`, run in the caller's thread: check the metadata and the
    target, and flatten `state` (calling `state_dict()` on stateful objects; `memo` as
    `flatten` takes it, for a series of saves). Nothing is written. The caller owns the
    result and must close it. `parent_check`: see `check_free` (a manager's steps skip it).

    Raises:
        CheckpointExists: `url` holds a committed checkpoint and `overwrite` is False.
        UnsupportedLeaf: bad metadata, or a state that cannot be flattened.
    """
    started = time.perf_counter()
    user_metadata = _checked_metadata(metadata)
    storage = open_storage(url, storage_options)
    try:
        check_free(storage, overwrite=overwrite, parent_check=parent_check)
        flat = flatten(state, memo=memo, max_depth=MAX_DEPTH)
    except BaseException:
        storage.close()
        raise
    return PreparedSave(url, storage, flat.leaves, flat.kinds, flat.skeleton, user_metadata,
                        overwrite, started=started)


def write_and_commit(
    prepared: PreparedSave, data: SaveData, increment: Increment | None = None, *,
    before_publish: Callable[[], None] | None = None, tidy: bool = True,
) -> CheckpointInfo:
    """The second half of `save`: write `data` (the prepared leaves' bytes) as a data file,
    durably, then publish the manifest. Safe to run in a background thread; the storage stays
    open (the caller closes `prepared`). The cyclic garbage collector stays on here, since a
    background write must not pause it for the training thread; `save` pauses it. With an
    `increment` (its data file named by `prepared.data_file`), only the blocks its previous
    commit does not hold are written, the files holding the others are shared, and
    `increment.next` is set once committed. `before_publish` is called once the data is
    durable, just before the manifest is published (a manager checks its lease there); what
    it raises is raised, with the data removed and nothing published. `tidy`: see `_publish`.

    Raises:
        CheckpointExists: a committed checkpoint appeared at the URL meanwhile and
            `overwrite` is False.
        StorageError: the storage failed (the previous checkpoint stays intact).
    """
    manifest, document, info = _write(prepared, data, increment)
    try:
        if before_publish is not None:
            before_publish()
        _publish(prepared.storage, manifest, document, overwrite=prepared.overwrite,
                 tidy=tidy)
    except BaseException:
        discard_unless_committed(prepared.storage, manifest.save_id, list(manifest.files))
        raise
    seconds = time.perf_counter() - prepared.started
    reused = increment.reused if increment is not None else 0
    logger.info(
        "saved %s: %d entries, %.1f MB in %.2f s (%.0f MB/s)%s", prepared.url,
        len(manifest.entries), manifest.nbytes / 1e6, seconds,
        manifest.nbytes / 1e6 / max(seconds, 1e-9),
        f", {reused / 1e6:.1f} MB of it unchanged and shared" if reused else "",
    )
    if increment is not None:
        increment.committed(prepared.url, manifest)
    return info


@_gc_paused()
def save(
    url: str,
    state: Any,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    dist: bool | None = None,
    on_event: EventCallback | None = None,
) -> CheckpointInfo:
    """Save `state` as one checkpoint at `url`, durably and atomically.

    Data is written and fsynced first; the manifest is published last, so a crash at any
    instant leaves either the previous checkpoint at `url` or the new one, never a mix.

    Once torch.distributed is initialised the call is collective: every rank of the group
    calls it with its own state. `sp.Shard` and `DTensor` leaves are written by the ranks
    holding them, each piece once; any other leaf must be the same on every rank (it is
    written once, the writing spread over ranks); `sp.PerRank` values are kept per rank. Each
    rank writes and fsyncs its own data file, and rank 0 publishes the manifest only after
    every rank succeeded.

    Args:
        url: a directory path or URL; created if needed.
        state: a tree of dicts, lists and tuples whose leaves are tensors, numpy arrays, plain
            values, bytes, stateful objects (`state_dict()`/`load_state_dict()`) or
            `sp.Pickled` objects.
        metadata: JSON-able user data stored in the manifest.
        overwrite: replace a committed checkpoint at `url`.
        storage_options: options for the storage backend.
        process_group: the torch.distributed group to save over (the default group when
            None).
        dist: False keeps the call local to this process; True requires torch.distributed.
        on_event: called with an `sp.Event` ("save", or "error" when the save fails).

    Returns:
        what was committed (the same on every rank).

    Raises:
        CheckpointExists: `url` holds a committed checkpoint and `overwrite` is False.
        UnsupportedLeaf: the state holds a value that cannot be saved (nothing is written).
        StorageError: the storage failed (the previous checkpoint stays intact).
        DistributedError: a collective save failed on some rank (named with its cause); no
            rank committed anything.
    """
    started = time.perf_counter()
    group = group_for(process_group, dist)
    try:
        committed: CheckpointInfo | None = None
        if group.solo:
            with prepare_save(url, state, metadata=metadata, overwrite=overwrite,
                              storage_options=storage_options) as prepared:
                if SHARDED not in prepared.kinds.values():
                    committed = write_and_commit(prepared, prepared.host_data())
        if committed is None:
            # Pieces of global tensors (from one process or many) take the collective path,
            # which in a group of one is plain calls.
            write, _ = save_collective(group, url, state, metadata=metadata,
                                       overwrite=overwrite, storage_options=storage_options)
            committed = write()
    except BaseException as exc:
        _notify(on_event, ERROR, url, started, error=exc)
        raise
    _notify(on_event, SAVE, url, started, committed.nbytes)
    return committed


def save_collective(
    group: Group, url: str, state: Any, *, metadata: dict[str, Any] | None, overwrite: bool,
    storage_options: dict[str, Any] | None, stager: Stager | None = None,
    memo: Memo | None = None, increment: Increment | None = None,
    replica: bool | None = None, before_publish: Callable[[], None] | None = None,
    parent_check: bool = True, tidy: bool = True,
) -> tuple[Callable[[], CheckpointInfo], Callable[[], None]]:
    """A collective `save` in two halves: this call agrees with the other ranks on who writes
    what; the returned `write` writes and commits, possibly in a background thread (then over
    a group of its own, see `Group.private`). With a `stager`, the caller runs the returned
    `stage` while `write` runs: it copies this rank's pieces into the stager's buffers, within
    its budget (see `_dist.save_pieces`); without one, `stage` does nothing. `memo` is
    `flatten`'s, for a series of saves. With an `increment` (every rank's written against
    the same previous commit), each rank writes only the blocks of its pieces that commit
    does not hold, and `increment.next` is set once committed.

    `replica` (None on every rank, or a bool on every rank) is for URLs that are not one
    directory on every rank (a two-tier manager's node-local step directories): after rank 0
    published the manifest, each rank given True publishes the same bytes in its own storage
    (replacing what was committed there), and a third exchange makes every rank raise when
    one of them failed (the step is then committed only where it was published).

    `before_publish` is called on rank 0 once every rank's data is durable, just before the
    manifest is published (a manager checks its lease there); what it raises fails the save
    on every rank, with nothing published. `parent_check`: see `check_free`; `tidy` (rank
    0's): see `_publish`.
    """
    started = time.perf_counter()
    try:
        storage = open_storage(url, storage_options)
    except Exception as exc:  # an unknown scheme, bad options: raised on every rank
        raise_together(group, exc, what=f"saving {url}", consequence="nothing was written")
    checked: list[dict[str, Any]] = []

    def prepare() -> Flat:
        checked.append(_checked_metadata(metadata))
        return flatten(state, rank=group.rank, memo=memo, max_depth=MAX_DEPTH)

    def check() -> None:
        check_free(storage, overwrite=overwrite, parent_check=parent_check)

    committed: list[Manifest] = []

    def commit(save_id: str, entries: dict[StatePath, Entry], files: dict[str, int],
               tree: Any, hashes: dict[StatePath, tuple[str, ...]]) -> bytes:
        """Publish on rank 0; the other ranks get the manifest's JSON, which crosses
        processes faster than its thousands of records would pickle."""
        manifest = _new_manifest(save_id, entries, files, tree, checked[0], group.size, hashes)
        committed.append(manifest)
        document = encode(manifest)
        if before_publish is not None:
            before_publish()
        _publish(storage, manifest, document, overwrite=overwrite, tidy=tidy)
        return document

    try:
        finish, stage = save_pieces(group, storage, prepare, check=check, commit=commit,
                                    options=_OPTIONS, url=url, stager=stager,
                                    increment=increment,
                                    agreed=None if replica is None else posixpath.basename(
                                        url.rstrip("/")))
    except BaseException:
        storage.close()
        raise

    def write_and_publish() -> CheckpointInfo:
        try:
            document = finish()
            manifest = committed[0] if committed else decode(document, url)
            if replica is not None:

                def replicate() -> None:
                    if replica:
                        _publish(storage, manifest, document, overwrite=True)

                exchange(group, replicate, lambda _: None, what=f"committing {url} on every node",
                         consequence="the step is committed only where rank 0 and the "
                         "other ranks that succeeded published it: save it again")
        finally:
            storage.close()
        seconds = time.perf_counter() - started
        logger.info("saved %s from %d ranks: %d entries, %.1f MB in %.2f s", url, group.size,
                    len(manifest.entries), manifest.nbytes / 1e6, seconds)
        if increment is not None:
            increment.committed(url, manifest)
        return info_of(url, manifest)

    return write_and_publish, stage


def _publish(
    storage: Storage, manifest: Manifest, document: bytes, *, overwrite: bool, tidy: bool = True,
    background: bool = True,
) -> None:
    """Publish `document`, the encoded `manifest`, once every data file that `storage` holds
    of it is durable; then, with `tidy`, remove in the background what the manifest does not
    reference (what it replaced, or what a crashed save left there), which takes a listing
    of the directory (a LIST request on an object store). A failure to remove is logged: the
    checkpoint is committed. `tidy` False is for a caller that knows the directory held
    nothing before this save (a manager's step of a new number). `background` False removes
    before returning: for a copy, whose data file names recur (the same save copied there
    again), so that no removal still queued deletes a file a later copy wrote."""
    publish(storage, document, overwrite=overwrite)
    if not tidy:
        return
    try:
        remove_unreferenced(storage, manifest, background=background)
    except Exception:
        logger.warning("could not remove the replaced data under %s; the next save there "
                       "will", storage.url, exc_info=True)


def _write(
    prepared: PreparedSave, data: SaveData, increment: Increment | None = None
) -> tuple[Manifest, bytes, CheckpointInfo]:
    """Write `data` as one data file, durably, and return the manifest that commits it, encoded
    and described: the entries' records are made as their bytes are copied, while the writer
    holds every buffer (`_Chunked`), and the rest while the writer finishes the file (on W2,
    20,000 entries: 30 ms after the last copy instead of 55). With an `increment`, only the
    blocks it does not find in its previous commit, and the files holding those are
    shared."""
    storage = prepared.storage
    name = prepared.data_file
    made: list[tuple[Manifest, bytes, CheckpointInfo]] = []

    early = _Chunked(data, name)

    def make(digests: dict[StatePath, list[int]], size: int | None = None) -> None:
        described = data.entries
        if increment is None:
            chunked = early.finish(digests)
        else:
            chunks = increment.chunks(digests)
            paths = [path for path, entry in described.items() if entry.kind != ALIAS]
            chunked = dict(zip(paths, _with_chunks(
                [described[path] for path in paths], [chunks[path] for path in paths]),
                strict=True))
        entries = {  # an alias or a value has no chunks
            path: chunked.get(path) or described.get(path) or Entry(VALUE, value=leaf)
            for path, leaf in prepared.leaves.items()
        }
        files = {} if size is None else {name: size}
        if increment is not None:
            files.update(increment.shared())
        manifest = _new_manifest(prepared.save_id, entries, files, prepared.tree,
                                 prepared.metadata,
                                 hashes=increment.hashes() if increment is not None else None)
        made.append((manifest, encode(manifest), info_of(prepared.url, manifest)))

    if any(kind != VALUE for kind in prepared.kinds.values()):
        stream = data.stream() if increment is None else increment.stream(data.stream(), name)
        try:
            write_file(storage, name, stream, block_bytes=BLOCK_BYTES,
                       checksum=checksum_function(DEFAULT_ALGORITHM), options=_OPTIONS,
                       meanwhile=make, spare=early.ready if increment is None else None)
            if increment is not None:
                increment.share(storage)
        except BaseException as exc:
            _discard(storage, name)
            raise_out_of_space(storage, exc, prepared.save_id)
            raise
    else:
        make({})
    return made[0]


#: Entries `_Chunked.ready` makes at once, at least: fewer are left for `finish`.
_SPARE_ENTRIES = 256


class _Chunked:
    """The data entries of a save with their chunks, made a column at a time (see `records`)
    while the data file is written: `write_file` offers `ready` the time it would spend
    waiting for the writer, so that on a disk slower than the copies most of this work (W2:
    15 ms for 20,000 entries) overlaps the writes instead of following them."""

    def __init__(self, data: SaveData, name: str) -> None:
        self.data = data
        self.name = name
        self.entries: dict[StatePath, Entry] = {}
        self.done = 0  # items of the layout made
        self.ordered = True  # whether the layout is in the order `write_file` copies

    def ready(self, digests: dict[StatePath, list[int]]) -> None:
        """Make the entries whose bytes are all copied: those of `digests` (in file order)
        but the last, which may be in part."""
        count = len(digests) - 1
        if not self.ordered or count - self.done < _SPARE_ENTRIES:
            return
        items = self.data.layout[self.done : count]
        if [item.path for item in items] != list(itertools.islice(digests, self.done, count)):
            self.ordered = False  # all made by `finish`
            return
        self._make(items, digests)
        self.done = count

    def finish(self, digests: dict[StatePath, list[int]]) -> dict[StatePath, Entry]:
        """Every data entry with its chunk, once every item is copied."""
        self._make(self.data.layout[self.done :], digests)
        return self.entries

    def _make(self, items: list[WriteItem], digests: dict[StatePath, list[int]]) -> None:
        paths = [item.path for item in items]
        chunks = records(
            Chunk, len(items), itertools.repeat(self.name), [item.offset for item in items],
            [item.nbytes for item in items], [tuple(digests[path]) for path in paths],
            itertools.repeat(None),
        )
        described = self.data.entries
        self.entries.update(zip(paths, _with_chunks(
            [described[path] for path in paths], zip(chunks)), strict=True))


def _with_chunks(rows: list[Entry], chunks: Iterable[tuple[Chunk, ...]]) -> list[Entry]:
    """`rows` (entries without chunks) with `chunks`, made a column at a time."""
    return records(
        Entry, len(rows), [e.kind for e in rows], [e.dtype for e in rows],
        [e.shape for e in rows], chunks, itertools.repeat(None), [e.device for e in rows],
        [e.scalar for e in rows], [e.strides for e in rows], [e.big_endian for e in rows],
    )


def _new_manifest(
    save_id: str, entries: dict[StatePath, Entry], files: dict[str, int], tree: Any,
    metadata: dict[str, Any], world_size: int = 1,
    hashes: dict[StatePath, tuple[str, ...]] | None = None,
) -> Manifest:
    """The manifest of a save, of the lowest format version that reads its entries right;
    `hashes` are an incremental save's block hashes."""
    torch = sys.modules.get("torch")
    return Manifest(
        save_id=save_id,
        created=datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace(
            "+00:00", "Z"
        ),
        entries=entries,
        files=files,
        tree=tree,
        metadata=metadata,
        library_version=__version__,
        torch_version=getattr(torch, "__version__", None) if torch else None,
        world_size=world_size,
        checksum=DEFAULT_ALGORITHM,
        block_bytes=BLOCK_BYTES,
        version=version_for(entries),
        hashes=hashes or {},
    )


def _discard(storage: Storage, name: str) -> None:
    """Remove a data file of a save that failed; `gc` gets it if this fails too."""
    try:
        storage.delete([name])
    except Exception:
        logger.warning("could not remove %s/%s of a failed save; the next save there will",
                       storage.url, name, exc_info=True)


def _load_options(storage: Storage) -> IOOptions:
    """The engine's options for loading from `storage`: a backend whose requests have a high
    fixed cost (object stores) asks for its own read length with a `read_bytes` attribute."""
    read_bytes = getattr(storage, "read_bytes", None)
    return _LOAD_OPTIONS if read_bytes is None else replace(_OPTIONS, max_read_bytes=read_bytes)


def _read(
    storage: Storage, manifest: Manifest, dests: dict[StatePath, Destination],
    boxes: dict[StatePath, Box] | None = None, checked: _Tally | None = None,
) -> None:
    """Fill `dests`: whole entries chunk by chunk, pieces (a destination with a box in
    `boxes`, or a sharded entry) from the saved pieces that overlap them, aliases from the
    bytes of the entries they alias, and targets on an accelerator a host batch at a time;
    `checked` is told the bytes of each part once they are checked."""
    boxes = boxes or {}
    entries = manifest.entries
    on_device = False
    pieces: list[Want] = []
    wanted: list[tuple[StatePath, memoryview]] = []
    aliased: dict[StatePath, StatePath] = {}
    for path, dest in dests.items():
        kind = entries[path].kind
        if dest.holder is None:
            on_device = True
        elif kind == ALIAS:
            aliased[path] = entries[path].value
        elif path in boxes or kind == SHARDED:
            pieces.append(Want(path, boxes.get(path) or whole(entries[path]), dest.view))
        else:
            wanted.append((path, dest.view))
    if aliased:
        # One pass must not read a byte range into two places: aliases get a pass of their
        # own, reading the bytes of the entries they alias.
        _read(storage, _resolved(manifest, aliased), {p: dests[p] for p in aliased}, boxes,
              checked)
    if on_device:
        for batch in device_batches(dests):
            _read(storage, manifest, batch, boxes, checked)
    checksum = checksum_function(manifest.checksum)
    options = _load_options(storage)
    if pieces:
        problems = read_pieces(storage, manifest, pieces, checksum=checksum, options=options)
        if problems:
            raise _corrupt(storage, manifest, problems)
        if checked is not None:
            checked(sum(len(want.view) for want in pieces))
    local = getattr(storage, "read_bytes", None) is None
    if local and sum(len(view) for _, view in wanted) < _SMALL_ENTRY_BYTES * len(wanted):
        options = replace(options, read_threads=min(options.read_threads, _cpus()))
    block = manifest.block_bytes
    step = max(block, options.max_read_bytes // block * block)

    def reads() -> Iterator[PartsRead]:
        # Whole chunks, one cut every `step` bytes, placed as plain tuples: a load of 20,000
        # small tensors builds no other object per entry.
        for first in range(0, len(wanted), _PLAN_BATCH):
            placed: list[tuple[str, int, int, Part]] = []
            for path, view in wanted[first : first + _PLAN_BATCH]:
                at = 0  # where the chunk's bytes go in the entry's: chunks are consecutive
                for chunk in entries[path].chunks:
                    offset, nbytes = chunk.offset, chunk.nbytes
                    if 0 < nbytes == len(view) <= step:
                        placed.append((chunk.file, offset, offset + nbytes,
                                       (offset, view, chunk.digests, 0, path)))
                        continue
                    for start in range(0, nbytes, step):
                        stop = min(start + step, nbytes)
                        placed.append((chunk.file, offset + start, offset + stop,
                                       (offset + start, view[at + start : at + stop],
                                        chunk.digests, start // block, path)))
                    at += nbytes
            yield from group_ranges(placed, options.max_read_bytes, options.max_gap)

    problems = read_parts(storage, reads(), _itself, block_bytes=block, checksum=checksum,
                          options=options, checked=checked)
    if problems:
        raise _corrupt(storage, manifest, problems)


def _itself(read: PartsRead) -> PartsRead:
    return read


def _cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: Called with (bytes read and checked so far, bytes in all) as a load or verify advances.
Progress = Callable[[int, int], object]


class _Tally:
    """Adds up the bytes reading threads report and passes the running total on to a
    `Progress`, one call at a time; the first call, (0, total), is made at once."""

    def __init__(self, progress: Progress, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        self.lock = threading.Lock()
        progress(0, total)

    def __call__(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            self.progress(self.done, self.total)


def _read_size(dests: Mapping[StatePath, Destination]) -> int:
    """The bytes that filling `dests` reads (targets on a device included)."""
    return sum(len(dest.view) if dest.holder is not None
               else dest.target.numel() * dest.target.element_size()
               for dest in dests.values())


def _tally(progress: Progress | None, total: int) -> _Tally | None:
    """A `_Tally` of `total` bytes to read for `progress`, if any."""
    return None if progress is None else _Tally(progress, total)


class _Replaced(CheckpointNotFound):
    """The checkpoint a load was reading was replaced meanwhile (saved again with
    overwrite): `load` reads the new one."""


def _corrupt(
    storage: Storage, manifest: Manifest, problems: list[str], doing: str = "load"
) -> SafepointError:
    """The error for data that failed its reads while `doing` it: `CheckpointNotFound` when
    the checkpoint was removed or replaced meanwhile (its writer's retention, an overwrite: a
    reader racing a writer), else `CorruptCheckpoint`."""
    first = problems[0] + (f" (and {len(problems) - 1} more problem(s))"
                           if len(problems) > 1 else "")
    try:
        now: str | None = read_manifest(storage).save_id
    except SafepointError:
        now = None
    if now != manifest.save_id:
        return (_Replaced if now else CheckpointNotFound)(
            f"{storage.url} was {'replaced' if now else 'removed'} while it was being read to "
            f"{doing} it ({first}): {doing} it again, or another checkpoint (a writer's "
            "retention or an overwrite changes what is committed there)",
            url=storage.url,
        )
    return CorruptCheckpoint(
        f"{storage.url} is corrupt: {first}; restore an earlier checkpoint, and run "
        "`safepoint verify` for the full list",
        url=storage.url,
        problems=problems,
    )


def load(
    url: str,
    into: Any = None,
    *,
    keys: Sequence[str] | None = None,
    strict: bool = True,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    dist: bool | None = None,
    on_event: EventCallback | None = None,
    progress: Progress | None = None,
) -> Any:
    """Load the checkpoint at `url`, verifying every byte read against its checksum.

    Without `into`, returns the saved tree: containers as they were, tensors as CPU tensors,
    arrays as arrays, a stateful object as the state dict it produced, an `sp.PerRank` value
    as `{rank: value}`. With `into`, tensors are read straight into the existing tensors'
    memory (no second copy of the model), stateful objects get `load_state_dict`, and plain
    values are replaced in their containers.

    Once torch.distributed is initialised the call is collective: rank 0 reads the manifest
    for all, each rank reads only the bytes overlapping its own pieces (`sp.Shard`, `DTensor`
    leaves of `into`, whatever split the checkpoint was saved with) and checks that every
    element of each is covered exactly once, `sp.PerRank` values go back to the rank that
    saved them, and a failure on any rank raises on every rank. Without a process group a
    sharded checkpoint loads as whole tensors.

    Args:
        url: the checkpoint.
        into: a live state to restore in place.
        keys: path prefixes (`model/`) or globs (`model/*.weight`) selecting what to load.
        strict: with `into`, make missing or unexpected keys and dtype or shape differences an
            error; with False they are logged and skipped.
        allow_pickle: allow unpickling `sp.Pickled` entries, which runs code from the file.
        storage_options: options for the storage backend.
        process_group: the torch.distributed group to load over (the default group when
            None).
        dist: False keeps the call local to this process; True requires torch.distributed.
        on_event: called with an `sp.Event` ("load", or "error" when the load fails).
        progress: called with (bytes read and checked so far, bytes this process reads in
            all) as the load advances, from the reading threads one call at a time (a
            progress bar for a large restore from an object store).

    Returns:
        the loaded tree, or `into` updated (a new object only when its root is a tuple).

    Raises:
        CheckpointNotFound: nothing committed at `url`, or the checkpoint was removed
            while it was loading (a writer's retention), or replaced (an overwrite) twice,
            or once in a collective load: a process loading alone reads the new one.
        CorruptCheckpoint: a checksum mismatch, truncated data or a bad manifest (with `into`,
            tensors read before the problem was found hold the new bytes).
        StateMismatch: strict matching failed (nothing was changed), `keys` matched nothing,
            or per-rank values were selected for a different world size than saved them.
        PickleNotAllowed: an entry the load would read is pickled and `allow_pickle` is
            False (nothing was read); one that `strict=False` skips is not.
        UnsupportedLeaf: a pickled entry does not unpickle in this process (its class moved
            or its reduction raises), named by its path.
        FormatVersionError: the checkpoint was written by a newer format.
        DistributedError: a collective load failed on some rank (named with its cause).
        SafepointError: `keys` is a str, or holds an item that is not one.
    """
    group = group_for(process_group, dist)
    try:
        storage = open_storage(url, storage_options)
    except Exception as exc:  # an unknown scheme, bad options: raised on every rank
        raise_together(group, exc, what=f"loading {url}", consequence="nothing was loaded")
    try:
        try:
            return load_from(storage, into, keys=keys, strict=strict,
                             allow_pickle=allow_pickle, group=group, on_event=on_event,
                             progress=progress, named=url)
        except _Replaced as exc:
            if not group.solo:  # a retry would need every rank to agree on it
                raise
            # Saved again with overwrite while it was read (its old data files went): the
            # new checkpoint is the one at `url` now, whole; so at any instant one loads.
            logger.info("%s; loading the new one", exc)
        return load_from(storage, into, keys=keys, strict=strict, allow_pickle=allow_pickle,
                         group=group, on_event=on_event, progress=progress, named=url)
    finally:
        storage.close()


@_gc_paused()
def load_from(
    storage: Storage,
    into: Any = None,
    *,
    keys: Sequence[str] | None,
    strict: bool,
    allow_pickle: bool,
    group: Group,
    on_event: EventCallback | None = None,
    progress: Progress | None = None,
    named: str | None = None,
) -> Any:
    """`load` from the checkpoint at an open `storage` (left open), over `group`: for a
    storage that is not one URL's backend, e.g. a two-tier manager's step that reads each
    data file from a node-local copy when there is one, else from the remote root. `named`:
    the URL the caller gave, which every rank must have given alike."""
    url = storage.url
    strict = flag("strict", strict, url)
    allow_pickle = flag("allow_pickle", allow_pickle, url)
    started = time.perf_counter()
    steps: list[Any] = []
    primed: list[Any] = []  # optimizers given state for the load (see `_load_into`)
    try:
        read: list[Manifest] = []

        def read_ahead(files: dict[str, int]) -> None:
            _prefetch(storage, {name: (0, nbytes) for name, nbytes in files.items()})

        def read_on_rank_0(urls: list[str | None]) -> bytes | None:
            check_same_url(urls, verb="loads", consequence="nothing was loaded")
            # Loading everything alone, the data files are read ahead while the manifest's
            # entries are decoded; with keys=, once the selection is known.
            early = group.solo and keys is None
            read.append(read_manifest(storage, read_ahead if early else None))
            return None if group.solo else encode(read[0])  # JSON crosses faster than pickle

        def asked() -> str | None:
            nonlocal keys
            keys = checked_keys(keys)  # bad keys on one rank raise on every rank, here
            return named

        document = exchange(group, asked, read_on_rank_0, what=f"loading {url}",
                            consequence="nothing was loaded on any rank")
        manifest = read[0] if read else decode(document, url)
        selected = select(manifest.entries, keys)
        if group.solo and keys is not None:
            _prefetch(storage, _spans(manifest, selected))

        def prepare() -> None:
            if into is None:
                _check_selection(url, manifest, keys, selected, strict)
                # With keys=, what they select comes back whole, its empty containers
                # too (a fresh optimizer's `state: {}`); those outside are left out.
                keep = True if keys is None else selects(keys, selected)
                steps.append(_load_tree(storage, manifest, selected, allow_pickle, keep))
            else:
                steps.append(_load_into(storage, manifest, into, selected, keys, strict,
                                        allow_pickle, group, primed))

        try:
            exchange(group, prepare, lambda _: None, what=f"loading {url}",
                     consequence="nothing was loaded on any rank")
        except BaseException:
            unprime(primed)  # refused here or on another rank: nothing changes
            raise
        run, nbytes = steps[0]
        exchange(group, lambda: steps.append(run(progress)), lambda _: None,
                 what=f"loading {url}",
                 consequence="the state on the other ranks may be partly loaded: load again")
        result = steps[1]
    except BaseException as exc:
        _notify(on_event, ERROR, url, started, error=exc)
        raise
    seconds = time.perf_counter() - started
    logger.info("loaded %s: %d entries, %.1f MB in %.2f s (%.0f MB/s)", url, len(selected),
                nbytes / 1e6, seconds, nbytes / 1e6 / max(seconds, 1e-9))
    _notify(on_event, LOAD, url, started, nbytes)
    return result


#: About what a disk reads while a load plans: prefetching much more could evict its own first
#: bytes from the page cache before the load's reads reach them.
_PREFETCH_BYTES = 1 << 30


def _spans(manifest: Manifest, selected: list[StatePath]) -> dict[str, tuple[int, int]]:
    """Per data file, the byte span `(first, end)` holding the `selected` entries."""
    spans: dict[str, tuple[int, int]] = {}
    for path in selected:
        for chunk in manifest.entries[path].chunks:
            end = chunk.offset + chunk.nbytes
            first, last = spans.get(chunk.file, (chunk.offset, end))
            spans[chunk.file] = (min(first, chunk.offset), max(last, end))
    return spans


def _prefetch(storage: Storage, spans: dict[str, tuple[int, int]]) -> None:
    """Have `storage` start reading `spans` (data file -> `(first, end)`; the first
    `_PREFETCH_BYTES` of them) ahead of the load's own reads, when it can (a local file:
    `prefetch`), so that the disk works while the load decodes and plans; the reads then wait
    only for what is not cached yet."""
    prefetch = getattr(storage, "prefetch", None)
    if prefetch is None:
        return
    budget = _PREFETCH_BYTES
    wanted: dict[str, tuple[int, int]] = {}
    for name, (first, last) in spans.items():
        if budget <= 0:
            break
        last = min(last, first + budget)
        wanted[name] = (first, last)
        budget -= last - first
    prefetch(wanted)


def _notify(
    on_event: EventCallback | None, kind: str, url: str, started: float, nbytes: int = 0,
    error: BaseException | None = None,
) -> None:
    """Pass the event of a save or load to `on_event` (the operation logged its own line)."""
    if on_event is not None:
        seconds = time.perf_counter() - started
        described = None if error is None else f"{type(error).__name__}: {error}"
        emit(Event(kind, url, None, seconds, seconds, nbytes, described), [on_event], log=False)


def _check_selection(
    url: str, manifest: Manifest, keys: Sequence[str] | None, selected: list[StatePath],
    strict: bool, target_selected: Sequence[StatePath] = (),
) -> None:
    """Refuse a `keys=` selection that selects nothing in the checkpoint at `url`, or, under
    `strict`, one of whose keys selects nothing there nor among the paths of the target
    that it selects, `target_selected` (a typo: what it meant would be left as it was,
    silently); a lenient load logs such keys and loads what the others select. A key that
    selects only target paths is left to the match, which names them missing; one that
    selects only saved paths (a fresh optimizer's state, `optim/state/0/`) loads."""
    if keys is None:
        return
    if not keys:  # a filtered list that came out empty: it would load nothing
        top = sorted({p.split("/")[0] for p in manifest.entries})
        raise StateMismatch(
            f"keys=[] match nothing in {url}: an empty selection would load nothing, nothing "
            "was loaded; leave keys= out (None) to load everything, or name what to load "
            f"(its top-level keys are {top[:20]})",
            url=url,
        )
    unmatched = _unmatched(keys, selected) if selected else list(keys)
    if selected and unmatched and target_selected:
        unmatched = _unmatched(unmatched, target_selected)
    if not unmatched:
        return
    top = sorted({p.split("/")[0] for p in manifest.entries})
    if not selected or strict:
        raise StateMismatch(
            f"keys={unmatched} match nothing in {url}"
            + (f" (of keys={list(keys)}; nothing was loaded)" if selected else "")
            + f"; its top-level keys are {top[:20]}: fix the keys (prefixes like 'model/' or "
            "globs like 'model/*', as `sp.info` lists the paths)"
            + (", or pass strict=False to load what the others select" if selected else ""),
            url=url,
        )
    logger.warning("loading %s: keys=%s match nothing there, loading what the others select",
                   url, unmatched)


def _unmatched(keys: Sequence[str], selected: Sequence[StatePath]) -> list[str]:
    """Those of `keys` that select none of the `selected` paths (see `_tree.select`); a key
    that is one of them or of their ancestors is found without a pass over them."""
    named = {"", *selected}  # "" (or "/") selects everything
    for path in selected:
        while "/" in path:
            path = path.rpartition("/")[0]
            if path in named:
                break
            named.add(path)
    return [key for key in keys if key.rstrip("/") not in named and not select(selected, [key])]


def _check_pickles(
    url: str, manifest: Manifest, read: Sequence[StatePath], allow_pickle: bool
) -> None:
    """Refuse a load that would unpickle entries (among the paths it `read`s) without
    `allow_pickle`, before anything is read; a pickled entry it skips is never unpickled."""
    pickled = [p for p in read if manifest.entries[p].kind == PICKLE]
    if pickled and not allow_pickle:
        raise PickleNotAllowed(
            f"{url} holds pickled entries {pickled[:5]}: loading them runs code from the "
            "file; pass allow_pickle=True (--allow-pickle) only if you trust its author, or "
            "leave them out with keys= (--keys)",
            url=url,
            paths=pickled,
        )


#: The most elements of a target whose strides do not show it free of overlaps that are
#: compared one by one; a larger one counts as overlapping.
_OVERLAP_CHECKED = 1 << 22


def _self_overlapping(target: Any) -> bool:
    """Whether a tensor or writable ndarray target has elements that share memory (an
    `expand`ed view, an `as_strided` array), which no copy can fill."""
    layout = _strided(target)
    if layout is None or not (is_tensor(target) or target.flags.writeable):
        return False  # not memory of ours to fill: a read-only array is replaced
    _, shape, strides, itemsize = layout
    dims = sorted((abs(stride), n) for n, stride in zip(shape, strides, strict=True) if n > 1)
    reach = itemsize  # the bytes the dimensions of smaller strides span
    for stride, n in dims:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:
        return False  # each dimension steps past all the smaller ones span: no overlap
    if math.prod(shape) > _OVERLAP_CHECKED:
        return True
    starts, length = _runs(target)
    starts.sort()
    return bool((sys.modules["numpy"].diff(starts) < length).any())


def _open_paths(
    stateful: Mapping[StatePath, tuple[Any, Any]]
) -> tuple[list[StatePath], list[StatePath]]:
    """Where the stateful objects of a target take saved keys their `state_dict()` lacks (see
    `_tree.open_keys`), and which of those keys the saved subtree replaces whole
    (`_tree.replaces`)."""
    paths: list[StatePath] = []
    replacing: list[StatePath] = []
    for path, (obj, state_dict) in stateful.items():
        keys = open_keys(obj, state_dict)
        if keys is None:
            paths.append(path)
            continue
        named = [join(path, key) for key in keys]
        paths += named
        if replaces(obj):
            replacing += named
    return paths, replacing


def _replaced(
    manifest: Manifest, replacing: Sequence[StatePath], keys: Sequence[str] | None
) -> list[StatePath]:
    """The open keys among `replacing` whose saved subtree replaces the live one in this
    load: those the checkpoint has, and which the selection takes whole (a selection inside
    one, such as `optim/state/0/`, loads what it selects into the live state)."""
    if not replacing:
        return []
    selected = replacing if keys is None else select(replacing, keys)
    return list(nodes_at(manifest.tree, selected))


def _tensor_entry(
    entries: Mapping[StatePath, Entry], path: StatePath, shape: tuple[int, ...] | None = None,
    *, array: bool = False,
) -> Entry:
    """The entry `path` (of `entries`) loads as: a sharded entry (or a piece of one, of
    `shape`) as the plain tensor it loads into; an alias as the tensor it names, laid out with
    its strides, or, into an array target (`array`), as an array (as `Match.retyped` makes a
    tensor meeting one)."""
    entry = entries[path]
    if entry.kind == ALIAS:
        if array:
            return Entry(NDARRAY, entry.dtype, entry.shape)
        return Entry(TENSOR, entry.dtype, entry.shape, strides=entries[entry.value].strides)
    if entry.kind != SHARDED and shape is None:
        return entry
    return Entry(TENSOR, entry.dtype, shape if shape is not None else entry.shape)


def _values(
    manifest: Manifest, paths: Sequence[StatePath], dests: dict[StatePath, Destination],
    allow_pickle: bool, loaded: Mapping[StatePath, Entry],
    pieces: dict[StatePath, tuple[Any, Entry]] | None = None,
) -> dict[StatePath, Any]:
    """The loaded value of every path (with a destination, read as its entry in `loaded`
    says); a piece target (`pieces`: path -> (the Shard or DTensor, its local entry)) is
    filled and then stands for itself, as it does unfilled where this rank holds none of it
    (no destination)."""
    pieces = pieces or {}
    values = {}
    for path in paths:
        entry = manifest.entries[path]
        dest = dests.get(path)
        if dest is None:
            values[path] = pieces[path][0] if path in pieces else entry.value
        elif path in pieces:
            leaf, local = pieces[path]
            finish(local, dest, path, allow_pickle=allow_pickle)
            values[path] = leaf
        elif dest.target is None and entry.kind == TENSOR:
            values[path] = dest.holder  # read in place (the target itself) or a new tensor
        else:
            values[path] = finish(loaded[path], dest, path, allow_pickle=allow_pickle)
    return values


def _load_tree(
    storage: Storage, manifest: Manifest, selected: list[StatePath], allow_pickle: bool,
    keep_empty: KeepEmpty,
) -> tuple[Callable[[Progress | None], Any], int]:
    """Plan a load without a target; returns the step that reads and builds the tree, and
    the bytes it reads. An alias loaded with the tensor it aliases is that very tensor
    again, as saved."""
    _check_pickles(storage.url, manifest, selected, allow_pickle)
    moved = (renumbered(manifest.tree, set(selected))
             if len(selected) < len(manifest.entries) else None)
    if moved is not None:
        raise StateMismatch(
            f"the selection from {storage.url} leaves out items of a list or tuple before "
            f"{moved!r}, which would be renumbered (come back at another index): select every "
            "item of it (its prefix, such as 'optim/param_groups/'), or load into a state "
            "(into=), where each item keeps its place. Nothing was read",
            url=storage.url, mismatched=[moved],
        )
    entries = {
        path: _tensor_entry(manifest.entries, path)
        for path in selected if manifest.entries[path].kind != VALUE
    }
    check_makeable(entries, storage.url)
    aliased = {path: manifest.entries[path].value for path in entries
               if manifest.entries[path].kind == ALIAS}
    dests = {path: destination(entry, path) for path, entry in entries.items()
             if aliased.get(path) not in entries}
    shared = {path: dests[source] for path, source in aliased.items() if source in dests}

    nbytes = _read_size(dests)

    def run(progress: Progress | None) -> Any:
        _read(storage, manifest, dests, checked=_tally(progress, nbytes))
        values = _values(manifest, selected, dests | shared, allow_pickle, entries)
        return rebuild(manifest.tree, values, keep_empty=keep_empty)

    return run, nbytes


def _resolved(manifest: Manifest, aliased: Mapping[StatePath, StatePath]) -> Manifest:
    """`manifest` with each alias in `aliased` standing for the entry it aliases, so that
    reading the alias reads that entry's bytes."""
    entries = dict(manifest.entries)
    for path, source in aliased.items():
        entries[path] = manifest.entries[source]
    return replace(manifest, entries=entries)


def _same_memory(a: Destination, b: Destination) -> bool:
    """Whether two destinations are one tensor (the targets of tied weights)."""
    return hasattr(a.holder, "data_ptr") and hasattr(b.holder, "data_ptr") and same_tensor(
        a.holder, b.holder)


def _under(path: StatePath, prefixes: Sequence[StatePath]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _ranked(tree: Any, rank: int | None = None) -> list[StatePath]:
    """Paths of the per-rank values in a skeleton: of `rank`, or of every rank when None."""
    return [join(prefix, r) for prefix, ranks in per_rank_paths(tree).items() for r in ranks
            if rank is None or r == rank]


def _load_into(
    storage: Storage, manifest: Manifest, into: Any, selected: list[StatePath],
    keys: Sequence[str] | None, strict: bool, allow_pickle: bool, group: Group,
    primed: list[Any],
) -> tuple[Callable[[Progress | None], Any], int]:
    """Plan a load into `into` (matching it, so nothing changes on a mismatch); returns the
    step that reads and writes back, and the bytes it reads. The optimizers given state for
    the `selected` entries (`prime_optimizers`) are added to `primed`, for the caller to
    undo (`unprime`) if the load is refused (here or on another rank); the load undoes it
    for those whose state it skips."""
    target = flatten(into, rank=group.rank)
    primed += prime_optimizers(target.stateful, selected)
    return _plan_load_into(storage, manifest, into,
                           flatten(into, rank=group.rank) if primed else target,
                           selected, keys, strict, allow_pickle, group, primed)


def _not_dense(tensor: Any) -> str:
    """How a load's match names a target tensor that is not dense (sparse, nested, mkldnn):
    as a kind of its own, which no saved entry has, since no read can fill its memory in
    place."""
    layout = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
    return (f"{layout.strip('_')} tensor (only a dense one is restored in place: make it "
            "dense, or load without into= and convert)")


def _state_of_resized_parameters(
    target: Flat, described: Mapping[StatePath, tuple[str, str | None, Any]],
    entries: Mapping[StatePath, Entry], load: Sequence[StatePath], fresh: Sequence[StatePath],
) -> dict[StatePath, str]:
    """The saved optimizer state (of an optimizer in `target`, whose leaves `described`
    gives as the match saw them) that `load` would restore for a parameter whose saved shape
    or dtype differs from its own now (a resized head in a fine-tune, a model cast to
    bfloat16: a lenient load leaves the parameter as it is), or which was another
    parameter's (the parameters ordered otherwise): path -> why. Parameters are found among
    the target's dense tensors and DTensors (FSDP2's, compared by global shape) by their
    memory (`_memory`), so this knows of those whose module is in the target (loaded or
    not). It also compares the saved state tensors with what the optimizer makes for the
    parameter now: its live state, where a saved tensor among the `fresh` ones (replacing a
    live one that differs) has another shape than a live one shaped as its parameter; and,
    for a parameter without state (a fresh optimizer), the state a zero step would make
    (`state_shapes`). Only state tensors shaped as their parameter are compared (Adam's
    moments, not Adafactor's factored rows or a `step`). Without it, the first
    `optimizer.step()` would fail on the shapes, naming no path, or train on another
    parameter's moments."""
    torch = sys.modules.get("torch")
    optimizers = {path: obj for path, (obj, _) in target.stateful.items()
                  if torch is not None and isinstance(obj, torch.optim.Optimizer)}
    if not optimizers:
        return {}
    where = {_memory(leaf): path for path, leaf in target.leaves.items()
             if described[path][0] in (TENSOR, SHARDED) and is_tensor(leaf)}
    where.pop(None, None)  # tensors without memory: no parameter is found by theirs
    replacing = frozenset(fresh)
    resized: dict[str, str] = {}
    for path, optimizer in optimizers.items():
        state = f"{join(path, 'state')}/"
        saved: dict[str, list[StatePath]] = {}  # index -> its saved state tensors loaded
        for loaded in load:
            if loaded.startswith(state) and entries[loaded].shape is not None:
                saved.setdefault(loaded[len(state):].split("/", 1)[0], []).append(loaded)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stateless: list[int] = []
        for index, param in enumerate(params):
            if is_uninitialized(param):  # a lazy module's: its load gives it the saved shape
                continue
            prefix, shape = f"{state}{index}/", tuple(param.shape)
            found = where.get(_memory(param))
            entry = entries.get(found) if found is not None else None
            dtype = described[found][1] if found is not None else None
            if entry is not None and entry.shape is not None and (
                    entry.shape != shape or entry.dtype != dtype):
                resized[prefix] = (f"optimizer state of {found}, saved as {entry.dtype}"
                                   f"{list(entry.shape)}, which is {dtype}{list(shape)} now")
                continue
            tensors = saved.get(str(index), [])
            grown = [p for p in tensors if p in replacing and described[p][0] == TENSOR
                     and tuple(target.leaves[p].shape) == shape and entries[p].shape != shape]
            if grown:
                resized[prefix] = _resized_state(index, entries[grown[0]], shape)
            elif tensors and not optimizer.state.get(param):
                stateless.append(index)
        made = state_shapes(optimizer, stateless) if stateless else {}
        for index, shapes in made.items():
            prefix, shape = f"{state}{index}/", tuple(params[index].shape)
            other = [p for p in saved[str(index)]
                     if shapes.get(p[len(prefix):]) == shape and entries[p].shape != shape]
            if other:
                resized[prefix] = _resized_state(index, entries[other[0]], shape)
    return {path: why for path in load for prefix, why in resized.items()
            if path.startswith(prefix)}


def _resized_state(index: int, saved: Entry, shape: tuple[int, ...]) -> str:
    """Why `_state_of_resized_parameters` refuses the saved state of parameter `index`, one
    of whose tensors, shaped as its parameter was, is `saved`."""
    return (f"optimizer state of parameter {index}, saved as {list(saved.shape or ())}, which "
            f"is {list(shape)} now (a resized parameter, or parameters given to the optimizer "
            "in another order than at the save)")


def _memory(tensor: Any) -> tuple[int, tuple[int, ...], Any] | None:
    """How `_state_of_resized_parameters` finds a parameter among the target's tensors: its
    memory, (global) shape and dtype; None for a tensor without memory. A DTensor (FSDP2's
    parameters) is found by its local piece, whose storage an empty piece has too: FSDP2
    gives each parameter its own, so a rank holding no rows finds it as the others do."""
    if is_dtensor(tensor):
        local = tensor.to_local()
        address = local.data_ptr() or local.untyped_storage().data_ptr()
    else:
        address = tensor.data_ptr() if tensor.numel() else 0
    return (address, tuple(tensor.shape), tensor.dtype) if address else None


def _plan_load_into(
    storage: Storage, manifest: Manifest, into: Any, target: Flat, selected: list[StatePath],
    keys: Sequence[str] | None, strict: bool, allow_pickle: bool, group: Group,
    primed: Sequence[Primed],
) -> tuple[Callable[[Progress | None], Any], int]:
    """`_load_into` once `target`, the flattened `into`, is final (its optimizers `primed`
    for it)."""
    saved_ranked = _ranked(manifest.tree)
    target_ranked = _ranked(target.skeleton)
    target_selected = select(target.leaves, keys)
    _check_selection(storage.url, manifest, keys, selected, strict, target_selected)
    per_rank: list[StatePath] = []
    if saved_ranked:
        mine = _ranked(manifest.tree, group.rank)
        selected = [p for p in selected if not _under(p, saved_ranked) or _under(p, mine)]
        per_rank += [p for p in selected if _under(p, saved_ranked)]
    if target_ranked:
        per_rank += [p for p in target_selected if _under(p, target_ranked)]
    per_rank = list(dict.fromkeys(per_rank))  # a path per-rank in both, named once
    if per_rank and manifest.world_size != group.size:
        raise StateMismatch(
            f"{storage.url} was saved by {manifest.world_size} rank(s) and is restored on "
            f"{group.size}: its per-rank values ({per_rank[:3]}) belong to ranks that do not "
            "match; leave them out with keys= (select everything else)",
            url=storage.url, mismatched=per_rank,
        )
    described: dict[StatePath, tuple[str, str | None, tuple[int, ...] | None]] = {}
    strided = getattr(sys.modules.get("torch"), "strided", None)
    for path, kind in target.kinds.items():
        leaf = target.leaves[path]
        if kind == SHARDED:
            local, _, shape = piece_of(leaf, path)
            described[path] = (kind, describe(local, TENSOR)[1], shape)
        elif kind == TENSOR and (leaf.layout is not strided or leaf.is_nested):
            described[path] = (_not_dense(leaf), None, None)  # matches no saved entry
        else:
            described[path] = describe(leaf, kind)
    open_paths, replacing = _open_paths(target.stateful)
    replaced = _replaced(manifest, replacing, keys)
    match = match_target(manifest.entries, selected, described, target_selected, open_paths,
                         optional_paths(target.stateful), replaced,
                         parameter_groups(target.stateful))
    if match.retyped:  # read as the target's kind (an array as a tensor, ...), in place
        manifest = replace(manifest, entries={**manifest.entries, **match.retyped})
    stale = _state_of_resized_parameters(target, described, manifest.entries, match.load,
                                         match.fresh)
    if match.kept:
        logger.info("restoring %s: the checkpoint lacks %s; the target keeps its own values "
                    "there (settings added since the save, by a newer torch or class)",
                    storage.url, match.kept)
    if stale:
        match.load = [path for path in match.load if path not in stale]
        match.mismatched += [f"{path}: {why}" for path, why in stale.items()]
    if not match.ok:
        lines = (
            [f"missing from the checkpoint: {p or '<root>'}" for p in match.missing]
            + [f"not in the target: {p or '<root>'}" for p in match.unexpected]
            + [f"differs: {m}" for m in match.mismatched]
        )
        summary = "; ".join(lines[:5]) + (f" (and {len(lines) - 5} more)" if len(lines) > 5 else "")
        summary += "." + wrapper_hint(match.missing, manifest.entries)
        if strict:
            raise StateMismatch(
                f"{storage.url} does not match the state to restore: {summary} Nothing was "
                "changed; pass strict=False to load what matches, or keys= to select a subset",
                url=storage.url, missing=match.missing, unexpected=match.unexpected,
                mismatched=match.mismatched,
            )
        logger.warning("loading %s leniently, skipping: %s", storage.url, summary)
    _check_pickles(storage.url, manifest, match.load, allow_pickle)
    boxes: dict[StatePath, Box] = {}
    pieces: dict[StatePath, tuple[Any, Entry]] = {}
    paths: list[StatePath] = []
    entries: list[Entry] = []
    leaves: list[Any] = []
    aliased: dict[StatePath, StatePath] = {}
    fresh = frozenset(match.fresh)
    for path in match.load:
        entry = manifest.entries[path]
        if entry.kind == VALUE:
            continue
        leaf = target.leaves.get(path) if path not in fresh else None
        wanted = target.kinds.get(path)
        if wanted == SHARDED:
            local, offsets, _ = piece_of(leaf, path)
            pieces[path] = (leaf, _tensor_entry(manifest.entries, path, tuple(local.shape)))
            if offsets is None:  # a rank outside a 0-dim DTensor's mesh: nothing to read
                continue
            boxes[path] = (offsets, tuple(local.shape))
            entries.append(pieces[path][1])
            leaves.append(local)
        else:
            entries.append(_tensor_entry(manifest.entries, path,
                                         array=wanted == NDARRAY and leaf is not None))
            leaves.append(leaf)
        paths.append(path)
        if entry.kind == ALIAS:
            aliased[path] = entry.value
    held_at: tuple[list[int], list[int], list[int]] = ([], [], [])
    dests = dict(zip(paths, destinations(entries, paths, leaves, held_at=held_at), strict=True))
    meta = [path for path, dest in dests.items()
            if dest.target is not None and is_tensor(dest.target) and _memoryless(dest.target)]
    if meta:
        raise StateMismatch(
            f"{storage.url} cannot be restored into tensors on the meta device or fake "
            f"tensors (FakeTensorMode), which have no memory to fill ({meta[:3]}"
            f"{' and more' if len(meta) > 3 else ''}): materialize them first "
            "(module.to_empty(device='cpu'), or build the module outside FakeTensorMode), or "
            "load without `into` and call module.load_state_dict(tree[...], assign=True). "
            "Nothing was changed",
            url=storage.url, mismatched=meta,
        )
    shared = [path for path, dest in dests.items()
              if dest.target is not None and _self_overlapping(dest.target)]
    if shared:
        raise StateMismatch(
            f"{storage.url} cannot be restored into tensors or arrays whose elements share "
            f"memory (expanded or overlapping as_strided views: {shared[:3]}"
            f"{' and more' if len(shared) > 3 else ''}): give them memory of their own "
            "(tensor.contiguous() or .clone(), array.copy()) in the state to restore. Nothing "
            "was changed",
            url=storage.url, mismatched=shared,
        )
    # An alias whose target is the memory its aliased entry loads into (tied weights in the
    # target too) needs no bytes of its own.
    filled = {path for path, source in aliased.items()
              if source in dests and _same_memory(dests[path], dests[source])}
    pickled = ([path for path in match.load if target.kinds.get(path) == PICKLE]
               if PICKLE in target.kinds.values() else [])
    reading = {p: d for p, d in dests.items() if p not in filled} if filled else dests
    twins = _twins(storage.url, manifest, paths, held_at, reading, aliased, boxes)
    if twins:
        reading = {p: d for p, d in reading.items() if p not in twins}
    nbytes = _read_size(reading)

    def run(progress: Progress | None) -> Any:
        _read(storage, manifest, reading, boxes, _tally(progress, nbytes))
        dests.update(reading)  # a load onto a device replaces its destinations
        values = _values(manifest, match.load, dests, allow_pickle,
                         dict(zip(paths, entries, strict=True)), pieces)
        for path in pickled:  # an sp.Pickled leaf stays one, so the state saves again
            values[path] = Pickled(values[path])
        restored = write_back(into, target, manifest.tree, values, storage.url, replaced)
        unprime(primed, match.load)  # a parameter whose state was skipped gets none
        return restored

    return run, nbytes


def _twins(
    url: str, manifest: Manifest, paths: Sequence[StatePath],
    held_at: tuple[list[int], list[int], list[int]],
    reading: Mapping[StatePath, Destination], aliased: Mapping[StatePath, StatePath],
    boxes: Mapping[StatePath, Box],
) -> set[StatePath]:
    """Of the entries to read whose targets share memory, those that need no read of their
    own: an entry whose target is another's (the same memory and layout, and box of a global
    tensor) and whose saved bytes are the same by their checksums (tied weights in a
    checkpoint that stores them apart, such as one written before aliases). Any other
    sharing is refused before anything is read (tied weights in a model saved untied, views
    of one tensor): one entry's bytes would overwrite the other's, and a checksum would
    report an intact checkpoint corrupt, or the last copy would win silently. The memory
    checked is that of the contiguous CPU tensors (`destinations`' `held_at`: index in
    `paths`, address, size) and the span of every other CPU tensor or array target; targets
    whose spans meet are compared element by element (views that interleave, such as a
    weight's column blocks, share nothing).

    Raises:
        StateMismatch: naming both paths. Nothing was changed.
    """
    indices, addresses, sizes = held_at
    candidates = [paths[i] for i in indices]
    if len(reading) != len(candidates):
        held = set(candidates)
        for path, dest in reading.items():
            value = _filled(dest)
            span = _span(value) if path not in held else None
            if span is not None:
                candidates.append(path)
                addresses.append(span[0])
                sizes.append(span[1])
    met = [k for k in meeting(addresses, sizes) if candidates[k] in reading]
    if not met:
        return set()
    alike: dict[tuple[Any, ...], list[StatePath]] = {}
    for k in met:
        dest = reading[candidates[k]]
        value = _filled(dest)
        alike.setdefault(_layout(value), []).append(candidates[k])
    twins = set()
    for same in alike.values():
        for b in same[1:]:
            a = same[0]
            if boxes.get(a) != boxes.get(b) or not _same_bytes(
                    manifest.entries[aliased.get(a, a)], manifest.entries[aliased.get(b, b)]):
                raise _shared(url, a, b, "with different values, and the state to restore has "
                              "them in one memory (tied weights), which cannot hold both: "
                              "untie them in the target (give each a tensor of its own, as the "
                              "saved model had)")
            if reading[b].target is None:  # else read into a holder of its own, copied alike
                twins.add(b)
    clash = _first_shared([_runs(_filled(reading[same[0]])) for same in alike.values()]) if len(
        alike) > 1 else None
    if clash is not None:
        a, b = (list(alike.values())[k][0] for k in clash)
        raise _shared(url, a, b, "and in the state to restore they share part of their memory "
                      "(views of one tensor), so reading one would overwrite part of the "
                      "other: give each a tensor of its own in the target")
    return twins


def _shared(url: str, a: StatePath, b: StatePath, why: str) -> StateMismatch:
    return StateMismatch(f"{url} stores {a!r} and {b!r} apart, {why}, or load one of them "
                         "with keys=. Nothing was changed", url=url, mismatched=[a, b])


def _span(value: Any) -> tuple[int, int] | None:
    """(address, bytes) of the memory from a non-empty CPU tensor's or ndarray's lowest
    element to the end of its highest; None for anything else (a target on an accelerator,
    bytes)."""
    layout = _strided(value)
    if layout is None:
        return None
    address, shape, strides, itemsize = layout
    reach = [(n - 1) * stride for n, stride in zip(shape, strides, strict=True)]
    low = sum(r for r in reach if r < 0)
    return address + low, sum(r for r in reach if r > 0) - low + itemsize


def _memoryless(tensor: Any) -> bool:
    """Whether a target tensor has no memory to fill: on the meta device, or a FakeTensor (a
    model built under FakeTensorMode, which reports a real device). Fake tensors exist only
    once torch's fake-tensor module is imported, so it is looked up, never imported."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return bool(tensor.is_meta or (fake is not None and fake.is_fake(tensor)))


def _strided(value: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int] | None:
    """(address of the first element, shape, strides in bytes, itemsize) of a non-empty CPU
    tensor or ndarray; None for anything else (a tensor subclass at address 0, which keeps
    its elements in other tensors)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray) and value.size:
        return (value.__array_interface__["data"][0], value.shape, value.strides,
                value.itemsize)
    if is_tensor(value) and value.is_cpu and value.numel() and value.data_ptr():
        itemsize = value.element_size()
        return (value.data_ptr(), tuple(value.shape),
                tuple(stride * itemsize for stride in value.stride()), itemsize)
    return None


def _layout(value: Any) -> tuple[Any, ...]:
    """What makes two targets one, a tensor or an ndarray alike: the memory their elements
    fill, element by element (the strides of dimensions of size 1 address nothing), and
    what is done to the bytes on the way in (a tensor's conjugate and negative bits, an
    array's byte order)."""
    address, shape, strides, itemsize = _strided(value) or (0, (), (), 0)
    strides = tuple(stride if n != 1 else 0 for n, stride in zip(shape, strides, strict=True))
    flags = ((value.is_conj(), value.is_neg()) if is_tensor(value)
             else (False, value.dtype.byteorder == ">"))  # a big-endian array is byte-swapped
    return address, shape, strides, itemsize, *flags


def _filled(dest: Destination) -> Any:
    """The tensor or array whose memory a load fills: the target itself, or its holder."""
    return dest.holder if dest.target is None else dest.target


def _runs(value: Any) -> tuple[Any, int]:
    """The start addresses of the contiguous runs of bytes a CPU tensor's or ndarray's
    elements fill, and the runs' length."""
    np = sys.modules["numpy"]
    address, shape, strides, length = _strided(value) or (0, (), (), 0)
    dims = [(n, stride) for n, stride in zip(shape, strides, strict=True) if n != 1]
    while dims and dims[-1][1] == length:
        length *= dims.pop()[0]
    starts = np.array([address], dtype=np.int64)
    for n, stride in dims:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    return starts, length


def _first_shared(targets: list[tuple[Any, int]]) -> tuple[int, int] | None:
    """Two of `targets` (`_runs` of each, none sharing a byte with itself) that share a
    byte, by their indices, or None: the owners of the two runs that start first among
    those that meet another (the second starts inside the first)."""
    np = sys.modules["numpy"]
    starts = np.concatenate([runs for runs, _ in targets])
    lengths = np.concatenate([np.full(len(runs), length, dtype=np.int64)
                              for runs, length in targets])
    met = sorted(meeting(starts, lengths), key=lambda run: (starts[run], run))
    if not met:
        return None
    owners = np.concatenate([np.full(len(runs), k) for k, (runs, _) in enumerate(targets)])
    return int(owners[met[0]]), int(owners[met[1]])


def _same_bytes(a: Entry, b: Entry) -> bool:
    """Whether two saved entries are the same value: dtype, shape (a global tensor's, for
    pieces of one) and bytes, by their chunks' sizes and checksums, and where pieces lie (a
    tensor cut by rows and its transpose cut by columns have chunks of the same bytes)."""
    return (a.dtype, a.shape) == (b.dtype, b.shape) and [
        (c.nbytes, c.digests, c.box) for c in a.chunks
    ] == [(c.nbytes, c.digests, c.box) for c in b.chunks]


def info(url: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """Describe the checkpoint at `url` from its manifest, without reading data.

    Raises:
        CheckpointNotFound: nothing committed at `url`.
        CorruptCheckpoint: the manifest is damaged.
        FormatVersionError: written by a newer format.
    """
    storage = open_storage(url, storage_options)
    try:
        return info_of(url, read_manifest(storage))
    finally:
        storage.close()


@_gc_paused()
def verify(
    url: str, *, storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Read every byte of the checkpoint at `url` and check it against its checksums.

    Problems are reported, not raised: `report.ok` is False and `report.problems` lists them.

    Args:
        url: the checkpoint.
        storage_options: options for its storage backend.
        progress: called with (bytes checked so far, bytes of data in all) as the check
            advances, from the reading threads one call at a time (a progress bar for a large
            remote checkpoint).

    Raises:
        CheckpointNotFound: nothing committed at `url`, or the checkpoint was removed or
            replaced while it was read (a writer's retention or overwrite, not damage).
        FormatVersionError: written by a newer format (upgrade safepoint to verify it).
    """
    started = time.perf_counter()
    storage = open_storage(url, storage_options)
    try:
        try:
            manifest = read_manifest(storage)
        except CorruptCheckpoint as exc:
            return VerifyReport(url, False, exc.problems, 0, time.perf_counter() - started)
        problems = []
        present: dict[str, int] = {}  # data file -> the bytes it holds, up to what it should
        for name, nbytes in manifest.files.items():
            try:
                actual = storage.size(name)
            except FileNotFoundError:
                problems.append(f"{name}: data file is missing")
                present[name] = 0
                continue
            except CorruptCheckpoint as exc:  # not a regular file
                problems += exc.problems
                present[name] = 0
                continue
            present[name] = min(actual, nbytes)
            if actual > nbytes:
                problems.append(f"{name}: {actual} bytes, the manifest records {nbytes}")
            elif actual < nbytes:
                problems.append(f"{name}: truncated to {actual} bytes of the {nbytes} the "
                                "manifest records (the entries past its end are not checked)")
        # Bytes land in one scratch buffer per reading thread and are dropped once checked.
        # Locally, reads as long as a save's buffers keep that memory small (4 x 32 MiB of
        # fresh memory took longer to fault in than W2's 450 MB took to read and check); an
        # object store (a `read_bytes` attribute) keeps the longer reads its requests want.
        local = getattr(storage, "read_bytes", None) is None
        options = replace(_OPTIONS, max_read_bytes=_OPTIONS.buffer_bytes) if local else _OPTIONS
        reads = plan_reads(
            ((path, chunk) for path, entry in manifest.entries.items() for chunk in entry.chunks
             if chunk.offset + chunk.nbytes <= present[chunk.file]),
            block_bytes=manifest.block_bytes, max_read_bytes=options.max_read_bytes,
            max_gap=options.max_gap,
        )
        tally = None
        if progress is not None:
            tally = _Tally(progress, sum(entry.nbytes for entry in manifest.entries.values()))
        try:
            checksum = checksum_function(manifest.checksum)
        except CorruptCheckpoint as exc:
            problems += exc.problems or [str(exc)]
        else:
            problems += read_segments(
                storage, reads, scratch_dest(options), block_bytes=manifest.block_bytes,
                checksum=checksum, options=options, checked=tally,
            )
        if problems:
            error = _corrupt(storage, manifest, problems, "verify")
            if isinstance(error, CheckpointNotFound):  # not damage: a writer replaced it
                raise error
    finally:
        storage.close()
    problems = list(dict.fromkeys(problems))
    return VerifyReport(url, not problems, problems, manifest.nbytes, time.perf_counter() - started)
