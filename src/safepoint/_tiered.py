"""Two tiers: `CheckpointManager(root, local_dir=...)` commits every step to a fast local
directory first, so training unblocks at local-disk speed, then uploads it to `root` (an
object store, a shared filesystem: any URL) in the background (manager layer).

- Uploads are verified copies (every block checked against the manifest's checksums, as
  `sp.copy` does), the remote manifest published last, so a half-uploaded step is invisible
  remotely.
- A failed upload is reported (an "error" event per attempt) and retried with backoff; a step
  that still fails stays in `local_dir` and is tried again at the next `save`, at `wait` and at
  `close`, which raises if it never made it. Steps left in `local_dir` by a run that died
  before uploading them are uploaded when a manager opens it again, unless the remote root
  holds a later save of that step (the local copy is stale: the job ran on another host since).
- Retention: the manager's policy (`keep_last`, `keep_every`, `keep_best`, ...) applies to
  `root`; `local_dir` keeps the newest `keep_local` steps, plus every step not uploaded yet (a
  local step is removed only once the remote root committed the same save of it, or holds a
  later save of it: a stale copy). A step waiting for upload that the policy would delete at
  once, given the steps committed there and the newer ones waiting, is not uploaded but
  removed (superseded), so `local_dir` stays bounded while the remote root lags behind the
  saves or is down. Local retention runs in the uploader thread: no save reads the remote
  root's manifests.
- `restore` prefers the local copy of a step and falls back to the remote one when the local
  copy is missing, fails its checksums, cannot be read (its disk failed) or is stale.
- `local_dir` records its remote root (`remote.json`) on first use; a manager of another root
  refuses it: its steps are another job's.

Under torch.distributed the manager is collective, like `CheckpointManager`. When it is made,
the ranks find out which of them share a `local_dir` (each leaves a marker file there, the
markers' names are exchanged, and each rank reports the markers it sees): the ranks that see
each other's markers are a *node* (a host with its own local disk; "sees" must be an
equivalence, else every rank raises `DistributedError`), and the lowest rank of a node is its
*leader*. Every rank writes its pieces of each step into its node's `local_dir` and rank 0
commits the step there.

- One node (the local disk of a single-host job, or a filesystem every host mounts): rank 0
  alone uploads each step (a verified `sp.copy`), applies retention to both tiers and holds the
  leases, all without any collective.
- Several nodes (a node-local disk on each host): a node's local step holds only the data
  files its ranks wrote, plus the whole manifest, which each other node's leader publishes in
  its `local_dir` (the same bytes) once rank 0 committed, i.e. once every rank's files are
  durable; a save whose leader fails to do so raises on every rank. Such a *partial* local step
  is a step of the local tier on that node: it is listed, kept and removed like a whole one; a
  step counts as committed locally (for `steps`, `restore` and uploads) when every node holds
  it. `sp.verify` on one reports the other nodes' files as missing (verify the remote copy,
  which is whole). Each node's leader uploads its node's files (verified copies) in a
  background thread, then leaves a small *marker* (`node-<leader>.json`: the save id and the
  files) in the remote step directory; rank 0's uploader polls for the other nodes' markers
  and publishes the remote manifest only when every node's marker of that save is there and
  together they cover every data file, then removes the markers. The uploader threads take
  part in no collective (a thread racing the training loop's collectives deadlocks; a group of
  their own would need every node to upload the same steps in the same order, retries
  included, and time out while one node uploads a large step): markers need nothing but the
  remote store, and they survive a restart. Rank 0 holds the remote root's lease from when the
  manager is made, and removes there, before any node uploads, what a dead run left (step
  directories without a manifest: half-uploaded files and markers), as for any leftover.
  Which steps are committed remotely, and which rank 0 skipped as superseded (it alone
  decides, so every node agrees), reaches the other nodes' leaders (for their retention) at
  each `save` and `wait`; a leader then removes from the remote root what it uploaded of a
  skipped step, and no longer uploads it. Each node's leader holds the lease of its own
  `local_dir` and removes leftovers of crashed saves there. `wait` and `close` gather every
  node's failures: they raise on every rank, and rank 0 publishes every step whose files all
  arrived.
  `restore` reads each data file from the rank's own node when it holds the step (whole or
  partial), else from the remote root: the other nodes' files, or everything on a node that
  lost its `local_dir` (a replaced host); every rank reads the remote copy alone when some
  node's copy is stale. `incremental=True` is refused with several nodes:
  the files a step shares with the one before would have to be linked on each node.

`steps`, `restore`, `wait` and `close` are collective and agree on rank 0's view.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ._api import CheckpointInfo, Progress, _publish, info, load_from
from ._commit import document_at, manifest_at, read_manifest
from ._copy import copy_checkpoint, copy_files
from ._dist import exchange, group_for
from ._events import ERROR, LOAD, Event, EventCallback, callbacks
from ._format import MANIFEST, Manifest, decode
from ._leaves import whole_number
from ._manager import (
    _RESTORE_TRIES,
    CheckpointManager,
    GCReport,
    SaveHandle,
    StepInfo,
    _vanished,
    committed_steps,
    failed_with,
    unreadable,
)
from ._names import as_step
from ._retention import Policy, StepRecord, keep_reasons
from ._storage_fsspec import jitter
from ._storage_local import location
from .errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
    DistributedError,
    SafepointError,
    StorageError,
)
from .storage import Buffer, Storage, open_storage

__all__ = ["UPLOAD", "TieredManager", "nodes_of"]

logger = logging.getLogger(__name__)

#: The event kind of a step uploaded to the remote root.
UPLOAD = "upload"

#: The file in `local_dir` recording the remote root its steps belong to (JSON: {"root"}).
_ROOT_RECORD = "remote.json"

Node = tuple[int, ...]


def _apart(root: str, local_dir: str) -> None:
    """Refuse a `local_dir` that is the remote root or lies inside it, or holds it: each
    tier's retention would delete the other's steps, and a step "uploaded" onto itself has
    no second copy. Local paths are compared with their symbolic links resolved (those of
    the parts that exist yet): `/scratch/run1`, with `/scratch -> /shared`, is
    `/shared/run1`.

    Raises:
        SafepointError: naming both, saying to pass directories apart.
    """
    paths = []
    for url in (root, local_dir):
        place = location(str(url))
        paths.append(os.path.realpath(place) if os.path.isabs(place) else place)
    a, b = sorted(paths, key=len)
    if b == a or b.startswith(a + "/"):
        raise SafepointError(
            f"CheckpointManager({root!r}, local_dir={local_dir!r}): the local directory and "
            "the root overlap (symbolic links followed), so each tier's retention would delete "
            "the other's steps and no step would have a second copy: pass a local_dir outside "
            "the root (a node-local disk such as /local_nvme/ckpt/RUN) and a root outside it",
            url=str(local_dir),
        )


def nodes_of(seen: Sequence[Iterable[int]], local_dir: str) -> list[Node]:
    """The nodes (groups of ranks sharing a local_dir, ascending) from what each rank saw:
    `seen[rank]` holds the ranks whose marker it found in its local_dir.

    Raises:
        DistributedError: "sees" is not an equivalence (a rank misses its own marker, or two
            ranks disagree on who shares their directory).
    """
    views = [tuple(sorted(set(ranks))) for ranks in seen]
    for rank, view in enumerate(views):
        others = [o for o in view if views[o] != view]
        if rank in view and not others:
            continue
        problem = (f"rank {rank} does not see its own marker" if rank not in view else
                   f"rank {rank} sees the markers of ranks {list(view)} but rank {others[0]} "
                   f"sees those of ranks {list(views[others[0]])}")
        raise DistributedError(
            f"the ranks do not agree on who shares local_dir {local_dir}: {problem}; the ranks "
            "of a host must share one local_dir and no two hosts' local_dirs may overlap: pass "
            "a directory on each host's own disk (the same path on every host is fine), or "
            "one directory every host mounts",
            url=local_dir, failures={rank: problem},
        )
    return sorted(set(views))


def _local_copy_failed(exc: BaseException) -> bool:
    """Whether `restore` reads the remote copy of a step whose local restore raised `exc`:
    the local copy is missing, corrupt, or its disk failed to read it (a `StorageError`),
    here or on every rank that failed. A mismatch with the state, a pickle refused and the
    like are the caller's to fix, whichever copy is read."""
    return failed_with(exc, CorruptCheckpoint, CheckpointNotFound, StorageError)


def _marker(leader: int) -> str:
    """The name, in a remote step directory, of the marker of the node led by `leader`."""
    return f"node-{leader}.json"


class _LocalFirst:
    """A read-only `Storage` over one step: each file from the node-local copy when it is
    there, else from the remote one (the files other nodes wrote, or all of them on a node
    that lost its copy). Its URL is the local copy's when that holds the manifest.

    Attributes:
        from_remote: whether some file was read from the remote copy (the local one lacks
            it, so an incremental save cannot share it from there).
    """

    def __init__(self, local: Storage, remote: Storage) -> None:
        self.local = local
        self.remote = remote
        self.url = local.url if local.exists(MANIFEST) else remote.url
        self.from_remote = False

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        try:
            return self.local.read(path, start, end)
        except FileNotFoundError:
            self.from_remote = True
            return self.remote.read(path, start, end)

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        try:
            self.local.readinto(path, offset, buffers)
        except FileNotFoundError:
            self.from_remote = True
            self.remote.readinto(path, offset, buffers)

    def size(self, path: str) -> int:
        try:
            return self.local.size(path)
        except FileNotFoundError:
            self.from_remote = True
            return self.remote.size(path)

    def list(self, prefix: str = "") -> list[str]:
        found: set[str] = set()
        for storage in (self.local, self.remote):
            try:
                found.update(storage.list(prefix))
            except FileNotFoundError:
                continue
        return sorted(found)

    def exists(self, path: str) -> bool:
        return self.local.exists(path) or self.remote.exists(path)

    def _refuse(self) -> StorageError:
        return StorageError(f"{self.url} is opened for reading a step only", url=self.url)

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        raise self._refuse()

    def delete(self, paths: Iterable[str]) -> None:
        raise self._refuse()

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        raise self._refuse()

    def close(self) -> None:
        self.local.close()
        self.remote.close()


class TieredManager(CheckpointManager):
    """A `CheckpointManager` whose steps are committed in `local_dir` and uploaded to `root`.

    Made by `CheckpointManager(root, local_dir=...)`; the arguments are the manager's, plus:

    Args:
        local_dir: a fast local directory where each step is committed first; in a process
            group, the ranks sharing it are a node (see the module docstring): the same
            directory for every rank of a host, a different disk per host.
        keep_local: how many of the newest uploaded steps stay in `local_dir`.
        incremental: as the manager's, for the local tier: each step's unchanged blocks are
            shared with the step before in `local_dir`; the upload copies every file of a
            step, so each remote step is complete. Not with several nodes.

    Raises:
        DistributedError: in a process group, the ranks disagree on who shares a local_dir
            (on every rank; nothing is uploaded or deleted).
        SafepointError: `incremental=True` with several nodes (on every rank).
        LeaseHeld: with several nodes, another writer holds the remote root or a node's
            local_dir.

    Attributes:
        remote: the manager of `root` (listing and restore of the remote copies).
        nodes: the nodes, each a tuple of ranks, ascending (one node for a solo process).
        upload_attempts: tries per upload round before the step waits for the next round.
        upload_backoff_s: the cap of the first wait between tries (doubled each time).
        upload_poll_s: with several nodes, how often rank 0 looks for the other nodes'
            markers of the steps it is waiting to publish.
    """

    _shared_root = False  # each node's local_dir; the remote manager compares the roots
    upload_attempts = 4
    upload_backoff_s = 1.0
    upload_poll_s = 0.5

    def __init__(
        self,
        root: str,
        *,
        local_dir: str,
        keep_local: int = 1,
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
        process_group: Any = None,
        dist: bool | None = None,
        incremental: bool = False,
    ) -> None:
        made: list[list[EventCallback]] = []

        def check() -> None:  # on every rank: one rank's bad option raises on all
            nonlocal keep_local
            keep_local = whole_number("keep_local", keep_local, least=1)
            _apart(root, local_dir)
            made.append(callbacks(on_event))  # once: a generator would reach one manager only

        exchange(group_for(process_group, dist), check, lambda _: None,
                 what=f"making the two-tier manager of {root}", consequence="no manager was made")
        on_event = made[0]
        remote_options: dict[str, Any] = dict(
            keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
            best_metric=best_metric, best_mode=best_mode, async_save=False,
            keep_every_seconds=keep_every_seconds, on_event=on_event, fallback=fallback,
            storage_options=storage_options, lease_seconds=lease_seconds,
        )
        self.remote = CheckpointManager(root, process_group=process_group, dist=dist,
                                        **remote_options)
        try:
            super().__init__(
                local_dir, keep_last=None, async_save=async_save,
                max_staging_bytes=max_staging_bytes, on_event=on_event, fallback=fallback,
                lease_seconds=lease_seconds, process_group=process_group, dist=dist,
                incremental=incremental,
            )
        except BaseException:
            self.remote.close()
            raise
        self.remote_root = self.remote.root
        self.keep_local = keep_local
        #: Where rank 0's uploader applies retention (outside the group: the uploader's
        #: thread must take part in no collective); None on the other ranks.
        self._uploads: CheckpointManager | None = self.remote
        self._queue: list[int] = []
        self._failed: dict[int, str] = {}
        self._uploaded: dict[int, str] = {}  # step -> the save id committed remotely
        #: step -> its save that rank 0 did not upload, superseded (`_superseded`); the other
        #: nodes' leaders learn them with `_uploaded`, and local retention removes them.
        self._skipped: dict[int, str] = {}
        #: step -> the save of this node's copy that the remote root holds a later save of
        #: (stale): never uploaded nor restored, so local retention removes it.
        self._stale_copies: dict[int, str] = {}
        #: Several nodes, a leader but rank 0: step -> (save id, files) of the steps whose
        #: files and marker this node left in the remote root, until rank 0 publishes or
        #: skips them (then this node removes them from there).
        self._sent: dict[int, tuple[str, list[str]]] = {}
        #: Rank 0: step -> its local save's info, for the steps committed locally and not
        #: uploaded yet (what remote retention will see of them: `_superseded`).
        self._waiting: dict[int, CheckpointInfo] = {}
        #: Rank 0: the remote root's committed steps as last read (used while it cannot be).
        self._remote_seen: dict[int, StepRecord] | None = None
        #: Rank 0, several nodes: step -> (save id, manifest bytes, rank 0's node's files)
        #: of the steps uploaded from rank 0's node, waiting for the other nodes' markers.
        self._awaiting: dict[int, tuple[str, bytes, list[str]]] = {}
        self._changed = threading.Condition()
        self._publishing = threading.Lock()
        self._retaining = threading.Lock()
        #: Steps being saved in `local_dir` now: local retention leaves them alone (a step
        #: saved again after a rollback still has its old manifest while it is written).
        self._writing: Counter[int | None] = Counter()
        self._busy = False
        self._stopping = False
        self._uploader: threading.Thread | None = None
        try:
            self.nodes = self._find_nodes()
            self._spread = len(self.nodes) > 1
            self.leader = any(node[0] == self.group.rank for node in self.nodes)
            if self._spread and incremental:
                raise SafepointError(
                    f"CheckpointManager({self.remote_root!r}, local_dir={self.root!r}, "
                    f"incremental=True): the ranks are on {len(self.nodes)} nodes, each with "
                    "its own local_dir, and incremental saves are not supported there (each "
                    "node would link its own ranks' shared files); pass incremental=False, "
                    "or a local_dir every host mounts", url=self.root,
                )
            if not self.group.solo:
                self._uploads = (CheckpointManager(root, dist=False, **remote_options)
                                 if self.group.rank == 0 else None)
            if self._spread:
                self._replica = self.leader and self.group.rank != 0
            pending = self._open_tiers()
        except BaseException:
            if self._uploads is not None and self._uploads is not self.remote:
                self._uploads.close()
            CheckpointManager.close(self)
            self.remote.close()
            raise
        if self.leader:
            self._uploader = threading.Thread(target=_upload_loop, args=(weakref.ref(self),),
                                              daemon=True, name="safepoint-upload")
            self._uploader.start()
            for step in pending:  # a previous run may have died mid-upload
                self._enqueue(step)

    def _recorded_policy(self) -> Policy:
        """The user's policy, the remote root's: each step's manifest is uploaded as it is,
        and the local tier's own policy (keep everything; `keep_local` applies) is no one's
        to record."""
        return self.remote.policy

    def _find_nodes(self) -> list[Node]:
        """Which ranks share this rank's `local_dir`: every rank leaves a marker there, the
        markers' names are exchanged, and each rank reports which it sees (see `nodes_of`)."""
        if self.group.solo:
            return [(0,)]
        marker = f".node-{uuid.uuid4().hex}"

        def leave() -> str:
            self._storage.publish(marker, b"", overwrite=False)
            return marker

        try:
            markers: list[str] = exchange(
                self.group, leave, lambda names: names, what=f"opening {self.root}",
                consequence="no manager was made")

            def look() -> list[int]:
                return [rank for rank, name in enumerate(markers) if self._storage.exists(name)]

            nodes: list[Node] = exchange(
                self.group, look, lambda seen: nodes_of(seen, self.root),
                what=f"finding which ranks share local_dir {self.root}",
                consequence="no manager was made")
        finally:
            self._storage.delete([marker])
        return nodes

    def _open_tiers(self) -> list[int]:
        """With several nodes, take the leases (each node's leader its `local_dir`'s, rank 0
        the remote root's) and remove what dead runs left, before any node uploads. Returns
        the steps committed in every node's `local_dir` (to upload: they may not be yet)."""

        def prepare() -> list[int]:
            if self.leader:  # before its lease, whose taking removes leftovers there
                self._claim_local_dir()
            if self._spread and self.leader:
                self._take_lease()
            if self._spread and self._uploads is not None:
                self._uploads._take_lease()
            return committed_steps(self._storage)

        steps: list[int] = exchange(self.group, prepare, _everywhere,
                                    what=f"opening {self.root}",
                                    consequence="no manager was made")
        return steps

    def _claim_local_dir(self) -> None:
        """Record the remote root in `local_dir` on first use, and refuse a `local_dir` that
        records another: its steps are another job's (the same node-local path in every
        job's config, and a job requeued on a node another job used), which this manager
        would restore, upload to its own root and then retain there in place of its own.
        A `local_dir` with steps but no record (an earlier safepoint's) is adopted. Roots
        are compared as the places they name (`location`), so a requeued job whose config
        spells its root another way ("s3://b/run/" for "s3://b/run") is not refused; an
        earlier safepoint's record, the root as the user spelled it, compares the same way.

        Raises:
            SafepointError: `local_dir` records another remote root, or its record is damaged.
        """
        record = f"{self.root.rstrip('/')}/{_ROOT_RECORD}"
        try:
            recorded = self._recorded_root(record)
        except FileNotFoundError:
            adopted = committed_steps(self._storage)
            try:
                self._storage.publish(_ROOT_RECORD, json.dumps(
                    {"root": location(self.remote_root)}).encode(), overwrite=False)
            except FileExistsError:  # another manager recorded its root meanwhile
                recorded = self._recorded_root(record)
            else:
                if adopted:
                    logger.info("%s holds steps %s but records no remote root (an earlier "
                                "safepoint's): recorded %s as theirs in %s", self.root,
                                adopted, self.remote_root, record)
                return
        if location(recorded) != location(self.remote_root):
            raise SafepointError(
                f"local_dir {self.root} belongs to another run: {record} records its remote "
                f"root as {recorded}, not {self.remote_root}, and its steps would be restored "
                f"and uploaded as this run's; give each job its own local_dir (e.g. with the "
                f"job id in its path), or empty {self.root} once its steps are uploaded to "
                f"{recorded}", url=self.root,
            )

    def _recorded_root(self, record: str) -> str:
        """The remote root recorded in `local_dir` (at `record`).

        Raises:
            FileNotFoundError: there is no record.
            SafepointError: the record is damaged.
        """
        try:
            recorded = json.loads(self._storage.read(_ROOT_RECORD))["root"]
            if not isinstance(recorded, str):
                raise TypeError(f"its root is {recorded!r}, not a URL")
        except (ValueError, KeyError, TypeError) as exc:
            raise SafepointError(
                f"{record} (the remote root local_dir {self.root} belongs to) is damaged "
                f"({exc}): delete it if the steps in {self.root} are this run's",
                url=self.root) from exc
        return recorded

    def _local_steps(self) -> tuple[list[int], list[int]]:
        """The steps committed in every node's `local_dir`, and those in some node's."""
        steps: tuple[list[int], list[int]] = exchange(
            self.group, lambda: committed_steps(self._storage),
            lambda found: (_everywhere(found), sorted({s for steps in found for s in steps})),
            what=f"listing {self.root}", consequence="nothing was changed")
        return steps

    # -- uploading ---------------------------------------------------------------------------

    def _enqueue(self, step: int) -> None:
        with self._changed:
            if step not in self._queue:
                self._queue.append(step)
                self._changed.notify_all()

    def _upload_next(self) -> bool:
        """Upload the next step queued (rank 0 with several nodes: then publish the steps
        whose markers are all in), waiting for one at most `_IDLE_S`, or `upload_poll_s`
        while steps await markers. False once closing with nothing left to upload."""
        with self._changed:
            timeout = self.upload_poll_s if self._awaiting else _IDLE_S
            if (not self._changed.wait_for(lambda: self._queue or self._stopping, timeout)
                    and not self._awaiting):
                return True
            if not self._queue and self._stopping:
                return False
            step = self._queue.pop(0) if self._queue else None
            self._busy = True
        try:
            if step is not None:
                superseded = self._superseded(step) if self._uploads is not None else None
                if superseded is None:
                    self._upload(step)
                else:
                    self._skip(step, superseded)
            if self._awaiting:
                self._publish_ready()
        except BaseException:  # a bug: report it rather than lose the step silently
            logger.exception("uploading step %s to %s failed", step, self.remote_root)
            if step is not None:
                with self._changed:
                    self._failed[step] = "the uploader failed; see the log"
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()
        return True

    def _upload(self, step: int) -> None:
        """Upload `step` (its node's files, with several nodes), retrying with backoff."""
        target = self.remote.step_url(step)
        for attempt in range(1, self.upload_attempts + 1):
            started = time.perf_counter()
            try:
                nbytes = self._send_files(step) if self._spread else self._copy_step(step)
            except CheckpointNotFound:  # deleted locally meanwhile: nothing left to upload
                with self._changed:
                    self._failed.pop(step, None)
                    self._waiting.pop(step, None)
                return
            except Exception as exc:
                if isinstance(exc, CorruptCheckpoint):
                    # A damaged local file: an incremental save that shared it would link
                    # it again, and every later upload would fail on it.
                    self._drop_lineage(f"uploading step {step} found damage in {self.root}")
                error = f"upload attempt {attempt} of {self.upload_attempts} failed: " \
                        f"{type(exc).__name__}: {exc}"
                self._emit(Event(ERROR, target, step, time.perf_counter() - started,
                                 error=error))
                with self._changed:
                    self._failed[step] = error
                    given_up = attempt == self.upload_attempts or self._stopping
                if given_up:  # until the next round; older steps may go meanwhile
                    self._retain_local()
                    return
                with self._changed:
                    wait = jitter.uniform(0.5, 1.0) * self.upload_backoff_s * 2 ** (attempt - 1)
                    self._changed.wait_for(lambda: self._stopping, timeout=wait)
                continue
            with self._changed:
                self._failed.pop(step, None)
            if nbytes is None:  # the remote root held this save, or a later one: nothing written
                self._retain_local()  # (or rank 0 skipped it): the local copy may go
                return
            if not self._spread:
                seconds = time.perf_counter() - started
                self._emit(Event(UPLOAD, target, step, seconds, 0.0, nbytes))
                self._retain_both()
            else:
                self._retain_local()
            return

    def _superseded(self, step: int) -> str | None:
        """Rank 0 (or a single process), before uploading `step`: the save id of its local
        copy when the remote root's retention policy would delete it at once, applied to
        the steps committed there plus the local steps waiting to be uploaded (queued,
        failed, awaiting other nodes' markers, and `step`): newer steps make it one no rule
        keeps, so uploading it is wasted, and keeping it in `local_dir` until then lets
        `local_dir` grow without bound while the remote root is slower than the saves (or
        down). None when some rule keeps it, when the remote root holds a save of `step`
        (after a rollback, an older one that its own metrics or time may keep: the upload
        replaces it), or while which steps the remote root holds was never learnt (it could
        not be listed since the manager was made).

        A step no rule keeps stays unkept whatever later saves commit (later steps only push
        a step out of `keep_last` and `keep_best`, and `keep_every_seconds` and `keep_every`
        decide by what came before), and dropping unkept steps changes no other step's
        reasons, so every later decision agrees with this one."""
        if self.remote.policy.keep_last is None:  # every step is kept: nothing to read
            return None
        with self._changed:  # the steps committed by now, before reading the remote root
            waiting = {step, *self._queue, *self._failed, *self._awaiting}
            self._waiting = {s: found for s, found in self._waiting.items() if s in waiting}
            known = dict(self._waiting)
        remote = self._remote_records()
        if remote is None or step in remote:
            return None
        for other in waiting - set(known):  # left by a dead run: read once
            try:
                known[other] = info(self.step_url(other))
            except SafepointError:
                continue  # gone or unreadable: its upload says so
            with self._changed:
                self._waiting.setdefault(other, known[other])
        if step not in known:
            return None
        try:
            records = {**remote, **{s: StepInfo.of(s, found).record()
                                    for s, found in known.items()}}
        except ValueError:  # a commit time that is no ISO 8601: upload as before
            return None
        if step in keep_reasons(list(records.values()), self.remote.policy):
            return None
        return known[step].save_id

    def _remote_records(self) -> dict[int, StepRecord] | None:
        """Rank 0: what retention knows of the steps committed in the remote root (read
        once and kept current while the uploads hold its lease); the last known while it
        cannot be listed; None when it never could be."""
        uploads = self._uploads
        assert uploads is not None
        try:
            records = {s: found.record() for s, found in uploads._records().items()}
        except (SafepointError, ValueError):  # an outage, a commit time that is no ISO 8601
            return self._remote_seen
        self._remote_seen = records
        return records

    def _skip(self, step: int, save_id: str) -> None:
        """Rank 0: do not upload `step` (its save `save_id`), superseded; local retention
        removes it (on the other nodes once they learn it, at the next `save` or `wait`)."""
        logger.info(
            "step %d in %s is not uploaded to %s: newer steps are committed, and the "
            "retention policy there would delete it at once (superseded); %s keeps it "
            "only while keep_local=%d does", step, self.root, self.remote_root, self.root,
            self.keep_local)
        with self._changed:
            self._skipped[step] = save_id
            self._failed.pop(step, None)
            self._waiting.pop(step, None)
        self._retain_local()

    def _nothing_to_upload(self, step: int, local: Manifest, there: Manifest | None) -> bool:
        """Whether the remote root's save of `step` (`there`, None when it holds none)
        makes uploading the local one (`local`) needless or wrong: it is the same save (a
        restart), or a later save of that step number (from a host that ran the job after
        this one: the local copy is stale, and uploading it would replace a newer committed
        step). The remote save is then recorded as uploaded, and a stale copy as stale, so
        that local retention removes the local copy: a stale copy is never uploaded nor
        restored."""
        if there is None or (there.save_id != local.save_id
                             and there.created <= local.created):
            return False
        if there.save_id != local.save_id:
            logger.warning(
                "step %d in %s (saved %s) is older than the one at %s (saved %s): not "
                "uploaded, and removed from %s", step, self.root, local.created,
                self.remote_root, there.created, self.root)
        with self._changed:
            self._uploaded[step] = there.save_id
            self._waiting.pop(step, None)
            if there.save_id != local.save_id:
                self._stale_copies[step] = local.save_id
        return True

    def _copy_step(self, step: int) -> int | None:
        """One node: copy `step` whole to the remote root, as the writer holding its lease.
        Returns the bytes copied, or None when the remote root holds that save already, or a
        later one of that step (then nothing is written, and no lease is needed)."""
        uploads = self._uploads
        assert uploads is not None
        source, target = self.step_url(step), self.remote.step_url(step)
        local, document = document_at(source, None)
        try:
            there = manifest_at(target, self.remote.storage_options)
        except (CheckpointNotFound, CorruptCheckpoint):  # none, or one to replace
            there = None
        if self._nothing_to_upload(step, local, there):
            return None  # a manager that only reads needs no lease
        uploads._take_lease()  # a second writer of the remote root stops here

        def recheck() -> None:  # the lease may lapse while a long copy runs
            uploads._check_lease(f"step {step} was not uploaded to {target}")

        recheck()
        nbytes = copy_checkpoint(source, target, (local, document),
                                 there.files if there else {},
                                 overwrite=True, storage_options=None,
                                 dst_storage_options=self.remote.storage_options,
                                 before_publish=recheck)
        with self._changed:
            self._uploaded[step] = local.save_id
            self._waiting.pop(step, None)
        return nbytes

    def _send_files(self, step: int) -> int | None:
        """Several nodes: copy the data files of `step` that this node holds to the remote
        step directory, then leave this node's marker there (rank 0: wait for the others'
        markers instead). Returns the bytes copied, or None when the remote root holds this
        save already (a restart), or a later one of that step (as `_copy_step`), or rank 0
        skipped this save (`_superseded`): then what this node left of it in the remote
        root is removed."""
        source = open_storage(self.step_url(step))
        target = open_storage(self.remote.step_url(step), self.remote.storage_options)
        try:
            if self._withdraw(step, target):
                return None
            try:
                document = source.read(MANIFEST)
            except FileNotFoundError as exc:  # the local step was removed meanwhile
                raise CheckpointNotFound(f"{self.step_url(step)} is gone",
                                         url=self.step_url(step)) from exc
            manifest = decode(document, source.url)
            with self._changed:
                if self._skipped.get(step) == manifest.save_id:
                    return None
            try:
                there: Manifest | None = read_manifest(target)
            except (CheckpointNotFound, CorruptCheckpoint):  # none, or one to replace
                there = None
            if self._nothing_to_upload(step, manifest, there):
                return None
            names = [name for name in sorted(manifest.files) if source.exists(name)]
            nbytes = copy_files(source, target, manifest, names,
                                there.files if there is not None else {})
            if self.group.rank == 0:
                with self._changed:
                    self._awaiting[step] = (manifest.save_id, document, names)
            else:
                with self._changed:  # until rank 0 publishes or skips it (then `_withdraw`)
                    self._sent[step] = (manifest.save_id, names)
                if self._withdraw(step, target):  # skipped while its files were copied
                    return None
                marker = json.dumps({"save_id": manifest.save_id, "files": names})
                target.publish(_marker(self.group.rank), marker.encode(), overwrite=True)
        finally:
            source.close()
            target.close()
        logger.info("uploaded %d file(s) of step %d (%.1f MB) from %s to %s", len(names), step,
                    nbytes / 1e6, self.root, self.remote_root)
        return nbytes

    def _withdraw(self, step: int, target: Storage) -> bool:
        """Several nodes, a leader but rank 0: when rank 0 skipped the save of `step` whose
        files (and marker) this node left in the remote step directory (`target`), remove
        them, since no manifest will ever reference them. Whether it did."""
        with self._changed:
            sent = self._sent.get(step)
            if sent is None or self._skipped.get(step) != sent[0]:
                return False
        save_id, names = sent
        try:
            marker = json.loads(target.read(_marker(self.group.rank)))
        except (FileNotFoundError, ValueError):
            marker = {}
        mine = [_marker(self.group.rank)] if marker.get("save_id") == save_id else []
        target.delete([*names, *mine])
        with self._changed:
            if self._sent.get(step) == sent:
                del self._sent[step]
        logger.info("removed this node's %d file(s) of step %d from %s: rank 0 did not "
                    "upload it (superseded)", len(names), step, self.remote_root)
        return True

    def _publish_ready(self) -> None:
        """Rank 0, several nodes: publish the remote manifest of every awaited step whose
        other nodes' markers (of the same save) are all there; a step whose markers do not
        cover every data file is given up (it is reported, and stays in `local_dir`)."""
        with self._publishing:
            with self._changed:
                awaiting = dict(self._awaiting)
            for step, (save_id, document, names) in sorted(awaiting.items()):
                self._publish_step(step, save_id, document, names)

    def _publish_step(self, step: int, save_id: str, document: bytes, names: list[str]) -> None:
        uploads = self._uploads
        assert uploads is not None
        started = time.perf_counter()
        target = open_storage(self.remote.step_url(step), self.remote.storage_options)
        leaders = [node[0] for node in self.nodes[1:]]
        try:
            files = set(names)
            for leader in leaders:
                try:
                    marker = json.loads(target.read(_marker(leader)))
                except FileNotFoundError:
                    return  # not there yet
                if marker.get("save_id") != save_id:
                    return  # a dead run's, replaced when that node uploads this save
                files.update(marker.get("files", []))
            manifest = decode(document, target.url)
            missing = sorted(set(manifest.files) - files)
            if missing:
                error = (f"data files {missing[:3]} of step {step} are on no node's "
                         f"local_dir: restore an earlier step, or save it again")
                with self._changed:
                    self._awaiting.pop(step, None)
                    self._failed[step] = error
                self._emit(Event(ERROR, target.url, step, error=error))
                return
            uploads._lease.check()
            _publish(target, manifest, document, overwrite=True, background=False)
            markers = [_marker(leader) for leader in leaders]
            try:  # the step is committed: markers left behind are inert
                target.delete(markers)
            except Exception:
                logger.warning("step %d is committed at %s, but its markers %s could not be "
                               "removed; they are safe to delete", step, target.url, markers,
                               exc_info=True)
        except Exception as exc:  # retried with the step (the markers stay)
            error = f"publishing the remote manifest failed: {type(exc).__name__}: {exc}"
            with self._changed:
                self._awaiting.pop(step, None)
                self._failed[step] = error
            self._emit(Event(ERROR, target.url, step, time.perf_counter() - started,
                             error=error))
            return
        finally:
            target.close()
        with self._changed:
            self._awaiting.pop(step, None)
            self._failed.pop(step, None)
            self._waiting.pop(step, None)
            self._uploaded[step] = save_id
        seconds = time.perf_counter() - started
        self._emit(Event(UPLOAD, self.remote.step_url(step), step, seconds, 0.0,
                         manifest.nbytes))
        self._retain_both()

    def _retain_both(self) -> None:
        """The policy on the remote root; `keep_local` uploaded steps in `local_dir` (rank 0's
        uploader thread: no collective here)."""
        uploads = self._uploads
        assert uploads is not None
        with uploads._lock:  # steps arrived behind the remote manager's back: re-read them
            uploads._known = None
            uploads._generation += 1  # and never install a listing taken before this
        try:
            if self._spread:  # the policy only: other steps' uploads may be in flight
                uploads._retain(dry_run=False)
            else:
                uploads.gc()
        except Exception as exc:
            logger.warning("retention under %s failed; the next upload retries it",
                           self.remote_root, exc_info=True)
            self._emit(Event(ERROR, self.remote_root, error=f"retention failed: {exc}"))
        self._retain_local()

    def _retain_local(self) -> None:
        """Keep the newest `keep_local` steps of this node's `local_dir` and every step whose
        save is neither committed remotely nor skipped by rank 0 as superseded (as far as
        this rank knows); remove every stale copy (the remote root holds a later save of its
        step: it is never uploaded nor restored), the newest too. The step being saved and
        the one the next incremental save shares files with stay."""
        if self._closed:
            return
        with self._retaining:
            local = committed_steps(self._storage)
            with self._changed:
                uploaded, skipped = dict(self._uploaded), dict(self._skipped)
                stale = dict(self._stale_copies)
            lineage = self._lineage  # the step the next incremental save shares files with
            kept = {lineage[0]} if lineage is not None else set()  # (maybe not the newest)
            kept.update(step for step in local if self._writing[step] > 0)
            doomed = [step for step in local if step in stale and step not in kept]
            fresh = [step for step in local if step not in stale]
            kept.update(fresh[-self.keep_local:])
            doomed += [step for step in fresh if step not in kept
                       and (step in uploaded or step in skipped)]
            for step in sorted(doomed):
                try:
                    checkpoint = info(self.step_url(step))
                    if checkpoint.save_id in (uploaded.get(step), skipped.get(step),
                                              stale.get(step)):
                        self._delete_step(step, checkpoint.nbytes)
                except SafepointError as exc:
                    self._emit(Event(ERROR, self.step_url(step), step,
                                     error=f"removing the local copy failed: {exc}"))

    def _retry_failed(self) -> None:
        """Queue again the steps whose upload failed."""
        with self._changed:
            retry = [s for s in self._failed if s not in self._queue]
        for step in retry:
            self._enqueue(step)

    def _drain(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self._queue and not self._busy)

    def _share_uploaded(self) -> None:
        """Tell every rank which steps rank 0 committed remotely or skipped as superseded
        (other nodes' leaders keep their local copies until then)."""
        with self._changed:
            mine = dict(self._uploaded), dict(self._skipped)
        decided: tuple[dict[int, str], dict[int, str]] = exchange(
            self.group, lambda: None, lambda _: mine, what=f"uploading to {self.remote_root}",
            consequence="nothing was changed")
        self._learn(*decided)

    def _learn(self, uploaded: dict[int, str], skipped: dict[int, str]) -> None:
        """Another node's leader: record which saves rank 0 published (`uploaded`) and which
        it skipped (`skipped`), and queue the removal of the files this node left in the
        remote root of each skipped one (`_withdraw`); its upload, queued or retried,
        sends nothing."""
        with self._changed:
            self._uploaded.update(uploaded)
            self._skipped.update(skipped)
            withdrawn = []
            for step, (save_id, _) in list(self._sent.items()):
                if uploaded.get(step) == save_id:
                    del self._sent[step]
                elif skipped.get(step) == save_id:
                    withdrawn.append(step)
        if self.leader:
            for step in withdrawn:
                self._enqueue(step)

    def _settle(self) -> dict[int, str]:
        """After every rank drained its uploads: the steps not uploaded, from every rank,
        once rank 0 published what it could (every node's markers are in by now); with
        several nodes, the leaders then apply their local retention."""
        with self._changed:
            mine = dict(self._failed)

        def decide(failures: list[dict[int, str]]) -> tuple[
                dict[int, str], dict[int, str], dict[int, str]]:
            if self._awaiting:
                self._publish_ready()
                with self._changed:  # and what publishing them found
                    failures = [dict(self._failed), *failures[1:]]
            merged: dict[int, str] = {}
            with self._changed:
                for rank, failed in enumerate(failures):
                    for step, error in failed.items():
                        if step not in self._skipped:  # another node's: nothing to upload
                            merged.setdefault(step, f"rank {rank}: {error}" if self._spread
                                              else error)
                for step in self._awaiting:
                    merged.setdefault(step, "the files of some node never reached "
                                            f"{self.remote.step_url(step)}")
                return merged, dict(self._uploaded), dict(self._skipped)

        failed: dict[int, str]
        uploaded: dict[int, str]
        skipped: dict[int, str]
        failed, uploaded, skipped = exchange(self.group, lambda: mine, decide,
                                             what=f"uploading to {self.remote_root}",
                                             consequence="nothing was changed")
        if self._spread and self.leader:
            self._learn(uploaded, skipped)
            self._retain_local()
        return failed

    def _raise_failed(self, failed: dict[int, str]) -> None:
        """Raise, on every rank, when some steps could not be uploaded."""
        if failed:
            steps = sorted(failed)
            raise StorageError(
                f"step(s) {steps} are committed in {self.root} but not uploaded to "
                f"{self.remote_root} ({failed[steps[0]]}); they stay in {self.root} and are "
                f"retried at the next save, or upload them with `safepoint cp {self.root} "
                f"{self.remote_root}`",
                url=self.remote_root,
            )

    # -- the manager's API -------------------------------------------------------------------

    def _committed(
        self, step: int, url: str, checkpoint: CheckpointInfo, started: float,
        blocked: list[float] | None, *, retain: bool,
    ) -> StepInfo:
        # The local tier's policy keeps every step (`_retain_local` applies keep_local, in
        # the uploader): its retention would only read every step's manifest on the first
        # commit, and the remote one of each, on the save's path.
        result = super()._committed(step, url, checkpoint, started, blocked, retain=False)
        if self._uploads is not None:  # what `_superseded` weighs, without reading it again
            with self._changed:
                self._waiting[step] = checkpoint
                self._skipped.pop(step, None)  # a new save of the number
        with self._changed:  # on every rank: a new save of a number that was stale here
            self._stale_copies.pop(step, None)
        if self.leader:
            self._enqueue(step)
        return result

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Commit `state` as `step` in `local_dir` (see `CheckpointManager.save`); the upload
        to the remote root follows in the background. Steps whose upload failed are queued
        again."""
        if self._spread:  # first: a step rank 0 skipped is not retried
            self._share_uploaded()
        self._retry_failed()
        writing = as_step(step)  # a bad step is refused by the save (in a group, on every rank)
        with self._retaining:  # a removal under way ends first
            self._writing[writing] += 1
        try:
            handle = super().save(step, state, metrics=metrics, metadata=metadata)
        except BaseException:
            self._written(writing)
            raise
        handle._future.add_done_callback(lambda _: self._written(writing))
        return handle

    def _written(self, step: int | None) -> None:
        with self._retaining:
            self._writing[step] -= 1

    def steps(self) -> list[int]:
        """The committed steps, local (in every node's `local_dir`) or remote, ascending;
        while the remote root cannot be listed (an outage), the local ones, with a warning.

        Raises:
            StorageError: the remote root cannot be listed and `local_dir` holds no step.
        """
        whole = self._local_steps()[0]
        return sorted(set(whole) | set(self._remote_steps(whole)))

    def _remote_steps(self, local: list[int]) -> list[int]:
        """The steps committed in the remote root; none, with a warning, when it cannot be
        listed (an outage) and `local_dir` holds steps (`local`): a job restarted then
        resumes from them, and one preempted then names one as its resume point."""
        try:
            return self.remote.steps()
        except StorageError as exc:
            if not local:
                raise
            warnings.warn(f"safepoint: cannot list {self.remote_root} ({exc}); using the "
                          f"steps in {self.root} alone", stacklevel=3)
            return []

    def _listed(self) -> tuple[list[int], list[int], list[int]]:
        """The steps `restore` tries (committed in every node's `local_dir` or in the remote
        root) in restore order, the steps some node's `local_dir` holds, and the remote
        root's (collective)."""
        whole, held = self._local_steps()
        remote = self._remote_steps(whole)
        return self._restore_order(sorted(set(whole) | set(remote))), held, remote

    def metadata(self, step: int) -> StepInfo:
        """A step's record, from its local copy, else (missing or damaged there) its remote
        one; and the remote one when it is a later save of that step (the local copy is then
        stale: left in `local_dir` by a host that ran the job before another saved it anew)."""
        try:
            local = super().metadata(step)
        except SafepointError as exc:
            if not unreadable(exc):
                raise
            return self.remote.metadata(step)
        return self._later_remote(step, local) or local

    def _later_remote(self, step: int, local: StepInfo) -> StepInfo | None:
        """The remote root's record of `step` when it is a later save than `local`, the local
        copy's; None otherwise, or when it is unreadable."""
        try:
            remote = self.remote.metadata(step)
        except SafepointError:
            return None
        return remote if remote.created > local.created else None

    def _stale(self, step: int) -> bool:
        """Whether some node's copy of `step` in its `local_dir` is readable and older than
        the remote root's save of it. Collective, and the same answer on every rank: the
        ranks of a node holding a stale copy restore from the remote root, and so must all
        the others, since they load together."""

        def mine() -> bool:
            try:
                local = CheckpointManager.metadata(self, step)
            except SafepointError:
                return False
            return self._later_remote(step, local) is not None

        stale: bool = exchange(self.group, mine, any,
                               what=f"comparing step {step} in {self.root} with "
                                    f"{self.remote_root}", consequence="nothing was restored")
        return stale

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
        """Restore `state` from `step` (or, as the manager's, the step committed last in
        either tier): each rank reads the data files its node's `local_dir` holds from
        there, the others from the remote root; when that fails its checksums or its disk
        fails to read it (a `StorageError`), or some node's copy is stale (the remote root
        holds a later save of that step), from the remote copy alone, on every rank; with
        `fallback`, older steps are tried when both fail, and a step that vanished from the
        remote root meanwhile (a reader racing the writer's retention) makes it list both
        tiers again, as the manager's does. While the remote root cannot be listed, the
        steps in `local_dir` are tried (with a warning).

        Returns:
            the step restored, or None when nothing is committed in either tier.

        Raises:
            the error of the local save in flight, if it failed: restore waits for it first
                (in a group, on every rank).
            SafepointError: `step` is not a whole number 0 or more, or differs by rank.
        """
        keys = list(keys) if isinstance(keys, Iterator) else keys  # each step tried reads it
        self._raise_pending_everywhere(f"restoring from {self.root}")
        step, whole = self._agreed_step(step, keys is None and strict)
        remote: list[int] = []  # listed only to try older steps: not with `step`
        if step is not None:
            candidates, held = [step], self._local_steps()[1]
        else:
            candidates, held, remote = self._listed()
        first: SafepointError | None = None
        tried: Counter[int] = Counter()
        skipped: set[int] = set()  # failed in both tiers: never tried again
        while candidates:
            candidate = candidates.pop(0)
            tried[candidate] += 1
            if candidate in held and self._stale(candidate):
                logger.warning("a copy of step %d in %s is older than the one at %s: "
                               "restoring that one", candidate, self.root, self.remote_root)
            elif candidate in held:
                try:
                    return self._resumed(self._restore_local(
                        state, candidate, keys=keys, strict=strict, allow_pickle=allow_pickle,
                        progress=progress, whole=whole), keys)
                except SafepointError as exc:
                    self._report_failure(self._url(candidate), candidate, time.perf_counter(),
                                         exc)
                    if not _local_copy_failed(exc):
                        raise
                    self._drop_lineage(f"restoring the local copy of step {candidate} failed")
                    first = first or exc
                    warnings.warn(f"safepoint: the local copy of step {candidate} cannot be "
                                  f"restored: {exc}; trying {self.remote_root}", stacklevel=2)
            try:
                self.remote.restore(state, candidate, keys=keys, strict=strict,
                                    allow_pickle=allow_pickle, progress=progress)
                return self._resumed(candidate, keys)
            except SafepointError as exc:
                if not unreadable(exc) or (step is not None and candidate not in held):
                    raise
                first = first or exc
                if not self.fallback or step is not None:
                    break
                if candidate in remote and _vanished(exc):
                    # Removed since it was listed: the writer's retention, which may have
                    # committed a newer step meanwhile. List both tiers again.
                    candidates, held, remote = self._listed()
                    candidates = [c for c in candidates
                                  if c not in skipped and tried[c] < _RESTORE_TRIES]
                else:
                    skipped.add(candidate)
                then = f"trying step {candidates[0]}" if candidates else "no other step left"
                warnings.warn(  # the remote manager reported the failure (an error event)
                    f"safepoint: step {candidate} cannot be restored from "
                    f"{self.remote_root} either: {exc}; {then}", stacklevel=2)
        if first is not None:
            raise first
        return None

    def _restore_local(
        self, state: Any, step: int, *, keys: Sequence[str] | None, strict: bool,
        allow_pickle: bool, progress: Progress | None, whole: bool,
    ) -> int:
        """Restore `step`, each file from this node's `local_dir` when it is there, else
        from the remote root (collective). An incremental manager's next save shares files
        with it only after a strict, whole restore (no `keys`) on every rank (`whole`, agreed
        by `_agreed_step`) that read every file locally: as the manager's, it never shares
        bytes it has not seen checked, nor links a file the local copy lacks."""
        started = time.perf_counter()
        storage = _LocalFirst(open_storage(self.step_url(step)),
                              open_storage(self.remote.step_url(step),
                                           self.remote.storage_options))
        try:
            load_from(storage, state, keys=keys, strict=strict, allow_pickle=allow_pickle,
                      group=self.group, progress=progress)
        finally:
            storage.close()
        seconds = time.perf_counter() - started
        nbytes = self.metadata(step).nbytes if self._callbacks else 0
        self._emit(Event(LOAD, storage.url, step, seconds, seconds, nbytes))
        if self.incremental and whole:  # every block read and checked, on every rank
            # Only when every rank read it all locally: the next save links its files.
            borrowed: bool = exchange(
                self.group, lambda: storage.from_remote, any, what=f"restoring {storage.url}",
                consequence="the state was restored; restore again")
            if not borrowed:
                self._follow(step)
        return step

    def gc(self, *, dry_run: bool = False) -> GCReport:
        """Remove leftovers in both tiers (in every node's `local_dir`) and apply the
        retention policy to the remote root. Returns the remote root's report. The save in
        flight and the uploads are waited for first, and their error raised: a step being
        uploaded (its data copied, its manifest not yet published) would be taken for a
        leftover and its data removed under the upload."""
        self._check_open()
        self.wait()
        super().gc(dry_run=dry_run)
        uploads = self._uploads

        def mine() -> None:  # the other nodes' leaders, in their own local_dir
            if self._spread and self.leader and self.group.rank != 0:
                self._remove_leftovers(dry_run, thorough=True)

        def collect(_: object) -> GCReport:  # on rank 0 only in a group
            assert uploads is not None
            return uploads.gc(dry_run=dry_run)

        report: GCReport = exchange(self.group, mine, collect,
                                    what=f"collecting garbage under {self.remote_root}",
                                    consequence="nothing more was deleted")
        return report

    def _keep_only(self, step: int) -> list[int]:
        """Delete every step but `step` in both tiers, once every step is uploaded: rank 0
        in the remote root, each node's leader in its `local_dir`. Returns the remote steps
        deleted."""
        self.wait()

        def mine() -> None:
            if not self.leader:
                return
            with self._retaining:
                for other in committed_steps(self._storage):
                    if other != step:
                        try:
                            nbytes = info(self.step_url(other)).nbytes
                        except SafepointError:  # a damaged local copy goes all the same
                            nbytes = 0
                        self._delete_step(other, nbytes)

        def collect(_: object) -> list[int]:  # on rank 0 only in a group
            assert self._uploads is not None
            return self._uploads._keep_only(step)

        deleted: list[int] = exchange(
            self.group, mine, collect, what=f"deleting the steps under {self.remote_root}",
            consequence="some older steps may be left: `safepoint gc` applies the policy")
        return deleted

    def kept(self) -> dict[int, list[str]]:
        """Why each remote step is kept under the policy."""
        return self.remote.kept()

    def wait(self) -> None:
        """Wait for the save in flight and for every queued upload (with several nodes: on
        every node, and for rank 0 to publish them).

        Raises:
            the save's error; else StorageError when a step could not be uploaded (it stays
            in `local_dir` and is retried at the next save).
        """
        super().wait()
        if self._closed:  # `close` waited already, and no uploader is left to retry
            return
        if self._spread:  # first: a step rank 0 skipped is not retried
            self._share_uploaded()
        self._retry_failed()
        self._drain()
        self._raise_failed(self._settle())

    def _finish_before_exit(self) -> None:
        """Also finish this process's uploads (a last try for those that failed): the
        uploader is a daemon thread, stopped at exit. What is still not uploaded (and, with
        several nodes, what rank 0 had yet to publish) stays in `local_dir`, for the next
        manager opened on it."""
        super()._finish_before_exit()
        if self._closed or self._uploader is None:
            return
        self._retry_failed()
        self._drain()
        with self._changed:
            failed = sorted(set(self._failed) | set(self._awaiting))
        if failed:
            logger.error("step(s) %s are committed in %s but not uploaded to %s when the "
                         "interpreter exited; open a manager on them again, or upload them "
                         "with `safepoint cp %s %s`", failed, self.root, self.remote_root,
                         self.root, self.remote_root)

    def close(self) -> None:
        """Wait for the save in flight, give every step not uploaded yet a last round of
        tries, then release both tiers.

        Raises:
            the save's error; else StorageError naming the steps that were not uploaded
            (they stay in `local_dir`).
        """
        if self._closed:
            return
        failed: dict[int, str] = {}
        try:
            try:
                CheckpointManager.wait(self)
            finally:
                # While local_dir is open, so that the last uploads leave keep_local steps.
                self._retry_failed()
                self._drain()
                failed = self._settle()
        finally:
            try:
                super().close()
            finally:
                with self._changed:
                    self._stopping = True
                    self._changed.notify_all()
                if self._uploader is not None:
                    self._uploader.join()
                self.remote.close()
                if self._uploads is not None and self._uploads is not self.remote:
                    self._uploads.close()
        self._raise_failed(failed)


#: How long an idle uploader waits for a step before it lets go of its manager for a moment.
_IDLE_S = 1.0


def _upload_loop(ref: weakref.ReferenceType[TieredManager]) -> None:
    """Upload steps until the manager closes or is collected. The thread lets go of its
    manager whenever no step is queued, so one dropped without `close` (a notebook cell run
    again, a function that raised) finishes its uploads and is then collected, and its
    leases lapse, as a `CheckpointManager`'s do: it held both roots for the life of the
    process."""
    while (manager := ref()) is not None and manager._upload_next():
        if not manager._queue:
            del manager

def _everywhere(found: list[list[int]]) -> list[int]:
    """The steps every rank found, ascending."""
    return sorted(set.intersection(*(set(steps) for steps in found)))

