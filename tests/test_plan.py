"""Pure planning, table-driven: plan_layout alignment (64 B below 1 MiB, 4 KiB from 1 MiB),
plan_reads (large chunks split on block boundaries, small ones coalesced up to the gap and
size limits, one file per read, every wanted byte covered once), and match_target (missing,
unexpected, mismatched, and additions inside stateful objects)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safepoint._format import Chunk, Entry
from safepoint._plan import Read, match_target, plan_layout, plan_reads

MiB = 1 << 20
KiB = 1 << 10

# -- plan_layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "offsets", "end"),
    [
        ([], [], 0),
        ([10], [0], 10),
        ([10, 10, 64, 1], [0, 64, 128, 192], 193),
        ([0, 5], [0, 0], 5),
        ([100, MiB], [0, 4096], 4096 + MiB),  # >= 1 MiB starts on a page
        ([100, MiB - 1], [0, 128], 128 + MiB - 1),  # just below: 64 B alignment
        ([MiB + 3, 7], [0, MiB + 64], MiB + 64 + 7),
        ([MiB + 3, 2 * MiB], [0, MiB + 4096], 3 * MiB + 4096),
    ],
)
def test_plan_layout(sizes: list[int], offsets: list[int], end: int) -> None:
    items, size = plan_layout((f"p{i}", n) for i, n in enumerate(sizes))
    assert [item.offset for item in items] == offsets
    assert [item.nbytes for item in items] == sizes
    assert [item.path for item in items] == [f"p{i}" for i in range(len(sizes))]
    assert size == end


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3 * MiB), max_size=20))
def test_plan_layout_invariants(sizes: list[int]) -> None:
    items, size = plan_layout((str(i), n) for i, n in enumerate(sizes))
    previous_end = 0
    for item in items:
        assert item.offset % (4096 if item.nbytes >= MiB else 64) == 0
        assert item.offset >= previous_end, "entries never overlap"
        assert item.offset - previous_end < (4096 if item.nbytes >= MiB else 64)
        previous_end = item.offset + item.nbytes
    assert size == previous_end


# -- plan_reads ----------------------------------------------------------------------------------


def _chunk(offset: int, nbytes: int, file: str = "data/a.bin", block: int = 1024) -> Chunk:
    return Chunk(file, offset, nbytes, tuple(range(-(-nbytes // block))))


def _spans(reads: list[Read]) -> list[tuple[str, int, int]]:
    return [(r.file, r.offset, r.end) for r in reads]


def test_large_chunk_split_on_block_boundaries() -> None:
    chunk = _chunk(4096, 10 * KiB + 5)
    reads = plan_reads([("big", chunk)], block_bytes=1024, max_read_bytes=4 * KiB, max_gap=0)
    segments = [seg for read in reads for seg in read.segments]
    assert [(s.start, s.nbytes) for s in segments] == [
        (0, 4096), (4096, 4096), (8192, 2048 + 5)
    ]
    assert all(s.start % 1024 == 0 for s in segments)
    assert _spans(reads) == [
        ("data/a.bin", 4096, 8192), ("data/a.bin", 8192, 12288), ("data/a.bin", 12288, 14341)
    ]


def test_read_size_rounds_down_to_whole_blocks() -> None:
    chunk = _chunk(0, 10 * KiB)
    reads = plan_reads([("big", chunk)], block_bytes=1024, max_read_bytes=3000, max_gap=0)
    assert [seg.nbytes for read in reads for seg in read.segments] == [2048] * 5


def test_block_larger_than_max_read_reads_whole_blocks() -> None:
    chunk = _chunk(0, 5000, block=4096)
    reads = plan_reads([("x", chunk)], block_bytes=4096, max_read_bytes=1000, max_gap=0)
    assert [(s.start, s.nbytes) for r in reads for s in r.segments] == [(0, 4096), (4096, 904)]


def test_small_chunks_coalesce_within_gap() -> None:
    wanted = [("a", _chunk(0, 100)), ("b", _chunk(128, 100)), ("c", _chunk(256, 10))]
    reads = plan_reads(wanted, block_bytes=1024, max_read_bytes=MiB, max_gap=64)
    assert _spans(reads) == [("data/a.bin", 0, 266)]
    assert [s.path for s in reads[0].segments] == ["a", "b", "c"]


def test_gap_limit_splits_reads() -> None:
    wanted = [("a", _chunk(0, 100)), ("b", _chunk(164, 100)), ("c", _chunk(365, 10))]
    reads = plan_reads(wanted, block_bytes=1024, max_read_bytes=MiB, max_gap=64)
    # a..b: gap 64 (allowed); b..c: gap 101 (too far)
    assert _spans(reads) == [("data/a.bin", 0, 264), ("data/a.bin", 365, 375)]


def test_max_read_bytes_bounds_coalescing() -> None:
    wanted = [(f"p{i}", _chunk(i * 1000, 1000)) for i in range(10)]
    reads = plan_reads(wanted, block_bytes=1024, max_read_bytes=3000, max_gap=MiB)
    assert _spans(reads) == [
        ("data/a.bin", 0, 3000), ("data/a.bin", 3000, 6000),
        ("data/a.bin", 6000, 9000), ("data/a.bin", 9000, 10000),
    ]


def test_reads_are_per_file_and_in_file_order() -> None:
    wanted = [
        ("b2", _chunk(200, 50, "data/b.bin")),
        ("a1", _chunk(0, 50, "data/a.bin")),
        ("b1", _chunk(0, 50, "data/b.bin")),
        ("a2", _chunk(100, 50, "data/a.bin")),
    ]
    reads = plan_reads(wanted, block_bytes=1024, max_read_bytes=MiB, max_gap=MiB)
    assert _spans(reads) == [("data/a.bin", 0, 150), ("data/b.bin", 0, 250)]
    assert [[s.path for s in r.segments] for r in reads] == [["a1", "a2"], ["b1", "b2"]]


def test_empty_chunks_need_no_read() -> None:
    assert plan_reads([("e", _chunk(64, 0))], block_bytes=1024, max_read_bytes=MiB,
                      max_gap=0) == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20_000)), max_size=12),
    st.sampled_from([512, 1024, 4096]),
    st.integers(1, 40_000),
    st.integers(0, 5000),
)
def test_plan_reads_covers_every_byte_once(
    layout: list[tuple[int, int]], block: int, max_read: int, max_gap: int
) -> None:
    # Lay chunks out like a writer would: per file, one after another with padding.
    ends = [0, 0, 0, 0]
    wanted = []
    for index, (file, nbytes) in enumerate(layout):
        offset = -(-ends[file] // 64) * 64
        ends[file] = offset + nbytes
        wanted.append((f"p{index}", _chunk(offset, nbytes, f"data/{file}.bin", block)))
    reads = plan_reads(wanted, block_bytes=block, max_read_bytes=max_read, max_gap=max_gap)
    covered: dict[str, list[tuple[int, int]]] = {}
    for read in reads:
        assert read.segments
        previous = read.offset
        for seg in read.segments:
            assert seg.chunk.file == read.file
            assert seg.start % block == 0
            assert seg.file_offset >= previous
            assert seg.file_offset - previous <= max_gap or seg is read.segments[0]
            previous = seg.file_offset + seg.nbytes
            covered.setdefault(seg.path, []).append((seg.start, seg.nbytes))
        assert read.offset == read.segments[0].file_offset
        assert read.end - read.offset <= max(max_read, block)
        assert read.end == previous
    for path, chunk in wanted:
        pieces = sorted(covered.get(path, []))
        position = 0
        for start, nbytes in pieces:
            assert start == position
            position += nbytes
        assert position == chunk.nbytes


# -- match_target --------------------------------------------------------------------------------

T = "tensor"
ENTRIES = {
    "model/w": Entry(T, "F32", (2, 3)),
    "model/b": Entry(T, "F32", (3,)),
    "optim/state/0/exp_avg": Entry(T, "F32", (2, 3)),
    "step": Entry("value", value=5),
    "arr": Entry("ndarray", "I64", (4,)),
}


def test_match_everything() -> None:
    target = {
        "model/w": (T, "F32", (2, 3)), "model/b": (T, "F32", (3,)),
        "optim/state/0/exp_avg": (T, "F32", (2, 3)), "step": ("value", None, None),
        "arr": ("ndarray", "I64", (4,)),
    }
    match = match_target(ENTRIES, list(ENTRIES), target, list(target), [])
    assert match.ok
    assert match.load == list(ENTRIES)


def test_match_missing_unexpected_mismatched() -> None:
    target = {
        "model/w": (T, "BF16", (2, 3)),     # dtype differs
        "model/b": (T, "F32", (4,)),        # shape differs
        "arr": (T, "I64", (4,)),            # kind differs
        "step": ("value", None, None),
        "extra": (T, "F32", (1,)),          # not in the checkpoint
    }
    match = match_target(ENTRIES, list(ENTRIES), target, list(target), [])
    assert not match.ok
    assert match.missing == ["extra"]
    assert match.unexpected == ["optim/state/0/exp_avg"]
    assert match.load == ["step"]
    assert len(match.mismatched) == 3
    by_path = {line.split(":")[0]: line for line in match.mismatched}
    assert "BF16" in by_path["model/w"] and "F32" in by_path["model/w"]
    assert "[3]" in by_path["model/b"] and "[4]" in by_path["model/b"]
    assert "ndarray" in by_path["arr"] and "tensor" in by_path["arr"]


def test_plain_values_of_another_type_still_load() -> None:
    """A value replaced by a value is not a mismatch (step: int in both, or str vs int)."""
    match = match_target({"step": Entry("value", value=5)}, ["step"],
                         {"step": ("bytes", None, None)}, ["step"], [])
    assert match.ok


def test_additions_inside_a_stateful_object_load() -> None:
    """A fresh optimizer has no state yet: its saved state is not unexpected."""
    target = {"model/w": (T, "F32", (2, 3)), "model/b": (T, "F32", (3,)),
              "step": ("value", None, None), "arr": ("ndarray", "I64", (4,))}
    match = match_target(ENTRIES, list(ENTRIES), target, list(target), ["optim"])
    assert match.ok
    assert "optim/state/0/exp_avg" in match.load


def test_stateful_prefix_is_a_whole_component() -> None:
    entries = {"optimizer2/x": Entry("value", value=1)}
    match = match_target(entries, list(entries), {}, [], ["optim"])
    assert match.unexpected == ["optimizer2/x"]


def test_stateful_root_accepts_everything() -> None:
    entries = {"a": Entry("value", value=1), "b/c": Entry("value", value=2)}
    match = match_target(entries, list(entries), {}, [], [""])
    assert match.ok and match.load == ["a", "b/c"]


def test_selection_limits_missing_and_unexpected() -> None:
    target = {"model/w": (T, "F32", (2, 3)), "other": ("value", None, None)}
    match = match_target(ENTRIES, ["model/w"], target, ["model/w"], [])
    assert match.ok and match.load == ["model/w"]
