"""Read pieces of global tensors (engine layer): fill each destination piece from the saved
pieces that overlap it, reading only the checksum blocks those overlaps touch, whatever split
the checkpoint was written with. A whole tensor is the piece that covers everything.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._engine import IOOptions, read_segments
from ._format import DTYPES, Box, Chunk, Entry, Manifest, box_runs
from ._plan import Read, Run, Segment, copy_runs, coverage_problem, plan_ranged_reads
from ._types import StatePath
from .errors import CorruptCheckpoint
from .storage import Storage

__all__ = ["Want", "read_pieces", "whole"]

Checksum = Callable[..., int]


@dataclass(frozen=True, slots=True)
class Want:
    """A destination piece of a tensor entry.

    Attributes:
        path: the entry.
        box: where the piece lies in the entry's global tensor.
        view: the piece's bytes in row-major order, to fill.
    """

    path: StatePath
    box: Box
    view: memoryview


def whole(entry: Entry) -> Box:
    """The box of an entry's whole tensor."""
    shape = entry.shape or ()
    return (0,) * len(shape), tuple(shape)


#: Blocks read apart from their destination (a column of row pieces) land in scratch memory
#: before their bytes are copied into place, at most this much at a time: a batch of windows
#: read in parallel, copied, and the memory reused for the next, so that what a load sets
#: aside does not grow with the checkpoint (it held every such block at once: a column split
#: of 256 MiB saved as row pieces grew each rank by 261 MiB).
_SCRATCH_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class _Landing:
    """Blocks `[start, end)` of a saved chunk read apart from their destination: they land in
    scratch memory, from which `runs` (source offsets in the chunk's bytes, all inside the
    span) copy them into `dest` once they are checked."""

    path: StatePath
    chunk: Chunk
    start: int
    end: int
    runs: list[Run]
    dest: memoryview


def read_pieces(
    storage: Storage, manifest: Manifest, wants: Sequence[Want], *, checksum: Checksum,
    options: IOOptions,
) -> list[str]:
    """Fill every wanted piece (at most one per entry), verifying every block read. A chunk
    that lands whole and contiguous is read straight into place; blocks of any other are read
    in windows of whole blocks into scratch memory of at most about `_SCRATCH_BYTES` (a
    window for each reading thread), a batch at a time, and copied into place once checked.

    Returns:
        one line per problem (a destination the saved pieces do not cover exactly once, a
        checksum mismatch, missing or truncated data; the reads stop after the first batch
        that found one); empty when all is well, and only then are the destinations complete.
    """
    if len({want.path for want in wants}) != len(wants):
        raise ValueError("read_pieces takes at most one Want per entry")
    block = manifest.block_bytes
    window = max(block, min(options.max_read_bytes,
                            _SCRATCH_BYTES // max(options.read_threads, 1)) // block * block)
    problems: list[str] = []
    straight: list[tuple[StatePath, Chunk, int, int]] = []
    # By chunk object: two pieces of a crafted manifest may name the same bytes.
    into: dict[tuple[StatePath, int], memoryview] = {}
    apart: list[_Landing] = []
    for want in wants:
        entry = manifest.entries[want.path]
        itemsize = DTYPES[entry.dtype or "U8"].itemsize
        problem, overlaps = _overlaps(entry, want.box, itemsize)
        if problem:
            problems.append(f"{want.path!r}: {problem}")
            continue
        for chunk, runs in overlaps:
            if len(runs) == 1 and runs[0].source == 0 and runs[0].nbytes == chunk.nbytes:
                into[(want.path, id(chunk))] = want.view[runs[0].dest : runs[0].dest + chunk.nbytes]
                straight.append((want.path, chunk, 0, chunk.nbytes))
                continue
            for _, part in _cut(runs, [*range(0, chunk.nbytes, window), chunk.nbytes]):
                first, last = part[0].source, part[-1].source + part[-1].nbytes
                end = min(chunk.nbytes, -(-last // block) * block)
                apart.append(_Landing(want.path, chunk, first // block * block, end, part,
                                      want.view))
    if problems:
        return problems
    problems = _short_files(storage, manifest, [(land.chunk, land.end) for land in apart])
    if problems:
        return problems
    budget = max(_SCRATCH_BYTES, window)
    batches: list[list[_Landing]] = []
    used = budget
    for landing in apart:
        if used + landing.end - landing.start > budget:
            batches.append([])
            used = 0
        batches[-1].append(landing)
        used += landing.end - landing.start
    scratch = memoryview(bytearray(min(budget, sum(land.end - land.start for land in apart))))
    landed: dict[tuple[StatePath, int, int], memoryview] = {}

    def dest(_: Read, seg: Segment) -> memoryview:
        view = landed.get((seg.path, id(seg.chunk), seg.start))
        if view is None:  # a chunk read straight into place, perhaps in several reads
            return into[(seg.path, id(seg.chunk))][seg.start : seg.start + seg.nbytes]
        return view

    reads = plan_ranged_reads(straight, block_bytes=block,
                              max_read_bytes=options.max_read_bytes, max_gap=options.max_gap)
    for batch in batches or [[]]:  # the chunks read straight into place go with the first
        landed.clear()
        at = 0
        for landing in batch:
            size = landing.end - landing.start
            landed[(landing.path, id(landing.chunk), landing.start)] = scratch[at : at + size]
            at += size
        # Reads of a window at most: each reading thread has one.
        reads += plan_ranged_reads(
            [(land.path, land.chunk, land.start, land.end) for land in batch],
            block_bytes=block, max_read_bytes=window, max_gap=options.max_gap,
        )
        problems = read_segments(storage, reads, dest, block_bytes=block, checksum=checksum,
                                 options=options)
        if problems:
            return problems
        reads = []
        for landing in batch:
            buffer = landed[(landing.path, id(landing.chunk), landing.start)]
            for run in landing.runs:
                source = run.source - landing.start
                landing.dest[run.dest : run.dest + run.nbytes] = buffer[
                    source : source + run.nbytes
                ]
    return []


def _short_files(
    storage: Storage, manifest: Manifest, spans: Sequence[tuple[Chunk, int]]
) -> list[str]:
    """One problem per data file that ends before a span (a chunk, up to its byte `end`)
    that blocks are read from apart, to be checked whole before their bytes are copied: the
    file's real size is measured before a buffer is set aside for them, since the manifest's
    sizes (a block, a chunk: 2**62 bytes in an edited one) are no bound on memory."""
    ends: dict[str, int] = {}
    for chunk, end in spans:
        ends[chunk.file] = max(ends.get(chunk.file, 0), chunk.offset + end)
    problems = []
    for file, end in ends.items():
        try:
            actual = storage.size(file)
        except FileNotFoundError:
            problems.append(f"{file}: data file is missing")
            continue
        except CorruptCheckpoint as exc:  # not a regular file
            problems.append(str(exc))
            continue
        if actual < end:
            problems.append(f"{file}: truncated to {actual} bytes of the {manifest.files[file]} "
                            "the manifest records")
    return problems


def _overlaps(entry: Entry, box: Box, itemsize: int) -> tuple[str, list[tuple[Chunk, list[Run]]]]:
    """Each saved chunk of `entry` that overlaps destination `box`, with the runs that copy
    the overlap (offsets in the chunk's bytes and in the destination's), or why the chunks do
    not cover `box` exactly once. The chunks store pieces of the tensor, each a run of
    consecutive chunks whose joined bytes are the piece's (`box_runs`): a sharded entry's
    boxes, or for any other entry one piece, its whole tensor."""
    pieces = [(source or whole(entry), chunks) for source, chunks in box_runs(entry.chunks)]
    problem = coverage_problem(box, [source for source, _ in pieces])
    if problem:
        return problem, []
    overlaps = []
    for source, chunks in pieces:
        runs = copy_runs(source, box, itemsize)
        if not runs:
            continue
        if len(chunks) == 1:
            overlaps.append((chunks[0], runs))
            continue
        lows = [0, *itertools.accumulate(chunk.nbytes for chunk in chunks)]
        for index, part in _cut(runs, lows):
            low = lows[index]
            overlaps.append((chunks[index], [Run(run.source - low, run.dest, run.nbytes)
                                             for run in part]))
    return "", overlaps


def _cut(runs: list[Run], bounds: Sequence[int]) -> list[tuple[int, list[Run]]]:
    """`runs` (in source order) cut at the increasing source offsets `bounds`: each stretch
    `bounds[i]` to `bounds[i + 1]` that the runs touch, by `i`, with the parts of the runs
    inside it. Source offsets are kept as they are, and only a run that crosses a bound is
    cut, so a stretch holding many whole runs costs no new ones."""
    if len(bounds) == 2:
        return [(0, runs)] if runs else []
    parts: list[tuple[int, list[Run]]] = []
    at = 0  # the first run not yet in a stretch
    rest: list[Run] = []  # what is left of a run that crossed the last bound
    for index, (low, high) in enumerate(itertools.pairwise(bounds)):
        if at == len(runs) and not rest:
            break
        if low == high:
            continue
        stop = bisect.bisect_left(runs, high, lo=at, key=_SOURCE)
        part = [*rest, *runs[at:stop]] if rest else runs[at:stop]
        at = stop
        rest = []
        if part and part[-1].source + part[-1].nbytes > high:
            run = part[-1]
            part[-1] = Run(run.source, run.dest, high - run.source)
            rest = [Run(high, run.dest + high - run.source, run.source + run.nbytes - high)]
        if part:
            parts.append((index, part))
    return parts


_SOURCE = operator.attrgetter("source")
