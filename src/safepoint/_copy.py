"""Copy committed checkpoints between any two URLs, verifying every block on the way (API
layer): `sp.copy`, behind `safepoint cp` and the uploads of a two-tier `CheckpointManager`.

A copy follows the commit rule of a save: every data file is read, checked against the
manifest's checksums and written at the destination first; the manifest is published last.
A copy that fails (corrupt source, storage error) publishes nothing, removes the data files it
wrote, and leaves whatever was committed at the destination as it was.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from ._api import _publish
from ._checksum import checksum_function
from ._commit import (
    discard_unless_committed,
    document_at,
    manifest_at,
    read_manifest,
    refuse_a_parent,
)
from ._format import MANIFEST, Manifest
from ._leaves import flag
from ._names import parse_step
from .errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    SafepointError,
    StorageError,
)
from .storage import Storage, open_storage

__all__ = [
    "READ_AHEAD",
    "CopyReport",
    "copy",
    "copy_checkpoint",
    "copy_files",
    "linked_checkpoints",
    "verified_pieces",
]

logger = logging.getLogger(__name__)

#: Called as bytes arrive: (bytes copied so far, bytes to copy in all).
Progress = Callable[[int, int], None]

#: Bytes per ranged read of a source data file (cut at checksum-block boundaries).
_PIECE_BYTES = 16 << 20
#: Ranged reads in flight per file.
READ_AHEAD = 4


@dataclass(frozen=True, slots=True)
class CopyReport:
    """What `sp.copy` did.

    Attributes:
        src: the source URL.
        dst: the destination URL.
        copied: the checkpoints copied, as paths relative to `src` ("" when `src` is one
            checkpoint).
        skipped: those already at the destination (same save id), left as they were.
        nbytes: data bytes copied.
        seconds: how long the copy took.
        vanished: those of a root removed from the source after it was listed (its writer's
            retention, while a running job's root is copied) or replaced there (saved
            again): what was listed is no longer committed there, so not copied; nothing of
            them is left at the destination.
    """

    src: str
    dst: str
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    vanished: list[str] = field(default_factory=list)


def _join(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}" if name else url


def _checkpoints(storage: Storage) -> tuple[list[str], set[str]]:
    """Every committed checkpoint under `storage`'s URL, as relative paths, in name order,
    with the links to checkpoints directly under it (on a local disk: Lightning's
    `last.ckpt`), which are copied as the checkpoints they lead to, replacing what the last
    copy of a link left (it moves): an object store has no links, and a run resumed from the
    copy finds its last checkpoint. A link named as a manager's step (`step-9 -> step-1`) is
    no step of the manager and is not copied as one. Returns the names and those of links.

    Raises:
        CorruptCheckpoint: a name (an object store's key) has a `..`, `.` or empty part.
    """
    try:
        files = storage.list("")
    except FileNotFoundError:
        files = []
    suffix = f"/{MANIFEST}"
    links = set(linked_checkpoints(storage))
    names = [path[: -len(suffix)] for path in files if path.endswith(suffix)]
    for name in names:
        if {"", ".", ".."} & set(name.split("/")):
            # Refused, not skipped: a copy that left a checkpoint of the root out would report
            # success, and a backup would lack it unnoticed.
            raise CorruptCheckpoint(
                f"{storage.url.rstrip('/')} holds a checkpoint named {name!r} (an object "
                f"store's key {name}/{MANIFEST}): its '..', '.' or empty parts lead outside "
                "the root, so a copy of it would write outside its destination; nothing was "
                "copied: remove or rename those objects, or copy the other checkpoints one "
                "by one", url=storage.url,
            )
    return sorted(names + list(links)), links


def linked_checkpoints(storage: Storage) -> dict[str, str]:
    """The links directly under a local root that lead to a checkpoint (name -> where they
    point), but for those named like a manager's step (`step-9 -> step-1`), which are no
    step of the manager; none for other backends."""
    found: dict[str, str] = getattr(storage, "linked_checkpoints", dict)()
    return {name: to for name, to in found.items() if parse_step(name) is None}


def copy(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> CopyReport:
    """Copy the checkpoint at `src` to `dst`, or, when `src` is a root holding checkpoints
    (a `CheckpointManager` root, a directory of saves), every checkpoint under it to the same
    relative path under `dst`. Works between any two URLs (local, s3://, gs://, memory://...).

    Every byte read is checked against the manifest's checksums before it is written; each
    checkpoint's manifest is published at the destination after all its data is written. A
    checkpoint already at the destination with the same save id is skipped, so running a copy
    again finishes an interrupted one. A checkpoint of a root that is removed from the source
    while the copy runs (a running job's retention), or replaced there (a step saved again
    after a rollback), is left out, with a warning: what was listed is no longer committed
    there, and the data of it copied so far is removed.

    Args:
        src: a checkpoint, or a root holding checkpoints.
        dst: where the copy goes.
        overwrite: replace a different committed checkpoint at the destination.
        storage_options: options for the source's storage backend (and the destination's
            when `dst_storage_options` is None).
        dst_storage_options: options for the destination's storage backend.
        progress: called with (bytes copied, bytes in all) as the copy advances.

    Returns:
        what was copied and skipped.

    Raises:
        CheckpointNotFound: nothing committed at or under `src`, or the checkpoint at
            `src` was removed or replaced (saved again) while it was copied.
        CheckpointExists: a different checkpoint is committed at a destination and
            `overwrite` is False (checked for all of them before anything is written).
        CorruptCheckpoint: a source block does not match its checksum, or a data file is
            missing under a manifest that is still there (nothing of that checkpoint is
            published); or a checkpoint's name under a root has a `..`, `.` or empty part
            (an object store's key), which would lead outside `dst` (nothing is copied).
        FormatVersionError: a source checkpoint was written by a newer format.
        StorageError: a storage failed.
    """
    overwrite = flag("overwrite", overwrite, dst)
    started = time.perf_counter()
    if dst_storage_options is None:
        dst_storage_options = storage_options
    source = open_storage(src, storage_options)
    links: set[str] = set()
    try:
        if source.exists(MANIFEST):
            names = [""]
        else:
            names, links = _checkpoints(source)
            if not names:
                read_manifest(source)  # raises CheckpointNotFound with its hints
    finally:
        source.close()
    skipped = _through_links(src, dst, names, storage_options, dst_storage_options)
    vanished: list[str] = []
    plans = []
    for name in names:
        if name not in links and name not in skipped:
            try:
                plans.append(_plan(src, dst, name, overwrite, (), storage_options,
                                   dst_storage_options))
            except CheckpointNotFound:
                if not name:  # the one checkpoint asked for
                    raise
                _vanished(src, name, vanished)
    if links:
        # A link's earlier copy (a save the source or the destination holds under another
        # name) is replaced by what the link leads to now; any other checkpoint there is not.
        known = {manifest.save_id for _, manifest, _, _, _, _ in plans}
        present = _save_ids(dst, dst_storage_options)
        plans += [_plan(src, dst, name, overwrite,
                        known | {there for other, there in present.items() if other != name},
                        storage_options, dst_storage_options)
                  for name in sorted(links - set(skipped))]
        plans.sort(key=lambda plan: plan[0])
    total = sum(manifest.nbytes for _, manifest, _, skip, _, _ in plans if not skip)
    copied: list[str] = []
    done = 0

    def advanced(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    for name, manifest, document, skip, held, replaces in plans:
        if skip:
            skipped.append(name)
            continue
        before = done
        try:
            copy_checkpoint(_join(src, name), _join(dst, name), (manifest, document), held,
                            overwrite=replaces, storage_options=storage_options,
                            dst_storage_options=dst_storage_options, advanced=advanced)
        except _CopiedMeanwhile:
            logger.info("%s was copied to %s meanwhile by another process", _join(src, name),
                        _join(dst, name))
            skipped.append(name)
            done = before + manifest.nbytes
            continue
        except CorruptCheckpoint as exc:
            now = _save_id_now(_join(src, name), storage_options, manifest.save_id)
            if now == manifest.save_id:
                raise
            if not name:
                what = ("removed while it was copied (its writer's retention, or a delete): "
                        "nothing was published at the destination; copy another checkpoint"
                        if now is None else
                        "replaced while it was copied (saved again with overwrite; no "
                        "damage): nothing was published at the destination; copy it again")
                raise CheckpointNotFound(f"{src} was {what}", url=src) from exc
            _vanished(src, name, vanished, replaced=now is not None)
            done, total = before, total - manifest.nbytes  # copy_files removed its data
            continue
        copied.append(name)
    seconds = time.perf_counter() - started
    logger.info("copied %s to %s: %d checkpoint(s), %d skipped, %d vanished, %.1f MB in "
                "%.2f s", src, dst, len(copied), len(skipped), len(vanished), done / 1e6,
                seconds)
    return CopyReport(src, dst, copied, sorted(skipped), done, seconds, vanished)


class _CopiedMeanwhile(Exception):
    """`copy_checkpoint` found the checkpoint it was copying committed at the destination by
    another process's copy of it: nothing is left to do."""


def _save_id_now(url: str, storage_options: dict[str, Any] | None, copied: str) -> str | None:
    """The save id of the checkpoint committed at `url` now: None when none is (a writer's
    retention removes a checkpoint's manifest first), `copied` (the save being copied) when
    its manifest cannot be read. Another one tells a source that a writer replaced while it
    was copied (`overwrite`, a manager's step saved again) from a damaged one."""
    try:
        return manifest_at(url, storage_options).save_id
    except CheckpointNotFound:
        return None
    except SafepointError:
        return copied


def _vanished(src: str, name: str, vanished: list[str], *, replaced: bool = False) -> None:
    """Leave out checkpoint `name` of root `src`, removed (or `replaced`: saved again) since
    the root was listed, adding it to `vanished` with a warning."""
    if replaced:
        logger.warning("%s was replaced while %s was copied (saved again): the save that was "
                       "listed is no longer committed there, so it is not copied; copy again "
                       "for the new one", _join(src, name), src)
    else:
        logger.warning("%s was removed while %s was copied (its writer's retention): it is "
                       "no longer committed there, so it is not copied", _join(src, name), src)
    vanished.append(name)


def _through_links(
    src: str, dst: str, names: Sequence[str], storage_options: dict[str, Any] | None,
    dst_storage_options: dict[str, Any] | None,
) -> list[str]:
    """The names whose destination lies through a symbolic link (a local destination that is
    a link, a link under it, a linked directory on the way) and holds the save being copied
    already: nothing to write there. Any other such name is refused before anything is
    written, since writing through a link replaces what it leads to, which the copy never
    named.

    Raises:
        CheckpointExists: naming the link.
    """
    target = open_storage(dst, dst_storage_options)
    try:
        on_the_way = getattr(target, "link_on_the_way", None)
        through = {name: link for name in names
                   if (link := on_the_way(name) if on_the_way else None) is not None}
    finally:
        target.close()
    same = []
    for name, link in through.items():
        try:
            there: str | None = manifest_at(_join(dst, name), dst_storage_options).save_id
        except (CheckpointNotFound, CorruptCheckpoint):
            there = None
        if there != manifest_at(_join(src, name), storage_options).save_id:
            raise CheckpointExists(
                f"{_join(dst, name)} lies through the link {link}: a copy never writes through "
                "one (it would replace what the link leads to); remove the link, or copy "
                "elsewhere", url=_join(dst, name),
            )
        same.append(name)
    return same


def _save_ids(url: str, storage_options: dict[str, Any] | None) -> dict[str, str]:
    """The save id of each checkpoint under `url` whose manifest can be read, by name."""
    storage = open_storage(url, storage_options)
    try:
        names, _ = _checkpoints(storage)
    finally:
        storage.close()
    found = {}
    for name in names:
        try:
            found[name] = manifest_at(_join(url, name), storage_options).save_id
        except SafepointError:
            continue
    return found


def _plan(
    src: str, dst: str, name: str, overwrite: bool, replaceable: Collection[str],
    storage_options: dict[str, Any] | None, dst_storage_options: dict[str, Any] | None,
) -> tuple[str, Manifest, bytes, bool, dict[str, int], bool]:
    """(name, source manifest and its bytes, whether the destination already holds it, the
    data files of the checkpoint committed there, and whether a manifest there is replaced).
    A different checkpoint there is replaced with `overwrite`, or when its save id is
    `replaceable`; a damaged one only with `overwrite`."""
    manifest, document = document_at(_join(src, name), storage_options)
    damaged = False
    try:
        existing: Manifest | None = manifest_at(_join(dst, name), dst_storage_options)
    except CheckpointNotFound:
        existing = None
    except CorruptCheckpoint:
        if not overwrite:
            raise
        existing, damaged = None, True
    if existing is None and not damaged:
        target = open_storage(_join(dst, name), dst_storage_options)
        try:
            refuse_a_parent(target)
        finally:
            target.close()
    held = dict(existing.files) if existing is not None else {}
    there = existing.save_id if existing is not None else None
    if there == manifest.save_id:
        return name, manifest, document, True, held, True
    if there is not None and not overwrite and there not in replaceable:
        raise CheckpointExists(
            f"{_join(dst, name)} already holds another committed checkpoint (save id "
            f"{there}): pass overwrite=True (`safepoint cp --overwrite`) to replace "
            "it, or copy elsewhere",
            url=_join(dst, name),
        )
    return name, manifest, document, False, held, there is not None or damaged


def copy_checkpoint(
    src: str, dst: str, document: tuple[Manifest, bytes], held: dict[str, int], *,
    overwrite: bool, storage_options: dict[str, Any] | None,
    dst_storage_options: dict[str, Any] | None,
    advanced: Callable[[int], None] | None = None,
    before_publish: Callable[[], None] | None = None,
) -> int:
    """Copy the checkpoint at `src`, whose manifest `document_at` read, to `dst`, where the
    committed checkpoint holds the data files `held` (name -> size; see `copy_files`), and
    publish the manifest's bytes there as they are (a newer writer's fields that this reader
    ignores included). `before_publish` is called once the data is durable, just before the
    publish (a writer re-checking its lease): what it raises abandons the copy, removing the
    data it wrote. Once published, what the manifest does not reference there is removed; a
    failure to remove it is logged, not raised: the copy is committed. Returns the bytes
    copied."""
    manifest, raw = document
    source = open_storage(src, storage_options)
    target = open_storage(dst, dst_storage_options)
    try:
        try:
            nbytes = copy_files(source, target, manifest, sorted(manifest.files), held,
                                advanced)
        except StorageError:
            # Another copy of this save to the same place (an overlapping backup run) that
            # committed first removes this one's files in progress as its leftovers.
            if _save_id_now(dst, dst_storage_options, "") == manifest.save_id:
                raise _CopiedMeanwhile from None
            raise
        try:
            if before_publish is not None:
                before_publish()
            _publish(target, manifest, raw, overwrite=overwrite, background=False)
        except BaseException:
            discard_unless_committed(target, manifest.save_id, list(manifest.files))
            raise
    finally:
        source.close()
        target.close()
    return nbytes


def copy_files(
    source: Storage, target: Storage, manifest: Manifest, names: Sequence[str],
    held: Mapping[str, int], advanced: Callable[[int], None] | None = None,
) -> int:
    """Copy data files `names` of the checkpoint `manifest` describes from `source` to
    `target`, every block checked against the manifest's checksums before it is written, each
    file durable when this returns; publish nothing. Returns the bytes copied.

    A file that the checkpoint committed at `target` holds already (`held`: its data files,
    name -> size, which the caller read), of the same size, is left as it is: data file
    names are unique per save (incremental steps share files, and a re-saved step's copy
    meets its own), so a failed copy never damages what is committed there.

    Raises:
        CorruptCheckpoint: a source block does not match its checksum, or a file's size
            differs from the manifest's (the files this call wrote are removed).
        StorageError: a storage failed (likewise).
    """
    written: list[str] = []
    there = [name for name in names if held.get(name) == manifest.files[name]]
    names = [name for name in names if name not in there]
    if advanced is not None and there:
        advanced(sum(manifest.files[name] for name in there))
    try:
        with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="safepoint-copy") as pool:
            for name in names:
                written.append(name)
                pieces = verified_pieces(source, manifest, name, pool, advanced)
                size = target.write(name, pieces)
                if size != manifest.files[name]:
                    where = source.url.rstrip("/")
                    raise CorruptCheckpoint(
                        f"{where}/{name} holds {size} bytes, the manifest records "
                        f"{manifest.files[name]}; restore an earlier checkpoint",
                        url=where,
                    )
    except BaseException:  # unless another copy of this save committed them meanwhile
        discard_unless_committed(target, manifest.save_id, written)
        raise
    return sum(manifest.files[name] for name in names)


def _blocks(manifest: Manifest, name: str) -> list[Block]:
    """(file offset, nbytes, digest) of every checksum block stored in data file `name`, in
    file order."""
    size = manifest.block_bytes
    found = [
        (chunk.offset + start, min(size, chunk.nbytes - start), chunk.digests[n])
        for entry in manifest.entries.values() for chunk in entry.chunks if chunk.file == name
        for n, start in enumerate(range(0, chunk.nbytes, size))
    ]
    found.sort()
    return found


Block = tuple[int, int, int]


def _pieces(blocks: list[Block], size: int) -> Iterator[tuple[int, int, list[Block]]]:
    """(start, end, blocks inside) of ranges covering a file of `size` bytes, about
    `_PIECE_BYTES` each, cut only outside blocks, so every block lies in one piece (blocks
    that overlap, as two chunks of a crafted manifest may, included). Bytes no block covers
    (an incremental step's file shared with an earlier step holds whatever that step's
    changed tensors left: up to all of a model) are cut every `_PIECE_BYTES` too, so no read
    holds much more than a piece. Made as they are read, so memory never follows `size`."""
    start = reach = 0  # where the piece starts, and where its blocks end
    inside: list[Block] = []
    for block in chain(blocks, [(size, 0, 0)]):  # the end of the file closes the last gap
        # A block that starts inside bytes an earlier block reaches joins its piece: a cut
        # at `reach` would put it in the next piece, which starts after it.
        while block[0] - start >= _PIECE_BYTES and reach <= block[0]:
            cut = max(reach, start + _PIECE_BYTES)  # at most where this block starts
            yield start, cut, inside
            start = reach = cut
            inside = []
        if block[1]:
            inside.append(block)
            reach = max(reach, block[0] + block[1])
    if size > start:
        yield start, size, inside


def verified_pieces(
    source: Storage, manifest: Manifest, name: str, pool: ThreadPoolExecutor,
    advanced: Callable[[int], None] | None = None,
) -> Iterator[bytes]:
    """The bytes of data file `name`, piece by piece in order, each checked against the
    manifest's digests before it is yielded; `READ_AHEAD` pieces are read in parallel.

    Raises:
        CorruptCheckpoint: the file is missing or not the size the manifest records (found
            before anything is read), or a block does not match its digest.
    """
    checksum = checksum_function(manifest.checksum)
    where = f"{source.url.rstrip('/')}/{name}"

    def missing() -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"{where} is missing: the manifest records it; the source is damaged, nothing "
            "was published at the destination; restore an earlier checkpoint",
            url=source.url, problems=[f"{name}: data file is missing"],
        )

    def sized(actual: int) -> CorruptCheckpoint:
        held = (f"truncated to {actual} bytes of the {nbytes} the manifest records"
                if actual < nbytes else f"{actual} bytes, the manifest records {nbytes}")
        return CorruptCheckpoint(
            f"{where} is {held}; the source is damaged, nothing was published at the "
            "destination; restore an earlier checkpoint",
            url=source.url, problems=[f"{name}: {held}"],
        )

    # IMPORTANT: the file's real size, not the manifest's word, bounds what is read: an
    # edited manifest may record 2**62 bytes, which no read plan or buffer may follow.
    nbytes = manifest.files[name]
    try:
        actual = source.size(name)
    except FileNotFoundError as exc:
        raise missing() from exc
    if actual != nbytes:  # longer is damage too, as verify says (appended bytes)
        raise sized(actual)

    def fetch(start: int, end: int, inside: list[Block]) -> bytes:
        try:
            data = source.read(name, start, end)
        except FileNotFoundError as exc:
            raise missing() from exc
        if len(data) != end - start:  # it shrank since it was measured
            raise sized(start + len(data))
        view = memoryview(data)
        for offset, size, digest in inside:
            if checksum(view[offset - start : offset - start + size]) != digest:
                raise CorruptCheckpoint(
                    f"{where} at byte {offset}: checksum mismatch; the source is damaged, "
                    "nothing was published at the destination; run `safepoint verify` on it",
                    url=source.url, problems=[f"{name} at byte {offset}: checksum mismatch"],
                )
        return data

    pending: deque[Future[bytes]] = deque()
    ranges = _pieces(_blocks(manifest, name), nbytes)
    try:
        for piece in ranges:
            pending.append(pool.submit(fetch, *piece))
            if len(pending) >= READ_AHEAD:
                break
        while pending:
            data = pending.popleft().result()
            for piece in ranges:
                pending.append(pool.submit(fetch, *piece))
                break
            yield data
            if advanced is not None:
                advanced(len(data))
    finally:
        for future in pending:
            future.cancel()
