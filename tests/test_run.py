"""sp.Run in process: the step schedule (every_steps, every_seconds, the initial and final
saves), resume, stop/break/finish and the complete mark, keep_final_only, preemption signals
(also a second one during the save), and the save-error policy with injected storage faults.
The exit status in a real process and kills at random moments are in test_resume_e2e."""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint as sp
from safepoint import storage
from safepoint._tiered import TieredManager
from safepoint.testing import FaultyStorage, MemoryBackend
from test_dist import results, run_group


def _state() -> dict[str, Any]:
    return {"w": torch.zeros(3), "count": 0}


def _train(state: dict[str, Any], step: int) -> None:
    state["w"] += step + 1
    state["count"] += 1


def _events(kind: str, log: list[sp.Event]) -> list[int | None]:
    return [event.step for event in log if event.kind == kind]


def _run(root: str, state: dict[str, Any], total: int, **options: Any) -> sp.Run:
    with sp.Run(root, state, **options) as run:
        for step in run.range(total):
            _train(state, step)
    return run


def _restored(root: str, step: int | None = None) -> dict[str, Any]:
    state = _state()
    with sp.CheckpointManager(root) as manager:
        manager.restore(state, step, keys=["w", "count"])
    return state


def test_a_fresh_run_saves_on_schedule_and_at_the_end(tmp_path: Path) -> None:
    log: list[sp.Event] = []
    state = _state()
    run = _run(str(tmp_path), state, 10, every_steps=4, keep_last=None, on_event=log.append)
    assert run.step == 10 and run.complete and run.restored_step is None
    assert _events("save", log) == [4, 8, 10]
    with sp.CheckpointManager(str(tmp_path)) as manager:
        assert manager.steps() == [4, 8, 10]
        assert manager.metadata(10).metadata[sp._run.RUN_KEY] == {"complete": True,
                                                                  "stopped_early": False}
        assert manager.metadata(8).metadata[sp._run.RUN_KEY] == {"complete": False,
                                                                 "stopped_early": False}
    assert torch.equal(_restored(str(tmp_path), 4)["w"], torch.full((3,), 10.0))
    assert _restored(str(tmp_path))["count"] == 10


def test_resume_continues_after_the_restored_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    state = _state()
    with pytest.raises(RuntimeError), sp.Run(root, state, every_steps=3) as run:
        for step in run.range(10):
            if step == 7:
                raise RuntimeError("crash")
            _train(state, step)
    state = _state()
    seen = []
    with sp.Run(root, state, every_steps=3) as run:
        assert (run.restored_step, run.step, run.complete) == (6, 6, False)
        assert state["count"] == 6
        for step in run.range(10):
            seen.append(step)
            _train(state, step)
    assert seen == [6, 7, 8, 9]
    assert state["count"] == 10 and torch.equal(state["w"], torch.full((3,), 55.0))


def test_a_finished_run_does_nothing_when_restarted(tmp_path: Path) -> None:
    root = str(tmp_path)
    _run(root, _state(), 5, every_steps=2)
    state = _state()
    with sp.Run(root, state, every_steps=2) as run:
        assert run.complete and run.restored_step == 5
        assert list(run.range(5)) == []
    with sp.CheckpointManager(root) as manager:
        assert manager.latest_step() == 5


def test_a_finished_run_goes_on_to_a_larger_total(tmp_path: Path) -> None:
    """Training extended: a run that reached the end of range(5) and is restarted with
    range(8) trains steps 5..7 (a run stopped early does not: see below)."""
    root = str(tmp_path)
    _run(root, _state(), 5, every_steps=2)
    state = _state()
    run = _run(root, state, 8, every_steps=2)
    assert run.restored_step == 5 and run.complete and run.step == 8 and state["count"] == 8
    assert _restored(root)["count"] == 8


def test_a_crash_in_a_second_range_resumes_it(tmp_path: Path) -> None:
    """Two ranges in one run (a warm-up then the main phase, or one range per epoch up to a
    running total): a crash in the second before its first save resumes the second from
    the end of the first, rather than finding a finished run (found by a review)."""
    root = str(tmp_path)
    state = _state()
    with pytest.raises(RuntimeError), sp.Run(root, state, every_steps=100) as run:
        for step in run.range(10):
            _train(state, step)
        for step in run.range(20):
            _train(state, step)
            if step == 15:
                raise RuntimeError("crash")
    state, taken = _state(), []
    with sp.Run(root, state, every_steps=100) as run:
        assert run.restored_step == 10
        for step in run.range(10):
            taken.append(step)
        for step in run.range(20):
            taken.append(step)
            _train(state, step)
    assert taken == list(range(10, 20)) and run.step == 20 and state["count"] == 20


def test_nested_ranges_are_refused(tmp_path: Path) -> None:
    """One step counter per run: a range inside a range would yield step 0 twice and end at
    a step neither asked for."""
    state = _state()
    with pytest.raises(sp.SafepointError, match="inside another"), \
            sp.Run(str(tmp_path), state) as run:
        for _epoch in run.range(3):
            for step in run.range(10):
                _train(state, step)
    with sp.Run(str(tmp_path / "again"), _state()) as run:  # one after the other is fine
        assert list(run.range(2)) == [0, 1] and list(run.range(3)) == [2]


def test_a_kept_iterator_left_by_a_break_counts_its_step_once_closed(tmp_path: Path) -> None:
    """A range whose iterator is kept (a progress bar) stays open after a `break` until it
    is closed: a later range is refused as nested, saying to close it, and nothing is
    trained by it; closed, the step left counts and a later range starts after it."""
    state = _state()
    with sp.Run(str(tmp_path), state, every_steps=1, keep_last=None) as run:
        steps = run.range(10)
        for step in steps:
            _train(state, step)
            if step == 4:
                break
        with pytest.raises(sp.SafepointError, match=r"inside another.*pbar\.close\(\)"):
            next(iter(run.range(10)))
        assert run.step == 4
        steps.close()
        assert run.step == 5
        assert list(run.range(7)) == [5, 6]


def test_every_seconds_waits_an_interval_after_a_failed_save(
    flaky: FlakyBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """every_seconds=10, steps of 3 s, the save at step 4 fails (and would at 5 and 6): the
    next attempt is an interval later (step 8), not at every step, so a short storage blip
    does not use up max_failed_saves in three steps (found by a review)."""
    clock = [1000.0]
    monkeypatch.setattr(sp._run.time, "monotonic", lambda: clock[0])
    flaky.failing = {4, 5, 6}
    log: list[sp.Event] = []
    state = _state()
    with sp.Run("flaky-test://run", state, every_seconds=10, async_save=False, keep_last=None,
                on_event=log.append) as run:
        for step in run.range(12):
            _train(state, step)
            clock[0] += 3
    assert _events("error", log) == [4] and _events("save", log) == [8, 12]


def test_every_seconds(tmp_path: Path) -> None:
    saved: list[tuple[int | None, float]] = []

    def record(event: sp.Event) -> None:
        if event.kind == "save":
            saved.append((event.step, time.monotonic()))

    state = _state()
    with sp.Run(str(tmp_path), state, every_seconds=0.15, keep_last=None, async_save=False,
                on_event=record) as run:
        for step in run.range(8):
            time.sleep(0.05)
            _train(state, step)
    steps = [step for step, _ in saved]
    assert steps[-1] == 8 and len(steps) >= 2, steps  # 0.4 s of steps: one save at least
    times = [when for _, when in saved[:-1]]
    assert all(b - a >= 0.12 for a, b in itertools.pairwise(times)), saved


def test_save_initial(tmp_path: Path) -> None:
    root = str(tmp_path)
    state = _state()
    with sp.Run(root, state, save_initial=True, async_save=False) as run:
        with sp.CheckpointManager(root) as manager:
            assert manager.steps() == [0]
        for step in run.range(2):
            _train(state, step)
    with sp.Run(root, _state(), save_initial=True, keep_last=None) as run:
        assert run.restored_step == 2  # a resumed run does not save step 0 again
    with sp.CheckpointManager(root) as manager:
        assert manager.steps() == [0, 2]


def test_stop_ends_the_range_with_a_final_save(tmp_path: Path) -> None:
    state = _state()
    with sp.Run(str(tmp_path), state, every_steps=100) as run:
        for step in run.range(50):
            _train(state, step)
            if step == 6:
                run.stop()
    assert run.step == 7 and run.complete
    assert _restored(str(tmp_path))["count"] == 7


def test_break_counts_the_step_it_leaves(tmp_path: Path) -> None:
    state = _state()
    with sp.Run(str(tmp_path), state, every_steps=100) as run:
        for step in run.range(50):
            _train(state, step)
            if step == 3:
                break
    assert run.step == 4 and run.complete
    with sp.CheckpointManager(str(tmp_path)) as manager:
        assert manager.steps() == [4]
    assert _restored(str(tmp_path))["count"] == 4


def test_a_break_then_a_second_range_does_not_repeat_the_step_it_left(tmp_path: Path) -> None:
    """A warm-up range left with `break` at step 4, then a second range ("ranges run one
    after another"): `run.step` is 5 as soon as the loop is left and the second range goes
    on at 5, so every checkpoint's step is the number of steps it holds. The step used to
    count only in `finish()`: step 4 ran twice and every later checkpoint held one step more
    than its name, so a resume trained one step too many (found by a review)."""
    root = str(tmp_path)
    state, taken = _state(), []
    with sp.Run(root, state, every_steps=3, async_save=False, keep_last=None) as run:
        for step in run.range(10):
            _train(state, step)
            taken.append(step)
            if step == 4:
                break
        assert run.step == 5, "a break counts the step it leaves as completed"
        for step in run.range(8):
            _train(state, step)
            taken.append(step)
    assert taken == list(range(8)) and run.step == 8 and run.complete
    with sp.CheckpointManager(root) as manager:
        assert manager.steps() == [3, 6, 8]
    for step in (3, 6, 8):
        assert _restored(root, step)["count"] == step


def test_an_exception_in_the_loop_body_does_not_count_its_step(tmp_path: Path) -> None:
    """A step that raises is not completed, unlike one left with `break`: after a crash in
    step 5 (in a second range, after a `break` out of the first) `run.step` is 5, nothing
    more is saved, and the restarted job trains step 5 again, from the checkpoint of the
    `break`."""
    root = str(tmp_path)
    state = _state()
    with pytest.raises(RuntimeError, match="crash"), \
            sp.Run(root, state, every_steps=3, async_save=False) as run:
        for step in run.range(10):
            _train(state, step)
            if step == 3:
                break
        for step in run.range(10):
            if step == 5:
                raise RuntimeError("crash")
            _train(state, step)
    assert run.step == 5 and not run.complete
    with sp.CheckpointManager(root) as manager:
        assert manager.steps() == [3]
    state, taken = _state(), []
    with sp.Run(root, state, every_steps=3) as run:
        assert run.restored_step == 3 and state["count"] == 3
        for step in run.range(6):
            taken.append(step)
            _train(state, step)
    assert taken == [3, 4, 5] and _restored(root)["count"] == 6


def test_a_preemption_after_a_break_saves_the_step_it_left(tmp_path: Path) -> None:
    """SIGTERM during step 4, which the loop leaves with `break`; the next range saves at
    its first boundary and exits to be requeued. The checkpoint is step 5 holding 5 steps
    (the break's step counted): it used to be named step 4 though it held 5."""
    root = str(tmp_path)
    state = _state()
    with pytest.raises(sp.Preempted) as caught, sp.Run(root, state, every_steps=100) as run:
        for step in run.range(50):
            _train(state, step)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
                break
        for step in run.range(50):
            _train(state, step)
    assert caught.value.step == 5 and state["count"] == 5
    with sp.CheckpointManager(root) as manager:
        assert manager.steps() == [5]
    assert _restored(root)["count"] == 5


def test_a_second_range_after_stop_trains_nothing(tmp_path: Path) -> None:
    """`run.stop()` (also with a `break` in the same step) stops the run, not one range: a
    second range in the same process yields nothing, as one does after a restart."""
    for leave in (False, True):
        root = str(tmp_path / str(leave))
        state = _state()
        with sp.Run(root, state) as run:
            for step in run.range(10):
                _train(state, step)
                if step == 2:
                    run.stop()
                    if leave:
                        break
            assert run.step == 3 and list(run.range(20)) == []
        assert _restored(root)["count"] == 3
        with sp.Run(root, _state()) as run:
            assert run.complete and list(run.range(20)) == []


def test_keep_final_only(tmp_path: Path) -> None:
    _run(str(tmp_path), _state(), 9, every_steps=2, keep_last=None, keep_final_only=True)
    with sp.CheckpointManager(str(tmp_path)) as manager:
        assert manager.steps() == [9]


def test_keep_final_only_after_a_rollback_deletes_the_abandoned_steps(tmp_path: Path) -> None:
    """A finished run rolled back to step 4 and saved step 6 again; the next run resumes
    from that 6 (the step committed last, not the abandoned 9) and, finishing at 7 with
    keep_final_only, leaves step 7 alone: the abandoned 8 and 9 go too."""
    root = str(tmp_path)
    _run(root, _state(), 9, every_steps=2, keep_last=None)
    state = _state()
    with sp.CheckpointManager(root, keep_last=None) as manager:
        manager.restore(state, 4)
        _train(state, 4)
        _train(state, 5)
        manager.save(6, state).result()
    state = _state()
    run = _run(root, state, 7, every_steps=2, keep_last=None, keep_final_only=True)
    assert run.restored_step == 6 and run.complete and state["count"] == 7
    with sp.CheckpointManager(root) as manager:
        assert manager.steps() == [7]
    assert _restored(root)["count"] == 7


def test_keep_final_only_with_local_dir_empties_both_tiers_but_the_final_step(
    tmp_path: Path,
) -> None:
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    _run(remote, _state(), 9, every_steps=2, keep_last=None, local_dir=local, keep_local=3,
         keep_final_only=True)
    for root in (remote, local):
        with sp.CheckpointManager(root) as manager:
            assert manager.steps() == [9], root
    assert _restored(remote)["count"] == 9


def test_epochs(tmp_path: Path) -> None:
    """range over epochs, a save each epoch: a restarted job continues at saved epoch + 1."""
    sampler = sp.ResumableSampler(12, seed=0)
    state = {"data": sampler, "seen": 0}
    with pytest.raises(RuntimeError), sp.Run(str(tmp_path), state, every_steps=1) as run:
        for _ in run.range(4):
            for _ in sampler:
                state["seen"] += 1
                if state["seen"] == 2 * 12 + 5:
                    raise RuntimeError("crash mid-epoch 2")
    sampler = sp.ResumableSampler(12, seed=0)
    state = {"data": sampler, "seen": 0}
    with sp.Run(str(tmp_path), state, every_steps=1) as run:
        assert run.step == 2 and (sampler.epoch, sampler.position) == (2, 0)
        assert state["seen"] == 24
        for _ in run.range(4):
            state["seen"] += len(list(sampler))
    assert state["seen"] == 48 and sampler.epoch == 4


# -- preemption ----------------------------------------------------------------------------


def test_a_signal_saves_at_the_step_boundary_and_raises_preempted(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    state = _state()
    with pytest.raises(sp.Preempted) as caught, sp.Run(str(tmp_path), state,
                                                       every_steps=100) as run:
        assert signal.getsignal(signal.SIGTERM) != before
        for step in run.range(50):
            _train(state, step)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
    assert caught.value.code == 75 and caught.value.step == 5
    assert isinstance(caught.value, SystemExit) and "SIGTERM" in str(caught.value)
    assert run.preempted and not run.complete
    assert signal.getsignal(signal.SIGTERM) == before
    with sp.CheckpointManager(str(tmp_path)) as manager:
        assert manager.steps() == [5]
        assert sp.verify(manager.step_url(5)).ok
    assert _restored(str(tmp_path))["count"] == 5


RUN_WITH_WORKERS = """
import sys, time, torch, safepoint as sp
from torch.utils.data import DataLoader, TensorDataset
data = TensorDataset(torch.randn(400, 4))
sampler = sp.ResumableSampler(data, seed=0)
loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2,
                    generator=sampler.generator)
w = torch.zeros(4)
with sp.Run(sys.argv[1], {"w": w, "data": sampler}, every_steps=1000) as run:
    batches = sampler.track(loader, epochs=None)
    for step in run.range(100000):
        (x,) = next(batches)
        w += x.sum(0)
        if step == 5:
            print("running", flush=True)
        time.sleep(0.01)
"""


@pytest.mark.multiprocess
def test_sigterm_to_the_whole_job_with_dataloader_workers_saves_and_requeues(
    tmp_path: Path,
) -> None:
    """SLURM signals every process of a job step, DataLoader workers included. The README's
    loop (ResumableSampler, workers, track) died with exit 1: the workers ended on SIGTERM and
    torch raised "DataLoader worker ... killed by signal" mid-step, nothing saved. It now
    saves at the step boundary and exits with 75, the data position that of the saved step."""
    child = tmp_path / "child.py"
    child.write_text(RUN_WITH_WORKERS)
    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(child), str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "running"
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGTERM)  # as slurmstepd signals a job step's processes
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 75, err[-2000:]
    sampler = sp.ResumableSampler(400)
    with sp.CheckpointManager(str(root)) as manager:
        step = manager.restore({"w": torch.zeros(4), "data": sampler})
    assert step is not None and step > 5
    assert (sampler.epoch, sampler.position) == divmod(step * 4, 400)


class SignalledWorker(torch.utils.data.Dataset[int]):
    """The worker that loads index 4 sends SIGTERM to itself and to the main process, as
    SLURM signalling every process of the job does."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        if index == 4:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getppid(), signal.SIGTERM)
        return index


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")  # torchdata on torch 2.13
def test_a_shielded_stateful_dataloader_outlives_the_signal_and_the_run_saves(
    tmp_path: Path,
) -> None:
    """A StatefulDataLoader (not iterated by sampler.track) under sp.Run: its workers ended
    on the job's SIGTERM and torch raised mid-step; `run.shield(loader)` makes them ignore
    the run's signals, so the run saves at the step boundary and raises Preempted."""
    import torchdata.stateful_dataloader as stateful
    seen: list[int] = []
    with pytest.raises(sp.Preempted) as caught, sp.Run(str(tmp_path), {"w": torch.zeros(1)},
                                                       every_steps=100) as run:
        loader = run.shield(stateful.StatefulDataLoader(SignalledWorker(), batch_size=4,
                                                        num_workers=2))
        batches = iter(loader)
        for _ in run.range(10):
            seen += next(batches).tolist()
    assert caught.value.code == 75 and seen == [0, 1, 2, 3]
    assert next(batches).tolist() == [4, 5, 6, 7]  # from the worker signalled loading it
    del batches, loader  # its workers end now, not at a later collection
    with sp.CheckpointManager(str(tmp_path)) as manager:
        assert manager.latest_step() == caught.value.step


class SignalsDuringSave:
    """A stateful entry that sends signals to its own process while a save collects it."""

    def __init__(self, *signums: int) -> None:
        self.signums = signums
        self.armed = False

    def state_dict(self) -> dict[str, Any]:
        if self.armed:
            for signum in self.signums:
                os.kill(os.getpid(), signum)
        return {"armed": self.armed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_more_signals_during_the_final_save_change_nothing(tmp_path: Path) -> None:
    bomb = SignalsDuringSave(signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM)
    state = {**_state(), "bomb": bomb}
    with pytest.raises(sp.Preempted) as caught, sp.Run(str(tmp_path), state) as run:
        for step in run.range(50):
            _train(state, step)
            if step == 2:
                bomb.armed = True
                os.kill(os.getpid(), signal.SIGUSR1)
    assert caught.value.step == 3 and "SIGUSR1" in str(caught.value)
    with sp.CheckpointManager(str(tmp_path)) as manager:
        assert manager.steps() == [3]
        assert sp.verify(manager.step_url(3)).ok
    assert _restored(str(tmp_path))["count"] == 3


def test_signals_are_configurable(tmp_path: Path) -> None:
    usr1 = signal.getsignal(signal.SIGUSR1)
    state = _state()
    with pytest.raises(sp.Preempted), sp.Run(str(tmp_path), state,
                                             signals=[signal.SIGUSR2]) as run:
        assert signal.getsignal(signal.SIGUSR1) == usr1  # not caught by this run
        for step in run.range(50):
            _train(state, step)
            os.kill(os.getpid(), signal.SIGUSR2)


def test_a_signal_on_the_last_step_finishes_the_run(tmp_path: Path) -> None:
    state = _state()
    with sp.Run(str(tmp_path), state) as run:
        for step in run.range(3):
            _train(state, step)
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
    assert run.preempted and run.complete and run.step == 3


def test_a_signal_in_the_step_that_called_stop_does_not_undo_the_stop(tmp_path: Path) -> None:
    """Early stopping decided in a step (`run.stop()`) and SIGTERM in that same step: the
    stop wins, as the last step does (nothing to requeue). The signal used to win: the step
    was saved with `complete` unset and the run exited with 75, and the requeued job trained
    on past the stop (found by a review)."""
    root = str(tmp_path)
    state = _state()
    with sp.Run(root, state, every_steps=100) as run:
        for step in run.range(10):
            _train(state, step)
            if step == 4:
                run.stop()
                os.kill(os.getpid(), signal.SIGTERM)
    assert run.preempted and run.complete and run.step == 5
    restarted, trained = _state(), []
    with sp.Run(root, restarted, every_steps=100) as run:
        trained.extend(run.range(10))
    assert trained == [] and run.complete and run.step == 5 and restarted["count"] == 5


# -- save failures -------------------------------------------------------------------------


class FlakyBackend:
    """A memory backend whose data writes fail for the steps in `failing`, and every call
    under the URL `down` (an outage) while it is set."""

    def __init__(self) -> None:
        self.memory = MemoryBackend()
        self.failing: set[int] = set()
        self.down: str | None = None

    def __call__(self, url: str, storage_options: dict[str, Any] | None = None) -> FaultyStorage:
        name = url.rstrip("/").rsplit("/", 1)[-1]
        step = int(name[5:]) if name.startswith("step-") else None

        def fails(op: str, path: str, count: int) -> bool:
            if self.down is not None and url.startswith(self.down):
                return True
            return op == "write" and step in self.failing

        return FaultyStorage(self.memory(url, storage_options), fails)


@pytest.fixture
def flaky() -> Iterator[FlakyBackend]:
    backend = FlakyBackend()
    storage.register("flaky-test", backend)
    try:
        yield backend
    finally:
        storage._REGISTERED.pop("flaky-test", None)


@pytest.mark.parametrize("async_save", [True, False])
def test_failed_saves_warn_and_training_goes_on(
    flaky: FlakyBackend, caplog: pytest.LogCaptureFixture, async_save: bool
) -> None:
    log: list[sp.Event] = []
    state = _state()
    flaky.failing = {3, 4}
    with sp.Run("flaky-test://run", state, every_steps=1, keep_last=None,
                async_save=async_save, on_event=log.append) as run:
        for step in run.range(8):
            _train(state, step)
    assert _events("error", log) == [3, 4]  # one event each, none twice
    assert _events("save", log) == [1, 2, 5, 6, 7, 8]
    assert "the save of step 3" in caplog.text and "training goes on" in caplog.text
    assert run.complete and _restored("flaky-test://run")["count"] == 8


def test_on_save_error_raise(flaky: FlakyBackend) -> None:
    state = _state()
    flaky.failing = {3}
    with pytest.raises(sp.StorageError), sp.Run("flaky-test://run", state, every_steps=1,
                                                 async_save=False,
                                                 on_save_error="raise") as run:
        for step in run.range(8):
            _train(state, step)
    assert _restored("flaky-test://run")["count"] == 2


def test_consecutive_failures_stop_the_run(flaky: FlakyBackend) -> None:
    state = _state()
    taken = []
    flaky.failing = set(range(3, 200))
    with pytest.raises(sp.SafepointError, match="3 saves in a row failed") as caught, \
            sp.Run("flaky-test://run", state, every_steps=2, max_failed_saves=3) as run:
        for step in run.range(100):
            taken.append(step)
            _train(state, step)
    assert isinstance(caught.value.__cause__, OSError)
    assert "resumes from step 2" in str(caught.value)
    assert len(taken) <= 10  # stopped early, not after 100 steps


def test_a_failed_final_save_raises_even_with_warn(flaky: FlakyBackend) -> None:
    state = _state()
    flaky.failing = {4}
    with pytest.raises(sp.SafepointError, match="final save of step 4"), \
            sp.Run("flaky-test://run", state, every_steps=100) as run:
        for step in run.range(4):
            _train(state, step)


# -- misuse --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"every_steps": 0}, {"every_seconds": 0}, {"on_save_error": "ignore"},
     {"max_failed_saves": 0}],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any]) -> None:
    with pytest.raises(sp.SafepointError, match=next(iter(options))):
        sp.Run(str(tmp_path), _state(), **options)


@pytest.mark.parametrize(
    ("options", "what"),
    [({"every_steps": "100"}, "every_steps"), ({"every_seconds": "600"}, "every_seconds"),
     ({"max_failed_saves": None}, "max_failed_saves"), ({"every_steps": 2.5}, "every_steps"),
     ({"every_steps": True}, "every_steps"), ({"signals": [99999]}, "signals"),
     ({"signals": [signal.SIGKILL]}, "SIGKILL cannot be caught"),
     ({"signals": signal.SIGTERM}, "signals"), ({"signals": ["SIGTERM"]}, "signals")],
    ids=["every_steps-str", "every_seconds-str", "max_failed_saves-None", "every_steps-float",
         "every_steps-bool", "signals-unknown", "signals-SIGKILL", "signals-not-a-list",
         "signals-names"],
)
def test_bad_run_options_raise_safepoint_error(
    tmp_path: Path, options: dict[str, Any], what: str
) -> None:
    """A schedule read from a config (`every_steps="100"`), a non-integer, a `None` where
    none is allowed or a signal that cannot be caught: `sp.Run(...)` itself raises a
    `SafepointError` naming the option and what to pass. A bare `TypeError` from a
    comparison used to escape, `every_steps=2.5` was taken (saving at 5, 10, ...), and a
    bad signal was a `ValueError` only on entering the run (found by a review)."""
    with pytest.raises(sp.SafepointError, match=what) as caught:
        sp.Run(str(tmp_path), _state(), **options)
    assert "pass" in str(caught.value)


def test_whole_numbers_of_other_types_are_taken(tmp_path: Path) -> None:
    """A schedule computed with torch (or NumPy) integers, or seconds as an int, works."""
    run = sp.Run(str(tmp_path), _state(), every_steps=torch.tensor(4), every_seconds=60,
                 max_failed_saves=torch.tensor(2))
    assert (run.every_steps, run.every_seconds, run.max_failed_saves) == (4, 60.0, 2)
    assert type(run.every_steps) is int and type(run.max_failed_saves) is int


def test_range_needs_the_with_block(tmp_path: Path) -> None:
    run = sp.Run(str(tmp_path), _state())
    with pytest.raises(sp.SafepointError, match="inside `with"):
        next(run.range(3))


@pytest.mark.parametrize("total", ["10", None, 2.5, True, -1],
                         ids=["str", "None", "float", "bool", "negative"])
def test_a_range_total_that_is_no_whole_number_is_refused(tmp_path: Path, total: Any) -> None:
    """A total read from a config as a str (or None) raised a bare TypeError from the first
    comparison with the step, and 2.5 was taken (found by a review); as the schedule's
    options, it is a whole number, here 0 or more, of any integer type."""
    with sp.Run(str(tmp_path), _state(), every_steps=2) as run:
        with pytest.raises(sp.SafepointError, match=r"total=.*pass a whole number >= 0"):
            next(run.range(total))
        assert list(run.range(torch.tensor(3))) == [0, 1, 2]
    with sp.Run(str(tmp_path / "empty"), _state()) as run:
        assert list(run.range(0)) == []


_BAD_OPTION_ON_ONE_RANK = """
import json, os, sys, time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import safepoint as sp

rank, port, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=timedelta(seconds=10))
started = time.monotonic()
try:
    with sp.Run(str(root / "run"), {"w": torch.zeros(2)},
                every_steps=0 if rank == 1 else 2) as run:
        for _ in run.range(2):
            pass
    outcome = ["ok", ""]
except Exception as exc:
    outcome = [type(exc).__name__, str(exc)]
(root / f"result-{rank}.json").write_text(
    json.dumps({"outcome": outcome, "seconds": time.monotonic() - started}))
deadline = time.monotonic() + 15  # linger until both ranks told what happened
while time.monotonic() < deadline and not all(
        (root / f"result-{r}.json").exists() for r in range(2)):
    time.sleep(0.05)
os._exit(0)
"""


@pytest.mark.multiprocess
def test_an_option_refused_on_one_rank_fails_the_run_on_every_rank_promptly(
    tmp_path: Path,
) -> None:
    """`every_steps=0` on rank 1 only of a 2-rank gloo group: rank 1 refused it, and rank 0
    entered the run, whose restore is collective, and waited there out the group's timeout
    (found by a review). The ranks tell each other how their options were checked, so both
    raise at once, naming the rank and the option."""
    worker = tmp_path / "worker.py"
    worker.write_text(_BAD_OPTION_ON_ONE_RANK)
    assert run_group(tmp_path, world=2, timeout=60, worker=worker) == [0, 0]
    for rank in results(tmp_path, 2):
        kind, message = rank["outcome"]
        assert kind == "DistributedError", rank
        assert "rank 1: SafepointError: every_steps=0" in message
        assert rank["seconds"] < 5, rank  # the group's timeout is 10 s


def test_preempted_when_its_save_fails_still_exits_to_be_requeued(flaky: FlakyBackend) -> None:
    flaky.failing = {5}
    state = _state()
    with pytest.raises(sp.Preempted) as caught, sp.Run("flaky-test://run", state,
                                                       every_steps=2) as run:
        for step in run.range(50):
            _train(state, step)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
    assert caught.value.code == 75 and caught.value.step == 4
    assert "save of step 5 failed" in str(caught.value)
    assert "resumes from step 4" in str(caught.value)


def test_a_two_tier_run_preempted_during_an_outage_of_its_root_exits_to_be_requeued(
    flaky: FlakyBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remote root is down (uploads fail, local_dir keeps every step), the save at the
    preemption fails too, SIGTERM arrives: the run raises Preempted (status 75) naming the
    step committed locally. Listing the remote root for the message raised StorageError,
    and the job exited 1, not to be requeued (found by a review)."""
    monkeypatch.setattr(TieredManager, "upload_backoff_s", 0.01)
    flaky.failing = {5}
    state = _state()
    with pytest.raises(sp.Preempted) as caught, \
            pytest.warns(UserWarning, match="cannot list flaky-test://run"), \
            sp.Run("flaky-test://run", state, every_steps=2, local_dir="flaky-test://local",
                   async_save=False) as run:
        for step in run.range(50):
            _train(state, step)
            if step == 2:
                flaky.down = "flaky-test://run"
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
    assert caught.value.code == 75 and caught.value.step == 4
    assert "save of step 5 failed" in str(caught.value)
    assert "resumes from step 4" in str(caught.value)


def test_a_preemption_saves_and_requeues_though_the_save_in_flight_failed(
    flaky: FlakyBackend,
) -> None:
    """SIGTERM while the background save of step 4 is failing, the second failure in a row
    with max_failed_saves=2: the run still saves step 5 and exits to be requeued (status
    75), instead of raising "2 saves in a row failed" with nothing saved (found by a
    review)."""
    flaky.failing = {2, 4}
    state = _state()
    with pytest.raises(sp.Preempted) as raised, \
            sp.Run("flaky-test://run", state, every_steps=2, max_failed_saves=2) as run:
        for step in run.range(50):
            _train(state, step)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
    assert raised.value.code == 75 and raised.value.step == 5
    with sp.CheckpointManager("flaky-test://run") as manager:
        assert manager.steps() == [5]


def test_a_preemption_waits_for_the_initial_save_before_calling_it_committed(
    flaky: FlakyBackend,
) -> None:
    """save_initial's background save of step 0 fails and SIGTERM arrives before the first
    step: the run waits for that save, finds it failed, saves step 0 again (the storage
    works now) and only then says step 0 is committed."""
    flaky.failing = {0}

    class Heal:  # the storage recovers once the first save failed
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    state = {**_state(), "heal": Heal()}
    log: list[sp.Event] = []

    def on_event(event: sp.Event) -> None:
        log.append(event)
        if event.kind == "error":
            flaky.failing = set()

    with pytest.raises(sp.Preempted) as raised, \
            sp.Run("flaky-test://run", state, save_initial=True, on_event=on_event) as run:
        os.kill(os.getpid(), signal.SIGTERM)
        for step in run.range(5):
            _train(state, step)
    assert _events("error", log) == [0] and _events("save", log) == [0]
    assert raised.value.step == 0 and "step 0 is committed" in str(raised.value)
    with sp.CheckpointManager("flaky-test://run") as manager:
        assert manager.steps() == [0]


def test_a_sampler_over_another_dataset_size_is_named_with_its_checkpoint(
    tmp_path: Path,
) -> None:
    state = {"w": torch.zeros(1), "train_sampler": sp.ResumableSampler(10)}
    with sp.Run(str(tmp_path), state) as run:
        assert list(run.range(2)) == [0, 1]
    state = {"w": torch.zeros(1), "train_sampler": sp.ResumableSampler(12)}
    with pytest.raises(sp.StateMismatch, match=r"step-2: 'train_sampler' \(ResumableSampler\)"
                       r" refused .* from 10 samples"):
        sp.Run(str(tmp_path), state).__enter__()


def test_preempted_survives_pickling() -> None:
    error = sp.Preempted("m", step=3, url="u")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.step, copy.url, copy.code) == (
        sp.Preempted, "m", 3, "u", 75)
    assert isinstance(copy, SystemExit) and isinstance(copy, sp.SafepointError)


def test_two_tiers_resume_from_the_remote_copy_on_a_new_machine(tmp_path: Path) -> None:
    """With `local_dir`, each save commits locally and is uploaded to the root; a job that
    crashes and restarts where the local disk is gone resumes from the root's copy."""
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    log: list[sp.Event] = []
    state = _state()
    with pytest.raises(RuntimeError), sp.Run(remote, state, every_steps=2, keep_last=2,
                                             local_dir=local, on_event=log.append) as run:
        for step in run.range(10):
            if step == 5:
                raise RuntimeError("crash")
            _train(state, step)
    assert sorted(s for s in _events("upload", log) if s is not None) == [2, 4]
    with sp.CheckpointManager(remote) as manager:
        assert manager.steps() == [2, 4]
    with sp.CheckpointManager(local) as manager:
        assert manager.latest_step() == 4

    for path in Path(local).rglob("*"):  # a new machine: the local disk is empty
        if path.is_file():
            path.unlink()
    state = _state()
    with sp.Run(remote, state, every_steps=2, keep_last=2, local_dir=local) as run:
        assert run.restored_step == 4 and state["count"] == 4
        for step in run.range(10):
            _train(state, step)
    expected = _state()
    for step in range(10):
        _train(expected, step)
    assert torch.equal(state["w"], expected["w"]) and state["count"] == 10
    with sp.CheckpointManager(remote) as manager:
        assert manager.steps() == [8, 10]
        assert manager.metadata(10).metadata[sp._run.RUN_KEY]["complete"] is True


def test_an_incremental_run_shares_what_does_not_change_and_resumes(tmp_path: Path) -> None:
    """With `incremental`, each save after the first links the unchanged tensor's file; a
    crash and a restart resume from the last save exactly."""
    root = tmp_path / "run"
    frozen = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB, never changes
    state = {**_state(), "frozen": frozen.clone()}
    with pytest.raises(RuntimeError), sp.Run(str(root), state, every_steps=2,
                                             incremental=True, async_save=False) as run:
        for step in run.range(10):
            if step == 7:
                raise RuntimeError("crash")
            _train(state, step)
    data = [{p.stat().st_ino for p in (root / f"step-{n}" / "data").iterdir()} for n in (4, 6)]
    assert data[0] & data[1]
    state = {**_state(), "frozen": torch.zeros_like(frozen)}
    with sp.Run(str(root), state, every_steps=2, incremental=True) as run:
        assert run.restored_step == 6 and torch.equal(state["frozen"], frozen)
        for step in run.range(10):
            _train(state, step)
    assert state["count"] == 10 and torch.equal(state["w"], torch.full((3,), 55.0))


def test_a_run_stopped_before_its_first_step_trains_no_more_when_restarted(
    tmp_path: Path,
) -> None:
    """stop() before the first step of a range whose start is saved already (save_initial,
    or a resumed job): recorded as stopped early, though no save was due at the stop."""
    with sp.Run(str(tmp_path), _state(), save_initial=True, async_save=False) as run:
        run.stop()
        assert list(run.range(10)) == []
    with sp.Run(str(tmp_path), _state()) as run:
        assert run.complete and list(run.range(10)) == []


def test_a_two_tier_run_names_a_remote_step_as_its_resume_point(tmp_path: Path) -> None:
    """The preemption message's resume point looks in both tiers: a step committed only at
    the remote root is where a restart resumes (found by a review)."""
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with sp.CheckpointManager(remote, async_save=False) as manager:
        manager.save(5, _state())
    with sp.Run(remote, _state(), local_dir=local, async_save=False) as run:
        assert run.restored_step == 5 and run._resume_point() == "step 5"


def test_a_run_stopped_early_is_complete_and_its_restart_trains_no_more(tmp_path: Path) -> None:
    """Early stopping (`stop()`) finishes the run like reaching the last step: a restart is
    complete and its range yields nothing, whatever its total."""
    state = {"w": torch.zeros(2)}
    with sp.Run(str(tmp_path), state, every_steps=5) as run:
        for step in run.range(100):
            if step == 12:
                run.stop()
    assert run.complete and run.step == 13
    with sp.Run(str(tmp_path), state, every_steps=5) as run:
        assert run.complete and run.restored_step == 13
        assert list(run.range(100)) == []


def test_a_real_time_signal_preempts_as_a_named_one_does(tmp_path: Path) -> None:
    """signals=[SIGRTMIN + 1] (a signal without a name) saves and raises Preempted with the
    requeue status; naming it raised a bare ValueError instead, and the job was not
    requeued."""
    realtime = signal.SIGRTMIN + 1
    run = sp.Run(str(tmp_path), {"x": torch.ones(1)}, every_steps=None, signals=[realtime])
    with pytest.raises(sp.Preempted) as caught, run:
        for step in run.range(10):
            if step == 2:
                os.kill(os.getpid(), realtime)
    assert caught.value.step == 3 and f"signal {int(realtime)} received" in str(caught.value)
    with sp.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.steps() == [3]


def test_a_state_no_save_takes_is_refused_when_the_run_is_made(tmp_path: Path) -> None:
    """A DataLoader left in the state was refused only at the first save, after every_steps
    steps of training (hours, on a real job)."""
    state = {"model": torch.nn.Linear(2, 2), "loader": torch.utils.data.DataLoader([1, 2])}
    with pytest.raises(sp.UnsupportedLeaf, match="DataLoader at 'loader'"):
        sp.Run(str(tmp_path / "run"), state, every_steps=5)
    assert not (tmp_path / "run").exists()


class _AsOlderTorchSaved:
    """An optimizer or LR scheduler whose state_dict() lacks the keys `drop` takes out: what
    an older torch wrote (AdamW's param groups had no `decoupled_weight_decay` before torch
    2.7, a StepLR no `_is_initial`). The format stores no classes, so a checkpoint saved
    through it is what a run under that torch saved."""

    def __init__(self, obj: Any, drop: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.obj = obj
        self.drop = drop

    def state_dict(self) -> dict[str, Any]:
        return self.drop(self.obj.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


def _without_group_key(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda state: {**state, "param_groups": [
        {k: v for k, v in group.items() if k != key} for group in state["param_groups"]]}


def _adamw_training(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return {"model": model, "optim": optim,
            "sched": torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)}


def _adamw_step(state: dict[str, Any], step: int) -> None:
    batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    state["optim"].zero_grad()
    state["model"](batch).pow(2).sum().backward()
    state["optim"].step()
    state["sched"].step()


def test_a_run_resumes_from_a_checkpoint_an_older_torch_wrote(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a torch upgrade between a preemption and the restart, the checkpoint's AdamW
    param groups lack `decoupled_weight_decay` and its StepLR lacks `_is_initial`: a strict
    restore called them missing, and sp.Run (strict) could not resume at all, though torch's
    own load_state_dict takes them. They keep the live object's values (logged), and the run
    continues bit for bit as one never interrupted."""
    expected = _adamw_training(0)
    for step in range(6):
        _adamw_step(expected, step)

    old = _adamw_training(0)
    saved = {"model": old["model"],
             "optim": _AsOlderTorchSaved(old["optim"],
                                         _without_group_key("decoupled_weight_decay")),
             "sched": _AsOlderTorchSaved(old["sched"], lambda state: {
                 k: v for k, v in state.items() if k != "_is_initial"})}
    with sp.Run(str(tmp_path), saved, every_steps=100) as run:
        for step in run.range(3):
            _adamw_step(old, step)

    state = _adamw_training(1)
    with caplog.at_level("INFO", logger="safepoint"), sp.Run(
            str(tmp_path), state, every_steps=100) as run:
        assert run.restored_step == 3
        for step in run.range(6):
            _adamw_step(state, step)
    kept = " ".join(record.getMessage() for record in caplog.records)
    assert "optim/param_groups/0/decoupled_weight_decay" in kept and "sched/_is_initial" in kept
    for a, b in zip(expected["model"].parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    assert state["optim"].param_groups[0]["decoupled_weight_decay"] is True
    assert state["sched"].state_dict() == expected["sched"].state_dict()


def _without_state(state: dict[str, Any]) -> dict[str, Any]:
    return {"param_groups": state["param_groups"]}


@pytest.mark.parametrize(("drop", "named"), [
    (_without_group_key("params"), "optim/param_groups/0/params/0"),
    (_without_state, "optim/state/0/"),
])
def test_an_optimizer_checkpoint_without_its_params_or_state_is_still_refused(
    tmp_path: Path, drop: Callable[[dict[str, Any]], dict[str, Any]], named: str
) -> None:
    """Only an optimizer's settings are optional: a checkpoint whose param groups lack their
    `params`, or which lacks the `state` a trained optimizer has, does not resume."""
    old = _adamw_training(0)
    _adamw_step(old, 0)
    saved = {**old, "optim": _AsOlderTorchSaved(old["optim"], drop)}
    with sp.CheckpointManager(str(tmp_path), async_save=False) as manager:
        manager.save(1, saved)
    state = _adamw_training(1)
    _adamw_step(state, 0)
    with pytest.raises(sp.StateMismatch, match=f"missing from the checkpoint: {named}"), sp.Run(
            str(tmp_path), state, every_steps=100):
        pass


def test_a_checkpoint_without_the_scheduler_is_still_refused(tmp_path: Path) -> None:
    """A scheduler's settings are optional, not the scheduler: a checkpoint saved without
    one restored strictly into a state with one, whose schedule silently started over."""
    old = _adamw_training(0)
    _adamw_step(old, 0)
    with sp.CheckpointManager(str(tmp_path), async_save=False) as manager:
        manager.save(1, {"model": old["model"], "optim": old["optim"]})
    state = _adamw_training(1)
    with pytest.raises(sp.StateMismatch, match="missing from the checkpoint: sched/last_epoch"
                       ), sp.Run(str(tmp_path), state, every_steps=100):
        pass
