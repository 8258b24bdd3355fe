"""End-to-end tests of `sp.save` / `sp.load` / `sp.info` / `sp.verify` on a local directory:
every leaf type DESIGN lists round-trips bit for bit, in-place restore writes into the live
state's memory, strict and lenient matching, `keys=` selection, overwrite, info and metadata,
and refusal of what cannot be stored."""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import safepoint as sp
from _rss import growth_during
from _slow import SlowWrites
from _states import (
    assert_same,
    assert_same_array,
    assert_same_tensor,
    data_files,
    edit_manifest,
    manifest_files,
    random_tensor,
    sealed,
    train_step,
    training_state,
)
from safepoint import _api
from safepoint._commit import read_manifest, wait_for_removals
from safepoint._engine import IOOptions, write_file
from safepoint._format import DTYPES
from safepoint._leaves import TENSOR, VALUE
from safepoint._staging import DEVICE_BATCH_BYTES, host_data
from safepoint._storage_local import LocalStorage

ignore_complex_half = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental:UserWarning"
)

TORCH_DTYPES = [getattr(torch, d.torch) for d in DTYPES.values()]
NUMPY_DTYPES = [np.dtype(d.numpy) for d in DTYPES.values() if d.numpy]


def roundtrip(tmp_path: Path, state: Any, **load_kwargs: Any) -> Any:
    url = str(tmp_path / "ckpt")
    sp.save(url, state)
    assert sp.verify(url).ok
    return sp.load(url, **load_kwargs)


# -- tensors ------------------------------------------------------------------------------------


@ignore_complex_half
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_dtype_roundtrips_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    state = {
        "matrix": random_tensor(dtype, (5, 7), seed=1),
        "scalar": random_tensor(dtype, (), seed=2),
        "empty": random_tensor(dtype, (0, 3), seed=3),
        "vector": random_tensor(dtype, (1000,), seed=4),
    }
    loaded = roundtrip(tmp_path, state)
    assert_same(loaded, state)
    assert [e.dtype for e in sp.info(str(tmp_path / "ckpt")).entries] == [
        next(d.name for d in DTYPES.values() if getattr(torch, d.torch) == dtype)
    ] * 4


@ignore_complex_half
def test_all_dtypes_in_one_checkpoint(tmp_path: Path) -> None:
    """Mixed item sizes in one data file keep every entry aligned and intact."""
    state = {str(dtype): random_tensor(dtype, (3, 1 + i), seed=i)
             for i, dtype in enumerate(TORCH_DTYPES)}
    assert_same(roundtrip(tmp_path, state), state)


#: torch dtypes the format has no name for (docs/format.md says why).
QUANTIZED_DTYPES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
SUB_BYTE_DTYPES = {f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8)}


@ignore_complex_half
def test_every_whole_byte_torch_dtype_is_stored() -> None:
    """A dtype a new torch adds fails here until it has a name in the format or a reason to be
    refused; every stored one has torch's item size and can be made from raw bytes."""
    names = {str(v).removeprefix("torch.") for v in vars(torch).values()
             if isinstance(v, torch.dtype)}
    stored = {d.torch: d for d in DTYPES.values()}
    assert names - stored.keys() <= QUANTIZED_DTYPES | SUB_BYTE_DTYPES
    for name, dtype in stored.items():
        tensor = torch.zeros(16, dtype=torch.uint8).view(getattr(torch, name))
        assert tensor.element_size() == dtype.itemsize, name


@ignore_complex_half
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_dtype_restores_in_place(tmp_path: Path, dtype: torch.dtype) -> None:
    """Into a contiguous target (read straight into its memory) and a transposed one (copied
    into afterwards), for dtypes without comparison ops (float4, bits) too."""
    url = str(tmp_path / "ckpt")
    saved = {"flat": random_tensor(dtype, (4, 6), seed=1),
             "t": random_tensor(dtype, (4, 6), seed=2)}
    sp.save(url, saved)
    flat, base = torch.zeros(4, 6, dtype=dtype), torch.zeros(6, 4, dtype=dtype)
    target = {"flat": flat, "t": base.t()}
    view, ptrs = target["t"], (flat.data_ptr(), base.data_ptr())
    sp.load(url, into=target)
    assert target["flat"] is flat and target["t"] is view
    assert (flat.data_ptr(), base.data_ptr()) == ptrs
    assert_same_tensor(flat, saved["flat"], "flat")
    assert_same_tensor(base.t(), saved["t"], "t")


def test_a_torch_without_the_dtype_cannot_load_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"w": random_tensor(torch.float4_e2m1fn_x2, (3,)), "b": torch.arange(3)})
    monkeypatch.delattr(torch, "float4_e2m1fn_x2")
    with pytest.raises(sp.SafepointError, match=r"dtype float4_e2m1fn_x2 \(F4_E2M1_X2\): upgrade"
                       ) as caught:
        sp.load(url)
    assert f"cannot load 'w' from {url}" in str(caught.value) and caught.value.url == url
    assert_same_tensor(sp.load(url, keys=["b"])["b"], torch.arange(3))


def test_large_tensor_spanning_many_checksum_blocks(tmp_path: Path) -> None:
    big = random_tensor(torch.float32, (3 << 20,), seed=5)  # 12 MiB: 3 blocks of 4 MiB
    state = {"big": big, "after": torch.arange(10)}
    assert_same(roundtrip(tmp_path, state), state)


def _views() -> dict[str, torch.Tensor]:
    base = random_tensor(torch.float32, (6, 8), seed=7)
    complex_base = torch.complex(torch.randn(4, 5), torch.randn(4, 5))
    return {
        "transposed": base.t(),
        "step_slice": base[:, ::3],
        "offset_slice": base[2:],
        "row_step": base[::2, 1:7:2],
        "expanded": torch.randn(1, 5).expand(4, 5),
        "conj": complex_base.conj(),
        "conj_transposed": complex_base.conj().t(),
        "bf16_transposed": random_tensor(torch.bfloat16, (4, 3), seed=8).t(),
        "requires_grad": torch.randn(3, 3, requires_grad=True),
        "param": torch.nn.Parameter(torch.randn(2, 2)),
    }


@pytest.mark.parametrize("name", list(_views()))
def test_views_save_their_values(tmp_path: Path, name: str) -> None:
    view = _views()[name]
    conj_before = view.is_conj()
    loaded = roundtrip(tmp_path, {"v": view})["v"]
    assert type(loaded) is torch.Tensor
    assert not loaded.is_conj()
    assert not loaded.requires_grad
    # A dense layout (a transpose) keeps its strides, as from torch.load; any other view
    # comes back contiguous.
    dense = name.endswith("transposed")
    assert loaded.is_contiguous() is not dense
    assert not dense or loaded.stride() == view.stride()
    assert_same_tensor(loaded, view.detach(), name)
    assert view.is_conj() == conj_before  # saving did not touch the source


def test_views_sharing_storage_come_back_independent(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    loaded = roundtrip(tmp_path, {"a": base[:6], "b": base[3:], "c": base})
    assert_same(loaded, {"a": base[:6], "b": base[3:], "c": base})
    loaded["a"].fill_(-1)
    assert torch.equal(loaded["b"], base[3:])


# -- numpy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
def test_numpy_dtypes_roundtrip(tmp_path: Path, dtype: np.dtype) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=24 * dtype.itemsize, dtype=np.uint8)
    array = (raw % 2).astype(bool) if dtype == np.bool_ else raw.view(dtype)
    state = {
        "a": array.reshape(4, 6),
        "zero_d": array[:1].reshape(()).copy(),
        "empty": array[:0].reshape(0, 2),
        "strided": array.reshape(4, 6)[::2, ::3],
        "fortran": np.asfortranarray(array.reshape(4, 6)),
    }
    assert_same(roundtrip(tmp_path, state), state)


@pytest.mark.parametrize("dtype", [">f8", ">f4", ">f2", ">i8", ">i4", ">u2", ">c16", ">c8"])
def test_big_endian_arrays_come_back_big_endian(tmp_path: Path, dtype: str) -> None:
    """Stored little-endian, as every entry is; a load without a target gives the array its
    saved dtype back (it came back little-endian: the values, not the type), and so does one
    over a read-only array, which the loaded one replaces in its container."""
    array = np.arange(-5, 7).astype(dtype).reshape(3, 4)
    loaded = roundtrip(tmp_path, {"be": array, "view": array[:, ::2]})
    assert loaded["be"].dtype.str == dtype and np.array_equal(loaded["be"], array)
    assert_same_array(loaded["be"], array)
    assert_same_array(loaded["view"], array[:, ::2])
    into = {"be": np.zeros((3, 4), np.dtype(dtype).newbyteorder("<"))}
    filled = sp.load(str(tmp_path / "ckpt"), into=into, keys=["be"])
    assert filled["be"] is into["be"] and np.array_equal(into["be"], array)
    read_only = np.zeros((3, 4), dtype)
    read_only.flags.writeable = False
    replaced = sp.load(str(tmp_path / "ckpt"), into={"be": read_only}, keys=["be"])
    assert_same_array(replaced["be"], array)


@pytest.mark.parametrize(
    "scalar",
    [np.float64(-0.0), np.float32(1.5), np.float16(np.inf), np.int64(-(2**62)), np.int8(-7),
     np.uint8(200), np.uint64(2**64 - 1), np.bool_(True), np.complex64(1 - 2j),
     np.complex128(np.nan)],
    ids=lambda s: type(s).__name__,
)
def test_numpy_scalars_stay_numpy_scalars(tmp_path: Path, scalar: np.generic) -> None:
    loaded = roundtrip(tmp_path, {"s": scalar, "in_list": [scalar]})
    assert_same(loaded, {"s": scalar, "in_list": [scalar]})


def test_a_numpy_scalar_restores_strictly_over_a_plain_value(tmp_path: Path) -> None:
    """A loss averaged with NumPy (np.float64, a float subclass) restores into a fresh
    state's plain float, and stays the saved scalar; a 0-d array or a dtype change is still a
    mismatch."""
    ckpt = str(tmp_path / "ckpt")
    sp.save(ckpt, {"best": np.float64(0.25), "seen": np.int64(7), "grid": np.array(1.0)})
    loaded = sp.load(ckpt, into={"best": float("inf"), "seen": 0, "grid": np.array(0.0)})
    assert_same(loaded, {"best": np.float64(0.25), "seen": np.int64(7), "grid": np.array(1.0)})
    with pytest.raises(sp.StateMismatch, match="grid: checkpoint has a ndarray, target a value"):
        sp.load(ckpt, into={"best": 0.0, "seen": 0, "grid": 0.0})
    with pytest.raises(sp.StateMismatch, match="seen: checkpoint dtype I64, target F32"):
        sp.load(ckpt, into={"best": 0.0, "seen": np.float32(0), "grid": np.array(0.0)})


# -- plain values and containers ----------------------------------------------------------------


PLAIN_VALUES = {
    "int": 42,
    "negative": -7,
    "huge": 2**63 + 12345,
    "huger": -(2**100) - 1,
    "max_u64": 2**64 - 1,
    "float": 0.1,
    "neg_zero": -0.0,
    "nan": float("nan"),
    "inf": float("inf"),
    "neg_inf": float("-inf"),
    "tiny": 5e-324,
    "true": True,
    "false": False,
    "str": "héllo wörld ✓ 🚀 \u0000 \n\t\"quoted\"",
    "empty_str": "",
    "bytes": bytes(range(256)),
    "empty_bytes": b"",
    "none": None,
}


def test_plain_values_roundtrip_with_their_types(tmp_path: Path) -> None:
    loaded = roundtrip(tmp_path, PLAIN_VALUES)
    assert_same(loaded, PLAIN_VALUES)
    assert loaded["true"] is True and loaded["false"] is False  # not 1 / 0


def test_containers_keep_their_shape_and_key_types(tmp_path: Path) -> None:
    state = {
        "int_keys": {0: "zero", 1: "one", -5: "minus five", 2**70: "big"},
        "str_keys": {"a/b": 1, "100%": 2, "%2F": 3, "a%2Fb": 4, "": 5, ".": 6, "..": 7,
                     "*?[": 8, "ünï": 9},
        "nested": [1, (2, [3, (4,)]), {"t": (torch.arange(3), np.arange(2))}],
        "tuple": (1, "two", 3.0, None, b"five"),
        "empty": {"dict": {}, "list": [], "tuple": ()},
        "singleton": (None,),
        "mixed_keys": {"x": 1, 7: 2},
    }
    loaded = roundtrip(tmp_path, state)
    assert_same(loaded, state)
    assert type(loaded["nested"][1]) is tuple
    assert type(loaded["nested"][1][1]) is list


def test_key_escaping_keeps_distinct_keys_distinct(tmp_path: Path) -> None:
    """`a/b` as one key and `a` -> `b` nested must not collide, nor `%2F` with `/`."""
    state = {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}, "a%2Fb": torch.full((1,), 2.0)}
    loaded = roundtrip(tmp_path, state)
    assert_same(loaded, state)
    paths = [e.path for e in sp.info(str(tmp_path / "ckpt")).entries]
    assert len(set(paths)) == 3


def test_root_may_be_a_list_or_tuple(tmp_path: Path) -> None:
    state = (torch.arange(3), [1, 2], {"k": "v"})
    assert_same(roundtrip(tmp_path, state), state)


# -- stateful objects ---------------------------------------------------------------------------


class Counter:
    """A user class that saves itself through a state dict, counting restores."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.history: list[float] = []
        self.restores = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history), "buf": torch.full((2,), self.n)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restores += 1
        self.n = state["n"]
        self.history = list(state["history"])


def test_stateful_objects_load_as_their_state_dicts(tmp_path: Path) -> None:
    state = training_state(seed=1)
    counter = Counter(3)
    counter.history = [0.5, float("nan")]
    state["user"] = counter
    expected = {key: value.state_dict() if hasattr(value, "state_dict") else value
                for key, value in state.items()}
    loaded = roundtrip(tmp_path, state)
    assert_same(loaded, expected)
    # AdamW's per-parameter state keeps its int keys; param groups keep `params` as int lists.
    assert sorted(loaded["optim"]["state"]) == [0, 1, 2, 3]
    assert loaded["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert type(loaded["optim"]["param_groups"][0]["betas"]) is tuple
    assert loaded["scaler"]["scale"] == state["scaler"].get_scale()


class SharesItsLists:
    """A stateful object whose state_dict() hands out its live attributes, one of them
    another object's list (as a fresh SequentialLR's `_last_lr` is its first scheduler's)."""

    def __init__(self, shared: list[float], n: int) -> None:
        self.shared, self.own, self.table = shared, [float(n)], {"n": n}

    def state_dict(self) -> dict[str, Any]:
        return {"shared": self.shared, "own": self.own, "table": self.table}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shared, self.own, self.table = state["shared"], state["own"], state["table"]


def test_a_restore_never_changes_the_containers_a_state_dict_handed_out(tmp_path: Path) -> None:
    """Saved plain values reach a stateful object through load_state_dict only: the lists and
    dicts its state_dict() returned (its live attributes, possibly another object's) are left
    as they were. The restore wrote into them, so a restored SequentialLR reported its first
    scheduler's last learning rate as its own."""
    first, second = SharesItsLists([1.0], 1), SharesItsLists([2.0], 2)
    sp.save(str(tmp_path / "ckpt"), {"a": first, "b": second})
    alias: list[float] = [0.0]
    fresh_a, fresh_b = SharesItsLists(alias, 0), SharesItsLists(alias, 0)
    table = fresh_a.table
    sp.load(str(tmp_path / "ckpt"), {"a": fresh_a, "b": fresh_b})
    assert (fresh_a.shared, fresh_a.own, fresh_a.table) == ([1.0], [1.0], {"n": 1})
    assert (fresh_b.shared, fresh_b.own, fresh_b.table) == ([2.0], [2.0], {"n": 2})
    assert alias == [0.0] and table == {"n": 0}

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)], milestones=[3])
    for _ in range(5):
        optimizer.step()
        schedule.step()
    sp.save(str(tmp_path / "sched"), {"sched": schedule}, overwrite=True)
    fresh_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh = torch.optim.lr_scheduler.SequentialLR(fresh_optimizer, [
        torch.optim.lr_scheduler.LinearLR(fresh_optimizer, start_factor=0.1, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(fresh_optimizer, T_max=10)], milestones=[3])
    sp.load(str(tmp_path / "sched"), {"sched": fresh})
    assert fresh.get_last_lr() == schedule.get_last_lr()


def test_restore_in_place_writes_into_existing_memory(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    source = training_state(seed=1, steps=4)
    source["array"] = np.arange(10, dtype=np.float32) * 1.5
    source["user"] = Counter(9)
    sp.save(url, source)

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # fresh: no state yet
    target = {
        "model": model,
        "optim": optimizer,
        "sched": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", growth_interval=2),
        "ema": torch.zeros(7, 3),
        "step": 0,
        "array": np.zeros(10, dtype=np.float32),
        "user": Counter(0),
    }
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    ema_ptr = target["ema"].data_ptr()
    array_ptr = target["array"].__array_interface__["data"][0]
    ema, array = target["ema"], target["array"]

    result = sp.load(url, into=target)

    assert result is target
    assert target["ema"] is ema and target["ema"].data_ptr() == ema_ptr
    assert target["array"] is array and array.__array_interface__["data"][0] == array_ptr
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert_same(model.state_dict(), source["model"].state_dict())
    assert_same(optimizer.state_dict(), source["optim"].state_dict())
    assert_same(target["sched"].state_dict(), source["sched"].state_dict())
    assert_same(target["scaler"].state_dict(), source["scaler"].state_dict())
    assert_same_tensor(target["ema"], source["ema"])
    assert_same_array(target["array"], source["array"])
    assert target["step"] == 4
    assert target["user"].n == 9 and target["user"].restores == 1

    # Resumed training continues bit for bit.
    batch = torch.randn(4, 6)
    for state in (source, target):
        train_step(state["model"], state["optim"], state["scaler"], batch)
        state["sched"].step()
    assert_same(model.state_dict(), source["model"].state_dict())
    assert_same(optimizer.state_dict(), source["optim"].state_dict())


def test_bool_bytes_are_stored_as_they_are_in_memory(tmp_path: Path) -> None:
    """docs/format.md: a BOOL byte is False when 0 and True otherwise, stored as it is in
    memory (no pass over the data on save): a uint8 mask viewed as bool keeps its 2 and 255
    through a save, in a tensor and in an array."""
    raw = [0, 1, 2, 255]
    state = {"t": torch.tensor(raw, dtype=torch.uint8).view(torch.bool),
             "a": np.array(raw, dtype="u1").view("?")}
    loaded = roundtrip(tmp_path, state)
    assert loaded["t"].tolist() == loaded["a"].tolist() == [False, True, True, True]
    assert loaded["t"].view(torch.uint8).tolist() == loaded["a"].view("u1").tolist() == raw


def _attrs(url: str) -> dict[str, Any]:
    """Each entry's `attrs` cell, by path."""
    entries = json.loads((Path(url) / "manifest.json").read_text())["entries"]
    return dict(zip(entries["path"], entries["attrs"], strict=True))


def test_dense_tensors_keep_their_strides(tmp_path: Path) -> None:
    """A dense tensor that is not contiguous (channels_last, a transposed weight) came back
    contiguous, where torch.load keeps its strides. Its strides are recorded (attrs.strides;
    the bytes stay row-major) and a load without a target makes it with them; a contiguous
    tensor records nothing, and a view that is no dense layout (expanded, sliced) comes back
    contiguous, as before."""
    url = str(tmp_path / "ckpt")
    base = torch.randn(2, 3, 4, 5)
    state = {
        "channels_last": base.to(memory_format=torch.channels_last),
        "transposed": torch.randn(5, 3).t(),
        "one_row": torch.randn(2, 3, 1, 4).to(memory_format=torch.channels_last),
        "contiguous": base,
        "expanded": torch.randn(3, 1).expand(3, 4),
        "sliced": base[:, ::2],
        "empty": torch.empty(0, 3).t(),
    }
    sp.save(url, state)
    assert _attrs(url) == {
        "channels_last": {"strides": [60, 1, 15, 3]}, "transposed": {"strides": [1, 3]},
        "one_row": {"strides": [12, 1, 12, 3]},
        "contiguous": None, "expanded": None, "sliced": None, "empty": None,
    }
    loaded = sp.load(url)
    assert_same(loaded, state)
    for key in ("channels_last", "transposed", "one_row"):
        assert loaded[key].stride() == state[key].stride(), key
    assert loaded["expanded"].is_contiguous() and loaded["sliced"].is_contiguous()

    # An in-place target keeps its own layout.
    target = {key: torch.zeros(value.shape) for key, value in state.items()}
    memory = {key: value.data_ptr() for key, value in target.items()}
    sp.load(url, into=target)
    assert_same(target, state)
    assert all(value.is_contiguous() for value in target.values())
    assert {key: value.data_ptr() for key, value in target.items()} == memory


def test_an_asynchronous_save_records_the_strides_of_each_save(tmp_path: Path) -> None:
    """A manager's repeated saves describe a tensor at a path once per layout: one that
    became contiguous since records no strides, and one that turned back records them."""
    root = tmp_path / "run"
    weight = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    with sp.CheckpointManager(str(root)) as mgr:
        for step, value in enumerate((weight, weight.contiguous(), weight)):
            mgr.save(step, {"w": value})
            mgr.wait()
    assert [_attrs(str(root / f"step-{step}"))["w"] for step in range(3)] == [
        {"strides": list(weight.stride())}, None, {"strides": list(weight.stride())}]
    assert sp.load(str(root / "step-2"))["w"].stride() == weight.stride()


def _fused(make: str, parameters: Any) -> torch.optim.Optimizer:
    if make == "adamw":
        return torch.optim.AdamW(parameters, lr=0.01, fused=True)
    if make == "adam-amsgrad":
        return torch.optim.Adam(parameters, lr=0.01, amsgrad=True, fused=True)
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9, fused=True)


def _strided_model(seed: int) -> torch.nn.Module:
    """A channels_last CNN with a parameter stored transposed, as the weight of some
    projection layers is."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)
    model.register_parameter("proj", torch.nn.Parameter(torch.randn(5, 4).t()))
    return model


def _strided_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   steps: range) -> None:
    for step in steps:
        x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        out = model(x.to(memory_format=torch.channels_last)).mean(dim=(2, 3))
        (out @ model.proj).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("make", ["adamw", "adam-amsgrad", "sgd-momentum"])
@pytest.mark.parametrize("route", ["into", "load_state_dict"])
def test_fused_optimizers_of_strided_parameters_resume_bit_exact(
    tmp_path: Path, make: str, route: str
) -> None:
    """A fused optimizer assumes its state is laid out as its parameters: restored into a
    fresh optimizer (sp.load(into=)), or loaded as a tree and passed to load_state_dict (as
    Lightning does), its moments came back contiguous beside channels_last and transposed
    parameters, and training went on with scrambled moments, silently (weights off by
    0.04 to 0.17 after 3 steps). The state keeps the parameters' strides now."""
    url = str(tmp_path / "ckpt")
    model = _strided_model(0)
    optimizer = _fused(make, model.parameters())
    _strided_steps(model, optimizer, range(3))
    sp.save(url, {"model": model, "optim": optimizer})
    _strided_steps(model, optimizer, range(3, 6))

    resumed = _strided_model(1)
    fresh = _fused(make, resumed.parameters())
    if route == "into":
        sp.load(url, into={"model": resumed, "optim": fresh})
    else:
        tree = sp.load(url)
        resumed.load_state_dict(tree["model"])
        fresh.load_state_dict(tree["optim"])
    _strided_steps(resumed, fresh, range(3, 6))
    assert_same(resumed.state_dict(), model.state_dict())
    assert_same(fresh.state_dict(), optimizer.state_dict())


def test_local_loads_read_large_entries_in_long_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local load reads a large entry in ranged reads of up to 128 MiB (a cold page cache
    loaded GPT-2 with AdamW state a third faster than with 32 MiB reads), each on one
    descriptor in stretches of 4 MiB, checked as they land, straight into the destination,
    bit-exact."""
    url = str(tmp_path / "ckpt")
    source = {"w": torch.randn(16 << 20)}  # 64 MiB: one read
    sp.save(url, source)
    sizes: list[int] = []
    landings: list[int] = []
    stretches = LocalStorage.readinto_stretches

    def spy(self: LocalStorage, path: str, offset: int, buffers: Any, stretch: int) -> Any:
        sizes.append(sum(len(b) for b in buffers))
        for landed in stretches(self, path, offset, buffers, stretch):
            landings.append(landed)
            yield landed

    monkeypatch.setattr(LocalStorage, "readinto_stretches", spy)
    target = {"w": torch.zeros(16 << 20)}
    pointer = target["w"].data_ptr()

    sp.load(url, into=target)

    assert sizes == [64 << 20]
    assert landings == [n << 22 for n in range(1, 17)]
    assert target["w"].data_ptr() == pointer
    assert_same_tensor(target["w"], source["w"])


def test_a_load_of_many_entries_plans_and_reads_a_batch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More entries than one planning batch: every batch is planned, read into the targets'
    own memory and checked, and a flipped byte in the last batch's data is found."""
    from safepoint import _api

    count = 2 * _api._PLAN_BATCH + 100
    dtypes = [torch.float32, torch.int64, torch.bfloat16, torch.uint8]
    source = {f"t{i}": (torch.arange(i % 37 + 1) * (i + 1)).to(dtypes[i % 4])
              for i in range(count)}
    url = str(tmp_path / "ckpt")
    sp.save(url, source)
    batches: list[int] = []
    group_ranges = _api.group_ranges

    def spy(placed: Any, *options: Any) -> Any:
        reads = group_ranges(placed, *options)
        batches.append(sum(len(parts) for _, _, _, parts in reads))
        return reads

    monkeypatch.setattr(_api, "group_ranges", spy)
    target = {key: torch.zeros_like(value) for key, value in source.items()}
    pointers = {key: value.data_ptr() for key, value in target.items()}

    sp.load(url, into=target)

    assert batches == [_api._PLAN_BATCH, _api._PLAN_BATCH, 100]
    assert {key: value.data_ptr() for key, value in target.items()} == pointers
    for key, value in source.items():
        assert_same_tensor(target[key], value)

    last = f"t{count - 1}"
    storage = LocalStorage(url)
    (chunk,) = read_manifest(storage).entries[last].chunks
    data = tmp_path / "ckpt" / chunk.file
    blob = bytearray(data.read_bytes())
    blob[chunk.offset] ^= 0x01
    data.write_bytes(blob)
    with pytest.raises(sp.CorruptCheckpoint, match=f"'{last}'"):
        sp.load(url, into=target)


@pytest.mark.parametrize(("numel", "threads"), [(64, 1), (1 << 19, 4)])
def test_local_loads_of_small_entries_read_on_no_more_threads_than_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, numel: int, threads: int
) -> None:
    """Reading small entries is the interpreter's work: beyond one thread per CPU the
    threads only contend for it; large entries keep every reading thread."""
    from safepoint import _api

    url = str(tmp_path / "ckpt")
    source = {f"t{i}": torch.full((numel,), float(i)) for i in range(8)}
    sp.save(url, source)
    used: list[int] = []
    read_parts = _api.read_parts

    def spy(*args: Any, options: Any, **kwargs: Any) -> Any:
        used.append(options.read_threads)
        return read_parts(*args, options=options, **kwargs)

    monkeypatch.setattr(_api, "read_parts", spy)
    monkeypatch.setattr(_api, "_cpus", lambda: 1)
    target = {key: torch.zeros_like(value) for key, value in source.items()}

    sp.load(url, into=target)

    assert used == [threads]
    for key, value in source.items():
        assert_same_tensor(target[key], value)


def test_targets_waiting_for_a_device_load_beside_host_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU tensors stand in for accelerator targets (what `destination` defers for a device):
    they load through host batches, the others straight into their memory, in one load."""
    from safepoint import _api, _staging

    monkeypatch.setattr(_staging, "DEVICE_BATCH_BYTES", 4096)
    source = {f"t{i}": torch.arange(i * 50, dtype=torch.float32) + i for i in range(12)}
    url = str(tmp_path / "ckpt")
    sp.save(url, source)
    made = _api.destinations

    def deferring(entries: Any, paths: Any, targets: Any, **options: Any) -> Any:
        dests = made(entries, paths, targets, **options)
        return [sp_dest if index % 3 else _staging.Destination(memoryview(b""), None, target)
                for index, (sp_dest, target) in enumerate(zip(dests, targets, strict=True))]

    monkeypatch.setattr(_api, "destinations", deferring)
    target = {key: torch.zeros_like(value) for key, value in source.items()}
    pointers = {key: value.data_ptr() for key, value in target.items()}
    calls: list[tuple[int, int]] = []

    result = sp.load(url, into=target, progress=lambda *call: calls.append(call))

    assert result is target
    assert {key: value.data_ptr() for key, value in target.items()} == pointers
    for key, value in source.items():
        assert_same_tensor(target[key], value)
    _progress_is_sound(calls, sum(value.nbytes for value in source.values()))


def test_local_loads_prefetch_what_they_select(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local load asks the kernel to read ahead the bytes it will read (whole data files
    when everything is loaded, the span of the selected entries with keys=) before it plans,
    so that a cold load's disk reads overlap its planning."""
    url = str(tmp_path / "ckpt")
    source = {"a": torch.randn(1000), "b": {"x": torch.randn(50_000), "y": torch.randn(7)},
              "c": torch.randn(300)}
    info = sp.save(url, source)
    (name,) = [f"data/{p.name}" for p in (tmp_path / "ckpt" / "data").iterdir()]
    calls: list[dict[str, tuple[int, int]]] = []
    prefetch = LocalStorage.prefetch

    def spy(self: LocalStorage, spans: dict[str, tuple[int, int]]) -> None:
        calls.append(dict(spans))
        prefetch(self, spans)

    monkeypatch.setattr(LocalStorage, "prefetch", spy)
    target = {"a": torch.zeros(1000), "b": {"x": torch.zeros(50_000), "y": torch.zeros(7)},
              "c": torch.zeros(300)}
    sp.load(url, into=target)
    assert calls == [{name: (0, info.nbytes)}]

    calls.clear()
    sp.load(url, into=target, keys=["b/"])
    ((path, (start, end)),) = [span for call in calls for span in call.items()]
    assert path == name
    assert start >= 1000 * 4 and end <= info.nbytes - 300 * 4
    assert end - start >= (50_000 + 7) * 4
    assert_same_tensor(target["b"]["x"], source["b"]["x"])


def test_restore_in_place_makes_no_second_copy_of_the_state(tmp_path: Path) -> None:
    """256 MiB of tensors restore into their own memory: the load's peak memory stays far
    below a second copy of them (one would add 256 MiB)."""
    url = str(tmp_path / "ckpt")
    state = {f"t{i}": torch.full((16 << 20,), float(i)) for i in range(4)}
    sp.save(url, state)
    target = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    pointers = {name: tensor.data_ptr() for name, tensor in target.items()}
    growth = growth_during(lambda: sp.load(url, into=target))
    assert all(torch.equal(target[name], state[name]) for name in state)
    assert {name: tensor.data_ptr() for name, tensor in target.items()} == pointers
    assert growth < 64 << 20, f"the load grew the process by {growth >> 20} MiB"


def test_restore_in_place_into_non_contiguous_targets(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    saved = {"t": torch.randn(4, 6), "c": torch.complex(torch.randn(3), torch.randn(3))}
    sp.save(url, saved)
    base = torch.zeros(6, 4)
    target = {"t": base.t(), "c": torch.zeros(3, dtype=torch.complex64)}
    view, ptr = target["t"], base.data_ptr()
    sp.load(url, into=target)
    assert target["t"] is view and base.data_ptr() == ptr
    assert_same_tensor(target["t"].contiguous(), saved["t"])
    assert_same_tensor(target["c"], saved["c"])


def test_restore_into_numpy_targets_that_cannot_take_the_bytes_directly(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"be": np.arange(4, dtype=np.float64), "ro": np.arange(3),
                  "strided": np.arange(3, dtype=np.int32)})
    readonly = np.zeros(3, dtype=np.int64)
    readonly.flags.writeable = False
    big_endian = np.zeros(4, dtype=">f8")
    base = np.zeros(6, dtype=np.int32)
    target = {"be": big_endian, "ro": readonly, "strided": base[::2]}
    sp.load(url, into=target)
    assert target["be"] is big_endian and big_endian.dtype == np.dtype(">f8")
    assert list(big_endian) == [0.0, 1.0, 2.0, 3.0]
    assert list(base) == [0, 0, 1, 0, 2, 0]  # the view was written through
    assert list(readonly) == [0, 0, 0]  # read-only memory is never written behind numpy's back
    assert list(target["ro"]) == [0, 1, 2]


def test_restore_a_stateful_root(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    sp.save(url, torch.nn.Linear(3, 2))
    expected = sp.load(url)
    module = torch.nn.Linear(3, 2)
    assert sp.load(url, into=module) is module
    assert_same(module.state_dict(), expected)


def test_restore_into_a_tuple_root_returns_a_new_tuple(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, (torch.arange(4.0), 5, "x"))
    live = torch.zeros(4)
    target = (live, 0, "")
    result = sp.load(url, into=target)
    assert type(result) is tuple and result is not target
    assert result[0] is live and torch.equal(live, torch.arange(4.0))
    assert result[1:] == (5, "x")
    assert target[1:] == (0, "")


def test_restore_replaces_plain_values_in_lists_and_nested_tuples(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"l": [1, "a", (2.5, None)], "d": {3: b"x"}})
    target: dict[str, Any] = {"l": [0, "", (0.0, 7)], "d": {3: b""}}
    inner = target["l"]
    assert sp.load(url, into=target) is target
    assert target["l"] is inner
    assert_same(target, {"l": [1, "a", (2.5, None)], "d": {3: b"x"}})


# -- tied tensors -------------------------------------------------------------------------------


class Tied(torch.nn.Module):
    """An embedding shared with the output layer, as GPT-2 ties them: `state_dict()` lists the
    one tensor under two names."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def _kinds(info: sp.CheckpointInfo) -> dict[str, tuple[str, Any]]:
    return {e.path: (e.kind, e.value) for e in info.entries}


def test_a_tied_tensor_is_stored_once_and_loads_tied(tmp_path: Path) -> None:
    model = Tied()
    url = str(tmp_path / "ckpt")
    info = sp.save(url, {"model": model, "again": model.emb.weight})
    assert _kinds(info) == {"model/emb.weight": ("tensor", None),
                            "model/head.weight": ("alias", "model/emb.weight"),
                            "again": ("alias", "model/emb.weight")}
    assert info.nbytes == 300 * 64 * 4  # the bytes once
    assert sp.info(url).entries == info.entries and sp.verify(url).ok
    loaded = sp.load(url)
    assert loaded["model"]["head.weight"] is loaded["model"]["emb.weight"] is loaded["again"]
    assert_same_tensor(loaded["model"]["head.weight"], model.emb.weight.detach())
    alone = sp.load(url, keys=["model/head.weight"])  # the alias without what it aliases
    assert list(alone["model"]) == ["head.weight"]
    assert_same_tensor(alone["model"]["head.weight"], model.emb.weight.detach())


def test_chunks_sharing_bytes_load_and_verify(tmp_path: Path) -> None:
    """The format lets two chunks share bytes (a writer storing equal tensors once): a read
    fills its destinations one after the other, so such chunks are read apart (they were
    read into one run of buffers, and intact data failed its checksums)."""

    url = str(tmp_path / "c")
    sp.save(url, {"a": torch.arange(4.0), "b": torch.arange(4.0) + 1, "c": torch.ones(2)})
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    doc["chunks"]["offset"][1] = doc["chunks"]["offset"][0]  # b shares a's bytes
    doc["chunks"]["digests"][1] = doc["chunks"]["digests"][0]
    (tmp_path / "c" / "manifest.json").write_bytes(sealed(doc))
    assert sp.verify(url).ok
    loaded = sp.load(url)
    assert torch.equal(loaded["a"], torch.arange(4.0)) and torch.equal(loaded["b"], loaded["a"])
    assert torch.equal(loaded["c"], torch.ones(2))
    into = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(2)}
    sp.load(url, into=into)
    assert torch.equal(into["b"], torch.arange(4.0)) and torch.equal(into["c"], torch.ones(2))


def test_an_entry_stored_as_several_chunks_loads_whole(tmp_path: Path) -> None:
    """The format lets an entry's bytes be the concatenation of several chunks, anywhere in
    any data file (incremental saves write them): loads with and without a target, of the
    whole entry or a `keys=` selection, and verify join them in order."""

    from safepoint._checksum import block_digests, checksum_function

    url = str(tmp_path / "c")
    t = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: three checksum blocks
    sp.save(url, {"t": t, "u": torch.ones(3)})
    manifest_path = tmp_path / "c" / "manifest.json"
    doc = json.loads(manifest_path.read_text())
    data = t.numpy().tobytes()
    cuts = [0, (5 << 20) + 4, (9 << 20) + 8, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(cuts)]
    blob = b"".join(reversed(pieces))  # stored last piece first
    (tmp_path / "c" / "data" / "other.bin").write_bytes(blob)
    doc["files"].append({"name": "data/other.bin", "nbytes": len(blob)})
    crc = checksum_function(doc["checksum"]["algorithm"])
    block = doc["checksum"]["block_bytes"]
    rows = doc["chunks"]
    first = rows["entry"].index(0)
    for column in rows.values():
        del column[first]
    offset = len(blob)
    for piece in pieces:
        offset -= len(piece)
        rows["entry"].append(0)
        rows["file"].append(len(doc["files"]) - 1)
        rows["offset"].append(offset)
        rows["nbytes"].append(len(piece))
        rows["digests"].append(block_digests(memoryview(piece), block, crc))
    manifest_path.write_bytes(sealed(doc))
    assert sp.verify(url).ok
    assert torch.equal(sp.load(url)["t"], t)
    assert torch.equal(sp.load(url, keys=["t"])["t"], t)
    into = {"t": torch.zeros_like(t), "u": torch.zeros(3)}
    sp.load(url, into=into)
    assert torch.equal(into["t"], t) and torch.equal(into["u"], torch.ones(3))


def test_tied_weights_restore_into_tied_and_untied_models(tmp_path: Path) -> None:
    source = Tied()
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": source})
    tied = Tied()
    pointer = tied.emb.weight.data_ptr()
    sp.load(url, into={"model": tied})
    assert tied.head.weight is tied.emb.weight and tied.emb.weight.data_ptr() == pointer
    assert_same_tensor(tied.emb.weight.detach(), source.emb.weight.detach())
    untied = Tied(tie=False)
    sp.load(url, into={"model": untied})
    for weight in (untied.emb.weight, untied.head.weight):
        assert_same_tensor(weight.detach(), source.emb.weight.detach())
    # A checkpoint of an untied model (or of a safepoint before aliases) loads into a tied one.
    sp.save(str(tmp_path / "untied"), {"model": untied})
    assert {e.kind for e in sp.info(str(tmp_path / "untied")).entries} == {"tensor"}
    fresh = Tied()
    sp.load(str(tmp_path / "untied"), into={"model": fresh})
    assert_same_tensor(fresh.emb.weight.detach(), source.emb.weight.detach())


def test_only_the_same_tensor_is_an_alias(tmp_path: Path) -> None:
    """Views of the same memory with another shape, dtype or offset, and copies, are tensors
    of their own; two identical views are one tensor, non-contiguous or not."""
    base = torch.arange(12, dtype=torch.float32)
    state = {"base": base, "matrix": base.view(3, 4), "ints": base.view(torch.int32),
             "head": base[:6], "tail": base[6:], "copy": base.clone()}
    info = sp.save(str(tmp_path / "views"), state)
    assert {kind for kind, _ in _kinds(info).values()} == {"tensor"}
    assert_same(sp.load(str(tmp_path / "views")), state)
    pair = {"t": base.view(3, 4).t(), "t_again": base.view(3, 4).t()}
    info = sp.save(str(tmp_path / "pair"), pair)
    assert _kinds(info)["t_again"] == ("alias", "t")
    loaded = sp.load(str(tmp_path / "pair"))
    assert loaded["t_again"] is loaded["t"]
    assert_same_tensor(loaded["t"], pair["t"])


def test_weights_saved_apart_into_a_target_that_ties_them_are_a_mismatch(
    tmp_path: Path
) -> None:
    """A checkpoint of two distinct weights restored into a model that ties them cannot fill
    both: it is a StateMismatch naming both paths, raised before anything changed (it was a
    false checksum mismatch once both reads had landed in the same memory). Selecting one of
    them fills the tie with it; weights saved apart but equal (an untied copy, or a
    checkpoint from before aliases) still load into the tie."""
    torch.manual_seed(0)
    url = str(tmp_path / "ckpt")
    saved = Tied(tie=False)
    sp.save(url, {"model": saved})
    tied = Tied()
    before = tied.emb.weight.detach().clone()
    with pytest.raises(sp.StateMismatch, match=r"'model/emb.weight' and 'model/head.weight' "
                       r"apart.*untie them.*keys=.*Nothing was changed") as raised:
        sp.load(url, into={"model": tied})
    assert raised.value.mismatched == ["model/emb.weight", "model/head.weight"]
    assert torch.equal(tied.emb.weight, before) and sp.verify(url).ok
    sp.load(url, into={"model": tied}, keys=["model/head.weight"])
    assert torch.equal(tied.emb.weight, saved.head.weight)


def test_overlapping_views_in_the_target_are_a_mismatch(tmp_path: Path) -> None:
    """Two targets that are views of one memory (a tensor and a slice of it, an array and a
    slice of it) cannot take two saved values: a StateMismatch naming both, nothing
    changed."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"a": torch.arange(4.0), "b": torch.arange(3.0) + 10,
                  "x": np.arange(4), "y": np.arange(3) + 10})
    base, array = torch.zeros(4), np.zeros(4, dtype=np.int64)
    state = {"a": base, "b": base[1:], "x": np.zeros(4, dtype=np.int64),
             "y": np.zeros(3, dtype=np.int64)}
    with pytest.raises(sp.StateMismatch, match=r"'a' and 'b'.*Nothing was changed") as caught:
        sp.load(url, into=state)
    assert "share part of their memory" in str(caught.value)
    assert "different values" not in str(caught.value)
    assert not base.any() and not state["x"].any()
    state = {"a": torch.zeros(4), "b": torch.zeros(3), "x": array, "y": array[1:]}
    with pytest.raises(sp.StateMismatch, match=r"'x' and 'y'"):
        sp.load(url, into=state)
    assert not array.any() and not state["a"].any()



@pytest.mark.parametrize("library", ["torch", "numpy"])
def test_strided_views_sharing_memory_are_a_mismatch_and_disjoint_ones_load(
    tmp_path: Path, library: str
) -> None:
    """A strided view sharing memory with another target (a matrix and its transpose) is
    refused like any overlap, nothing changed (it was copied over the other
    after the read: the last copy won, silently), and the message says they share part of
    their memory; views that interleave without sharing an element (a weight's column
    blocks) load, each with its own values."""
    url = str(tmp_path / "ckpt")
    make = torch.arange if library == "torch" else np.arange
    sp.save(url, {"a": make(16).reshape(4, 4), "b": make(16).reshape(4, 4) + 100,
                  "c": make(8).reshape(4, 2) + 200})
    zeros = torch.zeros if library == "torch" else np.zeros
    base = zeros((4, 4), dtype=torch.int64 if library == "torch" else np.int64)
    with pytest.raises(sp.StateMismatch, match=r"'a' and 'b'.*share part of their memory"):
        sp.load(url, into={"a": base, "b": base.T, "c": zeros((4, 2), dtype=base.dtype)})
    assert not base.any()
    wide = zeros((4, 6), dtype=base.dtype)
    state = {"b": wide[:, :4], "c": wide[:, 4:]}
    sp.load(url, into=state, keys=["b", "c"])
    assert (state["b"] == make(16).reshape(4, 4) + 100).all()
    assert (state["c"] == make(8).reshape(4, 2) + 200).all()


@pytest.mark.parametrize("layout", ["transposed", "fortran", "conj"])
def test_a_tie_of_a_strided_target_loads_from_a_checkpoint_storing_both_apart(
    tmp_path: Path, layout: str
) -> None:
    """One target under two names (a tie) whose memory is not one C-order range (a transposed
    tensor, a Fortran-order array, a conjugate view), with the same bytes stored apart,
    loads as a contiguous tie does (it was refused as views sharing part of their memory)."""
    url = str(tmp_path / "ckpt")
    value: Any
    if layout == "fortran":
        value, tied = np.arange(9.0).reshape(3, 3), np.zeros((3, 3), order="F")
    elif layout == "transposed":
        value, tied = torch.arange(9.0).reshape(3, 3), torch.zeros(3, 3).T
    else:
        value = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        tied = torch.zeros(2, dtype=torch.complex64).conj()
    sp.save(url, {"a": value, "b": value.copy() if layout == "fortran" else value.clone()})
    sp.load(url, into={"a": tied, "b": tied})
    if layout == "fortran":
        np.testing.assert_array_equal(tied, value)
    else:
        assert torch.equal(tied.resolve_conj(), value)


def test_an_alias_loaded_into_views_of_one_tensor_is_a_mismatch(tmp_path: Path) -> None:
    """A tie saved as an alias, loaded into a tensor and its transpose: refused, nothing
    changed (the pair was passed over as one saved tensor, and the tensor came back
    transposed, silently)."""
    url = str(tmp_path / "ckpt")
    weight = torch.arange(9.0).reshape(3, 3)
    sp.save(url, {"a": weight, "b": weight})
    base = torch.zeros(3, 3)
    with pytest.raises(sp.StateMismatch, match="share part of their memory"):
        sp.load(url, into={"a": base, "b": base.T})
    assert not base.any()


def test_many_column_views_of_one_weight_load(tmp_path: Path) -> None:
    """Thousands of interleaving column views of one matrix load, each its own values (they
    were compared pair by pair: 1,000 columns took 13 s, 5,000 would have taken minutes;
    now 0.09 s and 0.22 s)."""
    url = str(tmp_path / "ckpt")
    columns = 3000
    sp.save(url, {f"c{i}": torch.full((8,), float(i)) for i in range(columns)})
    weight = torch.zeros(8, columns)
    sp.load(url, into={f"c{i}": weight[:, i] for i in range(columns)})
    assert torch.equal(weight, torch.arange(float(columns)).expand(8, columns))


def test_a_tensor_and_its_numpy_view_are_one_target(tmp_path: Path) -> None:
    """A tensor and an ndarray over its memory (t.numpy()), the same bytes saved under two
    names, load as one target (they were refused as views of one tensor)."""
    url = str(tmp_path / "ckpt")
    values = np.arange(4, dtype=np.float32)
    sp.save(url, {"a": torch.from_numpy(values.copy()), "b": values.copy()})
    target = torch.zeros(4)
    sp.load(url, into={"a": target, "b": target.numpy()})
    assert torch.equal(target, torch.arange(4.0))


@pytest.mark.parametrize("library", ["torch", "numpy"])
def test_a_tie_whose_views_differ_in_a_size_one_stride_loads(
    tmp_path: Path, library: str
) -> None:
    """Two views of one (1, 3) memory that differ only in the stride of the dimension of size
    1 (a column's transpose and its reshape) are one target: the same bytes saved apart load
    (they were refused)."""
    url = str(tmp_path / "ckpt")
    if library == "torch":
        sp.save(url, {"a": torch.ones(1, 3), "b": torch.ones(1, 3)})
        column: Any = torch.zeros(3, 1)
    else:
        sp.save(url, {"a": np.ones((1, 3), np.float32), "b": np.ones((1, 3), np.float32)})
        column = np.zeros((3, 1), np.float32)
    sp.load(url, into={"a": column.T, "b": column.reshape(1, 3)})
    assert bool((column == 1).all())


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_pieces_of_different_boxes_in_one_memory_are_a_mismatch(
    tmp_path: Path, layout: str
) -> None:
    """Two sp.Shard pieces over one memory that ask for different rows of the global tensor
    cannot both be there: refused, nothing changed (one piece was taken for the other's
    twin, and the last copy won or the second was never read)."""
    url = str(tmp_path / "ckpt")
    whole = torch.arange(8.0).reshape(4, 2)
    sp.save(url, {"a": whole, "b": whole.clone()})
    memory = torch.zeros(2, 4).T[:2] if layout == "strided" else torch.zeros(4, 2)[:2]
    with pytest.raises(sp.StateMismatch):
        sp.load(url, into={"a": sp.Shard(memory, (0, 0), (4, 2)),
                           "b": sp.Shard(memory, (2, 0), (4, 2))})
    assert not memory.any()


def test_a_transposed_tie_loads_without_listing_its_elements(tmp_path: Path) -> None:
    """A tie into a transposed target has nothing to clash with: its elements are not listed
    one by one (about 16 times the tensor in NumPy memory), and it loads."""
    url = str(tmp_path / "ckpt")
    value = torch.randn(1024, 1024)
    sp.save(url, {"a": value, "b": value.clone()})
    target = torch.zeros(1024, 1024).T
    tracemalloc.start()
    try:
        sp.load(url, into={"a": target, "b": target})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(target, value)
    assert peak < value.nbytes, f"{peak >> 20} MiB of NumPy memory for a 4 MiB tie"


def test_an_array_whose_elements_share_memory_is_a_mismatch(tmp_path: Path) -> None:
    """An ndarray target with a stride of 0 (as_strided), which no copy can fill, is refused
    by its path as an expanded tensor is (it was taken for a view of another target, and the
    message named it twice)."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"a": np.arange(4.0).reshape(2, 2), "c": np.array([5.0])})
    memory = np.zeros(8)
    repeated = np.lib.stride_tricks.as_strided(memory, (2, 2), (0, 16))
    with pytest.raises(sp.StateMismatch) as caught:
        sp.load(url, into={"a": repeated, "c": memory[1:2]})
    assert caught.value.mismatched == ["a"]
    assert not memory.any()


def test_a_byte_swapped_view_of_a_target_is_another_target(tmp_path: Path) -> None:
    """An array and its big-endian view over one memory need different bytes there: refused,
    nothing changed (they were taken for one target, and the array held garbage)."""
    url = str(tmp_path / "ckpt")
    values = np.arange(4, dtype=np.float32)
    sp.save(url, {"a": values.copy(), "b": values.copy()})
    memory = np.zeros(4, np.float32)
    with pytest.raises(sp.StateMismatch):
        sp.load(url, into={"a": memory, "b": memory.view(">f4")})
    assert not memory.any()


def test_pieces_of_different_global_tensors_in_one_memory_are_a_mismatch(
    tmp_path: Path
) -> None:
    """Pieces with one box of two global tensors of other shapes, whose bytes are the same,
    need different values in their one memory: refused (they were taken for twins, and one
    got the other's rows)."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"a": torch.arange(16.0).reshape(4, 4), "b": torch.arange(16.0).reshape(2, 8)})
    memory = torch.zeros(2, 2)
    with pytest.raises(sp.StateMismatch):
        sp.load(url, into={"a": sp.Shard(memory, (0, 0), (4, 4)),
                           "b": sp.Shard(memory, (0, 0), (2, 8))})
    assert not memory.any()


def test_a_read_only_broadcast_placeholder_is_replaced(tmp_path: Path) -> None:
    """A read-only ndarray target is replaced, never filled: a broadcast placeholder (stride
    0) loads (it was refused as a target whose elements share memory)."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"a": np.arange(4.0)})
    loaded = sp.load(url, into={"a": np.broadcast_to(np.float64(0), (4,))})
    np.testing.assert_array_equal(loaded["a"], np.arange(4.0))

def test_a_corrupt_tied_tensor_is_found_through_either_name(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": Tied()})
    (data,) = (tmp_path / "ckpt" / "data").iterdir()
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    for keys in (["model/head.weight"], ["model/emb.weight"], None):
        with pytest.raises(sp.CorruptCheckpoint, match="checksum mismatch"):
            sp.load(url, keys=keys)
    with pytest.raises(sp.CorruptCheckpoint, match="checksum mismatch"):
        sp.load(url, into={"model": Tied(tie=False)})


# -- strict / lenient matching ------------------------------------------------------------------


def _saved_and_target(tmp_path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    url = str(tmp_path / "ckpt")
    saved = {"w": torch.randn(3, 4), "b": torch.randn(4), "n": 7, "sub": {"x": np.arange(3)}}
    sp.save(url, saved)
    target = {"w": torch.zeros(3, 4), "b": torch.zeros(4), "n": 0,
              "sub": {"x": np.zeros(3, dtype=np.int64)}}
    return url, saved, target


MISMATCHES = {
    "missing": (lambda t: t.__setitem__("extra", torch.zeros(2)), "extra"),
    "missing_nested": (lambda t: t["sub"].__setitem__("y", 1), "sub/y"),
    "unexpected": (lambda t: t.pop("b"), "b"),
    "dtype": (lambda t: t.__setitem__("b", torch.zeros(4, dtype=torch.float64)), "b"),
    "shape": (lambda t: t.__setitem__("b", torch.zeros(5)), "b"),
    "array_dtype": (lambda t: t["sub"].__setitem__("x", np.zeros(3, dtype=np.int32)), "sub/x"),
    "kind": (lambda t: t.__setitem__("n", torch.zeros(())), "n"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_strict_mismatch_names_the_path_and_changes_nothing(tmp_path: Path, case: str) -> None:
    url, _, target = _saved_and_target(tmp_path)
    change, path = MISMATCHES[case]
    change(target)
    before = copy.deepcopy(target)
    pointer = target["w"].data_ptr()
    with pytest.raises(sp.StateMismatch) as caught:
        sp.load(url, into=target)
    message = str(caught.value)
    assert path in message
    assert url in message
    assert "strict=False" in message  # says what to do next
    assert path in caught.value.missing + caught.value.unexpected + [
        m.split(":")[0] for m in caught.value.mismatched
    ]
    assert isinstance(caught.value, ValueError)
    assert target["w"].data_ptr() == pointer
    assert_same(target, before)  # nothing changed, not even the matching tensors


def test_a_tuple_restores_into_a_list_and_a_list_into_a_tuple(tmp_path: Path) -> None:
    """Same paths, another container: the values go into the live container, which keeps its
    type (they were left as they were, with no word, while tensors in them were filled)."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"best": (7, 0.25, torch.ones(2)), "shape": [3, 4]})
    state: dict[str, Any] = {"best": [0, 0.0, torch.zeros(2)], "shape": (0, 0)}
    sp.load(url, into=state)
    assert state["best"][:2] == [7, 0.25] and type(state["best"]) is list
    assert torch.equal(state["best"][2], torch.ones(2))
    assert state["shape"] == (3, 4)


def test_optimizer_state_of_a_resized_parameter_is_a_mismatch(tmp_path: Path) -> None:
    """A fine-tune with a new head: the head's Adam state was saved for the old shape.
    Leniently it is skipped with the head (it was loaded, and the first step failed on the
    shapes); strictly it is refused by path, also when only the optimizer is selected."""
    def make(classes: int) -> torch.nn.ModuleDict:
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"body": torch.nn.Linear(4, 4),
                                    "head": torch.nn.Linear(4, classes)})

    old = make(2)
    adam = torch.optim.Adam(old.parameters())
    old["head"](old["body"](torch.randn(1, 4))).sum().backward()
    adam.step()
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": old, "optim": adam})

    new = make(3)
    fresh = torch.optim.Adam(new.parameters())
    with pytest.raises(sp.StateMismatch, match=r"optim/state/2/exp_avg: optimizer state of "
                       r"model/head.weight, saved as F32\[2, 4\], which is F32\[3, 4\] now"):
        sp.load(url, into={"model": new, "optim": fresh}, keys=["optim/"])
    assert not fresh.state
    sp.load(url, into={"model": new, "optim": fresh}, strict=False)
    assert sorted(fresh.state_dict()["state"]) == [0, 1]  # the body's weight and bias
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"],
                       adam.state_dict()["state"][0]["exp_avg"])
    new["head"](new["body"](torch.randn(1, 4))).sum().backward()
    fresh.step()


def test_optimizer_state_of_a_parameter_of_another_dtype_is_skipped_with_it(
    tmp_path: Path,
) -> None:
    """A model cast to bfloat16 since the save: a lenient load leaves its weight as it is,
    and the weight's Adam moments, which were the saved float32 weight's, went with it (they
    were loaded onto the parameter they no longer describe)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model, "optim": adam})

    cast = torch.nn.Linear(4, 3)
    cast.weight.data = cast.weight.data.to(torch.bfloat16)
    fresh = torch.optim.Adam(cast.parameters())
    weight = cast.weight.detach().clone()
    sp.load(url, into={"model": cast, "optim": fresh}, strict=False)
    assert torch.equal(cast.weight, weight) and torch.equal(cast.bias, model.bias)
    assert sorted(fresh.state_dict()["state"]) == [1]  # the bias's, loaded with it
    with pytest.raises(sp.StateMismatch, match=r"optim/state/0/exp_avg: optimizer state of "
                       r"model/weight, saved as F32\[3, 4\], which is BF16\[3, 4\] now"):
        sp.load(url, into={"model": cast, "optim": torch.optim.Adam(cast.parameters())},
                keys=["optim/"])


def test_strict_mismatch_inside_a_module_changes_nothing(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": torch.nn.Linear(4, 3), "step": 5})
    model = torch.nn.Linear(4, 2)  # weight and bias shapes differ
    before = copy.deepcopy(model.state_dict())
    target = {"model": model, "step": 0}
    with pytest.raises(sp.StateMismatch, match=r"model/weight"):
        sp.load(url, into=target)
    assert_same(model.state_dict(), before)
    assert target["step"] == 0


def test_lenient_loads_what_matches_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, saved, target = _saved_and_target(tmp_path)
    target["b"] = torch.zeros(5)  # shape mismatch
    target["extra"] = "kept"  # missing from the checkpoint
    del target["sub"]  # unexpected in the checkpoint
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        result = sp.load(url, into=target, strict=False)
    assert result is target
    assert_same_tensor(target["w"], saved["w"])
    assert target["n"] == 7
    assert torch.equal(target["b"], torch.zeros(5))
    assert target["extra"] == "kept"
    assert "sub" not in target
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "strict=False must report what it skipped"
    text = " ".join(r.getMessage() for r in warnings)
    assert "b" in text and "extra" in text and "sub/x" in text


class _Wrapper(torch.nn.Module):
    """Stands in for torch.compile's OptimizedModule and (Distributed)DataParallel, which
    prefix their module's state_dict keys with `attribute.`."""

    def __init__(self, inner: torch.nn.Module, attribute: str) -> None:
        super().__init__()
        self.add_module(attribute, inner)


@pytest.mark.parametrize(("saved", "restored"), [
    ("_orig_mod", None), (None, "module"), ("_orig_mod", "module")])
def test_a_mismatch_from_wrapped_modules_says_so(
    tmp_path: Path, saved: str | None, restored: str | None
) -> None:
    """A module saved from torch.compile or DDP and restored into a plain one (or the other
    way round) misses every key by a prefix: the error says why and what to do."""
    def wrapped(module: torch.nn.Module, attribute: str | None) -> torch.nn.Module:
        return module if attribute is None else _Wrapper(module, attribute)

    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": wrapped(torch.nn.Linear(3, 2), saved)})
    target = torch.nn.Linear(3, 2)
    before = target.weight.detach().clone()
    with pytest.raises(sp.StateMismatch) as caught:
        sp.load(url, into={"model": wrapped(target, restored)})
    key = "weight" if restored is None else f"{restored}.weight"
    other = "weight" if saved is None else f"{saved}.weight"
    message = str(caught.value)
    assert f"The checkpoint has 'model/{other}' for 'model/{key}'" in message
    assert "wrapped differently" in message and "model._orig_mod, model.module" in message
    assert torch.equal(target.weight, before)
    sp.load(url, into={"model": wrapped(target, saved)})  # wrapped as saved: loads
    assert not torch.equal(target.weight, before)


def test_a_target_on_the_meta_device_is_refused_not_skipped(tmp_path: Path) -> None:
    """Meta tensors have no memory: copying into them does nothing, so a restore into them
    would silently leave the model empty."""
    url = str(tmp_path / "ckpt")
    source = torch.nn.Linear(4, 3)
    sp.save(url, {"model": source, "step": 5})
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    state = {"model": model, "step": 0}
    with pytest.raises(sp.StateMismatch, match="meta device") as caught:
        sp.load(url, into=state)
    assert caught.value.mismatched == ["model/weight", "model/bias"]
    assert "assign=True" in str(caught.value) and state["step"] == 0
    model.load_state_dict(sp.load(url)["model"], assign=True)  # the way the message gives
    assert torch.equal(model.weight, source.weight)


def test_an_unrelated_mismatch_gives_no_wrapper_hint(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": torch.nn.Linear(3, 2)})
    with pytest.raises(sp.StateMismatch) as caught:
        sp.load(url, into={"model": torch.nn.Linear(3, 2, bias=False), "extra": torch.ones(1)})
    assert "wrapped" not in str(caught.value) and "missing from the checkpoint: extra" in str(
        caught.value)


# -- keys= ---------------------------------------------------------------------------------------


def _keyed_state() -> dict[str, Any]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    return {"model": model, "head": {"weight": torch.randn(2)}, "step": 11, "tag": "run"}


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (["model/"], {"model": ["0.weight", "0.bias", "2.weight", "2.bias"]}),
        (["model"], {"model": ["0.weight", "0.bias", "2.weight", "2.bias"]}),
        (["model/*weight"], {"model": ["0.weight", "2.weight"]}),
        (["*weight"], {"model": ["0.weight", "2.weight"], "head": ["weight"]}),
        (["model/2.*", "step"], {"model": ["2.weight", "2.bias"], "step": None}),
        (["model/0.bias", "tag"], {"model": ["0.bias"], "tag": None}),
    ],
)
def test_keys_select_a_subset_without_target(
    tmp_path: Path, keys: list[str], expected: dict[str, Any]
) -> None:
    url = str(tmp_path / "ckpt")
    state = _keyed_state()
    sp.save(url, state)
    loaded = sp.load(url, keys=keys)
    assert list(loaded) == list(expected)
    full = state["model"].state_dict()
    for top, names in expected.items():
        if names is None:
            assert loaded[top] == state[top]
            continue
        assert list(loaded[top]) == names
        for name in names:
            source = full[name] if top == "model" else state[top][name]
            assert_same_tensor(loaded[top][name], source)


def test_keys_that_leave_out_list_items_before_others_are_refused(tmp_path: Path) -> None:
    """Without a target, a list rebuilt from items 0 and 2 would hold item 2 at index 1
    (optimizer param group 1 loaded alone would come back as group 0): refused before any
    read, naming the item. Leading items, every item, or a target keep each in its place
    (found by a review)."""
    url = str(tmp_path / "ckpt")
    items = [torch.full((1,), float(i)) for i in range(3)]
    sp.save(url, {"l": items, "t": (1, [], 3), "n": 5})
    for keys in (["l/2"], ["l/0", "l/2"], ["t/2"]):
        with pytest.raises(sp.StateMismatch, match=r"before '[lt]/2'.*renumbered") as raised:
            sp.load(url, keys=keys)
        assert raised.value.url == url
    assert [float(t) for t in sp.load(url, keys=["l/0", "l/1"])["l"]] == [0.0, 1.0]
    assert sp.load(url, keys=["t/"])["t"] == (1, [], 3)
    assert sp.load(url, keys=["n"]) == {"n": 5}
    target = {"l": [torch.zeros(1) for _ in range(3)], "t": (0, [], 0), "n": 0}
    sp.load(url, into=target, keys=["l/2"])
    assert [float(t) for t in target["l"]] == [0.0, 0.0, 2.0]
    # an item holding only empty containers has no leaves to select, and keeps its place
    nested = {"hist": [{"buf": {}}, {"buf": {"a": 1}}], "deep": [[[]], [5]], "other": 2}
    sp.save(url, nested, overwrite=True)
    for key in ("hist", "deep"):
        assert sp.load(url, keys=[key]) == {key: nested[key]}


def test_keys_selecting_a_subtree_bring_back_its_empty_containers(tmp_path: Path) -> None:
    """A prefix or glob selects a whole subtree; without into= it came back without the
    empty containers inside it (a fresh optimizer's `state: {}`), so that
    sp.load(url, keys=['optim/'])['optim'] differed from sp.load(url)['optim'] and torch's
    load_state_dict raised KeyError 'state'. Those outside the selection are left out."""
    url = str(tmp_path / "ck")
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.Adam(model.parameters())
    sp.save(url, {"model": model, "optim": optim, "a": {"x": 1, "e": {}, "l": []}})
    full = sp.load(url)
    for keys in (["optim/"], ["optim"], ["opt*"]):
        assert sp.load(url, keys=keys) == {"optim": full["optim"]}
    assert full["optim"]["state"] == {}
    torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).load_state_dict(
        sp.load(url, keys=["optim/"])["optim"])
    assert sp.load(url, keys=["a"]) == {"a": {"x": 1, "e": {}, "l": []}}
    assert sp.load(url, keys=["a/*"]) == {"a": {"x": 1, "e": {}, "l": []}}
    assert sp.load(url, keys=["a/x"]) == {"a": {"x": 1}}
    assert sp.load(url, keys=["model/"]).keys() == {"model"}


def test_keys_restore_only_the_selection_in_place(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    saved = _keyed_state()
    sp.save(url, saved)
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    untouched = copy.deepcopy(model.state_dict())
    target = {"model": model, "head": {"weight": torch.zeros(2)}, "step": 0, "tag": ""}
    sp.load(url, into=target, keys=["model/*weight", "step"])
    now, want = model.state_dict(), saved["model"].state_dict()
    assert_same_tensor(now["0.weight"], want["0.weight"])
    assert_same_tensor(now["2.weight"], want["2.weight"])
    assert_same_tensor(now["0.bias"], untouched["0.bias"])
    assert_same_tensor(now["2.bias"], untouched["2.bias"])
    assert torch.equal(target["head"]["weight"], torch.zeros(2))
    assert target["step"] == 11 and target["tag"] == ""


@pytest.mark.parametrize("keys", [["nothing"], ["mod"], ["model/9*"], ["step/"]])
def test_keys_matching_nothing_raise(tmp_path: Path, keys: list[str]) -> None:
    url = str(tmp_path / "ckpt")
    state = _keyed_state()
    state["step"] = torch.zeros(1)  # `step/` would select below a leaf: nothing
    sp.save(url, {"model": state["model"], "tag": "x"})
    with pytest.raises(sp.StateMismatch) as caught:
        sp.load(url, keys=keys)
    assert repr(keys[0]) in str(caught.value) or keys[0] in str(caught.value)
    target = {"model": torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                                           torch.nn.Linear(3, 2)), "tag": ""}
    with pytest.raises(sp.StateMismatch):
        sp.load(url, into=target, keys=keys)
    assert target["tag"] == ""


# -- overwrite ------------------------------------------------------------------------------------


def test_save_over_a_commit_needs_overwrite(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = {"w": torch.randn(100), "v": 1}
    sp.save(str(ckpt), first)
    files_before = data_files(ckpt)
    with pytest.raises(sp.CheckpointExists) as caught:
        sp.save(str(ckpt), {"w": torch.randn(100), "v": 2})
    assert isinstance(caught.value, sp.SafepointError)
    assert isinstance(caught.value, FileExistsError)
    assert str(ckpt) in str(caught.value) and "overwrite=True" in str(caught.value)
    assert data_files(ckpt) == files_before  # the refused save wrote nothing
    assert_same(sp.load(str(ckpt)), first)


def test_overwrite_replaces_and_leaves_no_unreferenced_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), {"w": torch.randn(1000), "v": 1})
    old = data_files(ckpt)
    second = {"w": torch.randn(10), "x": np.arange(4), "v": 2}
    sp.save(str(ckpt), second, overwrite=True)
    assert_same(sp.load(str(ckpt)), second)
    assert sp.verify(str(ckpt)).ok
    wait_for_removals()  # the replaced data goes in a background thread
    assert data_files(ckpt) == manifest_files(ckpt)
    assert not old & data_files(ckpt)
    assert sorted(os.listdir(ckpt)) == ["data", "manifest.json"]


def test_overwrite_with_a_state_of_plain_values_removes_all_data_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), {"w": torch.randn(1000)})
    sp.save(str(ckpt), {"v": 1}, overwrite=True)
    assert sp.load(str(ckpt)) == {"v": 1}
    assert data_files(ckpt) == set() == manifest_files(ckpt)


def test_save_encodes_and_describes_its_manifest_while_the_data_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making the manifest of 20,000 entries costs tens of milliseconds: a save does it while
    its data file is still being written and fsynced, and publishes only after that."""
    described = threading.Event()
    real_info_of = _api.info_of

    def info_of(url: str, manifest: Any) -> sp.CheckpointInfo:
        info = real_info_of(url, manifest)
        described.set()
        return info

    data_written: list[bool] = []
    real_write = LocalStorage.write

    def write(self: LocalStorage, path: str, chunks: Any) -> int:
        size = real_write(self, path, chunks)
        if path.startswith("data/"):
            data_written.append(described.wait(10))
            assert not (Path(self.root) / "manifest.json").exists()
        return size

    monkeypatch.setattr(_api, "info_of", info_of)
    monkeypatch.setattr(LocalStorage, "write", write)
    state = {"w": torch.randn(1000), "v": 1}
    saved = sp.save(str(tmp_path / "ckpt"), state, metadata={"step": 3})
    assert data_written == [True]
    assert saved == sp.info(str(tmp_path / "ckpt"))
    assert_same(sp.load(str(tmp_path / "ckpt")), state)


def test_save_over_uncommitted_leftovers_is_allowed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), {"w": torch.randn(10)})
    (ckpt / "manifest.json").unlink()
    state = {"w": torch.randn(10)}
    sp.save(str(ckpt), state)  # overwrite=False: nothing was committed there
    assert_same(sp.load(str(ckpt)), state)


# -- info and metadata ----------------------------------------------------------------------------


def test_info_describes_the_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    state = {"t": torch.zeros(2, 3, dtype=torch.bfloat16), "a": np.ones(4, dtype=np.int16),
             "b": b"xyz", "p": sp.Pickled({1, 2}), "n": 5, "s": "str", "f": -0.0}
    saved = sp.save(str(ckpt), state, metadata={"epoch": 3})
    info = sp.info(str(ckpt))
    assert isinstance(info, sp.CheckpointInfo)
    assert saved == info
    assert info.url == str(ckpt)
    assert len(info.save_id) == 32 and int(info.save_id, 16) >= 0
    created = datetime.datetime.fromisoformat(info.created.replace("Z", "+00:00"))
    now = datetime.datetime.now(datetime.timezone.utc)
    assert abs((now - created).total_seconds()) < 60
    assert info.format_version == 1
    assert info.library_version == sp.__version__
    assert info.torch_version == torch.__version__
    assert info.world_size == 1
    assert info.metadata == {"epoch": 3}
    assert info.files == 1
    assert info.nbytes == sum((ckpt / name).stat().st_size for name in data_files(ckpt))
    by_path = {e.path: e for e in info.entries}
    assert [e.path for e in info.entries] == list(state)
    assert (by_path["t"].kind, by_path["t"].dtype, by_path["t"].shape, by_path["t"].nbytes) == (
        "tensor", "BF16", (2, 3), 12)
    assert (by_path["a"].kind, by_path["a"].dtype, by_path["a"].shape, by_path["a"].nbytes) == (
        "ndarray", "I16", (4,), 8)
    assert (by_path["b"].kind, by_path["b"].nbytes) == ("bytes", 3)
    assert by_path["p"].kind == "pickle" and by_path["p"].nbytes > 0
    assert (by_path["n"].kind, by_path["n"].value, by_path["n"].nbytes) == ("value", 5, 0)
    assert by_path["s"].value == "str"
    assert math.copysign(1, by_path["f"].value) == -1


def test_metadata_roundtrips(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    metadata = {"epoch": 3, "loss": 0.25, "big": 2**70, "name": "rün ✓", "ok": True,
                "none": None, "nested": {"lr": [1e-3, 5e-4], "tags": ["a", "b"]}}
    sp.save(url, {"x": 1}, metadata=metadata)
    assert sp.info(url).metadata == metadata
    assert sp.load(url) == {"x": 1}


def _nested(depth: int, make: Callable[[Any], Any]) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = make(value)
    return value


@pytest.mark.parametrize(
    "metadata",
    [{"s": {1, 2}}, {"t": torch.zeros(1)}, {"nan": float("nan")}, {"o": object()},
     {"b": b"bytes"}, ["not", "a", "dict"], _nested(700, lambda v: {"a": v})],
    ids=["set", "tensor", "nan", "object", "bytes", "list", "700-deep"],
)
def test_non_json_metadata_fails_before_writing(tmp_path: Path, metadata: Any) -> None:
    ckpt = tmp_path / "ckpt"
    with pytest.raises(sp.UnsupportedLeaf) as caught:
        sp.save(str(ckpt), {"w": torch.zeros(3)}, metadata=metadata)
    assert "metadata" in str(caught.value)
    assert not ckpt.exists()


def test_a_state_nested_beyond_the_recursion_limit_is_refused_by_name(tmp_path: Path) -> None:
    """A list 3000 deep: an UnsupportedLeaf saying what to do, not a raw RecursionError
    (found by a review)."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(sp.UnsupportedLeaf, match="nests dicts, lists or tuples deeper"):
        sp.save(str(ckpt), {"x": _nested(3000, lambda v: [v])})
    assert not ckpt.exists()


@pytest.mark.parametrize("metadata", [{1: "x"}, {"a": [{"b": {2.5: 1}}]}], ids=["int", "nested"])
def test_metadata_with_non_str_keys_is_refused(tmp_path: Path, metadata: dict[Any, Any]) -> None:
    """JSON would turn the key into a str, so the metadata would not come back as saved."""
    url = str(tmp_path / "ckpt")
    with pytest.raises(sp.UnsupportedLeaf, match="metadata has a dict key"):
        sp.save(url, {"x": 1}, metadata=metadata)
    assert not (tmp_path / "ckpt").exists()


def _progress_is_sound(calls: list[tuple[int, int]], total: int) -> None:
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert {whole for _, whole in calls} == {total}


def test_a_load_reports_its_progress(tmp_path: Path) -> None:
    """Bytes read and checked, of the bytes this load reads: whole entries, a tied tensor read
    again into an untied target, and pieces of a resharded entry."""
    url = str(tmp_path / "ckpt")
    big = torch.randn(5 << 20)
    state = {"big": big, "tied": big, "small": [torch.randn(100) for _ in range(50)],
             "arr": np.arange(1000)}
    sp.save(url, state)
    data = sum(e.nbytes for e in sp.info(url).entries)
    calls: list[tuple[int, int]] = []
    sp.load(url, progress=lambda done, whole: calls.append((done, whole)))
    _progress_is_sound(calls, data)  # "tied" is the same tensor: read once
    calls.clear()
    target = {"big": torch.zeros(5 << 20), "tied": torch.zeros(5 << 20),
              "small": [torch.zeros(100) for _ in range(50)], "arr": np.zeros(1000, np.int64)}
    sp.load(url, into=target, progress=lambda done, whole: calls.append((done, whole)))
    _progress_is_sound(calls, data + big.nbytes)  # untied: read into both
    calls.clear()
    piece = {"big": sp.Shard(torch.zeros(1 << 20), (1 << 20,), (5 << 20,))}
    sp.load(url, into=piece, keys=["big"],
            progress=lambda done, whole: calls.append((done, whole)))
    _progress_is_sound(calls, 4 << 20)
    assert torch.equal(piece["big"].tensor, big[1 << 20 : 2 << 20])


def test_verify_reports_its_progress(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    state = {"big": torch.randn(5 << 20), "small": [torch.randn(100) for _ in range(50)],
             "arr": np.arange(1000)}  # 20 MiB and more: several reads, on several threads
    total = sum(entry.nbytes for entry in sp.save(url, state).entries)
    calls: list[tuple[int, int]] = []
    assert sp.verify(url, progress=lambda done, whole: calls.append((done, whole))).ok
    _progress_is_sound(calls, total)
    assert len(calls) > 3


# -- what cannot be stored -------------------------------------------------------------------


UNSUPPORTED = {
    "object": ({"a": {"b": object()}}, "a/b"),
    "set": ({"opt": [1, {2, 3}]}, "opt/1"),
    "complex": ({"c": 1 + 2j}, "c"),
    "sparse": ({"s": {"m": torch.eye(3).to_sparse()}}, "s/m"),
    "meta": ({"m": torch.empty(2, device="meta")}, "m"),
    "float_key": ({"d": {1.5: 1}}, "d"),
    "tuple_key": ({"d": {(1, 2): 1}}, "d"),
    "object_array": ({"arr": np.array([object()])}, "arr"),
    "string_array": ({"arr": np.array(["a", "b"])}, "arr"),
    "cycle": (None, "loop/0"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_leaf_names_its_path_and_writes_nothing(tmp_path: Path, case: str) -> None:
    state, path = UNSUPPORTED[case]
    if state is None:
        loop: list[Any] = []
        loop.append(loop)
        state = {"loop": loop}
    state = {"first": torch.randn(1000), **state}
    ckpt = tmp_path / "ckpt"
    with pytest.raises(sp.UnsupportedLeaf) as caught:
        sp.save(str(ckpt), state)
    assert caught.value.path == path
    assert repr(path) in str(caught.value)
    assert isinstance(caught.value, TypeError)
    assert not (ckpt / "manifest.json").exists()
    assert data_files(ckpt) == set()


def _quantized(dtype: torch.dtype) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, dtype)


REFUSED_DTYPES: dict[str, tuple[Any, str]] = {  # how to make one, what the refusal advises
    "qint8": (lambda: _quantized(torch.qint8), "sp.Pickled"),
    "quint8": (lambda: _quantized(torch.quint8), "dequantize()"),
    "qint32": (lambda: _quantized(torch.qint32), "int_repr()"),
    "quint4x2": (lambda: _quantized(torch.quint4x2), "sp.Pickled"),
    "quint2x4": (lambda: _quantized(torch.quint2x4), "sp.Pickled"),
    "per_channel": (lambda: torch.quantize_per_channel(
        torch.randn(2, 4), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0, torch.quint8,
    ), "sp.Pickled"),
    "uint4": (lambda: torch.zeros(8, dtype=torch.uint4), "view(torch.uint8)"),
    "int3": (lambda: torch.zeros(8, dtype=torch.int3), "view(torch.uint8)"),
    "bit": (lambda: torch.zeros(8, dtype=torch.bit), "view(torch.uint8)"),
}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")  # pickling one
@pytest.mark.parametrize("case", list(REFUSED_DTYPES))
def test_quantized_and_sub_byte_tensors_are_refused_before_writing(
    tmp_path: Path, case: str
) -> None:
    """The refusal names the path and says what to store instead, and that advice works."""
    make, advice = REFUSED_DTYPES[case]
    tensor = make()
    ckpt = tmp_path / "ckpt"
    with pytest.raises(sp.UnsupportedLeaf) as caught:
        sp.save(str(ckpt), {"first": torch.randn(1000), "model": {"w": tensor}})
    assert caught.value.path == "model/w"
    assert repr("model/w") in str(caught.value)
    assert str(tensor.dtype).removeprefix("torch.") in str(caught.value)
    assert advice in str(caught.value)
    assert not (ckpt / "manifest.json").exists()
    assert data_files(ckpt) == set()
    if tensor.is_quantized:
        loaded = roundtrip(tmp_path, {"w": sp.Pickled(tensor)}, allow_pickle=True)["w"]
        assert torch.equal(loaded.dequantize(), tensor.dequantize())
    else:
        loaded = roundtrip(tmp_path, {"w": tensor.view(torch.uint8)})["w"].view(tensor.dtype)
        assert_same_tensor(loaded, tensor)


def test_a_nested_tensor_is_refused_by_path(tmp_path: Path) -> None:
    """Nested tensors have a strided layout, so only `is_nested` tells them (torch's own
    error came from deep inside, naming nothing)."""
    with pytest.warns(UserWarning, match="nested"):  # torch: nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(sp.UnsupportedLeaf, match=r"'batch/nt' is nested.*to_padded_tensor"):
        sp.save(str(tmp_path / "ckpt"), {"w": torch.ones(2), "batch": {"nt": nested}})
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


def test_unsupported_leaf_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    state = {"w": torch.randn(10)}
    sp.save(str(ckpt), state)
    manifest = (ckpt / "manifest.json").read_bytes()
    with pytest.raises(sp.UnsupportedLeaf):
        sp.save(str(ckpt), {"w": torch.randn(10), "bad": object()}, overwrite=True)
    assert (ckpt / "manifest.json").read_bytes() == manifest
    assert_same(sp.load(str(ckpt)), state)
    assert data_files(ckpt) == manifest_files(ckpt)


# -- sp.Pickled ----------------------------------------------------------------------------------


def test_pickled_objects_roundtrip_with_allow_pickle(tmp_path: Path) -> None:
    import fractions

    obj = {"set": {1, 2, 3}, "frac": fractions.Fraction(1, 3), "cx": 1 + 2j}
    state = {"p": sp.Pickled(obj), "w": torch.arange(3), "lst": [sp.Pickled(None)]}
    loaded = roundtrip(tmp_path, state, allow_pickle=True)
    assert loaded["p"] == obj
    assert loaded["lst"] == [None]
    assert_same_tensor(loaded["w"], state["w"])


class _Unpickled:
    """Records that it was unpickled (which runs code from the file)."""

    loads = 0

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_Unpickled._made, ())

    @staticmethod
    def _made() -> _Unpickled:
        _Unpickled.loads += 1
        return _Unpickled()


@pytest.mark.parametrize("value", ["False", "no", 0, None], ids=str)
def test_a_flag_that_is_not_a_bool_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any,
) -> None:
    """The str "False" read from a config or an environment variable is true: passed as
    allow_pickle it unpickled (ran code from the file), as overwrite it replaced a committed
    checkpoint. Flags take True or False; anything else is refused, naming the checkpoint,
    before anything is read or written."""
    monkeypatch.setattr(_Unpickled, "loads", 0)
    url = str(tmp_path / "ckpt")
    sp.save(url, {"p": sp.Pickled(_Unpickled()), "step": 1})
    for flags in ({"allow_pickle": value}, {"strict": value}):
        name = next(iter(flags))
        with pytest.raises(sp.SafepointError, match=rf"{name}=.* for {url}: pass True or"):
            sp.load(url, **flags)
    assert _Unpickled.loads == 0
    with pytest.raises(sp.SafepointError, match=rf"overwrite=.* for {url}: pass True or"):
        sp.save(url, {"step": 2}, overwrite=value)
    assert sp.load(url, allow_pickle=True)["step"] == 1 and _Unpickled.loads == 1
    sp.save(url, {"step": 3}, overwrite=np.bool_(True))
    assert sp.load(url)["step"] == 3


@pytest.mark.parametrize("obj", [threading.Lock(), lambda x: x], ids=["lock", "lambda"])
def test_a_pickled_object_that_cannot_be_pickled_is_refused_by_path(tmp_path: Path,
                                                                    obj: Any) -> None:
    """Pickling raises what it likes (TypeError, PicklingError, AttributeError): the save
    refuses it as an UnsupportedLeaf naming the path, and nothing is written."""
    url = tmp_path / "ckpt"
    with pytest.raises(sp.UnsupportedLeaf, match=r"'a/p' cannot be pickled") as raised:
        sp.save(str(url), {"w": torch.ones(2), "a": {"p": sp.Pickled(obj)}})
    assert raised.value.path == "a/p" and not url.exists()


# -- devices --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_save_and_restore_in_place(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    source = {"w": torch.randn(1000, 33, device="cuda").t(), "b": torch.randn(5, device="cuda",
                                                                             dtype=torch.bfloat16)}
    sp.save(url, source)
    loaded = sp.load(url)
    assert loaded["w"].device.type == "cpu"
    assert_same(loaded, {k: v.cpu() for k, v in source.items()})
    target = {"w": torch.zeros(33, 1000, device="cuda"), "b": torch.zeros(5, device="cuda",
                                                                         dtype=torch.bfloat16)}
    pointer = target["w"].data_ptr()
    sp.load(url, into=target)
    assert target["w"].device.type == "cuda" and target["w"].data_ptr() == pointer
    assert_same({k: v.cpu() for k, v in target.items()}, {k: v.cpu() for k, v in source.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tied_cuda_weights_save_once_and_restore_tied(tmp_path: Path) -> None:
    source = Tied().cuda()
    url = str(tmp_path / "ckpt")
    info = sp.save(url, {"model": source})
    assert _kinds(info)["model/head.weight"] == ("alias", "model/emb.weight")
    for tie in (True, False):
        target = Tied(tie=tie).cuda()
        sp.load(url, into={"model": target})
        assert (target.head.weight is target.emb.weight) == tie
        for weight in (target.emb.weight, target.head.weight):
            assert torch.equal(weight, source.emb.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_checkpoint_loads_partly_into_cuda_tensors(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    source = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64).to(torch.float16)},
              "optim": {"m": torch.randn(4096)}}
    sp.save(url, source)
    model = {"w": torch.zeros(64, 64, device="cuda").t(),  # a non-contiguous CUDA view
             "b": torch.zeros(64, device="cuda", dtype=torch.float16)}
    target = {"model": model, "optim": {"m": torch.zeros(4096, device="cuda")}}
    sp.load(url, into=target, keys=["model/*"])
    assert torch.equal(model["w"].cpu(), source["model"]["w"])
    assert torch.equal(model["b"].cpu(), source["model"]["b"])
    assert not target["optim"]["m"].any()  # outside `keys`: untouched
    wrong = {"model": {"w": torch.zeros(64, 65, device="cuda"), "b": model["b"]}}
    with pytest.raises(sp.StateMismatch, match="model/w"):
        sp.load(url, into=wrong, keys=["model/*"])
    assert not wrong["model"]["w"].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_load_into_cuda_tensors_holds_two_batches_of_host_memory(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    state = {f"t{i}": torch.randn(16 << 20, device="cuda") for i in range(12)}  # 768 MiB
    state["small"] = [torch.randn(100, device="cuda") for _ in range(50)]
    sp.save(url, state)
    expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    for i in range(12):
        state[f"t{i}"].zero_()
    growth = growth_during(lambda: sp.load(url, into=state))
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    assert growth <= 2 * DEVICE_BATCH_BYTES + (64 << 20)


# -- restoring into a target that differs inside its stateful objects -----------------------------


def _with_head(tmp_path: Path) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": saved, "step": 5})
    return url, saved


def test_a_saved_module_key_the_target_module_lacks_is_unexpected(tmp_path: Path) -> None:
    """A module's state_dict lists every key it loads: a saved key it lacks (a head the
    target has not) is a StateMismatch naming it, with nothing changed; leniently it is
    skipped and the rest loads (a backbone out of a checkpoint with a head)."""
    url, saved = _with_head(tmp_path)
    backbone = torch.nn.Sequential(torch.nn.Linear(3, 3))
    before = backbone[0].weight.detach().clone()
    with pytest.raises(sp.StateMismatch, match=r"not in the target: model/1\.weight"):
        sp.load(url, into={"model": backbone, "step": 0})
    assert torch.equal(backbone[0].weight, before)
    target = {"model": backbone, "step": 0}
    sp.load(url, into=target, strict=False)
    assert torch.equal(backbone[0].weight, saved[0].weight) and target["step"] == 5


def test_an_optimizer_with_other_param_groups_is_a_mismatch(tmp_path: Path) -> None:
    """A fresh optimizer takes the saved per-parameter state it has not made yet, but not a
    param group it does not have: that is a mismatch found before anything is changed."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    two = torch.optim.AdamW([{"params": model[0].parameters()},
                             {"params": model[1].parameters(), "lr": 0.1}])
    model(torch.randn(2, 3)).sum().backward()
    two.step()
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model, "optim": two})
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    before = fresh[0].weight.detach().clone()
    one = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(sp.StateMismatch, match=r"optim/param_groups/1"):
        sp.load(url, into={"model": fresh, "optim": one})
    assert torch.equal(fresh[0].weight, before) and not one.state
    again = torch.optim.AdamW([{"params": fresh[0].parameters()},
                               {"params": fresh[1].parameters(), "lr": 0.5}])
    sp.load(url, into={"model": fresh, "optim": again})
    assert again.param_groups[1]["lr"] == 0.1 and len(again.state) == 4


class Vocabulary:
    """A user's stateful object that declares which keys its load_state_dict takes beyond
    what its state_dict() lists now (`words`, `extra`), and which it can do without
    (`cache`)."""

    safepoint_open_keys = ("words", "extra")
    safepoint_optional_keys = ("cache",)

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.extra: dict[str, Any] = {}
        self.cache: dict[str, int] = {"hits": 0}

    def state_dict(self) -> dict[str, Any]:
        return {"words": list(self.words), "extra": dict(self.extra), "cache": dict(self.cache)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.words = list(state["words"])
        self.extra = dict(state["extra"])
        self.cache = dict(state.get("cache", {"hits": 0}))


def test_a_stateful_object_declares_its_open_and_optional_keys(tmp_path: Path) -> None:
    """`safepoint_open_keys` and `safepoint_optional_keys` say what a user's class accepts:
    saved keys under `words` and `extra` load into it though its state_dict() lacks them, a
    saved key elsewhere is unexpected (nothing changed), and a checkpoint without `cache` loads
    strictly."""
    saved = Vocabulary(["a", "b"])
    saved.extra = {"lang": "en"}
    url = str(tmp_path / "ckpt")
    sp.save(url, {"vocab": saved, "w": torch.ones(2)})
    target = {"vocab": Vocabulary([]), "w": torch.zeros(2)}
    sp.load(url, into=target)
    assert target["vocab"].extra == {"lang": "en"} and target["vocab"].words == ["a", "b"]

    older = str(tmp_path / "older")
    sp.save(older, {"vocab": {"words": ["x"], "extra": {}, "cache": {}, "stray": 1},
                    "w": torch.ones(2)})
    fresh = {"vocab": Vocabulary([]), "w": torch.zeros(2)}
    with pytest.raises(sp.StateMismatch, match=r"not in the target: vocab/stray"):
        sp.load(older, into=fresh)
    assert fresh["vocab"].words == [] and torch.equal(fresh["w"], torch.zeros(2))

    class Plain(Vocabulary):
        safepoint_open_keys = ()  # type: ignore[assignment]

    plain = Plain(["", ""])
    with pytest.raises(sp.StateMismatch, match=r"not in the target: vocab/extra/lang"):
        sp.load(url, into={"vocab": plain, "w": torch.zeros(2)})
    assert plain.words == ["", ""] and not plain.extra

    without_cache = str(tmp_path / "without-cache")
    sp.save(without_cache, {"vocab": {"words": ["c"], "extra": {}}, "w": torch.ones(2)})
    again = {"vocab": Vocabulary([]), "w": torch.zeros(2)}
    sp.load(without_cache, into=again)
    assert again["vocab"].words == ["c"] and again["vocab"].cache == {"hits": 0}


def _unfreezing() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[bool], float]]:
    """A model and its Adam optimizer, and a training step on all of it or, as in gradual
    unfreezing, on its second layer only (the first then has no gradient, and no state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(everything: bool) -> float:
        adam.zero_grad()
        batch = torch.randn(5, 4) if everything else torch.randn(5, 8)
        loss = (model(batch) if everything else model[1](batch)).pow(2).sum()
        loss.backward()
        adam.step()
        return loss.item()

    return model, adam, step


@pytest.mark.parametrize("strict", [True, False])
def test_rolling_back_an_optimizer_replaces_its_state(tmp_path: Path, strict: bool) -> None:
    """Restoring an earlier step into the same optimizer (after a loss spike) gives it the
    saved state, as load_state_dict does: its state for parameters that had none when it was
    saved is gone (it was "missing from the checkpoint", and leniently kept, mixing two
    steps), and the run continues as after torch.save/torch.load."""
    model, adam, step = _unfreezing()
    step(False)
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model, "optim": adam})
    reference = copy.deepcopy({"model": model.state_dict(), "optim": adam.state_dict()})
    step(True)
    step(True)

    sp.load(url, into={"model": model, "optim": adam}, strict=strict)
    assert sorted(adam.state_dict()["state"]) == sorted(reference["optim"]["state"]) == [2, 3]
    torch.manual_seed(42)
    got = [step(True) for _ in range(3)]
    model.load_state_dict(reference["model"])
    adam.load_state_dict(reference["optim"])
    torch.manual_seed(42)
    assert got == [step(True) for _ in range(3)]


def test_rolling_back_lbfgs_restores_its_history(tmp_path: Path) -> None:
    """LBFGS's history lists (old_dirs, old_stps, ro, al) grow every step: restoring an
    earlier step gives them back as saved, and the run continues as it did."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=5, max_iter=2)
    x, y = torch.randn(20, 4), torch.randn(20, 1)

    def step() -> float:
        def closure() -> torch.Tensor:
            lbfgs.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            return loss
        return float(lbfgs.step(closure).item())

    step()
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model, "optim": lbfgs})
    want = [step() for _ in range(3)]
    sp.load(url, into={"model": model, "optim": lbfgs})
    assert [step() for _ in range(3)] == want


def test_a_selection_inside_an_optimizer_state_loads_only_what_it_selects(
    tmp_path: Path
) -> None:
    """Selecting the optimizer (or its `state`) takes its state as saved; a selection inside
    the state (one parameter's) loads that into the live state, whose other parameters keep
    theirs, and a live parameter's state that the checkpoint lacks is then missing, as
    selected."""
    model, adam, step = _unfreezing()
    step(False)
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model, "optim": adam})
    saved = copy.deepcopy(adam.state_dict()["state"])
    step(True)
    live = copy.deepcopy(adam.state_dict()["state"])

    sp.load(url, into={"optim": adam}, keys=["optim/state/3/"])
    state = adam.state_dict()["state"]
    assert sorted(state) == [0, 1, 2, 3]
    assert_same(state[3], saved[3])
    assert_same(state[0], live[0])
    assert_same(state[2], live[2])
    with pytest.raises(sp.StateMismatch, match=r"missing from the checkpoint: optim/state/0/"):
        sp.load(url, into={"optim": adam}, keys=["optim/state/0/", "optim/state/2/"])
    sp.load(url, into={"optim": adam}, keys=["optim/state"])
    assert_same(adam.state_dict()["state"], saved)


class WithExtraState(torch.nn.Module):
    """A layer that keeps PyTorch's extra state (get_extra_state/set_extra_state), as fp8
    layers keep their amax history there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.history: list[float] = []
        self.amax: torch.Tensor | None = None

    def get_extra_state(self) -> Any:
        return {"history": list(self.history), "amax": self.amax}

    def set_extra_state(self, state: Any) -> None:
        self.history = list(state["history"])
        self.amax = state["amax"]


@pytest.mark.parametrize("strict", [True, False])
def test_a_module_extra_state_is_taken_as_saved(tmp_path: Path, strict: bool) -> None:
    """A module's extra state is whatever its get_extra_state returned, and load_state_dict
    hands it to set_extra_state as saved: a freshly built model (empty history, no amax)
    restores it at any depth, strictly (it was compared as a structure: "not in the target"
    and "differs") and leniently (it was dropped)."""
    def make() -> torch.nn.Module:
        return torch.nn.Sequential(WithExtraState(), torch.nn.Sequential(WithExtraState()))

    model = make()
    for n, layer in enumerate([model[0], model[1][0]]):
        layer.history, layer.amax = [0.5, 0.25 * n], torch.tensor([3.0 + n])
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model})
    fresh = make()
    sp.load(url, into={"model": fresh}, strict=strict)
    for n, layer in enumerate([fresh[0], fresh[1][0]]):
        assert layer.history == [0.5, 0.25 * n]
        assert layer.amax is not None and torch.equal(layer.amax, torch.tensor([3.0 + n]))
    assert torch.equal(fresh[1][0].lin.weight, model[1][0].lin.weight)



class OnlyExtraState(torch.nn.Module):
    """A module whose whole state dict is its extra state."""

    def __init__(self, extra: dict[str, Any]) -> None:
        super().__init__()
        self.extra = extra

    def get_extra_state(self) -> Any:
        return self.extra

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


def test_an_extra_state_saved_empty_replaces_the_live_one(tmp_path: Path) -> None:
    """Extra state saved as {} holds no value to load, yet it replaces the live one, as
    load_state_dict would (the module was passed over, and kept its stale live state)."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"m": OnlyExtraState({}), "w": torch.ones(1)})
    live = OnlyExtraState({"a": torch.ones(2)})
    sp.load(url, into={"m": live, "w": torch.zeros(1)})
    assert live.extra == {}


def test_an_optimizer_restored_alone_refuses_state_of_a_resized_parameter(
    tmp_path: Path
) -> None:
    """An optimizer restored alone (keys=["optim/"]), whose parameter was resized since the
    save, refuses the saved state of that parameter by path: its live state is replaced as
    saved, but a saved moment of another shape than its parameter's would make the next
    step fail on the shapes, naming nothing."""
    url = str(tmp_path / "ckpt")

    def trained(classes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, classes))
        adam = torch.optim.Adam(model.parameters())
        model(torch.randn(5, 3)).sum().backward()
        adam.step()
        return model, adam

    model, adam = trained(10)
    sp.save(url, {"model": model, "optim": adam})
    _, resized = trained(2)
    with pytest.raises(sp.StateMismatch, match=r"optim/state/2.*saved as \[10, 4\].*\[2, 4\]"):
        sp.load(url, into={"optim": resized}, keys=["optim/"])


def test_a_piece_of_a_global_tensor_in_optimizer_state_that_differs_is_a_mismatch(
    tmp_path: Path
) -> None:
    """A piece of a global tensor (sp.Shard, a DTensor under FSDP2) in an optimizer's state
    whose saved global shape differs is a StateMismatch naming it, not a value to replace
    (it crashed on the missing piece)."""
    url = str(tmp_path / "ckpt")
    param = torch.nn.Parameter(torch.zeros(4, 2))
    sgd = torch.optim.SGD([param], lr=0.1)
    sgd.state[param]["buf"] = sp.Shard(torch.arange(8.0).reshape(4, 2), (0, 0), (4, 2))
    sp.save(url, {"optim": sgd})
    live = torch.nn.Parameter(torch.zeros(2, 2))
    other = torch.optim.SGD([live], lr=0.1)
    other.state[live]["buf"] = sp.Shard(torch.zeros(2, 2), (2, 0), (6, 2))
    with pytest.raises(sp.StateMismatch, match="optim/state/0/buf"):
        sp.load(url, into={"optim": other})

def test_a_pickled_leaf_restored_in_place_stays_pickled(tmp_path: Path) -> None:
    """A restored state must save again as it is: an sp.Pickled leaf comes back wrapped."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"w": torch.ones(2), "obj": sp.Pickled({"vocab": ["a", "b"]})})
    state = {"w": torch.zeros(2), "obj": sp.Pickled({})}
    sp.load(url, into=state, allow_pickle=True)
    assert isinstance(state["obj"], sp.Pickled) and state["obj"].obj == {"vocab": ["a", "b"]}
    sp.save(str(tmp_path / "next"), state)


def test_an_int_too_long_for_json_is_refused_by_path(tmp_path: Path) -> None:
    """Python prints ints of at most 4300 digits (sys.set_int_max_str_digits): a longer one
    cannot go into the manifest; the save names its path and commits nothing."""
    url = str(tmp_path / "ckpt")
    with pytest.raises(sp.UnsupportedLeaf, match=r"'counter'.*sp\.Pickled"):
        sp.save(url, {"t": torch.ones(3), "counter": 10**5000})
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    assert not list((tmp_path / "ckpt").rglob("*.bin"))
    sp.save(url, {"t": torch.ones(3), "counter": 10**4000})
    assert sp.load(url)["counter"] == 10**4000


def test_verify_refuses_an_unknown_checksum_algorithm_as_newer(tmp_path: Path) -> None:
    """An algorithm this safepoint does not know is a newer writer's, as a newer format
    version is: verify raises FormatVersionError (upgrade to verify it), not a damage report."""
    ckpt = tmp_path / "ckpt"
    sp.save(ckpt, {"a": torch.ones(3)})
    edit_manifest(ckpt, lambda doc: doc["checksum"].__setitem__("algorithm", "sha9"))
    with pytest.raises(sp.FormatVersionError, match=r"'sha9'.*upgrade safepoint"):
        sp.verify(str(ckpt))


def test_keys_must_be_a_list_not_a_str(tmp_path: Path) -> None:
    """keys="ab" would select by character ("a", "b"); it is refused, saying what to pass."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"a": 1, "b": 2, "ab": 3})
    with pytest.raises(sp.SafepointError, match=r"keys=\['ab'\]"):
        sp.load(url, keys="ab")  # type: ignore[arg-type]
    assert sp.load(url, keys=["ab"]) == {"ab": 3}


def test_an_expanded_target_is_a_mismatch_before_anything_changes(tmp_path: Path) -> None:
    """An `expand`ed view shares one element's memory among many: no load can fill it. It
    is refused by path before any other tensor is written."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"a": torch.ones(4), "b": torch.arange(6.0).view(2, 3)})
    a = torch.zeros(4)
    with pytest.raises(sp.StateMismatch, match=r"share memory.*'b'.*Nothing was changed"):
        sp.load(url, into={"a": a, "b": torch.zeros(1, 3).expand(2, 3)})
    assert torch.equal(a, torch.zeros(4))
    transposed = torch.zeros(3, 2).t()  # non-contiguous, but its own memory: fine
    sp.load(url, into={"a": a, "b": transposed})
    assert torch.equal(transposed, torch.arange(6.0).view(2, 3))


def test_pieces_of_equal_bytes_placed_differently_are_not_one_value() -> None:
    """Twins (saved entries read once into a target that ties them) must be one value: a
    tensor cut by rows and its transpose cut by columns have chunks of equal bytes but are
    different values (they were taken for one)."""
    from safepoint._api import _same_bytes
    from safepoint._format import Chunk, Entry

    def cut(boxes: list[tuple[tuple[int, int], tuple[int, int]]]) -> Entry:
        chunks = tuple(Chunk("data/f.bin", 8 * n, 8, (7 + n,), box) for n, box in enumerate(boxes))
        return Entry("sharded", "F32", (2, 2), chunks)

    rows = cut([((0, 0), (1, 2)), ((1, 0), (1, 2))])
    columns = cut([((0, 0), (2, 1)), ((0, 1), (2, 1))])
    assert _same_bytes(rows, rows) and not _same_bytes(rows, columns)



@pytest.mark.parametrize("where", ["value", "key", "metadata"])
def test_a_str_utf8_cannot_encode_is_refused_before_anything_is_written(
    tmp_path: Path, where: str
) -> None:
    """A str with a lone surrogate (what os.fsdecode gives for a file name that is not UTF-8)
    as a value, a key or in metadata is refused by path, and the checkpoint there stays. It
    was saved into a manifest no reader takes: every later load raised CorruptCheckpoint,
    and an overwrite replaced a good checkpoint with it."""
    name = "run-\udcff.bin"
    url = str(tmp_path / "ckpt")
    sp.save(url, {"ok": 1})
    state: dict[str, Any] = {"w": torch.ones(2)}
    metadata = None
    if where == "value":
        state["file"] = name
    elif where == "key":
        state[name] = 1
    else:
        metadata = {"file": name}
    problem = "metadata" if where == "metadata" else "surrogate"
    with pytest.raises(sp.UnsupportedLeaf, match=problem):
        sp.save(url, state, metadata=metadata, overwrite=True)
    assert sp.load(url) == {"ok": 1}
    many = {f"k{i}": "é" * (i % 3) for i in range(40)}  # a bulk dict of valid non-ASCII text
    sp.save(url, {"vocab": many, "ünïcode": 1}, overwrite=True)
    assert sp.load(url) == {"vocab": many, "ünïcode": 1}
    many["k7"] = name
    with pytest.raises(sp.UnsupportedLeaf, match="'vocab/k7'"):
        sp.save(url, {"vocab": many}, overwrite=True)


@pytest.mark.parametrize("url", ["local", "memory://freed-target"])
def test_a_target_whose_storage_was_freed_is_refused(tmp_path: Path, url: str) -> None:
    """A target tensor whose storage was resized to 0 (FSDP's resharded parameters) is a
    StateMismatch naming it, before anything is read: the load wrote to address 0 (from
    memory:// the process died; from a disk a StorageError blamed the disk)."""
    url = str(tmp_path / "ckpt") if url == "local" else url
    sp.save(url, {"w": torch.arange(6.0), "v": torch.arange(3.0).t()}, overwrite=True)
    freed = torch.empty(6)
    freed.untyped_storage().resize_(0)
    with pytest.raises(sp.StateMismatch, match="'w' has no memory"):
        sp.load(url, into={"w": freed, "v": torch.zeros(3)})
    column = torch.empty(3, 2)[:, 0]  # not contiguous: filled by a copy
    column.untyped_storage().resize_(0)
    with pytest.raises(sp.StateMismatch, match="'v' has no memory"):
        sp.load(url, into={"w": torch.zeros(6), "v": column})
    flat = torch.zeros(10)  # a parameter in a flat buffer: a view at an offset from 0 when freed
    view = flat[4:]
    flat.untyped_storage().resize_(0)
    with pytest.raises(sp.StateMismatch, match="'w' has no memory"):
        sp.load(url, into={"w": view, "v": torch.zeros(3)})


def test_a_view_gigabytes_into_a_freed_storage_is_refused() -> None:
    """A parameter more than 4 GiB into a freed flat parameter (FSDP1 units of a large model)
    points far from address 0: it is refused too (it passed as live memory, and the load
    killed the process)."""
    code = textwrap.dedent("""
        import torch, safepoint as sp
        sp.save("memory://freed-far", {"w": torch.arange(16, dtype=torch.float32)})
        flat = torch.empty(5 << 30, dtype=torch.uint8)  # 5 GiB, never touched
        offset = (4 << 30) + 4096
        view = flat[offset:offset + 64].view(torch.float32)
        flat.untyped_storage().resize_(0)
        try:
            sp.load("memory://freed-far", into={"w": view})
        except sp.StateMismatch as exc:
            print("refused" if "has no memory" in str(exc) else exc)
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.strip() == "refused"


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_a_target_overlapping_itself_through_strides_is_refused(tmp_path: Path, lib: str) -> None:
    """Sliding windows (as_strided with strides (1, 1)) share elements without a stride of 0:
    refused, as expanded views are (it loaded [[0, 2], [2, 4], [4, 5]] for [[0, 1], [2, 3],
    [4, 5]]). Layouts that only look unusual load: a transpose, every other column, a
    reversed array."""
    url = str(tmp_path / "ckpt")
    saved = np.arange(6, dtype=np.float32).reshape(3, 2)
    sp.save(url, {"w": torch.from_numpy(saved.copy()) if lib == "torch" else saved.copy()})
    if lib == "torch":
        windows: Any = torch.zeros(4).as_strided((3, 2), (1, 1))
        fine = [torch.zeros(2, 3).t(), torch.zeros(3, 4)[:, ::2], torch.zeros(2, 3).t()[:, :]]
    else:
        windows = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), (3, 2), (4, 4))
        fine = [np.zeros((2, 3), np.float32).T, np.zeros((3, 4), np.float32)[:, ::2],
                np.zeros((3, 2), np.float32)[::-1]]
    with pytest.raises(sp.StateMismatch, match="overlapping"):
        sp.load(url, into={"w": windows})
    for target in fine:
        loaded = sp.load(url, into={"w": target})["w"]
        assert np.array_equal(np.asarray(loaded), saved)


@pytest.mark.parametrize("leaf", ['b"abc"', 'np.arange(4, dtype=">f8")'],
                         ids=["bytes", "big-endian-array"])
def test_a_manifest_claiming_bytes_its_files_lack_costs_no_memory(
    tmp_path: Path, leaf: str
) -> None:
    """A 76-byte checkpoint whose manifest claims a 1 GiB bytes entry (in a data file it says
    is that large) is CorruptCheckpoint without the process using that memory: the entry's
    buffer was zero-filled (committed) before the read found the file short. A big-endian
    array's load made its big-endian copy before reading (a MemoryError where 1 GiB was not
    there; twice the memory of any real one): it is swapped in place once read."""
    code = textwrap.dedent(f"""
        import json, os, resource, numpy as np, safepoint as sp
        from safepoint._format import seal
        ckpt = {str(tmp_path / "ckpt")!r}
        sp.save(ckpt, {{"b": {leaf}}})
        doc = json.load(open(os.path.join(ckpt, "manifest.json")))
        n = 1 << 30
        doc["files"][0]["nbytes"] = n + 64
        if doc["entries"]["shape"][0] is not None:
            doc["entries"]["shape"][0] = [n // 8]
        doc["chunks"]["nbytes"][0] = n
        doc["chunks"]["digests"][0] = [0] * (-(-n // doc["checksum"]["block_bytes"]))
        doc.pop("manifest_checksum")
        open(os.path.join(ckpt, "manifest.json"), "wb").write(
            seal(json.dumps(doc, separators=(",", ":")).encode()))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            sp.load(ckpt)
        except sp.CorruptCheckpoint:
            print("corrupt", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    word, grown = child.stdout.split()
    assert word == "corrupt" and int(grown) < 256, child.stdout


def test_dicts_nested_deeper_than_a_manifest_holds_are_refused_before_writing(
    tmp_path: Path,
) -> None:
    """Dicts 340 deep passed flatten's recursion guard, the data was written, and encoding
    the manifest (three JSON levels per dict) raised a bare RecursionError: refused by path
    now, before anything is written; 100 levels save and load."""
    url = str(tmp_path / "ckpt")
    with pytest.raises(sp.UnsupportedLeaf, match="deeper than 100 levels"):
        sp.save(url, _nested(340, lambda v: {"k": v}))
    assert not (tmp_path / "ckpt").exists()
    sp.save(url, _nested(99, lambda v: {"k": v}))
    assert sp.load(url) == _nested(99, lambda v: {"k": v})

def test_a_state_deeper_than_a_save_takes_still_restores_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The nesting limit is on what a save writes: a state 150 dicts deep that an earlier
    release saved restores in place into the state that saved it (it was refused)."""
    def deep(leaf: torch.Tensor) -> dict[str, Any]:
        state: Any = leaf
        for _ in range(150):
            state = {"k": state}
        return state

    url = str(tmp_path / "ckpt")
    with monkeypatch.context() as earlier_release:
        earlier_release.setattr(_api, "MAX_DEPTH", None)
        sp.save(url, deep(torch.ones(2)))
    target = deep(torch.zeros(2))
    sp.load(url, into=target)
    assert sp.verify(url).ok
    innermost: Any = target
    while isinstance(innermost, dict):
        innermost = innermost["k"]
    assert torch.equal(innermost, torch.ones(2))


# -- lazy modules, and containers against leaves (found by a review) ------------------------


def _lazy_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.LazyBatchNorm1d(),
                               torch.nn.Linear(3, 1))


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")
def test_a_lazy_module_restores_into_a_fresh_one_which_it_materializes(tmp_path: Path) -> None:
    """Build the model, restore: a fresh model's lazy parameters and buffers have no shape
    yet, and the load raised torch's bare RuntimeError naming no path. As torch's
    `load_state_dict` does, the saved tensors materialize them, through `sp.load` and a
    manager's restore alike; another dtype is a mismatch by path, and nothing changes."""
    torch.manual_seed(0)
    trained = _lazy_model()
    trained(torch.randn(4, 5))
    trained.eval()
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": trained})
    with sp.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(1, {"model": trained})
    loaded, restored = _lazy_model(), _lazy_model()
    sp.load(url, into={"model": loaded})
    with sp.CheckpointManager(str(tmp_path / "run")) as mgr:
        assert mgr.restore({"model": restored}) == 1
    x = torch.randn(2, 5)
    for model in (loaded, restored):
        saved, now = trained.state_dict(), model.state_dict()
        assert list(now) == list(saved)
        assert all(torch.equal(now[key], saved[key]) for key in saved)
        assert torch.equal(model.eval()(x), trained(x))
    other = torch.nn.Sequential(torch.nn.LazyLinear(3, dtype=torch.float64),
                                torch.nn.LazyBatchNorm1d(), torch.nn.Linear(3, 1))
    with pytest.raises(sp.StateMismatch,
                       match=r"model/0\.weight: checkpoint dtype F32, target F64"):
        sp.load(url, into={"model": other})
    assert torch.nn.parameter.is_lazy(other[0].weight)
    assert torch.nn.parameter.is_lazy(other[1].running_mean)


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")
def test_a_lazy_model_and_its_optimizer_resume_training_exactly(tmp_path: Path) -> None:
    """The usual resume: build the lazy model and its optimizer, restore both. The check for
    optimizer state of resized parameters read each parameter's shape, which a lazy one has
    not yet, and raised torch's bare RuntimeError."""
    torch.manual_seed(0)
    trained = _lazy_model()
    optimizer = torch.optim.AdamW(trained.parameters(), lr=0.1)
    data = torch.randn(4, 5)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(data).square().mean().backward()
        opt.step()

    step(trained, optimizer)
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": trained, "optim": optimizer})
    resumed = _lazy_model()
    fresh = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    sp.load(url, into={"model": resumed, "optim": fresh})
    step(trained, optimizer)
    step(resumed, fresh)
    saved, now = trained.state_dict(), resumed.state_dict()
    assert all(torch.equal(now[key], saved[key]) for key in saved)


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")
def test_a_lazy_module_not_materialized_is_refused_by_path_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """A save of a lazy module before its first forward pass raised torch's bare
    RuntimeError during the write: every save refuses it by path, saying what to do."""
    state = {"model": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LazyLinear(3))}
    with pytest.raises(sp.UnsupportedLeaf, match="run one forward pass") as caught:
        sp.save(str(tmp_path / "ckpt"), state)
    assert caught.value.path == "model/1.weight"
    assert not (tmp_path / "ckpt").exists()
    for async_save in (False, True):
        with sp.CheckpointManager(str(tmp_path / f"run-{async_save}"),
                                  async_save=async_save) as mgr:
            with pytest.raises(sp.UnsupportedLeaf, match=r"'model/1\.weight'"):
                mgr.save(1, state)
            assert mgr.steps() == []


def test_a_value_that_became_a_dict_is_reported_as_differing(tmp_path: Path) -> None:
    """`state["best"]` was None at the start and a dict when saved: the report said "missing
    from the checkpoint: best" and "not in the target: best/loss". It differs, by its path;
    inside a stateful object that takes what it is given, the saved dict replaces it."""

    class Tracker:
        def __init__(self, best: Any) -> None:
            self.best = best

        def state_dict(self) -> dict[str, Any]:
            return {"best": self.best}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.best = state["best"]

    url = str(tmp_path / "ckpt")
    sp.save(url, {"step": 3, "best": {"loss": 0.4, "step": 2}, "tracker": Tracker({"loss": 1})})
    state = {"step": 0, "best": None, "tracker": Tracker(None)}
    with pytest.raises(sp.StateMismatch) as caught:
        sp.load(url, into=state)
    assert "differs: best: checkpoint has a container, target a value" in str(caught.value)
    assert caught.value.mismatched == ["best: checkpoint has a container, target a value"]
    assert caught.value.missing == caught.value.unexpected == []
    sp.load(url, into=state, strict=False)
    assert state["step"] == 3 and state["best"] is None and state["tracker"].best == {"loss": 1}


@pytest.mark.parametrize("root_leaf", [True, False])
def test_a_leaf_at_the_root_against_a_container_differs_by_the_root(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, root_leaf: bool
) -> None:
    """A checkpoint of one tensor at the root (`sp.save(url, tensor)`) restored into a
    dict, or a dict's into a tensor: a strict load named the root as an empty path ("not in
    the target: ."), and a lenient one, which loads what matches (nothing), raised
    StateMismatch claiming values loaded below the root would stay as they were."""
    url = str(tmp_path / "ck")
    sp.save(url, torch.ones(3) if root_leaf else {"w": torch.ones(3)})
    target = torch.zeros(3)
    state: Any = {"w": target} if root_leaf else target
    held = "a tensor, target a container" if root_leaf else "a container, target a tensor"
    with pytest.raises(sp.StateMismatch, match=f"differs: <root>: checkpoint has {held}"):
        sp.load(url, into=state)
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        assert sp.load(url, into=state, strict=False) is state
    assert f"<root>: checkpoint has {held}" in caplog.text
    assert torch.equal(target, torch.zeros(3))
    if root_leaf:
        assert state["w"] is target
        sp.load(url, into={}, strict=False)  # an empty dict holds no path: unexpected
        with pytest.raises(sp.StateMismatch, match="not in the target: <root>"):
            sp.load(url, into={})


class _SmallDisk(LocalStorage):
    """A local directory on a disk of `capacity` bytes (fault injection: a write that would
    pass it fails as a full disk does, with ENOSPC)."""

    capacity = 0
    disk = Path()

    def write(self, path: str, chunks: Any) -> int:
        used = sum(p.stat().st_size for p in self.disk.rglob("*") if p.is_file())

        def counted() -> Any:
            nonlocal used
            for chunk in chunks:
                used += memoryview(chunk).nbytes
                if used > self.capacity:
                    raise OSError(28, "No space left on device", path)
                yield chunk

        return super().write(path, counted())


def test_a_save_out_of_space_removes_what_a_killed_save_left_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save killed after writing its data leaves that data beside the committed checkpoint,
    for the next commit there to remove; on a nearly full disk every next save ran out of
    space before its commit, so the path stayed stuck until someone deleted files by hand."""
    from safepoint.storage import _REGISTERED

    ckpt = tmp_path / "disk" / "ckpt"
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    sp.save(str(ckpt), state)
    (data,) = (ckpt / "data").iterdir()
    killed = ckpt / "data" / f"{'0' * 32}-r00000-0000.bin"  # a killed overwrite's data
    killed.write_bytes(data.read_bytes())
    _SmallDisk.disk, _SmallDisk.capacity = tmp_path / "disk", (5 << 20) // 2
    monkeypatch.setitem(_REGISTERED, "small", _SmallDisk)
    newer = {"w": torch.arange(1 << 18, dtype=torch.float32) + 1}
    removed = r"killed save's leftovers .* now removed: save again"
    with pytest.raises(sp.StorageError, match=removed):
        sp.save(f"small://{ckpt}", newer, overwrite=True)
    assert not killed.exists()
    assert_same(sp.load(str(ckpt)), state)  # the committed one, as it was
    sp.save(f"small://{ckpt}", newer, overwrite=True)
    assert_same(sp.load(str(ckpt)), newer)


class _Gathering(torch.nn.Module):
    """A module whose state dict holds a list of the tensors its updates gathered, as a
    torchmetrics metric made persistent does (CatMetric's `value`)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(2))
        self.values: list[torch.Tensor] = []

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "values"] = list(self.values)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self.values = list(state_dict.pop(prefix + "values"))
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_what_a_modules_state_dict_holds_that_is_no_tensor_restores_whole(
    tmp_path: Path,
) -> None:
    """A fresh module's list is empty: the saved items were 'not in the target', and
    strict=False dropped them, though the module's own load_state_dict takes them."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), _Gathering())
    model[1].values += [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model})
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), _Gathering())
    sp.load(url, into={"model": fresh})
    assert [t.tolist() for t in fresh[1].values] == [[1.0, 2.0], [3.0]]
    assert torch.equal(fresh[0].weight, model[0].weight)


class _History:
    """README's advice for a list that grows during training: one value in a small stateful
    object."""

    def __init__(self, *items: float) -> None:
        self.items = list(items)

    def state_dict(self) -> dict[str, Any]:
        return {"items": json.dumps(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = json.loads(state["items"])


def test_a_growing_list_kept_as_one_value_restores_into_any_length(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"losses": [0.5, 0.25], "history": _History(0.5, 0.25, 0.125)})
    with pytest.raises(sp.StateMismatch, match="not in the target: losses/0"):
        sp.load(url, into={"losses": [], "history": _History()})
    for live in (_History(), _History(0.9, 0.8, 0.7, 0.6, 0.5)):  # a fresh run, a rollback
        sp.load(url, into={"losses": [0.0, 0.0], "history": live})
        assert live.items == [0.5, 0.25, 0.125]


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_quantization_aware_training_resumes_into_a_freshly_prepared_model(
    tmp_path: Path,
) -> None:
    """The observers and fake-quantizers of `prepare_qat` grow their scales from one value to
    one per channel once they see data, and their own `_load_from_state_dict` resizes a fresh
    one's: the restore refused them as shape mismatches, and strict=False skipped them, so
    the resumed run quantized with other scales than the saved one."""
    torch.manual_seed(0)
    trained = _trained_qat(4)
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": trained})
    fresh = _prepared_qat()
    sp.load(url, into={"model": fresh})
    saved, now = trained.state_dict(), fresh.state_dict()
    assert list(now) == list(saved)
    for key, value in saved.items():
        assert torch.equal(now[key], value), key
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), trained(x))


def _prepared_qat(width: int = 4) -> torch.nn.Module:
    import torch.ao.quantization as quantization

    model = torch.nn.Sequential(quantization.QuantStub(), torch.nn.Linear(4, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 2),
                                quantization.DeQuantStub())
    model.train()
    model.qconfig = quantization.get_default_qat_qconfig("fbgemm")  # type: ignore[assignment]
    return quantization.prepare_qat(model)


def _trained_qat(width: int) -> torch.nn.Module:
    model = _prepared_qat(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    return model


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_observed_quantization_buffers_load_in_place_and_are_checked(tmp_path: Path) -> None:
    """Only a fresh observer's placeholders (one value or none) are replaced whole. A lenient
    load of a 4-wide model's checkpoint into a trained 8-wide one loaded the 4-channel scales
    over the 8-channel ones (the next forward pass failed); a strict one into a histogram
    observer of other bins passed the check, and the observer's own load raised a bare
    RuntimeError after the weights were overwritten."""
    import torch.ao.quantization as quantization

    torch.manual_seed(0)
    url = str(tmp_path / "narrow")
    sp.save(url, {"model": _trained_qat(4)})
    live = _trained_qat(8)
    scale = live.state_dict()["1.weight_fake_quant.scale"].clone()
    sp.load(url, into={"model": live}, strict=False)
    assert torch.equal(live.state_dict()["1.weight_fake_quant.scale"], scale)
    live(torch.randn(2, 4))

    def observed(bins: int) -> torch.nn.Module:
        model = torch.nn.Sequential(quantization.QuantStub(), torch.nn.Linear(4, 4),
                                    quantization.DeQuantStub())
        model.eval()
        model.qconfig = quantization.QConfig(  # type: ignore[assignment]
            activation=quantization.HistogramObserver.with_args(bins=bins),
            weight=quantization.default_per_channel_weight_observer)
        model = quantization.prepare(model)
        model(torch.randn(8, 4))
        return model

    url = str(tmp_path / "histogram")
    sp.save(url, {"model": observed(256)})
    live = observed(128)
    weight = live[1].weight.detach().clone()
    with pytest.raises(sp.StateMismatch, match="histogram"):
        sp.load(url, into={"model": live})
    assert torch.equal(live[1].weight, weight)


def test_a_wrapper_subclass_target_is_restored_in_place(tmp_path: Path) -> None:
    """A wrapper tensor subclass (torchao's float8 and NF4 weights are made as TwoTensor is)
    keeps its elements in inner tensors while its storage claims their bytes at address 0:
    the load read there ("Bad address" locally; memory:// killed the process). Several of
    them, all at address 0, are no tensors sharing memory."""
    from torch.testing._internal.two_tensor import TwoTensor

    url = str(tmp_path / "ck")
    saved = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(2, 3), "z": torch.ones(2)}
    sp.save(url, saved)
    state = {"x": TwoTensor(torch.zeros(2, 3), torch.zeros(2, 3)),
             "y": torch.nn.Parameter(TwoTensor(torch.zeros(2, 3), torch.zeros(2, 3))),
             "z": torch.zeros(2)}
    target = dict(state)
    assert sp.load(url, into=target) is target
    for path in saved:
        assert target[path] is state[path], path
    for path in ("x", "y"):
        assert torch.equal(state[path].a, saved[path]) and torch.equal(state[path].b, saved[path])
    assert torch.equal(state["z"], saved["z"])


@pytest.mark.filterwarnings("ignore:.*(nested|[Ss]parse).*:UserWarning")
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested", "mkldnn"])
def test_a_target_that_is_not_dense_is_a_mismatch_by_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, layout: str, strict: bool
) -> None:
    """Save refuses sparse, nested and mkldnn tensors by path; a load into one gave torch's
    own NotImplementedError or RuntimeError ("Cannot access storage of SparseTensorImpl",
    "NestedTensorImpl doesn't support sizes"), naming nothing."""
    made = {"sparse_coo": lambda: torch.zeros(2, 3).to_sparse(),
            "sparse_csr": lambda: torch.zeros(2, 3).to_sparse_csr(),
            "nested": lambda: torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)]),
            "mkldnn": lambda: torch.zeros(2, 3).to_mkldnn()}
    url = str(tmp_path / "ck")
    sp.save(url, {"x": torch.ones(2, 3), "y": torch.ones(2)})
    target = {"x": made[layout](), "y": torch.zeros(2)}
    if strict:
        with pytest.raises(sp.StateMismatch, match=f"x: .*target a {layout} tensor") as info:
            sp.load(url, into=target)
        assert [m.split(":")[0] for m in info.value.mismatched] == ["x"]
        assert torch.equal(target["y"], torch.zeros(2))  # nothing was changed
    else:
        with caplog.at_level(logging.WARNING, logger="safepoint"):
            sp.load(url, into=target, strict=False)
        assert torch.equal(target["y"], torch.ones(2))
        assert f"x: checkpoint has a tensor, target a {layout} tensor" in caplog.text


def test_a_lenient_load_skips_a_pickled_entry_the_target_lacks(tmp_path: Path) -> None:
    """It never unpickles an entry it skips, yet raised PickleNotAllowed for it: a weights
    restore from a checkpoint that also pickled a tokenizer needed allow_pickle=True."""
    url = str(tmp_path / "ck")
    sp.save(url, {"x": torch.ones(2), "tokenizer": sp.Pickled({"vocab": [1, 2]})})
    state = {"x": torch.zeros(2)}
    sp.load(url, into=state, strict=False)
    assert torch.equal(state["x"], torch.ones(2)) and "tokenizer" not in state
    with pytest.raises(sp.PickleNotAllowed, match="tokenizer"):  # one it reads: still refused
        sp.load(url, into={"x": torch.zeros(2), "tokenizer": None}, strict=False)


def test_keys_may_be_an_iterator(tmp_path: Path) -> None:
    """A load passes over `keys=` several times: an iterator was used up by the first, so
    the load failed with "keys=[] match nothing"."""
    url = str(tmp_path / "ck")
    sp.save(url, {"a": {"b": 1}, "c": 2, "w": torch.ones(2)})
    assert sp.load(url, keys=(k for k in ["a/"])) == {"a": {"b": 1}}
    state = {"a": {"b": 0}, "c": 0, "w": torch.zeros(2)}
    sp.load(url, into=state, keys=iter(["a", "w"]))
    assert state["a"] == {"b": 1} and state["c"] == 0 and torch.equal(state["w"], torch.ones(2))
    used_up = iter(["a/"])
    list(used_up)
    with pytest.raises(sp.StateMismatch, match=r"keys=\[\] match nothing"):
        sp.load(url, keys=used_up)


@pytest.mark.parametrize("strict", [True, False])
def test_keys_empty_is_refused_as_a_selection_of_nothing(tmp_path: Path, strict: bool) -> None:
    """README: a selection that selects nothing is refused. keys=[] (a filtered list that
    came out empty) selected nothing, and the load returned {} or left the target as it
    was, strict or lenient, as if it had restored it."""
    url = str(tmp_path / "ck")
    sp.save(url, {"w": torch.ones(2), "step": 5})
    with pytest.raises(sp.StateMismatch, match=r"keys=\[\] match nothing.*leave keys= out"):
        sp.load(url, keys=[], strict=strict)
    state = {"w": torch.zeros(2), "step": 0}
    with pytest.raises(sp.StateMismatch, match=r"keys=\[\] match nothing.*'step', 'w'"):
        sp.load(url, into=state, keys=[], strict=strict)
    assert torch.equal(state["w"], torch.zeros(2)) and state["step"] == 0


def _grouped_adamw(reverse: bool, *, train: bool) -> dict[str, Any]:
    """A model and an AdamW over a decay and a no-decay group, each group's parameters in
    module order or reversed (the grouping code refactored between save and resume)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    named = dict(model.named_parameters())
    decay = [p for n, p in named.items() if n.endswith("weight")]
    no_decay = [p for n, p in named.items() if n.endswith("bias")]
    if reverse:
        decay, no_decay = decay[::-1], no_decay[::-1]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0}])
    if train:
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    return {"model": model, "optim": optim}


def test_a_fresh_optimizer_with_its_parameters_reordered_is_a_mismatch(tmp_path: Path) -> None:
    """A resume restores into a fresh optimizer, which has no state to compare the saved
    state with: with its parameters in another order than at the save, the load handed
    parameter 0 the moments of another shape, and the first step() failed naming no path."""
    url = str(tmp_path / "ck")
    sp.save(url, _grouped_adamw(False, train=True))
    target = _grouped_adamw(True, train=False)
    with pytest.raises(sp.StateMismatch, match=r"optim/state/0/exp_avg.*another order"):
        sp.load(url, into=target)
    assert not target["optim"].state  # nothing was changed, the probe's state is gone
    sp.load(url, into=_grouped_adamw(False, train=False))  # the same order loads


def test_a_fresh_optimizer_restored_alone_over_a_resized_head_is_a_mismatch(
    tmp_path: Path
) -> None:
    """The optimizer saved and restored on its own (no module entry to compare with), into a
    fresh optimizer over a model whose head was resized: the load succeeded and step() failed
    with a RuntimeError. Lenient, the head's state is skipped and the rest restored."""
    url = str(tmp_path / "ck")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    sp.save(url, {"optim": optim})
    resized = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))
    fresh = torch.optim.Adam(resized.parameters())
    with pytest.raises(sp.StateMismatch, match=r"optim/state/2/exp_avg.*\[2, 3\].*\[5, 3\]"):
        sp.load(url, into={"optim": fresh})
    assert not fresh.state
    sp.load(url, into={"optim": fresh}, strict=False)
    params = list(resized.parameters())
    assert [p in fresh.state for p in params] == [True, True, False, False]
    resized(torch.randn(2, 4)).sum().backward()
    fresh.step()


@pytest.mark.parametrize("name", sorted(
    name for name, value in vars(torch.optim).items() if isinstance(value, type)
    and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer))
def test_a_fresh_optimizer_of_every_kind_restores(tmp_path: Path, name: str) -> None:
    """The shape check of a fresh optimizer's saved state compares only the state tensors a
    step makes shaped as their parameter: Adafactor's factored ones, a `step`, LBFGS's flat
    history (whose step needs a closure) and SparseAdam's (which a dense zero gradient
    cannot step) are no reason to refuse."""
    kind = getattr(torch.optim, name)

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(4, 3, bias=name != "Muon"), torch.nn.Linear(3, 2, bias=name != "Muon"))
        if name == "SparseAdam":
            model = torch.nn.Embedding(5, 3, sparse=True)
        return model, kind(model.parameters(), **({} if name == "LBFGS" else {"lr": 0.1}))

    def loss(model: torch.nn.Module) -> torch.Tensor:
        inputs = torch.tensor([1, 2]) if name == "SparseAdam" else torch.ones(2, 4)
        return model(inputs).square().sum()

    model, optim = make()

    def closure() -> torch.Tensor:
        optim.zero_grad()
        value = loss(model)
        value.backward()
        return value

    optim.step(closure) if name == "LBFGS" else (closure(), optim.step())
    url = str(tmp_path / "ck")
    sp.save(url, {"model": model, "optim": optim})
    model2, optim2 = make()
    sp.load(url, into={"model": model2, "optim": optim2})
    assert_same(optim2.state_dict(), optim.state_dict())


def test_a_tensor_restores_into_an_array_and_an_array_into_a_tensor_in_place(
        tmp_path: Path) -> None:
    """A saved tensor meets a target array of its dtype and shape, or a saved array a target
    tensor (an export makes tensors of arrays): each target is filled in place, bit for bit,
    contiguous or not; a strict restore refused them as of another kind."""
    url = str(tmp_path / "ck")
    bits = torch.arange(24, dtype=torch.int32).view(torch.float32)  # subnormals, kept exact
    sp.save(url, {"t": torch.arange(6, dtype=torch.int64).view(2, 3),
                  "wide": torch.arange(12, dtype=torch.float64).view(4, 3).t(),
                  "bits": bits, "a": np.arange(5, dtype=np.uint32),
                  "strided": np.arange(8, dtype=np.float32)})
    arr, fortran = np.zeros((2, 3), np.int64), np.zeros((3, 4), np.float64, order="F")
    padded = np.zeros(48, np.float32)
    tensor, column = torch.zeros(5, dtype=torch.uint32), torch.zeros(8, 2)
    target = {"t": arr, "wide": fortran, "bits": padded[::2], "a": tensor,
              "strided": column[:, 1]}
    sp.load(url, into=target)
    assert target["t"] is arr and target["wide"] is fortran and target["a"] is tensor
    np.testing.assert_array_equal(arr, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(fortran, np.arange(12, dtype=np.float64).reshape(4, 3).T)
    assert padded[::2].tobytes() == bits.numpy().tobytes() and not padded[1::2].any()
    np.testing.assert_array_equal(tensor.numpy(), np.arange(5, dtype=np.uint32))
    assert torch.equal(column[:, 1], torch.arange(8.0)) and not column[:, 0].any()


@pytest.mark.parametrize("into", [True, False])
def test_a_strict_load_refuses_a_key_that_selects_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, into: bool
) -> None:
    """Only a selection that matched nothing at all was refused: with a typo in one key of
    several, the encoder loaded and the decoder silently kept its random initialisation.
    Leniently, the key is logged and the others load."""
    url = str(tmp_path / "ck")
    torch.manual_seed(0)
    saved = torch.nn.ModuleDict({"encoder": torch.nn.Linear(3, 3),
                                 "decoder": torch.nn.Linear(3, 3)})
    sp.save(url, {"model": saved, "step": 3})
    torch.manual_seed(1)
    target = torch.nn.ModuleDict({"encoder": torch.nn.Linear(3, 3),
                                  "decoder": torch.nn.Linear(3, 3)})
    before = copy.deepcopy(target.state_dict())
    keys = ["model/encoder.*", "model/decodr.*"]
    with pytest.raises(sp.StateMismatch, match=r"keys=\['model/decodr\.\*'\] match nothing"):
        sp.load(url, into={"model": target} if into else None, keys=keys)
    assert_same(target.state_dict(), before)  # nothing was changed
    with caplog.at_level(logging.WARNING, logger="safepoint"):
        loaded = sp.load(url, into={"model": target} if into else None, keys=keys,
                         strict=False)
    assert "model/decodr.*" in caplog.text
    encoder = (target.state_dict() if into else loaded["model"])["encoder.weight"]
    assert torch.equal(encoder, saved.encoder.weight)
    # Every key that selects something loads: "" (everything), a path, a glob.
    sp.load(url, into={"model": target, "step": 0}, keys=["", "step", "model/*.bias"])


def test_a_fresh_optimizer_s_step_hooks_do_not_run_on_a_load(tmp_path: Path) -> None:
    """The shape check of a fresh optimizer's saved state makes the state a zero step
    would, which is no training step: the hooks on its step (an EMA's update) stay still."""
    url = str(tmp_path / "ck")
    state = _grouped_adamw(False, train=True)
    sp.save(url, state)
    target = _grouped_adamw(False, train=False)
    calls: list[str] = []
    target["optim"].register_step_pre_hook(lambda *_: calls.append("pre"))
    target["optim"].register_step_post_hook(lambda *_: calls.append("post"))
    sp.load(url, into=target)
    assert calls == []
    assert_same(target["optim"].state_dict(), state["optim"].state_dict())


def test_empty_tensor_with_large_dims_does_not_make_checkpoint_unloadable(
        tmp_path: Path) -> None:
    """torch makes an empty tensor of shape (2**40, 0, 2**40) (its strides use only the
    dimensions after each): it was saved, then the reader, multiplying every dimension, called
    the manifest damaged and the weight beside it never loaded. It round-trips now, and an
    empty tensor whose shape readers do refuse (strides past int64 in bytes) is refused at save
    time by path, before anything is written."""
    url = str(tmp_path / "ck")
    odd, weight = torch.empty((2**40, 0, 2**40)), torch.arange(6.0)
    sp.save(url, {"odd": odd, "weight": weight})
    loaded = sp.load(url)
    assert loaded["odd"].shape == odd.shape and torch.equal(loaded["weight"], weight)
    assert sp.verify(url).ok
    refused = str(tmp_path / "refused")
    with pytest.raises(sp.UnsupportedLeaf, match="'odd'"):
        sp.save(refused, {"weight": weight, "odd": torch.empty((0, 2**60, 2))})
    assert not os.path.exists(refused) or not os.listdir(refused)


def test_non_contiguous_inference_tensor_target_is_filled(tmp_path: Path) -> None:
    """A contiguous target made under inference mode is filled through its memory; a
    non-contiguous one (a transpose) is copied into, which torch allows an inference tensor
    only inside inference mode: the load crashed with torch's bare RuntimeError after other
    targets were already changed."""
    url = str(tmp_path / "ck")
    sp.save(url, {"a": torch.ones(3), "w": torch.arange(12.0).reshape(3, 4)})
    with torch.inference_mode():
        w, contiguous = torch.zeros(4, 3).T, torch.zeros(3, 4)
    a = torch.zeros(3)
    sp.load(url, into={"a": a, "w": w})
    assert torch.equal(w, torch.arange(12.0).reshape(3, 4)) and torch.equal(a, torch.ones(3))
    sp.load(url, into={"w": contiguous}, keys=["w"])
    assert torch.equal(contiguous, torch.arange(12.0).reshape(3, 4))


def test_a_module_made_under_inference_mode_is_a_mismatch_by_path(tmp_path: Path) -> None:
    """A module built under inference mode refuses its own load_state_dict (in-place copies
    into inference tensors) with a RuntimeError, which escaped bare; it is a StateMismatch
    naming the module's path."""
    url = str(tmp_path / "ck")
    sp.save(url, {"m": torch.nn.Linear(3, 2)})
    with torch.inference_mode():
        model = torch.nn.Linear(3, 2)
    with pytest.raises(sp.StateMismatch, match=r"(?s)'m' \(Linear\) refused.*inference"):
        sp.load(url, into={"m": model})


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   NotImplementedError("not for this backend")],
                         ids=["out-of-memory", "not-implemented"])
def test_a_failure_in_load_state_dict_that_is_no_mismatch_keeps_its_type(
    tmp_path: Path, error: RuntimeError
) -> None:
    """Since RuntimeError (nn.Module's refusal) became a StateMismatch, an object's
    load_state_dict running out of memory (an optimizer moving its state to a full GPU) was
    called a mismatch too, with advice to restore another state, and code catching the
    OutOfMemoryError to free caches and retry no longer saw it: its subclasses go on as
    they are."""
    class Failing:
        def state_dict(self) -> dict[str, Any]:
            return {"w": torch.zeros(3)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise error

    url = str(tmp_path / "ck")
    sp.save(url, {"o": Failing()})
    with pytest.raises(type(error)):
        sp.load(url, into={"o": Failing()})


def test_fake_tensor_target_is_refused_by_path_before_anything_changes(tmp_path: Path) -> None:
    """A FakeTensor target (a model built under FakeTensorMode, to estimate memory) has no
    memory to fill, like a meta tensor, but reports a real device: the load crashed in copy_
    with torch's bare AssertionError after the other targets were filled. It is a
    StateMismatch naming it, before anything is read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    url = str(tmp_path / "ck")
    sp.save(url, {"a": torch.ones(3), "w": torch.arange(3.0)})
    with FakeTensorMode():
        fake = torch.zeros(3)
    a = torch.zeros(3)
    with pytest.raises(sp.StateMismatch, match=r"fake tensors .*'w'") as info:
        sp.load(url, into={"a": a, "w": fake})
    assert info.value.mismatched == ["w"]
    assert torch.equal(a, torch.zeros(3))


def test_tied_tensor_after_another_view_is_stored_once(tmp_path: Path) -> None:
    """Weights living in a flat buffer saved before them: a weight under two names was
    compared only with the buffer (the first tensor at its address), so the second name was
    written as a second copy instead of an alias. It is an alias, and restores tied."""
    flat = torch.arange(24.0)
    weight = flat.view(4, 6)
    url = str(tmp_path / "ck")
    sp.save(url, {"flat": flat, "emb": weight, "head": weight})
    kinds = {entry.path: entry.kind for entry in sp.info(url).entries}
    assert kinds == {"flat": "tensor", "emb": "tensor", "head": "alias"}
    loaded = sp.load(url)
    assert torch.equal(loaded["head"], weight) and loaded["head"] is loaded["emb"]


def test_alias_entry_loads_into_numpy_target(tmp_path: Path) -> None:
    """A saved tensor fills a target array of its dtype and shape; a tensor stored as an
    alias (tied) was refused instead, 'checkpoint has a tensor, target a ndarray'. It fills
    the array in place, contiguous or not, with or without the entry it aliases."""
    w = torch.arange(6.0).reshape(2, 3)
    url = str(tmp_path / "ck")
    sp.save(url, {"a": w, "b": w})
    assert {e.path: e.kind for e in sp.info(url).entries}["b"] == "alias"
    a, b = np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32).T
    target = {"a": a, "b": b}
    sp.load(url, into=target)
    assert target["a"] is a and target["b"] is b
    np.testing.assert_array_equal(a, w.numpy())
    np.testing.assert_array_equal(b, w.numpy())
    alone = np.zeros((2, 3), np.float32)
    sp.load(url, into={"b": alone}, keys=["b"])
    np.testing.assert_array_equal(alone, w.numpy())


def test_alias_loaded_alone_keeps_its_strides(tmp_path: Path) -> None:
    """A dense non-contiguous tensor (a transposed weight) comes back with its strides; its
    alias did when loaded with it, but selected alone came back contiguous (rebuilt without
    the strides of the entry it aliases)."""
    w = torch.arange(6.0).reshape(2, 3).T  # strides (1, 3)
    url = str(tmp_path / "ck")
    sp.save(url, {"a": w, "b": w})
    assert {e.path: e.kind for e in sp.info(url).entries}["b"] == "alias"
    assert sp.load(url)["b"].stride() == w.stride()
    alone = sp.load(url, keys=["b"])["b"]
    assert torch.equal(alone, w) and alone.stride() == w.stride()


def test_bytearray_leaf_keeps_its_type(tmp_path: Path) -> None:
    """A bytearray is saved as bytes; restored into a live bytearray it was replaced by
    immutable bytes, and code extending the buffer after a resume broke. The live bytearray
    is filled in place, its length changed as needed; loaded without a target it comes back
    as bytes (README)."""
    url = str(tmp_path / "ck")
    sp.save(url, {"buf": bytearray(b"abc"), "empty": bytearray()})
    assert sp.load(url) == {"buf": b"abc", "empty": b""}
    live, longer = bytearray(b"z"), bytearray(b"zzzzz")
    state = {"buf": live, "empty": longer}
    sp.load(url, into=state)
    assert state["buf"] is live and live == bytearray(b"abc")
    assert state["empty"] is longer and longer == bytearray()
    live.extend(b"d")


def test_entries_made_while_the_data_is_written_are_those_made_after_it() -> None:
    """A save makes its entries' records while it waits for a slow writer (`_Chunked.ready`):
    they are those made once every byte is copied, tied and empty tensors and a value among
    them."""
    leaves: dict[str, Any] = {f"t{n}": torch.arange(n % 40 + 1, dtype=torch.float64)
                              for n in range(1500)}
    leaves["tied"], leaves["empty"], leaves["step"] = leaves["t7"], torch.zeros(0, 3), 5
    kinds = {path: VALUE if path == "step" else TENSOR for path in leaves}
    data = host_data(leaves, kinds)
    early = _api._Chunked(data, "data/f.bin")
    _, digests = write_file(
        SlowWrites(0.005), "data/f.bin", data.stream(), block_bytes=4 << 20, checksum=crc32c.crc32c,
        options=IOOptions(buffer_bytes=8192, buffers=2), spare=early.ready)
    made_early = early.done
    assert made_early > 1000 and early.ordered
    made = early.finish(digests)
    assert made == _api._Chunked(data, "data/f.bin").finish(digests)
    assert len(made) == 1501 and "tied" not in made and "step" not in made
    assert made["t7"].chunks[0].digests == (crc32c.crc32c(leaves["t7"].numpy().tobytes()),)


def test_the_collector_is_enabled_again_after_loads_overlapping_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each load paused the cyclic garbage collector and restored what `gc.isenabled()` said
    when it began: a thread that read it while another thread's load had it paused, and
    paused it after that load ended, left it disabled for the rest of the process (found by
    a review, 1 to 7 rounds in 300 of four threads loading). The interleaving is forced."""
    import gc

    from safepoint._api import _gc_paused

    first_in, first_may_end = threading.Event(), threading.Event()
    first = threading.Thread(target=lambda: _paused_until(first_in, first_may_end))
    isenabled = gc.isenabled

    def read_then_let_the_first_end() -> bool:
        enabled = isenabled()
        if threading.current_thread().name == "second":
            first_may_end.set()
            first.join(10)
        return enabled

    monkeypatch.setattr(gc, "isenabled", read_then_let_the_first_end)
    assert isenabled()
    first.start()
    assert first_in.wait(10)
    def paused_once() -> None:
        with _gc_paused():
            pass

    second = threading.Thread(target=paused_once, name="second")
    second.start()
    second.join(10)
    first_may_end.set()
    first.join(10)
    assert isenabled()


def _paused_until(started: threading.Event, may_end: threading.Event) -> None:
    from safepoint._api import _gc_paused

    with _gc_paused():
        started.set()
        may_end.wait(10)


def test_the_collector_is_enabled_again_after_a_nested_pause_at_any_line() -> None:
    """A signal handler's save runs between any two lines of the operation it interrupts: one
    run right after the first pause's `gc.disable()` (before it counted itself), or right
    after the last count went to 0, took the collector for off and left it so (found by a
    review). A nested pause is run at each line of the pause in turn."""
    import gc
    import sys

    from safepoint._api import _gc_paused

    code = _gc_paused.__wrapped__.__code__  # type: ignore[attr-defined]
    lines: list[int] = []

    def nest_at(line: int | None) -> None:
        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code is not code:
                return None

            def local(frame: Any, event: str, arg: Any) -> Any:
                if event == "line":
                    if line is None:
                        lines.append(frame.f_lineno)
                    elif frame.f_lineno == line:
                        sys.settrace(None)  # one nested pause, untraced
                        with _gc_paused():
                            pass
                return local
            return local

        sys.settrace(tracer)
        try:
            with _gc_paused():
                pass
        finally:
            sys.settrace(None)

    assert gc.isenabled()
    nest_at(None)
    assert len(set(lines)) > 5
    for line in sorted(set(lines)):
        nest_at(line)
        assert gc.isenabled(), line


@pytest.mark.parametrize("into", [False, True])
def test_a_load_of_a_checkpoint_saved_again_while_it_is_read_loads_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: bool,
) -> None:
    """`overwrite=True` replaces a checkpoint so that at every instant the old or the new one
    loads, but a load that had read the old manifest when the old data files went raised
    CheckpointNotFound ('replaced while it was being read'; a review saw 2.4% of loads
    beside an overwrite loop). A load alone now reads the new one; removed, it still raises."""
    from safepoint._storage_local import LocalStorage

    url = tmp_path / "ckpt"
    sp.save(str(url), {"w": torch.full((1000,), 1.0), "n": 1})
    saved_anew: list[bool] = []
    readinto = LocalStorage.readinto_stretches

    def the_writer_saves_again(self: LocalStorage, *args: Any) -> Any:
        if not saved_anew:
            saved_anew.append(True)
            sp.save(str(url), {"w": torch.full((1000,), 2.0), "n": 2}, overwrite=True)
            wait_for_removals()  # the old data files are gone
        return readinto(self, *args)

    monkeypatch.setattr(LocalStorage, "readinto_stretches", the_writer_saves_again)
    target = {"w": torch.zeros(1000), "n": 0}
    loaded = sp.load(str(url), into=target) if into else sp.load(str(url))
    assert saved_anew and loaded["n"] == 2 and torch.equal(loaded["w"], torch.full((1000,), 2.0))

    def the_writer_removes_it(self: LocalStorage, *args: Any) -> Any:
        if not saved_anew:
            saved_anew.append(True)
            shutil.rmtree(url)
        return readinto(self, *args)

    saved_anew.clear()
    monkeypatch.setattr(LocalStorage, "readinto_stretches", the_writer_removes_it)
    with pytest.raises(sp.CheckpointNotFound, match="removed while it was being read"):
        sp.load(str(url))
