"""Leaf classification and the wrappers users put in a state (tree layer).

A leaf is one of a closed set of kinds; anything else is refused with the path it was found at.
torch is never imported here: a tensor can only exist if the caller already imported torch.
"""

from __future__ import annotations

import operator
import struct
import sys
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import SafepointError, UnsupportedLeaf

__all__ = [
    "MAX_INT_DIGITS",
    "PerRank",
    "Pickled",
    "Shard",
    "check_text",
    "leaf_kind",
    "piece_of",
    "same_value",
    "too_long_int",
    "whole_number",
]

T = TypeVar("T")

#: Kinds whose bytes live in data files; "value" lives in the manifest itself.
TENSOR = "tensor"
NDARRAY = "ndarray"
BYTES = "bytes"
PICKLE = "pickle"
VALUE = "value"
#: A piece of a global tensor (`Shard`, `DTensor`); stored as a tensor entry whose chunks
#: carry boxes when the pieces do not make one whole chunk.
SHARDED = "sharded"
#: A tensor that is another leaf's tensor (the same memory, dtype and shape: tied weights);
#: saved as an entry naming that leaf, its bytes stored once.
ALIAS = "alias"
#: A tensor not materialized yet, without shape or memory: a lazy module's parameter or
#: buffer (`nn.LazyLinear`'s) before its first forward pass. Only a load's target: the saved
#: tensor is read into a new one, from which the module's `load_state_dict` materializes it,
#: as torch's own load does; a save refuses it (`_staging.host_leaf`).
UNINITIALIZED = "uninitialized"


#: The most digits of an int the format holds: what Python reads by default
#: (`sys.get_int_max_str_digits`), whatever the saving process allows itself.
MAX_INT_DIGITS = 4300
_INT_BOUND = 10**MAX_INT_DIGITS


def too_long_int(value: Any) -> bool:
    """Whether `value` is an int of more than `MAX_INT_DIGITS` digits (compared with a bound,
    never printed: printing is what the process's own limit governs)."""
    return isinstance(value, int) and not -_INT_BOUND < value < _INT_BOUND


def same_value(a: Any, b: Any) -> bool:
    """Whether two plain values are the same: of one type and equal, floats by their bits,
    as data is compared (-0.0 is not 0.0, a NaN is the same NaN only with the same payload)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


@dataclass(frozen=True, slots=True)
class Pickled(Generic[T]):
    """Marks an object to be stored with pickle, which safepoint otherwise never does.

    Loading it back needs `allow_pickle=True`, since unpickling runs code from the checkpoint.

    Example:
        state["tokenizer"] = sp.Pickled(tokenizer)
    """

    obj: T


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's piece of a global tensor that the user partitioned by hand (an embedding
    table split by rows, PyTorch-BigGraph's entity partitions).

    On a distributed save every rank holding a piece writes it once (ranks holding the same
    box share the writing); on load each rank reads only the bytes overlapping its own piece,
    whatever the split was at save time, and a process without a group can load the whole
    tensor.

    Attributes:
        tensor: the local piece; its memory is what a load writes into.
        offsets: where the piece starts in the global tensor, one per dimension.
        global_shape: the shape of the global tensor.

    Example:
        rows = table.shape[0]
        state["emb"] = sp.Shard(table, (rank * rows, 0), (world * rows, table.shape[1]))
    """

    tensor: Any
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


@dataclass(slots=True)
class PerRank(Generic[T]):
    """A value that differs per rank (RNG state, a rank's data position): every rank's copy
    is kept, and restored to the same rank. `value` may be any state tree.

    Restoring onto a different world size is an error unless the load leaves these values
    out with `keys=`. Loading without a target gives `{rank: value}`.

    Example:
        state["rng"] = sp.PerRank(sp.RNGState())
    """

    value: T


def is_tensor(value: Any) -> bool:
    """True for a torch.Tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_uninitialized(value: Any) -> bool:
    """True for a tensor that a lazy module has not materialized yet (torch's
    `UninitializedParameter` and `UninitializedBuffer`)."""
    parameter = sys.modules.get("torch.nn.parameter")
    return parameter is not None and isinstance(value, parameter.UninitializedTensorMixin)


def is_ndarray(value: Any) -> bool:
    """True for a numpy array or numpy scalar (without importing numpy)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray | np.generic)


def is_dtensor(value: Any) -> bool:
    """True for a torch.distributed DTensor (without importing it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def leaf_kind(value: Any, path: str) -> str:
    """The kind a leaf is stored as, or `UnsupportedLeaf` naming its path."""
    if isinstance(value, Shard) or is_dtensor(value):
        piece_of(value, path)
        return SHARDED
    if is_tensor(value):
        return UNINITIALIZED if is_uninitialized(value) else TENSOR
    if value is None or isinstance(value, bool | int | str):
        return VALUE
    if isinstance(value, bytes | bytearray):
        return BYTES
    if isinstance(value, Pickled):
        return PICKLE
    if is_ndarray(value):  # before float: np.float64 subclasses float and must stay numpy
        _check_plain_array(value, path)
        return NDARRAY
    if isinstance(value, float):
        return VALUE
    raise UnsupportedLeaf(
        f"cannot save {type(value).__module__}.{type(value).__qualname__} at {path!r}: "
        "convert it to a tensor, array or plain value, give its owner state_dict() and "
        "load_state_dict(), or wrap it in sp.Pickled(obj) (loading then needs allow_pickle=True)",
        path=path,
    )


def whole_number(name: str, value: object, *, least: int, alternative: str = "") -> int:
    """The argument `name`'s `value` as a whole number >= `least` (an int, or NumPy's or
    torch's integers), else a `SafepointError` saying what to pass (`alternative`: what else
    it may be): a comparison with a str or None read from a config would escape as a bare
    `TypeError`, and a float would be taken and fail later, far from its cause."""
    try:
        if isinstance(value, bool):  # True is 1 to operator.index
            raise TypeError
        whole = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise SafepointError(
            f"{name}={value!r}: pass a whole number >= {least} (an int, not a "
            f"{type(value).__name__}: int(...) of a value read from a config){alternative}"
        ) from None
    if whole < least:
        raise SafepointError(f"{name}={value!r}: pass a whole number >= {least}{alternative}")
    return whole


def flag(name: str, value: object, where: str) -> bool:
    """The argument `name`'s `value` as a bool, else a `SafepointError` naming `where`: the
    str "False" read from a config or an environment variable is true, and would unpickle
    (`allow_pickle`) or replace a committed checkpoint (`overwrite`)."""
    numpy = sys.modules.get("numpy")
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise SafepointError(
        f"{name}={value!r:.100} for {where}: pass True or False (a {type(value).__name__} "
        "read from a config is not a bool: compare it, e.g. value == 'true')")


def check_text(text: str, path: str) -> None:
    """Refuse a str that UTF-8 cannot encode (a lone surrogate, as `os.fsdecode` gives for a
    file name that is not UTF-8): the manifest could hold it only as an escape that no
    reader takes, and the checkpoint would never load.

    Raises:
        UnsupportedLeaf: naming `path`.
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedLeaf(
            f"the str {text!r} at {path!r} holds a lone surrogate, which UTF-8 (a manifest's "
            "encoding) cannot store: keep such a name as bytes (os.fsencode), or as "
            "text.encode('utf-8', 'surrogateescape')", path=path,
        ) from None


def _check_plain_array(value: Any, path: str) -> None:
    """Refuse an ndarray subclass (but `np.memmap`, whose bytes are all it holds): it would
    come back as a plain ndarray without what the subclass adds (a MaskedArray's mask)."""
    np = sys.modules["numpy"]
    if type(value) is np.ndarray or not isinstance(value, np.ndarray) or isinstance(
        value, np.memmap
    ):
        return
    raise UnsupportedLeaf(
        f"cannot save {type(value).__module__}.{type(value).__qualname__} at {path!r}: it "
        "would load as a plain ndarray, without what its class adds (a masked array's "
        "mask): save np.asarray(x) (and np.ma.getmaskarray(x) beside it), or wrap it in "
        "sp.Pickled(obj) (loading then needs allow_pickle=True)",
        path=path,
    )


def _check_one_block(value: Any, offsets: tuple[int, ...], path: str) -> None:
    """Refuse a DTensor whose local tensor is not one block of the global tensor at
    `offsets`: a strided sharding (`_StridedShard`) placed after another sharding of its
    dimension gives a rank every other run of rows, which no (offsets, shape) describes.

    Raises:
        UnsupportedLeaf: naming the placements.
    """
    placements = value.placements
    if not any(type(p).__name__ == "_StridedShard" for p in placements):
        return
    torch = sys.modules["torch"]
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: holds nothing
        return
    for dim, size in enumerate(value.shape):
        indices = torch.arange(size)
        for axis, placement in enumerate(placements):
            if getattr(placement, "dim", None) == dim:  # Shard or _StridedShard of it
                chunks, _ = placement._split_tensor(indices, mesh.size(axis), with_padding=False)
                indices = chunks[coordinate[axis]]
        if indices.numel() and not torch.equal(
                indices, torch.arange(offsets[dim], offsets[dim] + indices.numel())):
            raise UnsupportedLeaf(
                f"DTensor at {path!r} has placements {list(placements)} that give this rank "
                f"indices {indices[:6].tolist()}{'...' if indices.numel() > 6 else ''} of "
                f"dimension {dim}, not one block: "
                "redistribute it to Shard/Replicate placements (or shard the dimension with "
                "_StridedShard first, as FSDP2 with tensor parallelism does) before saving "
                "or loading into it",
                path=path,
            )


def piece_of(value: Any, path: str) -> tuple[Any, tuple[int, ...] | None, tuple[int, ...]]:
    """(local tensor, offsets, global shape) of a `Shard` or `DTensor` leaf; a DTensor's
    replicated mesh dimensions give several ranks the same piece. A rank outside a DTensor's
    mesh holds an empty piece at offsets 0, or none (offsets None) of a 0-dim one, which
    has no empty piece.

    Raises:
        UnsupportedLeaf: the piece does not fit its global shape, or a DTensor has a pending
            reduction (a `Partial` placement).
    """
    if isinstance(value, Shard):
        tensor = value.tensor
        if not is_tensor(tensor):
            raise UnsupportedLeaf(
                f"sp.Shard at {path!r} holds a {type(tensor).__name__}: pass a torch.Tensor",
                path=path,
            )
        try:  # NumPy and torch integers are whole numbers too; 3.0 is not
            offsets = tuple(map(operator.index, value.offsets))
            shape = tuple(map(operator.index, value.global_shape))
        except TypeError:
            raise UnsupportedLeaf(
                f"sp.Shard at {path!r} has offsets {value.offsets!r} and global shape "
                f"{value.global_shape!r}: pass sequences of whole numbers, one per dimension "
                "(int(...) of a division's result, or use //)", path=path,
            ) from None
    else:
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(isinstance(p, Partial) for p in value.placements):
            raise UnsupportedLeaf(
                f"DTensor at {path!r} has a Partial placement (a pending reduction): "
                "redistribute it to Shard or Replicate placements before saving or loading into "
                "it",
                path=path,
            )
        tensor = value.to_local()
        shape = tuple(value.shape)
        if value.device_mesh.get_coordinate() is None:
            # A rank outside the mesh holds nothing: torch gives it a local tensor of shape
            # [0] at offsets [], which fits no tensor of another dimension.
            if not shape:
                return tensor, None, shape
            offsets = (0,) * len(shape)
            tensor = tensor.new_empty(offsets)
        else:
            _, offsets = compute_local_shape_and_global_offset(shape, value.device_mesh,
                                                               value.placements)
            offsets = tuple(offsets)
            _check_one_block(value, offsets, path)
    local = tuple(tensor.shape)
    if not (
        len(offsets) == len(shape) == len(local)
        and all(o >= 0 and n >= 0 and o + n <= g for o, n, g in zip(offsets, local, shape,
                                                                    strict=True))
    ):
        raise UnsupportedLeaf(
            f"the piece at {path!r} (shape {list(local)} at offsets {list(offsets)}) does not "
            f"fit its global shape {list(shape)}: fix the offsets or the global shape",
            path=path,
        )
    return tensor, offsets, shape
