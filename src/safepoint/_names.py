"""Checkpoint names from templates with Composer's placeholders (API layer):
`sp.format_name("s3://b/{run_name}/ep{epoch}-ba{step}", run_name="gpt", epoch=1, step=500)`.

Composer formats `save_folder` and `save_filename` with `{run_name}`, `{epoch}`, `{batch}`,
`{rank}` and more; this does the same for any URL given to `sp.save`, `sp.load` or a
`CheckpointManager` root, so names carry over unchanged (`{batch}` is another spelling of
`{step}`).
"""

from __future__ import annotations

import operator
import string
from collections.abc import Mapping
from typing import Any

from ._dist import group_for
from .errors import SafepointError

__all__ = ["as_step", "check_step", "format_name", "parse_step", "step_name"]

#: The placeholders `format_name` fills from its keyword arguments.
PLACEHOLDERS = ("step", "batch", "epoch", "rank", "run_name")


def format_name(
    template: str,
    *,
    step: int | None = None,
    epoch: int | None = None,
    rank: int | None = None,
    run_name: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """`template` with its placeholders filled: `{step}` (or `{batch}`), `{epoch}`, `{rank}`,
    `{run_name}`, and any name in `extra`. Format specs work as in `str.format`
    (`ba{step:06d}`); a placeholder the template does not use may be left out.

    Args:
        template: a path or URL with placeholders.
        step: the training step (batch) number.
        epoch: the epoch number.
        rank: the process's rank; by default the rank in torch.distributed's default group
            when it is initialised, else 0.
        run_name: the run's name.
        extra: more placeholders (`{"node": 3}` for `{node}`).

    Returns:
        the name.

    Raises:
        SafepointError: the template uses a placeholder that is unknown or has no value, or
            one that is not a plain name (`{step.real}`, `{a[0]}`), or is malformed.
    """
    values: dict[str, Any] = dict(extra or {})
    given = {"step": step, "batch": step, "epoch": epoch, "rank": rank, "run_name": run_name}
    values.update({name: value for name, value in given.items() if value is not None})
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise SafepointError(f"checkpoint name {template!r} is malformed: {exc}") from exc
    for field in (field for _, field, _, _ in parsed if field is not None):
        if not field.isidentifier():
            raise SafepointError(
                f"checkpoint name {template!r} has the placeholder {{{field}}}: use plain names "
                f"such as {{step}}, {{epoch}}, {{rank}}, {{run_name}}"
            )
        if field == "rank" and field not in values:
            values["rank"] = group_for(None, None).rank
        if field not in values:
            known = sorted({*PLACEHOLDERS, *values})
            raise SafepointError(
                f"checkpoint name {template!r} needs {{{field}}}: pass "
                + (f"{field}=" if field in PLACEHOLDERS else f"extra={{{field!r}: ...}}")
                + f" (placeholders: {', '.join(known)})"
            )
    try:
        return template.format(**values)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        # A field nested in a format spec ("{step:{width}}") is checked only here.
        raise SafepointError(f"cannot format checkpoint name {template!r}: {exc!r}; use "
                             "plain placeholders and format specs such as {step:07d}") from exc


#: A CheckpointManager's step directories under its root: `step-<n>`.
_STEP_PREFIX = "step-"


def as_step(step: object) -> int | None:
    """`step` as a manager step, a whole number 0 or more (an int, or NumPy's or torch's
    integers: a step picked with `np.argmin`) below `_STEP_LIMIT`, else None (a bool, "1",
    1.0, -1)."""
    if isinstance(step, bool) or str(getattr(step, "dtype", "")) == "torch.bool":
        return None
    try:
        whole = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        return None
    return whole if 0 <= whole < _STEP_LIMIT else None


#: The most digits of a step: `step-<step>` then fits the 255 bytes of a file name.
_STEP_DIGITS = 200
_STEP_LIMIT = 10**_STEP_DIGITS


def check_step(step: object) -> int:
    """`step` as a manager step (see `as_step`).

    Raises:
        SafepointError: naming the step.
    """
    whole = as_step(step)
    if whole is None:
        try:
            shown = repr(step)[:100]
        except ValueError:  # an int too long to write out
            bits = operator.index(step).bit_length()  # type: ignore[arg-type]
            shown = f"<an int of {bits} bits>"
        raise SafepointError(f"step={shown}: pass a whole number 0 or more, below "
                             f"10**{_STEP_DIGITS} (a step names a directory)")
    return whole


def step_name(step: int) -> str:
    """The directory of `step` under a manager's root: `step-<step>`, no zero padding."""
    return f"{_STEP_PREFIX}{step}"


def parse_step(name: str) -> int | None:
    """The step whose directory is `name`, or None for any other name."""
    digits = name.removeprefix(_STEP_PREFIX)
    if name.startswith(_STEP_PREFIX) and digits.isdecimal() and str(int(digits)) == digits:
        return int(digits)
    return None
