"""Every error safepoint raises; each says what happened, where, and what to do next.

Stdlib imports only, so any layer (and the CLI on a machine without torch) can use it::

    SafepointError(Exception)
      CheckpointNotFound      (also FileNotFoundError)  nothing committed at that URL or step
      CheckpointExists        (also FileExistsError)    save without overwrite=True over a commit
      CorruptCheckpoint                                 checksum, truncation, bad manifest
      FormatVersionError                                written by a newer format
      StateMismatch           (also ValueError)         strict restore: missing/unexpected keys,
                                                        dtype or shape
      UnsupportedLeaf         (also TypeError)          save met a value it cannot store
      PickleNotAllowed                                  pickled entry met allow_pickle=False
      StorageError            (also OSError)            I/O failed in a backend
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CheckpointExists",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "FormatVersionError",
    "PickleNotAllowed",
    "SafepointError",
    "StateMismatch",
    "StorageError",
    "UnsupportedLeaf",
]


class SafepointError(Exception):
    """Base of every error safepoint raises.

    Attributes:
        url: the checkpoint (or root) the error is about, when there is one.
    """

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduce calls cls(*args), which cannot pass the keyword-only fields
        # (UnsupportedLeaf's required `path`); errors cross processes by pickle.
        return _unpickle, (type(self), self.args, self.__dict__)


def _unpickle(
    cls: type[SafepointError], args: tuple[Any, ...], fields: dict[str, Any]
) -> SafepointError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


class CheckpointNotFound(SafepointError, FileNotFoundError):
    """Nothing committed at that URL (or step): check the path, or list with `safepoint ls`."""


class CheckpointExists(SafepointError, FileExistsError):
    """A save met a committed checkpoint at its URL; pass `overwrite=True` to replace it."""


class CorruptCheckpoint(SafepointError):
    """The checkpoint's bytes or manifest are damaged: a checksum mismatch, a truncated file,
    a manifest that does not parse or points outside its checkpoint.

    Restore an earlier checkpoint; `safepoint verify URL` lists every problem.

    Attributes:
        problems: one line per problem found.
    """

    def __init__(
        self, message: str, *, url: str | None = None, problems: Sequence[str] = ()
    ) -> None:
        super().__init__(message, url=url)
        self.problems = list(problems) or [message]


class FormatVersionError(SafepointError):
    """The checkpoint was written by a newer format version: upgrade safepoint to read it."""


class StateMismatch(SafepointError, ValueError):
    """A strict restore found missing or unexpected keys, or a dtype or shape that differs.

    Pass `strict=False` to load what matches and skip the rest, or `keys=` to select a subset.

    Attributes:
        missing: paths the target has and the checkpoint lacks.
        unexpected: paths the checkpoint has and the target lacks.
        mismatched: one line per path whose dtype, shape or kind differs.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
    ) -> None:
        super().__init__(message, url=url)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class UnsupportedLeaf(SafepointError, TypeError):
    """Save met a value it cannot store; the message names its path.

    Convert it to a supported type, give its owner `state_dict()`/`load_state_dict()`, or wrap
    it in `sp.Pickled(obj)` (loading it then needs `allow_pickle=True`).

    Attributes:
        path: the `/`-joined path of the value in the state.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class PickleNotAllowed(SafepointError):
    """A pickled entry met `allow_pickle=False`; pass `allow_pickle=True` only if you trust
    the checkpoint's author, or leave the entry out with `keys=`.

    Attributes:
        paths: the pickled entries that were refused.
    """

    def __init__(self, message: str, *, url: str | None = None, paths: Sequence[str] = ()) -> None:
        super().__init__(message, url=url)
        self.paths = list(paths)


class StorageError(SafepointError, OSError):
    """I/O failed in a storage backend; `__cause__` holds the backend's own error.

    Check the path, permissions, free space or credentials, then retry.
    """
