"""CheckpointManager end to end, on a local directory and on the mem-test:// memory backend:
steps and restore, asynchronous saves independent of later mutation, at most one in flight,
background failures surfacing at the next call with the previous step intact, retention,
leftover cleanup, one writer per root, fallback past a corrupt step, and SIGKILL at random
moments of async saves, sync saves and retention deletes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import gc
import json
import math
import os
import posixpath
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from _states import flip_bit_of
from safepoint import _manager as manager_module
from safepoint import storage as sp_storage
from safepoint._commit import manifest_at, wait_for_removals
from safepoint._format import MANIFEST
from safepoint._manager import unreadable
from safepoint._snapshot import WRITER_BYTES
from safepoint._storage_local import LocalStorage
from safepoint.testing import FaultyStorage, MemoryBackend, fail_nth, memory_scheme


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "run")
    else:
        with memory_scheme("mem-test"):
            yield "mem-test://run"


def make_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 200, generator=gen), "b": torch.randn(200, generator=gen)},
        "opt": {"m": torch.randn(300, 200, generator=gen).t()},
        "np": np.arange(100, dtype=np.float64) * seed,
        "step": seed,
        "tag": f"s{seed}",
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(300, 200), "b": torch.zeros(200)},
        "opt": {"m": torch.zeros(200, 300)},
        "np": np.zeros(100),
        "step": -1,
        "tag": "",
    }


def assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["model"]["w"], b["model"]["w"])
    assert torch.equal(a["model"]["b"], b["model"]["b"])
    assert torch.equal(a["opt"]["m"], b["opt"]["m"])
    np.testing.assert_array_equal(a["np"], b["np"])
    assert (a["step"], a["tag"]) == (b["step"], b["tag"])


@pytest.mark.parametrize("async_save", [True, False])
def test_save_list_restore(root: str, async_save: bool) -> None:
    with sp.CheckpointManager(root, keep_last=None, async_save=async_save) as mgr:
        assert mgr.latest_step() is None
        assert mgr.restore(blank()) is None
        for step in (5, 10, 15):
            handle = mgr.save(step, make_state(step), metrics={"loss": 1 / step},
                              metadata={"epoch": step // 5})
        assert handle.result().step == 15
        assert mgr.steps() == [5, 10, 15]
        assert mgr.latest_step() == 15
        target = blank()
        assert mgr.restore(target) == 15
        assert_state_equal(target, make_state(15))
        assert mgr.restore(target, step=5) == 5
        assert_state_equal(target, make_state(5))
        info = mgr.metadata(10)
        assert (info.metrics, info.metadata, info.step) == ({"loss": 0.1}, {"epoch": 2}, 10)
        with pytest.raises(sp.CheckpointNotFound):
            mgr.restore(blank(), step=7)
    # Every step is a normal checkpoint, readable without a manager and without a lease.
    assert sp.load(f"{root}/step-10")["tag"] == "s10"
    assert sp.verify(f"{root}/step-15").ok
    assert sp.CheckpointManager(root).steps() == [5, 10, 15]


@pytest.mark.parametrize("async_save", [True, False])
def test_tied_weights_and_pieces_of_global_tensors_in_one_process(
    root: str, async_save: bool
) -> None:
    """Tied weights are saved once (asynchronous saves stage them once) and restore tied; an
    `sp.Shard` in a single process's state takes the collective path, as `sp.save` does."""
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight
    with sp.CheckpointManager(root, async_save=async_save) as mgr:
        for step in (1, 2):  # the second asynchronous save reuses the staging plan
            with torch.no_grad():
                model[0].weight.add_(1)
            mgr.save(step, {"model": model})
        mgr.wait()
        kinds = {e.path: e.kind for e in sp.info(f"{root}/step-2").entries}
        assert kinds == {"model/0.weight": "tensor", "model/1.weight": "alias"}
        fresh = torch.nn.Sequential(torch.nn.Embedding(50, 8),
                                    torch.nn.Linear(8, 50, bias=False))
        fresh[1].weight = fresh[0].weight
        assert mgr.restore({"model": fresh}) == 2
        assert fresh[1].weight is fresh[0].weight
        assert torch.equal(fresh[0].weight, model[0].weight)
        piece = sp.Shard(torch.arange(4.0), (0,), (4,))
        mgr.save(3, {"piece": piece, "step": 3})
        mgr.wait()
        target = {"piece": sp.Shard(torch.zeros(4), (0,), (4,)), "step": 0}
        assert mgr.restore(target) == 3
        assert torch.equal(target["piece"].tensor, torch.arange(4.0)) and target["step"] == 3


def test_mutating_after_async_save_does_not_change_what_was_saved(root: str) -> None:
    state = make_state(3)
    expected = make_state(3)
    with sp.CheckpointManager(root) as mgr:
        handle = mgr.save(1, state)
        state["model"]["w"].add_(100)
        state["opt"]["m"].zero_()
        state["np"][:] = -5
        state["step"] = 99
        handle.result()
        assert_state_equal(sp.load(f"{root}/step-1"), expected)


def test_a_series_of_saves_writes_each_state_as_it_was_when_save_returned(tmp_path: Path) -> None:
    """Later saves reuse the staging plan: tensors changed at their paths between saves (new
    memory under the same object, other strides or bits on the same memory) and mutated right
    after `save` returns must still be written exactly as they were when it returned."""
    gen = torch.Generator().manual_seed(4)
    small = {f"t{i}": torch.randn(10 + i, generator=gen).to(
        [torch.float32, torch.bfloat16, torch.int64][i % 3]) for i in range(60)}
    state: dict[str, Any] = {"small": small, "square": torch.randn(8, 8, generator=gen),
                             "c": torch.randn(6, dtype=torch.complex64, generator=gen)}
    changes = [
        lambda: None,
        lambda: setattr(small["t0"], "data", torch.randn(10, generator=gen)),
        lambda: small["t3"].set_(torch.randn(13, generator=gen)),
        lambda: state["square"].t_(),
        lambda: state.update(c=state["c"].conj()),
        lambda: small.update(t4=torch._neg_view(small["t4"].float())),
        lambda: small["t6"].resize_(3),
    ]
    expected: dict[int, bytes] = {}
    with sp.CheckpointManager(str(tmp_path), keep_last=None) as mgr:
        for step, change in enumerate(changes):
            change()
            expected[step] = _bytes_of(state)
            mgr.save(step, state)
            with torch.no_grad():  # training goes on at once
                for value in [*small.values(), state["square"], state["c"]]:
                    value.add_(1)
        mgr.wait()
    for step in expected:
        assert _bytes_of(sp.load(f"{tmp_path}/step-{step}")) == expected[step], step


def _bytes_of(state: dict[str, Any]) -> bytes:
    """The values, dtypes and shapes of a state's tensors, as one byte string."""
    tensors = [state["square"], state["c"], *state["small"].values()]
    return b"".join(repr((t.dtype, tuple(t.shape))).encode() + t.resolve_conj().resolve_neg()
                    .contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def test_an_error_in_the_block_is_not_masked_by_a_failed_save(failing: FailingBackend) -> None:
    with pytest.raises(KeyError, match="the block's own"), \
            sp.CheckpointManager("mem-fail://run") as mgr:
        mgr.save(2, make_state(2))  # fails in the background
        raise KeyError("the block's own")


def test_at_most_one_save_in_flight(root: str) -> None:
    with sp.CheckpointManager(root, keep_last=None) as mgr:
        first = mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
        assert first.done()


def test_same_step_is_replaced(root: str) -> None:
    with sp.CheckpointManager(root) as mgr:
        mgr.save(4, make_state(1))
        mgr.save(4, make_state(2)).result()
        assert mgr.steps() == [4]
        assert sp.load(f"{root}/step-4")["tag"] == "s2"


def test_retention_applies_after_each_commit(root: str) -> None:
    with sp.CheckpointManager(root, keep_last=2, keep_every=4, keep_best=1,
                              best_metric="acc", best_mode="max") as mgr:
        for step in range(1, 11):
            mgr.save(step, make_state(step), metrics={"acc": 1.0 if step == 3 else 0.1})
        mgr.wait()
        assert mgr.steps() == [3, 4, 8, 9, 10]
        assert mgr.kept()[3] == ["best"]


def test_leftovers_are_removed_by_the_writer_only(tmp_path: Path) -> None:
    root = tmp_path / "run"
    sp.save(str(root / "step-1"), make_state(1))
    leftover = root / "step-2" / "data" / "x.bin"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a save")
    reader = sp.CheckpointManager(str(root))
    assert reader.steps() == [1]
    assert reader.restore(blank()) == 1
    assert leftover.exists()  # readers never delete
    with sp.CheckpointManager(str(root)) as writer:
        writer.save(3, make_state(3))
    assert not (root / "step-2").exists()


class FailingBackend(MemoryBackend):
    """Memory storage whose data writes fail for the steps named."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing

    def __call__(self, url: str, storage_options: dict[str, Any] | None = None) -> Any:
        inner = super().__call__(url, storage_options)
        if url.rsplit("/", 1)[-1] in self.failing:
            return FaultyStorage(inner, fail_nth("write_chunk", 1))
        return inner


@pytest.fixture
def failing() -> Iterator[FailingBackend]:
    backend = FailingBackend({"step-2"})
    sp_storage.register("mem-fail", backend)
    try:
        yield backend
    finally:
        sp_storage._REGISTERED.pop("mem-fail", None)


@pytest.mark.parametrize("surface", ["wait", "save", "close", "result"])
def test_background_failure_surfaces_and_previous_step_restores(
    failing: FailingBackend, surface: str
) -> None:
    events: list[sp.Event] = []
    mgr = sp.CheckpointManager("mem-fail://run", on_event=events.append)
    mgr.save(1, make_state(1)).result()
    handle = mgr.save(2, make_state(2))  # staged; the write fails in the background
    with pytest.raises(sp.StorageError, match="injected"):
        if surface == "wait":
            mgr.wait()
        elif surface == "save":
            mgr.save(3, make_state(3))
        elif surface == "close":
            mgr.close()
        else:
            handle.result()
    if surface == "result":
        mgr.wait()  # already reported through the handle: not raised twice
    errors = [e for e in events if e.kind == "error"]
    assert len(errors) == 1 and errors[0].step == 2 and "injected" in (errors[0].error or "")
    reader = sp.CheckpointManager("mem-fail://run")
    assert reader.steps() == [1]
    target = blank()
    assert reader.restore(target) == 1
    assert_state_equal(target, make_state(1))
    assert not [p for p in failing.files() if p.startswith("run/step-2")]
    mgr.close()


def test_a_failure_seen_through_handle_exception_is_not_raised_again(
    failing: FailingBackend,
) -> None:
    """`handle.exception()` reports a background failure as `result()` does: the next save
    is made instead of raising it a second time (and being skipped)."""
    with sp.CheckpointManager("mem-fail://run") as mgr:
        mgr.save(1, make_state(1)).result()
        error = mgr.save(2, make_state(2)).exception()
        assert isinstance(error, sp.StorageError) and "injected" in str(error)
        mgr.save(3, make_state(3)).result()
        assert mgr.steps() == [1, 3]


def test_two_managers_on_one_root(root: str) -> None:
    first = sp.CheckpointManager(root)
    second = sp.CheckpointManager(root)
    first.save(1, make_state(1)).result()
    with pytest.raises(sp.LeaseHeld, match="one writer per root"):
        second.save(2, make_state(2))
    assert second.steps() == [1]  # reading needs no lease
    assert second.restore(blank()) == 1
    first.close()
    second.save(2, make_state(2)).result()
    second.close()
    assert sp.CheckpointManager(root).steps() == [1, 2]


def corrupt_newest_data(root: Path, step: int) -> None:
    data = next((root / f"step-{step}" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_fallback_restore_past_a_corrupt_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    events: list[sp.Event] = []
    with sp.CheckpointManager(str(root), keep_last=None, on_event=events.append) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state(step))
    corrupt_newest_data(root, 3)
    mgr = sp.CheckpointManager(str(root), on_event=events.append)
    target = blank()
    calls: list[tuple[int, int]] = []
    with pytest.warns(UserWarning, match="step 3 .* cannot be restored.*checksum.*trying step 2"):
        assert mgr.restore(target, progress=lambda *call: calls.append(call)) == 2
    assert_state_equal(target, make_state(2))
    # Progress starts again at 0 for step 2, and ends with all of its bytes.
    total = calls[-1][1]
    assert calls.count((0, total)) == 2 and calls[-1] == (total, total)
    assert [e.step for e in events if e.kind == "error"] == [3]
    assert events[-1].kind == "load" and events[-1].step == 2
    strict = sp.CheckpointManager(str(root), fallback=False)
    with pytest.raises(sp.CorruptCheckpoint):
        strict.restore(blank())


@pytest.mark.parametrize("writer", ["retention", "overwrite"])
def test_a_readers_restore_racing_the_writer_restores_what_it_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """An evaluation job restores the newest step of a root a trainer writes (readers need no
    lease). Retention: right after the reader listed steps 1-3, the trainer commits step 4
    and deletes 1-3 (keep_last=1); the reader raised CheckpointNotFound for step 1, though
    step 4 was committed. Overwrite: the step the reader loads is saved again meanwhile (a
    rollback's re-save); listed again, it was passed over as tried, and the reader restored
    the step before it."""
    from safepoint._storage_local import LocalStorage

    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False, keep_last=None) as trainer:
        for step in (1, 2, 3):
            trainer.save(step, make_state(step))
    fired: list[str] = []

    def trainer_acts() -> None:
        fired.append(writer)
        if writer == "retention":
            with sp.CheckpointManager(str(root), async_save=False, keep_last=1) as later:
                later.save(4, make_state(4))
        else:
            sp.save(str(root / "step-3"), make_state(33), overwrite=True)
            wait_for_removals()

    class RacingTheTrainer(LocalStorage):
        def list(self, prefix: str = "") -> list[str]:
            found = super().list(prefix)
            if writer == "retention" and prefix == "" and not fired:
                trainer_acts()
            return found

        def readinto_stretches(self, path: str, *args: Any) -> Any:
            if writer == "overwrite" and self.url.endswith("step-3") and not fired:
                trainer_acts()
            return super().readinto_stretches(path, *args)

    monkeypatch.setitem(sp_storage._REGISTERED, "racing",
                        lambda url, options: RacingTheTrainer(url.partition("://")[2]))
    target = blank()
    with warnings.catch_warnings(record=True) as warned, \
            sp.CheckpointManager(f"racing://{root}") as reader:
        warnings.simplefilter("always")
        restored = reader.restore(target)
    assert fired
    if writer == "retention":
        assert restored == 4
        assert_state_equal(target, make_state(4))
        assert re.search("step 3 .* cannot be restored: .*no committed.*trying step 4",
                         str(warned[0].message))
    else:  # the load itself reads the step saved anew (sp.load does): nothing to warn of
        assert restored == 3
        assert_state_equal(target, make_state(33))
        assert not warned


def test_a_relative_root_names_the_same_place_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that changes directory after making its manager (Hydra's per-run chdir): the
    steps' URLs were made from the relative root at each call, so step 2 was committed under
    the new working directory, outside the root the manager lists and leases, and restore
    failed on a step it had listed."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    with sp.CheckpointManager("run", async_save=False, keep_last=None) as mgr:
        mgr.save(1, make_state(1))
        monkeypatch.chdir(tmp_path / "elsewhere")
        mgr.save(2, make_state(2))
        assert mgr.steps() == [1, 2] and mgr.root == str(tmp_path / "run")
        target = blank()
        assert mgr.restore(target) == 2
    assert_state_equal(target, make_state(2))
    assert not (tmp_path / "elsewhere" / "run").exists()


def test_a_corrupt_step_passed_over_is_not_read_again_when_a_later_one_vanishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 3 fails its checksums, step 2 is deleted while it loads (the writer's retention):
    the steps listed again put the corrupt step 3 back among those to try, and it was read
    and reported again before step 1."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=None, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state(step))
    corrupt_newest_data(root, 3)
    load = manager_module.load
    loaded: list[str] = []

    def deleting_step_2(url: str, **kwargs: Any) -> Any:
        loaded.append(url.rsplit("/", 1)[-1])
        if loaded == ["step-3", "step-2"]:
            shutil.rmtree(root / "step-2")
        return load(url, **kwargs)

    monkeypatch.setattr(manager_module, "load", deleting_step_2)
    events: list[sp.Event] = []
    target = blank()
    with pytest.warns(UserWarning), \
            sp.CheckpointManager(str(root), on_event=events.append) as reader:
        assert reader.restore(target) == 1
    assert loaded == ["step-3", "step-2", "step-1"]
    assert [e.step for e in events if e.kind == "error"] == [3, 2]
    assert_state_equal(target, make_state(1))


def test_restore_after_a_rollback_resumes_the_rolled_back_branch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A loss spike at step 110: the run restores 100, trains on and saves 105, then dies.
    The restart resumes from 105, the step committed last, not from the abandoned 110; when
    105 is corrupt it falls back to 100; step=110 still restores 110."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=None, async_save=False) as mgr:
        for step in (50, 100, 110):
            mgr.save(step, make_state(step))
        assert mgr.restore(blank(), step=100) == 100
        mgr.save(105, make_state(105))
    with sp.CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [50, 100, 105, 110] and mgr.latest_step() == 110
        target = blank()
        with caplog.at_level("WARNING", logger="safepoint"):
            assert mgr.restore(target) == 105
        assert_state_equal(target, make_state(105))
        assert "steps [110] under" in caplog.text and "restoring from step 105" in caplog.text
        assert mgr.restore(target, step=110) == 110
        assert_state_equal(target, make_state(110))
    corrupt_newest_data(root, 105)
    with sp.CheckpointManager(str(root)) as mgr:
        with pytest.warns(UserWarning, match="step 105 .* cannot be restored.*trying step 100"):
            assert mgr.restore(target) == 100
        assert_state_equal(target, make_state(100))


def test_restore_reads_the_steps_manifests_side_by_side() -> None:
    """Deciding where a restore starts reads every step's manifest; from an object store,
    one request after another would make a restart (or a preempted job's last message)
    wait out each round trip. Through a storage whose manifest reads take 50 ms, the reads
    overlap."""
    lock, in_flight, most = threading.Lock(), [0], [0]

    def slow_manifest_reads(op: str, path: str, n: int) -> bool:
        if op == "read" and path == "manifest.json":
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            time.sleep(0.05)
            with lock:
                in_flight[0] -= 1
        return False  # nothing fails: this storage only waits

    backend = MemoryBackend()
    with memory_scheme("slow-test"):
        sp_storage.register("slow-test", lambda url, options: FaultyStorage(
            backend(url, options), slow_manifest_reads))
        with sp.CheckpointManager("slow-test://run", keep_last=None, async_save=False) as mgr:
            for step in range(8):
                mgr.save(step, make_state(step))
            target = blank()
            assert mgr.restore(target) == 7
    assert_state_equal(target, make_state(7))
    assert most[0] > 1, most


def test_streaming_budget_through_the_manager(root: str) -> None:
    # 24 MiB through a 32 MiB budget, 24 MiB of which the writer's buffers take
    state = {f"t{i}": torch.randn(1 << 20) for i in range(6)}
    with sp.CheckpointManager(root, max_staging_bytes=32 << 20) as mgr:
        mgr.save(1, state)
        for tensor in state.values():
            tensor.zero_()
        mgr.wait()
        loaded = sp.load(f"{root}/step-1")
        assert all(not torch.equal(loaded[k], state[k]) for k in state)
        assert mgr.save(2, state).result().nbytes >= 24 << 20
        assert mgr._stager is not None and mgr._stager.nbytes <= (32 << 20) - WRITER_BYTES
    assert sp.verify(f"{root}/step-2").ok


def test_bad_arguments() -> None:
    with pytest.raises(sp.SafepointError, match="best_metric"):
        sp.CheckpointManager("/tmp/x", keep_best=2)
    with pytest.raises(sp.SafepointError, match="max_staging_bytes"):
        sp.CheckpointManager("/tmp/x", max_staging_bytes=1000)


def test_bad_step_and_metrics_write_nothing(tmp_path: Path) -> None:
    with sp.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(sp.SafepointError, match="step"):
            mgr.save(-1, make_state(1))
        with pytest.raises(sp.UnsupportedLeaf, match="metrics"):
            mgr.save(1, make_state(1), metrics={"loss": object()})
        assert mgr.steps() == []
        mgr.save(2, make_state(2), metrics={"loss": float("nan")}).result()
        assert mgr.metadata(2).metrics == {"loss": None}


def test_metrics_held_as_0_dim_tensors_arrays_or_numpy_scalars_are_their_numbers(
    tmp_path: Path,
) -> None:
    """A loss as training code holds it (a 0-d tensor, a NumPy scalar) was refused as not
    JSON, though README passes metrics={"val_loss": val_loss}; a tensor of one element in
    one dimension is still refused (which number it means is the caller's to say)."""
    with sp.CheckpointManager(str(tmp_path), keep_last=None, keep_best=1,
                              best_metric="loss") as mgr:
        mgr.save(1, make_state(1), metrics={"loss": torch.tensor(0.5), "acc": np.float32(0.25),
                                            "n": np.int64(7), "ok": np.bool_(True)})
        mgr.save(2, make_state(2), metrics={"loss": torch.tensor(float("nan")),
                                            "half": torch.tensor(0.5, dtype=torch.bfloat16)})
        with pytest.raises(sp.UnsupportedLeaf, match="metrics"):
            mgr.save(3, make_state(3), metrics={"loss": torch.tensor([0.5])})
        mgr.wait()
        assert mgr.metadata(1).metrics == {"loss": 0.5, "acc": 0.25, "n": 7, "ok": True}
        assert type(mgr.metadata(1).metrics["n"]) is int
        assert mgr.metadata(2).metrics == {"loss": None, "half": 0.5}
        assert mgr.steps() == [1, 2]


def test_gc_removes_leftovers_and_applies_the_policy(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=None) as mgr:
        for step in range(1, 6):
            mgr.save(step, make_state(step))
    (root / "step-9" / "data").mkdir(parents=True)
    (root / "step-9" / "data" / "x.bin").write_bytes(b"x")
    with sp.CheckpointManager(str(root), keep_last=2) as mgr:
        report = mgr.gc(dry_run=True)
        assert report.deleted_steps == [1, 2, 3] and list(report.leftovers) == [9]
        assert mgr.steps() == [1, 2, 3, 4, 5]
        report = mgr.gc()
        assert mgr.steps() == [4, 5] and not (root / "step-9").exists()
    # An overwrite of step 5 killed before its manifest landed leaves an unreferenced data
    # file inside the committed step: gc (which reads the manifests) removes it.
    stray = root / "step-5" / "data" / f"{uuid.uuid4().hex}-r00000-0000.bin"
    stray.write_bytes(b"half an overwrite")
    with sp.CheckpointManager(str(root), keep_last=2) as mgr:
        mgr.save(6, make_state(6))
        assert stray.exists()  # a writer's start-up cleanup does not read manifests
        assert mgr.gc().leftovers == {5: [f"step-5/data/{stray.name}"]}
    assert not stray.exists()
    assert sp.verify(str(root / "step-5")).ok


# -- SIGKILL at random moments --------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import safepoint as sp

    root, mode = sys.argv[1], sys.argv[2]
    state = {"a": np.zeros(1 << 20), "b": np.zeros(1 << 18, dtype=np.int32), "step": 0}
    mgr = sp.CheckpointManager(root, keep_last=1 if mode == "delete" else 2,
                               async_save=mode == "async", max_staging_bytes=None)
    step = mgr.latest_step() or 0
    while True:
        step += 1
        state["a"][:] = step
        state["b"][:] = step
        state["step"] = step
        handle = mgr.save(step, state)
        handle.result()
        print(step, flush=True)
""")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync", "delete"])
def test_sigkill_at_random_moments_leaves_a_restorable_root(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = str(tmp_path / "run")
    rng = random.Random(f"{mode}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    last = 0
    for _ in range(3):
        child = subprocess.Popen([sys.executable, str(script), root, mode],
                                 stdout=subprocess.PIPE, text=True, env=env)
        assert child.stdout is not None
        first = child.stdout.readline()  # one commit in this run, then kill at random
        assert first.strip(), "the child committed nothing"
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        output = first + child.stdout.read()
        child.stdout.close()
        child.wait()
        committed = [int(line) for line in output.split()]
        mgr = sp.CheckpointManager(root)
        latest = mgr.latest_step()
        assert latest is not None and latest >= max(committed) >= last
        last = latest
        for step in mgr.steps():
            assert sp.verify(mgr.step_url(step)).ok, step
        state = {"a": np.empty(1 << 20), "b": np.empty(1 << 18, dtype=np.int32), "step": 0}
        assert mgr.restore(state) == latest
        assert state["step"] == latest and (state["a"] == latest).all()
    # The next writer on this host takes the dead child's lease over at once and cleans up.
    with sp.CheckpointManager(root, keep_last=1) as mgr:
        mgr.save(last + 1, {"x": np.ones(3)})
    # (A kill between a delete's unlink and rmdir may leave an empty directory: no files.)
    files = {p.relative_to(tmp_path / "run").parts[0]
             for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert files == {"lease", f"step-{last + 1}"}


def test_restore_skips_a_step_only_for_missing_or_corrupt_data_on_every_failing_rank() -> None:
    """The rule `restore`'s fallback applies to a collective load's error (the same on every
    rank), so that all ranks skip the same steps."""
    assert unreadable(sp.CorruptCheckpoint("m")) and unreadable(sp.CheckpointNotFound("m"))
    corrupt = {1: "CorruptCheckpoint: block 3 of x.bin", 2: "CheckpointNotFound: gone"}
    assert unreadable(sp.DistributedError("m", failures=corrupt))
    assert not unreadable(sp.DistributedError("m", failures={**corrupt, 0: "OSError: EIO"}))
    assert not unreadable(sp.DistributedError("m"))  # a dead rank: no failure recorded
    assert not unreadable(sp.StateMismatch("m"))


# -- CUDA -------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_training(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 64)).cuda().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def cuda_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def host_copy(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor)}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("budget", [None, 32 << 20])
def test_cuda_training_saves_asynchronously_and_restores_in_place(tmp_path: Path,
                                                                  budget: int | None) -> None:
    model, optimizer = cuda_training(0)
    for _ in range(3):
        cuda_step(model, optimizer)
    big = torch.randn(48 << 20 >> 2, device="cuda")  # 48 MiB: streams through a 32 MiB budget
    state = {"model": model, "optim": optimizer, "big": big, "rng": sp.RNGState()}
    with sp.CheckpointManager(str(tmp_path), max_staging_bytes=budget) as mgr:
        for step in (1, 2):  # the second save reuses the pinned buffers
            expected = (host_copy(model), big.cpu(), optimizer.state_dict()["state"][0]["exp_avg"]
                        .cpu())
            mgr.save(step, state)
            cuda_step(model, optimizer)  # training goes on while the save is written
            big.add_(1)
            mgr.wait()
        after_step = host_copy(model)
        pinned = mgr._stager is not None and all(m.pinned for m in mgr._stager._memory)
    assert pinned
    model2, optimizer2 = cuda_training(1)
    pointers = [p.data_ptr() for p in model2.parameters()]
    target = {"model": model2, "optim": optimizer2, "big": torch.zeros_like(big),
              "rng": sp.RNGState()}
    with sp.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore(target) == 2
    assert [p.data_ptr() for p in model2.parameters()] == pointers  # restored in place
    assert all(torch.equal(a, b) for a, b in zip(host_copy(model2).values(),
                                                 expected[0].values(), strict=True))
    assert torch.equal(target["big"].cpu(), expected[1])
    exp_avg = optimizer2.state_dict()["state"][0]["exp_avg"]
    assert exp_avg.device.type == "cuda" and torch.equal(exp_avg.cpu(), expected[2])
    cuda_step(model2, optimizer2)  # the restored run continues exactly like the original
    assert all(torch.equal(a, b) for a, b in zip(host_copy(model2).values(),
                                                 after_step.values(), strict=True))


# -- incremental saves -------------------------------------------------------------------------


def _frozen_base_state() -> dict[str, Any]:
    """A fine-tune: a frozen 16 MiB base layer, a small trained head and its optimizer."""
    torch.manual_seed(0)
    base = torch.nn.Linear(2048, 2048)
    base.requires_grad_(False)
    head = torch.nn.Linear(2048, 8)
    return {"base": base, "head": head, "optim": torch.optim.AdamW(head.parameters()),
            "step": 0}


def _train(state: dict[str, Any], step: int) -> None:
    x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(step))
    state["head"](state["base"](x)).square().mean().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["step"] = step


def _data_files(step_dir: Path) -> dict[str, os.stat_result]:
    return {p.name: p.stat() for p in (step_dir / "data").iterdir()}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_incremental_saves_share_frozen_weights(tmp_path: Path, async_save: bool) -> None:
    """An incremental manager writes the frozen base once: every later step holds a hard link
    to the first step's file and a small file of its own; retention deletes the first step
    and the kept ones still verify and restore exactly; a new manager that restored the
    newest step shares with it at once, one that did not writes everything first."""
    root = tmp_path / "run"
    state = _frozen_base_state()
    base_bytes = sum(t.nbytes for t in state["base"].state_dict().values())
    with sp.CheckpointManager(str(root), keep_last=2, incremental=True,
                              async_save=async_save) as mgr:
        for step in range(1, 5):
            _train(state, step)
            mgr.save(step, state).result()
        assert mgr.steps() == [3, 4]
    first, last = _data_files(root / "step-3"), _data_files(root / "step-4")
    shared = set(first) & set(last)
    assert len(shared) == 1
    (name,) = shared
    assert first[name].st_ino == last[name].st_ino and last[name].st_size > base_bytes
    own = [stat for n, stat in last.items() if n != name]
    assert sum(stat.st_size for stat in own) < base_bytes / 10
    for step in (3, 4):
        assert sp.verify(str(root / f"step-{step}")).ok
    fresh = _frozen_base_state()
    fresh["base"].reset_parameters()
    with sp.CheckpointManager(str(root), incremental=True, async_save=async_save) as mgr:
        assert mgr.restore(fresh) == 4
        for key in ("base", "head"):
            for a, b in zip(fresh[key].state_dict().values(), state[key].state_dict().values(),
                            strict=True):
                assert torch.equal(a, b)
        assert fresh["step"] == 4
        mgr.save(5, fresh).result()  # shares with the step it restored
    assert name in _data_files(root / "step-5")
    with sp.CheckpointManager(str(root), incremental=True, async_save=async_save) as mgr:
        mgr.save(6, fresh).result()  # no restore: everything written
        assert name not in _data_files(root / "step-6")
        mgr.save(7, fresh).result()
    assert set(_data_files(root / "step-7")) & set(_data_files(root / "step-6"))


def test_a_lenient_restore_is_not_shared_with_since_it_checked_not_every_block(
    tmp_path: Path,
) -> None:
    """`restore(strict=False)` into a state without an entry skips that entry's bytes, so
    they are never checked; the next incremental save shared them all the same, and a block
    that rotted in the restored step was committed in the new one, born corrupt though the
    live tensor was intact."""
    root = tmp_path / "run"
    a, b = torch.randn(2 << 20), torch.randn(2 << 20)
    with sp.CheckpointManager(str(root), incremental=True, async_save=False) as mgr:
        mgr.save(1, {"a": a, "b": b})
    (data,) = _data_files(root / "step-1")
    with open(root / "step-1" / "data" / data, "r+b") as file:  # bit rot: b's bytes are last
        file.seek(-100, os.SEEK_END)
        byte = file.read(1)
        file.seek(-100, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0xFF]))
    with sp.CheckpointManager(str(root), incremental=True, async_save=False) as mgr:
        assert mgr.restore({"a": torch.zeros_like(a)}, strict=False) == 1
        mgr.save(2, {"a": a, "b": b})
    assert sp.verify(str(root / "step-2")).ok
    assert torch.equal(sp.load(str(root / "step-2"))["b"], b)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_incremental_saves_on_the_collective_path_share_unchanged_blocks(
    tmp_path: Path, async_save: bool
) -> None:
    """A state with `sp.Shard` leaves takes the collective path (a group of one) and shares
    block by block too: a tensor whose second block changes is written as that block alone.
    (Pieces spread over ranks: tests/test_dist_manager.py.)"""
    rows = 2 * (4 << 20) // (4 * 1024)  # two blocks of float32 rows of 1024

    def state(step: int) -> dict[str, Any]:
        w = torch.arange(rows * 1024, dtype=torch.float32).view(rows, 1024)
        w[-1] += step
        return {"w": sp.Shard(w, (0, 0), (rows, 1024)), "step": step}

    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), incremental=True, async_save=async_save) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step)).result()
    first, second = _data_files(root / "step-1"), _data_files(root / "step-2")
    (own,) = set(second) - set(first)
    assert second[own].st_size <= (4 << 20) + 4096 < sum(s.st_size for s in first.values())
    assert sp.info(str(root / "step-2")).format_version == 2
    assert sp.verify(str(root / "step-2")).ok
    assert sp.load(str(root / "step-2"))["w"].equal(state(2)["w"].tensor)


def test_a_restore_that_found_the_last_step_damaged_shares_nothing_with_it(
    tmp_path: Path,
) -> None:
    """restore(step=2) of a step whose shared file rotted (same size) raised CorruptCheckpoint,
    and a run that carried on saving linked that file into step 3: the damage now drops what
    the next save shares with, and step 3 writes every block."""
    state = _frozen_base_state()
    with sp.CheckpointManager(str(tmp_path), incremental=True, async_save=False) as mgr:
        for step in (1, 2):
            _train(state, step)
            mgr.save(step, state)
        flip_bit_of(tmp_path / "step-2", "base/weight")
        with pytest.raises(sp.CorruptCheckpoint):
            mgr.restore(_frozen_base_state(), step=2)
        _train(state, 3)
        mgr.save(3, state)
    assert sp.verify(str(tmp_path / "step-3")).ok


def test_a_step_replaced_by_one_without_hashes_is_not_shared_with(tmp_path: Path) -> None:
    """A step overwritten by a save that recorded no block hashes (a state of plain values)
    lost the files the manager last shared with: the next save writes everything."""
    w = torch.randn(2 << 20)
    with sp.CheckpointManager(str(tmp_path / "run"), incremental=True, async_save=False) as mgr:
        mgr.save(1, {"w": w})
        mgr.save(1, {"w": 3})
        wait_for_removals()  # the first save's data file is gone
        mgr.save(1, {"w": w})
        assert sp.verify(mgr.step_url(1)).ok
        assert sp.load(mgr.step_url(1))["w"].equal(w)


def test_incremental_save_that_fails_to_share_leaves_the_last_step(
    memory_backend: MemoryBackend,
) -> None:
    """A link that fails fails the save: the step is not committed, the previous one
    restores, and the next save succeeds."""

    def factory(url: str, storage_options: dict[str, Any] | None = None) -> Any:
        inner = memory_backend(url, storage_options)
        if url.endswith("step-2"):
            return FaultyStorage(inner, fail_nth("link", 1))
        return inner

    sp_storage.register("mem-link", factory)
    try:
        state = make_state(1)
        with sp.CheckpointManager("mem-link://run", incremental=True) as mgr:
            mgr.save(1, state).result()
            with pytest.raises(sp.StorageError, match="injected"):
                mgr.save(2, state).result()
            assert mgr.steps() == [1]
            mgr.save(3, state).result()
            assert mgr.steps() == [1, 3]
            target = blank()
            assert mgr.restore(target) == 3
            assert_state_equal(target, state)
    finally:
        sp_storage._REGISTERED.pop("mem-link", None)


def _frozen_and_trained(step: int) -> dict[str, torch.Tensor]:
    """A frozen block and a block that changes every step (4 MiB each)."""
    return {"frozen": torch.arange(1 << 20, dtype=torch.float32),
            "trained": torch.full((1 << 20,), float(step))}


def _files(url: str, storage_options: dict[str, Any] | None = None) -> tuple[list[str], str]:
    """The data files the checkpoint at `url` references, and its save id (which names the
    file its own save wrote)."""
    manifest = manifest_at(url, storage_options)
    return list(manifest.files), manifest.save_id


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_incremental_save_whose_shared_file_is_gone_writes_everything(
    tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """The data file the next save would share is gone (removed by hand, an object-store
    lifecycle rule, the step replaced by `sp.save` or `safepoint cp`): every later save
    failed, forever, with a bare FileNotFoundError from the link. The save now finds it
    missing, says so in the log and writes every block; the one after shares again."""
    options = None
    root = str(tmp_path / "run")
    if where == "s3":
        options = request.getfixturevalue("s3_server").storage_options
        root = request.getfixturevalue("s3_url")
    with sp.CheckpointManager(root, incremental=True, async_save=False, keep_last=None,
                              storage_options=options) as mgr:
        mgr.save(1, _frozen_and_trained(1))
        step1 = sp_storage.open_storage(mgr.step_url(1), options)
        try:
            step1.delete(step1.list("data"))
        finally:
            step1.close()
        with caplog.at_level("WARNING", logger="safepoint"):
            mgr.save(2, _frozen_and_trained(2))
        assert "writes every block" in caplog.text and "step-1" in caplog.text
        mgr.save(3, _frozen_and_trained(3))
        urls = [mgr.step_url(step) for step in (2, 3)]
    (two, save_id), (three, _) = (_files(url, options) for url in urls)
    assert len(two) == 1 and save_id in two[0]  # nothing of step 1 shared
    assert set(two) < set(three)  # the frozen block is shared again
    for url, step in zip(urls, (2, 3), strict=True):
        assert sp.verify(url, storage_options=options).ok
        loaded = sp.load(url, storage_options=options)
        assert all(torch.equal(loaded[k], v) for k, v in _frozen_and_trained(step).items())


def test_a_shared_file_removed_while_saving_fails_the_save_naming_it(
    memory_backend: MemoryBackend,
) -> None:
    """The shared file vanishes after the save found it, before it links it: the save fails
    with a CorruptCheckpoint (not a bare FileNotFoundError) naming the file, its step and
    what to do; nothing is committed, and the next save writes every block and commits."""

    class SourceGone:
        """A storage whose link finds its source removed just before."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.url = inner, inner.url

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def link(self, source_url: str, path: str) -> None:
            folder, _, name = source_url.rpartition("/")
            memory_backend(folder).delete([name])
            self.inner.link(source_url, path)

    def factory(url: str, storage_options: dict[str, Any] | None = None) -> Any:
        inner = memory_backend(url, storage_options)
        return SourceGone(inner) if url.endswith("step-2") else inner

    sp_storage.register("mem-gone", factory)
    try:
        with sp.CheckpointManager("mem-gone://run", incremental=True, async_save=False) as mgr:
            mgr.save(1, _frozen_and_trained(1))
            with pytest.raises(sp.CorruptCheckpoint,
                               match=r"mem-gone://run/step-1/data/.* is missing.*save again"):
                mgr.save(2, _frozen_and_trained(2))
            assert mgr.steps() == [1]
            mgr.save(3, _frozen_and_trained(3))
            files, save_id = _files(mgr.step_url(3))
            assert len(files) == 1 and save_id in files[0]  # nothing of step 1 shared
            assert sp.verify(mgr.step_url(3)).ok
    finally:
        sp_storage._REGISTERED.pop("mem-gone", None)


def test_incremental_is_refused_where_it_cannot_work(memory_backend: MemoryBackend) -> None:
    """A storage that cannot link one step's file into another cannot take incremental
    saves: refused when the manager is made, naming the root."""

    class NoLink:
        def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
            self.inner = memory_backend(url, storage_options)
            self.url = url

        def __getattr__(self, name: str) -> Any:
            if name == "link":
                raise AttributeError(name)
            return getattr(self.inner, name)

    sp_storage.register("mem-nolink", NoLink)
    try:
        with pytest.raises(sp.SafepointError, match=r"mem-nolink://run.*incremental=False"):
            sp.CheckpointManager("mem-nolink://run", incremental=True)
        sp.CheckpointManager("mem-nolink://run").close()
    finally:
        sp_storage._REGISTERED.pop("mem-nolink", None)


def test_an_async_save_keeps_the_metadata_as_it_was_at_save(
    tmp_path: Path, held_back: threading.Event
) -> None:
    """The caller may change everything once save returns, nested metadata included: the
    background commit stores what was passed."""
    meta = {"data": {"epoch": 1}}
    with sp.CheckpointManager(str(tmp_path / "run"), async_save=True) as mgr:
        handle = mgr.save(1, {"w": torch.ones(4)}, metadata=meta)
        meta["data"]["epoch"] = 2
        held_back.set()
        handle.result()
        assert mgr.metadata(1).metadata["data"] == {"epoch": 1}


def test_incremental_saves_on_s3(s3_url: str, s3_server: Any) -> None:
    """On an object store the shared file is copied by the server into each step."""
    options = s3_server.storage_options
    state = _frozen_base_state()
    with sp.CheckpointManager(s3_url, incremental=True, storage_options=options) as mgr:
        for step in (1, 2):
            _train(state, step)
            mgr.save(step, state).result()
        one, two = (sp.info(mgr.step_url(s), storage_options=options) for s in (1, 2))
        assert sp.verify(mgr.step_url(2), storage_options=options).ok
        fresh = _frozen_base_state()
        fresh["base"].reset_parameters()
        assert mgr.restore(fresh) == 2
    assert torch.equal(fresh["base"].weight, state["base"].weight)
    assert torch.equal(fresh["head"].weight, state["head"].weight)
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    names = [set(p.rsplit("/", 1)[1] for p in fs.find(f"{s3_url}/step-{s}/data"))
             for s in (1, 2)]
    assert len(names[0] & names[1]) == 1
    assert one.nbytes > 0 and two.nbytes > 0


INTERRUPTED_SAVE = """
import signal, sys, threading, time, faulthandler
import torch
import safepoint as sp
from safepoint.storage import register
from safepoint._storage_local import LocalStorage
from safepoint._snapshot import MIN_STAGING_BYTES

class Slow(LocalStorage):  # a slow disk: the writer drains the staging buffers slowly
    def write(self, path, chunks):
        def slow():
            for chunk in chunks:
                time.sleep(0.3)
                yield chunk
        return super().write(path, slow())

class Interrupt(BaseException):
    pass

def handler(signum, frame):
    raise Interrupt()

register("slow", Slow)
signal.signal(signal.SIGUSR2, handler)
root = "slow://" + sys.argv[1] + "/root"
state = {f"t{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB: streams
if sys.argv[2] == "collective":  # pieces of global tensors: the collective path
    state = {key: sp.Shard(value, (0,), (1 << 20,)) for key, value in state.items()}
mgr = sp.CheckpointManager(root, max_staging_bytes=MIN_STAGING_BYTES)
main = threading.get_ident()
threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGUSR2)).start()
faulthandler.dump_traceback_later(30, exit=True)
try:
    mgr.save(1, state)
    print("save returned")
except Interrupt:
    print("interrupted")
mgr.close()
print("steps", sp.CheckpointManager(root).steps())
"""


@pytest.mark.parametrize("path", ["one-process", "collective"])
def test_an_interrupt_while_a_streaming_save_waits_for_a_buffer_stops_it(
    tmp_path: Path, path: str,
) -> None:
    """A KeyboardInterrupt or a signal handler's exception raised while `save` waits for the
    writer to free a staging buffer (where a streaming save spends its time) reaches the
    caller at once and stops the writer: nothing is committed and close() returns (the
    writer used to wait for the next part forever, and `save` for the writer). The same on
    the collective path (pieces of global tensors)."""
    script = tmp_path / "child.py"
    script.write_text(INTERRUPTED_SAVE)
    child = subprocess.run([sys.executable, str(script), str(tmp_path), path],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
    assert child.stdout.split("\n")[:2] == ["interrupted", "steps []"], child.stdout


NESTED_SAVE = """
import signal, sys, threading, time, faulthandler
import torch
import safepoint as sp
from safepoint.storage import register
from safepoint._storage_local import LocalStorage
from safepoint._snapshot import MIN_STAGING_BYTES

class Slow(LocalStorage):  # a slow disk for step 2: its save waits in staging for a buffer
    def write(self, path, chunks):
        def slow():
            for chunk in chunks:
                time.sleep(0.2)
                yield chunk
        return super().write(path, slow() if "step-2" in self.url else chunks)

def on_preemption(signum, frame):  # a preemption handler that saves
    mgr.save(99, state).result()
    print("handler saved", 99 in mgr.steps())

register("slow", Slow)
signal.signal(signal.SIGUSR1, on_preemption)
root = "slow://" + sys.argv[1] + "/root"
tensors = state = {f"t{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB: streams
if sys.argv[2] == "collective":  # pieces of global tensors: the collective path
    state = {key: sp.Shard(value, (0,), (1 << 20,)) for key, value in state.items()}
mgr = sp.CheckpointManager(root, keep_last=2, max_staging_bytes=MIN_STAGING_BYTES)
mgr.save(1, state).result()
main = threading.get_ident()
threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
faulthandler.dump_traceback_later(20, exit=True)
mgr.save(2, state)
mgr.close()
print("steps", sp.CheckpointManager(root).steps())
print("equal", torch.equal(sp.load(mgr.step_url(99))["t5"], tensors["t5"]))
"""


SAVE_IN_LEASE_CHECK = """
import faulthandler, os, signal, sys, threading
import torch
import safepoint as sp
from safepoint import _lease

faulthandler.dump_traceback_later(30, exit=True)
state = {"w": torch.arange(1000.0)}
mgr = sp.CheckpointManager(sys.argv[1], async_save=False)
mgr.save(1, state).result()

def on_preemption(signum, frame):
    mgr.save(100, state)
    print("handler saved", flush=True)

signal.signal(signal.SIGUSR1, on_preemption)
renew, fired = _lease.Lease._renew, []

def signalled_renew(self):  # the scheduler's signal lands inside the lease check
    if threading.current_thread() is threading.main_thread() and not fired:
        fired.append(True)
        os.kill(os.getpid(), signal.SIGUSR1)
    return renew(self)

_lease.Lease._renew = signalled_renew
mgr.save(2, state).result()
mgr.close()
print("steps", sp.CheckpointManager(sys.argv[1]).steps())
"""


def test_a_save_from_a_signal_handler_that_interrupted_the_lease_check_commits(
    tmp_path: Path,
) -> None:
    """A preemption handler's save that interrupted this thread's check of the lease (before
    every commit; the main thread's own with async_save=False) hung for good: the lease's
    lock, held by the check it interrupted, was not re-entrant. The handler's save now
    commits, then the interrupted one."""
    script = tmp_path / "child.py"
    script.write_text(SAVE_IN_LEASE_CHECK)
    child = subprocess.run([sys.executable, str(script), str(tmp_path / "root")],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
    assert child.stdout.split("\n")[:2] == ["handler saved", "steps [1, 2, 100]"], child.stdout


@pytest.mark.parametrize("path", ["one-process", "collective"])
def test_a_save_from_a_signal_handler_that_interrupted_staging_commits(
    tmp_path: Path, path: str,
) -> None:
    """A preemption handler that saves, run while `save` stages (here: waits for the writer
    to free a buffer), hung: its save waited for the save in flight, whose writer waited for
    the staging the handler interrupted. It is now synchronous, touches neither that save
    nor its buffers and is committed when it returns; the interrupted save then finishes,
    and its retention (keep_last=2) covers both. The same on the collective path."""
    script = tmp_path / "child.py"
    script.write_text(NESTED_SAVE)
    child = subprocess.run([sys.executable, str(script), str(tmp_path), path],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
    assert child.stdout.split("\n")[:3] == ["handler saved True", "steps [2, 99]",
                                            "equal True"], child.stdout


class Interrupted(BaseException):
    """What a signal handler raises in the main thread (as Ctrl-C raises KeyboardInterrupt)."""


def _waits_for_the_save_in_flight(ident: int, inside: str) -> bool:
    """Whether thread `ident` is blocked waiting for a save, in a function named `inside`
    (the manager's `_settle_pending`, or a handle's `result`)."""
    frame = sys._current_frames().get(ident)
    if frame is None or frame.f_code is not threading.Condition.wait.__code__:
        return False
    while frame is not None and frame.f_code.co_name != inside:
        frame = frame.f_back
    return frame is not None


def once_main_waits(
    action: Callable[[], object], unless: threading.Event, inside: str = "_settle_pending",
) -> None:
    """Run `action` in a thread as soon as the main thread waits for the save in flight (in
    `inside`), unless `unless` is set first."""
    main = threading.get_ident()

    def run() -> None:
        while not unless.wait(0.001):
            if _waits_for_the_save_in_flight(main, inside):
                action()
                return

    threading.Thread(target=run, daemon=True).start()


@pytest.fixture
def failing_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event that makes the manager's writes fail (a StorageError) while it is set."""
    failing = threading.Event()
    write = manager_module.write_and_commit

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failing.is_set():
            raise sp.StorageError("injected failure of the write")
        return write(*args, **kwargs)

    monkeypatch.setattr(manager_module, "write_and_commit", flaky)
    return failing


@pytest.fixture
def interrupt() -> Iterator[Callable[..., None]]:
    """`interrupt(inside="_settle_pending")`: raise `Interrupted` in the main thread (by
    SIGUSR2) once it waits for the save in flight (see `once_main_waits`)."""
    done = threading.Event()
    main = threading.get_ident()

    def handler(signum: int, frame: object) -> None:
        raise Interrupted()

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        yield lambda inside="_settle_pending": once_main_waits(
            lambda: signal.pthread_kill(main, signal.SIGUSR2), done, inside)
    finally:
        done.set()
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("collective", [False, True], ids=["one-process", "collective"])
def test_a_save_interrupted_while_it_waits_for_the_previous_one_leaves_it_in_flight(
    tmp_path: Path, held_back: threading.Event, interrupt: Callable[[], None], collective: bool,
) -> None:
    """A KeyboardInterrupt (or a signal handler's exception) while `save` waits for the save
    in flight leaves that save in flight: the save made next (a loop's last save on Ctrl-C)
    waits for it too. The manager used to forget it, and the next save staged its state into
    the buffers that save had not written yet: step 1 was committed with step 2's bytes. The
    same on the collective path (which pieces of a global tensor take)."""

    def state(value: float) -> dict[str, Any]:
        big = torch.full((1 << 20,), value)
        return {"w": torch.full((1024,), value),
                "big": sp.Shard(big, (0,), (1 << 20,)) if collective else big}

    one, two = state(1.0), state(2.0)
    with sp.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, one)  # staged; written once `held_back` is set
        interrupt()
        with pytest.raises(Interrupted):
            mgr.save(2, two)
        once_main_waits(held_back.set, held_back)
        handle = mgr.save(2, two)
        held_back.set()
        handle.result()
    for step, value in ((1, 1.0), (2, 2.0)):
        loaded = sp.load(str(tmp_path / "run" / f"step-{step}"))
        assert all(torch.all(loaded[k] == value) for k in ("w", "big")), (step, loaded)


def test_restore_waits_for_the_save_in_flight(
    tmp_path: Path, held_back: threading.Event,
) -> None:
    """restore() right after an asynchronous save restores that save's step once it commits
    (it restored the step before, while the save's retention could delete the step it read)."""
    with sp.CheckpointManager(str(tmp_path / "run"), keep_last=1) as mgr:
        held_back.set()
        mgr.save(1, make_state(1)).result()
        held_back.clear()
        mgr.save(2, make_state(2))  # written once `held_back` is set
        once_main_waits(held_back.set, threading.Event())
        target = make_state(0)
        assert mgr.restore(target) == 2
        assert target["step"] == 2 and mgr.steps() == [2]


@pytest.mark.parametrize("interrupted", ["wait", "save", "result"])
def test_an_interrupted_wait_still_raises_the_failure_of_the_save_in_flight(
    failing: FailingBackend, held_back: threading.Event, interrupt: Callable[..., None],
    interrupted: str,
) -> None:
    """After an interrupt while `wait`, `save` or `handle.result()` waits for the save in
    flight, that save's failure is still raised by the next `wait` (it was forgotten, only
    logged; `result` counted the interrupt as the failure reported)."""
    mgr = sp.CheckpointManager("mem-fail://run")
    try:
        handle = mgr.save(2, make_state(2))  # its write fails once `held_back` is set
        interrupt("result" if interrupted == "result" else "_settle_pending")
        with pytest.raises(Interrupted):
            if interrupted == "wait":
                mgr.wait()
            elif interrupted == "save":
                mgr.save(3, make_state(3))
            else:
                handle.result()
        held_back.set()
        with pytest.raises(sp.StorageError, match="injected"):
            mgr.wait()
        assert mgr.steps() == []
    finally:
        held_back.set()
        with contextlib.suppress(sp.StorageError):
            mgr.close()


@pytest.mark.parametrize("waiting", ["wait", "restore"])
def test_a_save_from_a_signal_handler_during_a_wait_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waiting: str,
) -> None:
    """A preemption handler saves step 99 while the loop waits for step 1 in `wait()` or
    `restore()`. The wait used to drop the handler's save once step 1 committed, and the
    next save staged its state into the memory that save's writer had not written yet: step
    99 was committed with step 3's bytes, its checksums matching them. Now the wait returns
    once step 99 is committed too."""
    write = manager_module.write_and_commit
    first, handler = threading.Event(), threading.Event()

    def held(prepared: Any, *args: Any, **kwargs: Any) -> Any:
        (handler if prepared.url.endswith("step-99") else first).wait(30)
        return write(prepared, *args, **kwargs)

    monkeypatch.setattr(manager_module, "write_and_commit", held)
    state = {"w": torch.full((1 << 20,), 1.0)}
    main = threading.get_ident()
    done = threading.Event()

    def on_preemption(signum: int, frame: object) -> None:
        state["w"].fill_(99.0)
        once_main_waits(first.set, done)  # step 1 commits once this save waits for it
        mgr.save(99, state)  # then is staged, and held back
        once_main_waits(handler.set, done)  # until the loop's wait waits for it

    previous = signal.signal(signal.SIGUSR1, on_preemption)
    try:
        mgr = sp.CheckpointManager(str(tmp_path / "run"), keep_last=None)
        mgr.save(1, state)
        once_main_waits(lambda: signal.pthread_kill(main, signal.SIGUSR1), done)
        if waiting == "wait":
            mgr.wait()
        else:
            assert mgr.restore({"w": torch.zeros(1 << 20)}) == 99
        assert mgr.steps() == [1, 99]
        state["w"].fill_(3.0)
        mgr.save(3, state).result()
        mgr.close()
    finally:
        done.set()
        first.set()
        handler.set()
        signal.signal(signal.SIGUSR1, previous)
    for step in (1, 99, 3):
        loaded = sp.load(str(tmp_path / "run" / f"step-{step}"))
        assert torch.all(loaded["w"] == step), (step, loaded["w"].unique())


@contextlib.contextmanager
def scheme(name: str, factory: Any) -> Iterator[None]:
    sp_storage.register(name, factory)
    try:
        yield
    finally:
        sp_storage._REGISTERED.pop(name, None)


@pytest.mark.parametrize("seconds", [0, -5, math.nan, math.inf])
def test_lease_seconds_is_validated(tmp_path: Path, seconds: float) -> None:
    """0 or less busy-looped and was born expired (a second writer took a live writer's
    root over), NaN never expired, inf killed the renewer: refused when the manager is made,
    naming the root."""
    root = str(tmp_path / "run")
    pattern = rf"lease_seconds=.* for {re.escape(root)}: pass a finite"
    with pytest.raises(sp.SafepointError, match=pattern):
        sp.CheckpointManager(root, lease_seconds=seconds)
    with pytest.raises(sp.SafepointError, match="lease_seconds"):
        sp.CheckpointManager(root, local_dir=str(tmp_path / "local"), lease_seconds=seconds)


def test_a_writer_that_lost_its_lease_does_not_take_the_root_back(tmp_path: Path) -> None:
    """Writer A stalls past its lease (a SIGSTOP, a hung host); B takes the root over, saves
    and closes. A, awake again, took the free lease back at its second save and, numbering
    on, replaced B's steps: now every save of A's raises LeaseHeld, and B's steps stay."""
    root = str(tmp_path / "root")
    a = sp.CheckpointManager(root, async_save=False, lease_seconds=0.5)
    a.save(1, {"w": torch.full((3,), 1.0)})
    a._lease._stop.set()  # A stalls: no more renewals
    time.sleep(0.6)
    with sp.CheckpointManager(root, async_save=False) as b:
        state = {"w": torch.zeros(3)}
        assert b.restore(state) == 1
        for step in (2, 3):
            b.save(step, {"w": torch.full((3,), -float(step))})
    for step in (2, 3):
        with pytest.raises(sp.LeaseHeld):
            a.save(step, {"w": torch.full((3,), float(step))})
    a.close()
    assert sp.CheckpointManager(root).steps() == [1, 2, 3]
    assert sp.load(f"{root}/step-3")["w"].tolist() == [-3.0] * 3


@pytest.mark.parametrize("collective", [False, True], ids=["one-process", "collective"])
def test_a_save_that_lost_its_lease_while_writing_is_not_committed(collective: bool) -> None:
    """Writer A's lease lapses while it writes step 1 (its renewals fail) and B takes the
    root over: A's save raises LeaseHeld, publishes nothing and removes its data (the lease
    is checked after the write, just before the manifest is published; on the collective
    path, which pieces of a global tensor take, on rank 0)."""

    def state(value: float) -> dict[str, Any]:
        w = torch.full((3,), value)
        return {"w": sp.Shard(w, (0,), (3,)) if collective else w}

    backend = MemoryBackend()
    stalled, writing, go = threading.Event(), threading.Event(), threading.Event()

    def a_fails(op: str, path: str, n: int) -> bool:
        if stalled.is_set() and op == "write_chunk" and not writing.is_set():
            writing.set()
            go.wait(20)  # A's data write takes long
        # Meanwhile A cannot reach the lease file: its renewals fail and the lease lapses.
        return (writing.is_set() and not go.is_set() and op == "publish"
                and path.startswith("lease/"))

    with scheme("lease-a", lambda url, options=None: FaultyStorage(backend(url, options),
                                                                   a_fails)), \
            scheme("lease-b", backend):
        a = sp.CheckpointManager("lease-a://run", lease_seconds=1.0)
        b = None
        try:
            a.save(0, state(0.0)).result()
            stalled.set()
            handle = a.save(1, state(1.0))
            assert writing.wait(10)
            time.sleep(1.6)  # A's lease expires
            b = sp.CheckpointManager("lease-b://run")
            b.save(5, {"w": torch.full((3,), 5.0)}).result()  # B took the root over
            go.set()
            error = handle.exception()
            steps = b.steps()
        finally:
            go.set()
            if b is not None:
                b.close()
            with contextlib.suppress(Exception):
                a.close()
    assert isinstance(error, sp.LeaseHeld), f"A's save ended with {error!r}"
    assert "step 1 was not committed to lease-a://run/step-1 (its data was removed)" in str(
        error) and "no longer holds the lease" in str(error)
    assert steps == [0, 5]
    assert not [path for path in backend.files() if path.startswith("run/step-1/")]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_step_save_lists_its_directory_only_to_remove_what_it_replaced(
    async_save: bool,
) -> None:
    """A fresh save checks that its directory holds no checkpoints (which it would hide), by
    listing it: a LIST request per step on S3, which a manager's step directory, never a
    root of checkpoints, does not need. The step directory is never listed before the
    manifest is published (after it, only to remove what the commit replaced: see the next
    test); `sp.save` over the manager's root is still refused."""
    backend = MemoryBackend()
    calls: list[tuple[str, str]] = []

    def counted(url: str, options: dict[str, Any] | None = None) -> FaultyStorage:
        return FaultyStorage(backend(url, options),
                             lambda op, path, n: calls.append((url, op)) or False)

    with scheme("counted", counted), sp.CheckpointManager(
            "counted://run", async_save=async_save) as mgr:
        mgr.save(1, {"w": np.arange(10)})
        mgr.wait()
        calls.clear()
        mgr.save(2, {"w": np.arange(10)}).result()
        step = [op for url, op in calls if url == "counted://run/step-2"]
        assert "publish" in step and "list" not in step[:step.index("publish")], step
        with pytest.raises(sp.CheckpointExists, match="holds checkpoints"):
            sp.save("counted://run", {"w": np.arange(3)})
        assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize("async_save", [True, False])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_only_a_step_that_can_replace_something_is_listed_after_its_commit(
    tmp_path: Path, where: str, async_save: bool, collective: bool
) -> None:
    """Each step save listed its directory after the commit, to remove what the commit
    replaced: a LIST request per save on S3, though a new step number replaces nothing.
    Only a step committed before (saved again after a rollback), or one whose number the
    manager wrote before (the leftovers of a failed save), is listed, and what it replaced
    is removed; a number retention deleted is new again. Collective saves (pieces of a
    global tensor) alike."""
    backend = MemoryBackend()
    listed: list[str] = []  # the step directories listed, by the step's storage or the root's
    failing = threading.Event()

    def plain(url: str) -> sp_storage.Storage:
        return LocalStorage(url) if where == "local" else backend(url)

    def counted(url: str, options: dict[str, Any] | None = None) -> FaultyStorage:
        def predicate(op: str, path: str, n: int) -> bool:
            name = posixpath.basename(url) if path == "" else path.partition("/")[0]
            if op == "list" and name.startswith("step-"):
                listed.append(name)
            # A failed commit of step 3 whose data cannot be removed either: leftovers.
            return failing.is_set() and url.endswith("/step-3") and op in ("publish",
                                                                           "delete")
        return FaultyStorage(plain(url), predicate)

    def state(value: float) -> dict[str, Any]:
        w = torch.full((3,), value)
        return {"w": sp.Shard(w, (0,), (3,)) if collective else w}

    def files(step: int) -> list[str]:
        return sorted(plain(f"{root}/step-{step}").list(""))

    def committed_alone(step: int) -> bool:  # the step's files are its manifest's, no more
        wait_for_removals()
        return files(step) == sorted([*manifest_at(f"{root}/step-{step}").files, MANIFEST])

    root = f"counted://{tmp_path}/run" if where == "local" else "counted://run"
    with scheme("counted", counted), sp.CheckpointManager(
            root, keep_last=2, async_save=async_save) as mgr:
        for step in (1, 2, 4):
            mgr.save(step, state(step)).result()
        assert listed == ["step-1"]  # by retention, deleting step 1
        assert committed_alone(4)
        replaced = files(2)
        mgr.save(2, state(20.0)).result()  # a rollback saves step 2 again
        assert listed == ["step-1", "step-2"]
        assert committed_alone(2) and set(files(2)) & set(replaced) == {MANIFEST}
        failing.set()
        with pytest.raises(sp.SafepointError, match="injected failure"):
            mgr.save(3, state(3)).result()
        failing.clear()
        assert files(3)  # the failed save's data is left
        del listed[:]
        mgr.save(3, state(30.0)).result()
        assert listed == ["step-3", "step-2"]  # and retention deleted step 2
        assert committed_alone(3)
        mgr.save(1, state(10.0)).result()  # deleted by retention: a new number again
        assert listed == ["step-3", "step-2"]  # (retention keeps step 1, committed last)
        assert mgr.steps() == [1, 3, 4]
        target = {"w": torch.zeros(3)}
        assert mgr.restore(target, step=1) == 1 and target["w"].tolist() == [10.0] * 3


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_step_save_leaves_no_empty_step_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """A step save that failed (here the disk is full) removed its data but left an empty
    step-N directory behind, beside the committed steps."""
    root = tmp_path / "run"
    pwrite = os.pwrite

    def full(fd: int, data: Any, offset: int) -> int:
        if "step-2" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    with sp.CheckpointManager(str(root), async_save=async_save) as mgr:
        mgr.save(1, make_state(1)).result()
        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(sp.StorageError, match="No space left"):
            mgr.save(2, make_state(2)).result()
        monkeypatch.setattr(os, "pwrite", pwrite)
        wait_for_removals()
        assert sorted(os.listdir(root)) == ["lease", "step-1"]
        mgr.save(3, make_state(3)).result()
        assert mgr.steps() == [1, 3]


def test_retention_checks_the_lease_before_deleting(tmp_path: Path) -> None:
    """Retention of a manager whose lease was taken over deletes nothing: the other writer
    owns the steps now."""
    root = str(tmp_path / "run")
    with sp.CheckpointManager(root, keep_last=None, async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, {"w": torch.zeros(3)})
        takeover = {"host": "elsewhere", "pid": 1, "token": "other",
                    "expires": time.time() + 60}
        (tmp_path / "run" / "lease" / "000000000002.json").write_text(json.dumps(takeover))
        mgr.policy = dataclasses.replace(mgr.policy, keep_last=1)
        with pytest.raises(sp.LeaseHeld, match=r"retention under .* deleted nothing"):
            mgr._retain(dry_run=False)
        assert mgr.steps() == [0, 1, 2]


def test_a_dropped_manager_does_not_hold_the_root_forever(tmp_path: Path) -> None:
    """A manager that saved and was dropped without `close()` (a notebook cell run again, a
    function that raised) stops renewing its lease, and this process takes the root over at
    once (another host would once its lease expired): the renewer held it for the life of
    the process, every later manager on that root raising LeaseHeld naming this process."""
    root = str(tmp_path / "run")
    first = sp.CheckpointManager(root, lease_seconds=60.0)
    first.save(0, {"w": torch.zeros(3)}).result()
    del first
    gc.collect()
    with sp.CheckpointManager(root) as second:
        second.save(1, {"w": torch.ones(3)}).result()
    assert sp.CheckpointManager(root).steps() == [0, 1]


def test_retention_goes_on_with_an_int_metric_beyond_any_float(tmp_path: Path) -> None:
    """metrics={"tokens": 10**400} ranked by keep_best: that step is never best, and
    retention keeps working (it raised OverflowError after every commit, so nothing was
    deleted again, and gc raised it bare)."""
    state = {"w": torch.zeros(4)}
    with sp.CheckpointManager(str(tmp_path / "run"), keep_last=1, keep_best=1,
                              best_metric="tokens", async_save=False) as mgr:
        for step, tokens in ((1, 10**400), (2, 5), (3, 7), (4, 9)):
            mgr.save(step, state, metrics={"tokens": tokens})
        assert mgr.steps() == [2, 4]
        assert mgr.gc().deleted_steps == []


def test_a_step_saved_right_after_another_following_a_rollback_is_kept() -> None:
    """After a rollback, two quick saves can share a commit time to the millisecond: the
    later one, which a restart resumes from, stays (retention took the lower step for the
    one committed last and deleted the step just committed, in about half the trials)."""
    state = {"w": torch.zeros(2)}
    with memory_scheme("mem-tie"):
        for trial in range(20):
            with sp.CheckpointManager(f"mem-tie://t{trial}", keep_last=1, keep_every=100,
                                      async_save=False) as mgr:
                mgr.save(100, state)
                mgr.save(110, state)
                mgr.restore(state, step=100)
                mgr.save(101, state)
                mgr.save(102, state)
                assert 102 in mgr.steps() and mgr.restore(state) == 102, trial


def _script(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter, as a user's script that ends right after `save`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.multiprocess
def test_retention_runs_for_a_save_in_flight_when_the_interpreter_exits(tmp_path: Path) -> None:
    """A script that returns right after `mgr.save` (no close): the commit happened, but its
    retention read the manifests on a thread pool made after concurrent.futures' exit hook
    ('cannot schedule new futures after interpreter shutdown'), so keep_last was never
    applied and the root grew by one step per run."""
    root = str(tmp_path / "run")
    for step in range(1, 4):
        done = _script("""
            import sys, torch, safepoint as sp
            mgr = sp.CheckpointManager(sys.argv[1], keep_last=1)
            mgr.save(int(sys.argv[2]), {"w": torch.full((1000,), float(sys.argv[2]))})
        """, root, str(step))
        assert done.returncode == 0 and "Error" not in done.stderr, done.stderr[-2000:]
    with sp.CheckpointManager(root) as mgr:
        assert mgr.steps() == [3]


@pytest.mark.multiprocess
def test_a_save_to_s3_in_flight_when_the_interpreter_exits_commits(
    s3_server: Any, s3_url: str
) -> None:
    """The multipart upload of a step over the part size made its thread pool after
    concurrent.futures' exit hook: the step a script saved last was dropped, with exit
    status 0 and one warning."""
    done = _script("""
        import json, sys, torch, safepoint as sp
        mgr = sp.CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]))
        mgr.save(1, {"w": torch.arange(10_000_000, dtype=torch.float32)})
    """, s3_url, json.dumps(s3_server.storage_options))
    assert done.returncode == 0 and "Error" not in done.stderr, done.stderr[-2000:]
    with sp.CheckpointManager(s3_url, storage_options=s3_server.storage_options) as mgr:
        assert mgr.steps() == [1]
        state = {"w": torch.zeros(10_000_000)}
        mgr.restore(state)
        assert torch.equal(state["w"], torch.arange(10_000_000, dtype=torch.float32))


def test_a_restore_whose_step_is_deleted_once_it_is_loaded_returns_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader restoring with on_event= (sp.Run always passes one) read the step's manifest
    again after the load, for the event's byte count: when the writer's retention deleted the
    step in between, `restore` raised CheckpointNotFound though the state was restored."""
    root = str(tmp_path / "run")
    with sp.CheckpointManager(root, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"w": torch.full((1000,), float(step))})
    real_load = manager_module.load

    def load_then_retention_deletes(url: str, *args: Any, **kwargs: Any) -> Any:
        loaded = real_load(url, *args, **kwargs)
        shutil.rmtree(url)
        return loaded

    monkeypatch.setattr(manager_module, "load", load_then_retention_deletes)
    events: list[sp.Event] = []
    state = {"w": torch.zeros(1000)}
    with sp.CheckpointManager(root, on_event=events.append) as reader:
        assert reader.restore(state) == 2
    assert torch.equal(state["w"], torch.full((1000,), 2.0))
    (loaded,) = [event for event in events if event.kind == "load"]
    assert loaded.step == 2 and loaded.nbytes == 4000


def test_a_restore_that_falls_back_reads_keys_given_as_an_iterator_for_each_step(
    tmp_path: Path,
) -> None:
    """keys= given as a generator was used up by the load of the first step tried: after a
    fallback to an older step, the load saw no keys and refused ('keys=[] match nothing')."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": {"w": np.full(3, float(step))}, "other": 0})
    (data,) = (root / "step-2" / "data").glob("*.bin")
    data.write_bytes(bytes(len(data.read_bytes())))  # step 2 fails its checksums
    state = {"model": {"w": np.zeros(3)}}
    with pytest.warns(UserWarning, match="step 2"), sp.CheckpointManager(str(root)) as mgr:
        assert mgr.restore(state, keys=(key for key in ["model/"])) == 1
    assert np.array_equal(state["model"]["w"], np.full(3, 1.0))


@pytest.mark.multiprocess
def test_a_child_forked_while_a_save_is_in_flight_exits_at_once() -> None:
    """A forked child (a DataLoader worker) inherited the managers and the exit hook, not
    their threads: at its exit it waited forever for the parent's save in flight (torch
    killed each worker after 5 s, every epoch)."""
    done = _script("""
        import multiprocessing, sys, tempfile, time
        import numpy as np, safepoint as sp
        from safepoint.storage import open_storage, register, split_url
        from safepoint.testing import FaultyStorage

        def slow(op, path, count):
            if op == "write":
                time.sleep(3)
            return False

        register("slowfs", lambda url, options=None: FaultyStorage(
            open_storage(split_url(url)[1]), slow))
        mgr = sp.CheckpointManager(f"slowfs://{tempfile.mkdtemp()}/run")
        mgr.save(1, {"w": np.zeros(10)})  # in flight for seconds
        child = multiprocessing.get_context("fork").Process(target=lambda: None)
        started = time.monotonic()
        child.start()
        child.join(10)
        print("child", child.exitcode, f"{time.monotonic() - started:.1f}")
        mgr.close()
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    _, exitcode, seconds = done.stdout.split()
    assert exitcode == "0" and float(seconds) < 2.5, done.stdout


def test_a_retention_that_failed_midway_is_finished_by_the_next_one() -> None:
    """Retention deletes a step's manifest, then its data. When the data delete failed (a
    transient object-store or NFS error), the log said the next save retries it, but the
    step had left the manager's record and was no longer committed: its data leaked for the
    run. The next retention now deletes the rest, and reports the step deleted then."""
    backend = MemoryBackend()
    failing = threading.Event()

    def flaky(url: str, options: Any = None) -> FaultyStorage:
        return FaultyStorage(backend(url, options), lambda op, path, n: failing.is_set(
            ) and op == "delete" and "run/step-1/data" in f"{url}/{path}")

    events: list[sp.Event] = []
    state = {"w": torch.arange(1000.0)}
    with scheme("flaky-retention", flaky), sp.CheckpointManager(
            "flaky-retention://run", keep_last=1, on_event=events.append) as mgr:
        mgr.save(1, state).result()
        failing.set()
        mgr.save(2, state).result()  # step 1's manifest goes, its data stays
        assert [e.error for e in events if e.kind == "error"] != []
        assert any(path.startswith("run/step-1/") for path in backend.files())
        failing.clear()
        mgr.save(3, state).result()
        assert mgr.steps() == [3]
    assert not [path for path in backend.files() if path.startswith(("run/step-1/",
                                                                      "run/step-2/"))]
    assert sorted(e.step for e in events if e.kind == "delete") == [1, 2]


def test_kept_during_the_first_async_save_does_not_make_retention_forget_a_step() -> None:
    """`kept()` in the caller's thread while the manager's first asynchronous save is in
    flight listed the steps before that save's commit and stored the listing as the
    manager's record after the writer's retention had stored a fresher one: the new step
    was missing from the record for the rest of the run (keep_last=1 kept it forever). A
    listing started before a commit or delete is no longer stored."""
    backend = MemoryBackend()
    armed, both_reading, retained = threading.Event(), threading.Event(), threading.Event()
    readers = [0]
    lock = threading.Lock()

    def ordered(url: str, options: Any = None) -> FaultyStorage:
        """The caller's manifest reads wait for the writer's retention; the writer's data
        write waits until the caller listed and reads."""

        def hold(op: str, path: str, n: int) -> bool:
            if not armed.is_set():
                return False
            if op == "read" and path == MANIFEST and not both_reading.is_set():
                with lock:
                    readers[0] += 1
                    if readers[0] == 2:
                        both_reading.set()
                retained.wait(10)
            elif op == "write" and "step-3" in url:
                both_reading.wait(10)
            return False

        return FaultyStorage(backend(url, options), hold)

    state = {"w": torch.zeros(10)}
    with scheme("ordered-kept", ordered):
        with sp.CheckpointManager("ordered-kept://run", keep_last=5) as mgr:
            mgr.save(1, state)
            mgr.save(2, state)

        def on_event(event: sp.Event) -> None:
            if event.kind == "delete" and event.step == 2:
                retained.set()

        with sp.CheckpointManager("ordered-kept://run", keep_last=1,
                                  on_event=on_event) as mgr:
            armed.set()
            mgr.save(3, state)
            mgr.kept()  # while step 3 is being saved
            mgr.wait()
            armed.clear()
            for step in (4, 5, 6):
                mgr.save(step, state).result()
            assert mgr.steps() == [6]
            assert mgr.kept() == {6: ["latest", "last"]}


@pytest.mark.parametrize("futures_timeout", ["builtin", "python-3.10"])
def test_a_result_that_timed_out_raises_the_builtin_timeout_and_the_save_goes_on(
        futures_timeout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeout is the builtin TimeoutError naming the step; the save's own failure is
    then raised by `wait`, once. On Python 3.10 (requires-python) the futures' TimeoutError
    is a class of its own, not the builtin, which `except TimeoutError` misses (emulated
    here): `result` took it for the save's error, so the save's later failure was never
    raised."""
    if futures_timeout == "python-3.10":
        class FuturesTimeout(Exception):  # concurrent.futures' own on Python 3.10
            pass

        monkeypatch.setattr(concurrent.futures._base, "TimeoutError", FuturesTimeout)
        monkeypatch.setattr(manager_module, "FutureTimeout", FuturesTimeout, raising=False)
    gate = threading.Event()

    class Slow(FaultyStorage):
        def write(self, path: str, chunks: Any) -> int:
            gate.wait(20)
            return super().write(path, chunks)

    backend = MemoryBackend()
    with scheme("slow-result", lambda url, options=None: Slow(
            backend(url, options), lambda op, path, n: op == "write" and "step-1" in url)):
        mgr = sp.CheckpointManager("slow-result://run")
        try:
            handle = mgr.save(1, {"x": np.arange(1000)})
            with pytest.raises(TimeoutError, match="step 1 has not committed") as raised:
                handle.result(timeout=0.05)
            assert type(raised.value) is TimeoutError
            gate.set()
            with pytest.raises(sp.StorageError):
                mgr.wait()
            mgr.wait()
        finally:
            gate.set()
            mgr.close()


def test_a_restore_after_a_rollback_falls_back_along_the_new_branch(tmp_path: Path) -> None:
    """Steps 100 and 110 (a loss spike) saved; the run restored 100, saved 105 and 111.
    With 111 damaged, restore() fell back to 110, the step the rollback discarded (only
    steps numbered above the step committed last were passed over). It falls back to 105."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=None, async_save=False) as mgr:
        for step in (100, 110):
            mgr.save(step, make_state(step))
        assert mgr.restore(blank(), step=100) == 100
        for step in (105, 111):
            mgr.save(step, make_state(step))
    corrupt_newest_data(root, 111)
    target = blank()
    with (sp.CheckpointManager(str(root)) as mgr,
          pytest.warns(UserWarning, match="step 111 .* cannot be restored.*trying step 105")):
        assert mgr.restore(target) == 105
    assert_state_equal(target, make_state(105))


def _after_a_rollback(root: Path) -> None:
    """Steps 100 and 110 (a loss spike); the run rolled back to 100 and saved 105."""
    with sp.CheckpointManager(str(root), keep_last=None, async_save=False) as mgr:
        for step in (100, 110):
            mgr.save(step, make_state(step))
        assert mgr.restore(blank(), step=100) == 100
        mgr.save(105, make_state(105))


def _falls_back_to(root: Path, damaged: int, step: int) -> None:
    """With `damaged` corrupt, a restart's restore loads `step`."""
    corrupt_newest_data(root, damaged)
    target = blank()
    with (sp.CheckpointManager(str(root)) as mgr,
          pytest.warns(UserWarning, match=f"step {damaged} .* cannot be restored")):
        assert mgr.restore(target) == step
    assert_state_equal(target, make_state(step))


def test_a_restore_falls_back_to_the_step_an_explicit_restore_continued_from(
    tmp_path: Path,
) -> None:
    """Steps 100 and 110 saved; the run rolled back to 100 and saved 105, then restored 110
    after all (`step=`) and saved 120. With 120 damaged, restore() fell back to 105 (the
    step saved after 110): it falls back to 110, which 120 continued from."""
    root = tmp_path / "run"
    _after_a_rollback(root)
    with sp.CheckpointManager(str(root), keep_last=None, async_save=False) as mgr:
        assert mgr.restore(blank(), step=110) == 110
        mgr.save(120, make_state(120))
        records = {step: sp.info(mgr.step_url(step)).metadata["safepoint.manager"]
                   for step in (100, 105, 110, 120)}
    assert {step: record["parent"] for step, record in records.items()} == {
        100: None, 110: 100, 105: 100, 120: 110}
    _falls_back_to(root, 120, 110)


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("failure", ["leaf", "write"])
def test_a_save_that_failed_is_not_the_parent_of_the_next(
    tmp_path: Path, failing_writes: threading.Event, async_save: bool, failure: str
) -> None:
    """After restoring the abandoned 110 (`step=`), a save of 120 fails (before writing: an
    unsupported leaf; or writing, at once or in the background) and 130 is saved: 130
    recorded 120, never committed, as its parent, and fell back below it by save order, to
    105. It records 110 and falls back to it. (A failed asynchronous save is raised by the
    next save, which is not made either: the one after continues from 110 still.)"""
    root = tmp_path / "run"
    _after_a_rollback(root)
    with sp.CheckpointManager(str(root), keep_last=None, async_save=async_save) as mgr:
        assert mgr.restore(blank(), step=110) == 110
        if failure == "leaf":
            with pytest.raises(sp.UnsupportedLeaf):
                mgr.save(120, dict(make_state(120), extra=object())).result()
        else:
            failing_writes.set()
            with pytest.raises(sp.StorageError, match="injected"):
                mgr.save(120, make_state(120))
                mgr.wait()
            failing_writes.clear()
        mgr.save(130, make_state(130)).result()
        assert mgr.metadata(130)._parent == 110
    _falls_back_to(root, 130, 110)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_saved_again_records_the_parent_of_its_first_save(
    tmp_path: Path, failing_writes: threading.Event, async_save: bool
) -> None:
    """After restoring the abandoned 110, the save of 120 fails and is retried, then 120 is
    saved once more (an overwrite), and again after a restart that restored it: each
    recorded 120 itself (the head) or nothing as its parent, and a damaged 120 fell back by
    save order to 105. Each records 110, and falls back to it."""
    root = tmp_path / "run"
    _after_a_rollback(root)
    with sp.CheckpointManager(str(root), keep_last=None, async_save=async_save) as mgr:
        assert mgr.restore(blank(), step=110) == 110
        failing_writes.set()
        with pytest.raises(sp.StorageError, match="injected"):
            mgr.save(120, make_state(120))
            mgr.wait()
        failing_writes.clear()
        mgr.save(120, make_state(119)).result()  # the retry
        assert mgr.metadata(120)._parent == 110
        mgr.save(120, make_state(120)).result()  # saved again
        assert mgr.metadata(120)._parent == 110
    with sp.CheckpointManager(str(root), keep_last=None, async_save=async_save) as mgr:
        assert mgr.restore(blank()) == 120  # a restart, saving the step it resumed from
        mgr.save(120, make_state(120)).result()
        assert mgr.metadata(120)._parent == 110
    _falls_back_to(root, 120, 110)


def test_a_save_after_a_failed_background_save_is_raised_records_the_step_before(
    tmp_path: Path, failing_writes: threading.Event
) -> None:
    """An asynchronous save of 120 fails in the background; the next save (130) raises its
    error and is not made; 140 records 110, the step restored, as its parent."""
    root = tmp_path / "run"
    _after_a_rollback(root)
    with sp.CheckpointManager(str(root), keep_last=None) as mgr:
        assert mgr.restore(blank(), step=110) == 110
        failing_writes.set()
        mgr.save(120, make_state(120))
        with pytest.raises(sp.StorageError, match="injected"):
            mgr.save(130, make_state(130))
        failing_writes.clear()
        mgr.save(140, make_state(140)).result()
        assert mgr.metadata(140)._parent == 110


def test_a_rollback_by_sp_load_is_not_followed_to_the_abandoned_step(tmp_path: Path) -> None:
    """The run rolled back with `sp.load` of step 100 (not the manager's restore) after the
    spike at 110 and saved 105, which records 110, the step the manager saved last, as its
    parent: a damaged 105 fell back to the spike. A parent numbered above its step is a
    rollback the manager did not see: 105 falls back to 100."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=None, async_save=False) as mgr:
        for step in (100, 110):
            mgr.save(step, make_state(step))
        sp.load(mgr.step_url(100), into=blank())
        mgr.save(105, make_state(105))
        assert mgr.metadata(105)._parent == 110
    _falls_back_to(root, 105, 100)


def test_a_partial_restore_is_not_the_parent_of_the_next_save(tmp_path: Path) -> None:
    """The model of step 100 restored alone for an evaluation (`keys=`) mid-run is not what
    the run goes on from: 400 recorded 100 as its parent and fell back to it, 200 and 300
    passed over as abandoned. It falls back to 300."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), keep_last=None, async_save=False) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, make_state(step))
        assert mgr.restore({"model": blank()["model"]}, step=100, keys=["model"]) == 100
        mgr.save(400, make_state(400))
        assert mgr.metadata(400)._parent == 300
    _falls_back_to(root, 400, 300)


def test_a_save_from_a_signal_handler_during_the_wait_continues_from_the_save_it_interrupted(
) -> None:
    """The loop saves 1 (asynchronous, slow to commit) and calls save(2), which waits for
    it; a preemption handler interrupts that wait and saves 99 (committed first). 99 must
    fall back to 2, then 1: it recorded 1 as its parent, and 2 was passed over as abandoned."""
    backend = MemoryBackend()
    entered = threading.Event()

    def slow(op: str, path: str, n: int) -> bool:
        if op == "write" and path.startswith("data/") and not entered.is_set():  # step 1
            entered.set()
            deadline = time.monotonic() + 10
            while mgr._saving is None and time.monotonic() < deadline:
                time.sleep(0.01)  # until the main thread is in save(2), waiting for this
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
        return False

    def on_preemption(signum: int, frame: object) -> None:
        mgr.save(99, {"w": torch.full((4,), 99.0)}).result()

    previous = signal.signal(signal.SIGUSR1, on_preemption)
    try:
        with memory_scheme("slow-nested"):
            sp_storage.register("slow-nested", lambda url, options=None: FaultyStorage(
                backend(url, options), slow))
            mgr = sp.CheckpointManager("slow-nested://run", keep_last=None)
            mgr.save(1, {"w": torch.full((4,), 1.0)})
            mgr.save(2, {"w": torch.full((4,), 2.0)})
            mgr.close()
            with sp.CheckpointManager("slow-nested://run") as again:
                assert again.steps() == [1, 2, 99]
                assert again._restore_order(again.steps()) == [99, 2, 1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


class RaisesSignal:
    """A stateful object whose first `state_dict()` raises SIGUSR1: the signal arrives while
    `save` flattens the state."""

    def __init__(self) -> None:
        self.raised = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not self.raised:
            self.raised = True
            signal.raise_signal(signal.SIGUSR1)
        return {"x": torch.zeros(1)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


def test_preemption_save_from_signal_handler_is_what_restore_resumes_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A preemption handler saves step 99 while the loop's save of step 2 flattens the
    state (the documented nested save: committed when it returns); step 2 commits after it.
    Steps were ordered by commit time, so the restart took step 2 for the head of a rollback,
    logged step 99 as abandoned and resumed from 2, losing the preemption checkpoint. They
    are ordered by when `save` was called (recorded in the manifest): 99 comes first."""
    root = str(tmp_path / "run")
    mgr = sp.CheckpointManager(root, keep_last=3)
    stateful = RaisesSignal()

    def on_preemption(signum: int, frame: object) -> None:
        mgr.save(99, {"w": torch.full((4,), 99.0), "p": {"x": torch.zeros(1)}}).result()

    previous = signal.signal(signal.SIGUSR1, on_preemption)
    try:
        mgr.save(1, {"w": torch.full((4,), 1.0), "p": {"x": torch.zeros(1)}}).result()
        mgr.save(2, {"w": torch.full((4,), 2.0), "p": stateful})
        mgr.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stateful.raised
    target = {"w": torch.zeros(4), "p": {"x": torch.zeros(1)}}
    with sp.CheckpointManager(root) as again, caplog.at_level("WARNING", logger="safepoint"):
        assert again.steps() == [1, 2, 99]
        assert again.restore(target) == 99
        assert "abandoned" not in caplog.text
        assert again.kept() == {1: ["last"], 2: ["last"], 99: ["latest", "last"]}
    assert torch.equal(target["w"], torch.full((4,), 99.0))


@pytest.mark.parametrize("seconds", [np.int64(3600), np.float32(600.0)])
def test_numpy_keep_every_seconds_accepted_then_every_save_fails(
    tmp_path: Path, seconds: Any,
) -> None:
    """A NumPy number for keep_every_seconds (or a count) passed validation, then every save
    failed with 'metadata is not JSON' though no metadata was passed: the policy is recorded
    in each manifest. It is stored as a Python number."""
    with sp.CheckpointManager(str(tmp_path / "run"), keep_every_seconds=seconds,
                              keep_last=np.int64(2), async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
        assert mgr.steps() == [1]
        assert mgr.metadata(1).policy == sp.CheckpointManager(
            str(tmp_path / "other"), keep_every_seconds=float(seconds), keep_last=2).policy


def test_dry_run_gc_does_not_stop_the_first_save_removing_leftovers(tmp_path: Path) -> None:
    """A gc(dry_run=True) took the lease itself, so the first save found it held and never
    removed the leftovers of crashed saves (docs/manager.md, Saving, 2): they stayed for the
    whole run. The first save removes them whoever took the lease."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(1, make_state(1))
    (root / "step-7" / "data").mkdir(parents=True)
    (root / "step-7" / "data" / "x.bin").write_bytes(b"x" * 1000)  # a killed save's
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        assert mgr.gc(dry_run=True).leftovers == {7: ["step-7/data/x.bin"]}
        assert (root / "step-7").exists()  # a dry run removes nothing
        mgr.save(2, make_state(2))
        assert not (root / "step-7").exists()
        assert mgr.steps() == [1, 2]


def test_load_event_logged_without_callbacks_reports_the_bytes_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Events go to callbacks and to the safepoint._events log; without an on_event
    callback, restore() logged its load as 0.0 MB (the load's own event was not collected)."""
    root = str(tmp_path / "run")
    with sp.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(1 << 20)})
    with caplog.at_level("INFO", logger="safepoint._events"):
        assert sp.CheckpointManager(root).restore({"w": torch.zeros(1 << 20)}) == 1
    loads = [r.getMessage() for r in caplog.records
             if r.name == "safepoint._events" and r.getMessage().startswith("load ")]
    assert loads and "4.2 MB" in loads[-1], loads


@pytest.mark.parametrize("async_save", [False, True])
def test_an_incremental_save_does_not_link_a_data_file_cut_short(
    tmp_path: Path, async_save: bool
) -> None:
    """The last step's data file was cut short (a damaged disk, a partial copy by hand):
    every later incremental save linked it and committed a step that could not be loaded
    (truncated), each reporting success. The save writes every block instead."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), incremental=True, keep_last=None,
                              async_save=async_save) as mgr:
        mgr.save(1, _frozen_and_trained(1))
        mgr.wait()
        (data,) = (root / "step-1" / "data").iterdir()
        os.truncate(data, 1000)
        mgr.save(2, _frozen_and_trained(2))
        mgr.wait()
    loaded = sp.load(str(root / "step-2"))
    assert torch.equal(loaded["frozen"], _frozen_and_trained(2)["frozen"])
    assert sp.verify(str(root / "step-2")).ok
