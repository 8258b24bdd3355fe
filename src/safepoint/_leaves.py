"""Leaf classification and the wrappers users put in a state (tree layer).

A leaf is one of a closed set of kinds; anything else is refused with the path it was found at.
torch is never imported here: a tensor can only exist if the caller already imported torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import UnsupportedLeaf

__all__ = ["Pickled", "leaf_kind"]

T = TypeVar("T")

#: Kinds whose bytes live in data files; "value" lives in the manifest itself.
TENSOR = "tensor"
NDARRAY = "ndarray"
BYTES = "bytes"
PICKLE = "pickle"
VALUE = "value"


@dataclass(frozen=True, slots=True)
class Pickled(Generic[T]):
    """Marks an object to be stored with pickle, which safepoint otherwise never does.

    Loading it back needs `allow_pickle=True`, since unpickling runs code from the checkpoint.

    Example:
        state["tokenizer"] = sp.Pickled(tokenizer)
    """

    obj: T


def is_tensor(value: Any) -> bool:
    """True for a torch.Tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_ndarray(value: Any) -> bool:
    """True for a numpy array or numpy scalar (without importing numpy)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray | np.generic)


def leaf_kind(value: Any, path: str) -> str:
    """The kind a leaf is stored as, or `UnsupportedLeaf` naming its path."""
    if is_tensor(value):
        return TENSOR
    if value is None or isinstance(value, bool | int | str):
        return VALUE
    if isinstance(value, float):
        return VALUE
    if isinstance(value, bytes | bytearray):
        return BYTES
    if isinstance(value, Pickled):
        return PICKLE
    if is_ndarray(value):
        return NDARRAY
    raise UnsupportedLeaf(
        f"cannot save {type(value).__module__}.{type(value).__qualname__} at {path!r}: "
        "convert it to a tensor, array or plain value, give its owner state_dict() and "
        "load_state_dict(), or wrap it in sp.Pickled(obj) (loading then needs allow_pickle=True)",
        path=path,
    )
