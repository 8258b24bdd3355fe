"""What happened, for whoever watches: every save, load, delete and failure becomes an `Event`,
passed to `on_event=` callbacks and to logging, like caffe2's checkpoint stats (engine layer,
so the API layer can emit them too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import SafepointError

__all__ = ["DELETE", "ERROR", "LOAD", "SAVE", "Event", "EventCallback", "callbacks", "emit"]

logger = logging.getLogger(__name__)

SAVE = "save"
LOAD = "load"
DELETE = "delete"
ERROR = "error"


@dataclass(frozen=True, slots=True)
class Event:
    """One save, load, delete or failure.

    Attributes:
        kind: "save" (committed), "load" (restored), "delete" (a step or leftover removed) or
            "error" (a save failed in the background, or a restore skipped a corrupt step).
        url: the checkpoint it is about.
        step: the manager step, or None outside a manager.
        seconds: how long the operation took, start to end (for an asynchronous save: from
            the `save` call to the commit).
        blocked_seconds: how long the caller was blocked (for an asynchronous save, the
            staging; else the whole operation).
        nbytes: bytes written, read or deleted (0 when unknown).
        error: what went wrong, for kind "error".
    """

    kind: str
    url: str
    step: int | None = None
    seconds: float = 0.0
    blocked_seconds: float = 0.0
    nbytes: int = 0
    error: str | None = None

    @property
    def path(self) -> str:
        """The same as `url` (a local path is a URL without a scheme)."""
        return self.url

    @property
    def bytes_per_second(self) -> float:
        """Throughput of the whole operation."""
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        """One line for a log."""
        where = self.url if self.step is None else f"step {self.step} ({self.url})"
        if self.kind == ERROR:
            return f"error at {where}: {self.error}"
        rate = f", {self.bytes_per_second / 1e6:.0f} MB/s" if self.nbytes else ""
        return (f"{self.kind} {where}: {self.nbytes / 1e6:.1f} MB in {self.seconds:.3f} s"
                f"{rate}, blocked {self.blocked_seconds:.3f} s")


EventCallback = Callable[[Event], object]


def callbacks(on_event: EventCallback | Iterable[EventCallback] | None) -> list[EventCallback]:
    """The `on_event=` argument of the manager and the run (none, one callable or several) as
    a list."""
    if on_event is None:
        return []
    if callable(on_event):
        return [on_event]
    listed = list(on_event) if isinstance(on_event, Iterable) else [on_event]
    for callback in listed:
        if not callable(callback):
            raise SafepointError(
                f"on_event={on_event!r}: pass a function taking an sp.Event, a list of them, "
                "or None")
    return listed


def emit(event: Event, callbacks: Iterable[EventCallback], *, log: bool = True) -> None:
    """Log `event` (unless the caller logs its own line) and pass it to every callback. A
    callback that raises is logged and skipped: watching must never break saving."""
    if log:
        level = logging.WARNING if event.kind == ERROR else logging.INFO
        logger.log(level, "%s", event.describe())
    for callback in callbacks:
        try:
            callback(event)
        except Exception:
            logger.exception("on_event callback %r failed on %s", callback, event.describe())
