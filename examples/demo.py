"""Kill a training job at random moments (SIGKILL twice, then SIGTERM), restart it with the same
command each time, and check that it ends bit for bit where a job never interrupted ends.

    .venv/bin/python examples/demo.py [--root DIR] [--steps N] [--every K] [--seed S]

The job trains a small MLP (synthetic data from a fixed seed, a shuffled DataLoader with
`sp.ResumableSampler`, dropout, augmentation drawing on Python's, NumPy's and torch's RNGs,
AdamW, OneCycleLR) inside `sp.Run`, which restores the newest committed checkpoint on entry,
saves every K steps in the background and, on SIGTERM, saves at the next step boundary and
exits with status 75 (requeue). Two jobs run side by side:

1. an uninterrupted one;
2. one killed with SIGKILL at a random moment (twice), then sent SIGTERM at a random moment,
   and restarted after each, until it finishes.

The demo prints both jobs' sha256 of the final weights, optimizer and scheduler state, what each
interruption cost, and how long checkpointing held up the training loop. It exits with status
1 when the hashes differ. The kill moments come from `--seed` (random by default; printed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

SEED = 1234
SAMPLES = 2000
BATCH = 50  # 40 batches an epoch
FEATURES = 32
CLASSES = 10


# -- the training job (runs in a child process) ------------------------------------------------


def emit(**record: Any) -> None:
    """Report progress to the parent, one JSON object per line."""
    print(json.dumps(record), flush=True)


def state_hash(*state_dicts: dict[str, Any]) -> str:
    """sha256 of state dicts: every tensor's bytes and every other value, in a fixed order."""
    import torch

    digest = hashlib.sha256()

    def feed(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            digest.update(path.encode())
            digest.update(node.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(node, dict):
            for key in sorted(node, key=str):
                feed(node[key], f"{path}/{key}")
        elif isinstance(node, list | tuple):
            for index, item in enumerate(node):
                feed(item, f"{path}/{index}")
        else:
            digest.update(f"{path}={node!r}".encode())

    for index, state_dict in enumerate(state_dicts):
        feed(state_dict, str(index))
    return digest.hexdigest()


def train(root: str, steps: int, every: int, pause_after: int | None) -> None:
    """The job: the same command whether it starts fresh or resumes. With `pause_after`, it
    waits for a line on stdin after that many steps, so that the driver's signal lands a
    random moment after a known step, however busy the machine is."""
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import safepoint as sp

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    data_gen = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(SAMPLES, FEATURES, generator=data_gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=data_gen)
    labels = (inputs @ teacher + 0.5 * torch.randn(SAMPLES, CLASSES, generator=data_gen)).argmax(1)
    dataset = TensorDataset(inputs, labels)
    sampler = sp.ResumableSampler(dataset, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True,
                        generator=sampler.generator)

    model = nn.Sequential(
        nn.Linear(FEATURES, 256), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(256, CLASSES),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    # Everything the next step depends on: weights, optimizer, scheduler, every RNG stream and
    # the position in the data.
    state = {"model": model, "optim": optimizer, "sched": scheduler, "rng": sp.RNGState(),
             "data": sampler}

    model.train()
    began = time.perf_counter()
    run = sp.Run(root, state, every_steps=every)
    try:
        with run:
            emit(event="start", step=run.step)
            pause_at = None if pause_after is None else run.step + pause_after
            batches = sampler.track(loader, epochs=None)
            for step in run.range(steps):
                x, y = next(batches)
                if random.random() < 0.5:  # augmentation on all three host RNGs
                    x = x.flip(1)
                x = x + float(np.random.uniform(0.0, 0.1)) * torch.randn_like(x)
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                emit(event="step", step=step, epoch=sampler.epoch)
                if step == pause_at:
                    emit(event="paused")
                    sys.stdin.readline()
        emit(event="finished", hash=state_hash(model.state_dict(), optimizer.state_dict(),
                                               scheduler.state_dict()))
    finally:  # also on sp.Preempted, which then exits with status 75
        emit(event="exit", step=run.step, blocked=run.blocked_seconds,
             seconds=time.perf_counter() - began)


# -- the driver --------------------------------------------------------------------------------


class Job:
    """One process of the job, read line by line."""

    def __init__(self, root: str, args: argparse.Namespace, pause_after: int | None = None
                 ) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        command = [sys.executable, os.path.abspath(__file__), "--child", "--root", root,
                   "--steps", str(args.steps), "--every", str(args.every)]
        if pause_after is not None:
            command += ["--pause-after", str(pause_after)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.records: list[dict[str, Any]] = []
        self.start = self._next("start")["step"]

    def _lines(self) -> Iterator[dict[str, Any]]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                record = json.loads(line)
                self.records.append(record)
                yield record
            else:
                print(line, end="", file=sys.stderr)

    def _next(self, event: str) -> dict[str, Any]:
        for record in self._lines():
            if record["event"] == event:
                return record
        raise SystemExit(f"the job ended before reporting {event!r} (status {self.proc.wait()})")

    def interrupt(self, signum: int, delay: float) -> int:
        """Let the paused job go on and send it `signum` `delay` seconds later; returns the
        last step it reported."""
        assert self.proc.stdin is not None
        for record in self._lines():
            if record["event"] == "paused":
                self.proc.stdin.write("go\n")
                self.proc.stdin.flush()
                time.sleep(delay)
                self.proc.send_signal(signum)
                break
        self.wait()
        return max((r["step"] for r in self.records if r["event"] == "step"), default=-1)

    def wait(self) -> int:
        for _ in self._lines():
            pass
        return self.proc.wait()

    def last(self, event: str) -> dict[str, Any] | None:
        return next((r for r in reversed(self.records) if r["event"] == event), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="where checkpoints go (kept); a temp dir by default")
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--every", type=int, default=25, help="checkpoint every K steps (25)")
    parser.add_argument("--seed", type=int, help="seed of the kill moments (random)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pause-after", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.root, args.steps, args.every, args.pause_after)
        return 0
    if args.steps < 40:
        parser.error("--steps must be 40 or more, so that there is room for three interruptions")

    import safepoint as sp

    keep = args.root is not None
    base = args.root or tempfile.mkdtemp(prefix="safepoint-demo-")
    os.makedirs(base, exist_ok=True)
    if keep and os.listdir(base):
        parser.error(f"--root {base} is not empty")
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rng = random.Random(seed)
    reference_root, root = os.path.join(base, "uninterrupted"), os.path.join(base, "interrupted")
    began = time.perf_counter()
    print(f"Two runs of the same job, {args.steps} steps, a checkpoint every {args.every} steps "
          f"(kill moments from --seed {seed})")
    try:
        reference = Job(reference_root, args)  # runs alongside the interrupted one
        interrupted: list[Job] = []
        print("interrupted run:")
        for number, signum in enumerate([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM], 1):
            with sp.CheckpointManager(root) as manager:
                left = args.steps - (manager.latest_step() or 0)
            job = Job(root, args, pause_after=rng.randrange(max(1, left // 10), max(2, left // 4)))
            interrupted.append(job)
            last = job.interrupt(signum, rng.uniform(0.0, 0.1))
            status = job.proc.returncode
            with sp.CheckpointManager(root) as manager:
                committed = manager.latest_step()
            how = signal.Signals(signum).name
            # On a fast machine a short job can finish all its steps before the signal lands.
            finished = job.last("finished") is not None
            if finished:
                outcome = f"had finished its steps first (status {status})"
            elif signum == signal.SIGTERM:
                outcome = f"saved step {committed} and exited with status {status} (requeue)"
            else:
                outcome = f"killed (status {status})"
            print(f"  process {number}: resumed at step {job.start}, {how} after step {last}: "
                  f"{outcome}; newest committed checkpoint: step {committed}")
            expected = sp.errors.REQUEUE_EXIT_CODE if signum == signal.SIGTERM else -signum
            if status not in (expected, 0) and not (finished and status == -signum):
                raise SystemExit(f"process {number} ended with status {status}")
        final = Job(root, args)
        interrupted.append(final)
        if final.wait() != 0:
            raise SystemExit(f"the last process failed (status {final.proc.returncode})")
        print(f"  process 4: resumed at step {final.start}, finished at step {args.steps}")
        if reference.wait() != 0:
            raise SystemExit(f"the uninterrupted run failed (status {reference.proc.returncode})")
        wall = time.perf_counter() - began

        steps_run = sum(len([r for r in j.records if r["event"] == "step"]) for j in interrupted)
        print(f"lost work: {steps_run - args.steps} steps trained twice, over 3 interruptions "
              f"(SIGKILL loses the steps since the last checkpoint; SIGTERM loses none)")
        ref_exit = reference.last("exit")
        assert ref_exit is not None
        blocked, seconds = ref_exit["blocked"], ref_exit["seconds"]
        print(f"checkpointing: held up the uninterrupted run's loop {blocked:.2f} s of "
              f"{seconds:.2f} s ({100 * blocked / seconds:.0f}%: the restore, "
              f"{args.steps // args.every} asynchronous saves and the final wait)")
        with sp.CheckpointManager(root) as manager:
            latest = manager.latest_step()
            assert latest is not None
            report = sp.verify(manager.step_url(latest))
            size = manager.metadata(latest).nbytes
        print(f"final checkpoint: step {latest}, {size / 1024:.0f} KiB, sp.verify "
              f"{'ok' if report.ok else 'FAILED: ' + '; '.join(report.problems)}")
        expected_hash = (reference.last("finished") or {}).get("hash")
        got = (final.last("finished") or {}).get("hash")
        same = expected_hash is not None and expected_hash == got
        print(f"uninterrupted sha256: {expected_hash}")
        print(f"interrupted   sha256: {got}")
        print(f"{'IDENTICAL' if same else 'DIFFERENT'} ({len(interrupted) + 1} processes, "
              f"{wall:.1f} s)")
        return 0 if same and report.ok else 1
    finally:
        if keep:
            print(f"checkpoints kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
