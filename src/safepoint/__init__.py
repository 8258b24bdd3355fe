"""safepoint: fast, atomic, verifiable checkpoints of complete ML training state.

Example:
    import safepoint as sp

    sp.save("/ckpt/run1/final", {"model": model, "optim": optimizer, "step": 1000})
    sp.load("/ckpt/run1/final", into={"model": model, "optim": optimizer, "step": 0})
"""

from __future__ import annotations

from ._api import CheckpointInfo, EntryInfo, VerifyReport, info, load, save, verify
from ._leaves import Pickled
from ._version import __version__
from .errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    FormatVersionError,
    PickleNotAllowed,
    SafepointError,
    StateMismatch,
    StorageError,
    UnsupportedLeaf,
)

__all__ = [
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "EntryInfo",
    "FormatVersionError",
    "PickleNotAllowed",
    "Pickled",
    "SafepointError",
    "StateMismatch",
    "StorageError",
    "UnsupportedLeaf",
    "VerifyReport",
    "__version__",
    "info",
    "load",
    "save",
    "verify",
]
