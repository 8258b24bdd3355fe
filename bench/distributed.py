"""Benchmark collective save and load: safepoint beside torch.distributed.checkpoint (DCP) on 1,
2 and 4 ranks of a real gloo group on this machine, every rank writing to the same local disk.

Run (from the repository root)::

    .venv/bin/python bench/distributed.py --workloads W3 --repeat 2   # ~3 min on 2 cores
    .venv/bin/python bench/distributed.py --workloads W2              # ~12 min: DCP's loads
    .venv/bin/python bench/distributed.py --quick    # small sizes, a smoke test

Workloads (shapes from ``workloads.py``):

- ``W3``: GPT-2 small with AdamW state, ~1.5 GB, *sharded*: every parameter, ``exp_avg`` and
  ``exp_avg_sq`` is a DTensor split along dim 0 over the ranks (FSDP-style), the optimizer's
  scalar ``step`` tensors and ``param_groups`` are replicated. The global state is the same at
  every rank count.
- ``W2``: W2's 20,000 small tensors (~450 MB) *replicated* on every rank (DDP-style): each
  method writes every tensor once.

Both methods get the same state; loads go into zeroed DTensors / tensors of the same layout
(in place) and are checked against what was saved. Each time is one call on every rank, from a
barrier to a barrier (the slowest rank), warm page cache for loads. ``--repeat`` repeats each
call and keeps the best.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "src"))

WORLDS = (1, 2, 4)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- one rank -----------------------------------------------------------------------------------


def _w3(rank: int, world: int, mesh: Any, quick: bool, fill: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from workloads import FULL, QUICK, gpt2_shapes

    def piece(shape: tuple[int, ...], value: float) -> Any:
        rows = -(-shape[0] // world)
        lo, hi = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
        local = torch.empty((hi - lo, *shape[1:])).fill_(value if fill else 0.0)
        stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=stride)

    shapes = gpt2_shapes(QUICK if quick else FULL)
    model = {name: piece(shape, i) for i, (name, shape) in enumerate(shapes.items())}
    state = {
        i: {"step": torch.tensor(float(7 if fill else 0)),
            "exp_avg": piece(shape, i + 0.5), "exp_avg_sq": piece(shape, i + 0.25)}
        for i, shape in enumerate(shapes.values())
    }
    groups = [{"lr": 6e-4, "betas": (0.9, 0.95), "weight_decay": 0.1,
               "params": list(range(len(shapes)))}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def _w2(quick: bool, fill: bool) -> dict[str, Any]:
    import torch
    from workloads import FULL, QUICK, w2_layout

    groups: dict[str, dict[str, Any]] = {}
    for i, (dtype, numel) in enumerate(w2_layout(QUICK if quick else FULL)):
        tensor = torch.empty(numel, dtype=dtype)
        tensor.fill_((i % 2 == 0) if dtype == torch.bool else (i % 100 if fill else 0))
        groups.setdefault(f"g{i // 1000:02d}", {})[f"t{i:05d}"] = tensor
    return {"small": groups}


def _tensors(tree: Any) -> list[Any]:
    import torch

    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    if isinstance(tree, list | tuple):
        return [t for value in tree for t in _tensors(value)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _local(tensor: Any) -> Any:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def worker(rank: int, world: int, port: int, root: Path, workload: str, quick: bool,
           repeat: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.device_mesh import init_device_mesh

    import safepoint as sp

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def build(fill: bool) -> dict[str, Any]:
        return _w3(rank, world, mesh, quick, fill) if workload == "W3" else _w2(quick, fill)

    source, target = build(True), build(False)
    nbytes = sum(_local(t).nbytes for t in _tensors(source))
    if workload == "W2":
        nbytes //= world  # replicated: the global state is one copy
    total = torch.tensor(nbytes)
    dist.all_reduce(total)

    def timed(op: Any) -> float:
        best = float("inf")
        for _ in range(repeat):
            dist.barrier()
            started = time.perf_counter()
            op()
            dist.barrier()
            best = min(best, time.perf_counter() - started)
        return best

    def check() -> None:
        for saved, loaded in zip(_tensors(source), _tensors(target), strict=True):
            assert torch.equal(_local(saved), _local(loaded)), "a load differs from the save"
            _local(loaded).zero_()

    methods = {
        "safepoint": (
            lambda path: sp.save(path, source, overwrite=True),
            lambda path: sp.load(path, target),
        ),
        "dcp": (
            lambda path: dcp_save(source, checkpoint_id=path),
            lambda path: dcp_load(target, checkpoint_id=path),
        ),
    }
    results: dict[str, Any] = {"bytes": int(total)}
    for name, (save, load) in methods.items():
        path = str(root / name)
        results[f"{name}_save"] = timed(lambda: save(path))  # noqa: B023
        results[f"{name}_load"] = timed(lambda: load(path))  # noqa: B023
        check()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        (root / "result.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------


def run(world: int, workload: str, quick: bool, repeat: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="sp-bench-dist-", dir=os.environ.get("BENCH_DIR")))
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(world), str(port),
                          str(root), workload, str(int(quick)), str(repeat)])
        for rank in range(world)
    ]
    codes = [proc.wait() for proc in procs]
    try:
        if any(codes):
            raise SystemExit(f"{workload} on {world} ranks failed: exit codes {codes}")
        result: dict[str, Any] = json.loads((root / "result.json").read_text())
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port, root, workload, quick, repeat = sys.argv[2:9]
        worker(int(rank), int(world), int(port), Path(root), workload, quick == "1",
               int(repeat))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workloads", default="W3,W2")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    args = parser.parse_args()
    rows = []
    for workload in args.workloads.split(","):
        for world in map(int, args.worlds.split(",")):
            r = run(world, workload, args.quick, args.repeat)
            mb = r["bytes"] / 1e6
            rows.append(
                f"| {workload} | {world} | {mb:.0f} | {r['safepoint_save']:.2f} | "
                f"{r['dcp_save']:.2f} | {r['dcp_save'] / r['safepoint_save']:.2f}x | "
                f"{r['safepoint_load']:.2f} | {r['dcp_load']:.2f} | "
                f"{r['dcp_load'] / r['safepoint_load']:.2f}x |"
            )
            print(rows[-1], flush=True)
    print("\n| workload | ranks | MB | safepoint save s | DCP save s | DCP/safepoint | "
          "safepoint load s | DCP load s | DCP/safepoint |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
