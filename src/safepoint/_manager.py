"""A series of checkpoints under one root, one per step: retention, asynchronous saving with
bounded staging memory, events, a writer lease and restore with fallback (manager layer).

Layout: each step is an ordinary checkpoint at `<root>/step-<step>` (loadable with
`sp.load`), the lease lives under `<root>/lease/`. Only the `Storage` protocol is used, so a
root may be a local directory or any URL a backend serves.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from ._api import (
    CheckpointInfo,
    PreparedSave,
    Progress,
    info,
    info_of,
    load,
    metadata_not_a_dict,
    prepare_save,
    save_collective,
    write_and_commit,
)
from ._commit import leftovers, read_manifest
from ._dist import Group, alike, exchange, group_for
from ._events import DELETE, ERROR, LOAD, SAVE, Event, EventCallback, callbacks, emit
from ._format import MANIFEST, Manifest, decode, encode
from ._incremental import Increment, Lineage
from ._lease import Lease, check_seconds
from ._leaves import SHARDED
from ._names import as_step, check_step, parse_step, step_name
from ._retention import Policy, StepRecord, finite_number, keep_reasons, restore_order
from ._snapshot import Snapshot, Stager, staging_budget
from ._storage_local import absolute_url, location
from ._tree import Memo
from .errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
    DistributedError,
    LeaseHeld,
    SafepointError,
    UnsupportedLeaf,
)
from .storage import Storage, open_storage

__all__ = [
    "MANAGER_KEY",
    "CheckpointManager",
    "GCReport",
    "SaveHandle",
    "StepInfo",
    "committed_steps",
    "examine",
    "failed_with",
    "unreadable",
]

logger = logging.getLogger(__name__)

#: The manifest metadata key under which the manager records a step's number, metrics and
#: retention policy (so `safepoint ls` and `gc` can apply it without the training script).
MANAGER_KEY = "safepoint.manager"
_MANIFEST_READERS = 16  # manifests read at once when the steps' infos are needed


def _group(files: Iterable[str]) -> dict[int, list[str]]:
    """The files of each step directory under a root, by step."""
    steps: dict[int, list[str]] = {}
    for path in files:
        top, sep, _ = path.partition("/")
        step = parse_step(top) if sep else None
        if step is not None:
            steps.setdefault(step, []).append(path)
    return steps


def committed_steps(storage: Storage) -> list[int]:
    """The steps under the root at `storage` that have a manifest, ascending."""
    try:
        files = storage.list("")
    except FileNotFoundError:
        return []
    return steps_among(files)


def examine(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[CheckpointInfo, list[str]]:
    """What `info` says of the checkpoint at `url`, and the files under it that its manifest
    does not reference (a killed or failed overwrite's data, an upload it never completed),
    from one read of its manifest: what `safepoint ls` shows of a step or a checkpoint.

    Raises:
        CheckpointNotFound: nothing committed at `url`.
        SafepointError: its manifest cannot be read, or listing it failed.
    """
    storage = open_storage(url, storage_options)
    try:
        manifest = read_manifest(storage)
        return info_of(url, manifest), leftovers(storage, manifest)
    finally:
        storage.close()


def steps_among(files: Iterable[str]) -> list[int]:
    """The committed steps (those with a manifest) among a root's listed `files`,
    ascending."""
    return sorted(step for step, paths in _group(files).items()
                  if f"{step_name(step)}/{MANIFEST}" in paths)


def failed_with(exc: BaseException, *kinds: type[SafepointError]) -> bool:
    """Whether `exc` is one of `kinds`, or a collective call's `DistributedError` whose
    every failing rank raised one of them (the same error reaches every rank, so all decide
    alike)."""
    if isinstance(exc, kinds):
        return True
    names = tuple(f"{kind.__name__}:" for kind in kinds)
    return isinstance(exc, DistributedError) and bool(exc.failures) and all(
        cause.startswith(names) for cause in exc.failures.values())


def unreadable(exc: BaseException) -> bool:
    """Whether `restore` may skip the step whose load raised `exc`: the step is missing or
    corrupt, here or, for a collective load, on every rank that failed."""
    return failed_with(exc, CorruptCheckpoint, CheckpointNotFound)


#: How often `restore` tries a step that vanishes while it is loaded (overwritten again).
_RESTORE_TRIES = 3


def _vanished(exc: BaseException) -> bool:
    """Whether the step whose load raised `exc` (an `unreadable` one) is no longer committed,
    here or on every rank that failed, rather than corrupt."""
    return failed_with(exc, CheckpointNotFound)


def _seconds(created: str) -> float:
    """An ISO 8601 commit time as seconds since the epoch."""
    return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True, slots=True)
class StepInfo:
    """A committed step, from its manifest alone.

    Attributes:
        step: the step number.
        url: the step's checkpoint (loadable with `sp.load`).
        created: UTC commit time, ISO 8601.
        nbytes: bytes of its data files.
        metrics: the `metrics=` passed to `save`.
        metadata: the `metadata=` passed to `save`.
        policy: the retention policy of the manager that saved it (None if unknown).
    """

    step: int
    url: str
    created: str
    nbytes: int
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    policy: Policy | None = None
    #: When `save` was called (seconds since the epoch; None for a step saved before the
    #: manager recorded it): what orders steps for restore and retention (`record`).
    _called: float | None = field(default=None, repr=False)
    #: The step the run had restored or saved last when it saved this one (None: none, or
    #: saved before the manager recorded it): what a restore falls back to (`restore_order`).
    _parent: int | None = field(default=None, repr=False)

    @staticmethod
    def of(step: int, checkpoint: CheckpointInfo) -> StepInfo:
        """The step's view of a checkpoint's info."""
        metadata = dict(checkpoint.metadata)
        recorded = metadata.pop(MANAGER_KEY, None)
        recorded = recorded if isinstance(recorded, dict) else {}
        policy = None
        if isinstance(recorded.get("policy"), dict):
            try:
                policy = Policy(**recorded["policy"])
            except (TypeError, SafepointError):
                policy = None
        metrics = recorded.get("metrics")
        return StepInfo(step, checkpoint.url, checkpoint.created, checkpoint.nbytes,
                        dict(metrics) if isinstance(metrics, dict) else {}, metadata, policy,
                        finite_number(recorded.get("called")),
                        as_step(recorded.get("parent")))

    def record(self) -> StepRecord:
        """What retention and the restore order need of it: saved when `save` was called,
        or, for a step whose manifest does not record that, when it was committed.

        Raises:
            ValueError: it records no call time and its commit time is no ISO 8601.
        """
        saved = self._called if self._called is not None else _seconds(self.created)
        return StepRecord(self.step, saved, self.metrics)


@dataclass(frozen=True, slots=True)
class GCReport:
    """What `CheckpointManager.gc` removed (or, with `dry_run`, would remove).

    Attributes:
        deleted_steps: committed steps the policy does not keep.
        leftovers: per step, the files of saves that never committed (a directory without
            a manifest, or files its manifest does not reference).
        kept: each kept step and why ("latest", "last", "every", "time", "best").
    """

    deleted_steps: list[int]
    leftovers: dict[int, list[str]]
    kept: dict[int, list[str]]


class SaveHandle:
    """A save in progress; `result()` waits for its commit."""

    def __init__(
        self, step: int, future: Future[StepInfo], blocked_seconds: float,
        parent: int | None = None,
    ) -> None:
        self.step = step
        self.blocked_seconds = blocked_seconds
        self._future = future
        self.reported = False
        self._parent = parent  # the head when `save` was called

    def done(self) -> bool:
        """Whether the save has committed or failed."""
        return self._future.done()

    def exception(self) -> BaseException | None:
        """Wait for the save; what it raised (then it is not raised again by the manager), or
        None."""
        error = self._future.exception()
        if error is not None:
            self.reported = True
        return error

    def result(self, timeout: float | None = None) -> StepInfo:
        """Wait for the commit.

        Raises:
            whatever the write raised (then it is not raised again by the manager).
            TimeoutError: not done within `timeout` seconds (the builtin, also on Python
                3.10, where the futures' own is another class); the save goes on.
        """
        try:
            return self._future.result(timeout)
        except FutureTimeout as exc:  # the builtin TimeoutError from Python 3.11 on
            if self._future.done() and self._future.exception() is exc:  # the write's own
                self.reported = True
                raise
            raise TimeoutError(f"the save of step {self.step} has not committed within "
                               f"{timeout} s; it goes on: call result() again to wait") from exc
        except BaseException as exc:
            if self._future.done() and self._future.exception() is exc:  # not a Ctrl-C's
                self.reported = True
            raise


def _done(value: StepInfo) -> Future[StepInfo]:
    future: Future[StepInfo] = Future()
    future.set_result(value)
    return future


class CheckpointManager:
    """Checkpoints of a training run under `root`, one per step.

    Saving takes a lease on the root (one writer per root); listing and restoring need none.
    With `async_save=True`, `save` returns once the state is copied to host memory and a
    background thread writes and commits it; at most one save is in flight, and a failure is
    raised from the next `save`, `wait` or `close` (the previous checkpoint stays valid).

    Args:
        root: a directory path or URL holding the steps.
        keep_last: keep the newest N steps (None: all).
        keep_every: also keep every step divisible by K, forever.
        keep_best: also keep the N best steps by `best_metric`.
        best_metric: the metric (from `save(metrics=...)`) `keep_best` ranks by.
        best_mode: "min" or "max".
        async_save: write in the background from a staging copy; False writes straight from
            the tensors before `save` returns.
        keep_every_seconds: also keep one step per this many seconds, forever.
        max_staging_bytes: a host-memory budget (32 MiB or more) for staging and the
            writer's buffers; a larger state streams through it (stage a part, write it,
            reuse the buffers), and `save` blocks until the last part is staged. None: stage
            the whole state.
        on_event: called with an `sp.Event` for every save, load, delete and error (from the
            background thread for asynchronous saves).
        fallback: `restore()` of the newest step skips steps that fail their checksums
            (loudly: an error event and a warning), restoring the newest one that passes.
        storage_options: options for the storage backend.
        lease_seconds: how long the writer's lease lasts without renewal (a finite number
            of seconds above 0); it is renewed in the background while the manager holds it
            and is referenced (a manager dropped without `close` stops renewing it).
        local_dir: commit each step in this fast local directory first and upload it to
            `root` in the background (two tiers: see `safepoint._tiered.TieredManager`); in
            a process group, one directory every rank sees, or a node-local disk on each
            host (each host's ranks sharing one).
        keep_local: with `local_dir`, how many uploaded steps stay there.
        process_group: once torch.distributed is initialised, `save`, `restore`, `steps` and
            `latest_step` are collective over this group (the default group when None): rank
            0 lists the steps and tells every rank, holds the lease, decides whether a step
            is replaced and runs retention; every rank writes its own pieces (`sp.save`).
            Asynchronous collective saves stage each rank's pieces as a single process does
            (reused buffers, within `max_staging_bytes` per rank) and write and commit in the
            background, coordinating over a group of their own. The ranks are `mgr.group`.
        dist: False keeps the manager local to this process.
        incremental: each save writes only the checksum blocks (4 MiB of an entry) whose
            bytes changed since this manager's last commit (or the step `restore` restored
            whole), and shares the data files that hold the others (hard links on a local
            disk, server-side copies on an object store), so frozen weights are written
            once. Each step stays a complete checkpoint. A manager's first save without a
            restore writes everything. In a process group each rank does this for the
            pieces it writes (blocks counted from each piece's first byte).

    Raises:
        SafepointError: a bad retention policy, staging budget (not a whole number of bytes
            of at least 32 MiB; a whole float such as 2e9 counts) or `lease_seconds`, or
            `incremental` where it cannot be.
        DistributedError: in a process group, the ranks name different roots.
    """

    #: Whether every rank of a group names the same root (a two-tier manager's is each
    #: node's local_dir).
    _shared_root = True

    def __init__(
        self,
        root: str,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
        keep_every_seconds: float | None = None,
        max_staging_bytes: int | None = None,
        on_event: EventCallback | Sequence[EventCallback] | None = None,
        fallback: bool = True,
        storage_options: dict[str, Any] | None = None,
        lease_seconds: float = 60.0,
        local_dir: str | None = None,
        keep_local: int = 1,
        process_group: Any = None,
        dist: bool | None = None,
        incremental: bool = False,
    ) -> None:
        # The steps' URLs are made from it at each call; `absolute_url` refuses a root that
        # is not a path (None, bytes).
        self.root = absolute_url(root)
        self.group = group_for(process_group, dist)
        self._dist: dict[str, Any] = (
            {"dist": False} if self.group.solo else {"process_group": self.group.pg}
        )
        self.async_save = async_save
        self.fallback = fallback
        self.storage_options = storage_options
        self.incremental = incremental

        def check() -> tuple[str | None, bool, bool, bool]:
            """The options, checked on every rank, so that one rank's bad ones raise on all
            (alone, the others would wait out the group's timeout in their first call); and
            the root and the settings that change which collectives a call makes, for rank
            0 to compare."""
            made.update(lease=check_seconds(lease_seconds, self.root),
                        budget=staging_budget(max_staging_bytes, self.root),
                        policy=Policy(keep_last, keep_every, keep_every_seconds, keep_best,
                                      best_metric, best_mode),
                        callbacks=callbacks(on_event))
            self._storage = open_storage(self.root, storage_options)
            if incremental:
                self._check_incremental()
            return (location(self.root) if self._shared_root else None, bool(async_save),
                    bool(incremental), bool(fallback))

        def same(settings: list[tuple[str | None, bool, bool, bool]]) -> None:
            # Saves would be refused, but a restore would follow rank 0's listing alone.
            alike([root for root, *_ in settings], differ="the ranks' managers name "
                  "different roots", fix="a collective manager's root is one every rank "
                  "sees; pass the same root on every rank (dist=False for a manager of this "
                  "rank's own)", url=self.root, label=lambda root: f"root {root}")
            flags = [tuple(rest) for _, *rest in settings]
            if len(set(flags)) > 1:
                raise SafepointError(
                    f"the ranks' managers of {self.root} differ in (async_save, incremental, "
                    f"fallback): {flags}, rank by rank: make them alike on every rank")

        made: dict[str, Any] = {}
        try:
            exchange(self.group, check, same, what=f"making the manager of {self.root}",
                     consequence="no manager was made")
        except BaseException:
            if hasattr(self, "_storage"):
                self._storage.close()
            raise
        self.policy: Policy = made["policy"]
        self._callbacks = made["callbacks"]
        lease_seconds, max_staging_bytes = made["lease"], made["budget"]
        self._lineage: tuple[int, Lineage] | None = None  # the last commit, for incremental
        #: The step restored whole or saved last (`save` called), recorded as the parent of
        #: the next save: a restore falls back along the steps the run went through.
        self._head: int | None = None
        self._head_parent: int | None = None  # the head's parent, when saved here
        self._head_saved = False  # whether the head was saved here (else restored)
        #: Steps whose save failed -> the step that save continued from (`_resolved`).
        self._failed_saves: dict[int, int | None] = {}
        self._lease = Lease(self._storage, lease_seconds)
        self._stager = Stager(max_staging_bytes) if async_save else None
        self._memo: Memo = {}  # what flattening the last state leaves for the next one
        self._executor: ThreadPoolExecutor | None = None
        self._writers: Group | None = None  # the group of background collective saves
        #: Set by a two-tier manager whose ranks' roots are node-local directories: whether
        #: this rank publishes each committed manifest in its own root too (see
        #: `save_collective`); None: the root is one directory every rank sees.
        self._replica: bool | None = None
        self._pending: SaveHandle | None = None
        self._known: dict[int, StepInfo] | None = None  # committed steps, once the lease is held
        #: Bumped by every commit, delete and reset of `_known`: a listing taken before one
        #: (`_records`) is stale and never installed as `_known`.
        self._generation = 0
        #: Steps whose manifest retention deleted but not (all) their data, with their bytes:
        #: the next retention deletes the rest.
        self._unfinished: dict[int, int] = {}
        #: The steps whose directories may hold files, from the listing taken with the lease
        #: and kept current by this manager's own saves and deletes; None: unknown.
        self._occupied: set[int] | None = None
        #: Whether the leftovers of crashed saves were removed since the lease was taken.
        self._tidied = False
        # Reentrant: a signal handler that saves may interrupt this thread holding it.
        self._lock = threading.RLock()
        #: The thread inside `save` now, if any: a save it makes again (from a signal handler
        #: that interrupted it) is `_nested`.
        self._saving: int | None = None
        self._closed = False
        _live.add(self)

    def _recorded_policy(self) -> Policy:
        """The retention policy recorded in each step's manifest (for `safepoint ls` and
        `gc`, and `StepInfo.policy`)."""
        return self.policy

    def _check_incremental(self) -> None:
        if callable(getattr(self._storage, "link", None)):
            return
        raise SafepointError(
            f"CheckpointManager({self.root!r}, incremental=True): incremental saves do not "
            f"work on {type(self._storage).__name__} (it cannot link a file of one step into "
            "another); pass incremental=False"
        )

    def __new__(cls, root: str, *, local_dir: str | None = None, **options: Any) -> Any:
        """`CheckpointManager(root, local_dir=...)` is a two-tier manager."""
        if local_dir is not None and cls is CheckpointManager:
            from ._tiered import TieredManager

            return super().__new__(TieredManager)
        return super().__new__(cls)

    # -- reading -----------------------------------------------------------------------------

    def step_url(self, step: int) -> str:
        """Where `step`'s checkpoint is.

        Raises:
            SafepointError: `step` is not a whole number 0 or more.
        """
        return self._url(check_step(step))

    def _url(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/{step_name(step)}"

    def steps(self) -> list[int]:
        """The committed steps, ascending (in a group: as rank 0 sees them, on every rank)."""
        steps: list[int] = exchange(
            self.group, lambda: None, lambda _: committed_steps(self._storage),
            what=f"listing {self.root}", consequence="nothing was changed",
        )
        return steps

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def metadata(self, step: int) -> StepInfo:
        """A step's metrics, metadata, time and size, from its manifest (no tensor is read).

        Raises:
            CheckpointNotFound: `step` is not committed.
            SafepointError: `step` is not a whole number 0 or more.
        """
        step = check_step(step)
        return StepInfo.of(step, info(self._url(step), storage_options=self.storage_options))

    def restore(
        self,
        state: Any,
        step: int | None = None,
        *,
        keys: Sequence[str] | None = None,
        strict: bool = True,
        allow_pickle: bool = False,
        progress: Progress | None = None,
    ) -> int | None:
        """Restore `state` in place from `step`, or from the step committed last (`keys`,
        `strict`, `allow_pickle` and `progress` as `sp.load` takes them; `progress` starts
        again at 0 for each step tried). The step committed last is the newest one unless
        the run rolled back to an earlier step and saved again: then the newer steps of the
        abandoned branch are passed over (with a warning in the log), and `step=` restores
        one of them. The steps tried after it follow the parents the saves recorded (each
        the step restored or saved before it; see `restore_order`).

        With `step=None` and `fallback=True`, a step that fails its checksums (or vanished
        meanwhile) is reported (an error event and a warning naming it and the problem) and
        the next older one is tried; tensors may hold bytes of a skipped step until a good one
        overwrites them. In a group, a step whose bytes fail their checksums on some ranks (a
        `DistributedError` whose every failure is corrupt or missing data) is skipped on every
        rank alike.

        Returns:
            the step restored, or None when nothing is committed.

        Raises:
            CheckpointNotFound: `step` was given and is not committed.
            CorruptCheckpoint: the step (or, with fallback, every step) is corrupt.
            DistributedError: in a group, the load failed on some rank (for corrupt data: the
                step was given, or every step failed), or the ranks asked for different steps.
            StateMismatch, PickleNotAllowed, FormatVersionError: as `sp.load`.
            the error of the save in flight, if it failed: restore waits for it first (it
                may commit the step restored last, and its retention may delete another).
            SafepointError: `step` is not a whole number 0 or more.
        """
        keys = list(keys) if isinstance(keys, Iterator) else keys  # each step tried reads it
        candidates, whole = self._candidates(step, keys is None and strict)
        if not candidates:
            return None
        first: SafepointError | None = None
        tried: Counter[int] = Counter()
        corrupt: set[int] = set()  # never read again
        while candidates:
            candidate = candidates.pop(0)
            tried[candidate] += 1
            url = self._url(candidate)
            started = time.perf_counter()
            loaded: list[Event] = []  # its bytes, from the load itself: the step may go next
            try:
                load(url, into=state, keys=keys, strict=strict, allow_pickle=allow_pickle,
                     storage_options=self.storage_options, progress=progress,
                     on_event=loaded.append, **self._dist)
            except SafepointError as exc:
                self._report_failure(url, candidate, started, exc)
                if unreadable(exc):  # its files may be the ones the next save would link
                    self._drop_lineage(f"restoring step {candidate} of {self.root} failed")
                if not unreadable(exc) or step is not None or not self.fallback:
                    raise
                first = first or exc
                if not _vanished(exc):
                    corrupt.add(candidate)
                else:
                    # Removed since it was listed: the writer's retention, which may have
                    # committed a newer step, or an overwrite, whose new save is tried too.
                    # Readers need no lease.
                    candidates = [s for s in self._restore_order()
                                  if s not in corrupt and tried[s] < _RESTORE_TRIES]
                then = f"trying step {candidates[0]}" if candidates else "no other step left"
                warnings.warn(f"safepoint: step {candidate} at {url} cannot be restored: "
                              f"{exc}; {then}", stacklevel=2)
                continue
            seconds = time.perf_counter() - started
            nbytes = loaded[-1].nbytes if loaded else 0
            self._resumed(candidate, keys)
            self._emit(Event(LOAD, url, candidate, seconds, seconds, nbytes))
            if self.incremental and whole:  # every block read and checked, on every rank
                self._follow(candidate)
            return candidate
        assert first is not None
        raise first

    def _candidates(self, step: object, whole: bool) -> tuple[list[int], bool]:
        """The steps `restore` tries: `step` alone, or the committed steps in restore order;
        the same on every rank, after the save in flight (see `_raise_pending_everywhere`);
        and whether every rank restores the whole state strictly (`_agreed_step`)."""
        self._raise_pending_everywhere(f"restoring from {self.root}")
        try:
            wanted, everywhere = self._agreed_step(step, whole)
        except SafepointError as exc:
            self._report_failure(self.root, step, time.perf_counter(), exc)
            raise
        return (self._restore_order() if wanted is None else [wanted]), everywhere

    def _agreed_step(self, step: object, whole: bool) -> tuple[int | None, bool]:
        """`step` (None: the step committed last) checked on every rank and the same on
        every rank, in one exchange: a bad or differing step on some rank raises on all
        (alone, the others would wait out the group's timeout in the load). With it comes
        whether every rank restores the whole state strictly (`whole`: this rank passed no
        `keys=`, and `strict`): ranks may load different keys, but an incremental manager
        shares with the step restored only when every rank read and checked all of its
        pieces, and the collective call that makes it share (`_follow`) is made on every
        rank or on none.

        Raises:
            SafepointError: the step is not a whole number 0 or more.
            DistributedError: it differs by rank.
        """

        def decide(asked: list[tuple[int | None, bool]]) -> tuple[int | None, bool]:
            step = alike([wanted for wanted, _ in asked], differ=f"restoring from "
                         f"{self.root}: the ranks ask for different steps (None: the step "
                         "committed last)", fix="pass the same step= on every rank; nothing "
                         "was restored", url=self.root, label=lambda wanted: f"asks for step "
                         f"{wanted}")
            return step, all(entire for _, entire in asked)

        agreed: tuple[int | None, bool] = exchange(
            self.group, lambda: (None if step is None else check_step(step), whole), decide,
            what=f"restoring from {self.root}", consequence="nothing was restored")
        return agreed

    def _restore_order(self, steps: list[int] | None = None) -> list[int]:
        """`_ordered(steps)`, decided on rank 0, in one exchange."""
        order: list[int] = exchange(self.group, lambda: None, lambda _: self._ordered(steps),
                                    what=f"listing {self.root}", consequence="nothing was changed")
        return order

    def _ordered(self, steps: list[int] | None = None) -> list[int]:
        """The committed `steps` (None: listed here) in the order `restore` tries them
        (`restore_order`: the step saved last first, then the run's own older steps), from
        the times and parents their manifests record."""
        committed = committed_steps(self._storage) if steps is None else steps
        saved = {}
        parents = {}
        for step, found in self._infos(committed).items():
            with contextlib.suppress(ValueError):  # a commit time that is no ISO 8601
                saved[step] = found.record().saved
            if found._parent is not None:
                parents[step] = found._parent
        order, passed = restore_order(committed, saved, parents)
        if passed:
            logger.warning(
                "steps %s under %s were abandoned: a step numbered below each was saved "
                "after it (the run rolled back and saved again): restoring from step %d, "
                "falling back to older steps but never to these; pass step= to restore one "
                "of them", passed, self.root, order[0])
        return order

    def _keep_only(self, step: int) -> list[int]:
        """Delete every committed step but `step`, whatever the policy keeps (a finished
        run's `keep_final_only`), and the leftovers of crashed saves: as `gc`, on rank 0.
        Returns the deleted steps."""
        self._check_open()
        self._raise_pending_everywhere(f"deleting the steps under {self.root}")

        def collect(_: object) -> list[int]:
            self._acquire()
            self._remove_leftovers(dry_run=False)  # the steps to delete go whole anyway
            records = self._records()
            doomed = [other for other in committed_steps(self._storage) if other != step]
            for other in doomed:
                self._delete_step(other, records[other].nbytes if other in records else 0)
            return doomed

        deleted: list[int] = exchange(
            self.group, lambda: None, collect, what=f"deleting the steps under {self.root}",
            consequence="some older steps may be left: `safepoint gc` applies the policy")
        return deleted

    # -- writing -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Save `state` as `step` (replacing a committed `step` of the same number).

        Returns once the state is staged (asynchronous) or committed (synchronous); the
        handle's `result()` waits for the commit. Retention runs after each commit.

        A save made while this thread is inside `save` (from a signal handler that
        interrupted it, such as a preemption handler's) is synchronous and committed when it
        returns: it neither waits for the save in flight (whose writer may wait for the
        staging the handler interrupted) nor touches its staging buffers. Its retention is
        left to the save it interrupted, which commits after it (a retention now could
        delete the step that save shares files with, `incremental`).

        Raises:
            the error of the previous asynchronous save, if it failed (this save is not made).
            LeaseHeld: another writer holds the root.
            UnsupportedLeaf: bad metrics, metadata or state (nothing is written).
            SafepointError: `step` is not a whole number 0 or more; or a save from a signal
                handler that interrupted a save in a process group (set a flag there and
                save from the training loop).
        """
        self._check_open()
        me = threading.get_ident()
        if self._saving == me:
            return self._nested(step, state, metrics, metadata)
        self._saving = me
        try:
            return self._save(step, state, metrics, metadata)
        finally:
            self._saving = None

    def _nested(
        self, step: int, state: Any, metrics: dict[str, Any] | None,
        metadata: dict[str, Any] | None,
    ) -> SaveHandle:
        """`save` from a signal handler that interrupted this thread's `save` (see there)."""
        if not self.group.solo:
            raise SafepointError(
                f"a save of step {step} to {self.root} was made while this rank was inside "
                "another save (from a signal handler?); a collective save cannot be nested, "
                "and the other ranks are not saving it: set a flag in the handler and save "
                "from the training loop")
        return self._save(step, state, metrics, metadata, nested=True)

    def _save(
        self, step: int, state: Any, metrics: dict[str, Any] | None,
        metadata: dict[str, Any] | None, *, nested: bool = False,
    ) -> SaveHandle:
        """`save`; a `nested` one (`_nested`) is synchronous, waits for nothing and leaves
        retention to the save it interrupted. The step becomes the head at once (a save
        from a signal handler that interrupts this one continues from it), and a save that
        fails is passed over as a parent (`_resolved`)."""
        # Stamped before the wait: a save from a signal handler that interrupts this one
        # there (or later) holds the later state, and must be ordered after it.
        called, parent = time.time(), self._resolved(self._head)
        whole = as_step(step)
        if whole is not None:
            if parent == whole:  # saved again: from where its last save (or retry) went on
                parent = self._head_parent if self._head_saved else self._recorded_parent(whole)
            self._head, self._head_parent, self._head_saved = whole, parent, True
            self._failed_saves.pop(whole, None)
        try:
            return self._start_save(step, state, metrics, metadata, called, parent,
                                    nested=nested)
        except BaseException:
            if whole is not None:
                self._save_failed(whole, parent)
            raise

    def _resumed(self, step: int, keys: Sequence[str] | None) -> int:
        """`step`, just restored, made the head unless only `keys` were (weights for an
        evaluation: the run does not go on from them)."""
        if keys is None:
            self._head, self._head_parent, self._head_saved = step, None, False
            self._failed_saves.pop(step, None)
        return step

    def _recorded_parent(self, step: int) -> int | None:
        """The parent the manifest of `step` records (None when it records none, or cannot
        be read)."""
        try:
            return self._resolved(self.metadata(step)._parent)
        except SafepointError:
            return None

    def _save_failed(self, step: int, parent: int | None) -> None:
        """Pass over the save of `step` (continued from `parent`), which failed, as a parent:
        a save that continues from it records the step it continued from instead."""
        parent = self._resolved(parent)
        if parent != step:  # else a failed overwrite: the committed step stands
            self._failed_saves[step] = parent

    def _resolved(self, step: int | None) -> int | None:
        """`step`, or, while its save failed, the step that save continued from."""
        seen: set[int] = set()
        while step is not None and step in self._failed_saves and step not in seen:
            seen.add(step)
            step = self._failed_saves[step]
        return step

    def _start_save(
        self, step: int, state: Any, metrics: dict[str, Any] | None,
        metadata: dict[str, Any] | None, called: float, parent: int | None, *, nested: bool,
    ) -> SaveHandle:
        """`_save`, made from `parent` (the head when `save` was called)."""
        if not nested:
            self._raise_pending_everywhere(f"saving to {self.root}")
        started = time.perf_counter()
        if not self.group.solo:
            return self._save_collective(step, state, metrics, metadata, started, called, parent)
        try:
            step = check_step(step)
            self._take_lease()
            recorded = {"step": step, "called": called, "parent": self._resolved(parent),
                        "metrics": _checked_metrics(metrics),
                        "policy": asdict(self._recorded_policy())}
            overwrite = self._storage.exists(f"{step_name(step)}/{MANIFEST}")
            prepared = prepare_save(
                self._url(step), state, metadata=_with_record(metadata, recorded),
                overwrite=overwrite, storage_options=self.storage_options, memo=self._memo,
                parent_check=False,
            )
        except BaseException as exc:
            whole = as_step(step)
            self._report_failure(self.root if whole is None else self._url(whole), step,
                                 started, exc)
            raise
        if SHARDED in prepared.kinds.values():
            # Pieces of global tensors take the collective path, as in `sp.save`: in a group
            # of one, plain calls.
            prepared.close()
            return self._save_collective(step, state, metrics, metadata, started, called,
                                         parent, nested=nested)
        tidy = self._claim(step, overwrite)
        if self._stager is None or nested:
            with prepared:
                result = self._commit(step, prepared, prepared.host_data(), started, None,
                                      tidy=tidy, retain=not nested)
            return SaveHandle(step, _done(result), time.perf_counter() - started)
        try:
            snapshot = self._stager.snapshot(prepared.leaves, prepared.kinds)
        except BaseException as exc:
            prepared.close()
            self._report_failure(prepared.url, step, started, exc)
            raise
        blocked: list[float] = []
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="safepoint-save")
        future = self._executor.submit(self._background, step, prepared, snapshot, started,
                                       blocked, tidy)
        # In flight from here: an interrupt anywhere below leaves it for the next save, wait
        # or close to wait for (its staging buffers are in use until it ends).
        handle = self._pending = SaveHandle(step, future, 0.0, parent)
        try:
            snapshot.stage()
        except BaseException:
            handle.reported = True  # the writer stops; its error is this one
            future.exception()
            raise
        prepared.staged()
        blocked.append(time.perf_counter() - started)
        handle.blocked_seconds = blocked[0]
        return handle

    def _save_collective(
        self, step: int, state: Any, metrics: dict[str, Any] | None,
        metadata: dict[str, Any] | None, started: float, called: float, parent: int | None,
        *, nested: bool = False,
    ) -> SaveHandle:
        """`save` over a process group (`called`: when `save` was called, and `parent`, the
        step restored or saved before, both recorded): rank 0
        takes the lease and decides whether the step is replaced, every rank saves its part,
        rank 0 runs retention. Asynchronous saves stage
        each rank's pieces through the manager's `Stager` (as a single process does: the same
        buffers, reused, within `max_staging_bytes`) while a background thread writes and
        commits them, coordinating over a group of their own (created by the first such save)
        so that they never interleave with the training's collectives. A staging failure is
        not raised here but by the background save, on every rank (from the next `save` or
        `wait`). A `nested` one (`_nested`, in a group of one) commits before it returns,
        without retention."""
        whole = as_step(step)  # a torch or NumPy int as the int (a bad step: `check`)
        if whole is not None:
            step = whole
        recorded: dict[str, Any] = {}
        full_metadata: dict[str, Any] = {}

        def check() -> None:
            """The step, metrics and metadata, checked on every rank, so that one rank's bad
            ones raise on all (checked alone, the others would wait out the group's
            timeout)."""
            recorded.update(step=check_step(step), called=called,
                            parent=self._resolved(parent),
                            metrics=_checked_metrics(metrics),
                            policy=asdict(self._recorded_policy()))
            full_metadata.update(_with_record(metadata, recorded))

        def replaced(_: object) -> tuple[bool, bool, bool]:
            """Whether the step is replaced, whether the last commit is still there to
            share with (decided once, so that every rank writes against the same one), and
            whether the commit must remove what it replaced (`_claim`)."""
            self._take_lease()
            self._lease.check()
            overwrite = self._storage.exists(f"{step_name(step)}/{MANIFEST}")
            return overwrite, self._previous() is not None, self._claim(step, overwrite)

        url = self._url(step)  # a bad step is refused by `check`, on every rank

        def recheck() -> None:  # on rank 0, the lease holder: it may be lost while writing
            self._check_lease(f"step {step} was not committed to {url} (its data was removed)")

        try:
            overwrite, shares, tidy = exchange(self.group, check, replaced,
                                               what=f"saving {url}",
                                               consequence="nothing was written")
            # Every rank's lineage is rank 0's: each took it from the same committed manifest.
            increment = None
            if self.incremental:
                increment = Increment(self._lineage[1] if shares and self._lineage else None)
            if not self.async_save or nested:
                write, _ = save_collective(
                    self.group, url, state, metadata=full_metadata, overwrite=overwrite,
                    storage_options=self.storage_options, memo=self._memo,
                    increment=increment, replica=self._replica, before_publish=recheck,
                    parent_check=False, tidy=tidy,
                )
                checkpoint = write()
                self._advance(step, increment.next if increment else None)
                result = self._committed(step, url, checkpoint, started, None,
                                         retain=not nested and self.group.rank == 0)
                return SaveHandle(step, _done(result), time.perf_counter() - started)
            if self._writers is None:
                self._writers = self.group.private()
            write, stage = save_collective(
                self._writers, url, state, metadata=full_metadata, overwrite=overwrite,
                storage_options=self.storage_options, stager=self._stager, memo=self._memo,
                increment=increment, replica=self._replica, before_publish=recheck,
                parent_check=False, tidy=tidy,
            )
        except BaseException as exc:
            self._failed_to_share(exc)
            self._report_failure(url, step, started, exc)
            raise
        blocked: list[float] = []
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="safepoint-save")
        future = self._executor.submit(self._write_collective, step, url, write, increment,
                                       started, blocked)
        # In flight from here, as in `save`: an interrupt stops the writer, and the next save,
        # wait or close waits for it.
        handle = self._pending = SaveHandle(step, future, 0.0, parent)
        try:
            stage()
        except Exception:
            pass  # the writer reports it to every rank
        except BaseException:
            # An interrupt: the writer stops (and tells the other ranks); its error is this
            # one, so the next save, wait or close waits for it without raising it again.
            handle.reported = True
            raise
        blocked.append(time.perf_counter() - started)
        handle.blocked_seconds = blocked[0]
        return handle

    def _write_collective(
        self, step: int, url: str, write: Callable[[], CheckpointInfo],
        increment: Increment | None, started: float, blocked: list[float],
    ) -> StepInfo:
        try:
            checkpoint = write()
        except BaseException as exc:
            self._failed_to_share(exc)
            self._report_failure(url, step, started, exc)
            raise
        self._advance(step, increment.next if increment else None)
        return self._committed(step, url, checkpoint, started, blocked,
                               retain=self.group.rank == 0)

    def _background(
        self, step: int, prepared: PreparedSave, snapshot: Snapshot, started: float,
        blocked: list[float], tidy: bool,
    ) -> StepInfo:
        with prepared:
            try:
                return self._commit(step, prepared, snapshot, started, blocked, tidy=tidy)
            except BaseException as exc:
                snapshot.abort(exc)
                raise

    def _commit(
        self, step: int, prepared: PreparedSave, data: Any, started: float,
        blocked: list[float] | None, *, tidy: bool, retain: bool = True,
    ) -> StepInfo:
        """Write and commit a prepared save (`tidy`: see `_claim`), then record it (and apply
        retention when `retain`)."""
        try:
            # Before the write (not to write what cannot be committed) and after it, just
            # before the manifest is published: the lease may be lost while writing.
            self._check_lease(f"step {step} was not saved to {prepared.url} (nothing was "
                              "written)")
            increment = Increment(self._previous()) if self.incremental else None
            checkpoint = write_and_commit(
                prepared, data, increment,
                before_publish=lambda: self._check_lease(
                    f"step {step} was not committed to {prepared.url} (its data was removed)"),
                tidy=tidy)
            self._advance(step, increment.next if increment else None)
        except BaseException as exc:
            self._failed_to_share(exc)
            self._report_failure(prepared.url, step, started, exc)
            raise
        return self._committed(step, prepared.url, checkpoint, started, blocked, retain=retain)

    def _follow(self, step: int) -> None:
        """Let the next incremental save share with `step`, just restored whole (every block
        of it was read and checked), when its manifest records block hashes. In a group rank
        0 reads the manifest for all, so that every rank shares with the same commit."""
        url = self.step_url(step)

        def read(_: object) -> Manifest | bytes | None:
            storage = open_storage(url, self.storage_options)
            try:
                manifest = read_manifest(storage)
            except SafepointError as exc:
                logger.warning("cannot share with step %d of %s (%s); the next save writes "
                               "everything", step, self.root, exc)
                return None
            finally:
                storage.close()
            return manifest if self.group.solo else encode(manifest)

        document = exchange(self.group, lambda: None, read, what=f"restoring {url}",
                            consequence="the state was restored; restore again")
        lineage = None
        if document is not None:
            manifest = document if isinstance(document, Manifest) else decode(document, url)
            lineage = Lineage.of(url, manifest)
        self._advance(step, lineage)

    def _advance(self, step: int, lineage: Lineage | None) -> None:
        """Make `step`, just committed by an incremental save or restored, the one the next
        save shares with (`lineage`: its blocks); None (it recorded no hashes) leaves nothing
        to share with, since it may have replaced the step shared with before."""
        self._lineage = (step, lineage) if lineage is not None else None

    def _previous(self) -> Lineage | None:
        """What an incremental save shares with: the last commit while that step is still
        committed with every file it may share, from one listing of it. This manager alone
        writes while it holds the lease, but a file may be removed by hand or the step
        replaced (`sp.save`, `safepoint cp` or `import` with overwrite), or cut short: then
        the lineage is dropped and the save writes every block, rather than fail to link the
        file or link a damaged one."""
        if self._lineage is None:
            return None
        step, lineage = self._lineage
        name = step_name(step)
        try:
            held = set(self._storage.list(name))
        except FileNotFoundError:
            held = set()
        if f"{name}/{MANIFEST}" not in held:
            return None
        missing = sorted(file for file in lineage.files if f"{name}/{file}" not in held)
        if missing:
            self._drop_lineage(f"{self._url(step)} lacks {missing[0]}, which holds blocks "
                               "to share (removed, or the step replaced)")
            return None
        for file, nbytes in sorted(lineage.files.items()):
            try:
                size: int | str = self._storage.size(f"{name}/{file}")
            except (OSError, SafepointError) as exc:
                size = f"unknown ({exc})"
            if size != nbytes:  # cut short on disk: every step linking it would be too
                self._drop_lineage(f"{self._url(step)}/{file}, which holds blocks to share, "
                                   f"is {size} bytes, not the {nbytes} its manifest records")
                return None
        return lineage

    def _drop_lineage(self, why: str) -> None:
        """Share nothing with the last commit any more, `why` logged: the next incremental
        save writes every block (and the one after shares with it)."""
        if self._lineage is not None:
            logger.warning("%s; the next save to %s writes every block", why, self.root)
            self._lineage = None

    def _failed_to_share(self, exc: BaseException) -> None:
        """After an incremental save failed: when it found a file of the last commit
        missing or damaged (`Increment.share`), share nothing with that commit again."""
        if self.incremental and unreadable(exc):
            self._drop_lineage(f"an incremental save to {self.root} failed ({exc})")

    def _report_failure(self, url: str, step: object, started: float, exc: BaseException) -> None:
        """Report a save or restore that failed (an error event)."""
        self._emit(Event(ERROR, url, as_step(step), time.perf_counter() - started,
                         error=f"{type(exc).__name__}: {exc}"))

    def _committed(
        self, step: int, url: str, checkpoint: CheckpointInfo, started: float,
        blocked: list[float] | None, *, retain: bool,
    ) -> StepInfo:
        """Record a committed step, report it, and apply retention when `retain`."""
        seconds = time.perf_counter() - started
        result = StepInfo.of(step, checkpoint)
        with self._lock:
            self._generation += 1
            if self._known is not None:
                self._known[step] = result
        self._emit(Event(SAVE, url, step, seconds, blocked[0] if blocked else seconds,
                         checkpoint.nbytes))
        if not retain:
            return result
        try:
            self._retain(dry_run=False)
        except Exception as exc:
            logger.warning("retention under %s failed; the next save retries it", self.root,
                           exc_info=True)
            self._emit(Event(ERROR, self.root, step, error=f"retention failed: {exc}"))
        return result

    def _take_lease(self) -> None:
        """Take the lease on the first save; then clean up what crashed writers left, unless
        a `gc` that took the lease removed them (a dry run leaves them to this)."""
        if self._lease.held and self._tidied:
            return  # renewed in the background, and checked before each commit
        self._acquire()
        self._remove_leftovers(dry_run=False)

    def _acquire(self) -> None:
        """Take the lease, or renew it when held. Taking it forgets what this manager knew of
        the steps before it held the lease (another writer may have changed them since),
        leftovers included; a lease lost to another writer is not taken again (`Lease`)."""
        if not self._lease.held:
            with self._lock:
                self._known = self._occupied = None
                self._generation += 1
                self._tidied = False
        self._lease.acquire()

    def _check_lease(self, consequence: str) -> None:
        """Make sure this manager still holds the lease before it publishes or deletes.

        Raises:
            LeaseHeld: another writer took the lease over (this manager's renewals failed
                for `lease_seconds`), saying `consequence`.
        """
        try:
            self._lease.check()
        except LeaseHeld as exc:
            raise LeaseHeld(
                f"{consequence}: this checkpoint manager no longer holds the lease on "
                f"{self.root} ({exc}); a writer loses it when its renewals fail for longer "
                f"than lease_seconds={self._lease.seconds:g} (a storage outage, a stalled "
                "process) and another writer takes the root over",
                url=self.root,
            ) from exc

    def _claim(self, step: int, overwrite: bool) -> bool:
        """Note that `step`'s directory is about to hold this save's files (until the step
        is deleted), and say whether its commit must list the directory to remove what it
        replaces: only when the step is committed (`overwrite`: a rollback saves a number
        again) or its directory may hold files (this manager wrote that number before, the
        listing taken with the lease found some, or nothing is known). A new number's commit
        lists nothing: on an object store, no LIST request per save."""
        with self._lock:
            occupied = self._occupied
            tidy = overwrite or occupied is None or step in occupied
            if occupied is not None:
                occupied.add(step)
            self._unfinished.pop(step, None)  # its directory is this save's now
        return tidy

    def _records(self) -> dict[int, StepInfo]:
        """Every committed step's info: read once, then kept current by this manager's own
        commits and deletes while it holds the lease (no one else writes then)."""
        with self._lock:
            if self._known is not None:
                return dict(self._known)
            generation = self._generation
        known = self._infos(committed_steps(self._storage))  # only the lease holder retains
        if self._lease.held:
            with self._lock:  # unless a commit or delete made since it was listed
                if self._known is None and self._generation == generation:
                    self._known = known
        return dict(known)

    def _infos(self, steps: Iterable[int]) -> dict[int, StepInfo]:
        """The info of each of `steps` whose manifest can be read; the others are logged and
        left out (retention keeps them, a restore reports them if it tries them)."""
        def read(step: int) -> StepInfo | None:
            try:
                return self.metadata(step)
            except SafepointError as exc:
                logger.warning("step %d under %s is unreadable (%s)", step, self.root, exc)
                return None

        steps = list(steps)
        if len(steps) < 2:
            infos = [read(step) for step in steps]
        else:  # one request at a time would make a restore from an object store wait on each
            with ThreadPoolExecutor(min(len(steps), _MANIFEST_READERS),
                                    thread_name_prefix="safepoint-manifests") as pool:
                infos = list(pool.map(read, steps))
        return {step: found for step, found in zip(steps, infos, strict=True) if found}

    def _retain(self, dry_run: bool) -> tuple[list[int], dict[int, list[str]]]:
        records = self._records()
        kept = keep_reasons([r.record() for r in records.values()], self.policy)
        doomed = [step for step in records if step not in kept]
        if not dry_run and (doomed or self._unfinished):
            self._check_lease(f"retention under {self.root} deleted nothing")
            for step in doomed:
                self._delete_step(step, records[step].nbytes)
            for step in sorted(self._unfinished):  # a delete that failed midway before
                self._delete_data(step, time.perf_counter())
        return doomed, kept

    def _delete_step(self, step: int, nbytes: int) -> None:
        """Delete a committed step: its manifest first, so a crash midway leaves an
        uncommitted leftover, never half a checkpoint; then its data (`_delete_data`)."""
        started = time.perf_counter()
        self._storage.delete([f"{step_name(step)}/{MANIFEST}"])
        with self._lock:
            self._generation += 1
            if self._known is not None:
                self._known.pop(step, None)
            self._unfinished[step] = nbytes
        self._delete_data(step, started)

    def _delete_data(self, step: int, started: float) -> None:
        """Delete the files of `step`, whose manifest is deleted (`_unfinished`), and report
        the step deleted. When this fails (a transient storage error) the step stays in
        `_unfinished`, for the next retention; a step committed again meanwhile (`_claim`
        forgets it) or whose directory is gone is left as it is."""
        name = step_name(step)
        try:
            files = self._storage.list(name)
        except FileNotFoundError:
            files = []
        if f"{name}/{MANIFEST}" not in files:
            self._storage.delete(files)
        with self._lock:
            nbytes = self._unfinished.pop(step, None)
            if nbytes is None:
                return  # claimed again by a save while its files were deleted
            if self._occupied is not None:
                self._occupied.discard(step)
        seconds = time.perf_counter() - started
        self._emit(Event(DELETE, self.step_url(step), step, seconds, seconds, nbytes))

    def _remove_leftovers(self, dry_run: bool, thorough: bool = False) -> dict[int, list[str]]:
        """Files of saves that never committed (only the lease holder calls this, so none of
        them can belong to a save in progress): step directories without a manifest and
        temporary manifests; with `thorough`, also the data files of an interrupted overwrite
        that a committed step's manifest does not reference (its manifest is read). The
        listing also says which steps' directories hold files (for `_claim`)."""
        try:
            files = self._storage.list("")
        except FileNotFoundError:
            files = []
        grouped = _group(files)
        found: dict[int, list[str]] = {}
        for step, paths in grouped.items():
            name = step_name(step)
            if f"{name}/{MANIFEST}" not in paths:
                stale = paths
            elif thorough:
                stale = self._unreferenced(step)
            else:
                stale = [p for p in paths if p.startswith(f"{name}/{MANIFEST}.tmp")]
            if stale:
                found[step] = stale
        if not dry_run:
            for step, stale in found.items():
                started = time.perf_counter()
                self._storage.delete(stale)
                seconds = time.perf_counter() - started
                self._emit(Event(DELETE, self.step_url(step), step, seconds, seconds))
        occupied = set(grouped) if dry_run else set(steps_among(files))
        with self._lock:
            self._occupied = occupied
            self._tidied = self._tidied or not dry_run
        return found

    def _unreferenced(self, step: int) -> list[str]:
        """Files under a committed step that its manifest does not reference (none when the
        manifest cannot be read: such a step is the caller's to inspect)."""
        try:
            return self._examine(step)[1]
        except SafepointError:
            return []

    def _examine(self, step: int) -> tuple[StepInfo, list[str]]:
        """A committed step's `metadata` and the files under it (root-relative) that its
        manifest does not reference (a killed overwrite's data, which `gc` removes), from one
        read of its manifest (`safepoint ls`).

        Raises:
            CheckpointNotFound: `step` is not committed.
            SafepointError: its manifest cannot be read.
        """
        step = check_step(step)
        described, stale = examine(self._url(step), self.storage_options)
        return (StepInfo.of(step, described), [f"{step_name(step)}/{path}" for path in stale])

    def gc(self, *, dry_run: bool = False) -> GCReport:
        """Remove leftovers of crashed saves and apply the retention policy now (takes the
        lease, as a writer; in a process group, rank 0 does it and every rank gets the report).

        Raises:
            LeaseHeld: another writer holds the root.
        """
        self._check_open()
        self._raise_pending_everywhere(f"collecting {self.root}")

        def collect(_: object) -> GCReport:  # on rank 0 only in a group
            self._acquire()
            orphans = self._remove_leftovers(dry_run, thorough=True)
            deleted, kept = self._retain(dry_run)
            return GCReport(deleted, orphans, kept)

        report: GCReport = exchange(self.group, lambda: None, collect,
                                    what=f"collecting garbage under {self.root}",
                                    consequence="nothing was deleted")
        return report

    def kept(self) -> dict[int, list[str]]:
        """Why each committed step is kept under this manager's policy (see `gc`)."""
        return keep_reasons([r.record() for r in self._records().values()], self.policy)

    # -- waiting and closing -----------------------------------------------------------------

    def _settle_pending(self) -> tuple[BaseException | None, bool]:
        """Wait for the save in flight: its error (None when it succeeded or there was none)
        and whether that is still to be raised (its handle did not raise it; the caller
        raises or logs it, and it is not returned again). The save stays in flight until the
        wait returns: an interrupt leaves it to the next call. A save started meanwhile (by
        a signal handler that interrupted the wait) is waited for too: its writer may still
        be reading the staging memory the next save fills. Of two failures, the one still
        to be raised is returned and the other logged."""
        failures: list[tuple[BaseException, bool]] = []
        while (pending := self._pending) is not None:
            error = pending._future.exception()
            if self._pending is pending:
                self._pending = None
            if error is not None:
                self._save_failed(pending.step, pending._parent)
                failures.append((error, not pending.reported))
                pending.reported = True
        if not failures:
            return None, False
        failures.sort(key=lambda failure: not failure[1])  # the one still to be raised first
        for error, unreported in failures[1:]:
            if unreported:
                logger.error("a save to %s failed", self.root, exc_info=error)
        return failures[0]

    def _raise_pending(self) -> None:
        """Wait for the save in flight; raise its error unless its handle already did."""
        error, unreported = self._settle_pending()
        if unreported:
            assert error is not None
            raise error

    def _raise_pending_everywhere(self, what: str) -> None:
        """`_raise_pending`, on every rank alike in a group (one exchange): when the save in
        flight failed unreported on some rank, each rank raises its own error of that save
        (one that read it from its handle again). A rank that read it from its handle (the
        usual `if rank == 0: handle.result()`) would otherwise go on alone into the next
        collective while the others raise, and wait out the group's timeout."""
        error, unreported = self._settle_pending()
        told: list[bool] = exchange(self.group, lambda: unreported, lambda flags: flags,
                                    what=what, consequence="nothing was changed")
        if any(told):
            raise error or SafepointError(
                f"the previous save to {self.root} failed on rank(s) "
                f"{[rank for rank, failed in enumerate(told) if failed]}: see their error, "
                "then save again")

    def wait(self) -> None:
        """Wait for the save in flight to commit (in a group, a collective call).

        Raises:
            whatever it raised (in a group, on every rank: see `_raise_pending_everywhere`).
        """
        self._raise_pending_everywhere(f"waiting for the save to {self.root}")

    def _finish_before_exit(self) -> None:
        """At interpreter exit: wait for the save in flight (so that it commits, and its
        retention runs) and log its error, which no caller is left to raise."""
        error, unreported = self._settle_pending()
        if unreported:
            logger.error("the save in flight to %s when the interpreter exited failed",
                         self.root, exc_info=error)

    def _check_open(self) -> None:
        if self._closed:
            raise SafepointError(f"the checkpoint manager of {self.root} is closed")

    def close(self) -> None:
        """Wait for the save in flight, release the lease and the staging memory.

        Raises:
            the error of the save in flight, if it failed (everything is released anyway).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._raise_pending()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._lease.release()
            if self._stager is not None:
                self._stager.release()
            self._storage.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # the block's own exception is the one to see
            logger.exception("closing the checkpoint manager of %s after an error", self.root)

    def _emit(self, event: Event) -> None:
        emit(event, self._callbacks)


#: Every manager alive, for `_finish_before_exit`.
_live: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _finish_before_exit() -> None:
    """Finish every manager's save in flight and uploads before the interpreter exits, as
    `close` would, for a script that returns right after `save`. They need thread pools
    (an S3 multipart upload, reading manifests for retention), which refuse work once
    concurrent.futures' own exit hook ran: this one, registered after it, runs before it."""
    for manager in list(_live):
        try:
            manager._finish_before_exit()
        except Exception:
            logger.exception("finishing the work of the manager of %s at exit", manager.root)


threading._register_atexit(_finish_before_exit)  # type: ignore[attr-defined]
# A forked child (a DataLoader worker) inherits the managers but not their threads: at its
# exit it would wait forever for a save or upload running only in the parent.
os.register_at_fork(after_in_child=_live.clear)


# `__new__` picks the class, `__init__` takes the options: show those (help(), IDEs), not
# `__new__`'s (root, *, local_dir, **options).
_INIT = inspect.signature(CheckpointManager.__init__)
CheckpointManager.__signature__ = _INIT.replace(  # type: ignore[attr-defined]
    parameters=list(_INIT.parameters.values())[1:], return_annotation=inspect.Signature.empty
)


def _with_record(metadata: dict[str, Any] | None, recorded: dict[str, Any]) -> dict[str, Any]:
    """The user's `metadata` with the manager's record of the step.

    Raises:
        UnsupportedLeaf: `metadata` is not a dict (as `sp.save` refuses it).
    """
    if metadata is not None and not isinstance(metadata, Mapping):
        raise metadata_not_a_dict(metadata)
    return {**(metadata or {}), MANAGER_KEY: recorded}


def _metric(value: Any) -> Any:
    """`value` as recorded: a 0-d tensor or array or a NumPy scalar as its Python number, a
    float that is not finite as None."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _checked_metrics(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """JSON-able metrics; a 0-d tensor or array, or a NumPy scalar (a loss as training code
    holds it) as its Python number; NaN and infinities become None (recorded, never best)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise UnsupportedLeaf("metrics must be a dict with str keys", path="<metrics>")
    metrics = {name: _metric(value) for name, value in metrics.items()}
    try:
        json.dumps(metrics, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise UnsupportedLeaf(
            f"metrics are not JSON ({exc}): pass numbers (finite), str, bool or None, e.g. "
            "metrics={'loss': float(loss)}", path="<metrics>",
        ) from exc
    return metrics

