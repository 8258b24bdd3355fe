"""`Run`: a training loop over steps (or epochs) that checkpoints on a schedule, saves and
exits with a requeue status on a preemption signal, and resumes where the last committed
checkpoint left off (run layer, on `CheckpointManager`).

A checkpoint's step is the number of steps completed when it was taken: `step-0` is the
state right after initialisation, `step-100` the state after steps 0..99, from which
`run.range` continues with step 100.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal, TypeVar

from ._dist import alike, exchange, group_for
from ._events import ERROR, Event, EventCallback, callbacks, emit
from ._leaves import whole_number
from ._manager import CheckpointManager, SaveHandle
from ._retention import finite_number
from ._sampler import ShieldedWorker, exiting_flag
from ._storage_local import absolute_url
from ._tree import MAX_DEPTH, flatten
from .errors import REQUEUE_EXIT_CODE, DistributedError, Preempted, SafepointError

__all__ = ["RUN_KEY", "Run"]

logger = logging.getLogger(__name__)

#: The checkpoint metadata key under which a run records its own status.
RUN_KEY = "safepoint.run"

DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)

Loader = TypeVar("Loader")


@dataclass(frozen=True, slots=True)
class _Decision:
    """What to do at a step boundary.

    Attributes:
        save: save the current step now.
        stop: end the range after saving (and wait for the commit).
        preempt: raise `Preempted` after saving.
        left: a rank of the group left its loop during the step just completed (a
            `break`): the range ends here on every rank, as if each had left it there, with
            nothing saved yet (the final save or the next range's first boundary follows,
            on every rank alike).
    """

    save: bool
    stop: bool
    preempt: bool
    left: bool = False


def _save_failed(exc: OSError | DistributedError) -> bool:
    """Whether `on_save_error` applies to what a save raised: the storage failed, or, in a
    group, the save failed on some rank for a reason other than the state itself (every rank
    gets the same `DistributedError`, so all of them warn and train on, or all raise)."""
    if isinstance(exc, OSError):
        return True
    return not any(cause.startswith("UnsupportedLeaf:") for cause in exc.failures.values())


def _options(
    every_steps: object, every_seconds: object, on_save_error: object, max_failed_saves: object,
    signals: object,
) -> tuple[int | None, float | None, int, tuple[int, ...]]:
    """A run's schedule and policy options, checked: (every_steps, every_seconds,
    max_failed_saves, signals) as the run keeps them, else a `SafepointError` naming the
    option and saying what to pass."""
    if every_steps is not None:
        every_steps = whole_number("every_steps", every_steps, least=1,
                                   alternative=", or None to save only at the end")
    seconds = None
    if every_seconds is not None:
        seconds = finite_number(every_seconds)
        if seconds is None or seconds <= 0:
            raise SafepointError(
                f"every_seconds={every_seconds!r}: pass a finite number of seconds > 0 (an "
                "int or a float), or None")
    if on_save_error not in ("warn", "raise"):
        raise SafepointError(f'on_save_error={on_save_error!r}: pass "warn" or "raise"')
    return (every_steps, seconds, whole_number("max_failed_saves", max_failed_saves, least=1),
            _signals(signals))


def _signals(signals: object) -> tuple[int, ...]:
    """`signals` as a tuple of signal numbers that a handler can be installed for, checked
    when the run is made rather than when it is entered (where `signal.signal` would raise
    a bare `ValueError` or `OSError` with some of the handlers installed already)."""
    hint = "pass a sequence of signal numbers, e.g. [signal.SIGTERM, signal.SIGUSR1]"
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Iterable):
        raise SafepointError(f"signals={signals!r}: {hint}")
    checked = []
    for signum in signals:
        if (isinstance(signum, bool) or not isinstance(signum, int)
                or signum not in signal.valid_signals()):
            raise SafepointError(f"signals={signals!r}: {signum!r} is not a signal; {hint}")
        if signum in _UNCATCHABLE:
            raise SafepointError(
                f"signals={signals!r}: {_signal_name(signum)} cannot be caught (a "
                f"process cannot handle it); {hint}")
        checked.append(int(signum))
    return tuple(checked)


def _signal_name(signum: int) -> str:
    """SIGTERM's name, or for a signal without one (a real-time signal) its number."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_UNCATCHABLE = frozenset(
    getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name))


class Run:
    """A preemption-safe loop: restores the newest committed checkpoint on entry, saves on a
    schedule, and on SIGTERM or SIGUSR1 saves at the next step boundary and exits with status
    75 so that the scheduler requeues the job.

    Args:
        root: the directory or URL of the run's checkpoints (`<root>/step-<step>`).
        state: what to save and restore in place: model, optimizer, scheduler, grad scaler,
            `sp.RNGState()`, the data position (`sp.ResumableSampler`, a StatefulDataLoader)
            and anything else the step depends on.
        every_steps: save after every step whose number of completed steps is a multiple of
            this.
        every_seconds: save when this many seconds passed since the last save (or the start).
            With neither, the run saves only at the end, on `stop()` and on preemption.
        keep_last: keep the newest N checkpoints (None: all).
        keep_every: also keep every step divisible by K, forever.
        save_initial: when no checkpoint exists, save step 0 on entry, so a job that dies in
            its first interval does not repeat its set-up work.
        signals: the signals that mean "preempted" (SLURM, Kubernetes and cloud spot notices
            send SIGTERM; SLURM's `--signal=USR1@60` sends SIGUSR1). Handlers are installed on
            entry (main thread only) and the previous ones restored on exit.
        on_save_error: "warn" logs a failed save, reports it as an error event and trains on
            (the previous checkpoint stays valid); "raise" raises it. In a group, a save that
            failed on any rank (its `DistributedError`, on every rank) counts the same way,
            unless a rank refused a leaf of its state.
        max_failed_saves: with "warn", this many failed saves in a row raise a
            `SafepointError` rather than train on for hours without a checkpoint.
        keep_final_only: once the run finishes, delete every checkpoint but the final one
            (in both tiers with `local_dir`).
        async_save: save in the background once the state is staged in host memory.
        max_staging_bytes: the host-memory budget of asynchronous saving (see
            `CheckpointManager`).
        on_event: callbacks for every save, load, delete and error (`sp.Event`).
        storage_options: options for the storage backend.
        local_dir: commit each checkpoint in this fast local directory first and upload it
            to `root` in the background (a two-tier `CheckpointManager`): the loop waits for
            the local disk only. Retention applies to `root`; a restart restores the local
            copy when it is there and intact, else the one under `root`. The final save and
            a preemption's save wait for their upload.
        keep_local: with `local_dir`, how many uploaded checkpoints stay there.
        process_group: once torch.distributed is initialised, the run is collective over
            this group (the default group when None): at every step boundary the ranks agree
            (one small all-reduce) on whether to save, stop or exit for preemption, so a
            signal on any rank makes every rank save the same step and exit, and a `break` on
            any rank ends every rank's range after the same step; saves and the
            restore are collective (see `CheckpointManager`).
        dist: False keeps the run local to this process.
        incremental: each save writes only the blocks that changed since the run's last
            save and shares the rest (see `CheckpointManager`).

    Raises:
        SafepointError: a bad schedule or option (checked here, signals included); in a
            process group, a `DistributedError` on every rank when any rank's options were
            refused (so the others do not wait in the run's first collective for it).

    Example:
        state = {"model": model, "optim": optimizer, "sched": scheduler,
                 "rng": sp.RNGState(), "data": sampler}
        with sp.Run("ckpt/run1", state, every_steps=500) as run:
            for step in run.range(100_000):
                train_step()

    Attributes:
        step: the number of steps completed (the next step `range` yields).
        restored_step: the step restored on entry, or None on a fresh run.
        complete: whether the run finished (`finish()` or leaving the `with` normally), or
            the checkpoint restored on entry was saved by a finished run. A run that
            reached the end of its range goes on when a later range reaches further (training
            extended, or a second phase); one that was stopped early (`stop()`, `break`) does
            not.
        blocked_seconds: how long checkpointing (restore, saves, waits) held up the loop.
    """

    def __init__(
        self,
        root: str,
        state: Any,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        save_initial: bool = False,
        signals: Sequence[int] = DEFAULT_SIGNALS,
        on_save_error: Literal["warn", "raise"] = "warn",
        max_failed_saves: int = 3,
        keep_final_only: bool = False,
        async_save: bool = True,
        max_staging_bytes: int | None = None,
        on_event: EventCallback | Sequence[EventCallback] | None = None,
        storage_options: dict[str, Any] | None = None,
        local_dir: str | None = None,
        keep_local: int = 1,
        process_group: Any = None,
        dist: bool | None = None,
        incremental: bool = False,
    ) -> None:
        self.root = absolute_url(root)
        checked: list[tuple[int | None, float | None, int, tuple[int, ...]]] = []

        def check() -> None:
            checked.append(_options(every_steps, every_seconds, on_save_error,
                                    max_failed_saves, signals))
            # A value no save takes (a DataLoader in the state) is refused now, not at the
            # first save, after `every_steps` steps of training.
            flatten(state, max_depth=MAX_DEPTH)

        # In a group, a rank whose options are refused says so to the others before they
        # enter the run, whose restore is collective: they would wait out the timeout there.
        exchange(
            group_for(process_group, dist), check, lambda _: None,
            what=f"sp.Run({self.root!r})",
            consequence="fix the options or the state of those ranks; nothing was started",
        )
        ((every_steps, every_seconds, max_failed_saves, signals),) = checked
        self.state = state
        self.every_steps: int | None = every_steps
        self.every_seconds: float | None = every_seconds
        self.save_initial = save_initial
        self.signals = signals
        self.on_save_error = on_save_error
        self.max_failed_saves: int = max_failed_saves
        self.keep_final_only = keep_final_only
        self._callbacks = callbacks(on_event)
        self._storage_options = storage_options
        self._manager = CheckpointManager(
            self.root, keep_last=keep_last, keep_every=keep_every, async_save=async_save,
            max_staging_bytes=max_staging_bytes, on_event=[*self._callbacks, self._observe],
            storage_options=storage_options, local_dir=local_dir, keep_local=keep_local,
            process_group=process_group, dist=dist, incremental=incremental,
        )
        self.step = 0
        self.restored_step: int | None = None
        self.complete = False
        self.blocked_seconds = 0.0
        self._stopped_early = False  # with `complete`: ended by stop() or break, not by a range
        self._ranging = False
        self._entered = False
        self._closed = False
        self._signal: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._stop_requested = False
        self._pending_step: int | None = None  # yielded by range, not yet completed
        # The step, `complete` and `_stopped_early` before the loop was left during a step,
        # until that leave is known not to be an exception (see `_leave`).
        self._left: tuple[int, bool, bool] | None = None
        self._boundary_owed = False  # left during a step, in a group: see `_meet`
        self._handle: SaveHandle | None = None  # the asynchronous save in flight
        self._saved_step: int | None = None
        self._saved_complete = False
        self._last_save_time = time.monotonic()
        self._failures = 0
        self._errors_reported: list[int | None] = []  # steps of error events the manager sent

    # -- the loop ----------------------------------------------------------------------------

    def __enter__(self) -> Run:
        if self._entered:
            raise SafepointError(f"the run under {self.root} was entered already: use a new Run")
        self._entered = True
        try:
            self._install_signal_handlers()
            self._restore()
            if self.save_initial and self.restored_step is None:
                self._save(complete=False, wait=False)
        except BaseException:
            self._close(ok=False)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            if self._left is not None:  # the exception left the loop: that step is not done
                self.step, self.complete, self._stopped_early = self._left
                self._left = None
            self._pending_step = None  # nor when a range kept suspended is closed later
            self._close(ok=False)

    def range(self, total: int) -> Iterator[int]:
        """Yield the steps `self.step .. total - 1`: from 0 on a fresh run, from the restored
        step on a resumed one. After each step, save when one is due; after the last (or
        after `stop()`), save and wait for the commit.

        A `break` (or `return`) out of the loop counts the step it leaves as completed, as
        soon as the loop is left: `self.step` is the next step and a later range starts
        there. An iterator of the range kept after the loop (`pbar = tqdm(run.range(n))`)
        leaves it open until it is closed (`pbar.close()`) or dropped: nothing tells a
        `break` from the body of its step before then, and a range started meanwhile is
        refused as nested. An exception from the loop body that leaves the `with` block does
        not count its step. Prefer `stop()`, which also saves. In a group, a `break` on some
        ranks only ends every rank's range after that same step, once the breaking ranks end
        the `with` block or start their next range.

        Raises:
            Preempted: a preemption signal arrived; the step just completed is committed.
            SafepointError: the run is not entered; or `total` is not a whole number >= 0;
                or a save failed and `on_save_error="raise"`; or `max_failed_saves` saves in
                a row failed.
            DistributedError: in a group, `total` differs by rank, or is refused on some
                rank (raised on every rank before the first step of the range).
        """
        if not self._entered or self._closed:
            raise SafepointError("use run.range() inside `with sp.Run(...) as run:`")
        if self._ranging:
            raise SafepointError(
                f"run.range() of the run under {self.root} was called inside another: a run "
                "has one step counter, so nest a plain loop (for epoch in ...: for step in "
                "run.range(...)) or use one range of steps; after a break out of a range "
                "whose iterator is kept (pbar = tqdm(run.range(n))), close it first "
                "(pbar.close()), which counts the step it left")
        self._meet()
        total = self._agreed_total(total)
        self._left = None  # the loop before this one was left without an exception
        if self.complete and self._stopped_early:  # restored from a run stopped early
            return
        if self.complete and self.step < total:
            logger.info("the run under %s finished at step %d; going on to %d", self.root,
                        self.step, total)
        self._ranging = True
        try:
            while not self._boundary(total):
                self._pending_step = self.step
                try:
                    yield self.step
                except GeneratorExit:  # the loop was left during this step
                    self._leave()
                    raise
                self._pending_step = None
                self.step += 1
                self.complete = False
        finally:
            self._ranging = False

    def stop(self) -> None:
        """End `range` after the current step, with a final save (early stopping)."""
        self._stop_requested = True

    def shield(self, loader: Loader) -> Loader:
        """Make the worker processes `loader` starts from now on ignore this run's `signals`
        until this process exits, and return it. Use it for a DataLoader with workers that
        `sp.ResumableSampler.track` does not iterate (which does this by itself), such as
        torchdata's StatefulDataLoader.

        A scheduler signals every process of the job (SLURM), and a worker that ends on the
        signal makes torch raise "DataLoader worker ... killed by signal" in this process
        before the run saves at the step boundary. The loader's own `worker_init_fn` still
        runs, after; the workers end when the loader shuts them down, when this process
        exits (multiprocessing terminates them then) or when it dies.

        Example:
            with sp.Run("ckpt/run1", state) as run:
                loader = run.shield(StatefulDataLoader(dataset, num_workers=4))
        """
        workers: Any = loader  # a DataLoader: its worker_init_fn is read at each iter()
        workers.worker_init_fn = ShieldedWorker(self.signals, exiting_flag(),
                                                workers.worker_init_fn)
        return loader

    def _leave(self) -> None:
        """The loop over `range` was left during its pending step: count that step as
        completed (README: a `break` does), and the run as stopped early.

        A `break` and an exception from the loop body both close the generator with
        `GeneratorExit`, and nothing there tells them apart. So the step counts at once (after
        a `break`, `run.step` and a second range see the next step), and the state before is
        kept in `_left` until a later `range()` or `finish()` confirms it; an exception
        leaving the `with` block first puts it back (also one raised after a `break`: the run
        saves nothing more then either way). An exception caught inside the block counts as
        a `break` once a range or `finish()` follows: nothing tells them apart there either.
        """
        if self._pending_step is None:
            return
        self._left = (self._pending_step, self.complete, self._stopped_early)
        self.step, self._pending_step = self._pending_step + 1, None
        self.complete = False
        self._stopped_early = True
        self._boundary_owed = self._manager.group.size > 1

    def _meet(self) -> None:
        """In a group, after this rank left its loop during a step (`_leave`) and before its
        next collective call (the final save, or the next range's check of its total): take
        part in the step boundary the other ranks wait at, saying it left, so that their
        range ends there too (`_Decision.left`) and every rank makes the same next call.
        Not sooner: only then is the leave known to be a `break`, not an exception leaving
        the `with` block, after which this rank makes no collective call.
        """
        if self._boundary_owed:
            self._boundary_owed = False
            self._decide(last=False, left=True)  # the decision (`left`) asks nothing more here

    @property
    def preempted(self) -> bool:
        """Whether one of `signals` arrived."""
        return self._signal is not None

    def finish(self) -> None:
        """Mark the run complete: save the current step as final (unless it was already),
        wait for the commit, with `keep_final_only` delete every other checkpoint (in
        `local_dir` too, and the steps of a branch abandoned by a rollback), and close the
        run. Leaving the `with` block normally calls it.

        Raises:
            SafepointError: the final save failed (whatever `on_save_error` says: there is no
                later save to make up for it).
        """
        if self._closed:
            return
        if not self._entered:
            raise SafepointError("use run.finish() inside `with sp.Run(...) as run:`")
        try:
            self._leave()  # a `range` left suspended during a step (its iterator kept)
            self._meet()
            self._left = None
            if not (self._saved_step == self.step and self._saved_complete):
                self._save(complete=True, wait=True, on_failure="raise")
            self._settle()
            self.complete = True
            if self.keep_final_only:
                deleted = self._manager._keep_only(self.step)
                logger.info("kept only step %d under %s: deleted steps %s", self.step,
                            self.root, deleted)
        except BaseException:
            self._close(ok=False)
            raise
        self._close(ok=True)

    # -- decisions ---------------------------------------------------------------------------

    def _agreed_total(self, total: object) -> int:
        """`total` checked on every rank and the same on every rank, in one exchange: a bad
        or differing total on some rank raises on all. Ranks whose totals differ would part
        at the smaller one, one in its final save while the others train on, and wait there
        for the group's timeout; the boundaries' all-reduce does not carry the total."""

        def same(totals: list[int]) -> int:
            return alike(totals, differ=f"run.range() of the run under {self.root}: the "
                         "ranks' totals differ", fix="they would not stop at the same step: "
                         "pass the same total on every rank (e.g. the fewest batches any "
                         "rank's loader holds); nothing was trained or saved in this range",
                         url=self.root, label=lambda each: f"run.range({each})")

        agreed: int = exchange(
            self._manager.group, lambda: whole_number("run.range() total", total, least=0),
            same, what=f"run.range() of the run under {self.root}",
            consequence="nothing was trained or saved in this range")
        return agreed

    def _boundary(self, total: int) -> bool:
        """Between two steps (and before the first): save if due, raise `Preempted` if a
        signal arrived. Returns whether the range ends."""
        last = self.step >= total
        decision = self._decide(last=last)
        if decision.left:  # as after a `break` here (`_leave`): the step is completed already
            self._stopped_early = True
            return True
        if decision.stop:
            # The range ends on a commit: wait for a save in flight (which may be of this
            # step). Before a preemption's save its failure is only reported, so that the
            # job still saves and exits to be requeued.
            self._settle(fatal=not decision.preempt)
            self._stopped_early = not last and not decision.preempt
        if decision.save and self._saved_step != self.step:
            self._save(complete=decision.stop and not decision.preempt, wait=decision.stop,
                       on_failure="report" if decision.preempt else "policy")
        if decision.preempt:
            self._preempt()
        return decision.stop

    def _decide(self, *, last: bool, left: bool = False) -> _Decision:
        """Whether to save, stop or exit for preemption now, from this process's view: the
        schedule, `stop()` and the signal flag. Reaching the last step wins over a signal
        (the run is done; nothing to requeue), and so does `stop()` in the same step: the run
        was stopped, and a requeued job would train on past the stop.

        In a distributed run every rank must take the same decision at the same step: the
        flags (the signal's number, `stop()`, the schedule) are maximised over the ranks, so
        any rank that was signalled, stopped or found a save due decides it for all. A rank
        that left its loop during the step (`left`, from `_meet`) takes part in the boundary
        the others reached after that step, and ends their range there: a `break` on one
        rank (a NaN in its own loss) would otherwise leave it in its final save while the
        others wait here, until the group's timeout.
        """
        due = self._saved_step != self.step and (
            (self.every_steps is not None and self.step > 0
             and self.step % self.every_steps == 0)
            or (self.every_seconds is not None
                and time.monotonic() - self._last_save_time >= self.every_seconds)
        )
        signum, stop_requested, due_anywhere, left_anywhere = self._manager.group.maximum(
            [self._signal or 0, int(self._stop_requested), int(due), int(left)]
        )
        if signum and self._signal is None:
            self._signal = signum  # another rank was signalled: exit with it
        if left_anywhere:
            return _Decision(save=False, stop=True, preempt=False, left=True)
        preempt = self._signal is not None and not last and not stop_requested
        stop = last or bool(stop_requested) or preempt
        return _Decision(save=stop or bool(due_anywhere), stop=stop, preempt=preempt)

    def _preempt(self) -> None:
        assert self._signal is not None
        name = _signal_name(self._signal)
        if self._saved_step == self.step:
            message = (f"{name} received: step {self.step} is committed under {self.root}; "
                       f"exiting with status {REQUEUE_EXIT_CODE} so the job is requeued, and "
                       "the restarted job resumes from it")
        else:
            message = (f"{name} received but the save of step {self.step} failed: exiting "
                       f"with status {REQUEUE_EXIT_CODE}; the restarted job resumes from "
                       f"{self._resume_point()} under {self.root}")
        logger.warning("%s", message)
        raise Preempted(message, step=self._saved_step, url=self.root)

    # -- saving ------------------------------------------------------------------------------

    def _restore(self) -> None:
        started = time.perf_counter()
        try:
            step = self._manager.restore(self.state)
        finally:
            self.blocked_seconds += time.perf_counter() - started
        self.restored_step = step
        if step is not None:
            recorded = self._manager.metadata(step).metadata.get(RUN_KEY)
            recorded = recorded if isinstance(recorded, dict) else {}
            self.complete = recorded.get("complete") is True
            # Written before this was recorded: taken as stopped, as such runs were.
            self._stopped_early = recorded.get("stopped_early", True) is not False
            self.step = step
            self._saved_step, self._saved_complete = step, self.complete
            logger.info("resumed from step %d under %s%s", step, self.root,
                        " (a finished run)" if self.complete else "")
        self._last_save_time = time.monotonic()

    def _save(
        self, *, complete: bool, wait: bool,
        on_failure: Literal["policy", "raise", "report"] = "policy",
    ) -> None:
        """Save the current step; with `wait`, until it is committed. A failure follows
        `on_save_error` ("policy"), always raises (the final save: nothing later makes up for
        it), or is only reported (the save on preemption: the job exits to be requeued)."""
        started = time.perf_counter()
        step = self.step
        try:
            self._settle()
            reported = len(self._errors_reported)
            try:
                handle = self._manager.save(step, self.state, metadata={RUN_KEY: {
                    "complete": complete, "stopped_early": complete and self._stopped_early}})
                if wait:
                    handle.result()
            except (OSError, DistributedError) as exc:
                if not _save_failed(exc):
                    raise
                emitted = step in self._errors_reported[reported:]
                if on_failure == "raise":
                    raise SafepointError(
                        f"the final save of step {step} under {self.root} failed: {exc}; a "
                        f"restarted job resumes from {self._resume_point()}",
                        url=self.root,
                    ) from exc
                self._failed(step, exc, emitted=emitted, fatal=on_failure == "policy")
                return
        finally:
            self.blocked_seconds += time.perf_counter() - started
            # A failed save waits out the interval too rather than be retried every step.
            self._last_save_time = time.monotonic()
        self._saved_step, self._saved_complete = step, complete
        if wait:
            self._failures = 0
        else:
            self._handle = handle

    def _settle(self, fatal: bool = True) -> None:
        """Wait for the asynchronous save in flight and count its outcome (a failure follows
        `on_save_error` when `fatal`, else it is only reported)."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.result()
        except (OSError, DistributedError) as exc:
            if not _save_failed(exc):
                raise
            if self._saved_step == handle.step:
                self._saved_step, self._saved_complete = None, False
            self._failed(handle.step, exc, emitted=True, fatal=fatal)
        else:
            self._failures = 0

    def _failed(self, step: int, exc: OSError | DistributedError, *, emitted: bool,
                fatal: bool) -> None:
        """A save failed: report it (an error event unless the manager sent one) and raise
        it, or log it and train on, per `on_save_error` and `max_failed_saves`."""
        self._failures += 1
        if not emitted:
            emit(Event(ERROR, self._manager.step_url(step), step,
                       error=f"{type(exc).__name__}: {exc}"), self._callbacks)
        if not fatal:
            return
        if self.on_save_error == "raise":
            raise exc
        if self._failures >= self.max_failed_saves:
            raise SafepointError(
                f"{self._failures} saves in a row failed under {self.root} (the last, of step "
                f"{step}: {exc}); stopping rather than training on without checkpoints: fix "
                f"the storage and restart, which resumes from {self._resume_point()}",
                url=self.root,
            ) from exc
        logger.warning("the save of step %d under %s failed (%s); training goes on, the "
                       "previous checkpoint stays valid (%d failed in a row, the limit is %d)",
                       step, self.root, exc, self._failures, self.max_failed_saves)

    def _observe(self, event: Event) -> None:
        if event.kind == ERROR:
            self._errors_reported.append(event.step)

    # -- lifecycle ---------------------------------------------------------------------------

    def _close(self, *, ok: bool) -> None:
        """Close the manager (waiting for a save in flight) and restore the signal handlers.
        When the run did not end well (`ok=False`), a failure here is logged rather than
        raised, so it does not hide the error that ended the run."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.close()
        except Exception:
            if ok:
                raise
            logger.exception("closing the checkpoint manager of %s failed", self.root)
        finally:
            self._restore_signal_handlers()

    def _resume_point(self) -> str:
        """Where a restarted job would resume: the step `restore` would try first. For the
        message of a failure, so at best: the storage may be what failed, and listing it
        must not turn a preemption's requeue status into a crash."""
        try:
            order = self._manager._restore_order(self._manager.steps())  # both tiers
        except SafepointError as exc:
            return f"the step committed last (the steps cannot be listed now: {exc})"
        return f"step {order[0]}" if order else "the start (nothing is committed)"

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("sp.Run entered outside the main thread: preemption signals %s are "
                           "not caught", [_signal_name(s) for s in self.signals])
            return
        for signum in self.signals:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: the loop acts on it at the next step boundary. A second signal
        # (also during the final save) changes nothing.
        if self._signal is None:
            self._signal = signum
