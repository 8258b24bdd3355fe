"""Read pieces of global tensors (engine layer): fill each destination piece from the saved
pieces that overlap it, reading only the checksum blocks those overlaps touch, whatever split
the checkpoint was written with. A whole tensor is the piece that covers everything.
"""

from __future__ import annotations

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


@dataclass(slots=True)
class _Landing:
    """Where the blocks read from one saved chunk for one destination go: straight into the
    destination (`runs` empty) or into `buffer`, from which `runs` copy afterwards."""

    buffer: memoryview
    start: int
    runs: list[Run]
    dest: memoryview


def read_pieces(
    storage: Storage, manifest: Manifest, wants: Sequence[Want], *, checksum: Checksum,
    options: IOOptions,
) -> list[str]:
    """Fill every wanted piece (at most one per entry), verifying every block read.

    Returns:
        one line per problem (a destination the saved pieces do not cover exactly once, a
        checksum mismatch, missing or truncated data); empty when all is well, and only then
        are the destinations complete.
    """
    if len({want.path for want in wants}) != len(wants):
        raise ValueError("read_pieces takes at most one Want per entry")
    block = manifest.block_bytes
    problems: list[str] = []
    ranges: list[tuple[StatePath, Chunk, int, int]] = []
    # By chunk object: two pieces of a crafted manifest may name the same bytes.
    landings: dict[tuple[StatePath, int], _Landing] = {}
    apart: list[tuple[tuple[StatePath, int], Chunk, int, int, list[Run], memoryview]] = []
    for want in wants:
        entry = manifest.entries[want.path]
        itemsize = DTYPES[entry.dtype or "U8"].itemsize
        problem, overlaps = _overlaps(entry, want.box, itemsize)
        if problem:
            problems.append(f"{want.path!r}: {problem}")
            continue
        for chunk, runs in overlaps:
            key = (want.path, id(chunk))
            if len(runs) == 1 and runs[0].source == 0 and runs[0].nbytes == chunk.nbytes:
                # The chunk lands whole and contiguous: read it straight into place.
                into = want.view[runs[0].dest : runs[0].dest + chunk.nbytes]
                landings[key] = _Landing(into, 0, [], into)
                ranges.append((want.path, chunk, 0, chunk.nbytes))
                continue
            first, last = runs[0].source, runs[-1].source + runs[-1].nbytes
            start = first // block * block
            end = min(chunk.nbytes, -(-last // block) * block)
            apart.append((key, chunk, start, end, runs, want.view))
            ranges.append((want.path, chunk, first, last))
    if problems:
        return problems
    problems = _short_files(storage, manifest, [(chunk, end) for _, chunk, _, end, _, _ in apart])
    if problems:
        return problems
    for key, _, start, end, runs, view in apart:
        landings[key] = _Landing(memoryview(bytearray(end - start)), start, runs, view)
    reads = plan_ranged_reads(
        ranges,
        block_bytes=block, max_read_bytes=options.max_read_bytes, max_gap=options.max_gap,
    )

    def dest(_: Read, seg: Segment) -> memoryview:
        landing = landings[(seg.path, id(seg.chunk))]
        offset = seg.start - landing.start
        return landing.buffer[offset : offset + seg.nbytes]

    problems = read_segments(storage, reads, dest, block_bytes=block, checksum=checksum,
                             options=options)
    if problems:
        return problems
    for landing in landings.values():
        for run in landing.runs:
            source = run.source - landing.start
            landing.dest[run.dest : run.dest + run.nbytes] = landing.buffer[
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
        if runs:
            overlaps += _cut(runs, chunks)
    return "", overlaps


def _cut(runs: list[Run], chunks: Sequence[Chunk]) -> list[tuple[Chunk, list[Run]]]:
    """`runs` from a piece's bytes, in source order, cut across the consecutive `chunks` that
    hold those bytes: each chunk that a run touches, with the parts of the runs inside it
    (source offsets in the chunk's own bytes). One pass over both, runs and chunks."""
    if len(chunks) == 1:
        return [(chunks[0], runs)]
    overlaps = []
    low = 0
    at = 0  # the first run that does not end before this chunk
    for chunk in chunks:
        high = low + chunk.nbytes
        cut = []
        while at < len(runs) and runs[at].source < high:
            run = runs[at]
            first, last = max(run.source, low), min(run.source + run.nbytes, high)
            if first < last:
                cut.append(Run(first - low, run.dest + first - run.source, last - first))
            if run.source + run.nbytes > high:
                break  # it goes on into the next chunk
            at += 1
        if cut:
            overlaps.append((chunk, cut))
        low = high
    return overlaps
