"""Pure planning (engine layer): where each entry goes in a data file, which byte ranges a load
reads, and how a target state matches a manifest. No I/O here, so all of it is tested directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ._format import Chunk, Entry, aligned
from ._leaves import NDARRAY, TENSOR
from ._types import StatePath

__all__ = ["Match", "Read", "Segment", "WriteItem", "match_target", "plan_layout", "plan_reads"]


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One entry's place in a data file."""

    path: StatePath
    offset: int
    nbytes: int


def plan_layout(sizes: Iterable[tuple[StatePath, int]]) -> tuple[list[WriteItem], int]:
    """Pack entries one after another in one file, each aligned (see `_format.aligned`), in
    the order given. Returns the items and the file's size."""
    items = []
    end = 0
    for path, nbytes in sizes:
        offset = aligned(end, nbytes)
        items.append(WriteItem(path, offset, nbytes))
        end = offset + nbytes
    return items, end


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of whole checksum blocks of one chunk, read and verified together.

    Attributes:
        path: the entry it belongs to.
        chunk: the chunk.
        start: byte offset inside the chunk (a multiple of the block size).
        nbytes: bytes in the run.
    """

    path: StatePath
    chunk: Chunk
    start: int
    nbytes: int

    @property
    def file_offset(self) -> int:
        """Where the run starts in its data file."""
        return self.chunk.offset + self.start


@dataclass(frozen=True, slots=True)
class Read:
    """One ranged read of a data file covering several segments in file order; the bytes
    between segments (alignment padding, entries not wanted) are read and dropped."""

    file: str
    offset: int
    end: int
    segments: tuple[Segment, ...]


def plan_reads(
    wanted: Iterable[tuple[StatePath, Chunk]],
    *,
    block_bytes: int,
    max_read_bytes: int,
    max_gap: int,
) -> list[Read]:
    """Cover every wanted chunk with reads of at most about `max_read_bytes`: large chunks split
    on block boundaries so threads share them, small ones coalesced while the gap between them
    stays under `max_gap`."""
    step = max(block_bytes, max_read_bytes // block_bytes * block_bytes)
    segments = []
    for path, chunk in wanted:
        if chunk.nbytes <= step:
            if chunk.nbytes:
                segments.append(Segment(path, chunk, 0, chunk.nbytes))
            continue
        segments.extend(
            Segment(path, chunk, start, min(step, chunk.nbytes - start))
            for start in range(0, chunk.nbytes, step)
        )
    segments.sort(key=lambda s: (s.chunk.file, s.chunk.offset + s.start))
    reads: list[Read] = []
    group: list[Segment] = []
    for seg in segments:
        if group:
            head, last_end = group[0], group[-1].file_offset + group[-1].nbytes
            if (
                seg.chunk.file != head.chunk.file
                or seg.file_offset - last_end > max_gap
                or seg.file_offset + seg.nbytes - head.file_offset > max_read_bytes
            ):
                reads.append(_read(group))
                group = []
        group.append(seg)
    if group:
        reads.append(_read(group))
    return reads


def _read(group: Sequence[Segment]) -> Read:
    last = group[-1]
    return Read(group[0].chunk.file, group[0].file_offset, last.file_offset + last.nbytes,
                tuple(group))


@dataclass(slots=True)
class Match:
    """How a target state lines up with a manifest.

    Attributes:
        load: checkpoint paths to load.
        missing: selected target paths the checkpoint lacks.
        unexpected: selected checkpoint paths the target lacks (outside stateful objects).
        mismatched: paths whose kind, dtype or shape differ, with what differs.
    """

    load: list[StatePath] = field(default_factory=list)
    missing: list[StatePath] = field(default_factory=list)
    unexpected: list[StatePath] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is missing, unexpected or mismatched."""
        return not (self.missing or self.unexpected or self.mismatched)


def match_target(
    entries: Mapping[StatePath, Entry],
    selected: Iterable[StatePath],
    target: Mapping[StatePath, tuple[str, str | None, tuple[int, ...] | None]],
    target_selected: Iterable[StatePath],
    stateful_paths: Iterable[StatePath],
) -> Match:
    """Match selected checkpoint entries against a target's leaves, given as path ->
    `(kind, dtype, shape)`.

    A checkpoint path absent from the target is unexpected unless it lies inside a stateful
    object of the target, whose `load_state_dict` then receives it (a fresh optimizer has no
    state yet).
    """
    match = Match()
    prefixes = tuple(p + "/" for p in stateful_paths if p) + (("",) if "" in stateful_paths else ())
    selected = list(selected)
    chosen = set(selected)
    for path in selected:
        entry = entries[path]
        if path not in target:
            if prefixes and path.startswith(prefixes):
                match.load.append(path)
            else:
                match.unexpected.append(path)
            continue
        problem = _difference(entry, target[path])
        if problem:
            match.mismatched.append(f"{path}: {problem}")
        else:
            match.load.append(path)
    match.missing = [p for p in target_selected if p not in chosen]
    return match


def _difference(entry: Entry, target: tuple[str, str | None, tuple[int, ...] | None]) -> str:
    kind, dtype, shape = target
    if entry.kind in (TENSOR, NDARRAY) or kind in (TENSOR, NDARRAY):
        if entry.kind != kind:
            return f"checkpoint has a {entry.kind}, target a {kind}"
        if entry.dtype != dtype:
            return f"checkpoint dtype {entry.dtype}, target {dtype}"
        if entry.shape != shape:
            return f"checkpoint shape {list(entry.shape or ())}, target {list(shape or ())}"
    return ""
