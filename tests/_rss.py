"""Peak resident memory of this process, sampled by a thread (tests of memory bounds)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


def rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RSSPeak:
    """The highest `rss()` seen, sampled every millisecond by a thread until `stop()`."""

    def __init__(self) -> None:
        self.peak = rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, rss())


def growth_during(call: Callable[[], object]) -> int:
    """How far resident memory rose above its level before `call()` while it ran, in bytes."""
    peak = RSSPeak()
    before = peak.peak
    try:
        call()
    finally:
        grown = peak.stop() - before
    return grown
