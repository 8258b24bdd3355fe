"""Staging for asynchronous saves: a staged copy is independent of the live state, buffers
are reused between saves, a budget smaller than the state streams through two halves (entries
larger than a half are cut on block boundaries), and either side failing stops the other."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from _rss import growth_during
from safepoint._api import prepare_save, write_and_commit
from safepoint._format import BLOCK_BYTES, Entry
from safepoint._snapshot import (
    MIN_STAGING_BYTES,
    WRITER_BYTES,
    Snapshot,
    Stager,
    _copy_array_range,
    _copy_range,
    _Memory,
)
from safepoint._staging import SaveData, host_data
from safepoint._tree import flatten


def state_of(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * BLOCK_BYTES // 4 + 123, generator=gen),  # ~3 blocks, cut
        "mid": torch.randn(500, 700, generator=gen).t(),  # non-contiguous
        "half": torch.randn(64, generator=gen).to(torch.bfloat16),
        "small_t": torch.randn(8, 5, generator=gen).t(),  # small, non-contiguous
        "conj": torch.randn(4, dtype=torch.complex64, generator=gen).conj(),
        "offset": torch.arange(100.0)[10:20],  # a view with a storage offset
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(7),
        "array": np.arange(1000, dtype=np.int32),
        "blob": b"bytes leaf",
        "n": 5,
    }


def staged_bytes(data: SaveData) -> dict[str, bytes]:
    """Consume the data as a writer would, joining each entry's pieces."""
    out: dict[str, bytes] = {}
    for item, view in data.stream():
        out[item.path] = out.get(item.path, b"") + bytes(view)
    return out


def live_bytes(state: dict[str, Any]) -> dict[str, bytes]:
    flat = flatten(state)
    return staged_bytes(host_data(flat.leaves, flat.kinds))


def test_staged_copy_is_independent_of_the_state() -> None:
    state = state_of()
    expected = live_bytes(state)
    stager = Stager()
    flat = flatten(state)
    snapshot = stager.snapshot(flat.leaves, flat.kinds)
    snapshot.stage()
    state["big"].add_(1)
    state["mid"].zero_()
    state["array"][:] = 0
    assert not snapshot.streaming
    assert staged_bytes(snapshot) == expected


def test_buffers_are_reused_between_saves() -> None:
    stager = Stager()
    flat = flatten(state_of(1))
    stager.snapshot(flat.leaves, flat.kinds).stage()
    memory = stager.memory(0)
    address = memory.obj  # the mmap behind it
    snapshot = stager.snapshot(flatten(state_of(2)).leaves, flat.kinds)
    snapshot.stage()
    assert stager.memory(0).obj is address
    assert staged_bytes(snapshot) == live_bytes(state_of(2))


def _changed(state: dict[str, Any], how: str) -> None:
    """Change `state` as a training loop might between two saves."""
    if how == "in place":
        state["half"].add_(1)
        state["array"][:] = 3
    elif how == "new tensors":
        state.update({k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    elif how == "same address, new shape":
        state["offset"].data = state["offset"].data.reshape(2, 5)
    elif how == "new dtype":
        state["half"] = state["half"].to(torch.float16)
    elif how == "non-contiguous":
        state["small_t"] = torch.randn(5, 8).t()
        state["half"] = torch.randn(128).to(torch.bfloat16)[::2]
    elif how == "conjugate":
        state["conj"] = state["conj"].conj()
    elif how == "negative":
        state["neg"] = torch.randn(3, dtype=torch.complex64).conj().imag
    elif how == "new key":
        state["extra"] = torch.arange(7)
    elif how == "array shape":
        state["array"] = np.arange(999, dtype=np.int32)
    elif how == "value becomes tensor":
        state["n"] = torch.tensor([5])
    elif how == "tied":
        state["tied"] = state["big"]
        state["mid_again"] = state["mid"]


@pytest.mark.parametrize("how", [
    "in place", "new tensors", "same address, new shape", "new dtype", "non-contiguous",
    "conjugate", "negative", "new key", "array shape", "value becomes tensor", "tied",
])
def test_a_changed_state_stages_what_it_holds_now(how: str) -> None:
    stager = Stager()
    state = state_of(3)
    for _ in range(2):  # the second snapshot reuses the first one's plan
        flat = flatten(state)
        snapshot = stager.snapshot(flat.leaves, flat.kinds)
        snapshot.stage()
    _changed(state, how)
    for _ in range(2):  # a changed state makes a new plan, which the next save reuses
        flat = flatten(state)
        snapshot = stager.snapshot(flat.leaves, flat.kinds)
        snapshot.stage()
        described = host_data(flat.leaves, flat.kinds)
        assert staged_bytes(snapshot) == staged_bytes(described)
        assert dict(snapshot.entries) == described.entries


def test_tied_tensors_are_staged_once_while_they_stay_tied() -> None:
    stager = Stager()
    state = state_of(4)
    state["tied"] = state["big"]
    state["mid_again"] = state["mid"]
    kinds = []
    for untie in (False, False, True, True):  # the second save of each reuses the plan
        if untie:
            state["tied"] = state["big"].clone().add_(1)
        flat = flatten(state)
        snapshot = stager.snapshot(flat.leaves, flat.kinds)
        snapshot.stage()
        staged = staged_bytes(snapshot)
        kinds.append(snapshot.entries["tied"].kind)
        assert snapshot.entries["mid_again"].kind == "alias"
        assert "mid_again" not in staged and ("tied" in staged) == untie
        assert staged == staged_bytes(host_data(flat.leaves, flat.kinds))
    assert kinds == ["alias", "alias", "tensor", "tensor"]


def test_tensors_tied_after_the_plan_was_made_are_staged_once() -> None:
    """A reused plan stages each of its tensors; two that became one since it was made (Hugging
    Face's tie_weights() after the first save) are found and staged once, as the first save of
    such a state does: the small ones copied by memcpy and the larger ones alike."""
    stager = Stager()
    state = state_of(5)
    state["small_again"] = torch.randn(8, 5).t()
    state["big_again"] = torch.randn(state["big"].shape)
    for tie in (False, False, True, True):  # the second save of each reuses the plan
        if tie:
            # Other tensor objects over the same memory, as a module's state_dict() gives.
            state["small_again"] = state["small_t"].detach()
            state["big_again"] = state["big"].detach()
        flat = flatten(state)
        snapshot = stager.snapshot(flat.leaves, flat.kinds)
        snapshot.stage()
        described = host_data(flat.leaves, flat.kinds)
        assert staged_bytes(snapshot) == staged_bytes(described)
        assert dict(snapshot.entries) == described.entries  # known once streamed
        assert [snapshot.entries[p].kind for p in ("small_again", "big_again")] == [
            "alias" if tie else "tensor"] * 2


def test_views_at_one_address_that_are_not_one_tensor_keep_the_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors sharing an address without being one (a view of a tensor's first rows, empty
    tensors) are no tie: a state of them whose addresses moved still fits its plan."""
    stager = Stager()
    base = torch.randn(6, 4)
    state = {"w": base, "rows": base[:2], "e1": torch.zeros(0), "e2": torch.zeros(0, 3)}
    flat = flatten(state)
    stager.snapshot(flat.leaves, flat.kinds).stage()

    def describe(*args: Any) -> None:
        raise AssertionError("a state that fits its plan was described again")

    monkeypatch.setattr(Stager, "_planned", describe)
    base = torch.randn(6, 4)
    state.update(w=base, rows=base[:2])
    flat = flatten(state)
    snapshot = stager.snapshot(flat.leaves, flat.kinds)
    snapshot.stage()
    assert staged_bytes(snapshot) == live_bytes(state)


def test_an_async_manager_stores_weights_tied_after_its_first_save_once(tmp_path: Path) -> None:
    """A load without a target then returns one tensor under both names, as after a
    synchronous save."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with sp.CheckpointManager(tmp_path / "run", keep_last=None, async_save=True) as mgr:
        mgr.save(1, {"model": model})
        head.weight = emb.weight  # tie_weights()
        mgr.save(2, {"model": model})
    kinds = {e.path: e.kind for e in sp.info(tmp_path / "run" / "step-2").entries}
    assert kinds == {"model/emb.weight": "tensor", "model/head.weight": "alias"}
    tree = sp.load(tmp_path / "run" / "step-2")["model"]
    assert tree["head.weight"] is tree["emb.weight"]


def test_a_tensor_turned_unsupported_is_refused_on_a_repeated_save() -> None:
    stager = Stager()
    state = {"w": torch.eye(3)}
    flat = flatten(state)
    stager.snapshot(flat.leaves, flat.kinds).stage()
    state["w"] = torch.eye(3).to_sparse()
    flat = flatten(state)
    with pytest.raises(sp.UnsupportedLeaf, match="sparse"):
        stager.snapshot(flat.leaves, flat.kinds)


@pytest.mark.parametrize("freed", ["large", "strided", "small-view", "large-view"])
def test_a_tensor_whose_storage_was_freed_is_refused_on_a_repeated_save(freed: str) -> None:
    """A tensor whose storage was freed since the last save (FSDP's resharding: the same
    sizes and strides, no memory) is refused by path when the plan is reused, as on the first
    save: torch's copy of it read address 0 and crashed the process; a view into a flat
    parameter, at its offset from 0, likewise."""
    stager = Stager()
    flat_small, flat_large = torch.randn(100), torch.randn(3 << 20)
    state = {"small": torch.randn(10), "large": torch.randn(1 << 20),
             "strided": torch.randn(8, 5).t(), "small-view": flat_small[50:60],
             "large-view": flat_large[1 << 20: 2 << 20]}
    flat = flatten(state)
    stager.snapshot(flat.leaves, flat.kinds).stage()
    state[freed].untyped_storage().resize_(0)
    flat = flatten(state)
    with pytest.raises(sp.UnsupportedLeaf, match="storage was freed") as refused:
        stager.snapshot(flat.leaves, flat.kinds)
    assert refused.value.path == freed


def run_streaming(stager: Stager, state: dict[str, Any], url: str) -> Snapshot:
    """Stage and write concurrently, as the manager does."""
    prepared = prepare_save(url, state)
    snapshot = stager.snapshot(prepared.leaves, prepared.kinds)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with prepared:
                write_and_commit(prepared, snapshot)
        except BaseException as exc:
            snapshot.abort(exc)
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    snapshot.stage()
    writer.join()
    if errors:
        raise errors[0]
    return snapshot


def test_budget_streams_and_the_result_is_exact(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(BLOCK_BYTES // 4 * 3 // 2 + i) for i in range(6)}
    state["huge"] = torch.randn(5 * BLOCK_BYTES // 4)  # larger than a half: cut into pieces
    stager = Stager(MIN_STAGING_BYTES)
    snapshot = run_streaming(stager, state, str(tmp_path / "c"))
    assert snapshot.streaming
    assert stager.nbytes + WRITER_BYTES <= MIN_STAGING_BYTES
    assert sp.verify(str(tmp_path / "c")).ok
    loaded = sp.load(str(tmp_path / "c"))
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_small_budget_is_refused() -> None:
    with pytest.raises(sp.SafepointError, match="max_staging_bytes"):
        Stager(MIN_STAGING_BYTES - 1)


def test_a_failing_writer_releases_the_stager(tmp_path: Path) -> None:
    stager = Stager(MIN_STAGING_BYTES)
    state = {f"t{i}": torch.randn(BLOCK_BYTES // 2) for i in range(8)}
    flat = flatten(state)
    snapshot = stager.snapshot(flat.leaves, flat.kinds)
    assert snapshot.streaming
    stream = iter(snapshot.stream())

    def writer() -> None:
        next(stream)
        snapshot.abort(OSError("disk gone"))

    thread = threading.Thread(target=writer)
    thread.start()
    snapshot.stage()  # returns instead of waiting forever for a drained buffer
    thread.join()


def test_a_failing_stage_stops_the_writer() -> None:
    stager = Stager()
    flat = flatten({"x": torch.ones(10)})
    snapshot = stager.snapshot(flat.leaves, flat.kinds)
    snapshot.abort(RuntimeError("copy failed"))
    with pytest.raises(sp.SafepointError, match="staging stopped"):
        list(snapshot.stream())


def test_numpy_only_state_stages_without_tensors() -> None:
    state = {"a": np.arange(10.0), "b": [np.ones((3, 3), dtype=np.uint8)]}
    stager = Stager()
    flat = flatten(state)
    snapshot = stager.snapshot(flat.leaves, flat.kinds)
    snapshot.stage()
    state["a"][:] = -1
    assert staged_bytes(snapshot)["a"] == np.arange(10.0).tobytes()


def test_a_staged_bytearray_or_array_can_be_resized_before_it_is_written() -> None:
    """Once staged, the state is the caller's again: the views of a bytearray's and a
    contiguous array's memory that staging copied from are released (a bytearray with an
    exported view refuses to be resized, as NumPy refuses an array another one views)."""
    state = {"buf": bytearray(b"abc"), "array": np.arange(6.0), "w": torch.ones(3)}
    flat = flatten(state)
    snapshot = Stager().snapshot(flat.leaves, flat.kinds)
    snapshot.stage()
    del flat
    state["buf"].extend(b"def")
    state["array"].resize(8)
    staged = staged_bytes(snapshot)
    assert staged["buf"] == b"abc"
    assert staged["array"] == np.arange(6.0).tobytes()


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "shard"])
def test_a_bytearray_can_be_extended_right_after_an_async_save(
    tmp_path: Path, held_back: threading.Event, sharded: bool
) -> None:
    """An asynchronous `save` returns once staged, and the caller may change the state at
    once: a bytearray (a data position that code extends) too, while the write is in
    flight. A state holding pieces of a global tensor (`sp.Shard`) takes the collective
    path, in a group of one too."""
    w = torch.arange(4.0)
    state = {"w": sp.Shard(w, (0,), (4,)) if sharded else w, "buf": bytearray(b"abc")}
    with sp.CheckpointManager(str(tmp_path / "run"), async_save=True) as mgr:
        mgr.save(1, state)
        try:
            state["buf"].extend(b"def")
        finally:
            held_back.set()
    assert sp.load(str(tmp_path / "run" / "step-1"))["buf"] == b"abc"
    assert state["buf"] == b"abcdef"


def test_an_array_can_be_resized_in_place_right_after_an_async_save(
    tmp_path: Path, held_back: threading.Event
) -> None:
    """NumPy resizes an array in place only while nothing else refers to it: the manager's
    save in flight held the state's leaves until its write ended."""
    state = {"w": torch.arange(10.0), "a": np.arange(4.0)}
    with sp.CheckpointManager(str(tmp_path / "run"), async_save=True) as mgr:
        mgr.save(1, state)
        try:
            state["a"].resize(6)
        finally:
            held_back.set()
    np.testing.assert_array_equal(sp.load(str(tmp_path / "run" / "step-1"))["a"], np.arange(4.0))
    np.testing.assert_array_equal(state["a"], [0.0, 1.0, 2.0, 3.0, 0.0, 0.0])


def test_unsupported_leaf_is_refused_before_staging() -> None:
    flat = flatten({"sparse": torch.eye(3).to_sparse()})
    with pytest.raises(sp.UnsupportedLeaf, match="sparse"):
        Stager().snapshot(flat.leaves, flat.kinds)


def test_a_pinned_plan_synchronizes_the_cuda_devices_its_parts_copy_from() -> None:
    # White-box and CPU-only: the devices come from the plan's entries, once per plan (a
    # pinned buffer needs CUDA, so pageable ones stand in).
    signature = [("a", Entry("tensor", "F32", (4,), device="cuda:1"), 16),
                 ("b", Entry("tensor", "F32", (4,), device="cpu"), 16),
                 ("c", Entry("bytes"), 3),
                 ("d", Entry("tensor", "F32", (2,), device="cuda:0"), 8)]
    stager = Stager()
    plan = stager._make_plan(signature, pinned=True)
    stager._memory = [_Memory(n, pinned=False) for n in plan.slot_bytes]
    assert stager.ops(plan, 0).devices == {"cuda:0", "cuda:1"}
    unpinned = stager._make_plan(signature, pinned=False)
    assert stager.ops(unpinned, 0).devices == set()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stage_through_pinned_memory() -> None:
    state = {"w": torch.randn(1000, 1000, device="cuda"), "c": torch.arange(5)}
    stager = Stager()
    flat = flatten(state)
    snapshot = stager.snapshot(flat.leaves, flat.kinds)
    snapshot.stage()
    expected = state["w"].cpu().numpy().tobytes()
    state["w"].zero_()
    assert stager._memory[0].pinned
    assert staged_bytes(snapshot)["w"] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_leaves_of_every_kind_stage_as_their_host_copies_and_replan_on_a_move(
        tmp_path: Path) -> None:
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in state_of(5).items()}
    state["fp8"] = torch.randn(33, device="cuda").to(torch.float8_e4m3fn)
    state["cpu"] = torch.arange(10)  # CPU and CUDA tensors side by side
    assert state["mid"].device.type == "cuda" and not state["mid"].is_contiguous()
    expected = live_bytes(state)
    stager = Stager(MIN_STAGING_BYTES)  # streams: "big" is larger than a part
    for n in range(2):  # the second save reuses the plan and its pinned buffers
        snapshot = run_streaming(stager, state, str(tmp_path / f"c{n}"))
        assert snapshot.streaming and all(m.pinned for m in stager._memory)
        assert live_bytes(sp.load(str(tmp_path / f"c{n}"))) == expected
    state["mid"] = state["mid"].cpu()  # moved: a new plan, still pinned for the others
    run_streaming(stager, state, str(tmp_path / "c2"))
    assert stager._plan is not None and stager._plan.pinned
    state = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    snapshot = run_streaming(stager, state, str(tmp_path / "c3"))  # all on the host now
    assert not snapshot._plan.pinned
    assert live_bytes(sp.load(str(tmp_path / "c3"))) == expected


def test_host_data_describes_its_leaves_as_they_stream() -> None:
    state = state_of(4)
    flat = flatten(state)
    data = host_data(flat.leaves, flat.kinds)
    assert data.layout == [] and data.entries == {}  # nothing described before streaming
    first = staged_bytes(data)
    layout, entries = list(data.layout), dict(data.entries)
    assert staged_bytes(data) == first  # streaming again describes the same, once
    assert data.layout == layout and data.entries == entries
    assert [item.path for item in layout] == [p for p, k in flat.kinds.items() if k != "value"]
    assert entries["mid"].shape == (700, 500) and entries["half"].dtype == "BF16"
    assert first["mid"] == state["mid"].contiguous().numpy().tobytes()


# -- repeated saves: what makes a state fit its plan ----------------------------------------------


def small_state() -> dict[str, Any]:
    """Small plain CPU tensors only: each one staged by memcpy from a view of its memory."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(40, generator=gen)
    return {
        "f": torch.randn(64, generator=gen),
        "square": torch.randn(6, 6, generator=gen),
        "window": base[0:10],
        "c": torch.randn(5, dtype=torch.complex64, generator=gen),
        "i": torch.arange(12, dtype=torch.int32),
        "base": base,
    }


def _changed_in_place(state: dict[str, Any], how: str) -> None:
    """Change a tensor's memory or metadata keeping its path (often its object too)."""
    if how == "data swapped":  # same object, dtype and shape; new memory, the old one freed
        state["f"].data = torch.full((64,), 3.0)
    elif how == "set_ same shape":
        state["f"].set_(torch.full((64,), 4.0))
    elif how == "set_ new shape":
        state["f"].set_(torch.full((8, 8), 5.0))
    elif how == "resize_":
        state["f"].resize_(32)
    elif how == "transpose_":  # same address and shape, other strides
        state["square"].t_()
    elif how == "same shape, other offset":
        state["window"] = state["base"][5:15]
    elif how == "new object, same memory":
        state["f"] = state["f"].view(64)
    elif how == "conj bit":  # same memory, same strides
        state["c"] = state["c"].conj()
    elif how == "neg bit":
        state["f"] = torch._neg_view(state["f"])
    elif how == "dtype reinterpreted":
        state["i"].data = state["i"].data.view(torch.float32)
    elif how == "requires_grad":
        state["f"].requires_grad_(True)


@pytest.mark.parametrize("how", [
    "data swapped", "set_ same shape", "set_ new shape", "resize_", "transpose_",
    "same shape, other offset", "new object, same memory", "conj bit", "neg bit",
    "dtype reinterpreted", "requires_grad",
])
def test_a_tensor_changed_at_its_path_stages_what_it_holds_now(how: str) -> None:
    stager = Stager()
    state = small_state()
    for _ in range(2):
        flat = flatten(state)
        stager.snapshot(flat.leaves, flat.kinds).stage()
    _changed_in_place(state, how)
    for n in range(2):  # the changed state, then a repeat of it
        flat = flatten(state)
        snapshot = stager.snapshot(flat.leaves, flat.kinds)
        snapshot.stage()
        described = host_data(flat.leaves, flat.kinds)
        assert staged_bytes(snapshot) == staged_bytes(described), (how, n)
        assert dict(snapshot.entries) == described.entries
        with torch.no_grad():
            for value in state.values():
                value.add_(1)  # the next save must see the new values


def test_a_state_that_fits_its_plan_is_not_described_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stager = Stager()
    state = {**small_state(), **{k: v for k, v in state_of(8).items() if k != "conj"}}
    flat = flatten(state)
    stager.snapshot(flat.leaves, flat.kinds).stage()

    def describe(*args: Any) -> None:
        raise AssertionError("a state that fits its plan was described again")

    monkeypatch.setattr(Stager, "_planned", describe)
    for n in range(2):
        with torch.no_grad():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.mul_(-1)
        state["array"][:] = n
        state["f"].data = torch.randn(64)  # a new address for one memcpy'd tensor
        flat = flatten(state)
        snapshot = stager.snapshot(flat.leaves, flat.kinds)
        snapshot.stage()
        assert staged_bytes(snapshot) == live_bytes(state)


def test_without_tensor_guards_every_save_describes_its_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without dynamo's TensorGuards: no plan is reused unchecked."""
    monkeypatch.setattr(torch._C._dynamo.guards, "TensorGuards", None)
    calls: list[int] = []
    planned = Stager._planned

    def counted(self: Stager, *args: Any) -> Any:
        calls.append(1)
        return planned(self, *args)

    monkeypatch.setattr(Stager, "_planned", counted)
    stager = Stager()
    state = small_state()
    for how in ("data swapped", "transpose_", "conj bit"):
        flat = flatten(state)
        snapshot = stager.snapshot(flat.leaves, flat.kinds)
        snapshot.stage()
        assert staged_bytes(snapshot) == live_bytes(state)
        _changed_in_place(state, how)
    assert len(calls) == 3


@pytest.mark.parametrize("seed", range(6))
def test_a_range_of_a_strided_tensor_is_copied_as_its_flat_elements(seed: int) -> None:
    """_copy_range copies elements start..stop of a tensor in row-major order from views of
    it (transposed, permuted, sliced, conjugate), as the flat copy would."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(7, 5, 6, dtype=torch.complex64, generator=gen)
    sources = [base.permute(2, 0, 1), base[:, ::2].conj(), base.transpose(0, 2)[1:],
               base[3].t(), base.reshape(-1)[::3], base]
    for source in sources:
        flat = source.reshape(-1)
        for _ in range(20):
            start = int(torch.randint(0, flat.numel(), (), generator=gen))
            stop = int(torch.randint(start, flat.numel() + 1, (), generator=gen))
            into = torch.full((stop - start,), 99, dtype=source.dtype)
            _copy_range(into, source, start, stop, False)
            assert torch.equal(into, flat[start:stop].resolve_conj()), (source.shape, start)


def test_a_large_non_contiguous_tensor_streams_within_the_budget(tmp_path: Path) -> None:
    """A transposed 128 MiB tensor saved through a 32 MiB budget is staged piece by piece
    from views of its rows, never flattened whole (a copy of all of it)."""
    w = torch.randn(4096, 8192)
    with sp.CheckpointManager(str(tmp_path), max_staging_bytes=MIN_STAGING_BYTES) as mgr:
        mgr.save(1, {"w": w.t()}).result()  # buffers made and touched
        grown = growth_during(lambda: mgr.save(2, {"w": w.t()}).result())
    assert grown < 64 << 20, f"{grown >> 20} MiB"
    assert torch.equal(sp.load(str(tmp_path / "step-2"))["w"], w.t())


@pytest.mark.parametrize("seed", range(4))
def test_a_range_of_a_strided_array_is_copied_as_its_flat_elements(seed: int) -> None:
    """_copy_array_range copies elements start..stop of an array in C order from views of it
    (transposed, permuted, sliced, big-endian), little-endian, as the flat copy would."""
    rng = np.random.default_rng(seed)
    base = rng.random((7, 5, 6))
    sources = [base.transpose(2, 0, 1), base[:, ::2], base.T[1:], np.asfortranarray(base),
               base.astype(">f8"), base.astype(">f8").T, base.reshape(-1)[::3], base[3]]
    for source in sources:
        flat = np.ascontiguousarray(source).reshape(-1)
        for _ in range(20):
            start = int(rng.integers(0, flat.size))
            stop = int(rng.integers(start, flat.size + 1))
            into = np.full(stop - start, 99.0)
            _copy_array_range(into, source, start, stop)
            assert np.array_equal(into, flat[start:stop]), (source.shape, source.strides, start)


@pytest.mark.parametrize("layout", ["fortran", "transposed", "big-endian"])
def test_a_large_array_not_stored_as_is_streams_within_the_budget(tmp_path: Path,
                                                                  layout: str) -> None:
    """A 128 MiB array whose memory does not hold its bytes as stored (not C-contiguous, or
    big-endian) saved through a 32 MiB budget is staged piece by piece from views of its rows
    (byte-swapped as they are copied), never copied whole first (beyond the budget)."""
    data = np.random.default_rng(0).random((4099, 4093), dtype=np.float64)  # rows cut
    array = {"fortran": np.asfortranarray(data), "transposed": data.T,
             "big-endian": data.astype(">f8")}[layout]
    with sp.CheckpointManager(str(tmp_path), max_staging_bytes=MIN_STAGING_BYTES) as mgr:
        mgr.save(1, {"a": array}).result()  # buffers made and touched
        grown = growth_during(lambda: mgr.save(2, {"a": array}).result())
    assert grown < 64 << 20, f"{grown >> 20} MiB"
    loaded = sp.load(str(tmp_path / "step-2"))["a"]
    assert loaded.dtype == array.dtype and np.array_equal(loaded, array)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_non_contiguous_float4_tensor_saves(tmp_path: Path, async_save: bool) -> None:
    """torch has no copy kernel for float4 between layouts: its bytes are copied as uint8,
    whole or in pieces (a budget smaller than the tensor)."""
    raw = torch.randint(0, 255, (4096, 8192), dtype=torch.uint8)  # 32 MiB: cut in pieces
    state = {"t": raw.view(torch.float4_e2m1fn_x2).t(), "small": raw[:4, :4].view(
        torch.float4_e2m1fn_x2).t()}
    with sp.CheckpointManager(str(tmp_path), async_save=async_save,
                              max_staging_bytes=MIN_STAGING_BYTES) as mgr:
        mgr.save(1, state)
    loaded = sp.load(str(tmp_path / "step-1"))
    assert torch.equal(loaded["t"].view(torch.uint8), raw.t())
    assert torch.equal(loaded["small"].view(torch.uint8), raw[:4, :4].t())


def test_max_staging_bytes_written_as_a_float(tmp_path: Path) -> None:
    """`max_staging_bytes=5e7` (how byte counts are often written) is 50,000,000 bytes: it
    failed with a raw TypeError from the first save that streamed through the budget."""
    assert Stager(5e7).max_bytes == 50_000_000 and isinstance(Stager(5e7).max_bytes, int)
    assert Stager(np.int64(5e7)).max_bytes == 50_000_000  # type: ignore[arg-type]
    state = {"w": torch.arange(9_000_000, dtype=torch.float32)}  # 36 MB > budget - 24 MiB
    budget: Any = 5e7
    with sp.CheckpointManager(str(tmp_path / "run"), max_staging_bytes=budget) as mgr:
        mgr.save(0, state).result()
        assert mgr._stager is not None and mgr._stager.nbytes <= 50_000_000 - WRITER_BYTES
    assert torch.equal(sp.load(str(tmp_path / "run" / "step-0"))["w"], state["w"])


@pytest.mark.parametrize("budget", [5e7 + 0.5, float("nan"), float("inf"), True, "5e7"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_staging_budget_that_is_no_whole_number_is_refused(
    tmp_path: Path, budget: object, async_save: bool
) -> None:
    """A fraction, NaN, an infinity or a non-number is refused when the manager is made
    (NaN passed the size check and failed at the first save), naming the root."""
    root = str(tmp_path / "run")
    with pytest.raises(sp.SafepointError,
                       match=rf"max_staging_bytes=.* for {re.escape(root)} is not a whole number"):
        sp.CheckpointManager(root, max_staging_bytes=budget,  # type: ignore[arg-type]
                             async_save=async_save)
    with pytest.raises(sp.SafepointError, match=r"max_staging_bytes=.* is not a whole number"):
        Stager(budget)  # type: ignore[arg-type]


# -- forked children and inference mode -------------------------------------------------------


def _private_dirty(pid: int) -> int:
    """Bytes of pages process `pid` holds as its own copies (written since a fork)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        found = re.search(r"Private_Dirty:\s+(\d+) kB", f.read())
    assert found is not None
    return int(found.group(1)) << 10


def test_staging_buffers_are_not_copied_into_a_forked_child(tmp_path: Path) -> None:
    """A child forked after a save (a DataLoader worker) does not inherit the staging buffers'
    pages: each later save writes the whole buffer, which copied every page the idle child
    still shared (the state's size per child and save)."""
    nbytes = 64 << 20
    state = {"w": torch.zeros(nbytes // 4)}
    with sp.CheckpointManager(str(tmp_path / "run"), keep_last=1) as mgr:
        mgr.save(1, state).result()
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child only waits to be killed
            os.close(write)
            os.read(read, 1)
            os._exit(0)
        os.close(read)
        try:
            mgr.save(2, state).result()
            copied = _private_dirty(child)
        finally:
            os.close(write)
            os.waitpid(child, 0)
    assert copied < nbytes // 4, f"the child holds {copied >> 20} MiB of copied pages"


def test_a_forked_child_can_stage_through_inherited_buffers() -> None:
    """The child keeps a valid (zeroed) mapping of each buffer: staging there after a fork,
    through the stager it inherited, copies the state as before the fork. (Small tensors and
    an array: memcpys; torch's own parallel copies may hang in a forked child.)"""
    stager = Stager()
    state = {**small_state(), "array": np.arange(1000, dtype=np.int32), "blob": b"bytes"}
    flat = flatten(state)
    stager.snapshot(flat.leaves, flat.kinds).stage()
    child = os.fork()
    if child == 0:  # pragma: no cover - reported through the exit status
        code = 1
        try:
            snapshot = stager.snapshot(flat.leaves, flat.kinds)
            snapshot.stage()
            code = 0 if staged_bytes(snapshot) == live_bytes(state) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the child hung staging through the buffers it inherited")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_a_save_in_inference_mode_leaves_the_buffers_writable_outside_it(
        tmp_path: Path) -> None:
    """The first asynchronous save made inside `torch.inference_mode()` (a best-model save in
    an evaluation block) made the staging buffer's tensor and the cached views into it there,
    as inference tensors: every later save outside inference mode failed with torch's raw
    RuntimeError 'Inplace update to inference tensor outside InferenceMode'. Loads into the
    state work inside and outside inference mode too."""
    state = {"w": torch.arange(2_000_000, dtype=torch.float32), "b": torch.arange(5.0)}
    with sp.CheckpointManager(str(tmp_path / "run"), keep_last=5) as mgr:
        with torch.inference_mode():
            mgr.save(1, state).result()
        state["w"] = state["w"] + 1  # a normal tensor again
        mgr.save(2, state).result()
        with torch.inference_mode():
            mgr.save(3, state).result()
        for step, inference in ((1, True), (2, False), (3, True)):
            into = {"w": torch.zeros(2_000_000), "b": torch.zeros(5)}
            with torch.inference_mode(inference):
                sp.load(mgr.step_url(step), into=into)
            assert torch.equal(into["w"], torch.arange(2_000_000.0) + (step > 1)), step
            assert torch.equal(into["b"], state["b"])
