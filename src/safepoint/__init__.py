"""safepoint: fast, atomic, verifiable checkpoints of complete ML training state.

Example:
    import safepoint as sp

    sp.save("/ckpt/run1/final", {"model": model, "optim": optimizer, "step": 1000})
    sp.load("/ckpt/run1/final", into={"model": model, "optim": optimizer, "step": 0})
"""

from __future__ import annotations

from ._api import CheckpointInfo, EntryInfo, VerifyReport, info, load, save, verify
from ._copy import CopyReport, copy
from ._diff import DiffReport, EntryDiff, diff
from ._events import Event
from ._interchange import ExportReport, export_checkpoint, import_checkpoint
from ._leaves import PerRank, Pickled, Shard
from ._manager import CheckpointManager, GCReport, SaveHandle, StepInfo
from ._names import format_name
from ._rng import RNGState
from ._run import Run
from ._sampler import ResumableSampler
from ._version import __version__
from .errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    DistributedError,
    FormatVersionError,
    LeaseHeld,
    PickleNotAllowed,
    Preempted,
    SafepointError,
    StateMismatch,
    StorageError,
    UnsupportedLeaf,
)

__all__ = [
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "CopyReport",
    "CorruptCheckpoint",
    "DiffReport",
    "DistributedError",
    "EntryDiff",
    "EntryInfo",
    "Event",
    "ExportReport",
    "FormatVersionError",
    "GCReport",
    "LeaseHeld",
    "PerRank",
    "PickleNotAllowed",
    "Pickled",
    "Preempted",
    "RNGState",
    "ResumableSampler",
    "Run",
    "SafepointError",
    "SaveHandle",
    "Shard",
    "StateMismatch",
    "StepInfo",
    "StorageError",
    "UnsupportedLeaf",
    "VerifyReport",
    "__version__",
    "copy",
    "diff",
    "export_checkpoint",
    "format_name",
    "import_checkpoint",
    "info",
    "load",
    "save",
    "verify",
]
