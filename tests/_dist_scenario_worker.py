"""One rank of a small gloo group on 127.0.0.1 running one scenario of tests/test_dist.py
that needs a world size or a group timeout of its own (`SCENARIOS`):

    python tests/_dist_scenario_worker.py RANK PORT DIR SCENARIO

Each call's outcome goes to DIR/result-RANK.json; the parent checks what the ranks left.
"""

from __future__ import annotations

import enum
import json
import logging
import logging.handlers
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import safepoint as sp
from conftest import held_collective
from safepoint import _manager as manager_module
from safepoint.storage import open_storage, register
from safepoint.testing import FaultyStorage

#: How long rank 0's publish of a manifest takes in `slow_commit`: longer than the group's
#: timeout (`SCENARIOS`), so that rank 1 stops waiting for the outcome.
SLOW = 5


def outcome(result: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        result[key] = {"ok": True, "value": fn()}
    except Exception as exc:
        result[key] = {"ok": False, "safepoint": isinstance(exc, sp.SafepointError),
                       "error": f"{type(exc).__name__}: {exc}"}


def piece(rank: int, world: int) -> dict[str, Any]:
    return {"s": sp.Shard(torch.full((4,), float(rank)), (4 * rank,), (4 * world,))}


def slow_commit(rank: int, world: int, root: Path, result: dict[str, Any], *,
                fail: bool) -> None:
    """Rank 0's publish of the manifest outlasts the group's timeout (a slow object store,
    an incremental save's server-side copies), then succeeds, or fails with `fail`."""

    def slow(op: str, path: str, n: int) -> bool:
        if rank == 0 and op == "publish" and path == "manifest.json":
            time.sleep(SLOW)
            return fail
        return False

    register("slowpub", lambda url, options=None: FaultyStorage(
        open_storage(url.removeprefix("slowpub://"), options), slow))
    outcome(result, "save", lambda: sp.save(f"slowpub://{root}/ckpt", piece(rank, world)).nbytes)


def values_and_storage(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """A plain value of a class defined in a function; then memory://, which is each
    process's own, as a node-local path is each host's."""

    class Mode(enum.IntEnum):
        TRAIN = 1

    class Loss(float):
        pass

    payload = struct.unpack("<d", bytes.fromhex("0100000000fcff7f"))[0]  # a NaN with a payload
    values = {"mode": Mode.TRAIN, "loss": Loss(payload)}
    outcome(result, "enum", lambda: sp.save(str(root / "enum"), values).nbytes)
    dist.barrier()
    outcome(result, "enum_loaded", lambda: repr(sp.load(str(root / "enum"))["mode"]))
    outcome(result, "nan_loaded",
            lambda: struct.pack("<d", sp.load(str(root / "enum"))["loss"]).hex())
    result["enum_files"] = sorted(open_storage(str(root / "enum")).list(""))
    small = {"w": torch.arange(4.0), "step": 5}  # rank 0 writes the one tensor
    outcome(result, "small", lambda: sp.save(str(root / "small"), small).nbytes)
    dist.barrier()
    outcome(result, "small_loaded", lambda: sp.load(str(root / "small"))["w"].tolist())
    result["small_files"] = sorted(open_storage(str(root / "small")).list(""))
    with sp.CheckpointManager(str(root / "mgr")) as mgr:  # a new step: no tidying after it
        outcome(result, "mgr_small", lambda: mgr.save(1, small).step)
    dist.barrier()
    result["mgr_small_files"] = sorted(open_storage(str(root / "mgr")).list(""))
    order = np.arange(3, dtype=">i4" if rank == 0 else "<i4")  # the same values
    outcome(result, "byte_order", lambda: sp.save(str(root / "order"), {"a": order}).nbytes)
    name = "run-1" if rank == 0 else b"run-1"
    outcome(result, "str_or_bytes", lambda: sp.save(str(root / "name"), {"n": name}).nbytes)
    url = "memory://unshared/ckpt"
    sp.save(url, {"s": torch.full((4,), -1.0)}, dist=False)  # each process's own good one
    outcome(result, "unshared", lambda: sp.save(url, piece(rank, world), overwrite=True).nbytes)
    outcome(result, "unshared_after", lambda: sp.load(url, dist=False)["s"].tolist())
    result["unshared_files"] = sorted(open_storage(url).list(""))
    # States whose data rank 1 writes none of: plain values only, and one small replicated
    # tensor (which the plan gives to rank 0).
    unshared(result, "unshared_values", {"step": 5, "lr": 0.5})
    unshared(result, "unshared_small", {"w": torch.arange(4.0), "step": 5})
    extended_during_an_async_save(root, result)


def extended_during_an_async_save(root: Path, result: dict[str, Any]) -> None:
    """An asynchronous collective save of a bytearray (written by one rank), held back from
    writing, then the bytearray extended on every rank: staged, it is the caller's again."""
    release = threading.Event()
    prepare = manager_module.save_collective
    manager_module.save_collective = held_collective(prepare, release)
    state = {"buf": bytearray(b"abc"), "step": 1}
    try:
        with sp.CheckpointManager(str(root / "async_bytes"), async_save=True) as mgr:
            mgr.save(1, state)
            try:
                outcome(result, "extended", lambda: state["buf"].extend(b"def"))
            finally:
                release.set()
    finally:
        manager_module.save_collective = prepare
    outcome(result, "extended_saved", lambda: sp.load(str(root / "async_bytes" / "step-1"),
                                                      dist=False)["buf"].hex())


def unshared(result: dict[str, Any], key: str, state: dict[str, Any]) -> None:
    """Save `state` from every rank to memory://unshared/KEY, over each process's own good
    checkpoint there; record the outcome, what each process then loads, and its files."""
    url = f"memory://unshared/{key}"
    sp.save(url, {"s": torch.full((4,), -1.0)}, dist=False)
    outcome(result, key, lambda: sp.save(url, state, overwrite=True).nbytes)
    outcome(result, f"{key}_after", lambda: sp.load(url, dist=False)["s"].tolist())
    result[f"{key}_files"] = sorted(open_storage(url).list(""))


def stages_with_their_own_async_managers(rank: int, world: int, root: Path,
                                         result: dict[str, Any]) -> None:
    """Pipeline stages [0, 1] and [2, 3], each saving with a manager of its own, after a group
    of the stage leaders [0, 2] (every rank makes each group, as torch requires): rank 1
    belongs to fewer groups than rank 0."""
    dist.new_group([0, 2])
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage = rank // 2
    with sp.CheckpointManager(str(root / f"stage{stage}"), process_group=stages[stage],
                              async_save=True) as mgr:
        shard = {"s": sp.Shard(torch.full((2,), float(rank)), (2 * (rank % 2),), (4,))}
        outcome(result, "save", lambda: mgr.save(1, shard).step)
        outcome(result, "wait", mgr.wait)
        outcome(result, "steps", mgr.steps)


def markers_left_behind(rank: int, world: int, root: Path, result: dict[str, Any]) -> None:
    """Two nodes (a local_dir per rank) save step 1; rank 0's removal of node 1's marker
    from the remote step, after it published the manifest, fails once. Records the
    steps of the manager's upload and error events, what `wait` raised and the warnings
    logged."""
    failed: list[str] = []

    def fail_once(op: str, path: str, n: int) -> bool:
        if rank == 0 and op == "delete" and path == "node-1.json" and not failed:
            failed.append(path)
            return True
        return False

    register("keepmarkers", lambda url, options=None: FaultyStorage(
        open_storage(url.removeprefix("keepmarkers://"), options), fail_once))
    logged = logging.handlers.BufferingHandler(capacity=1000)  # keeps every record
    logging.getLogger("safepoint").addHandler(logged)
    uploads: list[int | None] = []
    errors: list[list[Any]] = []

    def on_event(event: sp.Event) -> None:
        if event.kind == "upload":
            uploads.append(event.step)
        elif event.kind == "error":
            errors.append([event.step, event.error])

    with sp.CheckpointManager(f"keepmarkers://{root}/remote",
                              local_dir=str(root / f"local-{rank}"), on_event=on_event) as mgr:
        result["nodes"] = mgr.nodes
        mgr.save(1, piece(rank, world))
        outcome(result, "wait", mgr.wait)
        outcome(result, "remote_steps", mgr.remote.steps)
    result["failed"] = failed
    result["uploads"] = uploads
    result["errors"] = errors
    result["warned"] = [record.getMessage() for record in logged.buffer
                        if record.levelno == logging.WARNING]


#: Per scenario: the world size, the group's timeout in seconds, and what each rank runs.
SCENARIOS: dict[str, tuple[int, float, Callable[[int, int, Path, dict[str, Any]], None]]] = {
    "slow_commit": (2, 3, lambda *args: slow_commit(*args, fail=False)),
    "slow_failed_commit": (2, 3, lambda *args: slow_commit(*args, fail=True)),
    "values_and_storage": (2, 30, values_and_storage),
    "stages_with_their_own_async_managers": (4, 20, stages_with_their_own_async_managers),
    "markers_left_behind": (2, 30, markers_left_behind),
}


def main() -> None:
    rank, port, root, scenario = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    world, timeout, run = SCENARIOS[scenario]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    result: dict[str, Any] = {}
    run(rank, world, root, result)
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    # A group whose collective timed out cannot be torn down collectively: exiting frees it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
