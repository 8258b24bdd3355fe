"""Incremental saves (`CheckpointManager(incremental=True)`) beside full ones (README,
"Incremental saves").

Two states, each saved by a manager six times, a training step between saves, interleaved
over `--repeat` rounds (full, then incremental, each in a fresh root) so that the disk's
drift hits both alike:

- fine-tune: a 1 GiB frozen backbone (16 bias-free 4096x4096 layers) and a 16 MiB trained
  head with AdamW; a step trains the head;
- all changing: 1 GiB in 64 tensors, every element changed by each step: what incremental
  costs when nothing can be shared (one xxh3-128 pass over the bytes).

Reported per state and mode: the first save (everything is written either way), the median of
the later saves (the time until the commit; for asynchronous saves also how long `save`
blocked), the bytes of data files each later step wrote itself, and the ratio of the later
saves' medians, full over incremental.

Usage: python bench/incremental.py [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import safepoint as sp

SAVES = 6


def fine_tune(quick: bool) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    width, layers = (1024, 4) if quick else (4096, 16)
    backbone = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False)
                                     for _ in range(layers))).requires_grad_(False)
    head = torch.nn.Linear(width, 1024)
    state = {"backbone": backbone, "head": head,
             "optim": torch.optim.AdamW(head.parameters())}

    def step(s: dict[str, Any]) -> None:
        s["head"](s["backbone"](torch.randn(4, width))).square().mean().backward()
        s["optim"].step()
        s["optim"].zero_grad()

    return state, step


def all_changing(quick: bool) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    state = {f"t{i}": torch.randn(1 << (18 if quick else 22)) for i in range(64)}

    def step(s: dict[str, Any]) -> None:
        for tensor in s.values():
            tensor.add_(1.0)

    return state, step


def _own_bytes(step_dir: Path) -> int:
    """Bytes of the data files the step wrote itself (a linked file has other names too)."""
    return sum(p.stat().st_size for p in (step_dir / "data").iterdir() if p.stat().st_nlink == 1)


def run(make: Callable[[bool], tuple[dict[str, Any], Callable[[dict[str, Any]], None]]],
        incremental: bool, async_save: bool, quick: bool, scratch: Path) -> dict[str, float]:
    root = scratch / "root"
    shutil.rmtree(root, ignore_errors=True)
    state, step = make(quick)
    step(state)  # optimizer state exists from the first save on
    totals, blocked, written = [], [], []
    with sp.CheckpointManager(str(root), keep_last=2, incremental=incremental,
                              async_save=async_save) as mgr:
        for n in range(SAVES):
            step(state)
            started = time.perf_counter()
            handle = mgr.save(n, state)
            blocked.append(time.perf_counter() - started)
            handle.result()
            totals.append(time.perf_counter() - started)
            written.append(_own_bytes(root / f"step-{n}"))
    shutil.rmtree(root, ignore_errors=True)
    return {"first": totals[0], "later": statistics.median(totals[1:]),
            "blocked": statistics.median(blocked[1:]), "written": statistics.median(written[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"incremental saves, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{SAVES} saves per run, {args.repeat} interleaved round(s); later = median of saves "
          "2..6 (seconds to the commit)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="safepoint-bench-") as scratch:
        for name, make in [("fine-tune", fine_tune), ("all changing", all_changing)]:
            for async_save in (False, True):
                runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
                for _ in range(args.repeat):
                    for incremental in (False, True):
                        runs[incremental].append(
                            run(make, incremental, async_save, args.quick, Path(scratch)))
                medians = {inc: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                           for inc, rs in runs.items()}
                rows.append((name, async_save, medians))
    print()
    print("| state | save | mode | first s | later s | later blocked s | written per later "
          "save MB | full / incremental (later) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, async_save, medians in rows:
        for incremental in (False, True):
            m = medians[incremental]
            ratio = (f"{medians[False]['later'] / m['later']:.2f}x" if incremental else "")
            print(f"| {name} | {'async' if async_save else 'sync'} | "
                  f"{'incremental' if incremental else 'full'} | {m['first']:.3f} | "
                  f"{m['later']:.3f} | {m['blocked']:.3f} | {m['written'] / 1e6:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
