"""The user story end to end, in real processes: a training job (tests/_resume_child.py) killed
with SIGKILL at random moments, several times, and preempted with SIGTERM (then signalled
again during its final save), restarted with the same command each time, ends with the same
bits in its parameters, optimizer state and scheduler state as a job never interrupted.

Three loops: steps with epochs inside (sp.ResumableSampler, 2 prefetching workers); epochs
(`run.range(num_epochs)`, a save per epoch); steps over torchdata's StatefulDataLoader. The
parent draws its kill moments from a seeded RNG and prints the seed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

import safepoint as sp

CHILD = Path(__file__).with_name("_resume_child.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


_CHILDREN: list[subprocess.Popen[str]] = []


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child and its DataLoader workers together (its process group), as a scheduler
    ends a job: a worker forked in the instant its parent is killed records init as the parent it
    watches (torch's ManagerWatchdog) and never exits, holding the child's pipes open."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test() -> Iterator[None]:
    """A failed assertion leaves children running: kill them and close their pipes (with a
    timeout: pytest-timeout stops timing a test once it has failed)."""
    yield
    while _CHILDREN:
        proc = _CHILDREN.pop()
        _kill(proc)
        proc.communicate(timeout=60)


def _start(root: Path, mode: str, out: Path, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(CHILD.parents[1] / "src"))
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(root), mode, str(out), *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, start_new_session=True,
    )
    _CHILDREN.append(proc)
    return proc


@contextmanager
def _killed_if_silent(proc: subprocess.Popen[str], seconds: float = 120) -> Iterator[None]:
    """Kill the child if the block, which waits for a line from it, takes longer than `seconds`:
    a child that never prints what the parent waits for fails the test, with what the child
    wrote, instead of the worker ending on the suite's timeout with nothing but stacks."""
    watchdog = threading.Timer(seconds, _kill, (proc,))
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _started(proc: subprocess.Popen[str]) -> int:
    """Read the child's `start N` line: the step it resumed from."""
    assert proc.stdout is not None
    with _killed_if_silent(proc):
        line = proc.stdout.readline()
    assert line.startswith("start "), (line, proc.stderr.read() if proc.stderr else "")
    return int(line.split()[1])


def _interrupt(
    proc: subprocess.Popen[str], signum: int, rng: random.Random, committed: Path | None = None
) -> str:
    """Let the child (started with --pause-after) go on from its pause and send `signum` a random
    moment later, within the next few steps (so it may land during a save); wait for the child
    to end and return its stderr. With `committed` (the run's root), first wait while paused
    until a step is committed there, so the kill cannot land before the first commit."""
    assert proc.stdout is not None and proc.stdin is not None
    paused = False
    with _killed_if_silent(proc):
        for line in proc.stdout:
            if paused := line.strip() == "paused":
                break
    assert paused, f"the child ended without pausing: {proc.communicate(timeout=120)[1]}"
    deadline = time.monotonic() + 60
    while committed is not None and _latest(committed) is None:
        assert time.monotonic() < deadline, f"nothing committed under {committed}"
        time.sleep(0.05)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    time.sleep(rng.uniform(0, 0.06))
    if signum == signal.SIGKILL:
        _kill(proc)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    return stderr


def _finish(proc: subprocess.Popen[str]) -> None:
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr


def _latest(root: Path) -> int | None:
    with sp.CheckpointManager(str(root)) as manager:
        return manager.latest_step()


def _digests(out: Path) -> dict[str, str]:
    return json.loads(out.read_text())


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"kill moments drawn with seed {seed}")
    return random.Random(seed)


def test_killed_and_preempted_steps_run_ends_bit_identical(tmp_path: Path,
                                                           rng: random.Random) -> None:
    reference = _start(tmp_path / "ref", "steps", tmp_path / "ref.json")
    root, out = tmp_path / "run", tmp_path / "run.json"
    starts = []
    for _ in range(3):  # SIGKILL at random moments: no handler, no cleanup
        proc = _start(root, "steps", out, "--pause-after", str(rng.randrange(3, 12)))
        starts.append(_started(proc))
        _interrupt(proc, signal.SIGKILL, rng)
        assert proc.returncode == -signal.SIGKILL
    # SIGTERM; the child sends itself SIGTERM and SIGUSR1 again during the final save
    proc = _start(root, "steps", out, "--pause-after", str(rng.randrange(2, 8)),
                  "--arm-second-signal")
    starts.append(_started(proc))
    stderr = _interrupt(proc, signal.SIGTERM, rng)
    assert proc.returncode == sp.errors.REQUEUE_EXIT_CODE == 75, stderr
    assert "Traceback" not in stderr and "SIGTERM received: step" in stderr
    with sp.CheckpointManager(str(root)) as manager:
        preempted_at = manager.latest_step()
        assert preempted_at is not None and sp.verify(manager.step_url(preempted_at)).ok
    proc = _start(root, "steps", out)
    start = _started(proc)
    assert start == preempted_at  # the final save of the preempted job is what resumes
    _finish(proc)
    _finish(reference)
    assert starts[0] == 0 and starts == sorted(starts), starts
    assert _digests(out) == _digests(tmp_path / "ref.json")


def test_epoch_granularity_resume_is_bit_identical(tmp_path: Path, rng: random.Random) -> None:
    reference = _start(tmp_path / "ref", "epochs", tmp_path / "ref.json")
    root, out = tmp_path / "run", tmp_path / "run.json"
    proc = _start(root, "epochs", out, "--pause-after", str(rng.randrange(1, 3)))
    _started(proc)
    _interrupt(proc, signal.SIGKILL, rng, committed=root)  # during the next epoch
    saved = _latest(root)
    proc = _start(root, "epochs", out)
    start = _started(proc)
    assert saved is not None and start == saved >= 1  # continues at saved epoch + 1
    _finish(proc)
    _finish(reference)
    assert _digests(out) == _digests(tmp_path / "ref.json")


def test_stateful_dataloader_resume_is_bit_identical(tmp_path: Path,
                                                     rng: random.Random) -> None:
    reference = _start(tmp_path / "ref", "stateful", tmp_path / "ref.json")
    root, out = tmp_path / "run", tmp_path / "run.json"
    proc = _start(root, "stateful", out, "--pause-after", str(rng.randrange(10, 40)))
    _started(proc)
    _interrupt(proc, signal.SIGKILL, rng, committed=root)
    saved = _latest(root)
    proc = _start(root, "stateful", out)
    start = _started(proc)
    assert saved is not None and start == saved > 0
    _finish(proc)
    _finish(reference)
    assert _digests(out) == _digests(tmp_path / "ref.json")
