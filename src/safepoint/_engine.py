"""Run write and read plans (engine layer): stream entries through page-aligned buffers into a
data file while checksumming them, and run ranged reads on a thread pool straight into their
destinations, verifying every block read.

Two threads make a save: the caller copies entries into bounce buffers and checksums them
while a writer thread hands full buffers to storage (a syscall that releases the GIL), so the
copy and the checksums hide behind the write. Large entries whose memory starts on a page (a
staging buffer's) skip the copy: the writer writes their whole checksum blocks from that
memory while the caller checksums them.
"""

from __future__ import annotations

import functools
import logging
import mmap
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ._format import PAGE
from ._plan import Read, Segment, WriteItem
from ._types import StatePath
from .errors import CorruptCheckpoint
from .storage import Storage

__all__ = [
    "IOOptions",
    "Part",
    "PartsRead",
    "read_parts",
    "read_segments",
    "scratch_dest",
    "write_file",
]

logger = logging.getLogger(__name__)

Checksum = Callable[..., int]
#: Alignment padding between entries is shorter than a page (see `_format.aligned`).
_ZEROS = bytes(4096)
#: A load checks the bytes of each read this many at a time, as they land, while they are still
#: in the CPU's cache (`readinto_stretches`). W1 warm, 1 GiB on 2 CPUs: 0.105 s against 0.123 s
#: checked after 128 MiB reads; 1 MiB stretches took 0.155 s.
_STRETCH_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class IOOptions:
    """How the engine moves bytes.

    Attributes:
        buffer_bytes: size of each page-aligned bounce buffer a save streams through.
        buffers: how many bounce buffers (one filling, the others writing); a save's memory
            beyond the state itself is about `buffer_bytes * buffers`.
        read_threads: parallel ranged reads on load and verify.
        max_read_bytes: the largest single ranged read.
        max_gap: the most unwanted bytes a read spans to join two wanted ranges.
    """

    buffer_bytes: int = 8 << 20
    buffers: int = 3
    read_threads: int = 4
    max_read_bytes: int = 32 << 20
    max_gap: int = 64 << 10


#: Bounce buffers are private: their pages fault in faster than shared ones, and MADV_DONTNEED
#: frees them.
_BUFFER_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
#: Every buffer but the first is populated: faulted in by one call, not page by page as the
#: copies first touch it (3 buffers of 8 MiB: 3-5 ms against 10-13). The first is not: a
#: save of a few small tensors touches a page of it (0.9 ms a save, 4 ms populated).
_POPULATED = _BUFFER_FLAGS | getattr(mmap, "MAP_POPULATE", 0)


class _Aborted(Exception):
    """The producer stopped; the writer must not commit a partial file."""


class _Pipeline:
    """Bounce buffers passed between the producer (caller) and the writer thread, and views of
    the producer's own page-aligned memory that the writer writes directly (`written` tells
    the producer when it is done with each: True, or False when it failed)."""

    def __init__(self, options: IOOptions) -> None:
        self.buffer_bytes = options.buffer_bytes
        self.maps: list[mmap.mmap] = []  # made as first taken: the first write starts sooner
        self.free: queue.Queue[int | None] = queue.Queue()
        for index in range(options.buffers):
            self.free.put(index)
        self.full: queue.Queue[tuple[int, int] | memoryview | None] = queue.Queue()
        self.written: queue.Queue[bool] = queue.Queue()
        self.error: BaseException | None = None

    def chunks(self) -> Iterator[memoryview]:
        while True:
            item = self.full.get()
            if item is None:
                # Every buffer is written: hand their memory back now, not after the fsync,
                # while the producer builds the manifest.
                for buffer in self.maps:
                    buffer.madvise(mmap.MADV_DONTNEED)
                return
            if isinstance(item, memoryview):
                yield item
                self.written.put(True)
                continue
            index, length = item
            if index < 0:
                raise _Aborted()
            yield memoryview(self.maps[index])[:length]
            self.free.put(index)

    def wait_written(self, count: int) -> None:
        """Wait until the writer is done with the last `count` direct views."""
        for _ in range(count):
            if not self.written.get():
                raise self.error or _Aborted()

    def take(self, idle: Callable[[], object] | None = None) -> int:
        """A free buffer's index, waiting for the writer to hand one back; `idle`, if given,
        is called first when none is free (every buffer is queued or being written)."""
        if idle is not None and self.free.empty():
            idle()
        index = self.free.get()
        if index is None:
            raise self.error or _Aborted()
        if index == len(self.maps):
            self.maps.append(mmap.mmap(-1, self.buffer_bytes,
                                       flags=_POPULATED if index else _BUFFER_FLAGS))
        return index


def write_file(
    storage: Storage,
    name: str,
    items: Iterable[tuple[WriteItem, memoryview]],
    *,
    block_bytes: int,
    checksum: Checksum,
    options: IOOptions,
    meanwhile: Callable[[dict[str, list[int]], int], object] | None = None,
    spare: Callable[[dict[StatePath, list[int]]], object] | None = None,
) -> tuple[int, dict[str, list[int]]]:
    """Write `items` (in offset order) as data file `name`, durably. `items` is consumed
    lazily: an item's bytes have been copied out once the next item is requested. An entry
    may come as several consecutive items of the same path, each starting on a multiple of
    `block_bytes` of the entry; their digests are joined. `meanwhile`, if given, is called
    with the digests and the file's size once every item is copied, while the writer
    finishes the file (its last buffers and the fsync), so that the caller's next step
    overlaps them. `spare`, if given, is called whenever every buffer is in the writer's
    hands (the caller would wait for one), with the digests so far: their paths in file order,
    every one whole but the last (an entry that comes as several items may be in part). Work
    done there overlaps the writes of a save that the disk holds up; it should be short (the
    next copy waits for it).

    Returns:
        the file size and, per entry path, its block digests.

    Raises:
        whatever the storage or `meanwhile` raised; the partial file is left for the caller
        to remove.
    """
    pipe = _Pipeline(options)
    written: list[int] = []

    def writer() -> None:
        try:
            written.append(storage.write(name, pipe.chunks()))
        except BaseException as exc:
            pipe.error = exc
            pipe.free.put(None)
            pipe.written.put(False)

    thread = threading.Thread(target=writer, name="safepoint-writer", daemon=True)
    thread.start()
    digests: dict[str, list[int]] = {}
    idle = None if spare is None else functools.partial(spare, digests)
    try:
        index = pipe.take()
        buffer = memoryview(pipe.maps[index])
        size = len(buffer)
        fill = 0  # bytes in the current buffer
        position = 0  # file offset of the current buffer's first byte
        zeros = memoryview(_ZEROS)
        for item, data in items:
            nbytes = item.nbytes
            start = item.offset - position
            end = start + nbytes
            if end <= size and nbytes <= block_bytes and start >= fill:
                # The common case, kept lean for states of many small tensors: the whole item
                # fits in the current buffer and in one checksum block.
                if start != fill:
                    buffer[fill:start] = zeros[: start - fill]
                known = digests.get(item.path)
                if known is None:
                    known = digests[item.path] = []
                if nbytes:
                    piece = buffer[start:end]
                    piece[:] = data
                    known.append(checksum(piece))
                fill = end
                if fill == size:
                    pipe.full.put((index, fill))
                    index, fill, position = pipe.take(idle), 0, position + size
                    buffer = memoryview(pipe.maps[index])
                continue
            gap = item.offset - (position + fill)
            while gap:
                step = min(gap, size - fill)
                buffer[fill : fill + step] = bytes(step)
                fill += step
                gap -= step
                if fill == size:
                    pipe.full.put((index, fill))
                    index, fill, position = pipe.take(idle), 0, position + size
                    buffer = memoryview(pipe.maps[index])
            blocks: list[int] = []
            running = 0
            in_block = 0
            direct = done = _direct_bytes(item, data, block_bytes)
            if direct:
                # Whole blocks of a large page-aligned item go to the writer as they are
                # (staged memory): no copy, while this thread checksums them.
                if fill:
                    pipe.full.put((index, fill))
                    index, fill, position = pipe.take(idle), 0, position + fill
                    buffer = memoryview(pipe.maps[index])
                for start in range(0, direct, size):
                    pipe.full.put(data[start : min(start + size, direct)])
                blocks.extend(checksum(data[start : start + block_bytes])
                              for start in range(0, direct, block_bytes))
                position += direct
            while done < item.nbytes:
                step = min(item.nbytes - done, size - fill, block_bytes - in_block)
                piece = buffer[fill : fill + step]
                _copy(piece, data[done : done + step])
                running = checksum(piece, running)
                fill += step
                done += step
                in_block += step
                if in_block == block_bytes:
                    blocks.append(running)
                    running = in_block = 0
                if fill == size:
                    pipe.full.put((index, fill))
                    index, fill, position = pipe.take(idle), 0, position + size
                    buffer = memoryview(pipe.maps[index])
            if in_block:
                blocks.append(running)
            digests.setdefault(item.path, []).extend(blocks)
            if direct:  # the item's memory must stay as it is until the writer is done
                pipe.wait_written(-(-direct // size))
        if fill:
            pipe.full.put((index, fill))
        pipe.full.put(None)
        if meanwhile is not None:
            meanwhile(digests, position + fill)
    except BaseException:
        pipe.full.put((-1, 0))
        thread.join()
        raise
    thread.join()
    if pipe.error is not None:
        raise pipe.error
    return written[0], digests


def _direct_bytes(item: WriteItem, data: memoryview, block_bytes: int) -> int:
    """How many leading bytes of `item` the writer may write straight from `data`: its whole
    checksum blocks, when it holds at least one and both its file offset and its memory start
    on a page (as staged entries of 1 MiB or more do; O_DIRECT needs both), else none."""
    if item.nbytes < block_bytes or item.offset % PAGE or block_bytes % PAGE:
        return 0
    if np.frombuffer(data, np.uint8).ctypes.data % PAGE:
        return 0
    return item.nbytes // block_bytes * block_bytes


#: Copies from this size on go through numpy, which releases the GIL while it copies.
_GIL_FREE_COPY = 256 << 10


def _copy(dst: memoryview, src: memoryview) -> None:
    """Copy `src`'s bytes into `dst`, large copies without holding the GIL: a memoryview
    assignment holds it throughout, and then a training loop beside a background save stalls
    (measured: a matmul loop ran at 12% of its speed beside memoryview copies, 38% beside
    numpy's on 2 cores)."""
    if len(dst) >= _GIL_FREE_COPY:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src


#: One span of a ranged read, in file order: (where it starts in the data file, the bytes to
#: fill, the digests of its chunk, the index of its first block among them, its entry's path).
Part = tuple[int, memoryview, Sequence[int], int, StatePath]
#: A ranged read of parts: (data file, where it starts, where it ends, its parts).
PartsRead = tuple[str, int, int, list[Part]]
_R = TypeVar("_R")


def read_segments(
    storage: Storage,
    reads: Iterable[Read],
    dest: Callable[[Read, Segment], memoryview],
    *,
    block_bytes: int,
    checksum: Checksum,
    options: IOOptions,
    checked: Callable[[int], object] | None = None,
) -> list[str]:
    """`read_parts` of planned reads, each segment filling `dest(read, segment)` (asked in
    the reading thread)."""

    def parts(read: Read) -> PartsRead:
        return read.file, read.offset, read.end, [
            (seg.file_offset, dest(read, seg), seg.chunk.digests, seg.start // block_bytes,
             seg.path)
            for seg in read.segments
        ]

    return read_parts(storage, reads, parts, block_bytes=block_bytes, checksum=checksum,
                      options=options, checked=checked)


def read_parts(
    storage: Storage,
    reads: Iterable[_R],
    parts: Callable[[_R], PartsRead],
    *,
    block_bytes: int,
    checksum: Checksum,
    options: IOOptions,
    checked: Callable[[int], object] | None = None,
) -> list[str]:
    """Run `reads` on a thread pool as they come (a caller that plans them lazily has the
    first read while it plans the rest), each made into its parts by `parts` in the reading
    thread, then checking every block of each part against its digests as it lands (in
    stretches, from a storage with `readinto_stretches`). `checked`, if given,
    is called in the reading thread with the bytes of each read's parts once they are checked
    (progress; the caller serializes it).

    Returns:
        one line per problem (checksum mismatch, truncated or missing file); empty when all
        is well.
    """
    gap = memoryview(bytearray(options.max_gap))
    stretches = _stretches_of(storage)
    missing: set[str] = set()  # data files found missing: said once, not once per read
    lock = threading.Lock()

    def run(read: _R) -> list[str]:
        file, head, end, pieces = parts(read)
        buffers: list[memoryview] = []
        position = head
        for offset, view, _, _, _ in pieces:
            if offset > position:
                buffers.append(gap[: offset - position])
            buffers.append(view)
            position = offset + len(view)
        problems: list[str] = []
        part = done = 0  # pieces[part] is checked up to its byte `done`

        def check(landed: int) -> None:
            # Every whole block of the parts that lie below file offset `landed`.
            nonlocal part, done
            while part < len(pieces):
                offset, view, digests, block, path = pieces[part]
                size = len(view)
                if size <= block_bytes:  # most parts of many small entries: one block
                    if offset + size > landed:
                        return
                    if checksum(view) != digests[block]:
                        problems.append(f"{file} at byte {offset}: checksum mismatch in {path!r}")
                else:
                    while done < size:
                        stop = min(done + block_bytes, size)
                        if offset + stop > landed:
                            return
                        if checksum(view[done:stop]) != digests[block + done // block_bytes]:
                            problems.append(f"{file} at byte {offset + done}: checksum "
                                            f"mismatch in {path!r}")
                        done = stop
                part += 1
                done = 0

        try:
            if stretches is None:
                storage.readinto(file, head, buffers)
                check(end)
            else:
                for landed in stretches(file, head, buffers, _STRETCH_BYTES):
                    check(head + landed)
        except FileNotFoundError:
            with lock:
                said = file in missing
                missing.add(file)
            return [] if said else [f"{file}: data file is missing (entries {_names(pieces)})"]
        except EOFError:
            return [*problems, f"{file}: truncated before byte {end} (entries {_names(pieces)})"]
        except CorruptCheckpoint as exc:  # not a regular file
            return exc.problems
        if checked is not None:
            checked(sum(len(part[1]) for part in pieces))
        return problems

    if options.read_threads <= 1 or (isinstance(reads, Sequence) and len(reads) <= 1):
        return [p for read in reads for p in run(read)]
    with ThreadPoolExecutor(options.read_threads, thread_name_prefix="safepoint-read") as pool:
        running = [pool.submit(run, read) for read in reads]
        return [p for future in running for p in future.result()]


def _stretches_of(storage: Storage) -> Callable[..., Iterator[int]] | None:
    """The storage's `readinto_stretches`, unless its `readinto` is overridden below where
    that is defined (a subclass of the local backend that counts or alters reads, or a
    `readinto` set on the instance): the load must then go through `readinto`."""
    stretches = getattr(storage, "readinto_stretches", None)
    if stretches is None:
        return None
    own = vars(storage) if hasattr(storage, "__dict__") else {}
    if "readinto_stretches" in own:
        return stretches  # type: ignore[no-any-return]
    if "readinto" in own:
        return None
    classes = type(storage).__mro__
    depth = {name: next((i for i, cls in enumerate(classes) if name in vars(cls)), len(classes))
             for name in ("readinto", "readinto_stretches")}
    return stretches if depth["readinto_stretches"] <= depth["readinto"] else None


def _names(parts: list[Part]) -> str:
    paths = list(dict.fromkeys(part[4] for part in parts))
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return ", ".join(repr(p) for p in paths[:3]) + more


def scratch_dest(options: IOOptions) -> Callable[[Read, Segment], memoryview]:
    """A destination that drops bytes after they are checked (verify): one scratch buffer per
    reading thread."""
    local = threading.local()

    def dest(read: Read, seg: Segment) -> memoryview:
        span = read.end - read.offset
        if getattr(local, "buffer", None) is None or len(local.buffer) < span:
            local.buffer = memoryview(bytearray(max(span, options.max_read_bytes)))
        start = seg.file_offset - read.offset
        view: memoryview = local.buffer[start : start + seg.nbytes]
        return view

    return dest
