"""Which steps of a series to keep (engine layer, pure: no I/O, so the manager and the
`safepoint gc` command share it and tests call it directly).

Rules combine: a step is kept when any rule keeps it, and the newest step is always kept, so
retention never removes the newest committed checkpoint; nor the one saved last, which is
not the newest when a run rolled back to an earlier step and saved again.

"Saved" times are when `save` was called, not when the step committed: a save made from a
signal handler that interrupted another save commits first, yet holds the later state.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import SafepointError

__all__ = ["Policy", "StepRecord", "finite_number", "keep_reasons", "restore_order"]

LATEST = "latest"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What retention knows of a committed step.

    Attributes:
        step: the step number.
        saved: when its `save` was called, in seconds since the epoch (when it was
            committed, for a step whose manifest does not record the call).
        metrics: the metrics saved with it.
    """

    step: int
    saved: float
    metrics: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Policy:
    """A retention policy.

    Attributes:
        keep_last: keep the newest N steps (None: all).
        keep_every: also keep, forever, every step divisible by K.
        keep_every_seconds: also keep, forever, one step per this many seconds: the first
            step, then each step saved at least this long after the last one so kept.
        keep_best: also keep the N best steps by `best_metric`; steps without a finite
            number for it are never best.
        best_metric: the metric `keep_best` ranks by.
        best_mode: "min" (lower is better) or "max".
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_every_seconds: float | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        """Check every option; NumPy (or other) numbers become Python ones, since the
        policy is recorded as JSON in each step's manifest."""
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral)
                                      or isinstance(value, bool)
                                      or value < (1 if name == "keep_every" else 0)):
                raise SafepointError(
                    f"{name}={value!r} is not a valid count: pass a whole number "
                    f"{'above 0' if name == 'keep_every' else '0 or more'}, or None"
                )
            if value is not None:
                object.__setattr__(self, name, int(value))
        seconds = self.keep_every_seconds
        if seconds is not None:
            if (finite_number(seconds) or 0) <= 0:
                raise SafepointError(
                    f"keep_every_seconds={self.keep_every_seconds!r}: pass a positive number "
                    "of seconds, or None"
                )
            plain = int(seconds) if isinstance(seconds, numbers.Integral) else float(seconds)
            object.__setattr__(self, "keep_every_seconds", plain)
        if self.best_metric is not None and (not isinstance(self.best_metric, str)
                                             or not self.best_metric):
            raise SafepointError(
                f"best_metric={self.best_metric!r} is not a metric's name: pass the name (a "
                "non-empty str) of one of the metrics= passed to save, or None"
            )
        if self.best_mode not in ("min", "max"):
            raise SafepointError(f"best_mode={self.best_mode!r}: pass 'min' or 'max'")
        if self.keep_best and not self.best_metric:
            raise SafepointError(
                "keep_best needs best_metric: name the metric to rank steps by "
                "(one of the metrics= passed to save)"
            )


def finite_number(value: object) -> float | None:
    """`value` as a finite float, or None: not a number (a bool, a str), NaN or infinite,
    or an int beyond any float (it would overflow the arithmetic of every commit's
    retention, as a metric or as `keep_every_seconds`, or a run's `every_seconds`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _metric(record: StepRecord, name: str) -> float | None:
    return finite_number(record.metrics.get(name))


def keep_reasons(records: Sequence[StepRecord], policy: Policy) -> dict[int, list[str]]:
    """Why each kept step is kept: step -> reasons ("latest", "last", "every", "time",
    "best"). Steps absent from the result may be deleted."""
    ordered = sorted(records, key=lambda r: r.step)
    reasons: dict[int, list[str]] = {}

    def keep(step: int, reason: str) -> None:
        reasons.setdefault(step, []).append(reason)

    if not ordered:
        return reasons
    keep(ordered[-1].step, LATEST)
    # The step saved last, as `restore_order` picks it (a tie goes to the higher step): the
    # head of a run that rolled back.
    last = max(ordered, key=lambda r: (r.saved, r.step))
    if last.step != ordered[-1].step:
        keep(last.step, LATEST)
    if policy.keep_last is None:
        for record in ordered:
            keep(record.step, "last")
    elif policy.keep_last:
        for record in ordered[-policy.keep_last :]:
            keep(record.step, "last")
    if policy.keep_every:
        for record in ordered:
            if record.step % policy.keep_every == 0:
                keep(record.step, "every")
    if policy.keep_every_seconds:
        # In the order saved: a step saved after a rollback, numbered below steps this rule
        # kept, must not take their place (they are kept for good).
        anchor: float | None = None
        for record in sorted(ordered, key=lambda r: (r.saved, r.step)):
            if anchor is None or record.saved >= anchor + policy.keep_every_seconds:
                keep(record.step, "time")
                anchor = record.saved
    if policy.keep_best and policy.best_metric:
        scored = [(m, r.step) for r in ordered
                  if (m := _metric(r, policy.best_metric)) is not None]
        # Best first; among equal scores the newer step wins.
        scored.sort(key=lambda s: (s[0] if policy.best_mode == "min" else -s[0], -s[1]))
        for _, step in scored[: policy.keep_best]:
            keep(step, "best")
    return {step: reasons[step] for step in sorted(reasons)}


def restore_order(
    steps: Sequence[int], saved: Mapping[int, float], parents: Mapping[int, int] | None = None,
) -> tuple[list[int], list[int]]:
    """The committed `steps` in the order a restore tries them, and the steps it passes over.

    The first is the step saved last (by `saved`, known for the steps whose manifest could be
    read): the head. From each step a restore falls back to its parent (`parents`: the step
    the run had restored or saved last when it saved this one) when that is committed,
    numbered below it and saved before it. Otherwise (no parent recorded, the parent gone,
    or numbered above it: a rollback the manager did not see, such as an `sp.load` of an
    older step) it falls back to the step saved last before it among those numbered below
    it (or below the missing parent): a step numbered above a step saved after it is
    abandoned, since the run rolled back to an earlier step and saved again, and resuming
    from the abandoned step, or falling back to it, would undo the rollback. Steps off that
    path are passed over, however far the new branch is numbered past them.

    A step with no time (its manifest is unreadable) is placed by its number, best effort: it
    is passed over when it is numbered above the head and the head is not the highest step
    with a time (it most likely belongs to an abandoned branch), and tried in step order
    otherwise (a restore reports it and falls back when it fails). Reached as a parent, it
    is tried in its place on the path.
    """
    ordered = sorted(steps, reverse=True)
    known = sorted((s for s in ordered if s in saved),
                   key=lambda step: (saved[step], step), reverse=True)
    if not known:
        return ordered, []
    parents = parents or {}
    committed = set(ordered)
    head = known[0]
    path, on_path = [head], {head}
    when = (saved[head], head)  # the time of the last step on the path that has one
    # known[:scan] can never come next: saved at or after `when`, on the path, or numbered
    # at or above a bound (the path's numbers fall, and its bounds with them).
    scan = 1
    while True:
        here = path[-1]
        parent = parents.get(here, here)
        bound = min(parent, here)  # a parent numbered above is not followed (see above)
        if (bound < here and parent in committed and parent not in on_path
                and (parent not in saved or (saved[parent], parent) < when)):
            step = parent
        else:
            while scan < len(known) and (known[scan] >= bound or known[scan] in on_path):
                scan += 1
            if scan == len(known):
                break
            step = known[scan]
        path.append(step)
        on_path.add(step)
        if step in saved:
            when = (saved[step], step)
            while scan < len(known) and (saved[known[scan]], known[scan]) >= when:
                scan += 1
    rolled_back = head != max(known)
    untimed = {s for s in ordered if s not in saved and s not in on_path
               and not (rolled_back and s > head)}
    tried = sorted(on_path | untimed, reverse=True)  # the path's numbers fall: a merge
    return tried, [s for s in ordered if s not in on_path and s not in untimed]
