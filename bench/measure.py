"""The worker: one method, one operation, one workload, measured in a process of its own.

A fresh process per measurement makes its peak RSS the method's alone and its first call a true
first call. The worker builds the workload (a random source state for a save, a touched
destination state of the same shapes for a load), lets the method prepare, waits ``pause``
seconds (memory freed while building goes back to the hypervisor, as it does between training
steps), then times the operation ``1 + repeat`` times back to back (a save's last output
removed before each rep, untimed). Rep 0 is the *first call*, reps 1.. are *steady state*.
After a load's last rep, untimed, what it loaded is compared with the source state: a method
that loads wrong bytes fails instead of being timed.

Peak RSS comes from the kernel: ``echo 5 > /proc/self/clear_refs`` resets the high-water mark
VmHWM to the current RSS right before the timed call, and VmHWM is read right after it. The
kernel folds the current RSS into the mark before every unmap or madvise that shrinks it, so a
peak freed before the call returns is still caught, however short; no sampling thread competes
with the method for the GIL. RSS counts file pages the method maps (mmap reads) as well as
anonymous memory, as the OOM killer does (safetensors' mmap'ed reads count the page cache they
map). *Extra* RSS is that peak minus the RSS before the first rep, which already holds the state
(and, for a load, the destination tensors): what an earlier rep left allocated counts too.

Each rep also records the user CPU time that *other* processes used while it ran: on a 2-core
machine a test suite running beside the benchmark can double a time, and the report marks such
reps instead of passing them off as the method's.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from methods import LOADS, SAVES
from workloads import State, build_state, tensor_bytes, tensor_leaves

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Between steady-state reps of a save, after the last output was removed and synced: long
#: enough for the disk to settle, short enough that freed memory stays with this VM.
STEADY_PAUSE = 0.2


@dataclass(frozen=True)
class Spec:
    """What one worker measures. ``cold`` drops the page cache before every timed load."""

    op: str  # "save" or "load"
    method: str
    workload: str
    path: str
    quick: bool
    repeat: int
    pause: float
    cold: bool = False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss() -> int:
    """Current resident set size in bytes."""
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """RSS high-water mark in bytes since the last reset."""
    return _status_kib("VmHWM") * 1024


def drop_caches() -> None:
    """Write back dirty pages, then drop the clean page cache (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def run_worker(spec: Spec) -> dict[str, Any]:
    """Measure ``spec`` in this process; return one JSON-ready record (see module docstring).

    Every rep of a save writes the same path, which is removed, untimed, before each rep:
    freeing a file's blocks takes most of a second per GiB on a disk mounted with ``discard``,
    inside ``open(..., "wb")`` or ``unlink`` for the others and in a background thread for
    ``safepoint``'s ``overwrite=True``, so no method pays for its last rep's output. The last
    rep's output stays as the input of the matching load. The memory a rep adds is measured
    from before the first rep, so that what an earlier rep left allocated counts.
    """
    # The imports inherited from the fork server go to GC's permanent generation: collections
    # then skip them, as Python's docs advise after a fork, so that no collection (ours
    # between calls, or one inside a timed call) copies their shared pages on write.
    gc.freeze()
    saving = spec.op == "save"
    method = (SAVES if saving else LOADS)[spec.method]
    path = Path(spec.path)
    state = build_state(spec.workload, quick=spec.quick, source=saving)
    nbytes, ntensors = tensor_bytes(state), len(tensor_leaves(state))
    op = method.setup(state)  # the state stays alive: RSS before each call holds it
    if saving:
        _remove(path)  # left by an earlier run
    if spec.cold:
        drop_caches()
    gc.collect()
    time.sleep(spec.pause)
    reps = []
    base = rss()
    for index in range(1 + spec.repeat):
        if saving and index:
            _remove(path)
            os.sync()
            time.sleep(STEADY_PAUSE)
        if spec.cold and index:
            drop_caches()
        gc.collect()
        reset_peak_rss()
        others = _others_cpu_ticks()
        start = time.perf_counter()
        result = op(path)
        seconds = time.perf_counter() - start
        peak = peak_rss()
        others = _others_cpu_ticks() - others
        if not saving and index == spec.repeat:
            check_loaded(spec, state, result)
        del result
        reps.append(
            {
                "seconds": seconds,
                "rss_before": base,
                "peak_rss": peak,
                "others_cpu_s": others / CLOCK_TICKS,
            }
        )
    return {**asdict(spec), "state_bytes": nbytes, "tensors": ntensors, "reps": reps}


def check_loaded(spec: Spec, state: State, result: Any) -> None:
    """Raise unless a load (its last rep, untimed) produced the tensors the save wrote: the
    returned tree (torch.load) or the destination state (the methods that load into it). The
    raw reads are byte baselines that decode nothing, and are not checked."""
    if LOADS[spec.method].source.startswith("raw"):
        return
    loaded = tensor_leaves(result if isinstance(result, dict) else state)
    expected = tensor_leaves(build_state(spec.workload, quick=spec.quick, source=True))
    wrong = [key for key, tensor in expected.items()
             if key not in loaded or not torch.equal(loaded[key], tensor)]
    if wrong:
        raise RuntimeError(f"{spec.method} loaded {len(wrong)} of {len(expected)} tensors unlike "
                           f"the saved ones, e.g. {wrong[:3]}")


def _others_cpu_ticks() -> int:
    """User CPU time of every other process on the machine, in clock ticks.

    The system's user time (``/proc/stat``) less this process's: kernel I/O work is system
    time and is not counted, so this measures other programs competing for the cores.
    """
    with open("/proc/stat") as f:
        fields = f.readline().split()  # cpu user nice system idle ...
    return int(fields[1]) + int(fields[2]) - round(os.times().user * CLOCK_TICKS)
