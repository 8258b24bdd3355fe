"""The `safepoint` command: list, inspect and verify checkpoints from a shell (integrations and
CLI layer). It never imports torch, so it runs on login nodes and CI runners without CUDA
wheels; it is the only part of safepoint that prints.

Exit status: 0 when all is well, 1 when a problem was found (corruption, nothing committed
where asked), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import codecs
import io
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any

import safepoint as sp

from ._commit import written_files
from ._copy import linked_checkpoints
from ._format import MANIFEST, encode_value
from ._manager import examine
from ._names import parse_step, step_name
from ._retention import Policy, keep_reasons
from ._tree import select
from .errors import CheckpointNotFound, SafepointError, StorageError
from .storage import children, open_storage

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = ["main"]

OK = 0
PROBLEM = 1
USAGE = 2
#: A shell's status for a command whose output pipe closed (128 + SIGPIPE).
PIPE_CLOSED = 141
#: A shell's status for a command stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED = 130

#: Longest rendering of a plain value in the `info` table before it is cut.
_VALUE_WIDTH = 40


def _human_bytes(nbytes: float) -> str:
    """`nbytes` in binary units: "512 B", "1.5 KiB", "3.0 GiB". A unit is chosen by the
    number as printed, rounded, so 1048575 bytes are "1.0 MiB", never "1024.0 KiB"."""
    if nbytes < 1023.5:  # 1023.5 prints as "1024" (round half to even)
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if round(nbytes, 1) < 1024 or unit == "TiB":  # round() as the format rounds
            break
    return f"{nbytes:.1f} {unit}"


def _shown(text: str) -> str:
    """`text` as the human-readable output shows it: each control or other non-printable
    character as its Python escape (`\\x1b`, `\\n`), as repr writes it, so that an entry path
    or a directory's name from a checkpoint cannot move the cursor, recolour the terminal or
    forge an output line; printable characters of any script stay as they are. A surrogate
    standing for a byte of a path that is not UTF-8 stays too, for stdout's error handler
    (`_escape`) to write as that byte. --json needs none of this: JSON escapes them."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() or "\udc80" <= char <= "\udcff"
                   else repr(char)[1:-1] for char in text)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Rows as aligned columns under `header`; columns whose index is in `right` are
    right-aligned (numbers), the others left-aligned. Every cell is `_shown`."""
    header = [_shown(cell) for cell in header]
    rows = [[_shown(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = (
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        return "  ".join(cells).rstrip()

    return "\n".join(line(row) for row in [header, *rows])


def _natural(name: str) -> list[Any]:
    """Sort key putting "step_20" before "step_100"."""
    # isdecimal, not isdigit: "²" is a digit that int() refuses, and \d matches only decimals.
    return [int(part) if part.isdecimal() else part for part in re.split(r"(\d+)", name)]


def _child(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def _error(message: object) -> None:
    """Print one error line on stderr; a name in `message` is `_shown`, so it stays one line."""
    print(f"safepoint: error: {_shown(str(message))}", file=sys.stderr)


#: The codec error handler stdout writes with while the command runs (see `_escape`).
_ESCAPE = "safepoint.cli.escape"


def _escape(exc: UnicodeError) -> tuple[str | bytes, int]:
    """Write what stdout's encoding cannot spell: a path that is not UTF-8 (os.fsdecode's
    surrogates) as the bytes it is, any other character (a snowman key on an ASCII or
    Latin-1 stdout) as its backslash escape, so the output goes on instead of crashing."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    char = exc.object[exc.start]
    if "\udc80" <= char <= "\udcff":
        return bytes([ord(char) - 0xDC00]), exc.start + 1
    return char.encode("ascii", "backslashreplace").decode("ascii"), exc.start + 1


codecs.register_error(_ESCAPE, _escape)


class _OutputFailed(SafepointError):
    """Stdout refused a write other than by closing (a full disk): `main` says so in one
    line and exits 1."""


@contextmanager
def _writing_output() -> Iterator[None]:
    """Turn a write to stdout that failed other than by a closed pipe (a full disk) into
    `_OutputFailed`; a closed pipe's BrokenPipeError goes through, for `main` to stop quietly.
    """
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _OutputFailed(f"cannot write output: {exc}; free space where it goes, or send "
                            "it elsewhere") from exc


def _say(text: str = "") -> None:
    """Print one line of the command's output (nothing when stdout is closed)."""
    with _writing_output():
        print(text)


def _discard_output() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's flush at exit
    does not fail again on what is still buffered."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _print_json(value: Any) -> None:
    """Strict JSON: a non-finite float (a stored `inf` loss) is printed as the manifest spells
    it, {"float": "inf"} (or "-inf", "nan", and a NaN of another sign or payload with its
    "bits"), which every JSON parser reads and no str value can be taken for."""
    try:  # most values hold no non-finite float: print them without walking them first
        text = json.dumps(value, indent=2, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(value), indent=2, allow_nan=False)
    _say(text)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return encode_value(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


@dataclass(frozen=True, slots=True)
class _Listing:
    """What `ls` found at or directly under a URL.

    Attributes:
        found: (name, info) of each committed checkpoint, in natural name order; under a
            manager root, those beside its steps.
        uncommitted: (name, leftover file count) of each directory holding an uncommitted save;
            the name is the URL itself when that is where the save crashed.
        stray: (name, file count) of each committed step, or of the checkpoint at the URL,
            that also holds files its manifest does not reference (a killed or failed
            overwrite's data).
        unreadable: (name, error) of each checkpoint whose manifest could not be read.
        steps: the committed `step-<n>` checkpoints of a CheckpointManager root, not read here
            (`ls` shows them in a step table).
        links: of the names in `found`, those of links to a checkpoint (Lightning's
            `last.ckpt` with `save_last="link"`) -> where they point.
        skipped: (name, error) of each directory that could not be looked into (listed, or
            its manifest read for want of permission: another user's private folder): not a
            problem of the checkpoints shown.
    """

    found: list[tuple[str, sp.CheckpointInfo]] = field(default_factory=list)
    uncommitted: list[tuple[str, int]] = field(default_factory=list)
    stray: list[tuple[str, int]] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _scan(url: str, options: dict[str, Any] | None = None) -> _Listing:
    """The checkpoint at `url`, or else the leftovers of a save that crashed there and the
    checkpoints and leftovers directly under it. Nothing deeper is listed, so a large tree
    below, or a directory below that cannot be listed, costs and fails nothing; a directory
    directly under `url` that cannot be looked into (listed, or its manifest read for want
    of permission) is named in `skipped`.

    Raises:
        SafepointError: `url` holds a manifest that cannot be read, or listing it failed.
    """
    listing = _Listing()
    try:
        described, stale = examine(url, options)
    except CheckpointNotFound:
        pass
    else:
        listing.found.append((url, described))
        if stale:
            listing.stray.append((url, len(stale)))
        return listing
    storage = open_storage(url, options)
    try:
        try:
            directories = children(storage)[1]
            own = len(written_files(storage))
        except FileNotFoundError:
            directories, own = [], 0
        if own:
            listing.uncommitted.append((url, own))
        looked = set()  # step directories: committed steps, and those that cannot be read
        for name in directories:
            step = parse_step(name)
            if step is None:
                continue
            try:
                if storage.exists(f"{step_name(step)}/{MANIFEST}"):
                    listing.steps.append(step)
                    looked.add(name)
            except StorageError as exc:
                _cannot_look(listing, name, exc)
                looked.add(name)
        listing.steps.sort()
        listing.links.update(linked_checkpoints(storage))
        for name in sorted((set(directories) - looked) | listing.links.keys(), key=_natural):
            try:
                listing.found.append((name, sp.info(_child(url, name), storage_options=options)))
            except CheckpointNotFound:
                try:
                    # A step directory without a manifest is a manager's leftover whole, as
                    # `gc` (the manager's) removes it; elsewhere only the files a save writes.
                    orphans = len(storage.list(name) if parse_step(name) is not None
                                  else written_files(storage, name))
                except FileNotFoundError:
                    continue  # removed since it was listed
                except StorageError as exc:
                    listing.skipped.append((name, str(exc)))
                    continue
                if orphans:
                    listing.uncommitted.append((name, orphans))
            except StorageError as exc:
                _cannot_look(listing, name, exc)
            except SafepointError as exc:
                listing.unreadable.append((name, str(exc)))
    finally:
        storage.close()
    return listing


def _cannot_look(listing: _Listing, name: str, exc: StorageError) -> None:
    """Note the directory `name` that could not be read: skipped when it is another user's
    private folder (nothing to say whether it is a checkpoint), else unreadable."""
    denied = isinstance(exc.__cause__, PermissionError)
    (listing.skipped if denied else listing.unreadable).append((name, str(exc)))


def _checkpoints_json(listing: _Listing) -> list[dict[str, Any]]:
    return [{"name": name, "url": ckpt.url, "created": ckpt.created,
             "entries": len(ckpt.entries), "nbytes": ckpt.nbytes,
             **({"link": listing.links[name]} if name in listing.links else {})}
            for name, ckpt in listing.found]


def _counts_json(named: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """`_Listing.uncommitted` or `.stray` as --json gives them."""
    return [{"name": name, "files": n} for name, n in named]


def _errors_json(named: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """`_Listing.unreadable` or `.skipped` as --json gives them."""
    return [{"name": name, "error": error} for name, error in named]


def _warn_skipped(listing: _Listing) -> None:
    """Name on stderr each directory `ls` could not look into; not a problem (exit status)."""
    for name, error in listing.skipped:
        print(f"safepoint: warning: skipped {_shown(name)}: it cannot be looked into (listed, "
              f"or its manifest read), so it is not shown, nor its leftovers counted: "
              f"{_shown(error)}", file=sys.stderr)


def _checkpoints_table(listing: _Listing) -> str:
    rows = [[f"{name} -> {listing.links[name]}" if name in listing.links else name,
             ckpt.created, str(len(ckpt.entries)), _human_bytes(ckpt.nbytes)]
            for name, ckpt in listing.found]
    return _table(["NAME", "CREATED", "ENTRIES", "SIZE"], rows, right=(2, 3))


def _leftovers_note(listing: _Listing) -> str:
    lines = []
    if listing.uncommitted:
        names = ", ".join(_shown(name) for name, _ in listing.uncommitted)
        lines.append(f"note: {len(listing.uncommitted)} uncommitted leftover(s), directories "
                     f"without a manifest (a crashed save's, or a save still in progress): "
                     f"{names}")
    if listing.stray:
        names = ", ".join(f"{_shown(name)} ({n})" for name, n in listing.stray)
        lines.append(
            f"note: committed step(s) holding files of a save that never committed "
            f"(`safepoint gc` removes them; the steps stay): {names}" if listing.steps else
            f"note: committed checkpoint holding files of a save that never committed (a "
            f"save over it with overwrite removes them; the checkpoint stays): {names}")
    return "\n".join(lines)


def ls(args: argparse.Namespace) -> int:
    """`safepoint ls DIR`: the committed checkpoints at or directly under DIR; for a manager
    root, a table of its steps (and a table of any other checkpoints beside them).

    A directory without a manifest but with data of a save (DIR itself, or one under it) is an
    uncommitted leftover: it is named in a note, never listed as a checkpoint.

    A committed checkpoint DIR that also holds files its manifest does not reference (a
    killed or failed overwrite's data, an S3 upload it never completed) is listed, and named
    with their count in a note (in --json, under "stray"), as a manager root's steps are.

    Nothing deeper than DIR's own directories (and their `data/`) is listed; one of them
    that cannot be looked into (another user's private folder) is named in a warning (in
    --json, under "skipped") and changes no exit status.

    Returns:
        0 when at least one checkpoint was listed and every manifest was readable, else 1.

    Raises:
        SafepointError: DIR holds a manifest that cannot be read, or listing DIR failed.
    """
    listing = _scan(args.dir, args.storage_options)
    if listing.steps:
        return _ls_steps(args, listing)
    if args.json:
        _print_json({
            "url": args.dir,
            "checkpoints": _checkpoints_json(listing),
            "uncommitted": _counts_json(listing.uncommitted),
            "stray": _counts_json(listing.stray),
            "unreadable": _errors_json(listing.unreadable),
            "skipped": _errors_json(listing.skipped),
        })
    else:
        if listing.found:
            _say(_checkpoints_table(listing))
        if listing.uncommitted or listing.stray:
            _say(_leftovers_note(listing))
    _warn_skipped(listing)
    for name, error in listing.unreadable:
        _error(f"{name}: {error}")
    if not listing.found and not listing.unreadable:
        if listing.uncommitted:
            _error(f"no committed checkpoint at or directly under {args.dir}, only leftovers "
                   "of saves that never committed: a save to a leftover's path replaces its "
                   "files, or delete them")
        else:
            _error(f"no committed checkpoint at or directly under {args.dir}: check the path")
    return OK if listing.found and not listing.unreadable else PROBLEM


def _metrics_text(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in metrics.items()) or "-"


def _ls_steps(args: argparse.Namespace, listing: _Listing) -> int:
    """`safepoint ls ROOT` for a manager root: one row per committed step, with why the
    retention policy recorded by the newest readable step keeps it; then the other checkpoints
    under ROOT and a note naming uncommitted leftovers, as for any directory."""
    steps: list[sp.StepInfo] = []
    problems: list[dict[str, Any]] = []
    with sp.CheckpointManager(args.dir, storage_options=args.storage_options) as manager:
        for step in listing.steps:
            try:
                described, stale = manager._examine(step)
            except CheckpointNotFound:
                continue  # removed since it was listed: the writer's retention, not a problem
            except SafepointError as exc:
                problems.append({"name": step_name(step), "step": step, "error": str(exc)})
                continue
            steps.append(described)
            if stale:  # what gc removes: a killed overwrite's data beside a committed step
                listing.stray.append((step_name(step), len(stale)))
    problems += _errors_json(listing.unreadable)
    policy = steps[-1].policy if steps else None
    kept = keep_reasons([s.record() for s in steps], policy) if policy else {}
    if args.json:
        _print_json({
            "url": args.dir,
            "steps": [{"step": s.step, "url": _child(args.dir, step_name(s.step)),
                       "created": s.created, "nbytes": s.nbytes,
                       "metrics": s.metrics, "kept": kept.get(s.step, [])} for s in steps],
            "checkpoints": _checkpoints_json(listing),
            "uncommitted": _counts_json(listing.uncommitted),
            "stray": _counts_json(listing.stray),
            "unreadable": problems,
            "skipped": _errors_json(listing.skipped),
        })
    else:
        rows = [[str(s.step), s.created, _human_bytes(s.nbytes), _metrics_text(s.metrics),
                 ", ".join(kept.get(s.step, [])) or ("-" if policy else "?")] for s in steps]
        _say(_table(["STEP", "TIME", "SIZE", "METRICS", "KEPT BECAUSE"], rows, right=(0, 2)))
        if listing.found:
            _say()
            _say(_checkpoints_table(listing))
        if listing.uncommitted or listing.stray:
            _say(_leftovers_note(listing))
    _warn_skipped(listing)
    for problem in problems:
        _error(f"{problem['name']}: {problem['error']}")
    return PROBLEM if problems else OK


def _recorded_metrics(reader: sp.CheckpointManager, steps: Sequence[int]) -> set[str] | None:
    """The names of the metrics any readable step of `steps` records, or None when no step
    can be read (gc then has nothing to rank, so nothing to check a metric against)."""
    names: set[str] = set()
    readable = False
    for step in steps:
        try:
            names.update(reader.metadata(step).metrics)
        except SafepointError:
            continue  # damaged, or deleted since it was listed: gc names the damaged ones
        readable = True
    return names if readable else None


def _unknown_metric(args: argparse.Namespace, metric: str, recorded: set[str]) -> str:
    """Why gc refuses to rank steps by `metric`, which no step records: no step would be kept
    as best, so retention would delete the best steps."""
    given = (f"--best-metric {metric!r}:" if args.best_metric else
             f"--keep-best ranks by {metric!r}, the best_metric the newest step recorded, but")
    if recorded:
        known = ", ".join(repr(name) for name in sorted(recorded))
        fix = f"the steps record {known}: pass one of those as --best-metric"
    else:
        fix = "the steps record no metrics: pass --keep-best 0"
    return (f"{given} no committed step under {args.root} records that metric, so no step "
            f"would be kept as best; {fix} (gc deleted nothing)")


def gc(args: argparse.Namespace) -> int:
    """`safepoint gc ROOT`: remove leftovers of crashed saves under a manager root and apply a
    retention policy: the one given by flags, over the one the newest readable step recorded
    (with neither, every committed step is kept). Takes the root's writer lease.

    Returns:
        0, or 1 when a step's manifest cannot be read (gc leaves such a step in place and
        names it), or 2 when the flags are refused, with nothing deleted: an invalid policy,
        or a --keep-best metric that no readable step records (a typo would leave no step
        kept as best).

    Raises:
        LeaseHeld: a job is writing the root.
    """
    storage = open_storage(args.root, args.storage_options)
    try:
        if storage.exists(MANIFEST):
            _error(f"{args.root} is one checkpoint, not a manager root of step-N checkpoints: "
                   "gc works on roots (remove a single checkpoint with your file tools)")
            return PROBLEM
        try:
            files = storage.list("")
        except FileNotFoundError:
            files = []
    finally:
        storage.close()
    if not files:
        _error(f"nothing under {args.root}: check the path (gc creates nothing)")
        return PROBLEM
    if not any(sep and parse_step(top) is not None
               for top, sep, _ in (name.partition("/") for name in files)):
        _error(f"{args.root} holds no step-N directories, so it is not a manager root: gc "
               "works on roots (the leftovers of a single checkpoint's crashed save go with "
               "the next save to it, or delete them with your file tools)")
        return PROBLEM
    with sp.CheckpointManager(args.root, storage_options=args.storage_options) as reader:
        steps = reader.steps()
        damaged: dict[int, str] = {}
        recorded: Policy | None = None
        for step in reversed(steps):  # the policy the newest readable step recorded
            try:
                recorded = reader.metadata(step).policy
                break
            except SafepointError as exc:
                damaged[step] = str(exc)
        fields = asdict(recorded) if recorded is not None else {"keep_last": None}
        for name in ("keep_last", "keep_every", "keep_every_seconds", "keep_best",
                     "best_metric", "best_mode"):
            if getattr(args, name) is not None:
                fields[name] = getattr(args, name)
        try:
            Policy(**fields)
        except SafepointError as exc:  # a flag, or a flag with the recorded policy
            _error(f"{exc} (gc's --keep-* and --best-* flags)")
            return USAGE
        metric = fields.get("best_metric")
        if metric and fields.get("keep_best") and (args.best_metric or args.keep_best):
            recorded_metrics = _recorded_metrics(reader, steps)
            if recorded_metrics is not None and metric not in recorded_metrics:
                _error(_unknown_metric(args, metric, recorded_metrics))
                return USAGE
        with sp.CheckpointManager(args.root, storage_options=args.storage_options,
                                  async_save=False, **fields) as writer:
            report = writer.gc(dry_run=args.dry_run)
        # Retention neither keeps nor deletes a step whose manifest it cannot read.
        unreadable: dict[int, str] = {}
        for step in steps:
            if step in report.kept or step in report.deleted_steps:
                continue
            if step in damaged:
                unreadable[step] = damaged[step]
                continue
            try:
                reader.metadata(step)
            except CheckpointNotFound:
                pass  # deleted since it was listed
            except SafepointError as exc:
                unreadable[step] = str(exc)
    if args.json:
        _print_json({"url": args.root, "dry_run": args.dry_run, **asdict(report),
                     "unreadable": [{"step": step, "error": error}
                                    for step, error in unreadable.items()]})
        return PROBLEM if unreadable else OK
    verb = "would delete" if args.dry_run else "deleted"
    for step in report.deleted_steps:
        _say(f"{verb} step {step}")
    for step, files in report.leftovers.items():
        _say(f"{verb} leftover step-{step} ({len(files)} file(s) of a save that never "
              "committed)")
    for step, why in report.kept.items():
        _say(f"kept step {step}: {', '.join(why)}")
    for step, error in unreadable.items():
        _error(f"step {step} is unreadable, so gc left it in place (check it with `safepoint "
               f"verify {_child(args.root, step_name(step))}`; delete the directory with your "
               f"file tools if it cannot be repaired): {error}")
    return PROBLEM if unreadable else OK


def _shape(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(map(str, shape)) + ")"


def _value(entry: sp.EntryInfo) -> str:
    """The VALUE cell of `info`: a plain value (cut to fit), or the entry an alias is stored
    under (never cut)."""
    if entry.kind == "alias":
        return f"same as {entry.value}"
    if entry.kind != "value":
        return ""
    text = repr(entry.value)
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 3] + "..."


def info(args: argparse.Namespace) -> int:
    """`safepoint info CKPT`: a summary of the checkpoint and a table of its entries, from the
    manifest alone (no data is read).

    Returns:
        0, or 1 when `--keys` selects nothing.

    Raises:
        SafepointError: nothing committed at CKPT, or its manifest is damaged.
    """
    summary = sp.info(args.ckpt, storage_options=args.storage_options)
    by_path = {entry.path: entry for entry in summary.entries}
    entries = [by_path[path] for path in select(by_path, args.keys)]
    if args.keys is not None and not entries:
        _error(f"--keys {' '.join(args.keys)} match nothing in {args.ckpt}: use path prefixes "
               "like 'model/' or globs like 'model/*.weight'")
        return PROBLEM
    shown = entries if args.limit is None else entries[: args.limit]

    if args.json:
        # Not asdict(summary): it deep-copies the metadata, which is plain JSON already (the
        # manifest decoded it) and may nest deeper than asdict's recursion reaches.
        described = {f.name: getattr(summary, f.name) for f in dataclass_fields(summary)}
        described["entries"] = [asdict(entry) for entry in shown]
        described["entries_left_out"] = len(entries) - len(shown)  # by --limit
        try:
            _print_json(described)
        except RecursionError:
            raise SafepointError(
                f"the metadata of {args.ckpt} nests too deeply to print as JSON; run "
                "`safepoint info` without --json to see it"
            ) from None
        return OK
    written_by = f"safepoint {summary.library_version}, torch {summary.torch_version or 'absent'}"
    fields = [
        ("url", summary.url),
        ("created", summary.created),
        ("save id", summary.save_id),
        ("format version", str(summary.format_version)),
        ("written by", written_by),
        ("world size", str(summary.world_size)),
        ("size", f"{_human_bytes(summary.nbytes)} ({summary.nbytes} bytes) in "
                 f"{summary.files} data file(s)"),
        ("entries", str(len(summary.entries))),
        ("metadata", json.dumps(summary.metadata, sort_keys=True)),
    ]
    for label, text in fields:
        _say(f"{label + ':':<16}{_shown(text)}")
    _say()
    rows = [
        [e.path, e.kind, (e.dtype or "-") + (" big-endian" if e.big_endian else ""),
         _shape(e.shape), "-" if e.kind == "value" else _human_bytes(e.nbytes), _value(e)]
        for e in shown
    ]
    _say(_table(["PATH", "KIND", "DTYPE", "SHAPE", "SIZE", "VALUE"], rows, right=(4,)))
    if len(shown) < len(entries):
        _say(f"... {len(entries) - len(shown)} more (raise --limit to see them)")
    return OK


def verify(args: argparse.Namespace) -> int:
    """`safepoint verify CKPT [CKPT...]`: read every byte of each checkpoint and check it
    against its checksums.

    Returns:
        0 when every checkpoint is committed and intact, else 1.
    """
    reports: list[sp.VerifyReport] = []
    for url in args.ckpt:
        with _Progress(f"verifying {url}") as progress:
            try:
                report = sp.verify(url, storage_options=args.storage_options, progress=progress)
            except SafepointError as exc:
                report = sp.VerifyReport(url, False, [str(exc)])
        reports.append(report)
        if args.json:
            continue
        if report.ok:
            rate = _human_bytes(report.nbytes / max(report.seconds, 1e-9))
            _say(f"OK      {_shown(url)}: {_human_bytes(report.nbytes)} in {report.seconds:.2f} s "
                  f"({rate}/s)")
        else:
            _say(f"FAILED  {_shown(url)}: {len(report.problems)} problem(s)")
            for problem in report.problems:
                _say(f"  {_shown(problem)}")
    if args.json:
        _print_json({"ok": all(r.ok for r in reports), "reports": [asdict(r) for r in reports]})
    return OK if all(report.ok for report in reports) else PROBLEM


#: How `diff` marks each kind of change.
_DIFF_MARKS = {"added": "+", "removed": "-"}


def _diff_detail(change: sp.EntryDiff) -> str:
    if change.change == "added":
        return str(change.b)
    if change.change == "removed":
        return str(change.a)
    if change.change != "data":
        return f"{change.a} -> {change.b}"
    if change.changed_fraction is None:
        return f"{change.a}: bytes differ"
    gap = "" if change.max_abs_diff is None else f"max |a-b| {change.max_abs_diff:.4g}, "
    return (f"{change.a}: {gap}{change.changed_fraction:.2%} of {change.elements} elements "
            "changed")


def diff(args: argparse.Namespace) -> int:
    """`safepoint diff A B`: the entries added, removed or changed from checkpoint A to B, and
    for data that differs, the largest absolute difference and the fraction of elements changed.

    Returns:
        0 when the checkpoints are identical (in the entries `--keys` selects), else 1.

    Raises:
        SafepointError: nothing committed at A or B, or one is damaged.
    """
    report = sp.diff(args.a, args.b, keys=args.keys, storage_options=args.storage_options)
    if args.json:
        _print_json({
            "a": report.a, "b": report.b, "identical": report.identical,
            "compared": report.compared,
            # A change to or from NaN or inf is reported as {"float": "inf"}.
            "differences": [asdict(d) for d in report.differences],
        })
    elif report.identical:
        _say(f"identical: {report.compared} entries")
    else:
        rows = [[_DIFF_MARKS.get(d.change, "~"), d.path, d.change, _diff_detail(d)]
                for d in report.differences]
        _say(_table(["", "PATH", "CHANGE", "DETAIL"], rows))
        moved = sum(d.change == "structure" for d in report.differences)
        _say(f"{len(report.differences) - moved} of {report.compared} entries differ"
              + (f", and the structure at {moved} path{'s' * (moved > 1)}" if moved else ""))
    return OK if report.identical else PROBLEM


def export(args: argparse.Namespace) -> int:
    """`safepoint export CKPT OUT`: write a checkpoint (or the part `--keys` selects) as a
    `torch.save` file (`.pt`, `.pth`, `.bin`, `.ckpt`) or a `.safetensors` file, or the whole
    checkpoint as an archive (`.tar`, `.tar.gz`, `.tar.bz2`, `.tar.xz`).

    Returns:
        0 when the file was written.

    Raises:
        SafepointError: nothing committed at CKPT, the selection is empty, or the format cannot
            hold what was selected.
    """
    report = sp.export_checkpoint(args.ckpt, args.out, keys=args.keys,
                                  strip_prefix=args.strip_prefix, allow_pickle=args.allow_pickle,
                                  storage_options=args.storage_options)
    if args.json:
        _print_json(asdict(report))
    else:
        _say(f"exported {len(report.paths)} entries of {_shown(args.ckpt)} to "
             f"{_shown(report.out)} ({_human_bytes(report.nbytes)})")
    return OK


def import_(args: argparse.Namespace) -> int:
    """`safepoint import IN CKPT`: save a `torch.save` or `.safetensors` file as a checkpoint,
    or commit the checkpoint an archive holds. A torch file is read with
    `torch.load(weights_only=True)` unless `--allow-pickle`.

    Returns:
        0 when the checkpoint was committed.

    Raises:
        SafepointError: the file is missing, unreadable, needs pickle without `--allow-pickle`,
            or CKPT holds a checkpoint and `--overwrite` was not given.
    """
    committed = sp.import_checkpoint(args.src, args.ckpt, allow_pickle=args.allow_pickle,
                                     overwrite=args.overwrite,
                                     storage_options=args.storage_options)
    if args.json:
        _print_json(asdict(committed))
    else:
        _say(f"imported {_shown(args.src)} into {_shown(committed.url)}: "
             f"{len(committed.entries)} entries, {_human_bytes(committed.nbytes)}")
    return OK


class _Progress:
    """A one-line progress display on stderr (bytes, rate, ETA), redrawn at most every
    `interval_s`; nothing at all when stderr is not a terminal.

    Used as a context manager: leaving it ends a line drawn and not yet ended (the work
    failed or stopped before 100%), so that what is printed next starts a line of its own
    instead of being glued to the progress line.
    """

    def __init__(self, label: str, interval_s: float = 0.2) -> None:
        self.label = _shown(label)
        self.enabled = sys.stderr.isatty()
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.drawn = 0.0
        self.open = False  # a line is drawn and not yet ended

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.end()

    def end(self) -> None:
        """End the progress line, if one is drawn and not yet ended."""
        if self.open:
            self.open = False
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.drawn < self.interval_s and done < total):
            return
        self.drawn = now
        elapsed = max(now - self.started, 1e-9)
        rate = done / elapsed
        eta = f"{(total - done) / rate:.0f} s" if rate > 0 and done < total else "-"
        percent = 100 * done / total if total else 100.0
        sys.stderr.write(
            f"\r{self.label}: {_human_bytes(done)} / {_human_bytes(total)} ({percent:.0f}%), "
            f"{_human_bytes(rate)}/s, ETA {eta}\x1b[K"
        )
        self.open = True
        if done >= total:
            self.end()
        else:
            sys.stderr.flush()


def cp(args: argparse.Namespace) -> int:
    """`safepoint cp SRC DST`: copy a checkpoint, or every checkpoint under a root, between any
    two URLs, verifying every block on the way; each manifest is published last.

    Returns:
        0 when everything was copied (or already there), or removed from SRC while it was
        copied (named in a note).

    Raises:
        SafepointError: nothing committed at SRC, a different checkpoint at DST without
            --overwrite, corrupt source data, or a storage failure.
    """
    dst_options = args.dst_storage_options
    with _Progress(f"copying {args.src}") as progress:
        report = sp.copy(
            args.src, args.dst, overwrite=args.overwrite, storage_options=args.storage_options,
            dst_storage_options=args.storage_options if dst_options is None else dst_options,
            progress=progress,
        )
    if args.json:
        _print_json(asdict(report))
        return OK
    rate = _human_bytes(report.nbytes / max(report.seconds, 1e-9))
    _say(f"copied {len(report.copied)} checkpoint(s) from {_shown(args.src)} to "
         f"{_shown(args.dst)}: {_human_bytes(report.nbytes)} in {report.seconds:.2f} s "
         f"({rate}/s)" + (f"; {len(report.skipped)} already there" if report.skipped else ""))
    if report.vanished:
        _say(f"note: {len(report.vanished)} checkpoint(s) removed from {_shown(args.src)} while "
             f"it was copied (its writer's retention), not copied: "
             f"{_shown(', '.join(report.vanished))}")
    return OK


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"anon\": true}'")
    return value


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of `least` or more."""

    def parse(text: str) -> int:
        number = int(text)
        if number < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, not {number}")
        return number

    parse.__name__ = "whole number"  # argparse names it so in "invalid ... value"
    return parse


def _positive_seconds(text: str) -> float:
    number = float(text)
    if not 0 < number < math.inf:  # also refuses nan, and 1e400 (inf)
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds above 0, not {text}")
    return number


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a failed write of --help or --version (a full disk)
    raises: argparse drops its error, and the command exited 0 having said nothing."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        out = file or sys.stderr
        if message and out is not None:  # None: that stream was closed at start (`>&-`)
            out.write(message)


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    common.add_argument("-v", "--verbose", action="store_true", help="log at INFO to stderr")
    common.add_argument("--storage-options", type=_json_object, metavar="JSON",
                        help="options for the URLs' storage backend, passed to fsspec as they "
                        "are, e.g. '{\"client_kwargs\": {\"endpoint_url\": \"http://...\"}}'")

    parser = _Parser(
        prog="safepoint",
        description="List, inspect, verify, compare, export and import safepoint checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"safepoint {sp.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("ls", parents=[common], help="list committed checkpoints in DIR")
    p.add_argument("dir", metavar="DIR", help="a checkpoint, or a directory holding some")
    p.set_defaults(run=ls)

    p = commands.add_parser("gc", parents=[common],
                            help="remove leftovers and apply retention under a manager root")
    p.add_argument("root", metavar="ROOT", help="a CheckpointManager root")
    p.add_argument("--keep-last", type=_at_least(0), metavar="N", help="keep the newest N steps")
    p.add_argument("--keep-every", type=_at_least(1), metavar="K",
                   help="also keep steps divisible by K")
    p.add_argument("--keep-every-seconds", type=_positive_seconds, metavar="S",
                   help="also keep one step per S seconds")
    p.add_argument("--keep-best", type=_at_least(0), metavar="N",
                   help="also keep the N best steps by --best-metric")
    p.add_argument("--best-metric", metavar="M", help="the metric --keep-best ranks by")
    p.add_argument("--best-mode", choices=["min", "max"], help="lower (min) or higher is better")
    p.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
    p.set_defaults(run=gc)

    p = commands.add_parser("info", parents=[common], help="describe a checkpoint")
    p.add_argument("ckpt", metavar="CKPT", help="path or URL of a checkpoint")
    p.add_argument("--keys", action="append", metavar="PATTERN",
                   help="only entries under this path prefix or matching this glob (repeatable)")
    p.add_argument("--limit", type=_at_least(0), metavar="N", help="show at most N entries")
    p.set_defaults(run=info)

    p = commands.add_parser("verify", parents=[common], help="check every byte of checkpoints")
    p.add_argument("ckpt", metavar="CKPT", nargs="+", help="paths or URLs of checkpoints")
    p.set_defaults(run=verify)

    p = commands.add_parser("diff", parents=[common], help="compare two checkpoints")
    p.add_argument("a", metavar="A", help="path or URL of the first checkpoint")
    p.add_argument("b", metavar="B", help="path or URL of the second checkpoint")
    p.add_argument("--keys", action="append", metavar="PATTERN",
                   help="compare only entries under this path prefix or matching this glob "
                   "(repeatable)")
    p.set_defaults(run=diff)

    p = commands.add_parser("export", parents=[common],
                            help="write a checkpoint as a .pt, .safetensors or .tar[.gz] file")
    p.add_argument("ckpt", metavar="CKPT", help="path or URL of a checkpoint")
    p.add_argument("out", metavar="OUT", help="*.safetensors, *.pt/.pth/.bin/.ckpt, or an "
                   "archive of the whole checkpoint: *.tar, *.tar.gz, *.tar.bz2, *.tar.xz")
    p.add_argument("--keys", action="append", metavar="PATTERN",
                   help="only entries under this path prefix or matching this glob (repeatable; "
                   "--keys model/ for weights only)")
    p.add_argument("--strip-prefix", metavar="PREFIX",
                   help="export the subtree under PREFIX (e.g. model/), named relative to it")
    p.add_argument("--allow-pickle", action="store_true",
                   help="load pickled entries (runs code from the checkpoint)")
    p.set_defaults(run=export)

    p = commands.add_parser("import", parents=[common],
                            help="save a .pt, .safetensors or .tar[.gz] file as a checkpoint")
    p.add_argument("src", metavar="IN", help="*.safetensors, *.pt/.pth/.bin/.ckpt, or an "
                   "archive that `safepoint export` wrote (*.tar, *.tar.gz, ...)")
    p.add_argument("ckpt", metavar="CKPT", help="path or URL of the checkpoint to write")
    p.add_argument("--allow-pickle", action="store_true",
                   help="fully unpickle a torch file (runs code from it; only for trusted files)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at CKPT")
    p.set_defaults(run=import_)

    p = commands.add_parser("cp", parents=[common],
                            help="copy a checkpoint or a root of them, verifying checksums")
    p.add_argument("src", metavar="SRC", help="a checkpoint, or a root holding checkpoints")
    p.add_argument("dst", metavar="DST", help="where the copy goes (any path or URL)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a different checkpoint committed at the destination")
    p.add_argument("--dst-storage-options", type=_json_object, metavar="JSON",
                   help="storage options for DST (default: --storage-options)")
    p.set_defaults(run=cp)
    return parser


class _OneLine(logging.Formatter):
    """A log record as one line, its traceback left out (`-v` shows it)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"safepoint: {record.levelname.lower()}: {_shown(record.getMessage())}"


def _unwritten(exc: _OutputFailed | BrokenPipeError) -> int:
    """The exit status once stdout could not be written: a full disk is one error line; a
    reader that went away (`safepoint info CKPT | head`) is a quiet stop, as cat's."""
    _discard_output()
    if isinstance(exc, BrokenPipeError):
        return PIPE_CLOSED
    _error(exc)
    return PROBLEM


def main(argv: list[str] | None = None) -> int:
    """Run the `safepoint` command.

    Args:
        argv: the arguments after the program name; `sys.argv[1:]` when None.

    Returns:
        the exit status: 0 all well, 1 a problem found, 2 a usage error, 130 when
        interrupted (Ctrl-C), 141 when the output pipe closed early.
    """
    try:
        with _writing_output():  # --help, --version
            args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else USAGE
    except (_OutputFailed, BrokenPipeError) as exc:
        return _unwritten(exc)
    run: Callable[[argparse.Namespace], int] = args.run
    package_logger = logging.getLogger("safepoint")
    handler = logging.StreamHandler(sys.stderr)
    level = package_logger.level
    if args.verbose:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package_logger.setLevel(logging.INFO)
    else:  # warnings only, a line each: no traceback of what the command then reports
        handler.setFormatter(_OneLine())
        handler.setLevel(logging.WARNING)
    package_logger.addHandler(handler)
    stdout = sys.stdout  # None when the command was started with stdout closed (`>&-`)
    errors = stdout.errors if isinstance(stdout, io.TextIOWrapper) else None
    if isinstance(stdout, io.TextIOWrapper):
        stdout.reconfigure(errors=_ESCAPE)
    try:
        status = run(args)
        if sys.stdout is not None:
            with _writing_output():  # here, where a failed write is caught, not at exit
                sys.stdout.flush()
        return status
    except (_OutputFailed, BrokenPipeError) as exc:
        return _unwritten(exc)
    except SafepointError as exc:
        _error(exc)
        return PROBLEM
    except KeyboardInterrupt:
        _error("interrupted")
        return INTERRUPTED
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(level)
        if isinstance(stdout, io.TextIOWrapper) and not stdout.closed:
            stdout.reconfigure(errors=errors)
