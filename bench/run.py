"""Benchmark safepoint's save and load against torch.save, safetensors, DCP and raw I/O.

Run (from the repository root; it imports safepoint from ``src/``)::

    .venv/bin/python bench/run.py                      # everything, ~15 min on 2 cores
    .venv/bin/python bench/run.py --quick              # small sizes, a smoke test (< 1 min)
    .venv/bin/python bench/run.py --workloads W1 --methods safepoint,raw_odirect,raw_readinto
    .venv/bin/python bench/run.py --worker save safepoint W3 --dir /tmp/x   # one, to profile

Workloads (see ``workloads.py``): W1 = 64 x 16 MiB float32, 1 GiB; W2 = 20,000 small tensors
in seven dtypes, ~450 MB; W3 = GPT-2 small (124M float32 parameters) with AdamW state, ~1.5 GB.

Methods (see ``methods.py``). Saves, all durable (fsync of the files and the directory):
``safepoint``, ``torch_save``, ``safetensors``, ``dcp`` (torch.distributed.checkpoint),
``raw_buffered`` (the tensors' bytes written one by one) and ``raw_odirect`` (one O_DIRECT write
from an aligned, resident buffer: the storage's limit). Loads, into existing tensors where the
method can: ``safepoint``, ``torch_load`` (allocates its result), ``safetensors`` (load_file,
then copy_), ``dcp``, ``raw_readinto`` (readinto one resident buffer through the page cache: the
targets' reference) and ``raw_odirect_read`` (the same with O_DIRECT: the device's read limit,
for information). Each load reads the file its save method wrote (the raw ones read
raw_buffered's). ``checksum`` adds the checksum micro-benchmark.

Each measurement runs in a fresh process (forked from a server that has imported torch, so
that startup is cheap): it builds the state, waits ``--pause`` seconds, times the *first
call*, then repeats the call ``--repeat`` times back to back for the *steady state* (the
median is shown). Memory freed on this machine goes back to the hypervisor within seconds, so a
first call pays for faulting in fresh memory and page cache; that is what a training job sees
when it checkpoints every few minutes. Each rep of a save overwrites the last one's output (as
``overwrite=True`` does), as a job saving to one path would. Loads run ``warm`` (files read
into the page cache beforehand) and ``cold`` (page cache dropped before every call; needs root,
else reported unavailable).

Reading the table: ``first s``/``steady s`` are seconds per call (``!``: other processes took
CPU meanwhile, so the time may be inflated; rerun on a quiet machine), MB/s is tensor payload
bytes per second (10^6), ``+RSS MiB`` is the peak resident memory during the call over the
resident memory just before it (which already holds the state or the destination tensors): the
method's own memory cost. ``peak RSS MiB`` is the process's whole high-water mark. The checks
table divides times (first by first, steady by steady) and marks each project target PASS or
FAIL. Results go to ``bench/results/<time>.json`` (``--report FILE`` prints them again); a
Markdown copy of every table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
sys.path.insert(1, str(REPO / "src"))  # measure the working tree's safepoint

from checksums import run_checksums  # noqa: E402
from measure import Spec, drop_caches, run_worker  # noqa: E402
from methods import LOADS, SAVES, read_through  # noqa: E402
from report import (  # noqa: E402
    DISTURBED,
    FOOTNOTE,
    Record,
    checks_table,
    checksums_table,
    disturbed,
    render_markdown,
    render_text,
    results_table,
)
from workloads import WORKLOADS  # noqa: E402

METHODS = ("checksum", *dict.fromkeys([*SAVES, *LOADS]))
CHECKSUM_BYTES = {False: 256 << 20, True: 32 << 20}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, from: {', '.join(METHODS)} (a name that is both a save and a "
        "load method, like safepoint, runs both)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        help="where checkpoints are written: a fresh folder is made inside it and removed at "
        "the end (default: one under bench/results/, on the repository's disk)",
    )
    parser.add_argument("--repeat", type=int, help="steady-state reps (default 3, quick 2)")
    parser.add_argument("--pause", type=float, help="seconds before a first call (3, quick 0.2)")
    parser.add_argument(
        "--firsts", type=int, default=1,
        help="first calls per method, each in a fresh worker; the report takes their median",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per worker")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        help="seconds to wait, before each measurement, for other programs to stop using the "
        "CPUs (default 120, quick 0)",
    )
    parser.add_argument(
        "--worker",
        nargs=3,
        metavar=("OP", "METHOD", "WORKLOAD"),
        help="measure one OP (save or load) in this process and print its record as JSON; "
        "--dir is then the workload folder itself (a load reads what a save left there)",
    )
    parser.add_argument("--cold", action="store_true", help="with --worker: a cold load")
    parser.add_argument(
        "--report", type=Path, metavar="JSON", help="print the tables of an earlier run's file"
    )
    args = parser.parse_args(argv)
    args.repeat = args.repeat if args.repeat is not None else (2 if args.quick else 3)
    args.pause = args.pause if args.pause is not None else (0.2 if args.quick else 3.0)
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.quick else 120.0
    return args


def _split(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return names


def _child(conn: multiprocessing.connection.Connection, func: Any, arg: Any) -> None:
    """Worker process body: run ``func(arg)`` and send back its result or its error."""
    try:
        conn.send(func(arg))
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise


class Runner:
    """Runs each measurement in a fresh process forked from a server that has imported torch.

    A child forked from it starts in milliseconds instead of the seconds a new interpreter
    takes to import torch and DCP, and shares nothing with the others but those imports.
    safepoint is imported in each child, so the working tree's current code is measured.
    """

    # DCP imports its fsspec filesystem (and fsspec) on its first save or load: not timed.
    PRELOAD = ("torch", "torch.distributed.checkpoint",
               "torch.distributed.checkpoint._fsspec_filesystem", "safetensors.torch", "measure")

    def __init__(self, timeout: float, quiet_wait: float, firsts: int = 1) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(list(self.PRELOAD))
        self.timeout = timeout
        self.quiet_wait = quiet_wait
        self.firsts = firsts

    def call(self, func: Any, arg: Any) -> Any:
        """``func(arg)`` in a child process; a dict with ``error`` if it failed or hung."""
        receiver, sender = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_child, args=(sender, func, arg))
        process.start()
        sender.close()
        result: Any = None
        if receiver.poll(self.timeout):
            with contextlib.suppress(EOFError):
                result = receiver.recv()
        if process.is_alive() and result is None:
            process.kill()
        process.join()
        if result is None:
            reason = "timed out" if process.exitcode == -9 else f"exit code {process.exitcode}"
            result = {"error": f"worker died ({reason})"}
        return result

    def measure(self, spec: Spec) -> Record:
        """One worker record, with the first calls of ``firsts - 1`` more workers (first
        calls only) in ``more_firsts``: one sample of a first call is at the mercy of the disk;
        a failure keeps the spec's fields and adds ``error``."""
        _wait_for_quiet(self.quiet_wait)
        result = self.call(run_worker, spec)
        record: Record = {**asdict(spec), **result}
        if "error" not in record and self.firsts > 1:
            record["more_firsts"] = []
            for _ in range(self.firsts - 1):
                _wait_for_quiet(self.quiet_wait)
                more = self.call(run_worker, replace(spec, repeat=0))
                if "error" in more:
                    record["error"] = f"a further first call failed: {more['error']}"
                    break
                record["more_firsts"].append(more["reps"][0])
        _progress(record)
        return record


def _user_cpu_seconds() -> float:
    """User CPU time of the whole machine so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()  # cpu user nice system idle ...
    return (int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def _wait_for_quiet(limit: float, window: float = 0.5) -> None:
    """Wait up to ``limit`` seconds for other programs to leave the CPUs (under 1/10 of a core).

    A test suite run beside the benchmark comes and goes; measuring between its runs is
    better than marking the results disturbed afterwards.
    """
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = _user_cpu_seconds()
        time.sleep(window)
        if _user_cpu_seconds() - before < 0.1 * window:
            return
    if limit > 0:
        print(f"the machine is busy after {limit:.0f} s of waiting; measuring anyway",
              file=sys.stderr)  # fmt: skip


def _progress(record: Record) -> None:
    cache = "" if record["op"] == "save" else ("cold" if record["cold"] else "warm")
    what = f"[{record['workload']}] {record['op']} {record['method']} {cache}".rstrip()
    if "error" in record:
        print(f"{what}: {record['error']}", file=sys.stderr, flush=True)
        return
    extra = max(rep["peak_rss"] - rep["rss_before"] for rep in record["reps"]) / (1 << 20)
    times = " ".join(
        f"{rep['seconds']:.3f}{DISTURBED if disturbed(rep) else ''}" for rep in record["reps"]
    )
    if record.get("more_firsts"):
        times += " (more first calls: " + " ".join(
            f"{rep['seconds']:.3f}" for rep in record["more_firsts"]) + ")"
    print(f"{what}: {times} s, +RSS {extra:.0f} MiB", file=sys.stderr, flush=True)


def _probe_drop_caches() -> str | None:
    """None if the page cache can be dropped here, else why not (cold loads are skipped)."""
    try:
        drop_caches()
    except OSError as exc:
        return f"cannot drop the page cache ({exc}); cold results unavailable"
    return None


def run_benchmark(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every selected workload and method, then the checksum micro-benchmark."""
    workloads = _split(args.workloads, WORKLOADS, "workloads")
    methods = _split(args.methods, METHODS, "methods")
    runner = Runner(args.timeout, args.quiet_wait, args.firsts)
    cold_error = _probe_drop_caches()
    if cold_error:
        print(cold_error, file=sys.stderr)
    base = Spec("save", "", "", "", args.quick, args.repeat, args.pause)
    records: list[Record] = []
    for workload in workloads:
        folder = root / workload
        folder.mkdir()
        records += _run_workload(runner, replace(base, workload=workload), methods, folder,
                                 cold_error)  # fmt: skip
        shutil.rmtree(folder)  # the disk holds one workload's files at a time
    checksums: list[dict[str, Any]] = []
    if "checksum" in methods:
        result = runner.call(run_checksums, CHECKSUM_BYTES[args.quick])
        checksums = [result] if isinstance(result, dict) else result
    return {"records": records, "checksums": checksums, "cold_error": cold_error}


def _run_workload(
    runner: Runner, base: Spec, methods: list[str], folder: Path, cold_error: str | None
) -> list[Record]:
    """One workload's saves, then its loads (warm, then cold), each reading its save's file."""
    records, saved = [], {}
    for name in (m for m in SAVES if m in methods):
        path = folder / SAVES[name].filename
        saved[name] = runner.measure(replace(base, method=name, path=str(path)))
        records.append(saved[name])
    for name in (m for m in LOADS if m in methods):
        source = SAVES[LOADS[name].source]
        path = folder / source.filename
        if source.name not in saved:  # written once, untimed
            write = replace(base, method=source.name, path=str(path), repeat=0, pause=0)
            saved[source.name] = runner.call(run_worker, write)
        error = saved[source.name].get("error")
        for cold in (False, True):
            spec = replace(base, op="load", method=name, path=str(path), cold=cold)
            if error or (cold and cold_error):
                why = f"its input was not written ({error})" if error else "cold unavailable"
                records.append({**asdict(spec), "error": why})
                _progress(records[-1])
                continue
            if not cold:
                read_through(path)
            records.append(runner.measure(spec))
    return records


def _filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def machine_info(root: Path) -> dict[str, Any]:
    """What the numbers depend on: machine, versions, filesystem, code revision."""
    versions: dict[str, str | None] = {}
    for package in ("torch", "safetensors", "numpy", "crc32c", "xxhash"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    git = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": multiprocessing.cpu_count(),
        "memory_bytes": _meminfo_total(),
        "filesystem": _filesystem(root),
        "git": git.stdout.strip() or None,
        "versions": versions,
    }


def _meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _single(args)
    if args.report:
        print_report(json.loads(args.report.read_text()))
        return 0
    parent = args.dir or RESULTS
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="scratch-", dir=parent))
    try:
        info = machine_info(root)
        if info["filesystem"] in ("tmpfs", "ramfs"):
            print(f"warning: {root} is on {info['filesystem']}, not a disk", file=sys.stderr)
        results = run_benchmark(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"{stamp}{'-quick' if args.quick else ''}.json"
    document = {"machine": info, "args": _jsonable(vars(args)), **results}
    out.write_text(json.dumps(document, indent=1))  # first: a report that fails loses nothing
    print_report(document)
    print(f"\nwrote {out}; print it again with --report {out}")
    return 0


def print_report(document: dict[str, Any]) -> None:
    """The tables of a results document, aligned, then in Markdown."""
    records = document["records"]
    tables = {"results": results_table(records), "checks": checks_table(records)}
    if document["checksums"]:
        tables["checksums"] = checksums_table(document["checksums"])
    for table in tables.values():
        print("\n" + render_text(table))
    print(f"\n{FOOTNOTE}")
    if document["cold_error"]:
        print(f"note: {document['cold_error']}")
    print("\nMarkdown:")
    for table in tables.values():
        print("\n" + render_markdown(table))


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, Path) else value for key, value in values.items()}


def _single(args: argparse.Namespace) -> int:
    """``--worker``: one measurement in this process (for py-spy or cProfile), JSON out."""
    op, method, workload = args.worker
    table = SAVES if op == "save" else LOADS
    if op not in ("save", "load") or method not in table or workload not in WORKLOADS:
        raise SystemExit(f"--worker: no {op} method {method!r} or no workload {workload!r}")
    folder = args.dir or Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    filename = SAVES[method if op == "save" else LOADS[method].source].filename
    spec = Spec(op, method, workload, str(folder / filename), args.quick, args.repeat,
                args.pause, args.cold)  # fmt: skip
    print(json.dumps(run_worker(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
