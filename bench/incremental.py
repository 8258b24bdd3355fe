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

With `--ranks N` (N > 1) every run is N processes of a gloo group on this machine, each
holding the whole state, as DDP replicas do: every save is collective, the backbone's 64 MiB
weights are written in slabs, one per rank, and times are rank 0's.

Usage: python bench/incremental.py [--repeat 3] [--quick] [--ranks 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
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
        incremental: bool, async_save: bool, quick: bool, scratch: Path,
        barrier: Callable[[], object] = lambda: None) -> dict[str, float]:
    """One manager's saves of the state `make` builds; `barrier` waits for the other ranks
    (every rank runs this; rank 0 alone is measured and clears the root)."""
    root = scratch / "root"
    shutil.rmtree(root, ignore_errors=True)
    barrier()
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
    barrier()
    return {"first": totals[0], "later": statistics.median(totals[1:]),
            "blocked": statistics.median(blocked[1:]), "written": statistics.median(written[1:])}


STATES = {"fine-tune": fine_tune, "all changing": all_changing}


def in_group(ranks: int, name: str, incremental: bool, async_save: bool, quick: bool,
             scratch: Path) -> dict[str, float]:
    """`run` on `ranks` processes of a gloo group (this script with `--rank`); rank 0's
    figures."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = json.dumps({"state": name, "incremental": incremental, "async_save": async_save,
                      "quick": quick, "scratch": str(scratch), "ranks": ranks, "port": port})
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), job])
             for rank in range(ranks)]
    if any(proc.wait() for proc in procs):
        raise SystemExit(f"a rank failed: {[proc.returncode for proc in procs]}")
    figures: dict[str, float] = json.loads((scratch / "rank-0.json").read_text())
    return figures


def rank_main(rank: int, job: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank,
                            world_size=job["ranks"])
    torch.manual_seed(0)  # the same state on every rank, as DDP keeps it
    figures = run(STATES[job["state"]], job["incremental"], job["async_save"], job["quick"],
                  Path(job["scratch"]), dist.barrier)
    if rank == 0:
        (Path(job["scratch"]) / "rank-0.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("job", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, json.loads(args.job))
        return
    torch.manual_seed(0)
    print(f"incremental saves, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.ranks} rank(s); {SAVES} saves per run, {args.repeat} interleaved round(s); "
          "later = median of saves 2..6 (seconds to the commit)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="safepoint-bench-") as scratch:
        for name, make in STATES.items():
            for async_save in (False, True):
                runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
                for _ in range(args.repeat):
                    for incremental in (False, True):
                        runs[incremental].append(
                            run(make, incremental, async_save, args.quick, Path(scratch))
                            if args.ranks == 1 else
                            in_group(args.ranks, name, incremental, async_save, args.quick,
                                     Path(scratch)))
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
