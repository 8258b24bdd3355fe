"""Named checksums: known vectors of crc32c and crc32, incremental use as the engine does it,
per-block digests, and the error for an unknown algorithm."""

from __future__ import annotations

import pytest

from safepoint._checksum import DEFAULT_ALGORITHM, block_digests, checksum_function
from safepoint.errors import CorruptCheckpoint


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


def test_unknown_algorithm_names_it() -> None:
    with pytest.raises(CorruptCheckpoint, match="'md5'") as excinfo:
        checksum_function("md5")
    assert "crc32c" in str(excinfo.value)  # lists the known ones
