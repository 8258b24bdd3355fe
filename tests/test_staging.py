"""Load-side staging: a contiguous CPU tensor target lends its own memory as the destination
(the no-second-copy path) and comes back as itself; a target that cannot take the bytes
directly (non-contiguous, a lazy conjugate or negative bit) gets a fresh buffer that is copied
into it; describe names a target's dtype as the format does; targets on an accelerator are filled a
host batch at a time through two reused buffers."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from safepoint import _staging
from safepoint._format import Entry
from safepoint._leaves import BYTES, TENSOR
from safepoint._staging import (
    Destination,
    describe,
    destination,
    destinations,
    device_batches,
    finish,
    host_data,
    host_leaf,
    raw_views,
)
from safepoint.errors import SafepointError, UnsupportedLeaf


def _fill(view: memoryview, data: bytes) -> None:
    view[:] = data


def test_a_contiguous_cpu_tensor_is_its_own_destination() -> None:
    target = torch.zeros(4, dtype=torch.float32)
    dest = destination(Entry("tensor", "F32", (4,)), "t", target)
    assert dest.holder is target and dest.target is None
    _fill(dest.view, torch.arange(4, dtype=torch.float32).numpy().tobytes())
    assert finish(Entry("tensor", "F32", (4,)), dest, "t", allow_pickle=False) is target
    assert target.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_targets_that_cannot_take_the_bytes_are_copied_into() -> None:
    real = torch.arange(6, dtype=torch.float32)
    complex_base = torch.complex(torch.zeros(3), torch.zeros(3))
    targets = {
        "transposed": (torch.zeros(3, 2).t(), real.reshape(2, 3)),
        "conj": (complex_base.conj(), torch.complex(real[:3], real[3:])),
        "neg": (torch.complex(torch.zeros(3), torch.zeros(3)).conj().imag,
                real[:3].clone()),
    }
    for name, (target, value) in targets.items():
        entry = Entry("tensor", describe(target, "tensor")[1], tuple(target.shape))
        dest = destination(entry, name, target)
        assert dest.target is target and dest.holder is not target, name
        _fill(dest.view, value.contiguous().numpy().tobytes())
        assert finish(entry, dest, name, allow_pickle=False) is target, name
        assert torch.equal(target.resolve_conj().resolve_neg(), value), name


def test_destinations_in_bulk_are_those_made_one_at_a_time() -> None:
    """Plain CPU tensors lend views of their own memory, made in bulk (an empty one among
    them); every other target gets what `destination` gives it."""
    # The last is large enough to be mapped apart from the others' heap: the span of their
    # views covers memory that belongs to none of them.
    plain = [torch.zeros(3), torch.zeros(0), torch.zeros(2, 2, dtype=torch.float64),
             torch.zeros(1 << 20, dtype=torch.uint8)]
    others = [torch.zeros(3, 2).t(), None, np.zeros(4, dtype=np.int32)]
    targets: list[object] = [plain[0], others[0], plain[1], others[1], plain[2], others[2],
                             plain[3]]
    entries = [Entry("tensor", describe(t, "tensor")[1], tuple(t.shape))
               if isinstance(t, torch.Tensor) else Entry("tensor", "F32", (3,)) if t is None
               else Entry("ndarray", "I32", (4,)) for t in targets]
    made = destinations(entries, [str(n) for n in range(len(targets))], targets)
    for entry, target, dest in zip(entries, targets, made, strict=True):
        single = destination(entry, "t", target)
        assert (dest.holder is target) == (single.holder is target)
        assert (dest.target is None) == (single.target is None)
        assert len(dest.view) == len(single.view)
    for position in (0, 2, 4, 6):
        tensor, dest = targets[position], made[position]
        assert isinstance(tensor, torch.Tensor)
        data = (bytes(range(1, 251)) * (tensor.nbytes // 250 + 1))[: tensor.nbytes]
        dest.view[:] = data
        assert tensor.numpy().tobytes() == data
    assert destinations([], [], []) == []


def test_a_value_the_allocator_refuses_is_named_by_path() -> None:
    """A damaged manifest can claim a petabyte for a tensor (no data file holds it, but the
    load allocates first): the allocator's refusal names the path and says to verify."""
    entry = Entry("tensor", "F32", (1 << 48,))
    with pytest.raises(SafepointError, match=r"cannot allocate 1125899906842624 bytes for "
                       r"'model/w' \(F32\[281474976710656\]\).*safepoint verify"):
        destination(entry, "model/w")


def test_raw_views_are_each_region_only() -> None:
    memory = torch.zeros(64, dtype=torch.uint8)
    base = memory.data_ptr()
    views = raw_views([base + 40, base, base + 8], [8, 4, 0])
    assert [len(v) for v in views] == [8, 4, 0]
    views[0][:] = b"\x01" * 8
    views[1][:] = b"\x02" * 4
    assert memory.tolist() == [2] * 4 + [0] * 36 + [1] * 8 + [0] * 16
    assert [len(v) for v in raw_views([base], [0])] == [0]


def test_describe_names_dtypes_as_the_format_does() -> None:
    assert describe(torch.zeros(2, 3, dtype=torch.bfloat16), "tensor") == ("tensor", "BF16",
                                                                            (2, 3))
    assert describe(torch.zeros((), dtype=torch.bool), "tensor") == ("tensor", "BOOL", ())
    # A dtype the format lacks keeps torch's name, so the mismatch message can show it.
    unknown = SimpleNamespace(dtype=torch.quint8, shape=torch.Size([1]))
    assert describe(unknown, "tensor") == ("tensor", "quint8", (1,))
    assert describe(np.zeros(3, dtype=">i4"), "ndarray") == ("ndarray", "I32", (3,))
    assert describe(7, "value") == ("value", None, None)


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")
def test_a_tensor_not_materialized_yet_is_described_without_shape_and_never_written() -> None:
    """A lazy module's parameter before its first forward pass: its dtype matches against a
    manifest and its shape is left open (asking for it raised torch's bare RuntimeError);
    every save meets it in `host_leaf`, which refuses it by path, saying what to do."""
    weight = torch.nn.LazyLinear(3, dtype=torch.float64).weight
    assert describe(weight, "uninitialized") == ("uninitialized", "F64", None)
    with pytest.raises(UnsupportedLeaf, match="run one forward pass") as caught:
        host_leaf(weight, "uninitialized", "model/weight")
    assert caught.value.path == "model/weight"


def test_device_targets_are_filled_a_bounded_batch_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU tensors stand in for accelerator targets (`destination` defers those): the batching,
    # alignment, buffer reuse and write-back are the same; CUDA runs it pinned and async.
    monkeypatch.setattr(_staging, "DEVICE_BATCH_BYTES", 1000)
    gen = torch.Generator().manual_seed(0)
    values = {"a": torch.randn(100, generator=gen), "b": torch.randn(3, generator=gen).to(
        torch.bfloat16), "big": torch.randn(700, generator=gen),  # larger than a batch
        "c": torch.randint(0, 2, (33,), generator=gen).bool(), "d": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "t": torch.randn(20, 7, generator=gen)}
    targets = {path: torch.zeros_like(v) for path, v in values.items()}
    targets["t"] = torch.zeros(7, 20).t()  # non-contiguous
    dests = {path: Destination(memoryview(b""), None, t) for path, t in targets.items()}
    dests["host"] = Destination(memoryview(bytearray(4)), bytearray(4))  # not deferred
    buffers = set()
    batches = 0
    for batch in device_batches(dests):
        batches += 1
        assert "host" not in batch
        for path, host in batch.items():
            assert host.holder.shape == targets[path].shape and host.holder.data_ptr() % 64 == 0
            host.view[:] = values[path].contiguous().reshape(-1).view(torch.uint8).numpy()
            buffers.add(host.holder.untyped_storage().data_ptr())
    assert batches == 3 and len(buffers) == 2  # a, b | big | c, d, t: two buffers, reused
    for path, value in values.items():
        assert dests[path].holder is targets[path] and dests[path].target is None
        assert torch.equal(targets[path], value), path
        assert finish(Entry("tensor", describe(value, "tensor")[1], tuple(value.shape)),
                      dests[path], path, allow_pickle=False) is targets[path]


def test_ties_name_the_first_of_one_tensor_under_several_paths() -> None:
    """Each later tensor is compared with every distinct tensor seen at its address: only the
    first was, so a weight tied after another view of its memory (a flat buffer the weights
    live in) was not found tied and was stored twice. A transposed view is another tensor;
    empty tensors are never tied."""
    base = torch.arange(12.0)
    ties = _staging.Ties()
    found = [ties.of(path, tensor, tensor.data_ptr()) for path, tensor in [
        ("a", base), ("view", base.view(3, 4)), ("b", base), ("c", base.view(3, 4).t()),
        ("e1", torch.empty(0)), ("e2", torch.empty(0)), ("copy", base.clone()), ("d", base),
        ("head", base.view(3, 4)), ("c2", base.view(3, 4).t()),
    ]]
    assert found == [None, None, "a", None, None, None, None, "a", "view", "c"]


def test_leaves_described_in_bulk_are_those_described_one_at_a_time(monkeypatch) -> None:
    """A save describes each batch of plain CPU tensors in C-level passes: the entries, layout
    and bytes are those of the one-at-a-time path. A batch holding a tensor tied to one of an
    earlier batch, a non-contiguous or an empty tensor, or a leaf that is no tensor is
    described one at a time."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
    leaves: dict[str, Any] = {
        f"t{n}": torch.arange(n % 37 + 1, dtype=torch.float32).to(dtypes[n % 5]).reshape(
            (n % 37 + 1, 1) if n % 2 else (n % 37 + 1,))
        for n in range(1800)
    }
    leaves["t700"] = leaves["t3"]  # tied across batches
    leaves["t900"] = torch.arange(6.0).reshape(2, 3).t()
    leaves["t1000"] = torch.zeros(0, 4)
    leaves["t1100"] = b"not a tensor"
    kinds = {path: BYTES if isinstance(value, bytes) else TENSOR
             for path, value in leaves.items()}
    bulk: list[bool] = []
    described_in_bulk = _staging._plain_batch

    def spied(batch: Any, ties: Any) -> Any:
        made = described_in_bulk(batch, ties)
        bulk.append(made is not None)
        return made

    def streamed() -> tuple[list[tuple[Any, bytes]], dict[str, Entry], list[Any]]:
        data = host_data(leaves, kinds)
        items = [(item, bytes(view)) for item, view in data.stream()]
        return items, dict(data.entries), list(data.layout)

    monkeypatch.setattr(_staging, "_plain_batch", spied)
    made = streamed()
    assert bulk == [True, False, False, True]  # batches of 512
    assert made[1]["t700"] == Entry("alias", "U8", (4, 1), (), "t3")
    monkeypatch.setattr(_staging, "_plain_batch", lambda batch, ties: None)
    assert streamed() == made


FREED = """
import sys, torch
import safepoint as sp
big, small = torch.randn(1000, 1000), torch.randn(10)
flat_big, flat_small = torch.randn(3_000_000), torch.randn(100)  # flat parameters
big_view, small_view = flat_big[1_000_000:2_000_000], flat_small[50:60]
for t in (big, small, flat_big, flat_small):
    t.untyped_storage().resize_(0)
for name, t in (("big", big), ("small", small), ("big-view", big_view),
                ("small-view", small_view)):
    for mode in ("sync", "async"):
        try:
            if mode == "sync":
                sp.save(f"{sys.argv[1]}/{name}", {"w": t})
            else:
                with sp.CheckpointManager(f"{sys.argv[1]}/{name}-m") as m:
                    m.save(1, {"w": torch.ones(3), "t": t}).result()
            print(name, mode, "saved")
        except sp.UnsupportedLeaf as exc:
            print(name, mode, "refused", exc.path)
"""


def test_a_tensor_whose_storage_was_freed_is_refused_by_path(tmp_path):
    """A tensor whose storage was resized to 0 (FSDP's resharded parameters) keeps its shape
    but has no memory: reading it would crash the process (torch's own copy_ does), so both
    sync and async saves refuse it by path, small or large, and so a view into such a
    storage, at its offset from address 0 (a parameter in a flat parameter: it was read
    there, and the process died)."""
    child = subprocess.run([sys.executable, "-c", FREED, str(tmp_path)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split("\n")[:8] == [
        f"{name} {mode} refused {path}" for name in ("big", "small", "big-view", "small-view")
        for mode, path in (("sync", "w"), ("async", "t"))], child.stdout


def _two_tensor(*shape: int) -> torch.Tensor:
    """A wrapper tensor subclass (`_make_wrapper_subclass`, as torchao's float8 and NF4
    weights are): its elements live in two inner tensors, its own storage claims their bytes
    at address 0."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.zeros(*shape), torch.zeros(*shape))


def test_a_wrapper_subclass_target_is_filled_through_torch() -> None:
    """Its storage claims its bytes at address 0: reading into that address crashed the
    process (memory://) or failed as "Bad address" (a local file). It gets a fresh buffer,
    which torch copies into it, into both inner tensors."""
    target = _two_tensor(2, 3)
    assert target.data_ptr() == 0 and target.untyped_storage().nbytes() == 24
    [dest] = destinations([Entry("tensor", "F32", (2, 3))], ["x"], [target])
    assert dest.target is target and dest.holder is not target
    values = torch.arange(6.0).reshape(2, 3)
    _fill(dest.view, values.numpy().tobytes())
    assert finish(Entry("tensor", "F32", (2, 3)), dest, "x", allow_pickle=False) is target
    assert torch.equal(target.a, values) and torch.equal(target.b, values)


def test_saving_a_wrapper_subclass_names_its_type(tmp_path) -> None:
    """It was refused as a tensor whose storage FSDP freed, with advice for FSDP."""
    with pytest.raises(UnsupportedLeaf, match="'x' is a TwoTensor, a tensor subclass") as info:
        sp.save(str(tmp_path / "ck"), {"x": _two_tensor(3)})
    assert info.value.path == "x" and "FSDP" not in str(info.value)
    assert "dequantize" in str(info.value) and "sp.Pickled" in str(info.value)


class _Moved:
    """Stands for a class that was renamed or moved since the save."""


class _RaisesOnLoad:
    def __reduce__(self) -> tuple[Any, ...]:
        return int, ("not an int",)


@pytest.mark.parametrize("into", [False, True])
def test_a_pickled_entry_that_does_not_unpickle_is_named(tmp_path, monkeypatch, into) -> None:
    """A bare AttributeError ("Can't get attribute '_Moved'") or the reduction's ValueError
    escaped, naming neither the entry nor what to do."""
    url = str(tmp_path / "ck")
    sp.save(url, {"x": torch.ones(2), "tok": sp.Pickled(_Moved()),
                  "cfg": sp.Pickled(_RaisesOnLoad())})
    monkeypatch.delattr(sys.modules[__name__], "_Moved")
    for keys, path, cause in ((["x", "tok"], "tok", "AttributeError"),
                              (["x", "cfg"], "cfg", "ValueError")):
        state = {"x": torch.zeros(2), path: None}
        with pytest.raises(UnsupportedLeaf, match=f"pickled entry at '{path}'.*{cause}") as info:
            if into:
                sp.load(url, into=state, keys=keys, allow_pickle=True)
            else:
                sp.load(url, keys=keys, allow_pickle=True)
        assert info.value.path == path and "keys=" in str(info.value)
