"""Turn worker records into the printed tables, the target checks and their Markdown form.

A record is what `measure.run_worker` returns (or a failure: the spec plus ``error``). Each
table is built once as rows of strings and rendered twice: aligned for the terminal, and as
Markdown for README.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
RSS_LIMIT = 64 * MIB  # safepoint's target for peak RSS over the state, on save and on load

Record = dict[str, Any]
Table = tuple[list[str], list[list[str]]]


@dataclass(frozen=True)
class Summary:
    """One record reduced: first call (the median of the fresh workers' first calls), steady
    state (the median of the repeats), memory."""

    first_s: float
    steady_s: float | None
    first_extra: int
    steady_extra: int | None  # the largest over the steady reps
    peak: int  # the largest VmHWM over all reps
    state_bytes: int
    first_disturbed: bool
    steady_disturbed: bool

    def mb_per_s(self, seconds: float | None) -> float | None:
        return None if seconds is None else self.state_bytes / seconds / 1e6


def cache_of(record: Record) -> str:
    """``warm``/``cold`` for a load, ``-`` for a save."""
    if record["op"] != "load":
        return "-"
    return "cold" if record["cold"] else "warm"


def summarize(record: Record) -> Summary | None:
    """The record's summary, or None when the worker failed."""
    if "error" in record:
        return None
    reps = record["reps"]
    firsts = [reps[0], *record.get("more_firsts", [])]  # first calls of fresh workers
    extras = [rep["peak_rss"] - rep["rss_before"] for rep in reps]
    steady = [rep["seconds"] for rep in reps[1:]]
    return Summary(
        first_s=statistics.median(rep["seconds"] for rep in firsts),
        steady_s=statistics.median(steady) if steady else None,
        first_extra=max(rep["peak_rss"] - rep["rss_before"] for rep in firsts),
        steady_extra=max(extras[1:]) if steady else None,
        peak=max(rep["peak_rss"] for rep in [*reps, *firsts]),
        state_bytes=record["state_bytes"],
        first_disturbed=any(map(disturbed, firsts)),
        steady_disturbed=any(map(disturbed, reps[1:])),
    )


def disturbed(rep: dict[str, Any]) -> bool:
    """Whether other processes took CPU enough to skew this rep (1/10 of a core, 20 ms)."""
    return bool(rep.get("others_cpu_s", 0.0) > max(0.02, 0.1 * rep["seconds"]))


DISTURBED = "!"
FOOTNOTE = (
    f"{DISTURBED} other processes used the CPU during that call: the time may be inflated; "
    "rerun on a quiet machine"
)


def _num(value: float | None, digits: int = 2, flagged: bool = False) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}{DISTURBED if flagged else ''}"


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.0f}"


def results_table(records: list[Record]) -> Table:
    """One row per record: seconds, MB/s and extra RSS for the first call and steady state."""
    header = [
        "workload", "op", "method", "cache",
        "first s", "first MB/s", "first +RSS MiB",
        "steady s", "steady MB/s", "steady +RSS MiB",
        "peak RSS MiB",
    ]  # fmt: skip
    rows = []
    for record in records:
        head = [record["workload"], record["op"], record["method"], cache_of(record)]
        summary = summarize(record)
        if summary is None:
            rows.append([*head, f"error: {record['error']}", *[""] * 6])
            continue
        rows.append(
            [
                *head,
                _num(summary.first_s, 3, summary.first_disturbed),
                _num(summary.mb_per_s(summary.first_s), 0),
                _mib(summary.first_extra),
                _num(summary.steady_s, 3, summary.steady_disturbed),
                _num(summary.mb_per_s(summary.steady_s), 0),
                _mib(summary.steady_extra),
                _mib(summary.peak),
            ]
        )
    return header, rows


@dataclass(frozen=True)
class Target:
    """A time ratio numerator/denominator that must stay on one side of a per-workload limit.

    Operands are ``(op, method, cache)``; ``at_most`` False means the ratio must be at least
    the limit (an alternative that should be that many times slower than safepoint).
    """

    label: str
    numerator: tuple[str, str, str]
    denominator: tuple[str, str, str]
    at_most: bool
    limits: dict[str, float]


ALL = ("W1", "W2", "W3")
TARGETS = (
    Target("save safepoint / raw_odirect", ("save", "safepoint", "-"),
           ("save", "raw_odirect", "-"), True, {"W1": 1.2, "W2": 1.5, "W3": 1.2}),
    Target("save safepoint / safetensors", ("save", "safepoint", "-"),
           ("save", "safetensors", "-"), True, {"W1": 0.8, "W2": 0.35, "W3": 0.8}),
    Target("save torch_save / safepoint", ("save", "torch_save", "-"),
           ("save", "safepoint", "-"), False, dict.fromkeys(ALL, 2.5)),
    Target("save dcp / safepoint", ("save", "dcp", "-"),
           ("save", "safepoint", "-"), False, dict.fromkeys(ALL, 2.5)),
    Target("cold load safepoint / raw_readinto", ("load", "safepoint", "cold"),
           ("load", "raw_readinto", "cold"), True, {"W1": 1.2, "W2": 1.5, "W3": 1.2}),
    Target("warm load safepoint / safetensors", ("load", "safepoint", "warm"),
           ("load", "safetensors", "warm"), True, {"W1": 1.0, "W2": 0.5, "W3": 1.0}),
    Target("warm load dcp / safepoint", ("load", "dcp", "warm"),
           ("load", "safepoint", "warm"), False, {"W2": 5.0}),
)  # fmt: skip


def _find(records: list[Record], workload: str, key: tuple[str, str, str]) -> Summary | None:
    for record in records:
        if (record["workload"], record["op"], record["method"], cache_of(record)) == (
            workload,
            *key,
        ):
            return summarize(record)
    return None


def _verdict(
    value: float | None, limit: float, at_most: bool, digits: int = 2, flagged: bool = False
) -> str:
    if value is None:
        return "n/a"
    ok = value <= limit if at_most else value >= limit
    return f"{value:.{digits}f} {'PASS' if ok else 'FAIL'}{DISTURBED if flagged else ''}"


def _rss_verdict(extra: int | None) -> str:
    return _verdict(None if extra is None else extra / MIB, RSS_LIMIT / MIB, True, 0)


def checks_table(records: list[Record]) -> Table:
    """The project's targets: time ratios and safepoint's extra RSS, each PASS or FAIL.

    Only workloads that were run appear; a ratio whose operands were not both measured
    reads ``n/a``.
    """
    header = ["workload", "check", "target", "first", "steady"]
    rows = []
    workloads = sorted({record["workload"] for record in records})
    for workload in workloads:
        for target in TARGETS:
            if workload not in target.limits:
                continue
            num = _find(records, workload, target.numerator)
            den = _find(records, workload, target.denominator)
            limit = target.limits[workload]
            first = steady = None
            first_disturbed = steady_disturbed = False
            if num and den:
                first = num.first_s / den.first_s
                first_disturbed = num.first_disturbed or den.first_disturbed
                if num.steady_s is not None and den.steady_s is not None:
                    steady = num.steady_s / den.steady_s
                    steady_disturbed = num.steady_disturbed or den.steady_disturbed
            rows.append(
                [
                    workload,
                    target.label,
                    f"{'<=' if target.at_most else '>='} {limit:g}",
                    _verdict(first, limit, target.at_most, flagged=first_disturbed),
                    _verdict(steady, limit, target.at_most, flagged=steady_disturbed),
                ]
            )
        for op, cache in (("save", "-"), ("load", "warm"), ("load", "cold")):
            summary = _find(records, workload, (op, "safepoint", cache))
            first = summary.first_extra if summary else None
            steady = summary.steady_extra if summary else None
            rows.append(
                [
                    workload,
                    f"{op} {'' if cache == '-' else cache + ' '}safepoint extra RSS MiB",
                    f"<= {RSS_LIMIT // MIB}",
                    _rss_verdict(first),
                    _rss_verdict(steady),
                ]
            )
    return header, rows


def checksums_table(results: list[dict[str, Any]]) -> Table:
    """Checksum throughput and GIL release."""
    header = ["checksum", "GB/s", "other thread's speed", "releases GIL"]
    rows = [
        [
            r["algorithm"],
            f"{r['gb_per_s']:.1f}",
            f"{r['other_thread_rate']:.2f}",
            "yes" if r["releases_gil"] else "no",
        ]
        for r in results
    ]
    return header, rows


def _is_number(cell: str) -> bool:
    try:
        float(cell.split()[0])
    except (ValueError, IndexError):
        return False
    return True


def render_text(table: Table) -> str:
    """Aligned columns for the terminal: numbers right-aligned, text left-aligned."""
    header, rows = table
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(width) if _is_number(cell) else cell.ljust(width)
            for cell, width in zip(row, widths, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def render_markdown(table: Table) -> str:
    """A GitHub Markdown table."""
    header, rows = table
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
