"""The `safepoint` command: list, inspect and verify checkpoints from a shell (integrations and
CLI layer). It never imports torch, so it runs on login nodes and CI runners without CUDA
wheels; it is the only part of safepoint that prints.

Exit status: 0 when all is well, 1 when a problem was found (corruption, nothing committed
where asked), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import safepoint as sp

from ._commit import leftovers
from ._tree import select
from .errors import CheckpointNotFound, SafepointError
from .storage import open_storage

__all__ = ["main"]

OK = 0
PROBLEM = 1
USAGE = 2

#: Longest rendering of a plain value in the `info` table before it is cut.
_VALUE_WIDTH = 40


def _human_bytes(nbytes: float) -> str:
    """`nbytes` in binary units: "512 B", "1.5 KiB", "3.0 GiB"."""
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            break
    return f"{nbytes:.1f} {unit}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Rows as aligned columns under `header`; columns whose index is in `right` are
    right-aligned (numbers), the others left-aligned."""
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
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _child(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def _error(message: object) -> None:
    print(f"safepoint: error: {message}", file=sys.stderr)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


@dataclass(frozen=True, slots=True)
class _Listing:
    """What `ls` found at or directly under a URL.

    Attributes:
        found: (name, info) of each committed checkpoint, in natural name order.
        uncommitted: (name, leftover file count) of each directory holding an uncommitted save.
        unreadable: (name, error) of each checkpoint whose manifest could not be read.
    """

    found: list[tuple[str, sp.CheckpointInfo]] = field(default_factory=list)
    uncommitted: list[tuple[str, int]] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)


def _scan(url: str) -> _Listing:
    """The checkpoint at `url`, or else those directly under it.

    Raises:
        SafepointError: `url` holds a manifest that cannot be read, or listing failed.
    """
    listing = _Listing()
    try:
        listing.found.append((url, sp.info(url)))
        return listing
    except CheckpointNotFound:
        pass
    storage = open_storage(url)
    try:
        names = sorted({p.split("/")[0] for p in storage.list("") if "/" in p}, key=_natural)
    finally:
        storage.close()
    for name in names:
        try:
            listing.found.append((name, sp.info(_child(url, name))))
        except CheckpointNotFound:
            child = open_storage(_child(url, name))
            try:
                orphans = leftovers(child)
            finally:
                child.close()
            if orphans:
                listing.uncommitted.append((name, len(orphans)))
        except SafepointError as exc:
            listing.unreadable.append((name, str(exc)))
    return listing


def ls(args: argparse.Namespace) -> int:
    """`safepoint ls DIR`: the committed checkpoints at or directly under DIR.

    A directory under DIR without a manifest but with data of a save is an uncommitted leftover:
    it is named in a note, never listed as a checkpoint.

    Returns:
        0 when at least one checkpoint was listed and every manifest was readable, else 1.

    Raises:
        SafepointError: DIR holds a manifest that cannot be read, or listing DIR failed.
    """
    listing = _scan(args.dir)
    if args.json:
        _print_json({
            "url": args.dir,
            "checkpoints": [
                {"name": name, "url": ckpt.url, "created": ckpt.created,
                 "entries": len(ckpt.entries), "nbytes": ckpt.nbytes}
                for name, ckpt in listing.found
            ],
            "uncommitted": [{"name": name, "files": n} for name, n in listing.uncommitted],
            "unreadable": [{"name": name, "error": error} for name, error in listing.unreadable],
        })
    else:
        if listing.found:
            rows = [
                [name, ckpt.created, str(len(ckpt.entries)), _human_bytes(ckpt.nbytes)]
                for name, ckpt in listing.found
            ]
            print(_table(["NAME", "CREATED", "ENTRIES", "SIZE"], rows, right=(2, 3)))
        if listing.uncommitted:
            names = ", ".join(name for name, _ in listing.uncommitted)
            print(f"note: {len(listing.uncommitted)} uncommitted leftover(s), directories "
                  f"without a manifest (never committed): {names}")
    for name, error in listing.unreadable:
        _error(f"{name}: {error}")
    if not listing.found and not listing.unreadable:
        _error(f"no committed checkpoint at or directly under {args.dir}: check the path")
    return OK if listing.found and not listing.unreadable else PROBLEM


def _shape(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(map(str, shape)) + ")"


def _value(entry: sp.EntryInfo) -> str:
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
    summary = sp.info(args.ckpt)
    by_path = {entry.path: entry for entry in summary.entries}
    entries = [by_path[path] for path in select(by_path, args.keys)]
    if args.keys is not None and not entries:
        _error(f"--keys {' '.join(args.keys)} match nothing in {args.ckpt}: use path prefixes "
               "like 'model/' or globs like 'model/*.weight'")
        return PROBLEM
    shown = entries if args.limit is None else entries[: args.limit]

    if args.json:
        described = asdict(summary)
        described["entries"] = [asdict(entry) for entry in shown]
        _print_json(described)
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
        print(f"{label + ':':<16}{text}")
    print()
    rows = [
        [e.path, e.kind, e.dtype or "-", _shape(e.shape),
         "-" if e.kind == "value" else _human_bytes(e.nbytes), _value(e)]
        for e in shown
    ]
    print(_table(["PATH", "KIND", "DTYPE", "SHAPE", "SIZE", "VALUE"], rows, right=(4,)))
    if len(shown) < len(entries):
        print(f"... {len(entries) - len(shown)} more (raise --limit to see them)")
    return OK


def verify(args: argparse.Namespace) -> int:
    """`safepoint verify CKPT [CKPT...]`: read every byte of each checkpoint and check it
    against its checksums.

    Returns:
        0 when every checkpoint is committed and intact, else 1.
    """
    reports: list[sp.VerifyReport] = []
    for url in args.ckpt:
        try:
            report = sp.verify(url)
        except SafepointError as exc:
            report = sp.VerifyReport(url, False, [str(exc)])
        reports.append(report)
        if args.json:
            continue
        if report.ok:
            rate = _human_bytes(report.nbytes / max(report.seconds, 1e-9))
            print(f"OK      {url}: {_human_bytes(report.nbytes)} in {report.seconds:.2f} s "
                  f"({rate}/s)")
        else:
            print(f"FAILED  {url}: {len(report.problems)} problem(s)")
            for problem in report.problems:
                print(f"  {problem}")
    if args.json:
        _print_json({"ok": all(r.ok for r in reports), "reports": [asdict(r) for r in reports]})
    return OK if all(report.ok for report in reports) else PROBLEM


def _non_negative(text: str) -> int:
    number = int(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {number}")
    return number


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    common.add_argument("-v", "--verbose", action="store_true", help="log at INFO to stderr")

    parser = argparse.ArgumentParser(
        prog="safepoint", description="List, inspect and verify safepoint checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"safepoint {sp.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("ls", parents=[common], help="list committed checkpoints in DIR")
    p.add_argument("dir", metavar="DIR", help="a checkpoint, or a directory holding some")
    p.set_defaults(run=ls)

    p = commands.add_parser("info", parents=[common], help="describe a checkpoint")
    p.add_argument("ckpt", metavar="CKPT", help="path or URL of a checkpoint")
    p.add_argument("--keys", action="append", metavar="PATTERN",
                   help="only entries under this path prefix or matching this glob (repeatable)")
    p.add_argument("--limit", type=_non_negative, metavar="N", help="show at most N entries")
    p.set_defaults(run=info)

    p = commands.add_parser("verify", parents=[common], help="check every byte of checkpoints")
    p.add_argument("ckpt", metavar="CKPT", nargs="+", help="paths or URLs of checkpoints")
    p.set_defaults(run=verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `safepoint` command.

    Args:
        argv: the arguments after the program name; `sys.argv[1:]` when None.

    Returns:
        the exit status: 0 all well, 1 a problem found, 2 a usage error.
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else USAGE
    run: Callable[[argparse.Namespace], int] = args.run
    package_logger = logging.getLogger("safepoint")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    level = package_logger.level
    if args.verbose:
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
    try:
        return run(args)
    except SafepointError as exc:
        _error(exc)
        return PROBLEM
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(level)
