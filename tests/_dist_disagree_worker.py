"""One rank of a 2-rank gloo group whose ranks disagree (tests/test_dist.py): a different
argument, a bad one on one rank, a failure read on one rank only. Each call must fail on
every rank at once with a SafepointError, where alone the other rank would wait out the
group's timeout. Run: python _dist_disagree_worker.py RANK PORT ROOT; each call's outcome
goes to ROOT/result-RANK.json."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import safepoint as sp
from safepoint.storage import open_storage, register
from safepoint.testing import FaultyStorage, fail_nth

#: The group's timeout: a call that fails promptly takes a fraction of it.
TIMEOUT = 20


def state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(8, dtype=torch.float32) * step, "n": step}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(8), "n": -1}


def piece(rank: int, value: float) -> dict[str, Any]:
    return {"s": sp.Shard(torch.full((4,), float(rank) + value), (4 * rank,), (8,))}


def main() -> None:
    rank, port, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=TIMEOUT))
    outcomes: dict[str, dict[str, Any]] = {}

    def call(name: str, fn: Callable[[], object]) -> None:
        started = time.monotonic()
        try:
            fn()
            outcomes[name] = {"ok": True}
        except Exception as exc:
            outcomes[name] = {"ok": False, "safepoint": isinstance(exc, sp.SafepointError),
                              "error": f"{type(exc).__name__}: {exc}"}
        outcomes[name]["seconds"] = time.monotonic() - started

    call("make a manager with a bad option on one rank",
         lambda: sp.CheckpointManager(str(root / "bad"), keep_last=-1 if rank else 3))
    call("make a two-tier manager with a bad option on one rank",
         lambda: sp.CheckpointManager(str(root / "bad"), local_dir=str(root / f"local{rank}"),
                                      keep_local=0 if rank else 1))
    mgr = sp.CheckpointManager(str(root / "mgr"), async_save=False, keep_last=None)
    mgr.save(2, state(2))
    mgr.save(3, state(3))
    target = blank()
    call("restore a bad step on one rank", lambda: mgr.restore(target, step=-1 if rank else 2))
    call("restore the latest on one rank, a step on the other",
         lambda: mgr.restore(target, step=2 if rank else None))
    untouched = torch.equal(target["w"], blank()["w"]) and target["n"] == -1
    url = str(root / "ckpt")
    sp.save(url, state(4))
    call("load with keys a str on one rank",
         lambda: sp.load(url, into=target, keys="w" if rank else ["w"]))
    untouched = untouched and torch.equal(target["w"], blank()["w"]) and target["n"] == -1
    call("save to an unknown scheme on one rank",
         lambda: sp.save("nosuchscheme://bucket/ckpt" if rank else str(root / "other"), state(5)))
    mgr.close()

    def flaky(url: str, options: dict[str, Any] | None = None) -> Any:
        inner = open_storage(url.removeprefix("flaky://"), options)
        return FaultyStorage(inner, fail_nth("write", 1)) if rank == 1 else inner

    register("flaky", flaky)
    failing = sp.CheckpointManager(f"flaky://{root}/async", async_save=True)
    handle = failing.save(1, piece(rank, 1))
    if rank == 0:  # the usual logging of rank 0 alone: its manager counts the error told
        call("the failed save, read on rank 0", handle.result)
    call("the next save after a failure read on rank 0 only",
         lambda: failing.save(2, piece(rank, 2)).result())
    failing.close()
    different = sp.CheckpointManager(str(root / "async-differs"), async_save=rank == 0)
    call("save with async_save on one rank", lambda: different.save(1, piece(rank, 1)).result())
    different.close()
    different = sp.CheckpointManager(str(root / "incremental-differs"), async_save=False,
                                     incremental=rank == 0)
    call("save with incremental on one rank", lambda: different.save(1, piece(rank, 1)).result())
    different.close()
    result = {"outcomes": outcomes, "untouched": untouched,
              "committed": sorted(str(p.parent.relative_to(root))
                                  for p in root.rglob("manifest.json"))}
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
