"""Collective save and load across real gloo process groups on 127.0.0.1 (one process per rank,
see tests/_dist_worker.py): a sharded state saved from 4 ranks (sp.Shard split unevenly by rows
and by columns, DTensors, an FSDP2 model and optimizer, DDP-style replicated tensors, per-rank
RNG), loaded onto 1 process (no group), 2 and 3 ranks; replicated data written once with the
writing spread; a collective CheckpointManager; an injected storage failure on one rank and a
SIGKILLed rank both abort the save everywhere with nothing committed. Plus the single-process
behaviour of the same API and the torchrun example."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import _dist_worker as worker
import safepoint as sp
from safepoint._dist import Group, exchange
from safepoint._format import MANIFEST

WORKER = Path(__file__).parent / "_dist_worker.py"

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_group(root: Path, world: int = 4, timeout: float = 120, worker: Path = WORKER,
              args: Sequence[str] = ()) -> list[int]:
    """Run one process of `worker` per rank (arguments: rank, port, `root`, `args`); returns
    their exit codes (a rank that fails prints why)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(port), str(root), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONHASHSEED": str(rank)},  # as random as separate hosts
        )
        for rank in range(world)
    ]
    codes = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        codes.append(proc.returncode)
        if proc.returncode not in (0, -signal.SIGKILL):
            print(f"--- rank {rank} ---\n{out.decode(errors='replace')}")
    return codes


def results(root: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((root / f"result-{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The 4-rank group (tests/_dist_worker.py), run once for the module."""
    root = tmp_path_factory.mktemp("dist")
    return root, run_group(root)


def _manifest(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "ckpt" / MANIFEST).read_text())
    return data


def test_four_ranks_save_restore_rng_and_reload(saved: tuple[Path, list[int]]) -> None:
    root, codes = saved
    assert codes[:3] == [0, 0, 0]
    got = results(root, 4)
    assert len({r["save_id"] for r in got}) == 1
    info = sp.info(str(root / "ckpt"))
    assert info.world_size == 4
    assert info.save_id == got[0]["save_id"]
    kinds = {e.path: e.kind for e in info.entries}
    assert kinds["emb"] == kinds["cols"] == kinds["grid"] == "sharded"
    assert kinds["rep"] == "tensor"
    assert kinds["model/0.weight"] == "sharded"
    assert {p.split("/")[1] for p in kinds if p.startswith("rng/")} == {"0", "1", "2", "3"}
    assert sp.verify(str(root / "ckpt")).ok
    # Every rank restored its pieces of a tied tensor from a one-process checkpoint.
    assert [r["tied"] for r in got] == [["tensor", "alias"]] * 4


def test_refusals_reach_every_rank(saved: tuple[Path, list[int]]) -> None:
    root, _ = saved
    for got in results(root, 4):
        assert got["exists"]
        assert ("differs between rank 0 and rank 1 at '<root>' (keys only rank 0 has: []; "
                "only rank 1 has: ['extra'])") in got["tree_differs"]
        assert list(got["bad_leaf"]) == ["3"]
        assert "UnsupportedLeaf: cannot save builtins.object at 'w'" in got["bad_leaf"]["3"]
        assert "'b' is bytes on rank 0 with other bytes than on rank 2" in got["bytes_differ"]
        assert "rank 0 loads" in got["load_differs"] and "rank 3 loads" in got["load_differs"]
        assert "nothing was loaded" in got["load_differs"]
        assert "keys='step'" in got["keys_differ"], got["keys_differ"]
        assert got["keys_differ"].endswith("nothing was loaded on any rank")
        assert list(got["bad_metrics"]) == ["1"] and "metrics" in got["bad_metrics"]["1"]
        assert got["pair_steps"] == [1]
        assert "ZeroRedundancyOptimizer at 'optim'" in got["zero_refused"]
        assert "sp.PerRank(optimizer.optim)" in got["zero_refused"]
    assert not (root / "odd").exists() or not list((root / "odd").rglob("*.bin"))
    assert not list((root / "mgr-metrics").rglob("*.bin"))
    for pair in (0, 1):  # each pair committed its own step, its ranks' values in it
        tree = sp.load(str(root / f"pair{pair}" / "step-1"), dist=False)
        assert tree["x"].tolist() == [float(pair)] * 3
        assert tree["p"] == {0: {"pos": 2 * pair}, 1: {"pos": 2 * pair + 1}}


def test_replicated_data_is_written_once_and_spread(saved: tuple[Path, list[int]]) -> None:
    root, _ = saved
    m = _manifest(root)
    files = [f["name"] for f in m["files"]]
    sizes = {f["name"]: f["nbytes"] for f in m["files"]}
    writer = {name: int(name.split("-r")[1][:5]) for name in files}
    rows = dict(enumerate(m["entries"]["path"]))
    chunks = m["chunks"]
    per_path: dict[str, list[tuple[int, int]]] = {}
    for entry, file, nbytes in zip(chunks["entry"], chunks["file"], chunks["nbytes"],
                                   strict=True):
        per_path.setdefault(rows[entry], []).append((writer[files[file]], nbytes))
    ddp = worker.ddp_state()
    for key, tensor in ddp.items():
        pieces = per_path[f"ddp/{key}"]
        assert sum(n for _, n in pieces) == tensor.nbytes, "written exactly once"
    assert sorted(r for r, _ in per_path["ddp/big"]) == [0, 1, 2, 3], "the big one is split"
    small_writers = {per_path[f"ddp/p{i}"][0][0] for i in range(12)}
    assert len(small_writers) >= 3, "small replicated tensors are spread over the ranks"
    assert len(per_path["rep"]) == 1
    total = sum(sizes.values())
    assert max(sizes.values()) <= total / 4 + (16 << 10), sizes
    # Sharded pieces come from their owners: rank 2 held one row of emb.
    emb = dict(per_path["emb"])
    assert emb[2] == 1 * worker.EMB[1] * 4


def test_load_on_one_process_without_a_group(saved: tuple[Path, list[int]]) -> None:
    root, _ = saved
    out = sp.load(str(root / "ckpt"))
    assert torch.equal(out["emb"], worker.emb_full())
    assert torch.equal(out["cols"], worker.cols_full())
    assert torch.equal(out["grid"], worker.grid_full())
    assert torch.equal(out["rep"], torch.full((3, 4), 2.5))
    for key, tensor in worker.ddp_state().items():
        assert torch.equal(out["ddp"][key], tensor)
    assert sorted(out["rng"]) == [0, 1, 2, 3]
    assert out["step"] == 7
    # A whole tensor target takes the sharded entry too; a piece target reads its part.
    emb = torch.zeros(worker.EMB)
    part = torch.zeros(7, 3, dtype=torch.float64)
    sp.load(str(root / "ckpt"), {"emb": emb, "grid": sp.Shard(part, (0, 6), worker.GRID)},
            keys=["emb", "grid"])
    assert torch.equal(emb, worker.emb_full())
    assert torch.equal(part, worker.grid_full()[:, 6:])


@pytest.mark.parametrize("world", [2, 3])
def test_load_onto_other_world_sizes(saved: tuple[Path, list[int]], world: int) -> None:
    root, _ = saved
    got = results(root, 4)
    for rank in range(world):
        loaded = got[rank][f"load{world}"]
        assert loaded["ok"]
        assert f"saved by 4 rank(s) and is restored on {world}" in loaded["per_rank_error"]
    assert all(f"load{world}" not in got[rank] for rank in range(world, 4))


def test_per_rank_values_restored_on_another_world_size_are_named_once(
    saved: tuple[Path, list[int]],
) -> None:
    """A pair's step (saved by 2 ranks) restored by one process: the per-rank value is in
    the checkpoint and in the target, and the error named it twice (['p/0/pos', 'p/0/pos'])."""
    root, _ = saved
    with pytest.raises(sp.StateMismatch) as caught:
        sp.load(str(root / "pair0" / "step-1"), {"x": torch.zeros(3), "p": sp.PerRank({"pos": 0})})
    assert "its per-rank values (['p/0/pos']) belong to ranks" in str(caught.value)
    assert caught.value.mismatched == ["p/0/pos"]


def test_collective_manager(saved: tuple[Path, list[int]]) -> None:
    root, _ = saved
    for got in results(root, 4):
        assert got["mgr_steps"] == [2, 3]
        assert got["mgr_latest"] == 3
        assert got["mgr_restored"] == 3
    steps = sorted(p.name for p in (root / "mgr").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-2", "step-3"], "retention ran once, on rank 0"
    assert sp.info(str(root / "mgr" / "step-3")).world_size == 4


def test_a_signal_on_one_rank_preempts_every_rank_at_the_same_step(
    saved: tuple[Path, list[int]],
) -> None:
    root, _ = saved
    assert [got["preempted"] for got in results(root, 4)] == [[4, 75]] * 4
    steps = sorted(p.name for p in (root / "run").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-4"]
    assert sp.load(str(root / "run" / "step-4"), keys=["done"])["done"] == 4
    # A finished run with keep_final_only: rank 0 alone deleted the earlier steps.
    assert sorted(p.name for p in (root / "final").iterdir() if p.name.startswith("step-")) == [
        "step-4"]


def test_a_two_tier_run_uploads_every_rank_s_pieces_and_resumes(
    saved: tuple[Path, list[int]],
) -> None:
    """sp.Run with local_dir in a group: the first run dies during step 4 with step 2
    committed, the second resumes at 2 and finishes at 6; both tiers hold steps that load
    whole, the local one only the newest (keep_local=1)."""
    root, _ = saved
    for got in results(root, 4):
        assert (got["tiered_start0"], got["tiered_done0"]) == (0, 3)
        assert (got["tiered_start1"], got["tiered_done1"]) == (2, 6)
    remote = sorted(p.name for p in (root / "remote").iterdir() if p.name.startswith("step-"))
    assert remote == ["step-2", "step-4", "step-6"]
    local = sorted(p.name for p in (root / "nvme").iterdir() if p.name.startswith("step-"))
    assert local == ["step-6"]
    for where in ("remote", "nvme"):
        url = str(root / where / "step-6")
        assert sp.verify(url).ok
        loaded = sp.load(url, keys=["emb", "done"])
        assert loaded["done"] == 6
        assert torch.equal(loaded["emb"], worker.emb_full() + 6)


def test_a_dtensor_whose_rank_holds_no_single_block_is_refused(
    saved: tuple[Path, list[int]],
) -> None:
    """(Shard(0), _StridedShard(0)) gives each rank every other row: the save and a load into
    it are refused on every rank, naming the DTensor, with nothing changed (the load used to
    fill it wrongly); (_StridedShard(0), Shard(0)), FSDP2 over tensor parallel, round-trips."""
    root, _ = saved
    for got in results(root, 4):
        save, load, unchanged = got["strided_bad"]
        for message in (save, load):
            assert "DTensor at " in message and "not one block" in message, message
            assert "sp.Shard" not in message
        assert unchanged is True
        assert got["strided_good"] == ["ok", "ok", True]
    assert not (root / "strided-bad" / "manifest.json").exists()


def test_a_plain_value_that_differs_between_ranks_is_refused(
    saved: tuple[Path, list[int]],
) -> None:
    """A plain value is saved once (rank 0's): one that differs per rank (a data position
    not wrapped in sp.PerRank) is refused on every rank, naming it and both values. Floats
    are compared by their bits (NaN is NaN, but -0.0 on one rank was taken for 0.0)."""
    root, _ = saved
    for got in results(root, 4):
        assert "'pos' is 0 on rank 0 but 10 on rank 1" in got["differing_value"]
        assert "sp.PerRank" in got["differing_value"]
        assert "'bias' is 0.0 on rank 0 but -0.0 on rank 3" in got["signed_zero"]
    assert not (root / "zeros" / "manifest.json").exists()
    loaded = sp.load(str(root / "values"))
    assert loaded["pos"] == 10 and loaded["loss"] != loaded["loss"]


def test_node_local_tiers_with_two_hosts_of_two_ranks(saved: tuple[Path, list[int]]) -> None:
    """Two nodes of two ranks (ranks 0-1 and 2-3 each share a local_dir): node leaders are
    ranks 0 and 2; each node's local_dir holds its own ranks' data files and the manifest,
    the remote root all four; a restart restores from each node's local bytes, and once node
    1's disk is wiped, its ranks restore from the remote root."""
    root, _ = saved
    for rank, got in enumerate(results(root, 4)):
        assert got["nodes"] == [[0, 1], [2, 3]]
        assert got["nodes_steps"] == [1, 2]
        local = str(root / f"nodes-local-{rank // 2}" / "step-2")
        assert got["nodes_local"] == [2, True, True, rank, [local]]
        wiped_url = local if rank < 2 else str(root / "nodes-remote" / "step-2")
        assert got["nodes_wiped"] == [2, True, True, rank, [wiped_url]]
    remote = root / "nodes-remote" / "step-2"
    assert sp.verify(str(remote)).ok
    node_0 = {p.name for p in (root / "nodes-local-0" / "step-2" / "data").iterdir()}
    assert node_0 < {p.name for p in (remote / "data").iterdir()}
    assert sorted(name.split("-r")[1][:5] for name in node_0) == ["00000", "00001"]
    loaded = sp.load(str(remote), keys=["emb"])
    assert torch.equal(loaded["emb"], worker.emb_full() + 2)


def test_ranks_naming_different_checkpoints_are_refused_with_nothing_written(
    saved: tuple[Path, list[int]],
) -> None:
    """A collective save whose ranks pass different URLs (or manager steps) wrote each rank's
    file beside its own URL, and rank 0 committed a manifest naming files that were not
    there: a committed checkpoint that never loads. It is refused on every rank, naming the
    first rank that differs."""
    root, _ = saved
    for got in results(root, 4):
        assert got["drifted_url"].startswith(
            f"rank 0 saves {root / 'drift-0'} but rank 2 saves {root / 'drift-1'}")
        assert f"rank 0 saves {root / 'drift' / 'step-100'} but rank 1 saves " \
            f"{root / 'drift' / 'step-101'}" in got["drifted_step"]
        assert got["drifted_steps"] == []
    assert not (root / "drift-0").exists() and not (root / "drift-1").exists()
    assert sorted(p.name for p in (root / "drift").iterdir()) == ["lease"]


def test_a_fresh_fsdp2_optimizer_is_primed_only_for_the_saved_parameters(
    saved: tuple[Path, list[int]],
) -> None:
    """A parameter that never had a gradient has no Adam state in the checkpoint: the fresh
    optimizer restores strictly with state for the others only, and its parameters keep
    their gradients (priming gave every parameter state, so the match failed)."""
    root, _ = saved
    for got in results(root, 4):
        assert got["partly"] == [[0, 1], [0, 1], True, True]


def test_a_fresh_fsdp2_optimizer_left_out_of_a_load_stays_fresh(
    saved: tuple[Path, list[int]],
) -> None:
    """A fresh optimizer is primed only for what the load restores: loading the weights alone
    (keys=["model/"]) leaves it without state (it got a step-1 state, so its next step used
    step 2's bias correction), and so does a load refused because of another rank's target
    (priming was undone only when this rank's own planning failed)."""
    root, _ = saved
    for got in results(root, 4):
        assert got["weights_only"] == 0
        assert got["refused_elsewhere"] == [True, 0]


def test_an_optimizer_with_state_for_some_fsdp2_parameters_restores_them_all_as_dtensors(
    saved: tuple[Path, list[int]],
) -> None:
    """An Adam over FSDP2 parameters with state for some of them only (an expert no batch
    reached yet) restored the others' state as whole plain tensors, and its next step failed
    with torch's 'mixed torch.Tensor and DTensor': priming took only optimizers with no state
    at all. Now the step after the restore matches the uninterrupted run bit for bit, and a
    refused load leaves the live state as it was."""
    root, _ = saved
    for got in results(root, 4):
        (status, body), expected = got["partial_state"]
        assert status == "ok", body
        assert body == expected
        assert got["partial_refused"] == [True, True]


def test_a_lenient_load_into_fsdp2_with_a_resized_head_skips_its_optimizer_state_whole(
    saved: tuple[Path, list[int]],
) -> None:
    """The head's saved Adam state has its old shape: its moments were skipped but its step
    kept, and the next optimizer.step() raised a raw KeyError('exp_avg'). The whole state of
    a resized DTensor parameter is now skipped, as a plain parameter's is, on every rank
    (ranks 2 and 3 hold no rows of the head)."""
    root, _ = saved
    for got in results(root, 4):
        status, body = got["resized_head"]
        assert status == "ok", body
        assert all(keys in ([], ["exp_avg", "exp_avg_sq", "step"]) for keys in body), body


def test_a_lenient_load_into_fsdp2_with_a_resized_head_leaves_it_as_a_fresh_optimizer_would(
    saved: tuple[Path, list[int]],
) -> None:
    """Selecting the optimizer's per-parameter state (keys=), which loads into the live
    state, left the head's skipped state as the state primed to load into (step 1, zero
    moments), so its next step took step 2's bias correction and differed from a first
    step. Now the head has no state on any rank, its next step equals a fresh Adam's, and
    the layer whose state was saved keeps it; so too when the whole state is replaced."""
    root, _ = saved
    for got in results(root, 4):
        for status, body in got["resized_head_step"]:
            assert status == "ok", body
            states, equal = body
            assert states == [["exp_avg", "exp_avg_sq", "step"]] * 2 + [[], []]
            assert equal == [True, True]


def test_a_dtensor_on_a_mesh_of_some_ranks_saves_and_loads(
    saved: tuple[Path, list[int]],
) -> None:
    """A DTensor whose mesh holds ranks 0 and 1 only: ranks 2 and 3 hold nothing of it, and
    refused its empty piece ('shape [0] at offsets []') as not fitting its global shape."""
    root, _ = saved
    rows = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3).tolist()
    for got in results(root, 4):
        saved_whole, loaded, local = got["submesh"]
        assert saved_whole == ["ok", rows]
        assert loaded == ["ok", local]


def test_a_0_dim_dtensor_on_a_mesh_of_some_ranks_saves_and_loads(
    saved: tuple[Path, list[int]],
) -> None:
    """Ranks 2 and 3, outside its mesh, hold no piece of it (a 0-dim tensor has no empty
    piece), take part in the save and the load, and are left as they were; they refused
    torch's local tensor of shape [0] as not fitting shape []."""
    root, _ = saved
    for rank, got in enumerate(results(root, 4)):
        assert got["submesh_scalar"] == ["ok", [2.5, 2.5 if rank < 2 else []]]


def test_a_dtensor_saved_over_a_group_short_of_its_mesh_names_the_mesh(
    saved: tuple[Path, list[int]],
) -> None:
    """Refused, as it leaves part of the DTensor out; the message said to fix the offsets
    passed to sp.Shard, which the user never passed."""
    root, _ = saved
    status, message = results(root, 4)[0]["mesh_not_tiled"]
    assert status == "error" and "'t'" in message and "do not tile it" in message, message
    assert "sp.Shard" not in message and "process_group" in message and "mesh" in message
    assert not (root / "alone" / MANIFEST).exists()


def test_an_equal_pickled_value_is_saved_once_though_its_bytes_differ(
    saved: tuple[Path, list[int]],
) -> None:
    """Equal sets pickle to other bytes under other string-hash seeds (one per rank here, as
    on separate hosts): compared unpickled, they are one value (they were refused as
    differing); values that do differ are still refused."""
    root, _ = saved
    got = results(root, 4)
    assert len({g["pickled_bytes"] for g in got}) > 1  # the bytes do differ
    expected = {"names": {"alpha", "beta", "gamma", "delta", "eps"}, "lr": 0.1}
    assert sp.load(str(root / "pickled"), allow_pickle=True)["hp"] == expected
    for g in got:
        assert "'hp' is pickle on rank 0 with other bytes than on rank 2" in g["pickled_differs"]
    assert not (root / "pickled-differs" / MANIFEST).exists()


def test_a_failing_rank_aborts_the_save_everywhere(saved: tuple[Path, list[int]]) -> None:
    root, _ = saved
    got = results(root, 4)
    for rank in range(3):
        assert "rank 2: StorageError" in got[rank]["failure"]
        assert list(got[rank]["failures"]) == ["2"]
    # Nothing of the failed save remains: besides the committed checkpoint's files, only those
    # of the save during which rank 3 was killed, by the ranks that could not learn whether
    # rank 0 committed it (rank 0, which would have, removed its own).
    listed = {f["name"] for f in _manifest(root)["files"]}
    on_disk = {f"data/{p.name}" for p in (root / "ckpt" / "data").iterdir()}
    leftovers = on_disk - listed
    assert len({name.split("-")[0] for name in leftovers}) == 1, leftovers
    assert "-r00003-" in " ".join(leftovers) and "-r00000-" not in " ".join(leftovers)


def test_a_killed_rank_leaves_the_previous_checkpoint(saved: tuple[Path, list[int]]) -> None:
    root, codes = saved
    assert codes[3] == -signal.SIGKILL
    got = results(root, 4)
    for rank in range(3):
        assert got[rank]["kill"], rank
    assert sp.info(str(root / "ckpt")).save_id == got[0]["save_id"]
    assert sp.verify(str(root / "ckpt")).ok


def test_single_process_pieces_and_errors(tmp_path: Path) -> None:
    url = str(tmp_path / "one")
    table = torch.arange(12.0).reshape(3, 4)
    sp.save(url, {"t": sp.Shard(table, (0, 0), (3, 4)), "r": sp.PerRank({"pos": 3})})
    assert [e.kind for e in sp.info(url).entries] == ["tensor", "value"]
    assert sp.load(url)["r"] == {0: {"pos": 3}}
    state = {"t": sp.Shard(torch.zeros(2, 4), (1, 0), (3, 4)), "r": sp.PerRank({"pos": 0})}
    sp.load(url, state)
    assert torch.equal(state["t"].tensor, table[1:])
    assert state["r"].value == {"pos": 3}
    with pytest.raises(sp.UnsupportedLeaf, match="do not tile it"):
        sp.save(str(tmp_path / "bad"), {"t": sp.Shard(table, (0, 0), (6, 4))})
    with pytest.raises(sp.UnsupportedLeaf, match="does not fit its global shape"):
        sp.save(str(tmp_path / "bad"), {"t": sp.Shard(table, (1, 0), (3, 4))})
    with pytest.raises(sp.SafepointError, match="init_process_group"):
        sp.save(str(tmp_path / "bad"), {"x": 1}, dist=True)


class _OthersDied(Group):
    """Rank 0 of a group whose other ranks die once it has gathered their results (fault
    injection: its broadcast fails as gloo's does when a peer is gone)."""

    def __init__(self) -> None:
        super().__init__(solo=True)
        self.solo, self.size = False, 2

    def gather(self, obj: Any) -> list[Any]:
        return [obj, obj]

    def broadcast(self, obj: Any) -> Any:
        raise sp.DistributedError("a collective call among 2 ranks failed on rank 0 "
                                  "(RuntimeError: Connection reset by peer)",
                                  failures={0: "RuntimeError: Connection reset by peer"})


def test_a_rank_dying_after_rank_0_committed_is_reported_as_committed() -> None:
    """A rank killed after rank 0 committed a save (while rank 0 tells the ranks so) made
    rank 0 raise "nothing was committed", though the checkpoint was there; it now says so. A
    rank that dies before the decision, or during an exchange that only plans or loads,
    claims nothing."""
    decided: list[Any] = []
    with pytest.raises(sp.DistributedError, match="rank 0 finished") as caught:
        exchange(_OthersDied(), lambda: 1, decided.append, what="saving x", consequence="-",
                 done="x is committed")
    assert decided == [[1, 1]] and str(caught.value).endswith("; x is committed")
    assert caught.value.failures == {0: "RuntimeError: Connection reset by peer"}

    def failing() -> None:
        raise OSError("disk full")

    # Nothing decided (a rank failed first), or nothing that stays done (planning, loading).
    for local, done in ((failing, "x is committed"), (lambda: 1, None)):
        with pytest.raises(sp.DistributedError) as caught:
            exchange(_OthersDied(), local, decided.append, what="saving x", consequence="-",
                     done=done)
        assert "finished" not in str(caught.value) and "committed" not in str(caught.value)


def test_example_under_torchrun(tmp_path: Path) -> None:
    """examples/train_distributed.py on 2 ranks: saves, then reloads (fresh FSDP2 model and
    optimizer) onto a group of 1 and checks the model."""
    example = Path(__file__).parents[1] / "examples" / "train_distributed.py"
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()),
         str(example), str(tmp_path), "--steps", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 4: loss" in done.stdout
    assert "reloaded step-000004 onto 1 of 2 ranks: step 4, model matches" in done.stdout
    assert sp.info(str(tmp_path / "step-000004")).world_size == 2


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Two ranks that disagree, call after call (tests/_dist_disagree_worker.py)."""
    root = tmp_path_factory.mktemp("disagree")
    assert run_group(root, world=2, worker=Path(__file__).parent / "_dist_disagree_worker.py",
                     timeout=240) == [0, 0]
    return root, results(root, 2)


@pytest.mark.parametrize("call", [
    "make a manager with a bad option on one rank",
    "make a two-tier manager with a bad option on one rank",
    "restore a bad step on one rank",
    "restore the latest on one rank, a step on the other",
    "load with keys a str on one rank",
    "save to an unknown scheme on one rank",
    "make a manager with async_save on one rank",
    "make a manager with incremental on one rank",
    "make a manager with local_dir on one rank",
    "make a manager of another root on each rank",
    "list on one rank, collect garbage on the other",
])
def test_ranks_that_disagree_fail_on_every_rank_at_once(
    disagreeing: tuple[Path, list[dict[str, Any]]], call: str
) -> None:
    """Checked on one rank alone, a bad or differing argument raised there while the other
    rank waited in the call's first collective until the group's timeout (or met another
    call's exchange: a bare TypeError); managers differing in async_save met a raw
    DistStoreError, in incremental a KeyError; managers of different roots restored rank
    0's latest step (none, when its root was empty) without a word."""
    _, ranks = disagreeing
    for rank, got in enumerate(ranks):
        outcome = got["outcomes"][call]
        assert not outcome["ok"] and outcome["safepoint"], (rank, outcome)
        assert outcome["seconds"] < 5, (rank, outcome)  # the group's timeout is 20 s
    if "incremental" in call or "async_save" in call:
        assert "(async_save, incremental, fallback)" in ranks[0]["outcomes"][call]["error"]
    if "local_dir" in call or "garbage" in call:  # the ranks met in different exchanges
        assert all("the ranks are out of step" in got["outcomes"][call]["error"]
                   for got in ranks)
    if "another root" in call:  # a restore followed rank 0's listing: nothing, silently
        assert all("managers name different roots" in got["outcomes"][call]["error"]
                   for got in ranks)
    if "a step on the other" in call:  # as ranks naming different URLs to save
        assert all(got["outcomes"][call]["error"].startswith("DistributedError")
                   for got in ranks)


def test_a_manager_of_one_root_spelled_two_ways_is_one_root(
    disagreeing: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Roots are compared as the places they name: a file:// URL with a trailing slash on
    one rank and a plain path on the other name the same root."""
    _, ranks = disagreeing
    for got in ranks:
        assert got["outcomes"]["make a manager of one root spelled two ways"]["ok"], got


def test_a_call_over_a_group_without_this_rank_says_so(
    disagreeing: tuple[Path, list[dict[str, Any]]],
) -> None:
    """dist.new_group([0]) gives rank 1 a handle to a group it is not in: a save over it
    died there with a bare AssertionError (torch's collectives do nothing for a non-member)."""
    _, ranks = disagreeing
    assert ranks[0]["outcomes"]["save over a group without this rank"]["ok"]
    outcome = ranks[1]["outcomes"]["save over a group without this rank"]
    assert not outcome["ok"] and outcome["safepoint"], outcome
    assert "does not include this process" in outcome["error"]


def test_a_failed_save_read_on_one_rank_fails_the_next_save_on_every_rank(
    disagreeing: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The usual `if rank == 0: handle.result()` told rank 0's manager of the failure; rank
    1's raised it again from the next save, alone, while rank 0 went into that save's
    collective and waited out the group's timeout."""
    _, ranks = disagreeing
    assert not ranks[0]["outcomes"]["the failed save, read on rank 0"]["ok"]
    for rank, got in enumerate(ranks):
        outcome = got["outcomes"]["the next save after a failure read on rank 0 only"]
        assert not outcome["ok"] and outcome["safepoint"], (rank, outcome)
        assert "injected" in outcome["error"] and outcome["seconds"] < 5, (rank, outcome)
    assert all(got["untouched"] for got in ranks)
    assert ranks[0]["committed"] == ["alone", "ckpt", "local/step-2", "local/step-3",
                                     "mgr/step-2", "mgr/step-3", "remote/step-2",
                                     "remote/step-3"]


@pytest.mark.parametrize("call", [
    "wait after a failure read on rank 0 only",
    "restore after a failure read on rank 0 only",
    "a save refused on rank 0 after a failure read on rank 0 only",
    "two tiers: restore after a failure read on rank 0 only",
    "two tiers: restore the latest on one rank, a step on the other",
])
def test_a_failure_read_on_one_rank_is_raised_on_every_rank_by_the_next_call(
    disagreeing: tuple[Path, list[dict[str, Any]]], call: str
) -> None:
    """wait returned on the rank that had read the failure while the other raised; restore
    (and the two-tier manager's) raised on one rank while the other waited out the timeout;
    a next save refused on rank 0 for its own reason dropped rank 1's failure for good."""
    _, ranks = disagreeing
    for rank, got in enumerate(ranks):
        outcome = got["outcomes"][call]
        assert not outcome["ok"] and outcome["safepoint"], (rank, outcome)
        assert outcome["seconds"] < 5, (rank, outcome)
    if call.startswith("a save refused"):
        assert "injected" in ranks[1]["outcomes"][call]["error"]
        assert all(got["outcomes"]["wait after that"]["ok"] for got in ranks)


def test_a_collective_save_out_of_space_removes_a_killed_saves_leftovers(
    disagreeing: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, ranks = disagreeing
    for got in ranks:
        outcome = got["outcomes"]["a save out of space on one rank"]
        assert not outcome["ok"] and "killed save's leftovers" in outcome["error"], outcome
    assert not ranks[0]["leftover"]


def test_ranks_with_safepoint_installed_at_other_paths_save_together_keeping_strides(
    tmp_path: Path,
) -> None:
    """Nodes with their own installs of the same safepoint (a per-node venv) were taken for
    ranks out of step, since the exchanges compared the calling files' paths; a collective
    save (every save of a DDP job) dropped the strides of a channels_last tensor, which a
    single process keeps; so did one large enough to be cut into slabs written by both
    ranks (rows in row-major order), and a fused Adam restored into a fresh optimizer then
    stepped its state laid out unlike its parameter: such a tensor is written whole."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(Path(sp.__file__).parent, copy / "safepoint",
                    ignore=shutil.ignore_patterns("__pycache__"))
    port = _free_port()
    paths = [os.pathsep.join(sys.path), os.pathsep.join([str(copy), *sys.path])]
    procs = [subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_dist_pair_worker.py"), str(rank),
         str(port), str(tmp_path)], env={**os.environ, "PYTHONPATH": paths[rank]})
        for rank in range(2)]
    assert [proc.wait(timeout=120) for proc in procs] == [0, 0]
    ranks = results(tmp_path, 2)
    assert ranks[0]["file"] != ranks[1]["file"]
    for got in ranks:
        assert got["ok"] and got["equal"], got
        assert got["strides"][0] == got["strides"][1] == [60, 1, 15, 3], got
        assert got["big_equal"], got
        assert got["big_strides"][0] == got["big_strides"][1] == [8320, 1, 2080, 520], got


# -- scenarios with a world size or a group timeout of their own (tests/_dist_scenario_worker.py)


SCENARIO_WORKER = Path(__file__).parent / "_dist_scenario_worker.py"


def run_scenario(root: Path, name: str, *, timeout: float = 90) -> list[dict[str, Any]]:
    import _dist_scenario_worker as scenarios

    world = scenarios.SCENARIOS[name][0]
    assert run_group(root, world=world, timeout=timeout, worker=SCENARIO_WORKER,
                     args=[name]) == [0] * world
    return results(root, world)


def test_a_rank_that_stops_waiting_for_a_slow_commit_keeps_its_data(tmp_path: Path) -> None:
    """Rank 0's publish outlasted the group's timeout: rank 1, no longer waiting for the
    outcome, saw no manifest and deleted its data file, which the manifest rank 0 then
    published names (a committed checkpoint failing verify; with overwrite=True the good one
    was gone). It now keeps it."""
    got = run_scenario(tmp_path, "slow_commit")
    assert not got[1]["save"]["ok"] and got[1]["save"]["safepoint"], got[1]
    assert sp.info(str(tmp_path / "ckpt")).world_size == 2
    report = sp.verify(str(tmp_path / "ckpt"))
    assert report.ok, report.problems


def test_a_file_kept_by_a_rank_that_stopped_waiting_goes_with_the_next_save(
    tmp_path: Path,
) -> None:
    """When the slow commit then fails, the data file that rank 1 kept is a leftover: the
    next save there removes it, as a manager's gc does."""
    from safepoint._commit import wait_for_removals

    got = run_scenario(tmp_path, "slow_failed_commit")
    assert all(not rank["save"]["ok"] for rank in got), got
    url = tmp_path / "ckpt"
    with pytest.raises(sp.CheckpointNotFound):
        sp.info(str(url))
    assert [p.name.split("-")[1] for p in (url / "data").iterdir()] == ["r00001"]
    sp.save(str(url), {"x": torch.ones(2)}, dist=False)
    wait_for_removals()
    saved = sp.info(str(url)).save_id
    assert [p.name.split("-")[0] for p in (url / "data").iterdir()] == [saved]


@pytest.fixture(scope="module")
def values_and_storage(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_scenario(tmp_path_factory.mktemp("values_and_storage"), "values_and_storage")


def test_an_int_enum_saves_in_a_group_as_it_does_alone(
    values_and_storage: list[dict[str, Any]],
) -> None:
    """An IntEnum of a class defined in a function (a plain int to safepoint, stored as 1)
    failed a group's save on every rank: rank 0 could not unpickle the value, and the error
    said another rank had probably died. A float subclass holding a NaN keeps its payload
    bits, as it does saved alone (it lost them in a JSON round trip)."""
    for got in values_and_storage:
        assert got["enum"]["ok"], got["enum"]
        assert got["enum_loaded"] == {"ok": True, "value": "1"}
        assert got["nan_loaded"] == {"ok": True, "value": "0100000000fcff7f"}
        # An array of another byte order on rank 1 was saved as rank 0's, and came back so.
        assert not got["byte_order"]["ok"], got["byte_order"]
        assert ("'a' is a ndarray I32[3] (big-endian) on rank 0 but a ndarray I32[3] on rank 1"
                in got["byte_order"]["error"])
        # A str on one rank and bytes on the other was 'a value None[] ... but a bytes None[]'.
        assert not got["str_or_bytes"]["ok"], got["str_or_bytes"]
        assert "'n' is a value (str) on rank 0 but a bytes value on rank 1" \
            in got["str_or_bytes"]["error"]


def test_a_save_to_storage_rank_0_does_not_see_whole_commits_nothing(
    values_and_storage: list[dict[str, Any]],
) -> None:
    """Ranks saving to memory:// (each process's own, as a node-local path is each host's)
    committed a manifest naming rank 1's data file, which rank 0 does not hold: a checkpoint
    no one can load, replacing the good one."""
    for got in values_and_storage:
        outcome = got["unshared"]
        assert not outcome["ok"] and outcome["error"].startswith("DistributedError"), outcome
        assert "the files written by rank(s) 1 (data/" in outcome["error"]
        assert "memory://unshared/ckpt" in outcome["error"]
        assert got["unshared_after"] == {"ok": True, "value": [-1.0] * 4}  # intact
        assert len(got["unshared_files"]) == 2, got["unshared_files"]  # its file, manifest


def test_the_marker_of_a_rank_without_data_is_not_left_in_a_shared_storage(
    values_and_storage: list[dict[str, Any]],
) -> None:
    """Rank 1, with nothing to write (plain values; a small tensor that rank 0 writes),
    leaves an empty marker for rank 0 to see, which rank 0 removes before it commits: in a
    manager's new step too, which nothing tidies after its commit."""
    for got in values_and_storage:
        assert got["enum_files"] == [MANIFEST], got["enum_files"]
        assert got["small"]["ok"] and got["small_loaded"] == {"ok": True, "value": [0, 1, 2, 3]}
        assert got["mgr_small"] == {"ok": True, "value": 1}, got["mgr_small"]
        for files, prefix in ((got["small_files"], ""), (got["mgr_small_files"], "step-1/")):
            data = [f for f in files if f.startswith(f"{prefix}data/")]
            assert f"{prefix}{MANIFEST}" in files, files
            assert len(data) == 1 and "-r00000-" in data[0], files


@pytest.mark.parametrize("key", ["unshared_values", "unshared_small"])
def test_a_save_to_storage_rank_0_does_not_see_commits_nothing_when_a_rank_writes_no_data(
    values_and_storage: list[dict[str, Any]], key: str,
) -> None:
    """The same, with a state of plain values only, or one small replicated tensor that rank 0
    writes: rank 1 wrote no file for rank 0 to miss, so every rank's save succeeded, rank 0
    committed in its own storage only (replacing its good checkpoint) and rank 1's next load
    found no checkpoint. A rank with no data now writes an empty marker for rank 0 to see."""
    for got in values_and_storage:
        outcome = got[key]
        assert not outcome["ok"] and outcome["error"].startswith("DistributedError"), outcome
        assert "the files written by rank(s) 1 (data/" in outcome["error"]
        assert f"memory://unshared/{key}" in outcome["error"]
        assert got[f"{key}_after"] == {"ok": True, "value": [-1.0] * 4}  # intact
        assert len(got[f"{key}_files"]) == 2, got[f"{key}_files"]  # its file, manifest


def test_a_bytearray_may_be_extended_on_every_rank_once_an_async_save_is_staged(
    values_and_storage: list[dict[str, Any]],
) -> None:
    """An asynchronous collective save held a view of a bytearray until its write ended on
    the ranks that write none of the state (one rank writes a bytearray), and extending it
    raised BufferError there."""
    for got in values_and_storage:
        assert got["extended"] == {"ok": True, "value": None}, got["extended"]
        assert got["extended_saved"] == {"ok": True, "value": b"abc".hex()}


def test_async_managers_of_pipeline_stages_whose_ranks_are_in_other_groups_save(
    tmp_path: Path,
) -> None:
    """The group of a manager's background saves was made with torch's new_group(...,
    use_local_synchronization=True), which names it after the number of groups each rank
    belongs to: ranks 0 and 1 of a stage, rank 0 also in the stage leaders' group, never
    met, and the first save hung on every rank."""
    for got in run_scenario(tmp_path, "stages_with_their_own_async_managers", timeout=60):
        assert got["save"] == {"ok": True, "value": 1}, got
        assert got["wait"]["ok"] and got["steps"] == {"ok": True, "value": [1]}, got


def test_a_marker_that_outlives_its_published_step_leaves_the_step_uploaded(
    tmp_path: Path,
) -> None:
    """Two nodes: rank 0 published the remote manifest of step 1, then failed to remove node
    1's marker. The step was committed remotely, yet reported as failed ("publishing the
    remote manifest failed", an error event, no upload event). It is now uploaded, and the
    marker left behind is logged as safe to delete."""
    got = run_scenario(tmp_path, "markers_left_behind")
    step = tmp_path / "remote" / "step-1"
    assert got[0]["failed"] == ["node-1.json"]  # the fault was injected
    assert got[0]["uploads"] == [1] and got[1]["uploads"] == []  # rank 0 publishes
    for rank in got:
        assert rank["nodes"] == [[0], [1]]
        assert rank["errors"] == [], rank["errors"]
        assert rank["wait"] == {"ok": True, "value": None}, rank["wait"]
        assert rank["remote_steps"] == {"ok": True, "value": [1]}
    [warned] = got[0]["warned"]
    assert f"step 1 is committed at {step}," in warned, warned
    assert "['node-1.json']" in warned and "safe to delete" in warned, warned
    assert (step / "node-1.json").exists()
    assert sp.verify(str(step)).ok
    loaded = sp.load(str(step))["s"]
    assert torch.equal(loaded, torch.tensor([0.0] * 4 + [1.0] * 4))


def test_exchange_labels_call_sites_without_co_qualname() -> None:
    """exchange labelled its call site with the code's co_qualname, which Python 3.10 (the
    oldest that pyproject allows) lacks: every load and manager failed with AttributeError."""
    from types import SimpleNamespace

    from safepoint._dist import _call_site

    def frame(name: str, first: int, line: int) -> SimpleNamespace:
        code = SimpleNamespace(co_name=name, co_firstlineno=first, co_filename="/elsewhere")
        return SimpleNamespace(f_code=code, f_lineno=line)

    assert _call_site(frame("save", 10, 12)) == _call_site(frame("save", 10, 12))
    assert len({_call_site(frame("save", 10, 12)), _call_site(frame("save", 10, 13)),
                _call_site(frame("save", 40, 42)), _call_site(frame("load", 10, 12))}) == 4


def test_a_fresh_lbfgs_over_dtensor_parameters_restores(tmp_path: Path) -> None:
    """A fresh optimizer over DTensor parameters is primed by a step on zero gradients;
    LBFGS's step needs a closure, and the load died with a raw TypeError from inside it.
    LBFGS is not primed (on zero gradients its step returns before making any tensor)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def make() -> tuple[torch.nn.Parameter, torch.optim.LBFGS]:
            torch.manual_seed(0)
            param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
            return param, torch.optim.LBFGS([param], history_size=3, max_iter=3)

        param, optim = make()

        def closure() -> torch.Tensor:
            optim.zero_grad()
            loss = (param * param).sum()
            loss.backward()
            return loss

        optim.step(closure)
        url = str(tmp_path / "ck")
        sp.save(url, {"p": param, "o": optim}, dist=False)
        param2, optim2 = make()
        sp.load(url, into={"p": param2, "o": optim2}, dist=False)
        saved, restored = optim.state_dict()["state"][0], optim2.state_dict()["state"][0]
        assert (restored["n_iter"], restored["func_evals"]) == (saved["n_iter"],
                                                                saved["func_evals"])
        assert torch.equal(param2.full_tensor(), param.full_tensor())
    finally:
        dist.destroy_process_group()


def test_a_fresh_optimizer_with_an_lr_scheduler_over_dtensor_parameters_restores(
    tmp_path: Path,
) -> None:
    """An LR scheduler wraps its optimizer's `step`, and the wrapper's signature (read through
    `__wrapped__`) is the unbound function's, `self` first: it was taken for a step needing
    a closure, so a fresh Adam over FSDP2 parameters was not primed, its state loaded as
    plain tensors and the next step failed with torch's 'mixed torch.Tensor and DTensor'."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from safepoint._dist import needs_closure

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def make() -> tuple[torch.nn.Parameter, torch.optim.Adam, Any]:
            torch.manual_seed(0)
            param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
            optim = torch.optim.Adam([param], lr=0.1)
            return param, optim, torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)

        def train(param: torch.nn.Parameter, optim: torch.optim.Adam, sched: Any) -> None:
            optim.zero_grad()
            (param * param).sum().backward()
            optim.step()
            sched.step()

        param, optim, sched = make()
        assert not needs_closure(optim)
        assert needs_closure(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(1))]))
        train(param, optim, sched)
        url = str(tmp_path / "ck")
        sp.save(url, {"p": param, "o": optim, "s": sched}, dist=False)
        param2, optim2, sched2 = make()
        sp.load(url, into={"p": param2, "o": optim2, "s": sched2}, dist=False)
        train(param, optim, sched)
        train(param2, optim2, sched2)
        assert torch.equal(param2.full_tensor(), param.full_tensor())
        assert isinstance(optim2.state[param2]["exp_avg"], type(param2.data))
    finally:
        dist.destroy_process_group()
