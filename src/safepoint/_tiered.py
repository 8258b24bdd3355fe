"""Two tiers: `CheckpointManager(root, local_dir=...)` commits every step to a fast local
directory first, so training unblocks at local-disk speed, then uploads it to `root` (an
object store, a shared filesystem: any URL) in the background (manager layer).

- Uploads are verified copies (`sp.copy`): every block checked, the remote manifest
  published last, so a half-uploaded step is invisible remotely.
- A failed upload is reported (an "error" event per attempt) and retried with backoff; a step
  that still fails stays in `local_dir` and is tried again at the next `save`, at `wait` and at
  `close`, which raises if it never made it. Steps left in `local_dir` by a run that died
  before uploading them are uploaded when a manager opens it again.
- Retention: the manager's policy (`keep_last`, `keep_every`, `keep_best`, ...) applies to
  `root`; `local_dir` keeps the newest `keep_local` steps, plus every step not uploaded yet.
- `restore` prefers the local copy of a step and falls back to the remote one when the local
  copy is missing or fails its checksums.
- Under torch.distributed the manager is collective, like `CheckpointManager`: every rank
  writes its pieces of each step into `local_dir` and rank 0 commits the step there, so
  `local_dir` must be one directory that every rank sees (the local disk of a single-host job,
  or a filesystem shared by the hosts): this is checked when the manager is made, and a
  `local_dir` that some rank does not share (a node-local disk of a multi-host job) is refused
  on every rank. Rank 0 alone uploads, applies retention to both tiers and holds the leases;
  `steps`, `restore`, `wait` and `close` are collective and agree on rank 0's view.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

from ._api import CheckpointInfo, Progress
from ._copy import copy
from ._dist import exchange
from ._events import ERROR, Event, EventCallback
from ._manager import (
    CheckpointManager,
    GCReport,
    SaveHandle,
    StepInfo,
    committed_steps,
    unreadable,
)
from .errors import CheckpointNotFound, SafepointError, StorageError

__all__ = ["UPLOAD", "TieredManager"]

logger = logging.getLogger(__name__)

#: The event kind of a step uploaded to the remote root.
UPLOAD = "upload"


class TieredManager(CheckpointManager):
    """A `CheckpointManager` whose steps are committed in `local_dir` and uploaded to `root`.

    Made by `CheckpointManager(root, local_dir=...)`; the arguments are the manager's, plus:

    Args:
        local_dir: a fast local directory where each step is committed first (in a process
            group: one directory every rank sees, see the module docstring).
        keep_local: how many of the newest uploaded steps stay in `local_dir`.
        incremental: as the manager's, for the local tier: each step's unchanged blocks are
            shared with the step before in `local_dir`; the upload copies every file of a
            step, so each remote step is complete.

    Raises:
        DistributedError: in a process group, some rank does not see the `local_dir` that
            rank 0 sees (on every rank; nothing is uploaded or deleted).

    Attributes:
        remote: the manager of `root` (listing and restore of the remote copies).
        upload_attempts: tries per upload round before the step waits for the next round.
        upload_backoff_s: the cap of the first wait between tries (doubled each time).
    """

    upload_attempts = 4
    upload_backoff_s = 1.0

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
        if isinstance(keep_local, bool) or not isinstance(keep_local, int) or keep_local < 1:
            raise SafepointError(f"keep_local={keep_local!r}: pass a whole number 1 or more")
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
        try:
            self._check_shared()
        except BaseException:
            CheckpointManager.close(self)
            self.remote.close()
            raise
        #: Where rank 0's uploader applies retention (outside the group: the uploader's
        #: thread must take part in no collective); None on the other ranks.
        self._uploads: CheckpointManager | None = self.remote
        if not self.group.solo:
            self._uploads = (CheckpointManager(root, dist=False, **remote_options)
                             if self.group.rank == 0 else None)
        self.remote_root = str(root)
        self.keep_local = keep_local
        self._queue: list[int] = []
        self._failed: dict[int, str] = {}
        self._uploaded: set[int] = set()
        self._changed = threading.Condition()
        self._busy = False
        self._stopping = False
        self._uploader = threading.Thread(target=self._upload_loop, daemon=True,
                                          name="safepoint-upload")
        self._uploader.start()
        for step in CheckpointManager.steps(self):  # a previous run may have died mid-upload
            if self.group.rank == 0:
                self._enqueue(step)

    def _check_shared(self) -> None:
        """In a group, make sure every rank sees the `local_dir` rank 0 writes to: rank 0
        leaves a marker there and every rank looks for it.

        Raises:
            DistributedError: some rank does not see it.
        """
        if self.group.solo:
            return
        marker = f".shared-{uuid.uuid4().hex}" if self.group.rank == 0 else ""

        def leave(_: object) -> str:
            self._storage.publish(marker, b"", overwrite=False)
            return marker

        def look() -> None:
            if not self._storage.exists(shared):
                raise SafepointError(
                    f"rank {self.group.rank} does not see the local_dir {self.root} that rank 0 "
                    "writes to; every rank of a group writes its pieces there and rank 0 "
                    "commits and uploads them, so pass a local_dir shared by all ranks (the "
                    "local disk of a single-host job, or a filesystem every host mounts), or "
                    "no local_dir to save straight to the remote root (node-local tiers on "
                    "several hosts are not supported yet)", url=self.root,
                )

        shared: str = exchange(self.group, lambda: None, leave, what=f"opening {self.root}",
                               consequence="nothing was written")
        try:
            exchange(self.group, look, lambda _: None,
                     what=f"checking that every rank shares local_dir {self.root}",
                     consequence="no manager was made")
        finally:
            if self.group.rank == 0:
                self._storage.delete([shared])

    # -- uploading ---------------------------------------------------------------------------

    def _enqueue(self, step: int) -> None:
        with self._changed:
            if step not in self._queue:
                self._queue.append(step)
                self._changed.notify_all()

    def _upload_loop(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._stopping:
                    self._changed.wait()
                if not self._queue:
                    return
                step = self._queue.pop(0)
                self._busy = True
            try:
                self._upload(step)
            except BaseException:  # a bug: report it rather than lose the step silently
                logger.exception("uploading step %d to %s failed", step, self.remote_root)
                with self._changed:
                    self._failed[step] = "the uploader failed; see the log"
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def _upload(self, step: int) -> None:
        """Copy `step` to the remote root, as the writer holding its lease, retrying with
        backoff; then apply retention."""
        source, target = self.step_url(step), self.remote.step_url(step)
        uploads = self._uploads
        assert uploads is not None
        for attempt in range(1, self.upload_attempts + 1):
            started = time.perf_counter()
            try:
                uploads._take_lease()  # a second writer of the remote root stops here
                report = copy(source, target, overwrite=True, storage_options=None,
                              dst_storage_options=self.remote.storage_options)
            except CheckpointNotFound:
                return  # deleted locally meanwhile: nothing left to upload
            except Exception as exc:
                error = f"upload attempt {attempt} of {self.upload_attempts} failed: " \
                        f"{type(exc).__name__}: {exc}"
                self._emit(Event(ERROR, target, step, time.perf_counter() - started,
                                 error=error))
                with self._changed:
                    self._failed[step] = error
                    if attempt == self.upload_attempts or self._stopping:
                        return
                    wait = random.uniform(0.5, 1.0) * self.upload_backoff_s * 2 ** (attempt - 1)
                    self._changed.wait_for(lambda: self._stopping, timeout=wait)
                continue
            with self._changed:
                self._failed.pop(step, None)
                self._uploaded.add(step)
            seconds = time.perf_counter() - started
            self._emit(Event(UPLOAD, target, step, seconds, 0.0, report.nbytes))
            self._retain_both()
            return

    def _retain_both(self) -> None:
        """The policy on the remote root; `keep_local` uploaded steps in `local_dir` (rank 0's
        uploader thread: no collective here)."""
        uploads = self._uploads
        assert uploads is not None
        with uploads._lock:  # steps arrived behind the remote manager's back: re-read them
            uploads._known = None
        try:
            uploads.gc()
        except Exception as exc:
            logger.warning("retention under %s failed; the next upload retries it",
                           self.remote_root, exc_info=True)
            self._emit(Event(ERROR, self.remote_root, error=f"retention failed: {exc}"))
        if self._closed:
            return
        local = committed_steps(self._storage)
        with self._changed:
            uploaded = set(self._uploaded)
        newest = set(local[-self.keep_local:])
        for step in local:
            if step in uploaded and step not in newest:
                try:
                    nbytes = CheckpointManager.metadata(self, step).nbytes
                    self._delete_step(step, nbytes)
                    with self._changed:
                        self._uploaded.discard(step)
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

    def _raise_failed(self) -> None:
        """Raise on every rank when rank 0 has steps it could not upload."""
        with self._changed:
            mine = dict(self._failed)
        failed: dict[int, str] = exchange(self.group, lambda: None, lambda _: mine,
                                          what=f"uploading to {self.remote_root}",
                                          consequence="nothing was changed")
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
        result = super()._committed(step, url, checkpoint, started, blocked, retain=retain)
        if self.group.rank == 0:
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
        self._retry_failed()
        return super().save(step, state, metrics=metrics, metadata=metadata)

    def steps(self) -> list[int]:
        """The committed steps, local or remote, ascending."""
        return sorted(set(CheckpointManager.steps(self)) | set(self.remote.steps()))

    def metadata(self, step: int) -> StepInfo:
        """A step's record, from its local copy, else (missing or damaged there) its remote
        one."""
        try:
            return super().metadata(step)
        except SafepointError as exc:
            if not unreadable(exc):
                raise
            return self.remote.metadata(step)

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
        """Restore `state` from `step` (or the newest step in either tier): from the local
        copy when it is there and intact, else from the remote one; with `fallback`, older
        steps are tried when both copies of a step fail.

        Returns:
            the step restored, or None when nothing is committed in either tier.
        """
        local = set(CheckpointManager.steps(self))
        if step is not None:
            candidates = [step]
        else:
            try:
                remote = set(self.remote.steps())
            except StorageError as exc:  # a restart during an outage resumes from local_dir
                if not local:
                    raise
                warnings.warn(f"safepoint: cannot list {self.remote_root} ({exc}); restoring "
                              f"from the local copies in {self.root}", stacklevel=2)
                remote = set()
            candidates = sorted(local | remote, reverse=True)
        first: SafepointError | None = None
        for candidate in candidates:
            if candidate in local:
                try:
                    return CheckpointManager.restore(
                        self, state, candidate, keys=keys, strict=strict,
                        allow_pickle=allow_pickle, progress=progress)
                except SafepointError as exc:
                    if not unreadable(exc):
                        raise
                    first = first or exc
                    self._emit(Event(ERROR, self.step_url(candidate), candidate, error=str(exc)))
                    warnings.warn(f"safepoint: the local copy of step {candidate} cannot be "
                                  f"restored: {exc}; trying {self.remote_root}", stacklevel=2)
            try:
                return self.remote.restore(state, candidate, keys=keys, strict=strict,
                                           allow_pickle=allow_pickle, progress=progress)
            except SafepointError as exc:
                if not unreadable(exc) or (step is not None and candidate not in local):
                    raise
                first = first or exc
                if not self.fallback:
                    break
        if first is not None:
            raise first
        return None

    def gc(self, *, dry_run: bool = False) -> GCReport:
        """Remove leftovers in both tiers and apply the retention policy to the remote root.
        Returns the remote root's report."""
        super().gc(dry_run=dry_run)
        uploads = self._uploads

        def collect(_: object) -> GCReport:  # on rank 0 only in a group
            assert uploads is not None
            return uploads.gc(dry_run=dry_run)

        report: GCReport = exchange(self.group, lambda: None, collect,
                                    what=f"collecting garbage under {self.remote_root}",
                                    consequence="nothing more was deleted")
        return report

    def kept(self) -> dict[int, list[str]]:
        """Why each remote step is kept under the policy."""
        return self.remote.kept()

    def wait(self) -> None:
        """Wait for the save in flight and for every queued upload.

        Raises:
            the save's error; else StorageError when a step could not be uploaded (it stays
            in `local_dir` and is retried at the next save).
        """
        super().wait()
        self._retry_failed()
        self._drain()
        self._raise_failed()

    def close(self) -> None:
        """Wait for the save in flight, give every step not uploaded yet a last round of
        tries, then release both tiers.

        Raises:
            the save's error; else StorageError naming the steps that were not uploaded
            (they stay in `local_dir`).
        """
        if self._closed:
            return
        try:
            try:
                CheckpointManager.wait(self)
            finally:
                # While local_dir is open, so that the last uploads leave keep_local steps.
                self._retry_failed()
                self._drain()
        finally:
            try:
                super().close()
            finally:
                with self._changed:
                    self._stopping = True
                    self._changed.notify_all()
                self._uploader.join()
                self.remote.close()
                if self._uploads is not None and self._uploads is not self.remote:
                    self._uploads.close()
        self._raise_failed()
