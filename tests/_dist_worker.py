"""One rank of the distributed test group (tests/test_dist.py starts one process per rank):

    python tests/_dist_worker.py RANK PORT DIR

The 4 ranks join a real gloo group on 127.0.0.1 and, in order (process start-up dominates the
time, so one group runs every scenario):

1. save a mixed sharded state (sp.Shard split unevenly by rows and by columns, DTensors on a
   2x2 mesh and replicated, an FSDP2 model and its optimizer, DDP-style replicated tensors,
   per-rank RNG), restore the RNG per rank and the pieces in place;
2. load it onto 2 ranks, then onto 3 (subgroups given as `process_group=`), with other splits
   and meshes;
3. three steps saved asynchronously with a collective `sp.CheckpointManager` (retention on
   rank 0), restored;
   an `sp.Run` in which only rank 1 gets SIGTERM; a two-tier `sp.Run` (local_dir)
   interrupted and resumed;
4. a save that fails on rank 2 (injected storage failure);
5. a save during which rank 3 is SIGKILLed.

Each rank asserts what it can see itself and writes what the parent checks to
DIR/result-RANK.json.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import safepoint as sp
from safepoint import _dist
from safepoint.storage import register
from safepoint.testing import FaultyStorage, fail_nth

EMB = (100, 6)
EMB_ROWS = [0, 10, 40, 41, 100]  # rank 2 holds one row
COLS = (8, 12)
COL_SPLIT = [0, 5, 6, 10, 12]
GRID = (7, 9)


def emb_full() -> torch.Tensor:
    return torch.arange(EMB[0] * EMB[1], dtype=torch.float32).reshape(EMB)


def cols_full() -> torch.Tensor:
    return torch.arange(COLS[0] * COLS[1], dtype=torch.int64).reshape(COLS) * 3


def grid_full() -> torch.Tensor:
    return torch.linspace(-1, 1, GRID[0] * GRID[1], dtype=torch.float64).reshape(GRID)


def ddp_state() -> dict[str, torch.Tensor]:
    """The same on every rank (seeded): one tensor big enough to be split over the ranks and
    many small ones spread over them."""
    gen = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(64, 1024, generator=gen)}
    for i in range(12):
        state[f"p{i}"] = torch.randn(16, 16 + i, generator=gen)
    return state


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))


class Partly(torch.nn.Module):
    """A model whose `unused` layer gets no gradient (so Adam keeps no state for it) unless
    called with `both` (an expert that a batch routes to, or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, both: bool = False) -> torch.Tensor:
        return self.unused(self.used(x)) if both else self.used(x)


def outcome_of(call: Any) -> list[Any]:
    """["ok", what `call()` returned] or ["error", its exception], for a scenario that must
    not stop the ones after it when it fails (on every rank alike)."""
    try:
        return ["ok", call()]
    except Exception as exc:
        return ["error", f"{type(exc).__name__}: {exc}"]


def trained(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model after one optimizer step (same input on every rank, so the result does
    not depend on the world size)."""
    m = model()
    fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(2, 5)).sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def save_and_fail(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    url = str(root / "ckpt")
    _dist.SPLIT_BYTES = 64 << 10  # so that ddp/big (256 KiB) is split over the ranks
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    m, opt = trained(mesh)
    lo, hi = EMB_ROWS[rank], EMB_ROWS[rank + 1]
    c0, c1 = COL_SPLIT[rank], COL_SPLIT[rank + 1]
    torch.manual_seed(100 + rank)
    state = {
        "emb": sp.Shard(emb_full()[lo:hi].clone(), (lo, 0), EMB),
        "cols": sp.Shard(cols_full()[:, c0:c1].clone(), (0, c0), COLS),
        "grid": distribute_tensor(grid_full(), mesh2, [Shard(0), Shard(1)]),
        "rep": distribute_tensor(torch.full((3, 4), 2.5), mesh, [Replicate()]),
        "ddp": ddp_state(),
        "model": m,
        "optim": opt,
        "rng": sp.PerRank(sp.RNGState()),
        "step": 7,
    }
    info = sp.save(url, state)
    assert info.world_size == world
    expected_rng = torch.rand(5)  # what the restored RNG must draw again
    result["save_id"] = info.save_id
    # Refusals decided on rank 0 reach every rank as the same error, before anything is written.
    try:
        sp.save(url, state)
    except sp.CheckpointExists:
        result["exists"] = True
    try:
        sp.save(str(root / "odd"), {"w": torch.zeros(2), **({"extra": 1} if rank == 1 else {})})
    except sp.UnsupportedLeaf as exc:
        result["tree_differs"] = str(exc)
    try:
        sp.save(str(root / "odd"), {"w": object() if rank == 3 else 1})
    except sp.DistributedError as exc:
        result["bad_leaf"] = exc.failures
    try:  # bytes are a plain value too, saved once
        sp.save(str(root / "odd"), {"b": b"rank 2" if rank == 2 else b"others"})
    except sp.UnsupportedLeaf as exc:
        result["bytes_differ"] = str(exc)
    try:  # a load names one checkpoint on every rank, as a save does
        sp.load(str(root / ("other" if rank == 3 else "ckpt")), keys=["step"])
    except sp.DistributedError as exc:
        result["load_differs"] = str(exc)
    try:  # keys that are not a list, on one rank, refused before anything is read
        sp.load(url, keys="step" if rank == 2 else ["step"])
    except sp.DistributedError as exc:
        result["keys_differ"] = str(exc)
    with sp.CheckpointManager(str(root / "mgr-metrics"), async_save=False) as mgr:
        try:  # checked on every rank: rank 1 alone raising would leave the others waiting
            mgr.save(1, {"w": torch.ones(2)},
                     metrics={"loss": torch.ones(1)} if rank == 1 else None)
        except sp.DistributedError as exc:
            result["bad_metrics"] = exc.failures
    # Two pairs of ranks (replicas, pipeline stages), each with an asynchronous manager over
    # its own subgroup, saving at once: their background groups must not mix the pairs.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    with sp.CheckpointManager(str(root / f"pair{rank // 2}"), process_group=pairs[rank // 2],
                              async_save=True) as mgr:
        mgr.save(1, {"x": torch.full((3,), float(rank // 2)), "p": sp.PerRank({"pos": rank})})
        mgr.wait()
        result["pair_steps"] = mgr.steps()
    full_model = {k: v.full_tensor() for k, v in m.state_dict().items()}  # collective
    if rank == 0:
        torch.save(full_model, root / "model_expected.pt")

    # Per-rank RNG comes back to the same rank.
    torch.rand(100)
    sp.load(url, {"rng": sp.PerRank(sp.RNGState())}, keys=["rng"])
    assert torch.equal(torch.rand(5), expected_rng), f"rank {rank}: RNG not restored"
    # A big-endian array comes back big-endian from a group's save, as from one process's.
    big = np.arange(6, dtype=">f4")
    sp.save(str(root / "big-endian"), {"big": big})
    back = sp.load(str(root / "big-endian"))["big"]
    assert back.dtype == big.dtype and np.array_equal(back, big), f"rank {rank}: {back.dtype}"
    # ZeroRedundancyOptimizer: refused whole (its state_dict() raises on every rank that did
    # not consolidate), and each rank's shard, its inner optimizer, restores exactly.
    from torch.distributed.optim import ZeroRedundancyOptimizer  # warns as it imports

    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    zero.step()
    try:
        sp.save(str(root / "zero"), {"net": net, "optim": zero})
    except sp.DistributedError as exc:  # every rank's UnsupportedLeaf
        result["zero_refused"] = exc.failures[rank]
    sp.save(str(root / "zero"), {"net": net, "optim": sp.PerRank(zero.optim)})
    again = torch.optim.Adam(zero.optim.param_groups[0]["params"], lr=0.1)
    sp.load(str(root / "zero"), {"optim": sp.PerRank(again)}, keys=["optim"])
    saved_state, restored = zero.optim.state_dict()["state"], again.state_dict()["state"]
    assert saved_state.keys() == restored.keys() and all(
        torch.equal(saved_state[i][k], restored[i][k]) for i in saved_state
        for k in saved_state[i]), f"rank {rank}: shard not restored"

    # A collective load at the same world size restores every piece in place.
    fresh = {
        "emb": sp.Shard(torch.zeros(hi - lo, EMB[1]), (lo, 0), EMB),
        "grid": distribute_tensor(torch.zeros(GRID, dtype=torch.float64), mesh2,
                                  [Shard(0), Shard(1)]),
    }
    sp.load(url, fresh, keys=["emb", "grid"])
    assert torch.equal(fresh["emb"].tensor, emb_full()[lo:hi])
    assert torch.equal(fresh["grid"].full_tensor(), grid_full())

    # One process's checkpoint with a tied tensor (stored once) restored in pieces by every
    # rank: each reads its rows of the one stored tensor under both names.
    if rank == 0:
        table = emb_full()
        sp.save(str(root / "tied"), {"emb": table, "head": table}, dist=False)
    dist.barrier()
    tied = {"emb": sp.Shard(torch.zeros(hi - lo, EMB[1]), (lo, 0), EMB),
            "head": distribute_tensor(torch.zeros(EMB), mesh, [Shard(0)])}
    sp.load(str(root / "tied"), tied)
    assert torch.equal(tied["emb"].tensor, emb_full()[lo:hi])
    assert torch.equal(tied["head"].full_tensor(), emb_full())
    result["tied"] = [e.kind for e in sp.info(str(root / "tied")).entries]

    for size in (2, 3):
        group = dist.new_group(list(range(size)))  # every rank takes part in creating it
        if rank < size:
            result[f"load{size}"] = load(group, root)

    # The manager is collective: rank 0 lists, holds the lease and applies retention.
    # Its saves are asynchronous: the state may change as soon as `save` returns.
    with sp.CheckpointManager(str(root / "mgr"), keep_last=2) as mgr:
        piece = emb_full()[lo:hi].clone()
        small = {"emb": sp.Shard(piece, (lo, 0), EMB), "pos": sp.PerRank(rank * 10), "step": 0}
        for step in (1, 2, 3):
            small["step"] = step
            handle = mgr.save(step, small)
            piece.add_(1000)  # training goes on while the step is written
            handle.result()
            piece.sub_(1000)
        result["mgr_steps"] = mgr.steps()
        result["mgr_latest"] = mgr.latest_step()
        back = {"emb": sp.Shard(torch.zeros(hi - lo, EMB[1]), (lo, 0), EMB),
                "pos": sp.PerRank(-1), "step": 0}
        result["mgr_restored"] = mgr.restore(back)
        assert torch.equal(back["emb"].tensor, emb_full()[lo:hi])
        assert back["pos"].value == rank * 10 and back["step"] == 3

    # SIGTERM on rank 1 alone: every rank saves the same step and exits for requeueing.
    run_state = {"emb": state["emb"], "pos": sp.PerRank(rank), "done": 0}
    try:
        with sp.Run(str(root / "run"), run_state, every_steps=100) as run:
            for step in run.range(10):
                run_state["done"] = step + 1
                if rank == 1 and step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
    except sp.Preempted as exc:
        result["preempted"] = [exc.step, exc.code]
    with sp.Run(str(root / "final"), {"pos": sp.PerRank(rank)}, every_steps=2,
                keep_final_only=True) as run:
        for _ in run.range(4):
            pass

    # A strided sharding placed after another sharding of its dimension gives each rank
    # every other row: refused by path both ways, nothing changed; FSDP2 + tensor parallel's
    # order (strided first) gives each rank one block, and round-trips.
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    for name, placements in (("good", [_StridedShard(0, split_factor=2), Shard(0)]),
                             ("bad", [Shard(0), _StridedShard(0, split_factor=2)])):
        strided = distribute_tensor(rows.clone(), mesh2, placements)
        zeros = distribute_tensor(torch.zeros(8, 3), mesh2, placements)
        outcome: list[Any] = []
        for call, args in ((sp.save, (str(root / f"strided-{name}"), {"t": strided})),
                           (sp.load, (str(root / "strided-good"), {"t": zeros}))):
            try:
                call(*args)
                outcome.append("ok")
            except sp.DistributedError as exc:
                outcome.append(str(exc))
        outcome.append(torch.equal(zeros.full_tensor(), rows if name == "good" else
                                   torch.zeros(8, 3)))
        result[f"strided_{name}"] = outcome

    # FSDP2 with a parameter that never had a gradient (no Adam state): a fresh optimizer is
    # primed for the saved parameters only, and keeps the gradients it had.
    def partly() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Partly()
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    used, adam = partly()
    for _ in range(2):
        used(torch.ones(2, 4)).sum().backward()
        adam.step()
        adam.zero_grad()
    sp.save(str(root / "partly"), {"model": used, "optim": adam})
    fresh, fresh_adam = partly()
    fresh(torch.ones(2, 4)).sum().backward()
    grad = fresh.used.weight.grad.full_tensor().clone()
    sp.load(str(root / "partly"), {"model": fresh, "optim": fresh_adam})
    result["partly"] = [sorted(adam.state_dict()["state"]),
                        sorted(fresh_adam.state_dict()["state"]),
                        torch.equal(fresh.used.weight.grad.full_tensor(), grad),
                        fresh.unused.weight.grad is None]
    # The weights alone: a fresh optimizer in the target, not selected, is left fresh.
    fresh, fresh_adam = partly()
    sp.load(str(root / "partly"), {"model": fresh, "optim": fresh_adam}, keys=["model/"])
    result["weights_only"] = len(fresh_adam.state)
    # A load refused because of one rank's target leaves every rank's fresh optimizer fresh.
    fresh, fresh_adam = partly()
    target: dict[str, Any] = {"model": fresh, "optim": fresh_adam}
    if rank == 1:
        target["extra"] = 5
    try:
        sp.load(str(root / "partly"), target)
    except sp.DistributedError as exc:
        result["refused_elsewhere"] = ["nothing was loaded on any rank" in str(exc),
                                       len(fresh_adam.state)]

    # An optimizer with state for some FSDP2 parameters only (`unused` got no gradient yet)
    # restores a checkpoint with state for all: the others are primed too, so their state
    # loads as DTensors, and training continues bit for bit. A load refused first (rank 1's
    # target differs) takes back what it primed and leaves the live state as it was.
    both, both_adam = partly()
    for _ in range(2):
        both(torch.ones(2, 4), both=True).sum().backward()
        both_adam.step()
        both_adam.zero_grad()
    sp.save(str(root / "both"), {"model": both, "optim": both_adam})
    both(torch.ones(2, 4), both=True).sum().backward()
    both_adam.step()
    expected = {k: v.full_tensor().tolist() for k, v in both.state_dict().items()}
    live, live_adam = partly()
    live(torch.ones(2, 4)).sum().backward()
    live_adam.step()
    live_adam.zero_grad()
    before = {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in s.items()}
              for i, s in live_adam.state_dict()["state"].items()}

    def restore_and_step() -> dict[str, Any]:
        target: dict[str, Any] = {"model": live, "optim": live_adam}
        try:
            sp.load(str(root / "both"), {**target, **({"extra": 5} if rank == 1 else {})})
        except sp.DistributedError:
            after = live_adam.state_dict()["state"]
            result["partial_refused"] = [sorted(after) == sorted(before), all(
                torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, before[i][k])
                for i, s in after.items() for k, v in s.items())]
        sp.load(str(root / "both"), target)
        live(torch.ones(2, 4), both=True).sum().backward()
        live_adam.step()
        return {k: v.full_tensor().tolist() for k, v in live.state_dict().items()}

    result["partial_state"] = [outcome_of(restore_and_step), expected]

    # A fine-tune with a shrunk head (3 rows to 2: ranks 2 and 3 hold none of it) and a fresh
    # Adam loads leniently: the head's saved state, of the old shape, is skipped whole (only
    # its moments were, and the step kept left a state the next step failed on).
    def head(outputs: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Linear(8, outputs))
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    old, old_adam = head(3)
    old(torch.ones(2, 5)).sum().backward()
    old_adam.step()
    sp.save(str(root / "head"), {"model": old, "optim": old_adam})
    tuned, tuned_adam = head(2)

    def load_head_and_step() -> list[list[str]]:
        sp.load(str(root / "head"), {"model": tuned, "optim": tuned_adam}, strict=False)
        keys = [sorted(state) for state in tuned_adam.state.values()]
        tuned(torch.ones(2, 5)).sum().backward()
        tuned_adam.step()
        return keys

    result["resized_head"] = outcome_of(load_head_and_step)

    # After that lenient load the head has no Adam state, as in a fresh optimizer, on every
    # rank, whether the load replaces the optimizer's whole state or selects its per-parameter
    # state (keys=), which loads into the live one: its next step is a first step, equal to a
    # fresh Adam's (there the state primed to load into, step 1 with zero moments, was left,
    # and the step took step 2's bias correction).
    def step_head_after_load(keys: list[str] | None) -> list[Any]:
        tuned, tuned_adam = head(2)
        sp.load(str(root / "head"), {"model": tuned, "optim": tuned_adam}, keys=keys,
                strict=False)
        fresh, fresh_adam = head(2)
        sp.load(str(root / "head"), {"model": fresh}, strict=False)
        states = [sorted(tuned_adam.state.get(p, {})) for p in tuned.parameters()]
        for net, adam in ((tuned, tuned_adam), (fresh, fresh_adam)):
            net(torch.ones(2, 5)).sum().backward()
            adam.step()
        return [states, [torch.equal(a.full_tensor(), b.full_tensor())
                         for a, b in zip(tuned[1].parameters(), fresh[1].parameters(),
                                         strict=True)]]

    result["resized_head_step"] = [outcome_of(partial(step_head_after_load, keys))
                                   for keys in (None, ["model/", "optim/state/*"])]

    # A DTensor on a mesh of ranks 0 and 1 alone: ranks 2 and 3 hold no piece of it, yet
    # take part in the save and the load (they refused its empty piece as not fitting).
    sub = DeviceMesh("cpu", [0, 1])
    part = distribute_tensor(rows.clone(), sub, [Shard(0)])
    into = distribute_tensor(torch.zeros(8, 3), sub, [Shard(0)])

    def save_part() -> list[Any]:
        sp.save(str(root / "submesh"), {"t": part})
        return sp.load(str(root / "submesh"), dist=False)["t"].tolist()

    def load_part() -> list[Any]:
        sp.load(str(root / "strided-good"), {"t": into})
        return into.to_local().tolist()

    result["submesh"] = [outcome_of(save_part), outcome_of(load_part), part.to_local().tolist()]

    # A 0-dim DTensor on that mesh (a loss scale, a step): ranks 2 and 3 hold no piece of it,
    # as of the others, and refused their local tensor of shape [0] as not fitting shape [].
    scalar = distribute_tensor(torch.tensor(2.5, dtype=torch.float64), sub, [Replicate()])
    zero = distribute_tensor(torch.tensor(0.0, dtype=torch.float64), sub, [Replicate()])

    def save_and_load_scalar() -> list[Any]:
        sp.save(str(root / "submesh-scalar"), {"s": scalar, "t": part})
        sp.load(str(root / "submesh-scalar"), {"s": zero}, keys=["s"])
        whole = sp.load(str(root / "submesh-scalar"), dist=False)["s"]
        return [whole.item(), zero.to_local().tolist()]

    result["submesh_scalar"] = outcome_of(save_and_load_scalar)

    # A DTensor over the 4 ranks saved over a group of rank 0 alone leaves 3/4 of it out:
    # refused, naming the mesh as the cause (not the sp.Shard offsets it never passed).
    alone = dist.new_group([0])
    spread = distribute_tensor(rows.clone(), mesh, [Shard(0)])
    if rank == 0:
        result["mesh_not_tiled"] = outcome_of(
            lambda: sp.save(str(root / "alone"), {"t": spread}, process_group=alone))
    dist.barrier()

    # Equal sets pickle to other bytes under other string-hash seeds (each rank has its own):
    # compared unpickled, they are one value, saved once.
    hyper = {"names": {"alpha", "beta", "gamma", "delta", "eps"}, "lr": 0.1}
    result["pickled_bytes"] = pickle.dumps(hyper).hex()
    sp.save(str(root / "pickled"), {"hp": sp.Pickled(hyper)})
    try:
        sp.save(str(root / "pickled-differs"), {"hp": sp.Pickled({"rank": rank // 2})})
    except sp.UnsupportedLeaf as exc:
        result["pickled_differs"] = str(exc)

    # A plain value is saved once: one that differs per rank is refused (NaN equals NaN).
    try:
        sp.save(str(root / "values"), {"pos": rank * 10, "loss": float("nan")})
    except sp.UnsupportedLeaf as exc:  # rank 0's plan, raised on every rank
        result["differing_value"] = str(exc)
    sp.save(str(root / "values"), {"pos": 10, "loss": float("nan")})
    # Floats are compared by their bits, as data is: -0.0 is not 0.0 (a sign a later
    # division or copysign tells apart).
    try:
        sp.save(str(root / "zeros"), {"bias": -0.0 if rank == 3 else 0.0})
    except sp.UnsupportedLeaf as exc:
        result["signed_zero"] = str(exc)

    # Ranks naming different checkpoints (a step counter that drifted) are refused before
    # anything is written: each rank's data file would land beside its own URL.
    try:
        sp.save(str(root / f"drift-{rank // 2}"), {"pos": sp.PerRank(rank)})
    except sp.DistributedError as exc:
        result["drifted_url"] = str(exc)
    with sp.CheckpointManager(str(root / "drift"), async_save=False) as mgr:
        try:
            mgr.save(100 + rank % 2, {"pos": sp.PerRank(rank)})
        except sp.DistributedError as exc:
            result["drifted_step"] = str(exc)
        result["drifted_steps"] = mgr.steps()

    # Two tiers: every step is committed in a local_dir all ranks share, then uploaded; a run
    # that crashed after step 3 resumes from step 2 in both tiers and finishes.
    tiered = {"emb": sp.Shard(emb_full()[lo:hi].clone(), (lo, 0), EMB), "pos": sp.PerRank(rank),
              "done": 0}
    for attempt in range(2):
        try:
            with sp.Run(str(root / "remote"), tiered, every_steps=2,
                        local_dir=str(root / "nvme"), keep_local=1) as run:
                result[f"tiered_start{attempt}"] = run.step
                for step in run.range(6):
                    tiered["emb"].tensor.copy_(emb_full()[lo:hi] + step + 1)
                    tiered["done"] = step + 1
                    if attempt == 0 and step == 2:
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        result[f"tiered_done{attempt}"] = tiered["done"]

    # Two hosts of two ranks each, simulated: ranks 0-1 share one node-local local_dir, ranks
    # 2-3 another. Each node holds its own ranks' files; the remote root holds all four; a
    # restart restores from local bytes, and after node 1's disk is wiped from the remote.
    def node_local() -> Any:
        return sp.CheckpointManager(str(root / "nodes-remote"), keep_last=2, keep_local=1,
                                    local_dir=str(root / f"nodes-local-{rank // 2}"),
                                    on_event=lambda e: loads.append(e.url)
                                    if e.kind == "load" else None)

    loads: list[str] = []
    nodes_state = {"emb": sp.Shard(emb_full()[lo:hi].clone(), (lo, 0), EMB),
                   "rep": torch.arange(12.0), "pos": sp.PerRank(rank)}
    with node_local() as mgr:
        result["nodes"] = mgr.nodes
        for step in (1, 2):
            nodes_state["emb"].tensor.copy_(emb_full()[lo:hi] + step)
            nodes_state["rep"].fill_(step)
            mgr.save(step, nodes_state)
        mgr.wait()
        result["nodes_steps"] = mgr.steps()
    for attempt in ("local", "wiped"):
        if attempt == "wiped" and rank == 2:
            shutil.rmtree(root / "nodes-local-1")
        dist.barrier()
        back = {"emb": sp.Shard(torch.zeros(hi - lo, EMB[1]), (lo, 0), EMB),
                "rep": torch.zeros(12), "pos": sp.PerRank(-1)}
        loads.clear()
        with node_local() as mgr:
            restored = mgr.restore(back)
        result[f"nodes_{attempt}"] = [
            restored, torch.equal(back["emb"].tensor, emb_full()[lo:hi] + 2),
            torch.equal(back["rep"], torch.full((12,), 2.0)), back["pos"].value, list(loads)]

    # An injected storage failure on rank 2 aborts the save on every rank.
    def factory(url: str, options: dict[str, Any] | None = None) -> Any:
        local = sp.storage.open_storage(url.removeprefix("faulty://"), options)
        return FaultyStorage(local, fail_nth("write", 1)) if rank == 2 else local

    register("faulty", factory)
    try:
        sp.save("faulty://" + url, state, overwrite=True)
    except sp.DistributedError as exc:
        result["failure"] = str(exc)
        result["failures"] = {str(k): v for k, v in exc.failures.items()}
    else:
        raise AssertionError(f"rank {rank}: the save with a failing rank 2 succeeded")
    assert sp.info(url).save_id == info.save_id

    # Rank 3 dies by SIGKILL in the middle of writing its data file.
    def dying(url: str, options: dict[str, Any] | None = None) -> Any:
        local = sp.storage.open_storage(url.removeprefix("dying://"), options)
        if rank == 3:
            write = local.write

            def write_and_die(path: str, chunks: Any) -> int:
                def first_then_die() -> Any:
                    for chunk in chunks:
                        yield chunk
                        os.kill(os.getpid(), signal.SIGKILL)

                return write(path, first_then_die())

            local.write = write_and_die
        return local

    register("dying", dying)
    result["before_kill"] = True
    _write(root, rank, result)
    try:
        sp.save("dying://" + url, state, overwrite=True)
    except sp.DistributedError as exc:
        result["kill"] = str(exc)
    else:
        raise AssertionError(f"rank {rank}: the save survived the death of rank 3")


def load(group: Any, root: Path) -> dict[str, Any]:
    """Load the checkpoint onto the ranks of `group`, with other splits."""
    result: dict[str, Any] = {}
    url = str(root / "ckpt")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    rows = [EMB[0] * r // world for r in range(world + 1)]
    col_rows = [0, 3, 8] if world == 2 else [0, 3, 4, 8]
    lo, hi = rows[rank], rows[rank + 1]
    r0, r1 = col_rows[rank], col_rows[rank + 1]
    m, opt = trained(mesh)
    for p in m.parameters():
        p.data.to_local().zero_()
    state = {
        "emb": sp.Shard(torch.zeros(hi - lo, EMB[1]), (lo, 0), EMB),
        "cols": sp.Shard(torch.zeros(r1 - r0, COLS[1], dtype=torch.int64), (r0, 0), COLS),
        "grid": distribute_tensor(torch.zeros(GRID, dtype=torch.float64), mesh, [Shard(1)]),
        "rep": torch.zeros(3, 4),
        "ddp": {k: torch.zeros_like(v) for k, v in ddp_state().items()},
        "model": m,
        "optim": opt,
        "rng": sp.PerRank(sp.RNGState()),
        "step": 0,
    }
    # The per-rank values belong to 4 ranks: restoring them on this world size is refused.
    try:
        sp.load(url, state, process_group=group)
    except sp.DistributedError as exc:
        result["per_rank_error"] = str(exc)
    else:
        raise AssertionError("per-rank values loaded onto a different world size")
    assert not state["emb"].tensor.any(), "a refused load changed the state"

    everything_but_rng = ["emb", "cols", "grid", "rep", "ddp", "model", "optim", "step"]
    sp.load(url, state, keys=everything_but_rng, process_group=group)
    assert torch.equal(state["emb"].tensor, emb_full()[lo:hi])
    assert torch.equal(state["cols"].tensor, cols_full()[r0:r1])
    grid = state["grid"]
    assert isinstance(grid, DTensor)
    assert torch.equal(grid.full_tensor(), grid_full())
    assert torch.equal(state["rep"], torch.full((3, 4), 2.5))
    for k, v in ddp_state().items():
        assert torch.equal(state["ddp"][k], v), k
    assert state["step"] == 7
    expected = torch.load(root / "model_expected.pt")
    for k, v in m.state_dict().items():
        assert torch.equal(v.full_tensor(), expected[k]), k
    full = sp.load(url, keys=["optim"], dist=False)["optim"]["state"]
    for index, values in opt.state_dict()["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(values[k].full_tensor(), full[index][k]), (index, k)
    result["ok"] = True
    return result


def _write(root: Path, rank: int, result: dict[str, Any]) -> None:
    (root / f"result-{rank}.json").write_text(json.dumps(result))


def main() -> None:
    rank, port, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=timedelta(seconds=30))
    result: dict[str, Any] = {}
    try:
        save_and_fail(rank, 4, root, result)
    finally:
        _write(root, rank, result)
    # The group lost rank 3: it cannot be torn down collectively; exiting releases it.


if __name__ == "__main__":
    main()
