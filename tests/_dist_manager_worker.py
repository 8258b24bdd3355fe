"""One rank of the 2-rank group of tests/test_dist_manager.py:

    python tests/_dist_manager_worker.py RANK PORT DIR

The ranks join a real gloo group on 127.0.0.1 and save a collective `sp.CheckpointManager`'s
steps asynchronously with a staging budget of a quarter of each rank's share (so staging
streams through it), while the training thread runs its own collectives; then a write that
fails mid-stream on rank 1 and a staging copy that fails on rank 1, each of which must surface
on every rank with nothing committed; then a restore. Then two tiers (`CheckpointManager(root,
local_dir=...)`): groupings of the ranks by local_dir that are not consistent, and incremental
saves with a local_dir per rank, are refused on every rank; steps committed in a shared
local_dir, uploaded by rank 0 to a second directory (the remote root), restored from the local
copy, then from the remote one once the local copy rots on one rank, and once it is gone; the
same with a moto S3 server as the remote root (DIR/s3.json, written by the parent, says
where), saving incrementally. Then node-local tiers, each rank a node with a local_dir of its
own (two simulated hosts): saves, uploads, retention, restores from local bytes and from the
remote root (a replaced host, rotten local bytes), an upload failing on one node, and an S3
remote root. Then an `sp.Run` whose save fails on rank 1 warns and trains on, on every rank.
Last, incremental managers (synchronous and asynchronous) save a fine-tuning state of frozen
and changing pieces, and a restarted one restores and goes on sharing. Then node-local tiers
holding stale copies (steps the remote root holds a later save of): a restore where one node's
copy is stale, and a manager reopened where every node's is; and node-local tiers whose
remote root is slower than the saves, where rank 0 skips the steps its policy would delete at
once and every node removes them. Last, ranks that pass different arguments: an `sp.Run`
whose `run.range()` totals differ by rank, refused on every rank; an `sp.Run` left with `break`
on one rank only, which ends every rank's range at that step; and incremental managers
restored with `keys=` that differ by rank. Each rank asserts what it can see itself and
writes what the parent checks to DIR/result-RANK.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import safepoint as sp
from _rss import RSSPeak, rss
from safepoint._snapshot import MIN_STAGING_BYTES, WRITER_BYTES, Snapshot
from safepoint.storage import open_storage, register
from safepoint.testing import FaultyStorage

WORLD = 2
BUDGET = MIN_STAGING_BYTES
COLS = 4096
ROWS = 4 * BUDGET // (4 * COLS)  # each rank's int32 piece is 4 budgets
SHAPE = (WORLD * ROWS, COLS)


def make(step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of the global tensor at `step` (every element distinct)."""
    start = rank * ROWS * COLS
    return torch.arange(start, start + ROWS * COLS, dtype=torch.int32).view(ROWS, COLS) + step


def replicated(step: int) -> torch.Tensor:
    return torch.linspace(0, 1, 5000, dtype=torch.float64) * step


def many(step: int) -> dict[str, torch.Tensor]:
    """A dict of leaves large enough for `flatten` to record in bulk and remember between the
    saves of a series; from step 2 on one key is renamed, so a remembered layout is stale."""
    return {("x5" if step >= 2 and i == 5 else f"k{i}"): torch.full((3,), step * 100.0 + i)
            for i in range(20)}


#: Rank 1's writes fail: the next data file after "chunks" chunks, and every data file of a
#: checkpoint whose URL ends with "under" (None: not armed).
ARMED: dict[str, Any] = {"chunks": None, "under": None}


def register_faulty(rank: int) -> None:
    """faulty://PATH: the directory PATH, whose writes fail on rank 1 as `ARMED` says."""

    def factory(url: str, options: dict[str, Any] | None = None) -> Any:
        local = open_storage(url.removeprefix("faulty://"), options)

        def fails(op: str, path: str, count: int) -> bool:
            if op != "write_chunk":
                return False
            if ARMED["under"] is not None and url.rstrip("/").endswith(ARMED["under"]):
                return True
            left = ARMED["chunks"]
            if left is None:
                return False
            ARMED["chunks"] = left - 1 if left else None
            return not left

        return FaultyStorage(local, fails) if rank == 1 else local

    register("faulty", factory)


def staged_saves(rank: int, root: Path, result: dict[str, Any]) -> None:
    piece = make(1, rank)
    state = {"w": sp.Shard(piece, (rank * ROWS, 0), SHAPE), "rep": replicated(1),
             "pos": sp.PerRank(rank), "step": 1, "many": many(1)}
    mgr = sp.CheckpointManager("faulty://" + str(root / "mgr"), keep_last=3,
                               max_staging_bytes=BUDGET)
    stager = mgr._stager
    assert stager is not None
    held: list[int] = []
    blocked: list[float] = []
    buffers: list[list[Any]] = []  # the staging buffers themselves, so no id is reused
    growth: list[int] = []
    for step in (1, 2):
        piece.copy_(make(step, rank))
        state["rep"], state["step"], state["many"] = replicated(step), step, many(step)
        before = rss()
        sampler = RSSPeak()
        handle = mgr.save(step, state)
        held.append(stager.nbytes)
        buffers.append(list(stager._memory))
        blocked.append(handle.blocked_seconds)
        piece.fill_(-7)  # training changes the state as soon as save returns
        state["rep"].fill_(-7)
        for tensor in state["many"].values():
            tensor.fill_(-7)
        # ... and runs its own collectives while the step is written
        for i in range(20):
            total = torch.tensor([rank + i])
            dist.all_reduce(total)
            assert int(total) == 1 + 2 * i
        handle.result()
        growth.append(sampler.stop() - before)
    assert "many" in mgr._memo, f"rank {rank}: the saves remembered no layout for the next"
    reused = len(buffers[1]) == len(buffers[0]) > 0 and all(
        a is b for a, b in zip(*buffers, strict=True))
    result.update(held=held, rss_growth=growth, reused=reused, blocked=blocked,
                  share=piece.numel() * piece.element_size())

    # Rank 1's write fails after 3 chunks, while its training thread is still staging.
    piece.copy_(make(3, rank))
    ARMED["chunks"] = 3
    mgr.save(3, state)
    try:
        mgr.wait()
    except sp.DistributedError as exc:
        result["write_failure"] = [str(exc), sorted(exc.failures)]
    else:
        raise AssertionError(f"rank {rank}: a save failing on rank 1 succeeded")

    # Rank 1's staging copy of its 5th part fails: save returns, the next save raises.
    copy = Snapshot._copy

    def failing(self: Snapshot, index: int) -> None:
        if index == 4:
            raise RuntimeError("injected staging failure")
        copy(self, index)

    if rank == 1:
        Snapshot._copy = failing  # type: ignore[method-assign]
    try:
        mgr.save(4, state)
    finally:
        Snapshot._copy = copy  # type: ignore[method-assign]
    try:
        mgr.save(5, state)
    except sp.DistributedError as exc:
        result["copy_failure"] = [str(exc), sorted(exc.failures)]
    else:
        raise AssertionError(f"rank {rank}: a save whose staging failed on rank 1 succeeded")

    result["steps"] = mgr.steps()
    back = {"w": sp.Shard(torch.zeros(ROWS, COLS, dtype=torch.int32), (rank * ROWS, 0), SHAPE),
            "rep": torch.zeros(5000, dtype=torch.float64), "pos": sp.PerRank(-1), "step": 0,
            "many": {key: torch.zeros(3) for key in many(2)}}
    result["restored"] = mgr.restore(back)
    assert torch.equal(back["w"].tensor, make(2, rank)), f"rank {rank}: step 2 differs"
    assert torch.equal(back["rep"], replicated(2))
    assert all(torch.equal(back["many"][k], v) for k, v in many(2).items())
    assert back["pos"].value == rank and back["step"] == 2
    mgr.close()
    result["writer_bytes"] = WRITER_BYTES


def small(step: int, rank: int) -> torch.Tensor:
    return torch.arange(rank * 96, (rank + 1) * 96, dtype=torch.float32).view(3, 32) + step


class SeesEveryMarker(FaultyStorage):
    """A local directory that claims to hold every rank's marker of who shares it."""

    def exists(self, path: str) -> bool:
        return path.startswith(".node-") or super().exists(path)


def register_sees_all(rank: int) -> None:
    """seesall://PATH: the directory PATH, where rank 1 also "sees" other ranks' markers."""

    def factory(url: str, options: dict[str, Any] | None = None) -> Any:
        local = open_storage(url.removeprefix("seesall://"), options)
        return SeesEveryMarker(local, lambda *_: False) if rank == 1 else local

    register("seesall", factory)


def two_tiers(rank: int, root: Path, result: dict[str, Any]) -> None:
    remote, local = root / "remote", root / "local"
    # Rank 1 sees rank 0's marker, rank 0 does not see rank 1's: not an equivalence.
    try:
        sp.CheckpointManager(str(remote), local_dir=f"seesall://{root}/own-{rank}")
    except sp.DistributedError as exc:
        result["inconsistent"] = [str(exc), sorted(exc.failures)]
    else:
        raise AssertionError(f"rank {rank}: inconsistent groupings were accepted")
    try:
        sp.CheckpointManager(str(remote), local_dir=str(root / f"own-{rank}"), incremental=True)
    except sp.SafepointError as exc:
        result["incremental_refused"] = str(exc)
    else:
        raise AssertionError(f"rank {rank}: incremental node-local tiers were accepted")

    loads: list[str] = []

    def on_event(event: sp.Event) -> None:
        if event.kind == "load":
            loads.append(event.url)

    piece = small(0, rank)
    state = {"w": sp.Shard(piece, (rank * 3, 0), (6, 32)), "pos": sp.PerRank(rank), "step": 0}
    with sp.CheckpointManager(str(remote), local_dir=str(local), keep_last=2, keep_local=1,
                              on_event=on_event) as mgr:
        for step in (1, 2, 3):
            piece.copy_(small(step, rank))
            state["step"] = step
            mgr.save(step, state)
            piece.fill_(-1)
        mgr.wait()  # and the uploads, on every rank
        result["tier_steps"] = mgr.steps()

        def restored(step: int | None = None) -> int | None:
            back = {"w": sp.Shard(torch.zeros(3, 32), (rank * 3, 0), (6, 32)),
                    "pos": sp.PerRank(-1), "step": 0}
            got = mgr.restore(back, step)
            assert got is not None and torch.equal(back["w"].tensor, small(got, rank))
            assert back["pos"].value == rank and back["step"] == got
            return got

        result["from_local"] = restored()
        if rank == 1:  # rank 1's local bytes rot: every rank restores the remote copy
            data = next((local / "step-3" / "data").glob("*-r00001-*"))
            with data.open("r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 0xFF]))
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["from_rotten"] = restored()
        result["warned"] = [str(w.message) for w in caught]
        dist.barrier()
        if rank == 0:  # a wiped local disk: the remote copy is restored
            shutil.rmtree(local / "step-3")
        dist.barrier()
        result["from_remote"] = restored()
        result["older"] = restored(2)
    result["loads"] = loads


def tiers_on_s3(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Two tiers, an S3 remote, incremental saves in the local tier: step 2 shares the frozen
    piece with step 1 there, and its upload holds every file."""
    s3 = json.loads((root / "s3.json").read_text())
    piece = small(0, rank)
    frozen = sp.Shard(small(-1, rank), (rank * 3, 0), (6, 32))
    state = {"w": sp.Shard(piece, (rank * 3, 0), (6, 32)), "frozen": frozen, "step": 0}
    with sp.CheckpointManager(s3["url"], local_dir=str(root / "local-s3"), keep_last=1,
                              storage_options=s3["storage_options"], incremental=True) as mgr:
        for step in (1, 2):
            piece.copy_(small(step, rank))
            state["step"] = step
            mgr.save(step, state)
        mgr.wait()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root / "local-s3" / "step-2")
        dist.barrier()
        back = {"w": sp.Shard(torch.zeros(3, 32), (rank * 3, 0), (6, 32)),
                "frozen": sp.Shard(torch.zeros(3, 32), (rank * 3, 0), (6, 32)), "step": 0}
        result["s3_restored"] = mgr.restore(back)
        result["s3_steps"] = mgr.steps()
        assert torch.equal(back["w"].tensor, small(2, rank)) and back["step"] == 2
        assert torch.equal(back["frozen"].tensor, small(-1, rank))


def replicated_small(step: int) -> torch.Tensor:
    """A plain tensor, the same on every rank: written by one rank, so one node."""
    return torch.arange(64, dtype=torch.float64) * step


def node_state(step: int, rank: int) -> dict[str, Any]:
    return {"w": sp.Shard(small(step, rank), (rank * 3, 0), (6, 32)),
            "rep": replicated_small(step), "pos": sp.PerRank(rank * 10 + step), "step": step}


def restore_node_state(mgr: Any, rank: int, step: int | None = None,
                       keys: list[str] | None = None) -> int | None:
    """Restore into a zeroed state; check it (the keys restored) against `node_state`."""
    back = node_state(0, rank)
    back["w"].tensor.zero_()
    back["pos"] = sp.PerRank(-1)
    if keys is not None:
        back = {key: back[key] for key in keys}
    got = mgr.restore(back, step, keys=keys)
    assert got is not None
    want = node_state(got, rank)
    assert torch.equal(back["w"].tensor, want["w"].tensor), f"rank {rank}: w of step {got}"
    assert back["pos"].value == want["pos"].value and back["step"] == got
    if "rep" in back:
        assert torch.equal(back["rep"], want["rep"])
    return int(got)


def flip_first_byte(path: Path) -> None:
    with path.open("r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def node_local_tiers(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Two hosts, simulated: each rank has a local_dir of its own, so each is a node. Steps
    are committed in both local_dirs (each with its own rank's files and the manifest) and
    uploaded; a restarted manager restores from local bytes (the remote copies of the data
    rot and a restore of each rank's own pieces still succeeds), then after rank 1's host is
    replaced (an empty local_dir) from the remote root for rank 1, then from the remote copy
    alone once rank 0's local copy rots; and saves on."""
    remote, local = root / "nl-remote", root / f"nl-local-{rank}"
    loads: list[str] = []
    uploads: list[int | None] = []

    def on_event(event: sp.Event) -> None:
        if event.kind == "load":
            loads.append(event.url)
        elif event.kind == "upload":
            uploads.append(event.step)

    def manager() -> Any:
        mgr = sp.CheckpointManager(str(remote), local_dir=str(local), keep_last=2,
                                   keep_local=1, on_event=on_event)
        mgr.upload_backoff_s = 0.01
        return mgr

    with manager() as mgr:
        result["nl_nodes"] = mgr.nodes
        for step in (1, 2, 3):
            state = node_state(step, rank)
            mgr.save(step, state)
            state["w"].tensor.fill_(-1)
        mgr.wait()  # the uploads of every node, and both tiers' retention
        result["nl_steps"] = mgr.steps()
        result["nl_local_files"] = sorted(str(p.relative_to(local)) for p in local.rglob("*")
                                          if p.is_file() and "lease" not in p.parts
                                          and p.name != "remote.json")
    result["nl_uploads"] = list(uploads)

    with manager() as mgr:  # a restart: the local copies are preferred
        result["nl_from_local"] = restore_node_state(mgr, rank)
        result["nl_loads_local"] = list(loads)
        dist.barrier()
        step_3 = remote / "step-3" / "data"
        if rank == 0:  # every remote data file of step 3 rots
            for data in step_3.iterdir():
                shutil.copy(data, root / f"kept-{data.name}")
                flip_first_byte(data)
        dist.barrier()
        # each rank's own pieces lie in its own node's files: read from local bytes only
        result["nl_own_pieces"] = restore_node_state(mgr, rank, 3, keys=["w", "pos", "step"])
        dist.barrier()
        if rank == 0:
            for data in step_3.iterdir():
                shutil.copy(root / f"kept-{data.name}", data)
        dist.barrier()

    if rank == 1:  # rank 1's host is replaced: an empty local_dir
        shutil.rmtree(local)
    dist.barrier()
    with manager() as mgr:
        loads.clear()
        result["nl_replaced"] = restore_node_state(mgr, rank)
        result["nl_loads_replaced"] = list(loads)
        if rank == 0:  # rank 0's local copy rots: every rank restores the remote copy
            flip_first_byte(next((local / "step-3" / "data").iterdir()))
        dist.barrier()
        loads.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["nl_rotten"] = restore_node_state(mgr, rank)
        result["nl_warned"] = [str(w.message) for w in caught]
        result["nl_loads_rotten"] = list(loads)
        mgr.save(4, node_state(4, rank))
        mgr.wait()
        result["nl_after"] = mgr.steps()


def node_local_upload_failure(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Two nodes; rank 1's node cannot write to the remote root: nothing is visible there,
    and `wait` raises on every rank; once the store is back, `wait` uploads the step."""
    remote = root / "nlf-remote"
    errors: list[int | None] = []
    texts: list[str | None] = []

    def on_event(event: sp.Event) -> None:
        if event.kind == "error":
            errors.append(event.step)
            texts.append(event.error)

    result["nlf_error_texts"] = texts
    with sp.CheckpointManager(f"faulty://{remote}", local_dir=str(root / f"nlf-local-{rank}"),
                              keep_local=1, on_event=on_event) as mgr:
        mgr.upload_attempts, mgr.upload_backoff_s = 2, 0.01
        ARMED["under"] = "nlf-remote/step-1"
        try:
            mgr.save(1, node_state(1, rank))
            try:
                mgr.wait()
            except sp.StorageError as exc:
                result["nlf_failure"] = str(exc)
            else:
                raise AssertionError(f"rank {rank}: an upload failing on rank 1 succeeded")
            result["nlf_visible"] = (remote / "step-1" / "manifest.json").exists()
            result["nlf_steps_meanwhile"] = mgr.steps()  # committed locally everywhere
        finally:
            ARMED["under"] = None
        mgr.wait()
        result["nlf_remote_steps"] = mgr.remote.steps()
        result["nlf_gc_kept"] = sorted(mgr.gc().kept)
    result["nlf_errors"] = errors


def node_local_on_s3(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Two nodes and an S3 remote root: saves, then a replaced host restores from S3."""
    s3 = json.loads((root / "s3.json").read_text())
    url = s3["url"] + "-nodes"

    def manager() -> Any:
        return sp.CheckpointManager(url, local_dir=str(root / f"nls3-local-{rank}"),
                                    keep_last=1, storage_options=s3["storage_options"])

    with manager() as mgr:
        for step in (1, 2):
            mgr.save(step, node_state(step, rank))
        mgr.wait()
    if rank == 1:
        shutil.rmtree(root / f"nls3-local-{rank}")
    dist.barrier()
    with manager() as mgr:
        result["nls3_restored"] = restore_node_state(mgr, rank)
        result["nls3_steps"] = mgr.steps()


def run_with_a_failed_save(rank: int, root: Path, result: dict[str, Any]) -> None:
    """An `sp.Run` (default `on_save_error="warn"`) whose save of step 4 fails on rank 1:
    every rank warns and trains on, and the final step is committed."""
    errors: list[int | None] = []

    def on_event(event: sp.Event) -> None:
        if event.kind == "error":
            errors.append(event.step)

    state = {"w": sp.Shard(torch.full((4,), float(rank)), (rank * 4,), (8,)),
             "pos": sp.PerRank(rank), "done": 0}
    ARMED["under"] = "run/step-4"
    with sp.Run("faulty://" + str(root / "run"), state, every_steps=2,
                on_event=on_event) as run:
        for step in run.range(6):
            state["done"] = step + 1
    ARMED["under"] = None
    result["run_errors"] = sorted(set(errors))
    with sp.CheckpointManager(str(root / "run")) as mgr:
        result["run_steps"] = mgr.steps()


#: The incremental saves' pieces: each rank's piece of a tensor is two checksum blocks.
INC_ROWS, INC_COLS = 512, 4096
INC_SHAPE = (WORLD * INC_ROWS, INC_COLS)


def fine_tuning(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors at `step`: a frozen piece and a frozen replicated tensor of 16 MiB
    (written in slabs, one per rank), a piece whose second block changes at every step, and
    a small replicated head that changes everywhere."""
    base = torch.arange(INC_ROWS * INC_COLS, dtype=torch.float32).view(INC_ROWS, INC_COLS)
    tuned = (base + rank).to(torch.int32)
    tuned[-1] += step  # the last row: in the piece's second block only
    return {"frozen": base * (rank + 1), "embed": torch.linspace(-1, 1, 4 << 20),
            "tuned": tuned, "head": torch.full((64,), float(step))}


def incremental_state(step: int, rank: int) -> dict[str, Any]:
    t = fine_tuning(step, rank)
    at = (rank * INC_ROWS, 0)
    # "row": a tensor of one row split by rows, as FSDP2 does: rank 1's piece is empty
    row = torch.arange(8.0).view(1, 8) if rank == 0 else torch.empty(0, 8)
    return {"frozen": sp.Shard(t["frozen"], at, INC_SHAPE), "embed": t["embed"],
            "tuned": sp.Shard(t["tuned"], at, INC_SHAPE), "head": t["head"],
            "row": sp.Shard(row, (rank, 0), (1, 8)),
            "pos": sp.PerRank(rank * 10 + step), "step": step}


def incremental_saves(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Steps 1 to 3 with a synchronous and an asynchronous incremental manager (keep_last=2,
    so step 1, which holds the frozen bytes, is deleted); then a new manager restores step 3
    and saves step 4, sharing with it."""
    for mode, async_save in (("sync", False), ("async", True)):
        url = str(root / f"inc-{mode}")
        with sp.CheckpointManager(url, keep_last=2, incremental=True,
                                  async_save=async_save) as mgr:
            for step in (1, 2, 3):
                state = incremental_state(step, rank)
                mgr.save(step, state)
                for value in state.values():  # training goes on once save returns
                    if isinstance(value, sp.Shard):
                        value.tensor.fill_(-1)
                    elif isinstance(value, torch.Tensor):
                        value.fill_(-1)
            mgr.wait()
            result[f"inc_{mode}_steps"] = mgr.steps()
    url = str(root / "inc-sync")
    with sp.CheckpointManager(url, keep_last=None, incremental=True, async_save=False) as mgr:
        back = incremental_state(0, rank)
        for value in back.values():
            if isinstance(value, sp.Shard):
                value.tensor.zero_()
            elif isinstance(value, torch.Tensor):
                value.zero_()
        result["inc_restored"] = mgr.restore(back)
        want = incremental_state(3, rank)
        for key in ("frozen", "tuned", "row"):
            assert torch.equal(back[key].tensor, want[key].tensor), f"rank {rank}: {key}"
        assert torch.equal(back["embed"], want["embed"]) and torch.equal(back["head"], want["head"])
        assert back["pos"].value == want["pos"].value and back["step"] == 3
        mgr.save(4, incremental_state(4, rank))
        result["inc_after_restart"] = mgr.steps()


def resaved_state(rank: int) -> dict[str, Any]:
    """A second save of step 1: `node_state(1, rank)` with other values of "w"."""
    return {**node_state(1, rank), "w": sp.Shard(small(-1, rank), (rank * 3, 0), (6, 32))}


def which_save(back: dict[str, Any], rank: int) -> str:
    """Which save of step 1 `back` holds: "first" (`node_state`), "second" (`resaved_state`)."""
    for name, state in (("first", node_state(1, rank)), ("second", resaved_state(rank))):
        if torch.equal(back["w"].tensor, state["w"].tensor):
            return name
    return "neither"


def node_local_stale_copy(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Two nodes save step 1, then save it again (both tiers replaced); rank 0's host then
    holds the first save's copy again (as a host that ran the job before would). A restart
    restores the newer, remote step 1 on every rank: rank 0's node finds its copy stale and
    rank 1's does not, so they must agree to read the remote copy alone, or their
    collective load refuses; nor may rank 0's node upload its stale copy."""
    remote, local = root / "nls-remote", root / f"nls-local-{rank}"
    loads: list[str] = []

    def on_event(event: sp.Event) -> None:
        if event.kind == "load":
            loads.append(event.url)

    def manager() -> Any:
        return sp.CheckpointManager(str(remote), local_dir=str(local), async_save=False,
                                    on_event=on_event)

    with manager() as mgr:
        mgr.save(1, node_state(1, rank))
    if rank == 0:
        shutil.copytree(local / "step-1", root / "nls-first")
    time.sleep(0.01)  # commit times are to the millisecond
    dist.barrier()
    with manager() as mgr:
        mgr.save(1, resaved_state(rank))
    if rank == 0:
        shutil.rmtree(local / "step-1")
        shutil.copytree(root / "nls-first", local / "step-1")
    dist.barrier()
    try:
        with manager() as mgr:
            back = node_state(0, rank)
            result["nls_restored"] = [mgr.restore(back), which_save(back, rank)]
    except sp.SafepointError as exc:  # the parent's test fails on it, not the whole group
        result["nls_error"] = f"{type(exc).__name__}: {exc}"
    result["nls_loads"] = loads


def saved_anew_elsewhere(rank: int, manager: Callable[[str], Any]) -> Any:
    """Save step 1 on the "first" hosts, then anew on the "other" ones; the other hosts'
    manager, still open, is returned for more saves there (close it)."""
    with manager("first") as mgr:
        mgr.save(1, node_state(1, rank))
    time.sleep(0.01)  # commit times are to the millisecond
    dist.barrier()
    mgr = manager("other")
    mgr.save(1, resaved_state(rank))
    return mgr


def node_local_stale_copies(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Two nodes save step 1 and upload it; the job then runs on other hosts and saves step
    1 anew there. Back on the first hosts, whose local_dirs hold the first save, a manager
    opened there must not upload it over the newer remote step 1: the parent checks that
    the remote step is still the second save, whole."""
    remote = root / "nlo-remote"

    def manager(host: str) -> Any:
        return sp.CheckpointManager(str(remote), local_dir=str(root / f"nlo-{host}-{rank}"),
                                    async_save=False)

    saved_anew_elsewhere(rank, manager).close()
    try:
        with manager("first") as mgr:  # queues the local step 1, as left by a dead run
            mgr.wait()
            result["nlo_steps"] = mgr.steps()
    except sp.SafepointError as exc:  # the parent's test fails on it, not the whole group
        result["nlo_error"] = f"{type(exc).__name__}: {exc}"


def node_local_stale_copies_removed(rank: int, root: Path, result: dict[str, Any]) -> None:
    """As `node_local_stale_copies`, with keep_local=2: the first hosts' copies of step 1
    are stale once the job saved it anew elsewhere, so a manager reopened there removes them
    from every node's local_dir (they stayed forever) and keeps its step 2, whose save
    the remote root holds."""
    remote = root / "nlr-remote"

    def manager(host: str) -> Any:
        return sp.CheckpointManager(str(remote), local_dir=str(root / f"nlr-{host}-{rank}"),
                                    keep_local=2, async_save=False)

    with saved_anew_elsewhere(rank, manager) as mgr:
        mgr.save(2, node_state(2, rank))
    shutil.copytree(root / f"nlr-other-{rank}" / "step-2", root / f"nlr-first-{rank}" / "step-2")
    dist.barrier()
    with manager("first") as mgr:
        mgr.wait()
        kept = sorted(p.parent.name for p in (root / f"nlr-first-{rank}").glob(
            "step-*/manifest.json"))
    with sp.CheckpointManager(str(remote)) as reader:
        back = node_state(0, rank)
        reader.restore(back, 1)
    result["nlr"] = [kept, which_save(back, rank)]
    assert result["nlr"] == [["step-2"], "second"], f"rank {rank}: {result['nlr']}"


#: Set by `gated://` once a write of step 1's data begins; every data write waits for GATE.
STARTED, GATE = threading.Event(), threading.Event()


def register_gated() -> None:
    """gated://PATH: the directory PATH, whose data writes wait until `GATE` is set (a remote
    root slower than the saves)."""

    def factory(url: str, options: dict[str, Any] | None = None) -> Any:
        def held(op: str, path: str, count: int) -> bool:
            if op == "write" and path.startswith("data/"):
                if url.rstrip("/").endswith("step-1"):
                    STARTED.set()
                GATE.wait(30)
            return False

        return FaultyStorage(open_storage(url.removeprefix("gated://"), options), held)

    register("gated", factory)


def node_local_superseded(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Two nodes, keep_last=1, a remote root whose writes are held while steps 2-4 commit
    behind step 1's upload: rank 0 publishes steps 1 and 4 and skips 2 and 3 (the policy
    would delete them at once); rank 1's node learns that at the next `wait` (it may have
    sent its files of 2 and 3 meanwhile, and removes them from the remote root then), and
    both nodes remove 2 and 3 from their local_dir. Each rank checks what it sees."""
    remote, local = root / "nlsup-remote", root / f"nlsup-local-{rank}"
    uploads: list[int | None] = []

    def on_event(event: sp.Event) -> None:
        if event.kind == "upload":
            uploads.append(event.step)

    with sp.CheckpointManager(f"gated://{remote}", local_dir=str(local), keep_last=1,
                              keep_local=1, async_save=False, on_event=on_event) as mgr:
        mgr.save(1, node_state(1, rank))
        if rank == 0:
            assert STARTED.wait(30), "step 1's upload never began"
        for step in (2, 3, 4):
            mgr.save(step, node_state(step, rank))
        GATE.set()
        mgr.wait()
        mgr.wait()  # rank 1's node removes what it sent of the steps skipped
        dist.barrier()
        local_steps = sorted(p.parent.name for p in local.glob("step-*/manifest.json"))
        left = sorted(str(p.relative_to(remote)) for step in (2, 3)
                      for p in (remote / f"step-{step}").rglob("*") if p.is_file())
        result["nlsup"] = [mgr.remote.steps(), local_steps, left, uploads]
        assert result["nlsup"] == [[4], ["step-4"], [], [1, 4] if rank == 0 else []], \
            f"rank {rank}: {result['nlsup']}"
    with sp.CheckpointManager(str(remote), keep_last=1) as reader:
        assert restore_node_state(reader, rank) == 4


def run_totals_differ(rank: int, root: Path, result: dict[str, Any]) -> None:
    """An `sp.Run` resumed from its step 2 whose ranks' `run.range()` totals differ (5 on
    rank 0, 7 on rank 1): every rank raises at once, before training a step, and step 2
    stays the last committed. On a group of its own with a short timeout, which ranks that
    part there wait out."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
    url = str(root / "totals")
    state = {"w": sp.Shard(torch.full((4,), float(rank)), (rank * 4,), (8,)), "done": 0}
    with sp.Run(url, state, every_steps=2, process_group=group) as run:
        for step in run.range(2):
            state["done"] = step + 1
    started = time.monotonic()
    try:
        with sp.Run(url, state, every_steps=2, process_group=group) as run:
            for step in run.range(5 if rank == 0 else 7):
                state["done"] = step + 1
    except sp.SafepointError as exc:
        failing = sorted(exc.failures) if isinstance(exc, sp.DistributedError) else None
        result["totals"] = [type(exc).__name__, str(exc), failing]
    result["totals_seconds"] = time.monotonic() - started
    result["totals_done"] = state["done"]
    dist.barrier()  # on the default group: the ranks meet again, also after parting above


#: Each case of `run_break_on_some_ranks`: the ranks that break out of step 3 of a range of
#: 10, and the total of a second range that follows in the same run (None: none).
BREAKS: dict[str, tuple[tuple[int, ...], int | None]] = {
    "break-one": ((1,), None), "break-one-then-range": ((1,), 6), "break-all": ((0, 1), None),
}


def run_break_on_some_ranks(rank: int, root: Path, result: dict[str, Any]) -> None:
    """An `sp.Run` (every_steps=2) left with `break` in step 3 on rank 1 alone (a rank-local
    condition: a NaN in its own loss), on rank 1 and then a second range on both, and on
    every rank; then each is resumed with a range of 8. The ranks record the steps they
    trained, where the run ended, how long it took, and what the resumed run restored and
    trained (or the error). On groups of their own with a short timeout, which ranks that
    part there wait out (rank 1 in its final save, rank 0 at the next step's all-reduce)."""
    for case, (breaking, then) in BREAKS.items():
        url = str(root / case)
        piece = torch.zeros(4)
        taken: list[int] = []
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
        started = time.monotonic()
        try:
            with sp.Run(url, {"w": sp.Shard(piece, (rank * 4,), (8,))}, every_steps=2,
                        keep_last=None, process_group=group) as run:
                for step in run.range(10):
                    piece.add_(1)
                    taken.append(step)
                    if rank in breaking and step == 3:
                        break
                if then is not None:
                    for step in run.range(then):
                        piece.add_(1)
                        taken.append(step)
            ended: Any = [run.step, run.complete]
        except sp.SafepointError as exc:
            ended = f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - started
        piece = torch.zeros(4)
        resumed: list[int] = []
        try:
            with sp.Run(url, {"w": sp.Shard(piece, (rank * 4,), (8,))}, every_steps=2,
                        keep_last=None,
                        process_group=dist.new_group(backend="gloo",
                                                     timeout=timedelta(seconds=10))) as run:
                restored: Any = [run.restored_step, piece.tolist()]
                for step in run.range(8):
                    piece.add_(1)
                    resumed.append(step)
            restored += [resumed, piece.tolist()]
        except sp.SafepointError as exc:
            restored = f"{type(exc).__name__}: {exc}"
        result[case] = {"taken": taken, "ended": ended, "seconds": seconds,
                        "resumed": restored}
        dist.barrier()  # on the default group: the ranks meet again, also after parting above


def restore_keys_by_rank(rank: int, root: Path, result: dict[str, Any]) -> None:
    """Incremental managers, of one tier and of two, restarted on their step 1: rank 0
    restores the whole state, rank 1 some keys only. Every rank restores what it asked for
    and goes on in step: it saves step 2, which shares nothing with step 1 (rank 1 did not
    read and check all of its pieces), and restores it whole. Last in `main`: ranks left out
    of step stop at their first error."""
    for name, tiers in (("keys", {}), ("keys-tiers", {"local_dir": str(root / "keys-local")})):
        url = str(root / name)
        options: dict[str, Any] = {"incremental": True, "async_save": False, "keep_last": None,
                                   **tiers}
        try:
            with sp.CheckpointManager(url, **options) as mgr:
                mgr.save(1, node_state(1, rank))
            with sp.CheckpointManager(url, **options) as mgr:
                some = restore_node_state(mgr, rank,
                                          keys=None if rank == 0 else ["w", "pos", "step"])
                mgr.save(2, node_state(2, rank))
                result[name] = [some, restore_node_state(mgr, rank), mgr.steps()]
        except sp.SafepointError as exc:
            result[name] = f"{type(exc).__name__}: {exc}"
            return


def main() -> None:
    rank, port, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    result: dict[str, Any] = {}
    register_faulty(rank)
    register_sees_all(rank)
    register_gated()
    try:
        staged_saves(rank, root, result)
        two_tiers(rank, root, result)
        tiers_on_s3(rank, root, result)
        node_local_tiers(rank, root, result)
        node_local_upload_failure(rank, root, result)
        node_local_on_s3(rank, root, result)
        run_with_a_failed_save(rank, root, result)
        incremental_saves(rank, root, result)
        node_local_stale_copy(rank, root, result)
        node_local_stale_copies(rank, root, result)
        node_local_stale_copies_removed(rank, root, result)
        node_local_superseded(rank, root, result)
        run_totals_differ(rank, root, result)
        run_break_on_some_ranks(rank, root, result)
        restore_keys_by_rank(rank, root, result)
    finally:
        (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
