"""The engine through MemoryStorage: write_file lays entries out as planned with one digest per
block (hypothesis over sizes, block and buffer sizes), read_segments reads them back, a flipped
bit or a truncated or missing file is a problem naming file, offset and entry, and a failure on
either side of the writer thread propagates without hanging."""

from __future__ import annotations

import mmap
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _slow import SlowWrites
from safepoint import _engine
from safepoint._checksum import block_digests, checksum_function
from safepoint._engine import IOOptions, read_segments, scratch_dest, write_file
from safepoint._format import Chunk
from safepoint._plan import Read, Segment, WriteItem, plan_layout, plan_reads
from safepoint._storage_local import LocalStorage
from safepoint.errors import StorageError
from safepoint.storage import Buffer, Storage
from safepoint.testing import FaultyStorage, MemoryStorage, fail_nth

CRC = checksum_function("crc32c")
NAME = "data/f.bin"

OPTIONS = [
    pytest.param(IOOptions(), id="defaults"),
    pytest.param(IOOptions(buffer_bytes=4096, buffers=2, read_threads=1, max_read_bytes=8192,
                           max_gap=128), id="small-buffers"),
    pytest.param(IOOptions(buffer_bytes=5000, buffers=3, read_threads=4, max_read_bytes=3000,
                           max_gap=0), id="odd-buffers"),
]


def _entries(sizes: list[int], seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"e{i}": rng.randbytes(n) for i, n in enumerate(sizes)}


def _write(
    storage: MemoryStorage | FaultyStorage, data: dict[str, bytes], block: int,
    options: IOOptions,
) -> tuple[list[WriteItem], int, dict[str, list[int]]]:
    items, planned = plan_layout((path, len(b)) for path, b in data.items())
    size, digests = write_file(
        storage, NAME, [(item, memoryview(data[item.path])) for item in items],
        block_bytes=block, checksum=CRC, options=options,
    )
    assert size == planned
    return items, size, digests


def _read_back(
    storage: Storage, items: list[WriteItem], digests: dict[str, list[int]], block: int,
    options: IOOptions,
) -> tuple[dict[str, bytearray], list[str]]:
    chunks = {i.path: Chunk(NAME, i.offset, i.nbytes, tuple(digests[i.path])) for i in items}
    out = {path: bytearray(chunk.nbytes) for path, chunk in chunks.items()}
    reads = plan_reads(chunks.items(), block_bytes=block, max_read_bytes=options.max_read_bytes,
                       max_gap=options.max_gap)

    def dest(_: Read, seg: Segment) -> memoryview:
        return memoryview(out[seg.path])[seg.start : seg.start + seg.nbytes]

    problems = read_segments(storage, reads, dest, block_bytes=block, checksum=CRC,
                             options=options)
    return out, problems


@pytest.mark.parametrize("options", OPTIONS)
def test_write_file_layout_and_digests(options: IOOptions) -> None:
    block = 1000
    data = _entries([0, 10, 999, 1000, 1001, 70_000, 3, 1 << 20, 5])
    storage = MemoryStorage()
    items, size, digests = _write(storage, data, block, options)
    stored = storage.read(NAME)
    assert len(stored) == size
    end = 0
    for item in items:
        assert stored[end : item.offset] == bytes(item.offset - end), "padding is zeros"
        assert stored[item.offset : item.offset + item.nbytes] == data[item.path]
        assert digests[item.path] == block_digests(memoryview(data[item.path]), block, CRC)
        end = item.offset + item.nbytes
    assert digests["e0"] == []
    assert len(digests["e5"]) == 70


@pytest.mark.parametrize("options", OPTIONS)
def test_round_trip_through_read_segments(options: IOOptions) -> None:
    block = 4096
    data = _entries([5, 4096, 100_000, 0, 64, 300_000], seed=1)
    storage = MemoryStorage()
    items, _, digests = _write(storage, data, block, options)
    out, problems = _read_back(storage, items, digests, block, options)
    assert problems == []
    assert {p: bytes(b) for p, b in out.items()} == data


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 20_000), min_size=1, max_size=10),
    st.sampled_from([64, 1000, 4096]),
    st.sampled_from([4096, 5000, 16384]),
    st.integers(2, 4),
)
def test_write_read_hypothesis(sizes: list[int], block: int, buffer_bytes: int,
                               buffers: int) -> None:
    options = IOOptions(buffer_bytes=buffer_bytes, buffers=buffers, read_threads=2,
                        max_read_bytes=8192, max_gap=256)
    data = _entries(sizes, seed=len(sizes))
    storage = MemoryStorage()
    items, _, digests = _write(storage, data, block, options)
    for path, blob in data.items():
        assert digests[path] == block_digests(memoryview(blob), block, CRC)
    out, problems = _read_back(storage, items, digests, block, options)
    assert problems == []
    assert {p: bytes(b) for p, b in out.items()} == data


def _damaged(mutate: Callable[[bytearray], bytearray | bytes]) -> tuple[list[str], list[WriteItem]]:
    block = 1024
    options = IOOptions(read_threads=2, max_read_bytes=4096, max_gap=64)
    data = _entries([100, 5000, 300], seed=2)
    storage = MemoryStorage()
    items, _, digests = _write(storage, data, block, options)
    storage.write(NAME, [mutate(bytearray(storage.read(NAME)))])
    _, problems = _read_back(storage, items, digests, block, options)
    return problems, items


def test_flipped_bit_is_a_problem_naming_file_offset_and_entry() -> None:
    def flip(buf: bytearray) -> bytearray:
        buf[128 + 2100] ^= 0x01  # inside e1 (offset 128), its third 1024-byte block
        return buf

    problems, items = _damaged(flip)
    assert [i.offset for i in items] == [0, 128, 5184]
    assert problems == [f"{NAME} at byte {128 + 2048}: checksum mismatch in 'e1'"]


def test_flipped_bit_in_padding_is_not_a_problem() -> None:
    def flip(buf: bytearray) -> bytearray:
        buf[110] ^= 0xFF  # between e0 (0..100) and e1 (128..)
        return buf

    problems, _ = _damaged(flip)
    assert problems == []


def test_truncated_file_is_a_problem() -> None:
    problems, _ = _damaged(lambda buf: bytes(buf[:3000]))
    assert problems
    assert any(NAME in p and "truncated" in p for p in problems)
    assert any("'e1'" in p for p in problems)


@pytest.mark.parametrize("sizes", [[100], [3000, 3000, 3000]], ids=["one read", "three reads"])
def test_missing_file_is_a_problem_once(sizes: list[int]) -> None:
    """A missing file is one problem, however many reads it takes (over S3 with its shorter
    reads, each read of the file added the same problem)."""
    block = 1024
    options = IOOptions(read_threads=2, max_read_bytes=3072, max_gap=64)
    data = _entries(sizes, seed=3)
    storage = MemoryStorage()
    items, _, digests = _write(storage, data, block, options)
    storage.delete([NAME])
    _, problems = _read_back(storage, items, digests, block, options)
    assert len(problems) == 1 and problems[0].startswith(f"{NAME}: data file is missing "
                                                         "(entries 'e"), problems


def test_scratch_dest_verifies_without_keeping_bytes() -> None:
    block = 1024
    options = IOOptions(read_threads=3, max_read_bytes=2048, max_gap=64)
    data = _entries([3000, 10, 7000], seed=4)
    storage = MemoryStorage()
    items, _, digests = _write(storage, data, block, options)
    chunks = [(i.path, Chunk(NAME, i.offset, i.nbytes, tuple(digests[i.path]))) for i in items]
    reads = plan_reads(chunks, block_bytes=block, max_read_bytes=2048, max_gap=64)
    assert read_segments(storage, reads, scratch_dest(options), block_bytes=block,
                         checksum=CRC, options=options) == []
    blob = bytearray(storage.read(NAME))
    blob[items[2].offset + 5000] ^= 0x80
    storage.write(NAME, [blob])
    problems = read_segments(storage, reads, scratch_dest(options), block_bytes=block,
                             checksum=CRC, options=options)
    assert problems == [f"{NAME} at byte {items[2].offset + 4096}: checksum mismatch in 'e2'"]


@pytest.mark.parametrize("stretch", [1, 700, 1024, 2500, 1 << 20])
@pytest.mark.parametrize("damage", ["none", "flips", "truncated"])
def test_reads_checked_in_stretches_find_what_one_read_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stretch: int, damage: str
) -> None:
    """A storage that lands bytes a stretch at a time (LocalStorage) has each block checked as
    soon as it landed: the same bytes and the same problems as a storage read whole
    (MemoryStorage), whatever the stretch size."""
    monkeypatch.setattr(_engine, "_STRETCH_BYTES", stretch)
    block = 1024
    options = IOOptions(read_threads=2, max_read_bytes=6000, max_gap=64)
    data = _entries([100, 5000, 300, 9000, 1024], seed=5)
    memory, local = MemoryStorage(), LocalStorage(str(tmp_path))
    items, _, digests = _write(memory, data, block, options)
    blob = bytearray(memory.read(NAME))
    if damage == "flips":
        for at in (items[1].offset + 10, items[1].offset + 3000, items[3].offset + 8999,
                   items[4].offset):
            blob[at] ^= 0x04
    elif damage == "truncated":
        blob = blob[: items[3].offset + 4000]
    for storage in (memory, local):
        storage.write(NAME, [blob])
    (got, found), (want, expected) = (_read_back(s, items, digests, block, options)
                                      for s in (local, memory))
    assert found == expected
    assert (found == []) == (damage == "none")
    if damage != "truncated":
        assert got == want


class _CountingLocal(LocalStorage):
    """A user's subclass of the local backend that counts the bytes it reads."""

    read_bytes = 0

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.read_bytes += sum(len(b) for b in buffers)
        super().readinto(path, offset, buffers)


def test_a_subclass_that_overrides_readinto_sees_every_read(tmp_path: Path) -> None:
    """Loads read in stretches only where `readinto` is not overridden below: a subclass of
    LocalStorage (or an instance) that wraps `readinto` still sees every byte a load reads."""
    block = 1024
    options = IOOptions(read_threads=2, max_read_bytes=6000, max_gap=0)
    data = _entries([100, 5000, 300, 9000], seed=7)
    memory = MemoryStorage()
    items, _, digests = _write(memory, data, block, options)
    subclassed = _CountingLocal(str(tmp_path / "a"))
    subclassed.write(NAME, [memory.read(NAME)])
    got, problems = _read_back(subclassed, items, digests, block, options)
    assert problems == []
    assert subclassed.read_bytes == sum(item.nbytes for item in items)

    patched = LocalStorage(str(tmp_path / "b"))
    patched.write(NAME, [memory.read(NAME)])
    seen: list[int] = []
    inherited = patched.readinto

    def counting(path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        seen.append(sum(len(b) for b in buffers))
        inherited(path, offset, buffers)

    patched.readinto = counting  # type: ignore[method-assign]
    assert _read_back(patched, items, digests, block, options) == (got, [])
    assert sum(seen) == sum(item.nbytes for item in items)


# -- failures around the writer thread -----------------------------------------------------------

FAILURES = [
    pytest.param(fail_nth("write", 1), id="write-call"),
    pytest.param(fail_nth("write_chunk", 1), id="first-chunk"),
    pytest.param(fail_nth("write_chunk", 4), id="mid-stream"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("predicate", FAILURES)
def test_writer_failure_propagates_without_hanging(predicate: Callable[..., bool]) -> None:
    inner = MemoryStorage()
    storage = FaultyStorage(inner, predicate)
    options = IOOptions(buffer_bytes=4096, buffers=2)
    data = _entries([50_000, 10, 30_000])
    with pytest.raises(StorageError, match="injected"):
        _write(storage, data, 1024, options)
    assert storage.failures
    assert not inner.exists(NAME)


@pytest.mark.timeout(30)
def test_producer_failure_aborts_the_writer() -> None:
    """An item whose bytes do not match its planned size fails in the caller's thread; the
    writer must stop without completing the file."""
    storage = MemoryStorage()
    options = IOOptions(buffer_bytes=4096, buffers=2)
    items = [(WriteItem("a", 0, 10_000), memoryview(bytes(10_000))),
             (WriteItem("b", 10_048, 100), memoryview(bytes(99)))]
    with pytest.raises(ValueError):
        write_file(storage, NAME, items, block_bytes=1024, checksum=CRC, options=options)
    assert not storage.exists(NAME)


# -- large page-aligned items are written straight from their memory ------------------------


class _Recording(MemoryStorage):
    """A MemoryStorage that records which chunks were views of `source`."""

    def __init__(self, source: object) -> None:
        super().__init__()
        self.source = source
        self.direct = 0

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        def seen() -> Iterator[Buffer]:
            for chunk in chunks:
                self.direct += isinstance(chunk, memoryview) and chunk.obj is self.source
                yield chunk

        return super().write(path, seen())


def _image(data: dict[str, bytes]) -> tuple[mmap.mmap, list[WriteItem]]:
    """The entries laid out in page-aligned memory as in the file (as staging lays them)."""
    items, size = plan_layout((path, len(b)) for path, b in data.items())
    image = mmap.mmap(-1, size)
    for item in items:
        image[item.offset : item.offset + item.nbytes] = data[item.path]
    return image, items


@pytest.mark.parametrize("buffer_bytes", [1 << 20, 3 << 20, 8 << 20])
def test_large_aligned_items_are_written_from_their_memory(buffer_bytes: int) -> None:
    block = 64 << 10
    data = _entries([100, (1 << 20) + 5, 3, 3 << 20, (2 << 20) + 4097, 64, 1 << 20], seed=3)
    image, items = _image(data)
    storage = _Recording(image)
    options = IOOptions(buffer_bytes=buffer_bytes, buffers=2)
    view = memoryview(image)
    size, digests = write_file(
        storage, NAME, [(i, view[i.offset : i.offset + i.nbytes]) for i in items],
        block_bytes=block, checksum=CRC, options=options,
    )
    assert storage.direct >= 4
    assert storage.read(NAME) == image[:size]
    for item in items:
        assert digests[item.path] == block_digests(memoryview(data[item.path]), block, CRC)
    del view


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nth", [1, 2, 3, 5])
def test_writer_failure_during_direct_writes_propagates(nth: int) -> None:
    data = _entries([10, 3 << 20, 50, 2 << 20], seed=4)
    image, items = _image(data)
    inner = MemoryStorage()
    storage = FaultyStorage(inner, fail_nth("write_chunk", nth))
    view = memoryview(image)
    with pytest.raises(StorageError, match="injected"):
        write_file(storage, NAME, [(i, view[i.offset : i.offset + i.nbytes]) for i in items],
                   block_bytes=64 << 10, checksum=CRC,
                   options=IOOptions(buffer_bytes=1 << 20, buffers=2))
    assert not inner.exists(NAME)
    del view


def test_an_items_memory_may_be_reused_once_the_next_is_requested() -> None:
    """What `write_file` promises its producer (staging reuses a buffer half that way): a
    view written directly must be written before the next item is requested."""
    data = _entries([3 << 20, 2 << 20, (1 << 20) + 7], seed=5)
    items, _ = plan_layout((path, len(b)) for path, b in data.items())
    shared = mmap.mmap(-1, 3 << 20)

    def produce() -> Iterator[tuple[WriteItem, memoryview]]:
        for item in items:
            shared[: item.nbytes] = data[item.path]
            with memoryview(shared) as view:
                yield item, view[: item.nbytes]

    storage = SlowWrites(0.02)
    write_file(storage, NAME, produce(), block_bytes=64 << 10, checksum=CRC,
               options=IOOptions(buffer_bytes=1 << 20, buffers=2))
    stored = storage.read(NAME)
    for item in items:
        assert stored[item.offset : item.offset + item.nbytes] == data[item.path]


def test_meanwhile_sees_every_digest_and_the_size_before_the_file_is_done() -> None:
    data = _entries([10, 5000, 0, 300], seed=6)
    items, _ = plan_layout((path, len(b)) for path, b in data.items())
    seen: list[tuple[dict[str, list[int]], int]] = []
    storage = MemoryStorage()
    size, digests = write_file(
        storage, NAME, [(i, memoryview(data[i.path])) for i in items], block_bytes=1024,
        checksum=CRC, options=IOOptions(),
        meanwhile=lambda d, n: seen.append(({p: list(v) for p, v in d.items()}, n)),
    )
    assert seen == [(digests, size)]
    assert size == len(storage.read(NAME))
    assert digests["e1"] == block_digests(memoryview(data["e1"]), 1024, CRC)


def test_spare_is_offered_the_waits_for_the_writer_with_the_entries_copied_so_far() -> None:
    """While every buffer is in a slow writer's hands, `spare` gets the digests so far, their
    paths in file order: every one but the last is whole (an entry that comes as several
    items may be met in part), also while a large entry is copied across buffers."""
    data = _entries([3000] * 12 + [40_000] + [700] * 12, seed=9)
    items, _ = plan_layout((path, len(b)) for path, b in data.items())
    seen: list[tuple[list[str], dict[str, list[int]]]] = []

    def spare(digests: dict[str, list[int]]) -> None:
        seen.append((list(digests), {path: list(d) for path, d in digests.items()}))

    _, digests = write_file(
        SlowWrites(0.02), NAME, [(i, memoryview(data[i.path])) for i in items], block_bytes=4096,
        checksum=CRC, options=IOOptions(buffer_bytes=8192, buffers=2), spare=spare,
    )
    assert len(seen) > 5
    paths = [item.path for item in items]
    for order, partial in seen:
        assert order == paths[: len(order)] and list(partial) == order
        assert all(partial[path] == digests[path] for path in order[:-1])
        last = partial[order[-1]]
        assert digests[order[-1]][: len(last)] == last
    assert any(order[-1] == "e11" for order, _ in seen)  # while e12 spans the buffers


def test_bounce_buffers_are_handed_back_once_written() -> None:
    """A save's bounce buffers are released as soon as the writer has written them, before
    the fsync, while the caller builds the manifest: they are not part of that peak."""
    data = _entries([3000] * 200, seed=8)
    items, _ = plan_layout((path, len(b)) for path, b in data.items())

    class Keeping(MemoryStorage):
        def write(self, path: str, chunks: Iterable[Buffer]) -> int:
            seen: list[memoryview] = []
            size = super().write(path, (seen.append(memoryview(c)) or c for c in chunks))
            self.after = [bytes(view) for view in seen]  # the chunks' memory, now
            return size

    storage = Keeping()
    options = IOOptions(buffer_bytes=64 << 10, buffers=2)
    write_file(storage, NAME, [(i, memoryview(data[i.path])) for i in items],
               block_bytes=1024, checksum=CRC, options=options)
    assert len(storage.after) > 2  # both buffers were filled and reused
    assert not any(b"".join(storage.after)), "the buffers still hold the data"
    stored = storage.read(NAME)
    assert all(stored[i.offset : i.offset + i.nbytes] == data[i.path] for i in items)


@pytest.mark.timeout(30)
def test_a_failing_meanwhile_propagates_without_hanging() -> None:
    data = _entries([10, 5000], seed=7)
    items, _ = plan_layout((path, len(b)) for path, b in data.items())

    def fail(_: dict[str, list[int]], __: int) -> None:
        raise KeyError("manifest")

    with pytest.raises(KeyError, match="manifest"):
        write_file(MemoryStorage(), NAME, [(i, memoryview(data[i.path])) for i in items],
                   block_bytes=1024, checksum=CRC, options=IOOptions(), meanwhile=fail)
