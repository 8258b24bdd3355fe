"""Checksum micro-benchmark: throughput of each candidate and whether it releases the GIL.

A checksum that releases the GIL can run on a second core beside the writes (or beside
training, for an asynchronous save); one that holds it stalls every other Python thread for the
whole call. The test: a second thread counts in a loop; its counting rate while the main thread
runs the checksum (for about half a second) is compared with its rate while the main thread
sleeps. Near 1 means the GIL was released (less when the other core is shared); near 0 that it
was held (the count advances only at the 5 ms switch interval between calls). The cut is 0.25.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np
import xxhash

ALGORITHMS: dict[str, Callable[[memoryview], int]] = {
    "zlib.crc32": zlib.crc32,
    "crc32c.crc32c": crc32c.crc32c,
    "xxhash.xxh3_64": xxhash.xxh3_64_intdigest,
}


class _Counter(threading.Thread):
    """Counts as fast as the GIL lets it, until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.count = 0
        self.stopped = False

    def run(self) -> None:
        while not self.stopped:
            self.count += 1


def _counting_rate(counter: _Counter, work: Callable[[], object]) -> float:
    """Counts per second of ``counter`` while the main thread runs ``work``."""
    before, start = counter.count, time.perf_counter()
    work()
    return (counter.count - before) / (time.perf_counter() - start)


def run_checksums(size: int, repeat: int = 3) -> list[dict[str, Any]]:
    """Measure every algorithm over the same ``size``-byte random buffer."""
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).data
    return [_measure(name, checksum, data, repeat) for name, checksum in ALGORITHMS.items()]


def _measure(
    name: str, checksum: Callable[[memoryview], int], data: memoryview, repeat: int
) -> dict[str, Any]:
    """GB/s (best of ``repeat``) of one algorithm, and the GIL test."""
    checksum(data[: 1 << 20])  # first-call costs (table setup, CPU dispatch) out of the way
    best = min(_timed(lambda: checksum(data)) for _ in range(repeat))
    calls = max(1, round(0.5 / best))  # the GIL test runs for about half a second
    counter = _Counter()
    counter.start()
    idle = _counting_rate(counter, lambda: time.sleep(0.2))
    busy = _counting_rate(counter, lambda: [checksum(data) for _ in range(calls)])
    counter.stopped = True
    counter.join()
    ratio = busy / idle
    return {
        "algorithm": name,
        "bytes": data.nbytes,
        "seconds": best,
        "gb_per_s": data.nbytes / best / 1e9,
        "other_thread_rate": ratio,
        "releases_gil": ratio > 0.25,
    }


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start
