"""Kill a training run with SIGKILL, resume it from its last committed checkpoint, and check
that the resumed run ends bit for bit where an uninterrupted run ends.

    .venv/bin/python examples/demo.py [--root DIR] [--steps N] [--every K] [--kill-at S]

Three fresh processes train the same small MLP (synthetic data from a fixed seed, a shuffled
DataLoader, dropout, random input noise from torch, NumPy and Python RNGs, AdamW, OneCycleLR):

1. an uninterrupted run of N steps, which reports a sha256 of its final weights and optimizer
   state;
2. a run that saves a checkpoint every K steps with `sp.save` and is killed with SIGKILL right
   after it reports step S, so the steps since its last checkpoint are lost;
3. a run that finds the newest committed checkpoint (`sp.info`), restores it in place
   (`sp.load(path, into=state)`), continues to N and reports the same hash.

Exact resume needs all of the training state: weights, optimizer, scheduler, step, every RNG
stream and the position in the data. The data order is restored by reseeding the DataLoader's
shuffle generator from (seed, epoch) at every epoch and skipping the batches of the current
epoch that were already consumed. The demo exits with status 1 when the hashes differ.
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
BATCH = 50  # 40 batches per epoch
FEATURES = 32
CLASSES = 10


# -- the training job (runs in a child process) ------------------------------------------------


def emit(**record: Any) -> None:
    """Report progress to the parent, one JSON object per line."""
    print(json.dumps(record), flush=True)


def capture_rng(generator: Any) -> dict[str, Any]:
    """Every RNG stream the job draws from, as tensors, arrays and plain values."""
    import numpy as np
    import torch

    version, words, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "loader": generator.get_state(),
        "python": {"version": version, "words": np.array(words, dtype=np.uint32),
                   "gauss_next": gauss_next},
        "numpy": {"keys": keys, "pos": pos, "has_gauss": has_gauss,
                  "cached_gaussian": cached_gaussian},
    }


def restore_rng(rng: dict[str, Any], generator: Any) -> None:
    """Set every RNG stream from what `capture_rng` produced (and a load filled in)."""
    import numpy as np
    import torch

    torch.set_rng_state(rng["torch"])
    generator.set_state(rng["loader"])
    py = rng["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["words"]), py["gauss_next"]))
    np_ = rng["numpy"]
    np.random.set_state(("MT19937", np_["keys"], np_["pos"], np_["has_gauss"],
                         np_["cached_gaussian"]))


def state_hash(model: Any, optimizer: Any) -> str:
    """sha256 of every parameter and buffer, then every optimizer state tensor, in a fixed order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    optim_state = optimizer.state_dict()["state"]
    for index in sorted(optim_state):
        for key in sorted(optim_state[index]):
            value = optim_state[index][key]
            digest.update(f"{index}/{key}".encode())
            digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def newest_committed(root: str) -> str | None:
    """The newest committed checkpoint under `root`; directories without a manifest (saves
    that never committed) are skipped."""
    import safepoint as sp

    names = sorted((n for n in os.listdir(root) if n.startswith("step-")), reverse=True)
    for name in names:
        path = os.path.join(root, name)
        try:
            sp.info(path)
        except sp.CheckpointNotFound:
            emit(event="skipped", path=path, why="no manifest: an uncommitted leftover")
            continue
        except sp.CorruptCheckpoint as exc:
            emit(event="skipped", path=path, why=f"unreadable manifest: {exc}")
            continue
        return path
    return None


def train(mode: str, root: str | None, steps: int, every: int) -> None:
    """One run: "full" (no checkpoints), "crash" (checkpoints, and waits for the parent's go
    after each step so the parent can kill it at an exact step) or "resume"."""
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

    # A synthetic classification task from its own generator: the same in every process.
    data_gen = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(SAMPLES, FEATURES, generator=data_gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=data_gen)
    labels = (inputs @ teacher + 0.5 * torch.randn(SAMPLES, CLASSES, generator=data_gen)).argmax(1)
    shuffle = torch.Generator()
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=BATCH, shuffle=True,
                        drop_last=True, generator=shuffle)
    per_epoch = len(loader)

    model = nn.Sequential(
        nn.Linear(FEATURES, 256), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.2),
        nn.Linear(256, CLASSES),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)

    state: dict[str, Any] = {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "step": 0,
        "rng": capture_rng(shuffle),
    }
    start = 0
    if mode == "resume":
        assert root is not None
        path = newest_committed(root)
        if path is None:
            emit(event="resumed", path=None, step=0)
        else:
            began = time.perf_counter()
            sp.load(path, into=state)  # tensors filled in place, load_state_dict on the rest
            seconds = time.perf_counter() - began
            restore_rng(state["rng"], shuffle)
            start = state["step"]
            emit(event="resumed", path=path, step=start, seconds=seconds)

    def batches(first: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from global step `first` on: the shuffle of epoch e is seeded from (SEED, e),
        and the batches of the current epoch consumed before `first` are skipped."""
        epoch, skip = divmod(first, per_epoch)
        while True:
            shuffle.manual_seed(SEED * 1_000_003 + epoch)
            epoch_batches = iter(loader)
            for _ in range(skip):
                next(epoch_batches)
            skip = 0
            yield from epoch_batches
            epoch += 1

    model.train()
    data = batches(start)
    for step in range(start, steps):
        x, y = next(data)
        # Augmentation drawing on all three host RNGs, so each must be restored exactly.
        if random.random() < 0.5:
            x = x.flip(1)
        x = x + float(np.random.uniform(0.0, 0.1)) * torch.randn_like(x)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        done = step + 1
        if mode != "full" and done % every == 0:
            state["step"] = done
            state["rng"] = capture_rng(shuffle)
            path = f"{root}/step-{done:06d}"
            began = time.perf_counter()
            saved = sp.save(path, state, metadata={"step": done, "loss": loss.item()})
            emit(event="saved", step=done, path=path, seconds=time.perf_counter() - began,
                 nbytes=saved.nbytes)
        emit(event="step", step=done, loss=round(loss.item(), 4))
        if mode == "crash" and sys.stdin.readline().strip() != "go":
            return
    emit(event="finished", step=steps, hash=state_hash(model, optimizer))


# -- the driver --------------------------------------------------------------------------------


def child(mode: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), "--child", mode,
               "--root", args.root, "--steps", str(args.steps), "--every", str(args.every)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def records(proc: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)
        else:
            print(line, end="", file=sys.stderr)


def run_to_end(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with child(mode, args) as proc:
        got = list(records(proc))
    if proc.returncode != 0 or not got or got[-1]["event"] != "finished":
        raise SystemExit(f"the {mode} run failed (exit status {proc.returncode})")
    return got


def run_and_kill(args: argparse.Namespace) -> list[dict[str, Any]]:
    got = []
    with child("crash", args) as proc:
        assert proc.stdin is not None
        for record in records(proc):
            got.append(record)
            if record["event"] != "step":
                continue
            if record["step"] == args.kill_at:
                os.kill(proc.pid, signal.SIGKILL)  # no handler, no cleanup: a hard crash
                break
            proc.stdin.write("go\n")
            proc.stdin.flush()
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"the crash run was not killed (exit status {proc.returncode})")
    return got


def kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="where checkpoints go (kept); a temp dir by default")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--every", type=int, default=30, help="checkpoint every K steps (30)")
    parser.add_argument("--kill-at", type=int, default=97, help="SIGKILL after step S (97)")
    parser.add_argument("--child", choices=["full", "crash", "resume"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.child, args.root, args.steps, args.every)
        return 0
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must lie between 0 and --steps")

    import safepoint as sp

    keep = args.root is not None
    if keep:
        os.makedirs(args.root, exist_ok=True)
        if os.listdir(args.root):
            parser.error(f"--root {args.root} is not empty")
    else:
        args.root = tempfile.mkdtemp(prefix="safepoint-demo-")
    began = time.perf_counter()
    try:
        full = run_to_end("full", args)
        crashed = run_and_kill(args)
        resumed = run_to_end("resume", args)
        wall = time.perf_counter() - began

        saves = [r for r in crashed + resumed if r["event"] == "saved"]
        before_kill = [r for r in crashed if r["event"] == "saved"]
        restored = next(r for r in resumed if r["event"] == "resumed")
        verified = True
        last_step = max(r["step"] for r in crashed if r["event"] == "step")
        print(f"uninterrupted run: {args.steps} steps in one process")
        print(f"interrupted run:   checkpoint every {args.every} steps; saved steps "
              f"{', '.join(str(r['step']) for r in before_kill) or 'none'}; "
              f"SIGKILL after step {last_step}")
        for record in resumed:
            if record["event"] == "skipped":
                print(f"skipped:           {os.path.basename(record['path'])} ({record['why']})")
        if restored["path"] is None:
            print("resumed run:       no committed checkpoint; started over from step 0")
        else:
            path = restored["path"]
            info = sp.info(path)
            manifest_bytes = os.path.getsize(os.path.join(path, "manifest.json"))
            print(f"resumed run:       from {os.path.basename(path)} (step {restored['step']}; "
                  f"{last_step - restored['step']} steps lost), loaded in "
                  f"{restored['seconds'] * 1000:.1f} ms, trained on to step {args.steps}")
            print(f"checkpoint:        {len(info.entries)} entries, {kib(info.nbytes)} in "
                  f"{info.files} data file + {kib(manifest_bytes)} manifest")
            save_s = [r["seconds"] for r in saves]
            mean_ms = sum(save_s) / len(save_s) * 1000
            print(f"saving:            {len(saves)} saves ({len(before_kill)} before the kill), "
                  f"{sum(save_s) * 1000:.1f} ms in all, mean {mean_ms:.1f} ms")
            report = sp.verify(path)
            verified = report.ok
            print(f"sp.verify:         {'ok' if report.ok else 'FAILED'}, "
                  f"{kib(report.nbytes)} checked in {report.seconds * 1000:.1f} ms"
                  + "".join(f"\n  {problem}" for problem in report.problems))
        expected, got = full[-1]["hash"], resumed[-1]["hash"]
        same = expected == got
        print(f"uninterrupted sha256: {expected}")
        print(f"resumed       sha256: {got}")
        print(f"{'IDENTICAL' if same else 'DIFFERENT'} (three processes, {wall:.1f} s)")
        return 0 if same and verified else 1
    finally:
        if keep:
            print(f"checkpoints kept in {args.root}")
        else:
            shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
