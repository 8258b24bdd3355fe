"""safepoint with a training state on a CUDA device, beside torch.save, safetensors and
torch.distributed.checkpoint on the same state (README, "On a GPU").

For each workload of `workloads.py`, moved to the GPU, in a fresh process each:

- asynchronous saves: how long `mgr.save` blocks the caller on the first save (pinned
  staging memory allocated) and on later ones (buffers reused; the median of five), next to
  the `copy_` of every tensor into pinned host buffers of the same shapes (`non_blocking`,
  then one synchronize: the limit of any host snapshot of GPU memory) and to DCP
  `async_save`'s blocking;
- synchronous, durable saves from the GPU: `sp.save`, torch.save + fsync, safetensors
  `save_file` + fsync and DCP (best of two);
- loads into the existing GPU tensors, page cache warm (best of two), with each method's
  peak host RSS growth (sampled every 2 ms): `sp.load(into=)`, torch.load + `copy_`,
  safetensors `load_file(device="cuda")` + `copy_`, DCP `load`.

Usage: python bench/cuda.py [--quick] [--async-only] [--workloads W1,W2,W3] [--dir DIR]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import methods
import psutil
import torch
from workloads import WORKLOADS, build_state, tensor_bytes, tensor_leaves

import safepoint as sp

MIB = 1 << 20


def _to_cuda(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to("cuda")
    if isinstance(tree, dict):
        return {key: _to_cuda(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cuda(value) for value in tree)
    return tree


def _timed(op: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    op()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    name = getattr(getattr(op, "func", op), "__qualname__", "op")
    print(f"  {name}: {seconds:.3f} s", file=sys.stderr, flush=True)
    return seconds


def _peak_growth(op: Callable[[], Any]) -> tuple[float, int]:
    """Seconds of `op` and its peak host RSS growth."""
    process = psutil.Process()
    before = process.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        seconds = _timed(op)
    finally:
        done.set()
        sampler.join()
    return seconds, peak[0] - before


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source, non_blocking=True)


def _asynchronous(state: Any, scratch: Path) -> dict[str, float]:
    tensors = list(tensor_leaves(state).values())
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    limit = statistics.median(_timed(partial(_copy_all, pinned, tensors)) for _ in range(3))
    del pinned
    later = []
    with sp.CheckpointManager(str(scratch / "mgr"), keep_last=1) as mgr:
        torch.cuda.synchronize()
        started = time.perf_counter()
        mgr.save(0, state)
        first = time.perf_counter() - started
        print(f"  first mgr.save: {first:.3f} s", file=sys.stderr, flush=True)
        mgr.wait()
        for step in range(1, 6):
            torch.cuda.synchronize()
            started = time.perf_counter()
            mgr.save(step, state)
            later.append(time.perf_counter() - started)
            print(f"  later mgr.save: {later[-1]:.3f} s", file=sys.stderr, flush=True)
            mgr.wait()

    import torch.distributed.checkpoint as dcp

    dcp_times = []
    for step in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(scratch / f"dcp-async{step}"))
        dcp_times.append(time.perf_counter() - started)
        future.result()
        print(f"  DCP async_save: {dcp_times[-1]:.3f} s", file=sys.stderr, flush=True)
    return {"copy": limit, "first": first, "later": statistics.median(later),
            "dcp_first": dcp_times[0], "dcp_later": statistics.median(dcp_times[1:])}


def _saves_and_loads(state: Any, scratch: Path) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    tensors = tensor_leaves(state)
    paths = {name: scratch / f"save-{name}" for name in ("safepoint", "torch_save",
                                                           "safetensors", "dcp")}
    saves = {"safepoint": methods.safepoint_save, "torch_save": methods.torch_save,
             "safetensors": methods.safetensors_save, "dcp": methods.dcp_save}
    for name, make in saves.items():
        op = make(state)
        path = paths[name]  # each method overwrites its previous save
        out[f"save {name}"] = {"seconds": min(_timed(partial(op, path)) for _ in range(2))}

    def torch_load() -> None:
        loaded = torch.load(paths["torch_save"], weights_only=True)
        for key, tensor in tensor_leaves(loaded).items():
            tensors[key].copy_(tensor)

    def safetensors_load() -> None:
        from safetensors.torch import load_file

        loaded = load_file(str(paths["safetensors"]), device="cuda")
        for key, tensor in tensors.items():
            tensor.copy_(loaded[key])

    loads = {
        "safepoint": lambda: sp.load(str(paths["safepoint"]), into=state),
        "torch_load": torch_load,
        "safetensors": safetensors_load,
        "dcp": lambda: methods.dcp_load(state)(paths["dcp"]),
    }
    for name, load in loads.items():
        runs = [_peak_growth(load) for _ in range(2)]
        out[f"load {name}"] = {"seconds": min(s for s, _ in runs),
                               "rss_growth_mib": max(g for _, g in runs) / MIB}
    return out


def _worker(workload: str, quick: bool, scratch: Path, async_only: bool) -> dict[str, Any]:
    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group
    state = _to_cuda(build_state(workload, quick=quick, source=True))
    torch.cuda.synchronize()
    result: dict[str, Any] = {"workload": workload, "nbytes": tensor_bytes(state),
                              "device": torch.cuda.get_device_name()}
    result["async"] = _asynchronous(state, scratch)
    if async_only:
        return result
    result["methods"] = _saves_and_loads(state, scratch)
    expected = {k: v.clone() for k, v in tensor_leaves(state).items()}
    for tensor in tensor_leaves(state).values():
        tensor.zero_()
    sp.load(str(scratch / "save-safepoint"), into=state)
    result["bit_exact"] = all(torch.equal(tensor_leaves(state)[k].reshape(-1).view(torch.uint8),
                                          v.reshape(-1).view(torch.uint8))
                              for k, v in expected.items())
    return result


def _report(results: list[dict[str, Any]]) -> str:
    lines = [f"device: {results[0]['device']}", "",
             "| workload | MB | copy_ limit s | first save blocks s | later saves block s | "
             "later / limit | DCP async first s | DCP async later s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        a = r["async"]
        lines.append(f"| {r['workload']} | {r['nbytes'] / 1e6:.0f} | {a['copy']:.3f} | "
                     f"{a['first']:.3f} | {a['later']:.3f} | {a['later'] / a['copy']:.2f}x | "
                     f"{a['dcp_first']:.3f} | {a['dcp_later']:.3f} |")
    measured = [r for r in results if "methods" in r]
    if not measured:  # --async-only
        return "\n".join(lines)
    lines += ["", "| workload | method | save s | load into GPU s | load host RSS growth MiB |",
              "|---|---|---|---|---|"]
    for r in measured:
        m = r["methods"]
        for name in ("safepoint", "torch_save", "safetensors", "dcp"):
            load = m[f"load {'torch_load' if name == 'torch_save' else name}"]
            lines.append(f"| {r['workload']} | {name} | {m[f'save {name}']['seconds']:.3f} | "
                         f"{load['seconds']:.3f} | {load['rss_growth_mib']:.0f} |")
    lines.append("")
    lines.append("bit-exact after sp.load into GPU tensors: "
                 + ", ".join(f"{r['workload']} {r['bit_exact']}" for r in measured))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke test)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--async-only", action="store_true", help="asynchronous saves only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/cuda.py needs a CUDA device")
    if args.worker:
        print(json.dumps(_worker(args.worker, args.quick, args.dir, args.async_only)))
        return
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    results = []
    for workload in args.workloads.split(","):
        with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
            command = [sys.executable, __file__, "--worker", workload, "--dir", scratch]
            command += ["--quick"] * args.quick + ["--async-only"] * args.async_only
            done = subprocess.run(command, check=True,
                                  stdout=subprocess.PIPE, text=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(_report(results[-1:]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    if len(results) > 1:
        print(_report(results))


if __name__ == "__main__":
    main()
