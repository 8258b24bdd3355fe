"""Named checksums: known vectors of crc32c and crc32, incremental use as the engine does it,
per-block digests, the error for an unknown algorithm, and that the default algorithm releases
the GIL on a large buffer (against a control that holds it)."""

from __future__ import annotations

import mmap
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from safepoint._checksum import DEFAULT_ALGORITHM, block_digests, checksum_function
from safepoint.errors import CorruptCheckpoint, FormatVersionError


def test_default_is_crc32c() -> None:
    assert DEFAULT_ALGORITHM == "crc32c"


def test_crc32c_known_vector() -> None:
    assert checksum_function("crc32c")(b"123456789") == 0xE3069283


def test_crc32_known_vector() -> None:
    assert checksum_function("crc32")(b"123456789") == 0xCBF43926


@pytest.mark.parametrize("name", ["crc32c", "crc32"])
def test_incremental_equals_whole(name: str) -> None:
    """The engine checksums a block piece by piece, passing the running value."""
    function = checksum_function(name)
    data = bytes(range(256)) * 40
    running = 0
    for start in range(0, len(data), 999):
        running = function(memoryview(data)[start : start + 999], running)
    assert running == function(data)


def test_block_digests() -> None:
    crc = checksum_function("crc32c")
    data = memoryview(bytes(range(256)) * 10)  # 2560 bytes
    digests = block_digests(data, 1024, crc)
    assert digests == [crc(data[:1024]), crc(data[1024:2048]), crc(data[2048:])]
    assert block_digests(data, 2560, crc) == [crc(data)]
    assert block_digests(memoryview(b""), 1024, crc) == []


def test_block_digests_detect_a_flipped_bit_in_its_block_only() -> None:
    crc = checksum_function("crc32c")
    data = bytearray(4096)
    before = block_digests(memoryview(data), 1024, crc)
    data[2500] ^= 0x10
    after = block_digests(memoryview(data), 1024, crc)
    assert [a == b for a, b in zip(before, after, strict=True)] == [True, True, False, True]


def test_unknown_algorithm_names_it_and_the_checkpoint_as_newer() -> None:
    """A checksum this safepoint does not know is a newer writer's, not damage."""
    with pytest.raises(FormatVersionError, match="'md5'") as excinfo:
        checksum_function("md5", url="mem://ckpt")
    message = str(excinfo.value)
    assert "crc32c" in message  # lists the known ones
    assert message.startswith("mem://ckpt: ") and excinfo.value.url == "mem://ckpt"
    assert "upgrade safepoint" in message
    assert not isinstance(excinfo.value, CorruptCheckpoint)


def _runs_beside(function: Callable[[Any], object], data: Any, seconds: float) -> bool:
    """Whether another Python thread ran while `function(data)` was called, repeated until it
    did or about `seconds` passed (a loaded machine may not schedule that thread at once)."""
    ticks = [0]
    started, stop = threading.Event(), threading.Event()

    def count() -> None:
        started.set()
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # gives up the GIL, so the main thread takes it back at once

    previous = sys.getswitchinterval()
    sys.setswitchinterval(10)  # the interpreter never forces a switch within a call
    thread = threading.Thread(target=count, daemon=True)
    try:
        thread.start()
        assert started.wait(10)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            before = ticks[0]
            function(data)
            if ticks[0] > before:
                return True
        return False
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(previous)


def test_default_checksum_releases_the_gil() -> None:
    """The engine checksums on one thread while others read and write, so the default
    algorithm must drop the GIL on a large buffer.

    With a 10 s switch interval the interpreter never takes the GIL from the main thread;
    the counting thread only runs while the checksum itself has released it. The control
    below holds the GIL (copying an mmap slice and `bytes.count`: C code that never drops it)
    and must not let the counter move, or the measurement proves nothing; `zlib.crc32` and
    `hashlib` cannot serve as controls, since both release the GIL on large buffers too.
    """
    function = checksum_function(DEFAULT_ALGORITHM)
    with mmap.mmap(-1, 256 << 20) as data:  # 256 MiB of zero pages, no RSS to speak of
        assert not _runs_beside(lambda b: b[: 32 << 20].count(b"x"), data, 0.3)
        assert _runs_beside(function, data, 3)
