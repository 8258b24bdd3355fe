"""A storage that writes as slowly as a disk (tests of what overlaps the writes)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from safepoint.storage import Buffer
from safepoint.testing import MemoryStorage


class SlowWrites(MemoryStorage):
    """A MemoryStorage that takes `delay` seconds over each chunk written, as a disk does."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        def slowly() -> Iterator[Buffer]:
            for chunk in chunks:
                time.sleep(self.delay)
                yield chunk

        return super().write(path, slowly())
