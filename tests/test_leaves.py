"""The leaf layer: `leaf_kind` for every kind it tells apart (tensor, ndarray and numpy
scalars, plain values, bytes, sp.Pickled, sp.Shard and DTensor pieces) and for the values it
refuses (containers and stateful objects, which only the tree may take apart, and everything
else) with the path named; `piece_of` bounds checks of hand-made shards and the offsets of
DTensor pieces (on a fake process group, in this process); the wrappers are frozen; and
classifying never imports torch."""

from __future__ import annotations

import dataclasses
import decimal
import json
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from safepoint._leaves import (
    PerRank,
    Pickled,
    Shard,
    is_dtensor,
    leaf_kind,
    piece_of,
    same_value,
)
from safepoint.errors import UnsupportedLeaf

# -- leaf_kind ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(2, 3),
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 4),
        torch.ones(3, dtype=torch.bool),
        torch.zeros(2, dtype=torch.bfloat16),
        torch.zeros(2, dtype=torch.complex64),
        torch.arange(12).reshape(3, 4).t(),  # a non-contiguous view
        torch.nn.Parameter(torch.zeros(2)),
    ],
    ids=["f32", "0d", "empty", "bool", "bf16", "complex", "view", "parameter"],
)
def test_tensors(value: torch.Tensor) -> None:
    assert leaf_kind(value, "t") == "tensor"


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")
def test_a_lazy_modules_tensors_are_uninitialized_until_materialized() -> None:
    """A lazy module's parameter and buffer have no shape before its first forward pass
    (asking raises torch's bare RuntimeError): they are a kind of their own, which a load
    fills and a save refuses; once materialized, tensors."""
    linear, norm = torch.nn.LazyLinear(3), torch.nn.LazyBatchNorm1d()
    assert leaf_kind(linear.weight, "w") == leaf_kind(norm.running_mean, "m") == "uninitialized"
    linear(torch.zeros(2, 5))
    assert leaf_kind(linear.weight, "w") == "tensor"


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6).reshape(2, 3),
        np.zeros((0,), dtype=np.float16),
        np.array(7),  # 0-d array
        np.arange(10)[::3],  # non-contiguous
        np.float64(1.5),  # a subclass of float: must stay numpy, not become a plain float
        np.float32(2.5),
        np.int64(-3),
        np.uint8(200),
        np.bool_(True),
        np.complex128(1 + 2j),
    ],
    ids=["array", "empty", "0d", "strided", "float64", "float32", "int64", "uint8", "bool_",
         "complex128"],
)
def test_ndarrays_and_numpy_scalars(value: Any) -> None:
    assert leaf_kind(value, "a") == "ndarray"


@pytest.mark.parametrize("value", [np.ma.masked_array([1.0, 2.0], mask=[False, True]),
                                   np.arange(3).view(type("Tagged", (np.ndarray,), {}))],
                         ids=["masked", "subclass"])
def test_ndarray_subclasses_are_refused_rather_than_saved_without_what_they_add(
    value: Any,
) -> None:
    """A masked array would have loaded as its data, the mask silently gone."""
    with pytest.raises(UnsupportedLeaf, match=r"at 'opt/a': it would load as a plain ndarray"
                       r".* np\.asarray\(x\)") as caught:
        leaf_kind(value, "opt/a")
    assert caught.value.path == "opt/a"


def test_a_memmap_is_saved_as_the_array_it_maps(tmp_path: Any) -> None:
    mapped = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4,))
    assert leaf_kind(mapped, "m") == "ndarray"


def test_numpy_float64_is_a_float_yet_numpy() -> None:
    """The one ordering trap: np.float64 passes isinstance(float), so the numpy check must
    come first, or a saved np.float64 would come back as a plain float."""
    assert isinstance(np.float64(0.25), float)
    assert leaf_kind(np.float64(0.25), "x") == "ndarray"
    assert leaf_kind(0.25, "x") == "value"


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, -7, 2**70, "", "text with / and %", 1.5, -0.0, float("nan"),
     float("inf")],
)
def test_plain_values(value: Any) -> None:
    assert leaf_kind(value, "v") == "value"


@pytest.mark.parametrize("value", [b"", b"\x00\xffabc", bytearray(b"xyz"), bytearray()])
def test_bytes(value: Any) -> None:
    assert leaf_kind(value, "b") == "bytes"


@pytest.mark.parametrize(
    "obj",
    [object(), {1, 2}, None, torch.zeros(2), np.arange(3), Shard(torch.zeros(1), (0,), (1,))],
    ids=["object", "set", "none", "tensor", "array", "shard"],
)
def test_pickled_wins_over_what_it_wraps(obj: Any) -> None:
    assert leaf_kind(Pickled(obj), "p") == "pickle"


@pytest.mark.parametrize(("a", "b", "same"), [
    (0.0, 0.0, True), (0.0, -0.0, False), (float("nan"), float("nan"), True),
    (float("nan"), -float("nan"), False), (1, 1.0, False), (True, 1, False), ("a", "a", True),
    (None, None, True), (2**70, 2**70, True),
])
def test_same_value_compares_floats_by_their_bits_and_never_across_types(
    a: Any, b: Any, same: bool,
) -> None:
    assert same_value(a, b) is same


def test_public_names_are_these_classes() -> None:
    assert sp.Pickled is Pickled
    assert sp.Shard is Shard
    assert sp.PerRank is PerRank
    assert leaf_kind(sp.Pickled([1, 2]), "p") == "pickle"


def test_shard_is_sharded() -> None:
    assert leaf_kind(Shard(torch.zeros(2, 3), (2, 0), (4, 3)), "emb") == "sharded"


class _Counter:
    """A user's stateful object: the tree calls state_dict(), leaf_kind never sees it."""

    def state_dict(self) -> dict[str, int]:
        return {"n": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({1, 2}, "builtins.set"),
        (frozenset(), "builtins.frozenset"),
        (1 + 2j, "builtins.complex"),
        (object(), "builtins.object"),
        (memoryview(b"ab"), "builtins.memoryview"),
        (decimal.Decimal("1.5"), "decimal.Decimal"),
        (range(3), "builtins.range"),
        # containers and stateful objects are the tree's to take apart, never leaves
        ({"a": 1}, "builtins.dict"),
        (OrderedDict(), "collections.OrderedDict"),
        ([1], "builtins.list"),
        ((1,), "builtins.tuple"),
        (PerRank(1), "safepoint._leaves.PerRank"),
        (_Counter(), f"{__name__}._Counter"),
        (torch.nn.Linear(2, 2), "torch.nn.modules.linear.Linear"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unsupported_names_type_and_path(value: Any, type_name: str) -> None:
    with pytest.raises(UnsupportedLeaf) as excinfo:
        leaf_kind(value, "model/head%2Fx")
    error = excinfo.value
    assert error.path == "model/head%2Fx"
    assert f"cannot save {type_name} at 'model/head%2Fx'" in str(error)
    assert "sp.Pickled(obj)" in str(error)  # says what to do next
    assert isinstance(error, TypeError)


# -- piece_of: hand-made shards -----------------------------------------------------------------


def test_piece_of_shard_gives_its_tensor_offsets_and_shape() -> None:
    local = torch.arange(6.0).reshape(2, 3)
    tensor, offsets, shape = piece_of(Shard(local, [2, 0], [4, 3]), "emb")  # type: ignore[arg-type]
    assert tensor is local  # the load writes into this very memory
    assert (offsets, shape) == ((2, 0), (4, 3))
    assert type(offsets) is tuple and type(shape) is tuple


@pytest.mark.parametrize(
    ("local_shape", "offsets", "global_shape"),
    [
        ((2, 3), (0, 0), (2, 3)),  # the whole tensor
        ((2, 3), (2, 0), (4, 3)),  # ends exactly at the edge
        ((1, 1), (3, 2), (4, 3)),  # the last element
        ((0, 3), (4, 0), (4, 3)),  # an empty piece past the last row
        ((0, 3), (0, 0), (0, 3)),  # an empty global tensor
        ((), (), ()),  # 0-d
        ((2, 2, 2), (1, 0, 3), (3, 2, 5)),
    ],
)
def test_pieces_that_fit(local_shape: tuple[int, ...], offsets: tuple[int, ...],
                         global_shape: tuple[int, ...]) -> None:
    shard = Shard(torch.zeros(local_shape), offsets, global_shape)
    assert piece_of(shard, "p")[1:] == (offsets, global_shape)
    assert leaf_kind(shard, "p") == "sharded"


@pytest.mark.parametrize(
    ("local_shape", "offsets", "global_shape"),
    [
        ((2, 3), (3, 0), (4, 3)),  # one row past the end
        ((2, 3), (0, 1), (4, 3)),  # one column past the end
        ((2, 3), (-1, 0), (4, 3)),  # negative offset
        ((5, 3), (0, 0), (4, 3)),  # larger than the global tensor
        ((2, 3), (0,), (4, 3)),  # too few offsets
        ((2, 3), (0, 0, 0), (4, 3, 1)),  # global rank differs from the piece's
        ((2, 3), (0, 0), (4,)),  # too short a global shape
        ((1,), (0,), (-1,)),  # a negative global dimension
    ],
)
def test_pieces_that_do_not_fit(local_shape: tuple[int, ...], offsets: tuple[int, ...],
                                global_shape: tuple[int, ...]) -> None:
    shard = Shard(torch.zeros(local_shape), offsets, global_shape)
    with pytest.raises(UnsupportedLeaf, match="does not fit its global shape") as excinfo:
        piece_of(shard, "emb/3")
    assert excinfo.value.path == "emb/3"
    assert f"offsets {list(offsets)}" in str(excinfo.value)
    with pytest.raises(UnsupportedLeaf, match="does not fit"):  # leaf_kind checks it too
        leaf_kind(shard, "emb/3")


@pytest.mark.parametrize(
    ("offsets", "global_shape"),
    [((3.0, 0), (6, 4)), ((0, 0), (6.0, 4)), ((0, 0), (6, "4")), (0, 4)],
    ids=["float-offset", "float-shape", "str-shape", "numbers-not-sequences"],
)
def test_shard_offsets_and_shape_must_be_whole_numbers(
    tmp_path: Any, offsets: tuple[Any, ...], global_shape: tuple[Any, ...]
) -> None:
    """Offsets such as `rank * 6 / world` (3.0) are refused by path before anything is
    written: they were saved, and every load refused the committed manifest as damaged."""
    shard = Shard(torch.zeros(3, 4), offsets, global_shape)
    with pytest.raises(UnsupportedLeaf, match="pass sequences of whole numbers") as excinfo:
        leaf_kind(shard, "emb")
    assert excinfo.value.path == "emb"
    with pytest.raises(UnsupportedLeaf, match="'emb'"):
        sp.save(str(tmp_path / "ckpt"), {"emb": shard})
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


def test_shard_takes_numpy_and_torch_integers(tmp_path: Any) -> None:
    """Offsets and a global shape computed with NumPy or torch are whole numbers: saved and
    loaded (an np.int64 global shape failed as a bare TypeError encoding the manifest)."""
    t = torch.arange(12.0).reshape(3, 4)
    sp.save(str(tmp_path / "ckpt"),
            {"t": Shard(t, (np.int64(0), torch.tensor(0)), (np.int64(3), torch.tensor(4)))})
    assert torch.equal(sp.load(str(tmp_path / "ckpt"))["t"], t)


@pytest.mark.parametrize("held", [np.zeros(2), [0.0, 0.0], None], ids=["ndarray", "list", "none"])
def test_shard_must_hold_a_tensor(held: Any) -> None:
    shard = Shard(held, (0,), (2,))
    with pytest.raises(UnsupportedLeaf, match=f"holds a {type(held).__name__}: pass a torch"):
        piece_of(shard, "emb")
    with pytest.raises(UnsupportedLeaf) as excinfo:
        leaf_kind(shard, "emb")
    assert excinfo.value.path == "emb"


def test_wrappers_are_frozen_values() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Pickled(1).obj = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shard(torch.zeros(1), (0,), (1,)).offsets = (1,)  # type: ignore[misc]
    assert Pickled("a") == Pickled("a") != Pickled("b")


# -- DTensor pieces, on a fake process group ----------------------------------------------------


@pytest.fixture
def fake_world() -> Iterator[Any]:
    """A fake process group of 4 ranks in which this process is rank 3 (no peers, no
    collectives run); destroyed afterwards."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg as fake_pg
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=3, world_size=4)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_dtensor_row_shard_is_a_piece(fake_world: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard

    mesh = DeviceMesh("cpu", torch.arange(4))
    local = torch.arange(6.0).reshape(3, 2)
    value = DTensor.from_local(local, mesh, [DShard(0)], run_check=False,
                               shape=torch.Size((12, 2)), stride=(2, 1))
    assert is_dtensor(value) and not is_dtensor(local)
    assert isinstance(value, torch.Tensor)  # so the sharded check must come before "tensor"
    assert leaf_kind(value, "w") == "sharded"
    tensor, offsets, shape = piece_of(value, "w")
    assert (offsets, shape) == ((9, 0), (12, 2))  # rank 3 of 4 holds rows 9..12
    assert torch.equal(tensor, local)


def test_dtensor_replicated_mesh_dimension(fake_world: Any) -> None:
    """On a 2 x 2 mesh [Replicate, Shard(1)] rank 3 sits at (1, 1): the second column half,
    the same piece rank 1 holds."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    local = torch.zeros(3, 2)
    value = DTensor.from_local(local, mesh, [Replicate(), DShard(1)], run_check=False,
                               shape=torch.Size((3, 4)), stride=(4, 1))
    assert piece_of(value, "w")[1:] == ((0, 2), (3, 4))


def test_dtensor_with_a_partial_placement_is_refused(fake_world: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = DeviceMesh("cpu", torch.arange(4))
    value = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
    for classify in (piece_of, leaf_kind):
        with pytest.raises(UnsupportedLeaf, match=r"Partial placement.*or loading") as excinfo:
            classify(value, "grad/acc")
        assert excinfo.value.path == "grad/acc"
        assert "'grad/acc'" in str(excinfo.value)


# -- no torch import ----------------------------------------------------------------------------


def test_classifying_never_imports_torch() -> None:
    code = textwrap.dedent(
        """
        import json
        import sys
        import numpy as np
        from safepoint._leaves import Pickled, leaf_kind
        kinds = [leaf_kind(v, "x") for v in (1, 1.5, None, "s", b"b", np.zeros(2),
                                              np.float64(1), Pickled(object()))]
        try:
            leaf_kind(object(), "x")
        except TypeError:
            kinds.append("refused")
        print(json.dumps([kinds, "torch" in sys.modules]))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    kinds, torch_imported = json.loads(result.stdout)
    assert kinds == ["value", "value", "value", "value", "bytes", "ndarray", "ndarray", "pickle",
                     "refused"]
    assert torch_imported is False
