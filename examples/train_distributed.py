"""A small sharded training job on torch.distributed (CPU, gloo) that checkpoints with safepoint
and restores onto a different number of ranks.

    torchrun --nproc-per-node 4 examples/train_distributed.py /tmp/sp-dist [--steps 12]

Every rank trains an FSDP2-sharded MLP (`fully_shard`: its parameters and Adam state are
DTensors, one piece per rank), holds an unevenly split piece of an embedding table
(`sp.Shard`), and its own RNG streams (`sp.PerRank(sp.RNGState())`). Every 4 steps all ranks
call `sp.save` together: each writes only its own pieces, rank 0 commits the manifest once all
are durable.

At the end the job restores its last checkpoint onto the first half of its ranks (a subgroup,
as if it had been restarted on fewer machines): model, optimizer and table are resharded onto
the smaller group, each rank reading only the bytes of its new pieces, and the per-rank RNG is
left out with `keys=` (it belongs to ranks that no longer exist). The script checks that the
resharded model equals the one that was saved.

Launched again with any `--nproc-per-node`, it resumes from the newest committed checkpoint
under the directory (the RNG streams only when the world size is the same).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import safepoint as sp

ROWS, DIM = 1000, 16  # the embedding table
EVERY = 4


def split(rank: int, world: int) -> tuple[int, int]:
    """Rows of the table this rank holds: uneven on purpose (the last ranks hold more)."""
    edges = [round(ROWS * (r / world) ** 1.5) for r in range(world + 1)]
    return edges[rank], edges[rank + 1]


def build(group: Any) -> dict[str, Any]:
    """The training state of one rank of `group`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)  # the same initial model on every rank, before sharding
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    fully_shard(model, mesh=DeviceMesh.from_group(group, "cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    lo, hi = split(rank, world)
    table = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))[lo:hi].clone()
    torch.manual_seed(100 + rank)  # every rank draws its own batches
    return {
        "model": model,
        "optim": optim,
        "table": sp.Shard(table, (lo, 0), (ROWS, DIM)),
        "rng": sp.PerRank(sp.RNGState()),
        "step": 0,
    }


def train_step(state: dict[str, Any]) -> float:
    table = state["table"].tensor
    rows = torch.randint(0, table.shape[0], (32,))
    x = table[rows]
    loss = (state["model"](x).squeeze(1) - x.sum(1)).pow(2).mean()
    loss.backward()
    state["optim"].step()
    state["optim"].zero_grad()
    with torch.no_grad():
        table[rows] *= 0.999  # the rank's own piece changes too
    state["step"] += 1
    return loss.item()


def latest(root: Path) -> Path | None:
    committed = sorted(root.glob("step-*/manifest.json"))
    return committed[-1].parent if committed else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = dist.group.WORLD
    state = build(whole)

    found = latest(args.root)
    if found is not None:
        saved_by = sp.info(str(found)).world_size
        keys = None if saved_by == world else ["model", "optim", "table", "step"]
        sp.load(str(found), state, keys=keys)
        if rank == 0:
            print(f"resumed {found.name} (saved by {saved_by} ranks) on {world} ranks")

    for _ in range(args.steps):
        loss = train_step(state)
        if state["step"] % EVERY == 0:
            info = sp.save(str(args.root / f"step-{state['step']:06d}"), state)
            if rank == 0:
                print(f"step {state['step']}: loss {loss:.4f}, saved {info.nbytes} bytes "
                      f"in {info.files} files from {info.world_size} ranks")

    found = latest(args.root)
    assert found is not None, "no checkpoint was committed"
    # Reload onto the first half of the ranks (at least one): a different world size.
    size = max(1, world // 2)
    smaller = dist.new_group(list(range(size)))  # every rank takes part in creating it
    if rank < size:
        fresh = build(smaller)
        sp.load(str(found), fresh, keys=["model", "optim", "table", "step"],
                process_group=smaller)
        expected = sp.load(str(found), keys=["model"], dist=False)["model"]
        for name, value in fresh["model"].state_dict().items():
            assert torch.equal(value.full_tensor(), expected[name]), name
        if rank == 0:
            print(f"reloaded {found.name} onto {size} of {world} ranks: step {fresh['step']}, "
                  "model matches")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
