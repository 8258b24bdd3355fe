"""One rank of a 2-rank gloo group whose ranks disagree (tests/test_dist.py): a different
argument, a bad one on one rank, a failure read on one rank only. Each call must fail on
every rank at once with a SafepointError, where alone the other rank would wait out the
group's timeout. Run: python _dist_disagree_worker.py RANK PORT ROOT; each call's outcome
goes to ROOT/result-RANK.json."""

from __future__ import annotations

import errno
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
from safepoint.testing import FaultyStorage

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

    failing_writes = [True]  # rank 1's writes fail while this holds

    def flaky(url: str, options: dict[str, Any] | None = None) -> Any:
        inner = open_storage(url.removeprefix("flaky://"), options)
        return FaultyStorage(inner, lambda op, *_: op == "write" and failing_writes[0]) \
            if rank == 1 else inner

    register("flaky", flaky)
    failing = sp.CheckpointManager(f"flaky://{root}/async", async_save=True)
    handle = failing.save(1, piece(rank, 1))
    if rank == 0:  # the usual logging of rank 0 alone: its manager counts the error told
        call("the failed save, read on rank 0", handle.result)
    call("the next save after a failure read on rank 0 only",
         lambda: failing.save(2, piece(rank, 2)).result())
    for then in ("wait", "restore", "save with bad metrics on rank 0"):
        handle = failing.save(3, piece(rank, 3))
        if rank == 0:
            call("the failed save, read on rank 0", handle.result)
        if then == "wait":
            call("wait after a failure read on rank 0 only", failing.wait)
        elif then == "restore":
            call("restore after a failure read on rank 0 only",
                 lambda: failing.restore({"s": sp.Shard(torch.zeros(4), (4 * rank,), (8,))}))
        else:  # rank 0's refusal of the metrics must not drop rank 1's failure
            call("a save refused on rank 0 after a failure read on rank 0 only",
                 lambda: failing.save(4, piece(rank, 4), metrics={"loss": "x" if rank else 1}))
            call("wait after that", failing.wait)
    failing.close()
    tiers = sp.CheckpointManager(f"flaky://{root}/remote", local_dir=f"flaky://{root}/local",
                                 async_save=True, keep_last=None, keep_local=5)
    handle = tiers.save(1, piece(rank, 1))
    if rank == 0:
        call("the failed save, read on rank 0", handle.result)
    call("two tiers: restore after a failure read on rank 0 only",
         lambda: tiers.restore({"s": sp.Shard(torch.zeros(4), (4 * rank,), (8,))}))
    failing_writes[0] = False
    tiers.save(2, piece(rank, 2))
    tiers.save(3, piece(rank, 3))
    tiers.wait()
    call("two tiers: restore the latest on one rank, a step on the other",
         lambda: tiers.restore({"s": sp.Shard(torch.zeros(4), (4 * rank,), (8,))},
                               step=2 if rank else None))
    tiers.close()
    call("make a manager with async_save on one rank",
         lambda: sp.CheckpointManager(str(root / "async-differs"), async_save=rank == 0))
    call("make a manager with incremental on one rank",
         lambda: sp.CheckpointManager(str(root / "incremental-differs"), async_save=False,
                                      incremental=rank == 0))
    call("make a manager of another root on each rank",
         lambda: sp.CheckpointManager(str(root / f"root-{rank}"), async_save=False))
    call("make a manager of one root spelled two ways",
         lambda: sp.CheckpointManager(f"file://{root}/same/" if rank else f"{root}/same",
                                      async_save=False).close())
    call("make a manager with local_dir on one rank",
         lambda: sp.CheckpointManager(str(root / "tiers-differ"), **(
             {"local_dir": str(root / "tiers-differ-local")} if rank == 0 else {})))
    listing = sp.CheckpointManager(str(root / "mgr"))
    call("list on one rank, collect garbage on the other",
         lambda: listing.gc(dry_run=True) if rank else listing.steps())
    listing.close()
    # dist.new_group is made by every rank; rank 1 holds a handle to a group without it.
    alone = dist.new_group([0])
    call("save over a group without this rank",
         lambda: sp.save(str(root / "alone"), state(6), process_group=alone))
    leftover = root / "full" / "data" / f"{'ab' * 16}-r00000-0000.bin"  # a killed save's
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(bytes(1 << 20))

    class Full(FaultyStorage):  # a full disk on rank 1
        def write(self, path: str, chunks: Any) -> int:
            cause = OSError(errno.ENOSPC, "No space left on device", path)
            raise sp.StorageError(f"writing {self.url}/{path} failed", url=self.url) from cause

    register("full", lambda url, options=None: (
        Full if rank else FaultyStorage)(open_storage(url.removeprefix("full://"), options),
                                         lambda *_: False))
    call("a save out of space on one rank", lambda: sp.save(f"full://{root}/full",
                                                            piece(rank, 1)))
    result = {"outcomes": outcomes, "untouched": untouched, "leftover": leftover.exists(),
              "committed": sorted(str(p.parent.relative_to(root))
                                  for p in root.rglob("manifest.json"))}
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
