"""One rank of a 2-rank gloo group (tests/test_dist.py), each rank perhaps importing
safepoint from its own copy (PYTHONPATH), as nodes with their own installs do. Run: python
_dist_pair_worker.py RANK PORT ROOT; the outcome goes to ROOT/result-RANK.json."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import safepoint as sp


def main() -> None:
    rank, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    result: dict[str, Any] = {"file": sp.__file__}
    try:
        w = torch.arange(120.0).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last)
        # Above the size that is cut into slabs written by both ranks (17.3 MB).
        big = torch.arange(520 * 520 * 16.0).reshape(520, 520, 4, 4).to(
            memory_format=torch.channels_last)
        sp.save(f"{root}/ckpt", {"w": w, "big": big, "n": 3})
        dist.barrier()
        loaded = sp.load(f"{root}/ckpt", dist=False)
        result.update(ok=True, equal=bool(torch.equal(loaded["w"], w)),
                      strides=[list(loaded["w"].stride()), list(w.stride())],
                      big_equal=bool(torch.equal(loaded["big"], big)),
                      big_strides=[list(loaded["big"].stride()), list(big.stride())])
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    with open(f"{root}/result-{rank}.json", "w") as file:
        json.dump(result, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
