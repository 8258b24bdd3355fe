"""Reading pieces of global tensors (`_reshard`): `whole`, and `read_pieces` on hand-written
data files in a `MemoryStorage`, each destination checked against numpy slicing of the global
array: a piece equal to a saved one, new row splits, overlaps partial in every dimension, a
plain tensor entry read in part, 0-d and empty tensors, entries and pieces stored in several
consecutive chunks, and a hypothesis property over random save partitions (each piece in one
chunk or several) and destination boxes. Reads are checked too: every checksum block holding a
wanted byte is read whole, and nothing outside the span from the first to the last such block
of each saved piece. Problems come back as lines: destinations not covered exactly once, a
checksum mismatch in a block read (a corrupt block outside the reads goes unnoticed), missing
and truncated files. Blocks read apart from their destination go through one scratch buffer of
a bounded size, a batch at a time: in a subprocess, a column of a 256 MiB checkpoint loads
with peak memory far below the checkpoint's size."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safepoint import _reshard
from safepoint._checksum import block_digests, checksum_function
from safepoint._engine import IOOptions
from safepoint._format import DTYPE_BY_NUMPY, Box, Chunk, Entry, Manifest, box_runs
from safepoint._reshard import Want, read_pieces, whole
from safepoint.testing import MemoryStorage

#: Bytes per checksum block in these tests: small, so a piece spans many blocks.
BLOCK = 16
CRC = checksum_function("crc32c")
#: max_gap=0: a read spans only the blocks planned, so the bytes read can be checked exactly.
OPTIONS = IOOptions(max_gap=0)
PAD = b"\xee" * 8


class RecordingStorage(MemoryStorage):
    """A `MemoryStorage` that records every `readinto` as (file, start, end), and the
    buffers it filled."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int, int]] = []
        self.buffers: list[memoryview] = []

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.reads.append((path, offset, offset + sum(len(b) for b in buffers)))
        self.buffers.extend(buffers)
        super().readinto(path, offset, buffers)

    def bytes_read(self) -> set[tuple[str, int]]:
        return {(path, i) for path, start, end in self.reads for i in range(start, end)}


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(*box, strict=True))


def _write_pieces(storage: MemoryStorage, name: str, full: np.ndarray, boxes: Sequence[Box],
                  order: Sequence[int] | None = None) -> tuple[Chunk, ...]:
    """Write the pieces `boxes` of `full` into data file `name` in `order` (padding before,
    between and after them) and return their chunks, in the order of `boxes`."""
    blob = bytearray(PAD)
    chunks: dict[int, Chunk] = {}
    for index in order if order is not None else range(len(boxes)):
        box = boxes[index]
        piece = np.ascontiguousarray(full[_slices(box)]).tobytes()
        digests = tuple(block_digests(memoryview(piece), BLOCK, CRC))
        chunks[index] = Chunk(name, len(blob), len(piece), digests, box)
        blob += piece + PAD
    storage.write(name, [bytes(blob)])
    return tuple(chunks[i] for i in range(len(boxes)))


def _sharded(storage: MemoryStorage, full: np.ndarray, boxes: Sequence[Box],
             name: str = "data/a.bin", order: Sequence[int] | None = None) -> Entry:
    """A "sharded" entry of `full` saved as the pieces `boxes`."""
    return Entry("sharded", DTYPE_BY_NUMPY[full.dtype.str].name, full.shape,
                 _write_pieces(storage, name, full, boxes, order))


def _plain(storage: MemoryStorage, full: np.ndarray, name: str = "data/a.bin") -> Entry:
    """A "tensor" entry of `full` saved whole, as one chunk without a box."""
    (chunk,) = _write_pieces(storage, name, full, [((0,) * full.ndim, full.shape)])
    return Entry("tensor", DTYPE_BY_NUMPY[full.dtype.str].name, full.shape,
                 (Chunk(chunk.file, chunk.offset, chunk.nbytes, chunk.digests),))


def _manifest(storage: MemoryStorage, entries: dict[str, Entry]) -> Manifest:
    files = {name: storage.size(name) for name in storage.list("")}
    return Manifest("save", "", entries, files, None, block_bytes=BLOCK)


def _want(path: str, box: Box, dtype: Any) -> tuple[Want, np.ndarray]:
    """A destination piece, filled with a marker byte so unwritten elements show."""
    out = np.empty(box[1], dtype=dtype)
    out.reshape(-1).view(np.uint8)[:] = 0xAB
    return Want(path, box, out.reshape(-1).view(np.uint8).data), out


def _read(storage: MemoryStorage, entries: dict[str, Entry],
          wants: Sequence[Want]) -> list[str]:
    return read_pieces(storage, _manifest(storage, entries), wants, checksum=CRC,
                       options=OPTIONS)


def _needed_and_span(entry: Entry, dest: Box, itemsize: int) -> tuple[set[Any], set[Any]]:
    """Computed with numpy, not with the planner: the bytes of every block holding an
    element of `dest` (all must be read, blocks being verified whole), and the bytes from the
    first to the last such block of each chunk (nothing outside may be read)."""
    needed: set[Any] = set()
    span: set[Any] = set()
    for box, chunks in box_runs(entry.chunks):
        box = box or whole(entry)
        index = np.arange(math.prod(box[1])).reshape(box[1])
        inside = tuple(slice(max(d - s, 0), max(min(d + dn, s + sn) - s, 0))
                       for s, sn, d, dn in zip(*box, *dest, strict=True))
        # element e holds bytes e * itemsize .. (e + 1) * itemsize - 1 of the piece
        wanted = {b for e in index[inside].reshape(-1).tolist()
                  for b in range(e * itemsize, (e + 1) * itemsize)}
        low = 0  # where the chunk's bytes start in the piece's
        for chunk in chunks:
            blocks = sorted({(b - low) // BLOCK for b in wanted
                             if low <= b < low + chunk.nbytes})
            low += chunk.nbytes
            if not blocks:
                continue
            for b in blocks:
                end = min((b + 1) * BLOCK, chunk.nbytes)
                needed |= {(chunk.file, chunk.offset + i) for i in range(b * BLOCK, end)}
            end = min((blocks[-1] + 1) * BLOCK, chunk.nbytes)
            span |= {(chunk.file, chunk.offset + i) for i in range(blocks[0] * BLOCK, end)}
    return needed, span


def _check_reads(storage: RecordingStorage, entry: Entry, dest: Box, itemsize: int) -> None:
    needed, span = _needed_and_span(entry, dest, itemsize)
    read = storage.bytes_read()
    assert needed <= read, f"unread bytes of needed blocks: {sorted(needed - read)[:5]}"
    assert read <= span, f"read outside the span: {sorted(read - span)[:5]}"


# -- whole ---------------------------------------------------------------------------------------


def test_whole() -> None:
    assert whole(Entry("tensor", "F32", (3, 4))) == ((0, 0), (3, 4))
    assert whole(Entry("sharded", "I64", (0, 5, 1))) == ((0, 0, 0), (0, 5, 1))
    assert whole(Entry("tensor", "F32", ())) == ((), ())  # 0-d
    assert whole(Entry("bytes")) == ((), ())  # no shape


# -- exact results ------------------------------------------------------------------------------

ROWS = [((0, 0), (4, 3)), ((4, 0), (3, 3)), ((7, 0), (3, 3))]


def _rows() -> tuple[RecordingStorage, np.ndarray, Entry]:
    """A 10x3 int32 tensor saved as the three row pieces of `ROWS`, and its storage."""
    storage = RecordingStorage()
    full = np.arange(30, dtype="<i4").reshape(10, 3)
    return storage, full, _sharded(storage, full, ROWS)


def test_destination_equal_to_a_saved_piece_reads_only_that_piece_straight_in() -> None:
    storage, full, entry = _rows()
    want, out = _want("t", ((4, 0), (3, 3)), full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert np.array_equal(out, full[4:7])
    chunk = entry.chunks[1]
    assert storage.bytes_read() == {(chunk.file, chunk.offset + i) for i in range(chunk.nbytes)}
    # no bounce buffer: the storage filled the destination's own memory
    assert any(np.shares_memory(np.asarray(buffer), out) for buffer in storage.buffers)


def test_a_new_row_split_joins_two_saved_pieces() -> None:
    storage, full, entry = _rows()
    box = ((2, 0), (4, 3))  # rows 2..6: the end of the first piece, the start of the second
    want, out = _want("t", box, full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert np.array_equal(out, full[2:6])
    _check_reads(storage, entry, box, 4)
    assert all(path == "data/a.bin" and end <= entry.chunks[2].offset
               for path, _, end in storage.reads), "the third piece is not read"


def test_overlap_partial_in_every_dimension() -> None:
    """A (6, 5, 4) float64 tensor saved as a 2 x 2 x 2 grid of uneven boxes, read back as a
    box crossing all eight of them and as a box inside one corner."""
    storage = RecordingStorage()
    full = np.random.default_rng(0).standard_normal((6, 5, 4))
    cuts = [(0, 2, 6), (0, 3, 5), (0, 1, 4)]
    boxes = [((a0, b0, c0), (a1 - a0, b1 - b0, c1 - c0))
             for a0, a1 in itertools.pairwise(cuts[0])
             for b0, b1 in itertools.pairwise(cuts[1])
             for c0, c1 in itertools.pairwise(cuts[2])]
    entry = _sharded(storage, full, boxes, order=[5, 2, 7, 0, 1, 6, 3, 4])
    for box in [((1, 1, 0), (4, 3, 3)), ((3, 3, 2), (2, 2, 2))]:
        storage.reads.clear()
        want, out = _want("t", box, full.dtype)
        assert _read(storage, {"t": entry}, [want]) == []
        assert out.tobytes() == full[_slices(box)].tobytes()
        _check_reads(storage, entry, box, 8)


def test_a_plain_tensor_entry_read_in_part() -> None:
    """A piece of an entry saved whole (its chunk has no box) reads only the blocks around
    its rows."""
    storage = RecordingStorage()
    full = np.arange(400, dtype="<i2").reshape(40, 10)
    entry = _plain(storage, full)
    box = ((30, 2), (3, 5))
    want, out = _want("t", box, full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert np.array_equal(out, full[30:33, 2:7])
    _check_reads(storage, entry, box, 2)
    assert len(storage.bytes_read()) < entry.chunks[0].nbytes // 4


def _split(storage: MemoryStorage, full: np.ndarray, cuts: Sequence[int],
           boxes: Sequence[Box] | None = None) -> Entry:
    """An entry of `full` whose bytes are consecutive chunks cut at byte offsets `cuts`,
    stored out of order in two files (as an incremental save stores them): a "tensor" entry,
    or with `boxes` a "sharded" entry of those pieces, each piece's bytes cut at the `cuts`
    inside it and its chunks carrying its box."""
    rows: list[tuple[Box | None, bytes]] = []  # (box, bytes) of each chunk, in table order
    for box in boxes or [None]:
        data = (full if box is None else np.ascontiguousarray(full[_slices(box)])).tobytes()
        bounds = [0, *(cut for cut in cuts if cut < len(data)), len(data)]
        rows += [(box, data[low:high]) for low, high in itertools.pairwise(bounds)]
    blobs = {"data/a.bin": bytearray(PAD), "data/b.bin": bytearray(PAD)}
    chunks: dict[int, Chunk] = {}
    for n in reversed(range(len(rows))):
        box, piece = rows[n]
        name = "data/a.bin" if n % 2 else "data/b.bin"
        chunks[n] = Chunk(name, len(blobs[name]), len(piece),
                          tuple(block_digests(memoryview(piece), BLOCK, CRC)), box)
        blobs[name] += piece + PAD
    for name, blob in blobs.items():
        storage.write(name, [bytes(blob)])
    return Entry("tensor" if boxes is None else "sharded", DTYPE_BY_NUMPY[full.dtype.str].name,
                 full.shape, tuple(chunks[n] for n in range(len(rows))))


@pytest.mark.parametrize("box", [((0, 0), (40, 10)), ((7, 2), (20, 5)), ((30, 0), (3, 10))])
def test_an_entry_in_several_chunks(box: Box) -> None:
    """An entry whose bytes are the concatenation of several chunks (cut anywhere, even
    inside a row, in any order in any file) reads whole or in part from the right chunks."""
    storage = RecordingStorage()
    full = np.arange(400, dtype="<i2").reshape(40, 10)
    entry = _split(storage, full, [96, 101, 480])
    want, out = _want("t", box, full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert np.array_equal(out, full[_slices(box)])
    _check_reads(storage, entry, box, 2)


#: A 40x10 tensor as three pieces: a column split of rows 0..15, and rows 16..39.
GRID = [((0, 0), (16, 6)), ((0, 6), (16, 4)), ((16, 0), (24, 10))]


@pytest.mark.parametrize("box", [((0, 0), (40, 10)), ((7, 2), (20, 5)), ((5, 0), (1, 10)),
                                 ((30, 0), (1, 10))],
                         ids=["whole", "across-pieces", "row-across-columns", "row"])
def test_a_sharded_entry_whose_pieces_lie_in_several_chunks(box: Box) -> None:
    """Each piece stored as consecutive chunks with its box, cut at block boundaries and
    spread over two files (as an incremental save in a process group stores it), reads
    whole or in part from the right chunks."""
    storage = RecordingStorage()
    full = np.arange(400, dtype="<i2").reshape(40, 10)
    entry = _split(storage, full, [2 * BLOCK, 6 * BLOCK, 10 * BLOCK, 20 * BLOCK], GRID)
    assert [c.nbytes for c in entry.chunks] == [32, 64, 64, 32, 32, 64, 32,
                                                32, 64, 64, 160, 160]
    assert {c.file for c in entry.chunks} == {"data/a.bin", "data/b.bin"}
    want, out = _want("t", box, full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert np.array_equal(out, full[_slices(box)])
    _check_reads(storage, entry, box, 2)


def test_two_destinations_of_one_entry_are_refused() -> None:
    """Landings are kept per entry and saved chunk: a second piece of the same entry would
    silently take the first one's place, so it is a caller's error."""
    storage = RecordingStorage()
    full = np.arange(400, dtype="<i2").reshape(40, 10)
    entry = _plain(storage, full)
    first, _ = _want("t", ((0, 0), (3, 10)), full.dtype)
    second, _ = _want("t", ((3, 0), (3, 10)), full.dtype)
    with pytest.raises(ValueError, match="one Want per entry"):
        _read(storage, {"t": entry}, [first, second])
    assert storage.bytes_read() == set()


def test_a_0d_tensor() -> None:
    storage = RecordingStorage()
    full = np.array(2.5, dtype="<f8")
    entry = _plain(storage, full)
    want, out = _want("t", whole(entry), full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert out.shape == () and out == 2.5


def test_an_empty_destination_reads_nothing() -> None:
    storage, full, entry = _rows()
    want, out = _want("t", ((5, 0), (0, 3)), full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert out.size == 0 and storage.reads == []


def test_an_empty_global_tensor() -> None:
    storage = RecordingStorage()
    full = np.zeros((0, 3), dtype="<f4")
    entry = _sharded(storage, full, [((0, 0), (0, 3))])
    want, out = _want("t", whole(entry), full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert out.shape == (0, 3) and storage.reads == []


def test_several_entries_in_several_files() -> None:
    storage = RecordingStorage()
    a = np.arange(30, dtype="<i4").reshape(10, 3)
    b = np.arange(64, dtype="|u1").reshape(8, 8)
    entries = {
        "a": _sharded(storage, a, ROWS, name="data/a.bin"),
        "b": _sharded(storage, b, [((0, 0), (8, 4)), ((0, 4), (8, 4))], name="data/b.bin"),
    }
    want_a, out_a = _want("a", ((3, 1), (6, 2)), a.dtype)
    want_b, out_b = _want("b", ((2, 2), (3, 5)), b.dtype)
    assert _read(storage, entries, [want_a, want_b]) == []
    assert np.array_equal(out_a, a[3:9, 1:3])
    assert np.array_equal(out_b, b[2:5, 2:7])
    assert {path for path, _, _ in storage.reads} == {"data/a.bin", "data/b.bin"}


# -- property: any save partition, any destination box ------------------------------------------


def _cuts(n: int) -> st.SearchStrategy[list[int]]:
    """Cut points 0 = c0 <= c1 <= ... = n of one dimension (equal cuts give empty pieces)."""
    return st.lists(st.integers(0, n), max_size=3).map(lambda inner: sorted([0, n, *inner]))


def _case(shape: tuple[int, ...]) -> st.SearchStrategy[Any]:
    def box(starts: tuple[int, ...]) -> st.SearchStrategy[Box]:
        sizes = st.tuples(*(st.integers(0, n - s) for s, n in zip(starts, shape, strict=True)))
        return sizes.map(lambda size: (starts, size))

    dest = st.tuples(*(st.integers(0, n) for n in shape)).flatmap(box)
    return st.tuples(st.just(shape), st.tuples(*(_cuts(n) for n in shape)), dest)


@settings(max_examples=80, deadline=None)
@given(
    case=st.lists(st.integers(1, 6), max_size=3).map(tuple).flatmap(_case),
    dtype=st.sampled_from(["<i4", "|u1", "<f8", "<i2"]),
    max_read_bytes=st.sampled_from([BLOCK, 3 * BLOCK, 1 << 20]),
    chunk_blocks=st.sampled_from([None, 1, 2]),
    scratch=st.sampled_from([None, BLOCK, 3 * BLOCK]),
    data=st.data(),
)
def test_any_partition_any_destination(case: Any, dtype: str, max_read_bytes: int,
                                       chunk_blocks: int | None, scratch: int | None,
                                       data: st.DataObject) -> None:
    """Pieces in one chunk each, or each in chunks of `chunk_blocks` blocks; blocks read
    apart through the default scratch memory, or through `scratch` bytes, a batch at a time."""
    shape, cuts, dest = case
    full = np.arange(math.prod(shape), dtype=dtype).reshape(shape)
    spans_per_dim = [list(itertools.pairwise(c)) for c in cuts]
    boxes: list[Box] = [(tuple(lo for lo, _ in spans), tuple(hi - lo for lo, hi in spans))
                        for spans in itertools.product(*spans_per_dim)]
    order = data.draw(st.permutations(range(len(boxes))))
    storage = RecordingStorage()
    if chunk_blocks is None:
        entry = _sharded(storage, full, boxes, order=order)
    else:
        step = chunk_blocks * BLOCK
        entry = _split(storage, full, range(step, full.nbytes, step), [boxes[i] for i in order])
    want, out = _want("t", dest, full.dtype)
    with pytest.MonkeyPatch.context() as patch:
        if scratch is not None:
            patch.setattr(_reshard, "_SCRATCH_BYTES", scratch)
        problems = read_pieces(storage, _manifest(storage, {"t": entry}), [want], checksum=CRC,
                               options=IOOptions(max_gap=0, max_read_bytes=max_read_bytes))
    assert problems == []
    assert out.tobytes() == np.ascontiguousarray(full[_slices(dest)]).tobytes()
    _check_reads(storage, entry, dest, full.itemsize)


# -- problems -----------------------------------------------------------------------------------


def test_a_gap_in_the_saved_pieces_is_a_problem_only_where_wanted() -> None:
    storage = RecordingStorage()
    full = np.arange(30, dtype="<i4").reshape(10, 3)
    entry = _sharded(storage, full, [((0, 0), (4, 3)), ((6, 0), (4, 3))])  # rows 4, 5 missing
    want, _ = _want("t", whole(entry), full.dtype)
    (problem,) = _read(storage, {"t": entry}, [want])
    assert problem.startswith("'t': ")
    assert "cover 24 of the destination's 30 elements" in problem
    want, out = _want("t", ((6, 1), (4, 2)), full.dtype)  # inside the second piece: fine
    assert _read(storage, {"t": entry}, [want]) == []
    assert np.array_equal(out, full[6:, 1:])


def test_overlapping_saved_pieces_are_a_problem_only_where_they_overlap() -> None:
    storage = RecordingStorage()
    full = np.arange(30, dtype="<i4").reshape(10, 3)
    entry = _sharded(storage, full, [((0, 0), (6, 3)), ((4, 0), (6, 3))])
    want, _ = _want("t", ((3, 0), (3, 3)), full.dtype)
    (problem,) = _read(storage, {"t": entry}, [want])
    assert "'t': saved pieces overlap at [4, 0] (shape [2, 3])" in problem
    want, out = _want("t", ((0, 0), (4, 3)), full.dtype)
    assert _read(storage, {"t": entry}, [want]) == []
    assert np.array_equal(out, full[:4])


def test_a_problem_in_one_destination_is_reported_beside_a_good_one() -> None:
    storage = RecordingStorage()
    full = np.arange(30, dtype="<i4").reshape(10, 3)
    entries = {"good": _sharded(storage, full, ROWS, name="data/g.bin"),
               "bad": _sharded(storage, full, ROWS[:2], name="data/b.bin")}
    problems = _read(storage, entries, [_want("good", ((0, 0), (10, 3)), full.dtype)[0],
                                        _want("bad", ((0, 0), (10, 3)), full.dtype)[0]])
    assert len(problems) == 1 and problems[0].startswith("'bad': ")


def _corrupt(storage: MemoryStorage, name: str, at: int) -> None:
    data = bytearray(storage.read(name))
    data[at] ^= 0x40
    storage.write(name, [bytes(data)])


def test_a_corrupt_block_is_found_when_read_and_only_then() -> None:
    full = np.arange(400, dtype="<i4").reshape(40, 10)  # 40 bytes a row: 2.5 blocks
    box = ((30, 0), (2, 10))  # rows 30, 31: bytes 1200..1280 of the chunk, blocks 75..79
    for at, found in [(1210, True), (1279, True), (1190, False), (1290, False), (8, False)]:
        storage = RecordingStorage()
        entry = _plain(storage, full)
        chunk = entry.chunks[0]
        _corrupt(storage, chunk.file, chunk.offset + at)
        want, out = _want("t", box, full.dtype)
        problems = _read(storage, {"t": entry}, [want])
        if found:
            block_start = chunk.offset + at // BLOCK * BLOCK
            assert problems == [f"data/a.bin at byte {block_start}: checksum mismatch in 't'"]
        else:
            assert problems == [], at
            assert np.array_equal(out, full[30:32])


def test_a_missing_data_file() -> None:
    storage, full, entry = _rows()
    manifest = _manifest(storage, {"t": entry})
    storage.delete(["data/a.bin"])
    want, _ = _want("t", ((2, 0), (5, 3)), full.dtype)
    problems = read_pieces(storage, manifest, [want], checksum=CRC, options=OPTIONS)
    assert problems and all(p.startswith("data/a.bin: data file is missing") for p in problems)


def test_a_truncated_data_file() -> None:
    storage, full, entry = _rows()
    manifest = _manifest(storage, {"t": entry})
    last = entry.chunks[2]
    storage.write("data/a.bin", [storage.read("data/a.bin", 0, last.offset + 10)])
    want, _ = _want("t", ((5, 0), (5, 3)), full.dtype)
    problems = read_pieces(storage, manifest, [want], checksum=CRC, options=OPTIONS)
    assert any(p.startswith("data/a.bin: truncated before byte") for p in problems), problems


def test_a_file_shorter_than_the_blocks_read_apart_is_found_before_any_buffer() -> None:
    """Blocks read apart (here a column of row pieces) land in a buffer of whole blocks
    first, which was allocated at the size the manifest records before any read found the
    file short: a block of 2**62 bytes in an edited manifest was a MemoryError. The file's
    size is measured first: a problem, as sp.verify words it, and nothing read."""
    storage, full, entry = _rows()
    manifest = _manifest(storage, {"t": entry})
    last = entry.chunks[2]
    storage.write("data/a.bin", [storage.read("data/a.bin", 0, last.offset + 10)])
    storage.reads.clear()
    want, _ = _want("t", ((0, 1), (10, 1)), full.dtype)
    problems = read_pieces(storage, manifest, [want], checksum=CRC, options=OPTIONS)
    assert problems == [f"data/a.bin: truncated to {last.offset + 10} bytes of the "
                        f"{manifest.files['data/a.bin']} the manifest records"]
    assert storage.reads == []

@pytest.mark.parametrize("box", [((0, 0), (10, 3)), ((4, 0), (3, 3))])
def test_nothing_read_is_left_unverified(box: Box) -> None:
    """Every byte of every saved chunk the read touched is covered by a digest check: a
    corrupt byte anywhere inside the destination's rows is reported."""
    full = np.arange(30, dtype="<i4").reshape(10, 3)
    for row in range(box[0][0], box[0][0] + box[1][0]):
        storage = RecordingStorage()
        entry = _sharded(storage, full, ROWS)
        chunk = next(c for c in entry.chunks if c.box and c.box[0][0] <= row
                     < c.box[0][0] + c.box[1][0])
        assert chunk.box is not None
        _corrupt(storage, "data/a.bin", chunk.offset + (row - chunk.box[0][0]) * 12 + 5)
        want, _ = _want("t", box, full.dtype)
        (problem,) = _read(storage, {"t": entry}, [want])
        assert "checksum mismatch in 't'" in problem


# -- scratch memory -----------------------------------------------------------------------------


def test_blocks_read_apart_land_in_one_scratch_buffer_a_batch_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two columns of row pieces (100 blocks) read through scratch memory of two blocks: one
    buffer of that size takes every batch (not a buffer per saved piece, as large as the
    piece, all held at once), windows of one block read exactly the blocks holding wanted
    bytes, and a corrupt block in the last batch is still found."""
    monkeypatch.setattr(_reshard, "_SCRATCH_BYTES", 2 * BLOCK)
    full = np.arange(400, dtype="<i4").reshape(40, 10)
    for corrupt in [False, True]:
        storage = RecordingStorage()
        entry = _sharded(storage, full, [((0, 0), (16, 10)), ((16, 0), (24, 10))])
        box = ((0, 3), (40, 2))  # bytes 12..20 of each 40-byte row
        last = entry.chunks[1]
        if corrupt:
            _corrupt(storage, last.file, last.offset + last.nbytes - 25)  # row 39, column 3
        want, out = _want("t", box, full.dtype)
        problems = _read(storage, {"t": entry}, [want])
        scratch = {id(buffer.obj): len(buffer.obj) for buffer in storage.buffers}
        assert list(scratch.values()) == [2 * BLOCK]
        if corrupt:
            block = last.offset + (last.nbytes - 25) // BLOCK * BLOCK
            assert problems == [f"data/a.bin at byte {block}: checksum mismatch in 't'"]
            continue
        assert problems == []
        assert np.array_equal(out, full[:, 3:5])
        needed, _ = _needed_and_span(entry, box, 4)
        assert storage.bytes_read() == needed


#: Saves a 256 MiB tensor as one piece, frees it, and loads a quarter of its columns into a
#: piece made before the load: prints how far the load grew the process, then whether the
#: piece holds the right values.
_COLUMN_LOAD = textwrap.dedent("""
    import sys
    import torch
    import safepoint as sp
    from _rss import growth_during

    url, rows = sys.argv[1], 8192
    full = torch.arange(rows * rows, dtype=torch.int32).reshape(rows, rows)
    sp.save(url, {"w": sp.Shard(full, (0, 0), (rows, rows))})
    del full
    piece = torch.zeros(rows, rows // 4, dtype=torch.int32)
    target = {"w": sp.Shard(piece, (0, rows // 4), (rows, rows))}
    print(growth_during(lambda: sp.load(url, into=target)))
    columns = torch.arange(rows // 4, rows // 2, dtype=torch.int32)
    print(torch.equal(piece, torch.arange(rows, dtype=torch.int32)[:, None] * rows + columns))
""")


def test_a_column_of_a_large_checkpoint_loads_in_bounded_memory(tmp_path: Path) -> None:
    """A column split of a tensor saved by rows (FSDP's pieces loaded into a tensor-parallel
    layer) reads every saved block apart from its destination: the load held them all at
    once (256 MiB here, each rank's whole checkpoint). Now they go through scratch memory of
    `_SCRATCH_BYTES` (64 MiB), whatever the checkpoint's size."""
    child = subprocess.run([sys.executable, "-c", _COLUMN_LOAD, str(tmp_path / "ckpt")],
                           capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parent)
    assert child.returncode == 0, child.stderr[-2000:]
    grown, right = child.stdout.split()
    assert right == "True"
    assert int(grown) < 96 << 20, f"the load grew the process by {int(grown) >> 20} MiB"
