"""Every error safepoint raises; each says what happened, where, and what to do next.

Stdlib imports only, so any layer (and the CLI on a machine without torch) can use it::

    SafepointError(Exception)
      CheckpointNotFound      (also FileNotFoundError)  nothing committed at that URL or step
      CheckpointExists        (also FileExistsError)    save without overwrite=True over a commit
      CorruptCheckpoint                                 checksum, truncation, bad manifest
      DistributedError                                  a collective call failed on some rank
      FormatVersionError                                written by a newer format
      StateMismatch           (also ValueError)         strict restore: missing/unexpected keys,
                                                        dtype or shape
      UnsupportedLeaf         (also TypeError)          save met a value it cannot store
      PickleNotAllowed                                  pickled entry met allow_pickle=False
      LeaseHeld                                         another writer holds a manager root
      StorageError            (also OSError)            I/O failed in a backend
    Preempted(SystemExit, SafepointError)               sp.Run saved after SIGTERM/SIGUSR1;
                                                        exits with status 75 to be requeued
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CheckpointExists",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "DistributedError",
    "FormatVersionError",
    "LeaseHeld",
    "PickleNotAllowed",
    "Preempted",
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


class DistributedError(SafepointError):
    """A collective save or load failed on one or more ranks, and was abandoned on every rank:
    a save committed nothing (the previous checkpoint stays the latest), unless the message
    says rank 0 committed it before a rank died. The message names each failing rank and
    its cause; the failing rank's own error is the `__cause__` there.

    Attributes:
        failures: rank -> what went wrong there.
    """

    def __init__(
        self, message: str, *, url: str | None = None, failures: dict[int, str] | None = None
    ) -> None:
        super().__init__(message, url=url)
        self.failures = dict(failures or {})


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
    """Save met a value it cannot store, or a load a pickled entry that does not unpickle
    here (its class moved or is not importable); the message names its path.

    On save: convert it to a supported type, give its owner `state_dict()`/
    `load_state_dict()`, or wrap it in `sp.Pickled(obj)` (loading it then needs
    `allow_pickle=True`). On load: make its class importable, or leave it out with `keys=`.

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


class LeaseHeld(SafepointError):
    """Another checkpoint manager holds the write lease on this root (one writer per root);
    stop that job or wait: a crashed writer's lease is taken over once its process is gone
    (same host) or the lease expired. Readers need no lease."""


class StorageError(SafepointError, OSError):
    """I/O failed in a storage backend; `__cause__` holds the backend's own error.

    Check the path, permissions, free space or credentials, then retry.
    """


#: The exit status of `Preempted`: EX_TEMPFAIL of sysexits.h, "a temporary failure; the user
#: is invited to retry". Not 0 (a scheduler would record the job as finished), not 1 (any
#: crash) and not 128+N (which claims the process died of signal N, as if it never saved).
REQUEUE_EXIT_CODE = 75


class Preempted(SystemExit, SafepointError):
    """`sp.Run` caught a preemption signal (SIGTERM or SIGUSR1 by default), saved the state at
    the step boundary and waited for the commit. Uncaught, it ends the process with status 75
    (`REQUEUE_EXIT_CODE`) and no traceback; restart the same command and the run resumes.

    It is also an `Exception`, so an `except Exception:` around the training loop catches it:
    re-raise it there.

    Attributes:
        step: the step that was saved.
        url: the run's root.
    """

    # A class attribute rather than SystemExit's per-instance `code`: it survives pickling,
    # and SafepointError's bases cannot reset it to the message.
    code = REQUEUE_EXIT_CODE

    def __init__(self, message: str, *, step: int | None = None, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.step = step
