"""Asynchronous saving with `sp.CheckpointManager`, beside torch.distributed.checkpoint's
`async_save` on the same state (README, "Asynchronous saving").

For each workload of `workloads.py`, in a fresh process each:

- blocking: how long `mgr.save` blocks the caller, on the first save (fresh staging memory
  to fault in) and on later ones (buffers reused; the median of five), next to the `copy_`
  of every tensor into already-touched buffers of the same shapes (the memcpy limit of any
  host snapshot; the median of three) and to DCP `async_save`'s blocking, first call and
  later ones;
- peak RSS with a staging budget of a quarter of the state (`max_staging_bytes`), as growth
  over the RSS once the state is built (sampled every 2 ms during two saves), next to the
  bound budget + 64 MiB;
- (W3 only) training overhead: a loop of CPU matrix multiplications with a W3-sized state,
  in blocks of `--every` seconds' worth of steps, alternately starting with an asynchronous
  save and without one (interleaved, so a change in machine load hits both alike).

Usage: python bench/async_save.py [--quick] [--workloads W1,W2,W3] [--train 120 --every 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch
from workloads import WORKLOADS, build_state, tensor_bytes, tensor_leaves

import safepoint as sp

MIB = 1 << 20


def _blocking(workload: str, quick: bool, scratch: Path) -> dict[str, Any]:
    state = build_state(workload, quick=quick, source=True)
    tensors = list(tensor_leaves(state).values())
    copies = [t.clone() for t in tensors]  # touched buffers of the same shapes
    limit = []
    for _ in range(3):
        started = time.perf_counter()
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)
        limit.append(time.perf_counter() - started)
    del copies

    later = []
    with sp.CheckpointManager(str(scratch / "sp"), keep_last=1) as mgr:
        started = time.perf_counter()
        mgr.save(0, state)
        first = time.perf_counter() - started
        mgr.wait()
        for step in range(1, 6):
            started = time.perf_counter()
            mgr.save(step, state)
            later.append(time.perf_counter() - started)
            mgr.wait()

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group
    dcp_times = []
    for step in range(3):
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(scratch / f"dcp{step}"))
        dcp_times.append(time.perf_counter() - started)
        future.result()
    return {
        "nbytes": tensor_bytes(state), "copy": statistics.median(limit), "first": first,
        "later": statistics.median(later), "dcp_first": dcp_times[0],
        "dcp_later": statistics.median(dcp_times[1:]),
    }


def _rss(workload: str, quick: bool, scratch: Path) -> dict[str, Any]:
    state = build_state(workload, quick=quick, source=True)
    nbytes = tensor_bytes(state)
    budget = max(nbytes // 4, 32 * MIB)  # the smallest budget a manager takes
    process = psutil.Process()
    before = process.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:  # RSS every 2 ms while saving
        while not done.wait(0.002):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with sp.CheckpointManager(str(scratch / "sp"), keep_last=1,
                                  max_staging_bytes=budget) as mgr:
            for step in range(2):
                mgr.save(step, state)
            mgr.wait()
    finally:
        done.set()
        sampler.join()
    return {"nbytes": nbytes, "budget": budget, "before": before, "growth": peak[0] - before}


def _train(quick: bool, scratch: Path, seconds: float, every: float) -> dict[str, Any]:
    state = build_state("W3", quick=quick, source=True)
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)

    def step() -> None:
        torch.mm(a, b, out=state_out)

    state_out = torch.empty(1024, 1024)
    started = time.perf_counter()
    calibrate = 0
    while time.perf_counter() - started < 2:
        step()
        calibrate += 1
    per_step = (time.perf_counter() - started) / calibrate
    block = max(1, int(every / per_step))  # steps between two saves
    rounds = max(1, int(seconds / every / 2))

    def run(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        return time.perf_counter() - started

    # Blocks without and with a save alternate, so that a change in the machine's load hits
    # both alike; a "with" block starts with an asynchronous save whose write overlaps it.
    never = with_saves = 0.0
    with sp.CheckpointManager(str(scratch / "train"), keep_last=1) as mgr:
        mgr.save(0, state)  # the first save (buffers faulted in) is not counted
        mgr.wait()
        for index in range(1, rounds + 1):
            never += run(block)
            started = time.perf_counter()
            mgr.save(index, state)
            for _ in range(block):
                step()
            with_saves += time.perf_counter() - started
            mgr.wait()  # normally done long before; keeps rounds independent
    return {"never": never, "with": with_saves, "saves": rounds, "every": block * per_step,
            "overhead": 100 * (with_saves - never) / never, "nbytes": tensor_bytes(state)}


def _child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        if args.child == "train":
            result = _train(args.quick, Path(scratch), args.train, args.every)
        elif args.what == "rss":
            result = _rss(args.child, args.quick, Path(scratch))
        else:
            result = _blocking(args.child, args.quick, Path(scratch))
    print(json.dumps(result))


def _run(*extra: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *extra], check=True, capture_output=True,
                         text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (smoke test)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--train", type=float, default=120.0,
                        help="seconds of training loop, with and without saves together")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between saves")
    parser.add_argument("--dir", default=None, help="scratch directory (default: tmp)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--what", default="blocking", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    common = [*(["--quick"] if args.quick else []), *(["--dir", args.dir] if args.dir else []),
              "--train", str(args.train), "--every", str(args.every)]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{psutil.virtual_memory().total / (1 << 30):.0f} GiB RAM")
    print("| workload | state | `copy_` limit | `mgr.save` blocks, first | later "
          "| later / limit | DCP `async_save` first | later | peak RSS growth, budget 1/4 "
          "| bound (budget + 64 MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workload in args.workloads.split(","):
        block = _run("--child", workload, *common)
        rss = _run("--child", workload, "--what", "rss", *common)
        print(f"| {workload} | {block['nbytes'] / MIB:.0f} MiB | {block['copy']:.3f} s "
              f"| {block['first']:.3f} s | {block['later']:.3f} s "
              f"| {block['later'] / block['copy']:.2f}x | {block['dcp_first']:.3f} s "
              f"| {block['dcp_later']:.3f} s | {rss['growth'] / MIB:.0f} MiB "
              f"| {(rss['budget'] + 64 * MIB) / MIB:.0f} MiB |", flush=True)
    if "W3" in args.workloads.split(","):
        train = _run("--child", "train", *common)
        print(f"\nW3-sized state ({train['nbytes'] / MIB:.0f} MiB), CPU matmul loop: "
              f"{train['saves']} blocks of {train['every']:.1f} s each starting with an async "
              f"save took {train['with']:.1f} s, the same blocks without a save "
              f"{train['never']:.1f} s (interleaved): {train['overhead']:+.1f}%")


if __name__ == "__main__":
    main()
