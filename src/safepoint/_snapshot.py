"""Staging for asynchronous saves (engine layer): copy a state's bytes into reusable host
buffers (pinned when tensors live on CUDA) so the caller may change the state while a
background thread writes the copy, within an optional memory budget.

Without a budget, or when the state fits in it, the buffers mirror the data file's layout and
everything is staged before `Snapshot.stage` returns. When the state is larger, staging
streams through two halves of the budget: stage a part into one half while the writer drains
the other, so `stage` returns once the last part is staged. An entry larger than a half is
cut into pieces on checksum-block boundaries (the writer joins their digests).

The buffers are kept by a `Stager` and reused by the next save of the same layout: no fresh
allocation of the state's size per save, and the tensor views into them are cached too, so a
later save costs little more than the copies themselves.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ._format import BLOCK_BYTES, PAGE, Entry, aligned
from ._leaves import TENSOR, VALUE
from ._plan import WriteItem, plan_layout
from ._staging import host_leaf, raw_view, tensor_entry
from ._types import StatePath
from .errors import SafepointError

__all__ = ["MIN_STAGING_BYTES", "Snapshot", "Stager"]

#: The smallest budget: two halves of at least one checksum block each.
MIN_STAGING_BYTES = 4 * BLOCK_BYTES


class StagingAborted(SafepointError):
    """The other side of a streaming save stopped (its own error is raised there)."""


@dataclass(frozen=True, slots=True)
class _Piece:
    """A byte range of one entry, its place in the data file and in a staging buffer."""

    item: WriteItem
    offset: int  # in the staging buffer
    start: int  # in the entry


@dataclass(frozen=True, slots=True)
class _Part:
    """Pieces staged together into one buffer."""

    slot: int
    pieces: tuple[_Piece, ...]


class _Memory:
    """One staging buffer: anonymous memory, or pinned memory from torch for CUDA copies."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self._map: mmap.mmap | None = None
        if pinned:
            torch = sys.modules["torch"]
            self._tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.view = raw_view(self._tensor.data_ptr(), nbytes)
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(-1, max(nbytes, PAGE), flags=flags)
            self.view = memoryview(self._map)[:nbytes]
            self._tensor = None

    def tensor(self) -> Any:
        """The buffer as a torch uint8 tensor (no copy)."""
        if self._tensor is None:
            torch = sys.modules["torch"]
            self._tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes)
        return self._tensor

    def release(self) -> None:
        """Drop the memory; it is unmapped now, or once the last view of it (a failed save's
        traceback may hold one) is gone."""
        self._tensor = None
        self.view = memoryview(b"")
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


class Stager:
    """Staging buffers kept between saves, within `max_bytes` when given.

    Raises:
        SafepointError: `max_bytes` is below `MIN_STAGING_BYTES`.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < MIN_STAGING_BYTES:
            raise SafepointError(
                f"max_staging_bytes={max_bytes} is too small: pass at least "
                f"{MIN_STAGING_BYTES} ({MIN_STAGING_BYTES >> 20} MiB), or None for no limit"
            )
        self.max_bytes = max_bytes
        self._memory: list[_Memory] = []
        self._views: dict[tuple[Any, ...], Any] = {}

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold now."""
        return sum(m.nbytes for m in self._memory)

    def snapshot(self, leaves: Mapping[StatePath, Any], kinds: Mapping[StatePath, str]) -> Snapshot:
        """Plan the staging of the data leaves among `leaves` (nothing is copied yet) and make
        sure the buffers are there.

        Raises:
            UnsupportedLeaf: a leaf that cannot be stored.
        """
        entries: dict[StatePath, Entry] = {}
        sources: dict[StatePath, Any] = {}
        sizes = []
        cuda = False
        for path, kind in kinds.items():
            if kind == VALUE:
                continue
            value = leaves[path]
            if kind == TENSOR:
                entries[path] = tensor_entry(value, path)
                sources[path] = value
                nbytes = value.numel() * value.element_size()
                cuda = cuda or value.device.type == "cuda"
            else:
                host = host_leaf(value, kind, path)
                entries[path] = host.entry
                sources[path] = host.data
                nbytes = len(host.data)
            sizes.append((path, nbytes))
        layout, file_size = plan_layout(sizes)
        if self.max_bytes is None or file_size <= self.max_bytes:
            parts = [_Part(0, tuple(_Piece(item, item.offset, 0) for item in layout))]
            slot_bytes = [file_size]
        else:
            half = self.max_bytes // 2 // PAGE * PAGE
            parts = _pack(layout, half)
            slot_bytes = [half, half] if len(parts) > 1 else [half]
        self._ensure(slot_bytes, pinned=cuda)
        return Snapshot(self, entries, layout, sources, parts, cuda)

    def _ensure(self, slot_bytes: list[int], pinned: bool) -> None:
        fits = len(self._memory) == len(slot_bytes) and all(
            m.nbytes >= n and m.pinned == pinned for m, n in zip(self._memory, slot_bytes,
                                                                 strict=True))
        if fits:
            return
        self.release()
        self._memory = [_Memory(n, pinned) for n in slot_bytes]

    def view(self, slot: int, offset: int, nbytes: int, dtype: Any, shape: Any) -> Any:
        """A tensor of `dtype` and `shape` over bytes `offset` to `offset + nbytes` of buffer
        `slot`, cached while the buffer lives."""
        key = (slot, offset, nbytes, dtype, shape)
        view = self._views.get(key)
        if view is None:
            flat = self._memory[slot].tensor()[offset : offset + nbytes].view(dtype)
            view = flat if shape is None else flat.view(shape)
            self._views[key] = view
        return view

    def memory(self, slot: int) -> memoryview:
        """The bytes of buffer `slot`."""
        return self._memory[slot].view

    def release(self) -> None:
        """Free the buffers (the next snapshot allocates new ones)."""
        self._views.clear()
        for memory in self._memory:
            memory.release()
        self._memory = []


def _pack(layout: list[WriteItem], half: int) -> list[_Part]:
    """Cut entries into pieces of at most `half` bytes starting on checksum-block boundaries
    of their entry, and pack the pieces in order into parts of at most `half` bytes that
    alternate between two buffers."""
    largest = half // BLOCK_BYTES * BLOCK_BYTES
    parts: list[_Part] = []
    pieces: list[_Piece] = []
    end = 0
    for item in layout:
        for start in range(0, max(item.nbytes, 1), largest):
            nbytes = min(largest, item.nbytes - start)
            offset = aligned(end, nbytes)
            if offset + nbytes > half and pieces:
                parts.append(_Part(len(parts) % 2, tuple(pieces)))
                pieces, offset = [], 0
            piece_item = item if nbytes == item.nbytes else WriteItem(
                item.path, item.offset + start, nbytes)
            pieces.append(_Piece(piece_item, offset, start))
            end = offset + nbytes
    if pieces:
        parts.append(_Part(len(parts) % 2, tuple(pieces)))
    return parts


class Snapshot:
    """One save's staged bytes: a `SaveData` whose `stream` (the writer's thread) hands out
    what `stage` (the caller's thread) copied, part by part."""

    def __init__(
        self, stager: Stager, entries: dict[StatePath, Entry], layout: list[WriteItem],
        sources: dict[StatePath, Any], parts: list[_Part], cuda: bool,
    ) -> None:
        self.entries: Mapping[StatePath, Entry] = entries
        self.layout = layout
        self._stager = stager
        self._sources = sources
        self._parts = parts
        self._cuda = cuda
        self._slots = 1 + max((p.slot for p in parts), default=0)
        self._cond = threading.Condition()
        self._staged = 0
        self._consumed = 0
        self._error: BaseException | None = None
        self._items = {item.path: item for item in layout}
        self._flats: dict[StatePath, Any] = {}

    def _flat(self, path: StatePath, tensor: Any) -> Any:
        """A 1-D view of a tensor cut into pieces (a contiguous copy when it has no such view,
        made once for all its pieces)."""
        flat = self._flats.get(path)
        if flat is None:
            flat = self._flats[path] = tensor.reshape(-1)
        return flat

    @property
    def nbytes(self) -> int:
        """Bytes of data the save writes."""
        return sum(item.nbytes for item in self.layout)

    @property
    def streaming(self) -> bool:
        """Whether the state is larger than the budget (staging streams through it)."""
        return len(self._parts) > 1

    def _free(self, part: int) -> bool:
        """Whether `part` may be staged: its buffer was drained, or the save stopped."""
        return self._error is not None or self._consumed > part - self._slots

    def _ready(self, part: int) -> bool:
        """Whether the writer may take `part`: it is staged, or the save stopped."""
        return self._error is not None or self._staged > part

    def stage(self) -> None:
        """Copy every part into the buffers (the caller's thread), waiting for the writer to
        free a buffer when streaming. Returns early, without raising, when the writer failed
        (its error is the save's).

        Raises:
            whatever a copy raised (the writer is stopped).
        """
        for index, part in enumerate(self._parts):
            with self._cond:
                self._cond.wait_for(partial(self._free, index))
                if self._error is not None:
                    return
            try:
                self._copy(part)
            except BaseException as exc:
                self.abort(exc)
                raise
            with self._cond:
                self._staged = index + 1
                self._cond.notify_all()

    def _copy(self, part: _Part) -> None:
        memory = self._stager.memory(part.slot)
        torch = sys.modules.get("torch")
        tensor_type = torch.Tensor if torch is not None else ()
        grad = torch.no_grad() if torch is not None else None
        if grad is not None:
            grad.__enter__()
        try:
            for piece in part.pieces:
                item = piece.item
                if not item.nbytes:
                    continue
                source = self._sources[item.path]
                if isinstance(source, tensor_type):
                    whole = item is self._items[item.path]
                    shape = tuple(source.shape) if whole else None
                    target = self._stager.view(part.slot, piece.offset, item.nbytes,
                                               source.dtype, shape)
                    if not whole:
                        size = source.element_size()
                        flat = self._flat(item.path, source)
                        source = flat[piece.start // size : (piece.start + item.nbytes) // size]
                    target.copy_(source, non_blocking=self._cuda)
                else:
                    memory[piece.offset : piece.offset + item.nbytes] = (
                        source[piece.start : piece.start + item.nbytes])
            if self._cuda:
                torch.cuda.synchronize()  # type: ignore[union-attr]
        finally:
            if grad is not None:
                grad.__exit__(None, None, None)

    def stream(self) -> Iterator[tuple[WriteItem, memoryview]]:
        """The staged pieces in file order (the writer's thread), each once its part is staged.

        Raises:
            StagingAborted: staging failed.
        """
        for index, part in enumerate(self._parts):
            with self._cond:
                self._cond.wait_for(partial(self._ready, index))
                if self._error is not None:
                    raise StagingAborted("staging stopped; the save is abandoned") from None
            memory = self._stager.memory(part.slot)
            for piece in part.pieces:
                yield piece.item, memory[piece.offset : piece.offset + piece.item.nbytes]
            with self._cond:
                self._consumed = index + 1
                self._cond.notify_all()

    def abort(self, error: BaseException) -> None:
        """Stop both sides: `stage` returns, `stream` raises."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
