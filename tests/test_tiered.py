"""Two tiers: CheckpointManager(root, local_dir=...) commits locally, uploads in the background
(to S3 on moto, or to a memory scheme whose writes fail on demand), keeps its own local
retention, restores from the local copy or falls back to the remote one, and reports and
retries failed uploads."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import safepoint as sp
from _states import flip_bit_of
from safepoint import storage as storage_module
from safepoint._storage_local import LocalStorage
from safepoint._tiered import UPLOAD, TieredManager, nodes_of
from safepoint.testing import FaultyStorage, MemoryBackend, memory_scheme


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(1000, float(step)), "step": step}


class Flaky:
    """The scheme ``flaky-test://``: a memory store whose data writes fail while `failing`
    is above 0 (each failure counts it down; -1 fails forever), and every call while
    `down` (an outage), or that `fails` picks; `on_write` sees every data write first."""

    def __init__(self) -> None:
        self.backend = MemoryBackend()
        self.failing = 0
        self.down = False
        #: Called with the storage's URL and the path of every data write, before it.
        self.on_write: Callable[[str, str], None] | None = None
        #: Called with the storage's URL, the op and the path of every call: True fails it.
        self.fails: Callable[[str, str, str], bool] | None = None

    def __call__(self, url: str, options: dict[str, Any] | None = None) -> FaultyStorage:
        def fail_on(op: str, path: str, n: int) -> bool:
            if self.down or (self.fails is not None and self.fails(url, op, path)):
                return True
            if op == "write" and self.on_write is not None:
                self.on_write(url, path)
            if op != "write" or self.failing == 0:
                return False
            if self.failing > 0:
                self.failing -= 1
            return True

        return FaultyStorage(self.backend(url, options), fail_on)


@pytest.fixture
def flaky() -> Iterator[Flaky]:
    scheme = Flaky()
    storage_module.register("flaky-test", scheme)
    try:
        yield scheme
    finally:
        storage_module._REGISTERED.pop("flaky-test", None)


def _manager(root: str, local: Path | str, events: list[sp.Event], **options: Any) -> TieredManager:
    mgr = sp.CheckpointManager(root, local_dir=str(local), on_event=events.append, **options)
    assert isinstance(mgr, TieredManager)
    mgr.upload_backoff_s = 0.01
    return mgr


@pytest.mark.filterwarnings("ignore:datetime.datetime.utcnow:DeprecationWarning")
def test_commits_locally_uploads_to_s3_and_keeps_its_own_local_retention(
    tmp_path: Path, s3_server: Any, s3_url: str
) -> None:
    events: list[sp.Event] = []
    options = s3_server.storage_options
    with _manager(s3_url, tmp_path / "local", events, keep_last=2, keep_local=1,
                  storage_options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
            mgr.wait()
        assert mgr.steps() == [2, 3]
        assert mgr.latest_step() == 3
    uploads = [e.step for e in events if e.kind == UPLOAD]
    assert uploads == [1, 2, 3]
    assert all(e.url.startswith(s3_url) for e in events if e.kind == UPLOAD)
    with sp.CheckpointManager(s3_url, storage_options=options) as remote:
        assert remote.steps() == [2, 3]
    with sp.CheckpointManager(str(tmp_path / "local")) as local:
        assert local.steps() == [3]
    assert sp.verify(f"{s3_url}/step-3", storage_options=options).ok


def test_steps_uploaded_while_closing_leave_keep_local_steps(
    tmp_path: Path, flaky: Flaky
) -> None:
    """Uploads that close() waits for still apply keep_local: after saves that never wait,
    local_dir holds only the newest step."""
    with _manager("flaky-test://remote", tmp_path / "local", [], keep_local=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    with sp.CheckpointManager(str(tmp_path / "local")) as local:
        assert local.steps() == [3]
    with sp.CheckpointManager("flaky-test://remote") as remote:
        assert remote.steps() == [1, 2, 3]


def test_restore_prefers_the_local_copy_and_falls_back_to_the_remote(
    tmp_path: Path, flaky: Flaky
) -> None:
    events: list[sp.Event] = []
    with _manager("flaky-test://run", tmp_path / "local", events, keep_local=2) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
        target = _state(0)
        assert mgr.restore(target) == 2
        assert target["step"] == 2
        assert [e.url for e in events if e.kind == "load"] == [mgr.step_url(2)]

        (data,) = (tmp_path / "local" / "step-2" / "data").glob("*.bin")
        raw = bytearray(data.read_bytes())
        raw[10] ^= 1
        data.write_bytes(bytes(raw))
        target = _state(0)
        with pytest.warns(UserWarning, match="step 2"):
            assert mgr.restore(target) == 2
        np.testing.assert_array_equal(target["w"], _state(2)["w"])
        assert events[-1].kind == "load" and events[-1].url == "flaky-test://run/step-2"


def test_restore_from_the_remote_when_local_dir_is_empty(tmp_path: Path, flaky: Flaky) -> None:
    with _manager("flaky-test://run", tmp_path / "a", []) as mgr:
        mgr.save(5, _state(5))
    with _manager("flaky-test://run", tmp_path / "b", []) as fresh:
        target = _state(0)
        assert fresh.restore(target) == 5
        assert target["step"] == 5


def test_restore_after_a_rollback_resumes_the_step_committed_last(
    tmp_path: Path, flaky: Flaky
) -> None:
    """Rolled back to step 10, the run saved 15: a new machine (empty local_dir) and the
    old one both resume from 15, not from the abandoned 20."""
    with _manager("flaky-test://run", tmp_path / "a", [], keep_last=None) as mgr:
        mgr.save(10, _state(10))
        mgr.save(20, _state(20))
        mgr.wait()
        assert mgr.restore(_state(0), 10) == 10
        mgr.save(15, _state(15))
    for local in ("a", "b"):
        with _manager("flaky-test://run", tmp_path / local, [], keep_last=None) as fresh:
            target = _state(0)
            assert fresh.restore(target) == 15, local
            assert target["step"] == 15


def test_a_save_records_the_step_restored_from_either_tier_as_its_parent(
    tmp_path: Path, flaky: Flaky
) -> None:
    """The step a restore loaded, from local_dir or from the remote root, is the parent the
    next save records, which a later restore falls back to."""
    with _manager("flaky-test://run", tmp_path / "a", [], keep_last=None) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.restore(_state(0), 10) == 10  # local
        mgr.save(15, _state(15))
    with _manager("flaky-test://run", tmp_path / "b", [], keep_last=None) as fresh:
        assert fresh.restore(_state(0), 20) == 20  # remote: local_dir b is empty
        fresh.save(40, _state(40))
        fresh.wait()
        assert fresh.metadata(15)._parent == 10
        assert fresh.metadata(40)._parent == 20
        assert fresh._restore_order(fresh.steps()) == [40, 20, 10]


def test_keep_only_deletes_a_local_step_whose_manifest_is_damaged(tmp_path: Path) -> None:
    """keep_final_only's deletion in both tiers goes past a local copy that cannot be read
    (it raised and deleted nothing)."""
    remote, local = tmp_path / "remote", tmp_path / "local"
    with sp.CheckpointManager(str(remote), local_dir=str(local), keep_last=None,
                              keep_local=5, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
        (local / "step-1" / "manifest.json").write_bytes(b"\x00garbage")
        assert mgr._keep_only(2) == [1]
        assert mgr.steps() == [2] and mgr.remote.steps() == [2]
        assert not (local / "step-1").exists()


def test_a_failed_upload_is_retried_and_reported(tmp_path: Path, flaky: Flaky) -> None:
    events: list[sp.Event] = []
    flaky.failing = 2
    training_stream = random.getstate()
    with _manager("flaky-test://run", tmp_path / "local", events) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
    assert random.getstate() == training_stream, "the backoff's jitter drew from `random`"
    errors = [e for e in events if e.kind == "error"]
    assert [e.step for e in errors] == [1, 1]
    assert "upload attempt 1 of 4 failed" in str(errors[0].error)
    assert [e.step for e in events if e.kind == UPLOAD] == [1]
    assert "run/step-1/manifest.json" in flaky.backend.files()


def test_an_upload_that_keeps_failing_is_never_lost(tmp_path: Path, flaky: Flaky) -> None:
    events: list[sp.Event] = []
    flaky.failing = -1
    mgr = _manager("flaky-test://run", tmp_path / "local", events, keep_local=1)
    mgr.upload_attempts = 2
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    with pytest.raises(sp.StorageError, match=r"step\(s\) \[1, 2\].*not uploaded"):
        mgr.wait()
    with pytest.raises(sp.StorageError, match="safepoint cp"):
        mgr.close()
    assert sum(e.kind == "error" for e in events) >= 4
    with sp.CheckpointManager(str(tmp_path / "local")) as local:
        assert local.steps() == [1, 2], "steps not uploaded stay local"
    assert not any(p.endswith("manifest.json") and "step-" in p for p in flaky.backend.files())

    with _manager("flaky-test://other", tmp_path / "other", events) as same:
        same.upload_attempts = 1
        same.save(9, _state(9))
        with pytest.raises(sp.StorageError, match=r"step\(s\) \[9\]"):
            same.wait()
        flaky.failing = 0  # the store is back: wait tries again what failed
        same.wait()
        assert same.remote.steps() == [9]
    # and a new manager uploads what the first one left
    with _manager("flaky-test://run", tmp_path / "local", events, keep_local=1) as again:
        again.wait()
        assert again.remote.steps() == [1, 2]
    with sp.CheckpointManager(str(tmp_path / "local")) as local:
        assert local.steps() == [2]


def test_incremental_local_tier_uploads_complete_steps(tmp_path: Path, flaky: Flaky) -> None:
    """With `incremental`, each local step shares the unchanged entry with the step before
    (a hard link); each uploaded step is complete and restores from the remote alone."""
    frozen = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB, never changes
    with _manager("flaky-test://run", tmp_path / "local", [], keep_local=2,
                  incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {**_state(step), "frozen": frozen})
            mgr.wait()
    one, two = ({p.name: p.stat().st_ino for p in (tmp_path / "local" / f"step-{s}" / "data")
                 .iterdir()} for s in (1, 2))
    assert [n for n in one if two.get(n) == one[n]]
    with sp.CheckpointManager("flaky-test://run") as remote:
        assert remote.steps() == [1, 2]
        target = {**_state(0), "frozen": np.zeros_like(frozen)}
        assert remote.restore(target) == 2
    np.testing.assert_array_equal(target["frozen"], frozen)
    assert target["step"] == 2


def test_incremental_uploads_go_on_after_a_shared_local_file_rots(tmp_path: Path) -> None:
    """One flipped bit in the frozen entry's local file: every later step linked that file
    again, every upload failed its checked copy (CorruptCheckpoint), and nothing reached
    the remote root again though the state in memory was intact. The failed upload now
    drops the lineage: the next step writes every block and is uploaded."""
    frozen = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB, never changes
    remote, local = tmp_path / "remote", tmp_path / "local"
    mgr = _manager(str(remote), local, [], keep_local=1, incremental=True, async_save=False)
    mgr.upload_attempts = 1
    try:
        mgr.save(1, {**_state(1), "frozen": frozen})
        mgr.wait()
        flip_bit_of(local / "step-1", "frozen")
        mgr.save(2, {**_state(2), "frozen": frozen})  # shares the rotten file
        with pytest.raises(sp.StorageError, match=r"step\(s\) \[2\].*checksum mismatch"):
            mgr.wait()
        mgr.save(3, {**_state(3), "frozen": frozen})
        with pytest.raises(sp.StorageError, match=r"step\(s\) \[2\]"):
            mgr.wait()  # step 2 never uploads; step 3 does
    finally:
        with contextlib.suppress(sp.StorageError):  # step 2, reported already
            mgr.close()
    with sp.CheckpointManager(str(remote)) as uploaded:
        assert uploaded.steps() == [1, 3]
        target = {**_state(0), "frozen": np.zeros_like(frozen)}
        assert uploaded.restore(target) == 3
    np.testing.assert_array_equal(target["frozen"], frozen)


def test_uploads_respect_the_lease_of_a_live_writer_of_the_remote_root(tmp_path: Path) -> None:
    """One writer per root: a two-tier manager whose remote root another live manager holds
    uploads nothing there, and says so."""
    remote = str(tmp_path / "remote")
    with sp.CheckpointManager(remote, async_save=False) as holder:
        holder.save(1, _state(1))
        events: list[sp.Event] = []
        mgr = _manager(remote, tmp_path / "local", events)
        mgr.upload_attempts = 1
        try:
            mgr.save(5, _state(5))
            with pytest.raises(sp.StorageError, match=r"step\(s\) \[5\].*being written by"):
                mgr.wait()
        finally:
            with pytest.raises(sp.StorageError):
                mgr.close()
        assert holder.steps() == [1]
    assert any(e.kind == "error" and "LeaseHeld" in (e.error or "") for e in events)



def test_an_upload_that_lost_the_remote_lease_while_copying_publishes_nothing(
    tmp_path: Path, flaky: Flaky
) -> None:
    """The remote root's lease is taken over while an upload copies step 5's data (its
    renewals failed for lease_seconds, and another writer took the root): the upload
    publishes nothing there and removes what it copied, since the lease is checked again once
    the data is durable, just before the manifest is published; it says why."""
    events: list[sp.Event] = []
    mgr = _manager("flaky-test://run", tmp_path / "local", events)
    mgr.upload_attempts = 1
    remote = flaky.backend("flaky-test://run")

    def take_over(url: str, path: str) -> None:
        if url.endswith("/step-5") and path.startswith("data/") and flaky.on_write:
            flaky.on_write = None
            generation = max(int(name.split("/")[1].split(".")[0])
                             for name in remote.list("lease"))
            holder = {"host": "elsewhere", "pid": 1, "token": "other",
                      "expires": time.time() + 60}
            remote.publish(f"lease/{generation + 1:012d}.json", json.dumps(holder).encode(),
                           overwrite=False)

    flaky.on_write = take_over
    try:
        mgr.save(5, _state(5))
        with pytest.raises(sp.StorageError, match=r"step\(s\) \[5\]"):
            mgr.wait()
    finally:
        flaky.on_write = None
        with pytest.raises(sp.StorageError):
            mgr.close()
    assert flaky.on_write is None and not [
        path for path in flaky.backend.files() if path.startswith("run/step-5/")]
    assert any(e.kind == "error" and "step 5 was not uploaded" in (e.error or "")
               and "no longer holds the lease" in (e.error or "") for e in events)


def test_a_dropped_two_tier_manager_does_not_hold_its_roots_forever(
    tmp_path: Path, flaky: Flaky
) -> None:
    """A two-tier manager dropped without `close()` (a notebook cell run again) with one
    upload running and another queued finishes both, is then collected, and its leases with
    it, so this process takes both roots over at once: its uploader thread held it, and both
    leases, for the life of the process."""

    def slow(url: str, path: str) -> None:
        if url.endswith("/step-1"):
            time.sleep(0.5)

    flaky.on_write = slow
    local = tmp_path / "local"
    first = _manager("flaky-test://run", local, [], async_save=False)
    first.save(1, _state(1))
    first.save(2, _state(2))  # queued behind step 1's slow upload
    dropped = weakref.ref(first)
    del first
    deadline = time.monotonic() + 20
    while dropped() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert dropped() is None
    with _manager("flaky-test://run", local, []) as second:
        assert second.remote.steps() == [1, 2]
        second.save(3, _state(3))
    with sp.CheckpointManager("flaky-test://run") as reader:
        assert reader.steps() == [1, 2, 3]

def test_restore_from_local_dir_while_the_remote_is_down(tmp_path: Path, flaky: Flaky) -> None:
    """A job restarted during an object-store outage resumes from its intact local copy."""
    with _manager("flaky-test://run", tmp_path / "local", []) as mgr:
        mgr.save(7, _state(7))
    flaky.down = True
    mgr = _manager("flaky-test://run", tmp_path / "local", [])
    try:
        target = _state(0)
        with pytest.warns(UserWarning, match="cannot list flaky-test://run"):
            assert mgr.restore(target) == 7
        np.testing.assert_array_equal(target["w"], _state(7)["w"])
    finally:
        flaky.down = False
        mgr.close()


def test_a_run_resumes_from_the_remote_copy_when_the_local_manifest_is_damaged(
    tmp_path: Path, flaky: Flaky
) -> None:
    """The local copy's manifest rots: `sp.Run` restores the remote copy and reads the step's
    record from there too."""
    local = str(tmp_path / "local")
    state = {"w": np.zeros(3)}
    with sp.Run("flaky-test://run", state, every_steps=5, local_dir=local, keep_local=2) as run:
        for _ in run.range(8):
            state["w"] += 1
    (tmp_path / "local" / "step-8" / "manifest.json").write_text("{garbage")
    target = {"w": np.zeros(3)}
    with pytest.warns(UserWarning, match="step 8"):
        run = sp.Run("flaky-test://run", target, every_steps=5, local_dir=local)
        run.__enter__()
    try:
        assert run.restored_step == 8 and run.complete
        np.testing.assert_array_equal(target["w"], np.full(3, 8.0))
    finally:
        run._close(ok=False)


def test_nodes_are_the_groups_of_ranks_that_see_each_others_markers() -> None:
    """What each rank saw in its local_dir makes the nodes, led by their lowest rank; a
    grouping that is not an equivalence is refused, naming the ranks that disagree."""
    assert nodes_of([[0, 1], [0, 1], [2, 3], [2, 3]], "/nvme/run") == [(0, 1), (2, 3)]
    assert nodes_of([[0], [1]], "/nvme/run") == [(0,), (1,)]
    assert nodes_of([[0, 1, 2]] * 3, "/shared/run") == [(0, 1, 2)]
    with pytest.raises(sp.DistributedError, match=r"rank 1 sees the markers of ranks \[0, 1\] "
                       r"but rank 0 sees those of ranks \[0\]") as caught:
        nodes_of([[0], [0, 1]], "/nvme/run")
    assert caught.value.failures.keys() == {1}
    with pytest.raises(sp.DistributedError, match="rank 2 does not see its own marker"):
        nodes_of([[0, 1], [0, 1], []], "/nvme/run")
    with pytest.raises(sp.DistributedError, match="do not agree"):  # 0~1 and 1~2, not 0~2
        nodes_of([[0, 1], [0, 1, 2], [1, 2]], "/nvme/run")


def test_two_tier_steps_record_the_users_retention_policy(tmp_path: Path) -> None:
    """The remote steps record the policy the user passed (the manifest is uploaded as it
    is): they recorded the local tier's keep-everything, so `safepoint ls` and `safepoint gc`
    of the remote root kept every step."""
    with sp.CheckpointManager(str(tmp_path / "remote"), local_dir=str(tmp_path / "local"),
                              keep_last=2, keep_best=1, best_metric="loss") as mgr:
        for step in range(3):
            mgr.save(step, _state(step), metrics={"loss": float(step)})
        mgr.wait()
        policies = [mgr.remote.metadata(2).policy, mgr.metadata(2).policy]
    for policy in policies:
        assert policy is not None
        assert (policy.keep_last, policy.keep_best, policy.best_metric) == (2, 1, "loss")


def test_two_tier_gc_during_an_upload_does_not_commit_a_remote_step_without_data(
    tmp_path: Path,
) -> None:
    """`gc()` on one node while the uploader is inside the copy of a step (data written,
    manifest not yet published) waits for the upload: it took the step for a crashed save's
    leftover and deleted its data, and the copy then published the manifest (a remote step
    without data, whose intact local copy retention later removed)."""
    backend = MemoryBackend()
    arrived, release = threading.Event(), threading.Event()

    def slow_publish(op: str, path: str, n: int) -> bool:
        if op == "publish" and path == "manifest.json" and not release.is_set():
            arrived.set()
            release.wait(20)  # the upload's data is written; its manifest not yet
        return False

    storage_module.register("slow-up", lambda url, options=None: FaultyStorage(
        backend(url, options), slow_publish))
    try:
        mgr = sp.CheckpointManager("slow-up://run", local_dir=str(tmp_path / "local"))
        try:
            mgr.save(1, _state(1)).result()  # committed locally
            assert arrived.wait(10)  # the upload is in flight
            timer = threading.Timer(1.0, release.set)
            timer.start()
            report = mgr.gc()
            assert not report.leftovers and report.kept == {1: ["latest", "last"]}
            mgr.wait()
            assert sp.verify("slow-up://run/step-1").ok
        finally:
            release.set()
            mgr.close()
    finally:
        storage_module._REGISTERED.pop("slow-up", None)


# -- found by a review of the two-tier manager ------------------------------------------


def _values(step: float) -> dict[str, Any]:
    return {"w": np.full(100, float(step))}


def _tiered(root: str, local: Path | str, **options: Any) -> TieredManager:
    mgr = sp.CheckpointManager(root, local_dir=str(local), **options)
    assert isinstance(mgr, TieredManager)
    mgr.upload_backoff_s = 0.01
    mgr.upload_attempts = 1
    return mgr


def test_wait_after_a_close_that_left_failed_uploads_does_not_hang(
    tmp_path: Path, flaky: Flaky
) -> None:
    """close() raised StorageError (step 1 never uploaded), then wait() is called (so is
    gc(), which calls wait()).

    Expected: wait() returns or raises at once (the manager is closed).
    Observed: it hangs forever: wait() re-queues the failed step (_retry_failed) and
    _drain() waits for the queue to empty, but close() already stopped and joined the
    uploader thread, so nothing ever takes it off the queue.
    """
    mgr = _tiered("flaky-test://run", tmp_path / "local")
    mgr.save(1, _values(1))
    flaky.failing = -1
    with pytest.raises(sp.StorageError):
        mgr.close()
    outcome: list[object] = []

    def call() -> None:
        try:
            mgr.wait()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "wait() after close() hangs forever"


def test_restore_skipping_a_corrupt_remote_step_warns_and_emits_an_error(
    tmp_path: Path,
) -> None:
    """A job on a fresh host (empty local_dir) restores; the remote copy of the newest step
    is corrupt.

    Expected (README "fallback=True  # restore() skips corrupt steps, loudly"; docs/manager.md
    "Restore and fallback": an error event and a UserWarning naming the step), as a
    one-tier manager on the same root does.
    Observed: TieredManager.restore calls self.remote.restore(state, candidate) with an
    explicit step, which raises without any event or warning, and the loop silently goes
    on to step 1: no warning, no error event. The same happens when a corrupt local copy's
    fallback to a remote copy also fails (only the local failure is reported).
    """
    with memory_scheme("mt-silent") as backend:
        with _tiered("mt-silent://run", tmp_path / "a") as mgr:
            mgr.save(1, _values(1))
            mgr.save(2, _values(2))
        store = backend._store
        (key,) = [k for k in store.files if k.startswith("run/step-2/data/")]
        raw = bytearray(store.files[key])
        raw[5] ^= 1
        store.files[key] = bytes(raw)

        events: list[sp.Event] = []
        with _tiered("mt-silent://run", tmp_path / "b", on_event=events.append) as mgr:
            target = _values(0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert mgr.restore(target) == 1
        assert any("step 2" in str(w.message) for w in caught), \
            "no warning names the corrupt step 2 that restore skipped"
        assert any(e.kind == "error" and e.step == 2 for e in events), \
            "no error event for the corrupt step 2 that restore skipped"


def _two_hosts_with_a_rollback(tmp_path: Path, root: str) -> str:
    """Host A saves 100 and 110 (local_dir a keeps 110). The job moves to host B, rolls
    back to 100 and saves 105 and a new 110. Returns the save id of B's step 110."""
    with _tiered(root, tmp_path / "a") as mgr:
        mgr.save(100, _values(100))
        mgr.save(110, _values(110))
    time.sleep(0.01)
    with _tiered(root, tmp_path / "b") as mgr:
        assert mgr.restore(_values(0), step=100) == 100
        mgr.save(105, _values(105))
        mgr.save(110, _values(-110))
    return sp.info(f"{root}/step-110").save_id


def test_reopening_a_stale_local_dir_does_not_overwrite_a_newer_remote_step(
    tmp_path: Path,
) -> None:
    """The job comes back to host A, whose local_dir still holds the abandoned branch's
    step 110 (uploaded long ago).

    Expected: the remote root keeps B's step 110 (the newest commit of the run); docs say a
    reopened manager uploads "what a dead run left behind", i.e. steps not uploaded yet.
    Observed: the constructor queues every local step (`pending`), and _copy_step copies
    with overwrite=True, replacing B's committed step 110 with A's stale one: the newest
    checkpoint of the run is destroyed.
    Fix: at open, upload a local step only when the remote root holds no committed step of
    that number (or holds the same save id: skip it); never overwrite a different remote
    save from `pending`.
    """
    with memory_scheme("mt-stale") as _:
        root = "mt-stale://run"
        newest = _two_hosts_with_a_rollback(tmp_path, root)
        with _tiered(root, tmp_path / "a") as mgr:
            mgr.wait()
        assert sp.info(f"{root}/step-110").save_id == newest, \
            "host A's stale local step 110 overwrote host B's newer remote step 110"


def test_restore_does_not_prefer_a_stale_local_copy_of_a_step(tmp_path: Path) -> None:
    """As above; host A restores.

    Expected: B's step 110 (state -110), the step committed last in the run.
    Observed: restore orders candidates by TieredManager.metadata (local first: A's stale
    110, committed before 105) and reads step 110 from local_dir whenever it is held
    there, without comparing save ids with the remote copy; combined with the upload
    above it resumes from 105 (and B's 110 is gone).
    Fix: treat a local step whose remote copy is a different, later save as stale
    (prefer the remote copy for metadata and restore; remove or ignore the local one).
    """
    with memory_scheme("mt-stale2") as _:
        root = "mt-stale2://run"
        _two_hosts_with_a_rollback(tmp_path, root)
        with _tiered(root, tmp_path / "a") as mgr:
            target = _values(0)
            step = mgr.restore(target)
        assert (step, float(target["w"][0])) == (110, -110.0)


def test_a_reader_manager_on_the_same_local_dir_closes_cleanly(tmp_path: Path) -> None:
    """A training job's manager (holding the remote lease) has uploaded step 1. An
    evaluation process opens a two-tier manager on the same local_dir and remote root, only
    to restore, then closes it.

    Expected: no upload is needed (the remote root holds the same save of step 1), so the
    reader touches no lease, emits no error and closes cleanly ("readers need no lease").
    Observed: the constructor queues step 1, _copy_step takes the remote root's lease
    *before* checking whether the remote already holds that save, gets LeaseHeld, emits
    error events, and close() raises StorageError "step(s) [1] ... not uploaded".
    Fix: in _copy_step, read the remote manifest first and skip (recording _uploaded) when
    its save id matches, as _send_files does for several nodes; only take the lease when
    something must be written.
    """
    remote = str(tmp_path / "remote")
    writer = _tiered(remote, tmp_path / "local")
    try:
        writer.save(1, _values(1))
        writer.wait()
        events: list[sp.Event] = []
        reader = _tiered(remote, tmp_path / "local", on_event=events.append)
        target = _values(0)
        assert reader.restore(target) == 1
        reader.close()  # raises StorageError today
        assert not [e for e in events if e.kind == "error"]
    finally:
        writer.close()


def test_a_failed_step_removed_from_local_dir_is_not_reported_forever(
    tmp_path: Path, flaky: Flaky
) -> None:
    """Step 1's upload failed during an outage; then step 1 is removed from local_dir (by
    hand to free space, or by `safepoint gc LOCAL_DIR`, which docs say applies the remote
    policy there). The store comes back.

    Expected: once step 1 is gone locally there is nothing to upload (the code says so:
    `except CheckpointNotFound: return  # deleted locally meanwhile`), so wait() succeeds
    after step 2 is uploaded.
    Observed: _upload returns on CheckpointNotFound without removing step 1 from
    self._failed, so every later wait() and close() raises StorageError "step(s) [1] are
    committed in <local_dir> but not uploaded" (false: it is not committed there).
    Fix: pop the step from _failed on CheckpointNotFound (perhaps with a log line).
    """
    mgr = _tiered("flaky-test://run", tmp_path / "local")
    try:
        flaky.failing = -1
        mgr.save(1, _values(1))
        with pytest.raises(sp.StorageError):
            mgr.wait()
        shutil.rmtree(tmp_path / "local" / "step-1")
        flaky.failing = 0
        mgr.save(2, _values(2))
        mgr.wait()  # raises StorageError naming step 1 today
        assert mgr.remote.steps() == [2]
    finally:
        with contextlib.suppress(sp.StorageError):
            mgr.close()


def test_incremental_save_after_a_rollback_survives_local_retention(tmp_path: Path) -> None:
    """Two tiers, incremental=True, keep_local=1. Steps 1..3 saved; the run rolls back
    (restore step 1) and saves 2 again, then 3 again. Save 3' shares step 2''s files (its
    lineage) while the uploader finishes uploading step 2'.

    Expected: save 3' commits (the base manager never deletes the step an incremental save
    shares with; retention keeps the step committed last).
    Observed: after uploading 2', _retain_local keeps only the newest keep_local steps by
    number, i.e. the abandoned branch's step 3, and deletes 2' in the uploader thread while
    save 3' is linking its files: the save fails with FileNotFoundError.
    (The storage hooks below only pin down the interleaving: the upload of 2' is held until
    save 3' reaches its link, and the link waits up to 2 s for step 2' to vanish.)
    Fix: _retain_local must keep the step the next incremental save shares with (the
    lineage, the step committed last), as base retention keeps "latest".
    """
    local_backend, remote_backend = MemoryBackend(), MemoryBackend()
    linking = threading.Event()
    armed = threading.Event()

    def local_storage(url: str, options: dict[str, Any] | None = None) -> FaultyStorage:
        def fail_on(op: str, path: str, n: int) -> bool:
            if armed.is_set() and op == "link":
                linking.set()
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline and any(
                        k.endswith("step-2/manifest.json") for k in local_backend.files()):
                    time.sleep(0.01)
            return False
        return FaultyStorage(local_backend(url, options), fail_on)

    def remote_storage(url: str, options: dict[str, Any] | None = None) -> FaultyStorage:
        def fail_on(op: str, path: str, n: int) -> bool:
            if armed.is_set() and op == "write" and url.rstrip("/").endswith("step-2"):
                linking.wait(2)
            return False
        return FaultyStorage(remote_backend(url, options), fail_on)

    storage_module.register("loc-inc", local_storage)
    storage_module.register("rem-inc", remote_storage)
    try:
        frozen = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB, shared
        mgr = _tiered("rem-inc://run", "loc-inc://local", keep_local=1, keep_last=None,
                       incremental=True)
        try:
            for step in (1, 2, 3):
                mgr.save(step, {"f": frozen, "w": np.full(10, float(step))})
                mgr.wait()
            target = {"f": np.zeros_like(frozen), "w": np.zeros(10)}
            assert mgr.restore(target, step=1) == 1
            armed.set()
            mgr.save(2, {"f": frozen, "w": np.full(10, 22.0)})
            mgr.save(3, {"f": frozen, "w": np.full(10, 33.0)})
            mgr.wait()  # FileNotFoundError from save 3' today
        finally:
            armed.clear()
            with contextlib.suppress(Exception):
                mgr.close()
    finally:
        storage_module._REGISTERED.pop("loc-inc", None)
        storage_module._REGISTERED.pop("rem-inc", None)


def test_two_tier_local_retention_never_removes_the_data_of_a_step_being_saved_again(
    tmp_path: Path, s3_server: Any, s3_url: str
) -> None:
    """Two tiers (local_dir, remote root on S3), keep_local=1. Steps 6 and 7 are saved; the
    run rolls back and saves step 6 again while the uploader finishes step 7.

    The new step 6 commits whole and restore() returns it (w == -6). The uploader's local
    retention used to see the old step 6 (its manifest stays until the new one is
    published), uploaded and not the newest, and delete every file under step-6/, the data
    file being written included: the new step 6 failed verify, its upload failed forever,
    and restore() fell back to the remote copy of the old step 6 without an error.

    Timing is pinned with a FaultyStorage over the real local disk that only delays (the
    new step-6 manifest's publish waits until the uploader has run retention) and an
    on_event callback; in production the window is the whole write of a large step.
    """
    options = s3_server.storage_options
    local = tmp_path / "local"
    armed, paused, deleted = threading.Event(), threading.Event(), threading.Event()

    def slow_local(url: str, storage_options: dict[str, Any] | None = None) -> FaultyStorage:
        def fail_on(op: str, path: str, n: int) -> bool:
            if (armed.is_set() and op == "publish" and path == "manifest.json"
                    and url.rstrip("/").endswith("/step-6")):
                paused.set()
                deleted.wait(5)
            return False  # never fails: it only holds the publish back

        return FaultyStorage(LocalStorage(url, storage_options), fail_on)

    def on_event(event: sp.Event) -> None:
        if not armed.is_set():
            return
        if event.kind == "upload" and event.step == 7:
            paused.wait(5)
        if event.kind == "delete" and event.step == 6 and "pause-local" in str(event.url):
            deleted.set()

    storage_module.register("pause-local", slow_local)
    mgr = sp.CheckpointManager(f"{s3_url}/run", local_dir=f"pause-local://{local}",
                               keep_local=1, keep_last=None, async_save=False,
                               storage_options=options, on_event=on_event)
    try:
        mgr.save(6, _state(6))
        mgr.wait()
        armed.set()
        mgr.save(7, _state(7))
        mgr.save(6, _state(-6))  # rolled back to step 6 and saved it again
        report = sp.verify(f"{local}/step-6")
        assert report.ok, report.problems
        target = _state(0)
        assert mgr.restore(target) == 6
        assert float(target["w"][0]) == -6.0
    finally:
        with contextlib.suppress(sp.SafepointError):
            mgr.close()
        storage_module._REGISTERED.pop("pause-local", None)


def test_restore_waits_for_the_local_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """restore() right after an asynchronous save restores that save's step once it commits
    in local_dir (it restored the step before)."""
    from safepoint import _manager as manager_module

    write = manager_module.write_and_commit

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return write(*args, **kwargs)

    with sp.CheckpointManager(str(tmp_path / "remote"), local_dir=str(tmp_path / "local"),
                              keep_local=1) as mgr:
        mgr.save(1, _state(1)).result()
        monkeypatch.setattr(manager_module, "write_and_commit", slow)
        mgr.save(2, _state(2))
        target = _state(0)
        assert mgr.restore(target) == 2
        assert target["step"] == 2


def test_a_bad_step_is_refused_as_a_safepoint_error(tmp_path: Path) -> None:
    """mgr.save([3], state) on a two-tier manager is a SafepointError saying what to pass (the
    count of steps being saved took it first: a bare TypeError)."""
    with sp.CheckpointManager(str(tmp_path / "remote"), local_dir=str(tmp_path / "local"),
                              async_save=False) as mgr:
        with pytest.raises(sp.SafepointError, match="whole number"):
            mgr.save([3], _state(3))  # type: ignore[arg-type]
        mgr.save(3, _state(3))
        assert mgr.steps() == [3]


def test_a_lenient_restore_from_local_dir_shares_nothing_with_the_next_save(
    tmp_path: Path,
) -> None:
    """docs/manager.md, Incremental saves: after a lenient restore (strict=False, which may
    skip entries) the manager's first save writes everything, sharing no bytes it has not
    seen checked. The two-tier manager's restore from its local copy shared them whatever
    `strict` said (found by a review)."""
    frozen = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB, never changes
    remote, local = str(tmp_path / "remote"), tmp_path / "local"
    with _manager(remote, local, [], keep_local=2, incremental=True) as mgr:
        mgr.save(1, {**_state(1), "frozen": frozen})
    first = sp.info(str(local / "step-1")).save_id
    with _manager(remote, local, [], keep_local=2, incremental=True) as mgr:
        target = {**_state(0), "frozen": np.zeros_like(frozen), "extra": np.zeros(3)}
        assert mgr.restore(target, strict=False) == 1  # "extra" is skipped
        mgr.save(2, {**_state(2), "frozen": frozen})
    names = [p.name for p in (local / "step-2" / "data").iterdir()]
    assert not [name for name in names if name.startswith(first)], names


def test_an_incremental_save_after_a_restore_that_read_lost_local_files_remotely(
    tmp_path: Path,
) -> None:
    """The local copy of step 1 lost its data file (its manifest is intact): restore reads
    it from the remote root, as designed, and the next saves write it anew. They tried to
    link the missing local file and failed with a raw FileNotFoundError, every one of them
    (found by a review)."""
    frozen = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB, never changes
    remote, local = str(tmp_path / "remote"), tmp_path / "local"
    with _manager(remote, local, [], keep_local=2, incremental=True) as mgr:
        mgr.save(1, {**_state(1), "frozen": frozen})
    for data in (local / "step-1" / "data").iterdir():
        data.unlink()
    with _manager(remote, local, [], keep_local=2, incremental=True) as mgr:
        target = {**_state(0), "frozen": np.zeros_like(frozen)}
        assert mgr.restore(target) == 1
        np.testing.assert_array_equal(target["frozen"], frozen)
        for step in (2, 3):
            mgr.save(step, {**_state(step), "frozen": frozen}).result()
    assert sp.verify(str(local / "step-3")).ok
    assert sp.verify(f"{remote}/step-3").ok


def test_an_incremental_save_after_a_restore_that_found_the_local_copy_damaged(
    tmp_path: Path,
) -> None:
    """One flipped bit in the local file that steps 1 and 2 share: restore reads step 2 from
    the remote root, as designed, but the next save still linked the damaged local file
    (the step saved last stayed the one shared with), so step 3 failed verify and every
    upload of it. The damage now drops what the next save shares with."""
    frozen = np.random.default_rng(0).standard_normal(1 << 20)  # 8 MiB, never changes
    remote, local = str(tmp_path / "remote"), tmp_path / "local"
    with _manager(remote, local, [], keep_local=2, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {**_state(step), "frozen": frozen})
        mgr.wait()
        flip_bit_of(local / "step-2", "frozen")
        target = {**_state(0), "frozen": np.zeros_like(frozen)}
        with pytest.warns(UserWarning, match="local copy of step 2 cannot be restored"):
            assert mgr.restore(target) == 2
        np.testing.assert_array_equal(target["frozen"], frozen)
        mgr.save(3, {**_state(3), "frozen": frozen}).result()
    assert sp.verify(str(local / "step-3")).ok
    assert sp.verify(f"{remote}/step-3").ok


def test_restore_reads_the_remote_copy_when_the_local_disk_fails_to_read(
    tmp_path: Path, flaky: Flaky
) -> None:
    """README: restore reads a step's local copy when it is there and intact, and falls
    back to the remote copy. A local disk that fails to read (EIO, a StorageError: a failing
    NVMe, a common reason for the restart) made restore raise, although the remote root
    holds the same save (found by a review)."""
    events: list[sp.Event] = []
    with _manager("flaky-test://remote", "flaky-test://local", events) as mgr:
        mgr.save(1, _state(1))
    flaky.fails = lambda url, op, path: (url.startswith("flaky-test://local")
                                         and op in ("read", "readinto")
                                         and path.startswith("data/"))
    with _manager("flaky-test://remote", "flaky-test://local", events) as mgr:
        target = _state(0)
        with pytest.warns(UserWarning, match="local copy of step 1 cannot be restored"):
            assert mgr.restore(target) == 1
    np.testing.assert_array_equal(target["w"], _state(1)["w"])
    assert target["step"] == 1
    failed = [e for e in events if e.kind == "error"]
    assert [(e.step, e.url) for e in failed] == [(1, "flaky-test://local/step-1")]
    assert "StorageError" in str(failed[0].error)
    assert events[-1].kind == "load" and events[-1].url == "flaky-test://remote/step-1"


def test_a_reader_racing_the_writers_retention_restores_the_step_committed_meanwhile(
    tmp_path: Path, flaky: Flaky
) -> None:
    """docs/manager.md, Restore and fallback: a step that vanished makes restore list the
    steps again, so a reader that lost its step to the writer's retention restores the one
    the writer committed meanwhile. A two-tier reader (an empty local_dir: an evaluation
    job, a restart on a new host) never listed again and raised CheckpointNotFound (found
    by a review)."""
    with sp.CheckpointManager("flaky-test://run", keep_last=1, async_save=False) as writer:
        writer.save(1, _state(1))
        racing: list[str] = []

        def writer_commits_step_2(url: str, op: str, path: str) -> bool:
            if op in ("read", "readinto") and path.startswith("data/") and not racing:
                racing.append(url)
                writer.save(2, _state(2))  # its retention deletes step 1 under the reader
            return False  # fails nothing

        flaky.fails = writer_commits_step_2
        with _manager("flaky-test://run", tmp_path / "reader", []) as reader:
            target = _state(0)
            with pytest.warns(UserWarning, match="step 1 cannot be restored"):
                assert reader.restore(target) == 2
        assert racing == ["flaky-test://run/step-1"]
    np.testing.assert_array_equal(target["w"], _state(2)["w"])
    assert target["step"] == 2


def test_a_local_dir_of_another_run_is_refused(tmp_path: Path) -> None:
    """A node's local_dir (the same path in every job's config) holds job A's steps; job B,
    requeued on that node with a root of its own, resumed from A's newest step, uploaded it
    into B's root and let B's retention delete B's own steps there (found by a review). The
    local_dir records its remote root on first use, and a manager of another root is
    refused, naming the local_dir, both roots and what to do; nothing is changed."""
    root_a, root_b = str(tmp_path / "job-a"), str(tmp_path / "job-b")
    shared = tmp_path / "nvme"
    with _manager(root_b, tmp_path / "other-node", [], keep_last=3) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, _state(step))
    with _manager(root_a, shared, [], keep_last=3) as mgr:
        mgr.save(5000, _state(5000))
    with pytest.raises(sp.SafepointError) as refused:
        _manager(root_b, shared, [], keep_last=3)
    message = str(refused.value)
    assert str(shared) in message and root_a in message and root_b in message
    assert "its own local_dir" in message
    with sp.CheckpointManager(root_b) as mgr:
        assert mgr.steps() == [100, 200, 300]
    with sp.CheckpointManager(str(shared)) as mgr:
        assert mgr.steps() == [5000]
    with _manager(root_a, shared, []) as mgr:  # its own run reopens it as before
        assert mgr.restore(_state(0)) == 5000


@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_a_local_dir_that_overlaps_the_root_is_refused(tmp_path: Path, where: str) -> None:
    """local_dir equal to the root, inside it or holding it was accepted: each tier's
    retention then deleted the other's steps and no step had a second copy (found by a
    review). It is refused when the manager is made, naming both; nothing is written."""
    root = tmp_path / "run"
    local = {"same": root, "inside": root / "local", "holding": tmp_path}[where]
    with pytest.raises(sp.SafepointError, match="overlap") as refused:
        sp.CheckpointManager(f"file://{root}" if where == "same" else str(root),
                             local_dir=str(local) + "/")
    assert str(local) in str(refused.value) and "local_dir outside the root" in str(
        refused.value)
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.parametrize("exists", [True, False], ids=["made", "not-made-yet"])
def test_local_dir_that_is_the_root_through_a_link_is_refused_or_loses_nothing(
    tmp_path: Path, exists: bool
) -> None:
    """local_dir spelled through a symbolic link to the root's filesystem ($SCRATCH ->
    the shared one, as on many clusters) was accepted: the paths differ as written, and
    local retention (keep_local=1) then deleted the root's steps that keep_last=3 kept. It
    is refused as the same path is, whether the directories exist yet or not."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "shared")
    if exists:
        (tmp_path / "shared" / "run1").mkdir()
    root, local = tmp_path / "shared" / "run1", tmp_path / "scratch" / "run1"
    with pytest.raises(sp.SafepointError, match="overlap") as refused:
        sp.CheckpointManager(str(root), local_dir=str(local), keep_local=1, keep_last=3)
    assert str(local) in str(refused.value)
    assert not root.exists() or not any(root.iterdir())


def test_a_local_dir_from_before_the_root_was_recorded_is_adopted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A local_dir with steps but no record of its remote root (an earlier safepoint's) is
    taken as the run's own, said in the log, and recorded: another root is refused then."""
    remote, local = str(tmp_path / "remote"), tmp_path / "local"
    with _manager(remote, local, [], keep_local=2) as mgr:
        mgr.save(1, _state(1))
    (local / "remote.json").unlink()
    with caplog.at_level("INFO", logger="safepoint._tiered"), \
            _manager(remote, local, [], keep_local=2) as mgr:
        assert mgr.restore(_state(0)) == 1
    assert "records no remote root" in caplog.text
    assert json.loads((local / "remote.json").read_text()) == {"root": remote}
    with pytest.raises(sp.SafepointError, match="belongs to another run"):
        _manager(str(tmp_path / "elsewhere"), local, [])


@pytest.mark.filterwarnings("ignore:datetime.datetime.utcnow:DeprecationWarning")
def test_a_root_spelled_another_way_is_the_same_run(
    tmp_path: Path, s3_server: Any, s3_url: str
) -> None:
    """A requeued job whose config spells its remote root with a trailing slash (or without
    it) names the same prefix: its local_dir was refused as
    another run's, advising to empty it, which loses the steps not uploaded yet (found by a
    review). local_dir records the root as the place it names; a record an earlier safepoint
    wrote, the root as spelled, is accepted the same way. Another root is still refused."""
    options = s3_server.storage_options
    local = tmp_path / "local"
    with _manager(f"{s3_url}/run/", local, [], storage_options=options) as mgr:
        mgr.save(1, _state(1)).result()
    assert json.loads((local / "remote.json").read_text()) == {"root": f"{s3_url}/run"}
    with _manager(f"{s3_url}/run", local, [], storage_options=options) as mgr:
        assert mgr.steps() == [1]
    (local / "remote.json").write_text(json.dumps({"root": f"{s3_url}/run/"}))
    with _manager(f"{s3_url}/run", local, [], storage_options=options) as mgr:
        assert mgr.steps() == [1]
    with pytest.raises(sp.SafepointError, match="belongs to another run"):
        _manager(f"{s3_url}/other", local, [], storage_options=options)


def test_a_local_root_spelled_another_way_is_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local remote root is compared as `LocalStorage` opens it: relative or absolute,
    plain or file://, with a trailing slash or not."""
    remote, local = tmp_path / "remote", tmp_path / "local"
    monkeypatch.chdir(tmp_path)
    with _manager("remote/", local, [], keep_local=2) as mgr:
        mgr.save(1, _state(1))
    assert json.loads((local / "remote.json").read_text()) == {"root": str(remote)}
    for spelled in (str(remote), f"file://{remote}/", "./remote"):
        with _manager(spelled, local, [], keep_local=2) as mgr:
            assert mgr.steps() == [1]


@pytest.mark.multiprocess
def test_a_script_ending_right_after_save_uploads_the_step(tmp_path: Path) -> None:
    """README: a two-tier manager dropped without close() finishes its uploads. In a script
    that returned right after `save` the uploader, a daemon thread, was stopped at exit: the
    step was committed in local_dir only, and nothing said so (a spot node's local disk goes
    with the node)."""
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    code = textwrap.dedent("""
        import sys, numpy as np, safepoint as sp
        mgr = sp.CheckpointManager(sys.argv[1], local_dir=sys.argv[2])
        mgr.save(1, {"w": np.arange(3_000_000, dtype=np.float32)})
    """)
    done = subprocess.run([sys.executable, "-c", code, remote, local], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and "Error" not in done.stderr, done.stderr[-2000:]
    with sp.CheckpointManager(remote) as mgr:
        assert mgr.steps() == [1]
        state = {"w": np.zeros(3_000_000, dtype=np.float32)}
        mgr.restore(state)
        assert np.array_equal(state["w"], np.arange(3_000_000, dtype=np.float32))


# -- local_dir bounded: stale copies, superseded uploads, no remote reads on the save path --


def _local_steps(local: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-"))
                  for p in local.glob("step-*/manifest.json"))


def test_a_stale_local_copy_is_removed_from_local_dir(tmp_path: Path) -> None:
    """Host A's local_dir keeps step 110 of the abandoned branch; the job ran on host B
    since and saved step 110 anew. Reopened on host A, the manager neither uploads nor
    restores A's copy (it is stale), yet local retention kept it in local_dir forever,
    whatever keep_local said. It is removed now, with a delete event, and the newer remote
    step 110 stays as it is."""
    with memory_scheme("mt-stale3") as _:
        root = "mt-stale3://run"
        newest = _two_hosts_with_a_rollback(tmp_path, root)
        assert _local_steps(tmp_path / "a") == [110]
        events: list[sp.Event] = []
        with _tiered(root, tmp_path / "a", keep_local=3, on_event=events.append) as mgr:
            mgr.wait()
            assert _local_steps(tmp_path / "a") == []
            assert [(e.step, e.url) for e in events if e.kind == "delete"] == [
                (110, mgr.step_url(110))]
        assert sp.info(f"{root}/step-110").save_id == newest


def test_a_new_save_of_a_step_once_stale_here_is_kept_as_the_newest(tmp_path: Path) -> None:
    """Back on host A, whose stale step 110 was removed, the job rolls back and saves step
    110 anew there. The manager still took the number for a stale copy, so once the new
    save was uploaded local retention deleted it, though it is the newest local step."""
    with memory_scheme("mt-stale4") as _:
        root = "mt-stale4://run"
        _two_hosts_with_a_rollback(tmp_path, root)
        with _tiered(root, tmp_path / "a", keep_local=1) as mgr:
            mgr.wait()
            assert _local_steps(tmp_path / "a") == []
            mgr.save(110, _values(7))
            mgr.wait()
            assert _local_steps(tmp_path / "a") == [110]
            assert sp.info(mgr.step_url(110)).save_id == sp.info(f"{root}/step-110").save_id


def test_a_rolled_back_step_replaces_the_remote_save_it_abandons(
    tmp_path: Path, flaky: Flaky
) -> None:
    """The remote root holds step 2 of an abandoned branch, kept as the best; the run saves
    step 2 anew (worse), then step 3, while the store is down. Retried, the new step 2 is
    one no rule keeps, but skipping its upload left the abandoned save there, kept as best
    by its own metric, for a restore to fall back to. It is uploaded now, replacing it."""
    mgr = _tiered("flaky-test://run", tmp_path / "local", keep_last=1, keep_best=1,
                  best_metric="loss", keep_local=1, async_save=False)
    try:
        mgr.save(1, _values(1), metrics={"loss": 3.0})
        mgr.save(2, _values(2), metrics={"loss": 0.1})
        mgr.wait()
        abandoned = sp.info("flaky-test://run/step-2").save_id
        flaky.down = True
        for step, loss in ((2, 5.0), (3, 4.0)):
            mgr.save(step, _values(-step), metrics={"loss": loss})
            with pytest.raises(sp.StorageError):
                mgr.wait()
        flaky.down = False
        mgr.wait()
        remote = mgr.remote.steps()
        assert 3 in remote
        assert 2 not in remote or sp.info("flaky-test://run/step-2").save_id != abandoned
    finally:
        flaky.down = False
        mgr.close()


def test_a_local_copy_older_than_no_remote_save_is_kept(tmp_path: Path, flaky: Flaky) -> None:
    """Only a later remote save makes a local copy stale: a step the remote root never
    committed stays in local_dir (it is the only copy of its save), however many newer
    steps the remote root holds."""
    mgr = _tiered("flaky-test://run", tmp_path / "local", keep_local=1)
    try:
        flaky.failing = -1
        mgr.save(1, _values(1))
        with pytest.raises(sp.StorageError):
            mgr.wait()
    finally:
        with contextlib.suppress(sp.StorageError):
            mgr.close()
    flaky.failing = 0
    with _tiered("flaky-test://run", tmp_path / "other", keep_local=1) as other:
        other.save(2, _values(2))
    flaky.failing = -1  # step 1 cannot be uploaded when its manager is opened again
    mgr = _tiered("flaky-test://run", tmp_path / "local", keep_local=1)
    try:
        with pytest.raises(sp.StorageError, match=r"step\(s\) \[1\]"):
            mgr.wait()
    finally:
        with contextlib.suppress(sp.StorageError):
            mgr.close()
    assert _local_steps(tmp_path / "local") == [1]


@pytest.mark.parametrize(("options", "uploaded", "remote"), [
    ({"keep_last": 1}, [1, 4], [4]),
    ({"keep_last": 1, "keep_every": 2}, [1, 2, 4], [2, 4]),
    ({"keep_last": 1, "keep_best": 1, "best_metric": "loss"}, [1, 3, 4], [3, 4]),
    ({"keep_last": 3}, [1, 2, 3, 4], [2, 3, 4]),
])
def test_steps_superseded_while_a_slow_upload_runs_are_not_uploaded(
    tmp_path: Path, flaky: Flaky, caplog: pytest.LogCaptureFixture,
    options: dict[str, Any], uploaded: list[int], remote: list[int],
) -> None:
    """The remote root is slower than the saves: steps 2-4 commit while step 1 uploads.
    Uploads ran in order, and local_dir kept every step not uploaded, so a remote slower
    than the save rate let it grow without bound, every step uploaded only to be deleted
    there by retention. A waiting step the remote policy would delete at once, given the
    newer steps committed, is now skipped (said in the log) and removed from local_dir like
    an uploaded one; a step any rule keeps still uploads, in order."""
    started, release = threading.Event(), threading.Event()

    def slow(url: str, path: str) -> None:
        if url.endswith("/step-1"):
            started.set()
            release.wait(20)

    flaky.on_write = slow
    events: list[sp.Event] = []
    loss = {1: 5.0, 2: 4.0, 3: 1.0, 4: 3.0}
    local = tmp_path / "local"
    with _manager("flaky-test://run", local, events, keep_local=1, async_save=False,
                  **options) as mgr:
        mgr.save(1, _state(1), metrics={"loss": loss[1]})
        assert started.wait(10)  # step 1's upload is under way: it is not skipped
        for step in (2, 3, 4):
            mgr.save(step, _state(step), metrics={"loss": loss[step]})
        assert _local_steps(local) == [1, 2, 3, 4]
        with caplog.at_level("INFO", logger="safepoint._tiered"):
            release.set()
            mgr.wait()
        assert [e.step for e in events if e.kind == UPLOAD] == uploaded
        assert mgr.remote.steps() == remote
        assert _local_steps(local) == [4]
    skipped = sorted(set(range(1, 5)) - set(uploaded))
    assert [r.getMessage().split()[1] for r in caplog.records
            if "superseded" in r.getMessage()] == [str(step) for step in skipped]
    assert [e.step for e in events if e.kind == "delete" and e.url.startswith(str(local))
            ] == [1, 2, 3]


def test_local_dir_stays_bounded_while_the_remote_root_is_down(
    tmp_path: Path, flaky: Flaky
) -> None:
    """During an outage every upload fails; local_dir kept every step since, without
    bound. It now holds the steps the remote policy will keep once they arrive (keep_last
    here) plus keep_local, and uploads them once the store is back."""
    local = tmp_path / "local"
    mgr = _tiered("flaky-test://run", local, keep_last=2, keep_local=1, async_save=False)
    try:
        mgr.save(1, _values(1))
        mgr.wait()
        flaky.down = True
        for step in range(2, 8):
            mgr.save(step, _values(step))
            with pytest.raises(sp.StorageError):
                mgr.wait()
            assert len(_local_steps(local)) <= 2, _local_steps(local)
        assert _local_steps(local) == [6, 7]
        flaky.down = False
        mgr.wait()
        assert mgr.remote.steps() == [6, 7]
        assert _local_steps(local) == [7]
    finally:
        flaky.down = False
        mgr.close()


def test_the_first_save_after_opening_reads_no_remote_manifest(
    tmp_path: Path, flaky: Flaky
) -> None:
    """Training unblocks at local-disk speed: the first commit after a manager was opened
    ran the local tier's retention, which read every local step's manifest and, for each,
    the remote one (to tell a stale copy), on the save's path: with an object store and
    several steps kept locally, as many round trips before the save returned. Nothing on
    the save's path reads a remote manifest now; the uploader does what it needs."""
    local = tmp_path / "local"
    with _tiered("flaky-test://run", local, keep_local=4, keep_last=None) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _values(step))
    gate = threading.Event()
    reads: list[str] = []

    def watch(url: str, op: str, path: str) -> bool:
        if threading.current_thread().name == "safepoint-upload":
            gate.wait(10)  # the uploader reads what it needs: after the save returned
        elif op in ("read", "readinto") and path.endswith("manifest.json"):
            reads.append(url)
        return False

    mgr = _tiered("flaky-test://run", local, keep_local=4, keep_last=None, async_save=False)
    try:
        mgr.wait()  # the steps found there are uploaded already
        flaky.fails = watch
        mgr.save(5, _values(5))
        assert reads == []
    finally:
        gate.set()
        mgr.close()
    with sp.CheckpointManager("flaky-test://run") as remote:
        assert remote.steps() == [1, 2, 3, 4, 5]
