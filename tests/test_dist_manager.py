"""A collective `sp.CheckpointManager` across a real 2-rank gloo group on 127.0.0.1 (one
process per rank, see tests/_dist_manager_worker.py): asynchronous saves staged through the
manager's budget per rank, failures on one rank surfacing on every rank, restore; and a
two-tier manager (a shared local_dir; a second directory as the remote root, then a moto S3
server); and two-tier managers whose ranks are two nodes, each with its own local_dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import _dist_manager_worker as worker
import safepoint as sp
from test_dist import results, run_group

WORKER = Path(worker.__file__)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def ran(
    tmp_path_factory: pytest.TempPathFactory, s3_server: Any,
) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("dist_manager")
    (root / "s3.json").write_text(json.dumps({
        "url": f"s3://{s3_server.bucket}/{root.name}", "storage_options": s3_server.storage_options,
    }))
    codes = run_group(root, world=worker.WORLD, worker=WORKER)
    assert codes == [0] * worker.WORLD
    return root, results(root, worker.WORLD)


def test_async_saves_stage_within_the_budget_and_reuse_the_buffers(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, got = ran
    for rank in got:
        assert rank["share"] == 4 * worker.BUDGET
        # what the stager holds, plus the writer's buffers, stays within the budget
        assert all(0 < held <= worker.BUDGET - rank["writer_bytes"] for held in rank["held"])
        # and so does the process: the budget plus the local disk's 8 MiB alignment buffer
        # and a few MiB of bookkeeping, where staging the share would take 4 budgets
        assert all(growth < worker.BUDGET + (12 << 20) for growth in rank["rss_growth"]), \
            rank["rss_growth"]
        assert rank["reused"]


def test_state_changed_after_save_returns_is_not_saved(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, got = ran
    assert [rank["restored"] for rank in got] == [2, 2]  # bit-exact, checked on each rank
    url = str(root / "mgr" / "step-1")
    loaded = sp.load(url, keys=["w", "rep", "many"])
    assert loaded["w"].equal(torch.cat([worker.make(1, r) for r in range(worker.WORLD)]))
    assert loaded["rep"].equal(worker.replicated(1))
    # Step 2 renamed a key of this dict: the layout remembered from step 1 was not reused.
    assert list(loaded["many"]) == list(worker.many(1))
    assert all(loaded["many"][k].equal(v) for k, v in worker.many(1).items())
    step_2 = sp.load(str(root / "mgr" / "step-2"), keys=["many"])["many"]
    assert list(step_2) == list(worker.many(2))
    assert all(step_2[k].equal(v) for k, v in worker.many(2).items())
    assert sp.verify(str(root / "mgr" / "step-2")).ok


def test_a_failure_on_one_rank_surfaces_on_every_rank(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, got = ran
    for rank in got:
        message, failing = rank["write_failure"]
        assert failing == [1]
        assert "injected failure" in message and "nothing was committed" in message
        message, failing = rank["copy_failure"]
        assert failing == [1]
        assert "injected staging failure" in message
        assert rank["steps"] == [1, 2]
    for step in (3, 4):  # nothing committed, and every rank removed its data file
        assert not [p for p in (root / "mgr" / f"step-{step}").rglob("*") if p.is_file()]


def test_two_tiers_commit_locally_upload_once_and_restore_from_either(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, got = ran
    local, remote = root / "local", root / "remote"
    for rank in got:
        message, failing = rank["inconsistent"]
        assert failing == [1] and "do not agree on who shares local_dir" in message
        assert "rank 1 sees the markers of ranks [0, 1] but rank 0 sees those of ranks [0]" \
            in message
        assert "incremental saves are not supported there" in rank["incremental_refused"]
        assert "pass incremental=False" in rank["incremental_refused"]
        assert rank["tier_steps"] == [2, 3]  # the remote keeps 2, the local tier the newest
        assert (rank["from_local"], rank["from_rotten"], rank["from_remote"], rank["older"]) \
            == (3, 3, 3, 2)
        assert rank["loads"] == [str(local / "step-3"), str(remote / "step-3"),
                                 str(remote / "step-3"), str(remote / "step-2")]
        [warned] = rank["warned"]  # the local copy failed on rank 1 only, skipped everywhere
        assert "the local copy of step 3 cannot be restored" in warned
        assert "rank 1: CorruptCheckpoint" in warned
    with sp.CheckpointManager(str(remote), dist=False) as reader:
        assert reader.steps() == [2, 3]
    for step in (2, 3):
        url = str(remote / f"step-{step}")
        assert sp.info(url).world_size == 2
        assert sp.verify(url).ok
        assert sp.load(url, keys=["w"])["w"].equal(
            torch.cat([worker.small(step, r) for r in range(worker.WORLD)]))
    for rank in range(worker.WORLD):  # the refused managers left nothing behind
        assert not [p for p in (root / f"own-{rank}").rglob("*") if p.is_file()]


@pytest.mark.filterwarnings("ignore:datetime.datetime.utcnow:DeprecationWarning")
def test_two_tiers_with_an_s3_remote(ran: tuple[Path, list[dict[str, Any]]]) -> None:
    root, got = ran
    for rank in got:
        assert rank["s3_restored"] == 2 and rank["s3_steps"] == [2]
    s3 = json.loads((root / "s3.json").read_text())
    url = f"{s3['url']}/step-2"
    options = s3["storage_options"]
    assert sp.verify(url, storage_options=options).ok
    info = sp.info(url, storage_options=options)
    assert info.world_size == 2
    # Incremental in the local tier: step 2's frozen pieces lie in step 1's files (one per
    # rank), uploaded with step 2's own; every piece is one chunk, so still version 1.
    assert info.files == 4 and info.format_version == 1


def test_a_run_warns_and_trains_on_when_a_save_fails_on_one_rank(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, got = ran
    for rank in got:
        assert rank["run_errors"] == [4]  # reported on every rank
        assert rank["run_steps"] == [2, 6]  # the final step committed after the failure


def test_incremental_saves_write_only_changed_blocks_of_each_rank(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    """In a group, each rank writes only the blocks of its pieces that changed (here one of
    the tuned piece's two blocks, and the head); the rest of every step lies in the files of
    step 1, hard-linked into each step, so deleting step 1 loses nothing; a restarted manager
    goes on sharing with the step it restored."""
    root, got = ran
    for rank in got:
        assert rank["inc_sync_steps"] == rank["inc_async_steps"] == [2, 3]
        assert rank["inc_restored"] == 3 and rank["inc_after_restart"] == [2, 3, 4]
    block = 4 << 20
    for mode, steps in (("sync", (2, 3, 4)), ("async", (2, 3))):
        for step in steps:
            where = root / f"inc-{mode}" / f"step-{step}"
            manifest = json.loads((where / "manifest.json").read_text())
            assert manifest["version"] == 3  # the tuned pieces lie in two files each
            files = {f["name"]: f["nbytes"] for f in manifest["files"]}
            written = sum(n for name, n in files.items() if manifest["save_id"] in name)
            assert written < worker.WORLD * block + (1 << 20) < sum(files.values()) / 4
            if step > 2:  # files shared with the step before are the very same file
                before = root / f"inc-{mode}" / f"step-{step - 1}"
                old = [name for name in files if (before / name).exists()]
                assert len(old) >= worker.WORLD
                assert all((where / name).stat().st_ino == (before / name).stat().st_ino
                           for name in old)
            url = str(where)
            assert sp.verify(url).ok
            loaded = sp.load(url)
            states = [worker.fine_tuning(step, r) for r in range(worker.WORLD)]
            for key in ("frozen", "tuned"):
                assert loaded[key].equal(torch.cat([s[key] for s in states])), (url, key)
            assert loaded["embed"].equal(states[0]["embed"])
            assert loaded["head"].equal(states[0]["head"]) and loaded["step"] == step
            assert loaded["row"].equal(torch.arange(8.0).view(1, 8))
            assert loaded["pos"] == {r: r * 10 + step for r in range(worker.WORLD)}


def _files(where: Path) -> list[str]:
    return sorted(str(p.relative_to(where)) for p in where.rglob("*") if p.is_file())


def test_node_local_tiers_commit_on_every_node_and_upload_each_nodes_files(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Each rank is a node with its own local_dir: a local step holds that node's files and
    the manifest (the same bytes on every node); every node uploads its own files, rank 0
    publishes the remote manifest; both tiers keep what their policies say."""
    root, got = ran
    remote = root / "nl-remote"
    for rank, result in enumerate(got):
        assert result["nl_nodes"] == [[0], [1]]
        assert result["nl_steps"] == [2, 3]
        # keep_local=1: only step 3, holding this node's own data file and the manifest
        files = result["nl_local_files"]
        assert files[-1] == "step-3/manifest.json" and len(files) == 2, files
        assert f"-r{rank:05d}-" in files[0], files
    assert got[0]["nl_uploads"] == [1, 2, 3] and got[1]["nl_uploads"] == []
    with sp.CheckpointManager(str(remote), dist=False) as reader:
        assert reader.steps() == [3, 4]  # keep_last=2, after step 4 (see the next test)
    for step in (3, 4):
        url = str(remote / f"step-{step}")
        assert sp.verify(url).ok
        assert not [f for f in _files(remote / f"step-{step}") if "node-" in f]  # no marker
        loaded = sp.load(url)
        assert loaded["w"].equal(torch.cat([worker.small(step, r) for r in range(worker.WORLD)]))
        assert loaded["rep"].equal(worker.replicated_small(step))
        assert loaded["pos"] == {r: r * 10 + step for r in range(worker.WORLD)}
        assert sp.info(url).files == worker.WORLD
    # the step saved after rank 1's host was replaced is committed on both nodes, uploaded
    manifests = {(root / f"nl-local-{r}" / "step-4" / "manifest.json").read_bytes()
                 for r in range(worker.WORLD)}
    assert len(manifests) == 1
    assert manifests == {(remote / "step-4" / "manifest.json").read_bytes()}
    assert sp.verify(str(remote / "step-4")).ok


def test_node_local_tiers_restore_from_local_bytes_and_fall_back_to_the_remote(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, got = ran
    remote = root / "nl-remote"
    for rank, result in enumerate(got):
        own = str(root / f"nl-local-{rank}" / "step-3")
        # a restarted manager reads its node's files locally, the others' remotely
        assert result["nl_from_local"] == 3 and result["nl_loads_local"] == [own]
        # with every remote data file of step 3 rotten, each rank's own pieces still load
        assert result["nl_own_pieces"] == 3
        # rank 1's replaced host has nothing: rank 1 reads the remote root, rank 0 its disk
        assert result["nl_replaced"] == 3
        assert result["nl_loads_replaced"] == [own if rank == 0 else str(remote / "step-3")]
        # rank 0's local copy rots: both restore the remote copy
        assert result["nl_rotten"] == 3
        assert result["nl_loads_rotten"] == [str(remote / "step-3")]
        [warned] = result["nl_warned"]
        assert "the local copy of step 3 cannot be restored" in warned
        assert "rank 0: CorruptCheckpoint" in warned
        assert result["nl_after"] == [3, 4]


def test_node_local_tiers_an_upload_failing_on_one_node_publishes_nothing(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, got = ran
    for result in got:
        message = result["nlf_failure"]
        assert "step(s) [1]" in message and "not uploaded" in message
        assert "rank 1: upload attempt 2 of 2 failed" in message and "injected" in message
        assert result["nlf_visible"] is False
        assert result["nlf_steps_meanwhile"] == [1]
        assert result["nlf_remote_steps"] == [1] and result["nlf_gc_kept"] == [1], \
            (result["nlf_errors"], result.get("nlf_error_texts"))
    # One round of 2 tries, or two when the first round failed before `wait` queued the
    # step again (a failed upload is retried at wait).
    assert got[1]["nlf_errors"] in ([1] * 2, [1] * 4) and got[0]["nlf_errors"] == []
    assert sp.verify(str(root / "nlf-remote" / "step-1")).ok


@pytest.mark.filterwarnings("ignore:datetime.datetime.utcnow:DeprecationWarning")
def test_node_local_tiers_with_an_s3_remote(ran: tuple[Path, list[dict[str, Any]]]) -> None:
    root, got = ran
    for result in got:
        assert result["nls3_restored"] == 2 and result["nls3_steps"] == [2]
    s3 = json.loads((root / "s3.json").read_text())
    url, options = s3["url"] + "-nodes", s3["storage_options"]
    assert sp.verify(f"{url}/step-2", storage_options=options).ok
    store = sp.storage.open_storage(url, options)
    try:
        assert sorted(p.split("/")[0] for p in store.list("") if "manifest" in p) == ["step-2"]
        assert not [p for p in store.list("") if "node-" in p]
    finally:
        store.close()


def test_node_local_tiers_restore_the_remote_copy_everywhere_when_one_nodes_copy_is_stale(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Rank 0's node holds the first save of step 1; the remote root and rank 1's node hold
    the second: every rank restores the second save, reading the remote copy alone (rank 1
    reading its local copy would make the collective load refuse on every rank)."""
    root, got = ran
    remote = root / "nls-remote"
    for rank, result in enumerate(got):
        assert "nls_error" not in result, f"rank {rank}: {result['nls_error']}"
        assert result["nls_restored"] == [1, "second"]
        # or rank 0's stale copy was removed by its local retention first: then rank 1 reads
        # its own copy (the second save), rank 0 the remote one
        assert result["nls_loads"] in ([str(remote / "step-1")],
                                       [str(root / f"nls-local-{rank}" / "step-1")])


def test_node_local_tiers_do_not_upload_stale_copies_over_a_newer_remote_step(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Both nodes' local_dirs hold the first save of step 1, the remote root the second
    (saved from other hosts): a manager reopened on them leaves the remote step 1 as it was,
    whole."""
    root, got = ran
    remote = root / "nlo-remote" / "step-1"
    for rank, result in enumerate(got):
        assert "nlo_error" not in result, f"rank {rank}: {result['nlo_error']}"
        assert result["nlo_steps"] == [1]
    assert sp.info(str(remote)).save_id == sp.info(str(root / "nlo-other-0" / "step-1")).save_id
    assert sp.verify(str(remote)).ok
    loaded = sp.load(str(remote))
    assert loaded["w"].equal(torch.cat([worker.small(-1, r) for r in range(worker.WORLD)]))
    assert not [f for f in _files(remote) if "node-" in f]


def test_run_ranks_whose_range_totals_differ_refuse_at_once(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Ranks whose run.range() totals differ would part at the smaller one (a final save on
    one rank, the next step's all-reduce on the other) and wait out the group's timeout:
    they are refused on every rank before the first step, and step 2 stays the last."""
    root, got = ran
    for rank in got:
        kind, message, failing = rank["totals"]
        assert kind == "DistributedError"
        assert "the ranks' totals differ ([5, 7], rank by rank)" in message, message
        assert str(root / "totals") in message and failing == [0, 1]
        assert rank["totals_seconds"] < 5 and rank["totals_done"] == 2
    with sp.CheckpointManager(str(root / "totals"), dist=False) as reader:
        assert reader.steps() == [2]
    assert sp.verify(str(root / "totals" / "step-2")).ok


def test_a_break_on_one_rank_ends_every_ranks_range_after_that_step(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    """A `break` in step 3 on rank 1 only ends rank 0's range after step 3 too: both make
    the same final save of step 4 (or go on together in a second range), at once. Rank 1
    went from its `break` to its final save while rank 0 waited at the next step's
    all-reduce, and both waited out the group's timeout to fail with nothing committed. A
    `break` on every rank still commits at once; each run resumes exactly (a range after a
    `break` goes on, a run that ended on one trains no more, as in a single process)."""
    root, got = ran
    four, six, eight = [4.0] * 4, [6.0] * 4, [8.0] * 4
    expected = {  # steps trained, [step, complete] at the end, steps committed (the
        # resumed run's too), the resume: the step and state restored, steps trained, state
        "break-one": ([0, 1, 2, 3], [4, True], [2, 4], [4, four, [], four]),
        "break-one-then-range": ([0, 1, 2, 3, 4, 5], [6, True], [2, 4, 6, 8],
                                 [6, six, [6, 7], eight]),
        "break-all": ([0, 1, 2, 3], [4, True], [2, 4], [4, four, [], four]),
    }
    for case, (taken, ended, steps, resumed) in expected.items():
        for rank in got:
            assert rank[case]["ended"] == ended, (case, rank[case]["ended"])
            assert rank[case]["taken"] == taken and rank[case]["seconds"] < 5, case
            assert rank[case]["resumed"] == resumed, (case, rank[case]["resumed"])
        with sp.CheckpointManager(str(root / case), dist=False) as reader:
            assert reader.steps() == steps, case
            assert reader.metadata(ended[0]).metadata[sp._run.RUN_KEY] == {
                "complete": True, "stopped_early": case != "break-one-then-range"}, case
        assert sp.load(str(root / case / f"step-{ended[0]}"))["w"].equal(
            torch.full((8,), float(ended[0]))), case


def test_ranks_may_restore_different_keys_from_an_incremental_manager(
    ran: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Rank 0 restores the whole state, rank 1 some keys (one tier and two): both restore
    and go on in step, as without incremental; the next save shares nothing with the step
    restored, since not every rank read and checked all of its pieces."""
    root, got = ran
    for rank in got:  # restored, step 2 restored whole, steps
        assert [rank.get("keys"), rank.get("keys-tiers")] == [[1, 2, [1, 2]]] * 2
    for where in (root / "keys", root / "keys-tiers"):
        manifest = json.loads((where / "step-2" / "manifest.json").read_text())
        assert all(manifest["save_id"] in file["name"] for file in manifest["files"]), where
        assert sp.verify(str(where / "step-2")).ok
