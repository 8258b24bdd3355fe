"""Staging for asynchronous saves (engine layer): copy a state's bytes into reusable host
buffers (pinned when tensors live on CUDA) so the caller may change the state while a
background thread writes the copy, within an optional memory budget.

Without a budget, or when the state fits in it, the buffers mirror the data file's layout and
everything is staged before `Snapshot.stage` returns. When the state is larger, staging
streams through two halves of the budget (less the writer's own buffers): stage a part into
one half while the writer drains the other, so `stage` returns once the last part is staged.
An entry larger than a half is cut into pieces on checksum-block boundaries (the writer joins
their digests).

The buffers are kept by a `Stager` and reused by the next save of the same layout: no fresh
allocation of the state's size per save, and the tensor views into them are cached too. A
later state is matched against the plan by one C++ call over all its tensors (dtype, device,
layout, conjugate and negative bits, sizes, strides: see `_Plan`) instead of being described
again, and small CPU tensors are copied by memcpy from views of their memory, each made again
only when its tensor's address changed, so a later save costs little more than the copies.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import operator
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import itemgetter
from typing import Any, SupportsIndex

from ._engine import IOOptions
from ._format import BLOCK_BYTES, DTYPES, PAGE, Entry, aligned
from ._leaves import ALIAS, NDARRAY, TENSOR, VALUE
from ._plan import WriteItem, plan_layout
from ._staging import (
    LOWEST_ADDRESS,
    Ties,
    array_view,
    check_memory,
    copy_bytes,
    host_array,
    host_leaf,
    raw_view,
    raw_views,
    same_tensor,
    tensor_entry,
)
from ._types import StatePath
from .errors import SafepointError

logger = logging.getLogger(__name__)

__all__ = ["MIN_STAGING_BYTES", "WRITER_BYTES", "Snapshot", "Stager", "staging_budget"]

#: What the writer holds while a save is written (its bounce buffers); a budget covers it.
WRITER_BYTES = IOOptions().buffer_bytes * IOOptions().buffers
#: The smallest budget: the writer's buffers and two halves of one checksum block each.
MIN_STAGING_BYTES = WRITER_BYTES + 2 * BLOCK_BYTES


def staging_budget(max_bytes: object, url: str | None = None) -> int | None:
    """`max_bytes` (`max_staging_bytes`, of the manager of `url`) as a whole number of bytes:
    an int, or a float that is one (byte counts are often written 2e9), or None.

    Raises:
        SafepointError: a fraction, NaN, an infinity, something else than a number, or a
            budget below `MIN_STAGING_BYTES`.
    """
    if max_bytes is None:
        return None
    where = f" for {url}" if url else ""
    advice = (f"pass a whole number of bytes, at least {MIN_STAGING_BYTES} "
              f"({MIN_STAGING_BYTES >> 20} MiB), such as 2_000_000_000 or 2e9, or None for no "
              "limit")
    budget: int | None = None
    if isinstance(max_bytes, float):
        if math.isfinite(max_bytes) and max_bytes.is_integer():
            budget = int(max_bytes)
    elif isinstance(max_bytes, SupportsIndex) and not isinstance(max_bytes, bool):
        budget = operator.index(max_bytes)  # an int, numpy's integers
    if budget is None:
        raise SafepointError(f"max_staging_bytes={max_bytes!r}{where} is not a whole number "
                             f"of bytes: {advice}", url=url)
    if budget < MIN_STAGING_BYTES:
        raise SafepointError(f"max_staging_bytes={max_bytes!r}{where} is too small: {advice}",
                             url=url)
    return budget


class StagingAborted(SafepointError):
    """The other side of a streaming save stopped (its own error is raised there)."""


@dataclass(frozen=True, slots=True)
class _Piece:
    """A byte range of one entry, its place in the data file and in a staging buffer."""

    item: WriteItem
    index: int  # of the entry in the layout (and in a snapshot's sources)
    offset: int  # in the staging buffer
    start: int  # in the entry


@dataclass(frozen=True, slots=True)
class _Part:
    """Pieces staged together into one buffer."""

    slot: int
    pieces: tuple[_Piece, ...]


#: How a piece is copied into a staging buffer (the first field of an op).
_BYTES = 0  # (_BYTES, entry, buffer offset, entry offset, bytes): bytes, arrays, pickles
_CUT = 1  # (_CUT, entry, target tensor, first element, end element): a piece of a tensor
_Op = tuple[Any, ...]
#: Tensors below this size are copied by memcpy when they are plain contiguous CPU tensors:
#: faster than `copy_` for small ones, and no tensor view to keep per entry. Never cut into
#: pieces: a streaming part holds at least a checksum block.
_SMALL_BYTES = 1 << 20
assert _SMALL_BYTES <= BLOCK_BYTES
_ALL = slice(None)


@dataclass(slots=True)
class _PartOps:
    """The copies that stage one part: `ops`; memcpys from `_Plan.views[slots[i]]` into
    `targets[i]` (views of the part's buffer), made together by one C-level loop; whole
    tensors `wholes` (entries) copied into the cached views `into` by one torch call (one
    C++ loop of asynchronous copies from CUDA); and the CUDA `devices` those copies come from,
    each synchronized once they are issued (the plan's guard keeps them where they were)."""

    ops: list[_Op]
    targets: list[memoryview]
    slots: list[int]
    wholes: list[int]
    into: list[Any]
    devices: set[str]


@dataclass(slots=True)
class _Plan:
    """What a state's shape decides, reused while the state keeps it: the file layout, the
    parts, the buffers' sizes and the copies (built on first use, while the buffers live).

    A later state fits the plan when it has the same leaf kinds, its tensors pass `guard` (one
    C++ call: each one's type, dtype, device, layout, conjugate and negative bits, sizes,
    strides and requires_grad as when the plan was made) and its other data leaves describe
    to the same entries and sizes. Small CPU tensors that were contiguous without those bits
    are copied by memcpy from raw views of their memory (`views`), each one made again only
    when its tensor's address (`ptrs`) changed.

    Attributes:
        kinds: the kinds of the state it was made for (every leaf's, values included).
        tensors: the data leaves that are tensors (their signature indexes), and `pick`
            takes them from a state's leaves, in that order.
        others: the other data leaves (their signature indexes).
        guard: checks a later state's tensors (`pick`'s result); None where torch lacks it.
        memcpy: the tensors (positions in `tensors`) copied by memcpy; `copied` the others,
            (position, signature index), copied by torch from the tensor.
        addresses: the address of each of `tensors`, last seen: while a later state's are
            the same, no two of its tensors became one and the memcpy views stand.
        ptrs, views: the address and a raw view of each memcpy tensor's bytes, last seen.
        aliases: (alias, the tensor it is) of tied tensors, staged once; a later state fits
            only while each pair is still one tensor, and no other two became one.
        tied: whether the plan was made looking for tied tensors (`snapshot`'s `aliases`).
    """

    signature: list[tuple[StatePath, Entry, int]]
    layout: list[WriteItem]
    parts: list[_Part]
    slot_bytes: list[int]
    pinned: bool
    ops: dict[int, _PartOps] = field(default_factory=dict)
    kinds: dict[StatePath, str] = field(default_factory=dict)
    entries: dict[StatePath, Entry] = field(default_factory=dict)
    tensors: list[int] = field(default_factory=list)
    pick: Callable[[Mapping[StatePath, Any]], tuple[Any, ...]] = lambda leaves: ()
    others: list[int] = field(default_factory=list)
    guard: Callable[..., bool] | None = None
    memcpy: list[int] = field(default_factory=list)
    copied: list[tuple[int, int]] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    views: list[memoryview] = field(default_factory=list)
    aliases: list[tuple[StatePath, StatePath]] = field(default_factory=list)
    tied: bool = True


#: Linux's madvise advice that leaves a private mapping out of a forked child's copy (the
#: child gets zero pages there); Python's mmap module does not name it.
_MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18 if sys.platform == "linux" else None)


class _Memory:
    """One staging buffer: anonymous memory, or pinned memory from torch for CUDA copies.

    Forked children (DataLoader workers) do not inherit the anonymous memory's pages
    (`MADV_WIPEONFORK`): each save writes the whole buffer, which would otherwise copy
    every page a child still shares, the state's size again per child. The child's mapping
    stays valid (zeros), so a child that saves or frees the buffer is unharmed, unlike with
    `MADV_DONTFORK`. CUDA keeps pinned memory out of children itself.

    Its tensors are made outside inference mode, whatever the caller's mode (a save from an
    evaluation block): they are reused by later saves, and an inference tensor cannot be
    written outside inference mode.
    """

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self._map: mmap.mmap | None = None
        if pinned:
            torch = sys.modules["torch"]
            with torch.inference_mode(False):
                self._tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.view = raw_view(self._tensor.data_ptr(), nbytes)
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(-1, max(nbytes, PAGE), flags=flags)
            if _MADV_WIPEONFORK is not None:
                try:
                    self._map.madvise(_MADV_WIPEONFORK)
                except OSError:  # a kernel before 4.14: children copy the pages they share
                    logger.debug("no MADV_WIPEONFORK: forked children may copy staging pages")
            self.view = memoryview(self._map)[:nbytes]
            self._tensor = None

    def tensor(self) -> Any:
        """The buffer as a torch uint8 tensor (no copy; `Stager.ops` calls this outside
        inference mode)."""
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
    """Staging buffers kept between saves. With `max_bytes`, the buffers and the writer's
    bounce buffers (`WRITER_BYTES`) stay within it.

    Raises:
        SafepointError: `max_bytes` is not a whole number of bytes (see `staging_budget`) or
            is below `MIN_STAGING_BYTES`.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = staging_budget(max_bytes)
        self._memory: list[_Memory] = []
        self._plan: _Plan | None = None
        #: (path, dtype, shape, device, layout) -> (entry, bytes, on CUDA) of tensors seen.
        self._known: dict[tuple[Any, ...], tuple[Entry, int, bool]] = {}

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold now."""
        return sum(m.nbytes for m in self._memory)

    def snapshot(self, leaves: Mapping[StatePath, Any], kinds: Mapping[StatePath, str], *,
                 aliases: bool = True) -> Snapshot:
        """Plan the staging of the data leaves among `leaves` (nothing is copied yet) and make
        sure the buffers are there. A state that fits the last plan (see `_Plan`) reuses it,
        its buffers and the views into them, without describing the state again. A tensor
        that is an earlier one (`same_tensor`: tied weights) is staged once and described as
        an alias, unless `aliases` is False (a collective save's pieces, each of which its
        plan needs written).

        Raises:
            UnsupportedLeaf: a leaf that cannot be stored.
        """
        plan = self._plan
        sources = None if plan is None else self._repeat(plan, leaves, kinds, aliases)
        if plan is None or sources is None:
            plan, sources = self._planned(leaves, kinds, aliases)
        if not self._fits(plan):
            self.release()
            self._memory = [_Memory(n, plan.pinned) for n in plan.slot_bytes]
            self._plan = plan
        return Snapshot(self, plan.entries, plan, sources, leaves)

    def _repeat(self, plan: _Plan, leaves: Mapping[StatePath, Any],
                kinds: Mapping[StatePath, str], aliases: bool) -> list[Any] | None:
        """The sources of a state that fits `plan` (by data leaf; None where a memcpy from
        `plan.views` copies it), else None."""
        if plan.guard is None or kinds != plan.kinds or aliases != plan.tied:
            return None
        tensors = plan.pick(leaves)
        if not plan.guard(*tensors) or not all(
                same_tensor(leaves[alias], leaves[first]) for alias, first in plan.aliases):
            return None
        addresses = list(map(sys.modules["torch"].Tensor.data_ptr, tensors)) if tensors else []
        moved = addresses != plan.addresses
        if moved and plan.tied and _tied_anew(plan, tensors, addresses):
            return None  # tied since the plan was made (tie_weights()): staged once from now
        sources: list[Any] = [None] * len(plan.signature)
        for index in plan.others:
            path, entry, nbytes = plan.signature[index]
            described, source = _staged_from(leaves[path], kinds[path], path)
            if described != entry or source.nbytes != nbytes:
                return None
            sources[index] = source
        for position, index in plan.copied:
            sources[index] = tensors[position]
        _check_copied(plan, sources)
        if moved:
            _refresh_views(plan, tensors, addresses)
        return sources

    def _planned(self, leaves: Mapping[StatePath, Any], kinds: Mapping[StatePath, str],
                 aliases: bool) -> tuple[_Plan, list[Any]]:
        """Describe every data leaf and make (or keep) the plan of the state's shape."""
        entries: dict[StatePath, Entry] = {}
        sources: list[Any] = []
        signature: list[tuple[StatePath, Entry, int]] = []
        tensors: list[int] = []
        others: list[int] = []
        small: list[bool] = []  # per tensor: small enough for a memcpy, on the CPU
        addresses: list[int] = []
        tied: list[tuple[StatePath, StatePath]] = []
        ties = Ties() if aliases else None
        cuda = False
        known = self._known
        if len(known) > 2 * len(kinds) + 1024:
            known.clear()
        for path, kind in kinds.items():
            if kind == VALUE:
                continue
            value = leaves[path]
            if kind == TENSOR:
                # A non-contiguous tensor's entry records its strides (`Entry.strides`).
                key = (path, value.dtype, value.shape, value.device, value.layout,
                       value.is_contiguous() or value.stride())
                seen = known.get(key)
                if seen is None:
                    entry = tensor_entry(value, path)
                    seen = known[key] = (entry, value.numel() * value.element_size(),
                                         value.device.type == "cuda")
                entry, nbytes, on_cuda = seen
                address = value.data_ptr()
                first = None if ties is None else ties.of(path, value, address)
                if first is not None:
                    tied.append((path, first))  # staged and written once
                    entries[path] = Entry(ALIAS, entry.dtype, entry.shape, (), first)
                    continue
                cuda = cuda or on_cuda
                tensors.append(len(signature))
                addresses.append(address)
                small.append(entry.device == "cpu" and nbytes < _SMALL_BYTES)
                if not small[-1]:  # the small ones are checked with their raw views
                    check_memory(path, value, address)
                sources.append(value)
            else:
                entry, source = _staged_from(value, kind, path)
                nbytes = source.nbytes
                others.append(len(signature))
                sources.append(source)
            entries[path] = entry
            signature.append((path, entry, nbytes))
        plan = self._plan
        if plan is None or plan.pinned != cuda or plan.signature != signature:
            plan = self._plan = self._make_plan(signature, cuda)
        plan.entries, plan.aliases, plan.tied = entries, tied, aliases
        values = [sources[index] for index in tensors]
        memcpy = [] if cuda else [
            position for position, (value, fits) in enumerate(zip(values, small, strict=True))
            if fits and value.is_contiguous() and not value.is_neg() and not value.is_conj()]
        if memcpy != plan.memcpy or tensors != plan.tensors:
            plan.ops.clear()  # the copies differ: made again on first use
            plan.ptrs, plan.views = [-1] * len(memcpy), [memoryview(b"")] * len(memcpy)
        plan.kinds = dict(kinds)
        plan.tensors, plan.others, plan.memcpy = tensors, others, memcpy
        copied = set(range(len(tensors))).difference(memcpy)
        plan.copied = [(position, tensors[position]) for position in sorted(copied)]
        plan.pick = _picker([signature[index][0] for index in tensors])
        plan.guard = _tensor_guard(values)
        _refresh_views(plan, values, addresses)
        for position in memcpy:
            sources[tensors[position]] = None
        return plan, sources

    def _make_plan(self, signature: list[tuple[StatePath, Entry, int]], pinned: bool) -> _Plan:
        layout, file_size = plan_layout((path, nbytes) for path, _, nbytes in signature)
        room = None if self.max_bytes is None else self.max_bytes - WRITER_BYTES
        if room is None or file_size <= room:
            pieces = tuple(_Piece(item, i, item.offset, 0) for i, item in enumerate(layout))
            return _Plan(signature, layout, [_Part(0, pieces)], [file_size], pinned)
        half = room // 2 // PAGE * PAGE
        parts = _pack(layout, half)
        return _Plan(signature, layout, parts, [half, half] if len(parts) > 1 else [half],
                     pinned)

    def _fits(self, plan: _Plan) -> bool:
        return len(self._memory) == len(plan.slot_bytes) and all(
            m.nbytes >= n and m.pinned == plan.pinned
            for m, n in zip(self._memory, plan.slot_bytes, strict=True))

    def ops(self, plan: _Plan, index: int) -> _PartOps:
        """The copies that stage part `index` of `plan` (made once per plan and buffers)."""
        cached = plan.ops.get(index)
        if cached is not None:
            return cached
        part = plan.parts[index]
        slots = {plan.tensors[position]: slot for slot, position in enumerate(plan.memcpy)}
        made = _PartOps([], [], [], [], [], set())
        torch = sys.modules.get("torch")
        # The views are kept for later saves, which may be made outside inference mode.
        with torch.inference_mode(False) if torch is not None else contextlib.nullcontext():
            for piece in part.pieces:
                _, entry, nbytes = plan.signature[piece.index]
                size = piece.item.nbytes
                slot = slots.get(piece.index)
                if not size:
                    continue
                if entry.kind != TENSOR:
                    made.ops.append((_BYTES, piece.index, piece.offset, piece.start, size))
                    continue
                if plan.pinned and entry.device and entry.device.startswith("cuda"):
                    made.devices.add(entry.device)
                if slot is not None and size == nbytes:
                    made.targets.append(self.memory(part.slot)[piece.offset : piece.offset + size])
                    made.slots.append(slot)
                elif size == nbytes:
                    made.wholes.append(piece.index)
                    made.into.append(self.target(part.slot, piece.offset, size, entry, whole=True))
                else:
                    target = self.target(part.slot, piece.offset, size, entry, whole=False)
                    itemsize = target.element_size()
                    made.ops.append((_CUT, piece.index, target, piece.start // itemsize,
                                     (piece.start + size) // itemsize))
        plan.ops[index] = made
        return made

    def target(self, slot: int, offset: int, size: int, entry: Entry, whole: bool) -> Any:
        """A tensor over `size` bytes of buffer `slot` from `offset`, of `entry`'s dtype: of
        its shape when `whole`, else 1-D (a piece)."""
        torch = sys.modules["torch"]
        flat = self._memory[slot].tensor()[offset : offset + size]
        flat = flat.view(getattr(torch, DTYPES[entry.dtype or ""].torch))
        return flat.view(entry.shape or ()) if whole else flat

    def memory(self, slot: int) -> memoryview:
        """The bytes of buffer `slot`."""
        return self._memory[slot].view

    def release(self) -> None:
        """Free the buffers (the next snapshot allocates new ones)."""
        if self._plan is not None:
            self._plan.ops.clear()
        for memory in self._memory:
            memory.release()
        self._memory = []


def _picker(keys: list[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """A function that takes `keys` from a mapping or a sequence, as a tuple (in C)."""
    if len(keys) > 1:
        return itemgetter(*keys)
    return (lambda items: (items[keys[0]],)) if keys else (lambda items: ())


def _tensor_guard(tensors: list[Any]) -> Callable[..., bool] | None:
    """A check, in one C++ call, that tensors have the Python type, dtype, device, layout,
    conjugate and negative bits, sizes, strides and requires_grad of `tensors` (in order):
    dynamo's `TensorGuards`, which keeps no reference to them. None where torch lacks it."""
    if not tensors:
        return lambda: True
    guards = getattr(getattr(sys.modules["torch"]._C, "_dynamo", None), "guards", None)
    try:
        check: Callable[..., bool] = guards.TensorGuards(  # type: ignore[union-attr]
            *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    except (AttributeError, TypeError, RuntimeError):
        logger.debug("torch has no TensorGuards: each save describes its tensors again")
        return None
    return check


def _copy_range(into: Any, source: Any, start: int, stop: int, non_blocking: bool) -> None:
    """Copy elements `start` to `stop` of `source`, in row-major order, into the 1-D `into`,
    through views of `source`: a piece of a non-contiguous tensor never flattens all of it
    (a copy of the whole tensor, beyond the staging budget)."""
    if source.dim() <= 1 or source.is_contiguous():
        copy_bytes(into, source.reshape(-1)[start:stop], non_blocking=non_blocking)
        return
    row = source[0].numel()
    first, head = divmod(start, row)
    last, tail = divmod(stop, row)
    if first == last:
        _copy_range(into, source[first], head, tail, non_blocking)
        return
    at = 0
    if head:
        _copy_range(into[: row - head], source[first], head, row, non_blocking)
        at, first = row - head, first + 1
    if last > first:
        rows = into[at : at + (last - first) * row].view(last - first, *source.shape[1:])
        copy_bytes(rows, source[first:last], non_blocking=non_blocking)
        at += (last - first) * row
    if tail:
        _copy_range(into[at:], source[last], 0, tail, non_blocking)


def _check_copied(plan: _Plan, sources: list[Any]) -> None:
    """Refuse a tensor that torch copies (`plan.copied`, among a state's `sources`) whose
    storage was freed since the plan was made: the guard sees its sizes and strides unchanged,
    and the copy would read address 0. One C-level pass over the addresses; the entries are
    looked at only when one of them is 0 (an empty tensor's is too)."""
    indexes = [index for _, index in plan.copied]
    if not indexes or min(map(sys.modules["torch"].Tensor.data_ptr,
                              map(sources.__getitem__, indexes))) >= LOWEST_ADDRESS:
        return
    for index in indexes:
        check_memory(plan.signature[index][0], sources[index], sources[index].data_ptr())


def _staged_from(value: Any, kind: str, path: StatePath) -> tuple[Entry, Any]:
    """The entry of a data leaf that is no tensor and what staging copies its bytes from: a
    byte view, or an ndarray whose memory does not hold them as stored (not C-contiguous, or
    big-endian), copied a piece at a time (`_copy_array_range`) rather than whole
    beforehand, outside the budget."""
    if kind != NDARRAY:
        host = host_leaf(value, kind, path)
        return host.entry, host.data
    entry, array = host_array(value, path)
    if array.flags.c_contiguous and array.dtype.byteorder != ">":
        return entry, array_view(array)
    return entry, array


def _copy_array_range(into: Any, source: Any, start: int, stop: int) -> None:
    """Copy elements `start` to `stop` of ndarray `source`, in C order, into the 1-D array
    `into` (of its dtype, little-endian), through views of `source`, as `_copy_range` does
    for tensors: a piece of a non-contiguous or big-endian array never copies all of it."""
    np = sys.modules["numpy"]
    if source.ndim <= 1 or source.flags.c_contiguous:
        np.copyto(into, source.reshape(-1)[start:stop])
        return
    row = source[0].size
    first, head = divmod(start, row)
    last, tail = divmod(stop, row)
    if first == last:
        _copy_array_range(into, source[first], head, tail)
        return
    at = 0
    if head:
        _copy_array_range(into[: row - head], source[first], head, row)
        at, first = row - head, first + 1
    if last > first:
        rows = into[at : at + (last - first) * row].reshape(last - first, *source.shape[1:])
        np.copyto(rows, source[first:last])
        at += (last - first) * row
    if tail:
        _copy_array_range(into[at:], source[last], 0, tail)


def _tied_anew(plan: _Plan, tensors: tuple[Any, ...], addresses: list[int]) -> bool:
    """Whether two of `tensors` (`plan.tensors`' leaves, at `addresses`) are now one tensor,
    which the plan stages twice. Only when two share an address are they compared."""
    if len(set(addresses)) == len(addresses):
        return False
    ties, signature = Ties(), plan.signature
    return any(ties.of(signature[index][0], tensor, address) is not None
               for index, tensor, address in zip(plan.tensors, tensors, addresses, strict=True))


def _refresh_views(
    plan: _Plan, tensors: tuple[Any, ...] | list[Any], addresses: list[int]
) -> None:
    """Record `addresses`, those of `tensors` (`plan.tensors`' leaves), and make again the
    raw view of each memcpy tensor among them whose address changed since the last save."""
    plan.addresses = addresses
    if not plan.memcpy:
        return
    pick = _picker(plan.memcpy)
    picked = pick(tensors)
    ptrs = list(pick(addresses))
    if ptrs == plan.ptrs:
        return
    signature, positions = plan.signature, plan.tensors
    changed = [slot for slot, (new, old) in enumerate(zip(ptrs, plan.ptrs, strict=True))
               if new != old]
    if min(ptrs) < LOWEST_ADDRESS:  # an empty tensor, or one whose storage was freed
        for slot in changed:
            check_memory(signature[positions[plan.memcpy[slot]]][0], picked[slot], ptrs[slot])
    made = raw_views([ptrs[slot] for slot in changed],
                     [signature[positions[plan.memcpy[slot]]][2] for slot in changed])
    for slot, view in zip(changed, made, strict=True):
        plan.views[slot] = view
    plan.ptrs = ptrs


def _pack(layout: list[WriteItem], half: int) -> list[_Part]:
    """Cut entries into pieces of at most `half` bytes starting on checksum-block boundaries
    of their entry, and pack the pieces in order into parts of at most `half` bytes that
    alternate between two buffers."""
    largest = half // BLOCK_BYTES * BLOCK_BYTES
    parts: list[_Part] = []
    pieces: list[_Piece] = []
    end = 0
    for index, item in enumerate(layout):
        for start in range(0, max(item.nbytes, 1), largest):
            nbytes = min(largest, item.nbytes - start)
            offset = aligned(end, nbytes)
            if offset + nbytes > half and pieces:
                parts.append(_Part(len(parts) % 2, tuple(pieces)))
                pieces, offset = [], 0
            piece_item = item if nbytes == item.nbytes else WriteItem(
                item.path, item.offset + start, nbytes)
            pieces.append(_Piece(piece_item, index, offset, start))
            end = offset + nbytes
    if pieces:
        parts.append(_Part(len(parts) % 2, tuple(pieces)))
    return parts


class Snapshot:
    """One save's staged bytes: a `SaveData` whose `stream` (the writer's thread) hands out
    what `stage` (the caller's thread) copied, part by part."""

    def __init__(self, stager: Stager, entries: dict[StatePath, Entry], plan: _Plan,
                 sources: list[Any], leaves: Mapping[StatePath, Any]) -> None:
        self.entries: Mapping[StatePath, Entry] = entries
        self.layout = plan.layout
        self._stager = stager
        self._plan = plan
        self._sources = sources
        self._leaves = leaves  # the owners of the memory that views in `sources` show
        self._slots = len(plan.slot_bytes)
        self._cond = threading.Condition()
        self._staged = 0
        self._consumed = 0
        self._error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of data the save writes."""
        return sum(item.nbytes for item in self.layout)

    @property
    def streaming(self) -> bool:
        """Whether the state is larger than the budget (staging streams through it)."""
        return len(self._plan.parts) > 1

    def _free(self, part: int) -> bool:
        """Whether `part` may be staged: its buffer was drained, or the save stopped."""
        return self._error is not None or self._consumed > part - self._slots

    def _ready(self, part: int) -> bool:
        """Whether the writer may take `part`: it is staged, or the save stopped."""
        return self._error is not None or self._staged > part

    def stage(self) -> None:
        """Copy every part into the buffers (the caller's thread), waiting for the writer to
        free a buffer when streaming. Returns early, without raising, when the writer failed
        (its error is the save's). Either way it lets go of the state when it returns (see
        `_let_go`): the caller may change the state, extend a bytearray included, while the
        writer writes the copy.

        Raises:
            whatever a copy raised, or what interrupted a wait (a KeyboardInterrupt, a
            signal handler's exception): the writer is stopped either way.
        """
        try:
            for index in range(len(self._plan.parts)):
                with self._cond:
                    self._cond.wait_for(partial(self._free, index))
                    if self._error is not None:
                        return
                self._copy(index)
                with self._cond:
                    self._staged = index + 1
                    self._cond.notify_all()
        except BaseException as exc:
            self.abort(exc)
            raise
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """Drop the references to the state, once every part is staged (or the save
        stopped): `stream` hands out only the staging buffers, so nothing reads the state
        after `stage`, and the caller may change it while the writer writes. The byte views
        of bytearrays and contiguous ndarrays are released, not merely dropped (a traceback
        may still hold this snapshot): while one is exported, Python refuses to resize the
        bytearray (BufferError) and NumPy the array. Tensors are only referenced (no
        export); `_Plan.views`, raw views of small tensors' memory kept for the next save,
        export nothing either."""
        sources, self._sources = self._sources, []
        self._leaves = {}
        for source in sources:
            if isinstance(source, memoryview):
                with contextlib.suppress(BufferError):  # a view of it still exported
                    source.release()

    def _copy(self, index: int) -> None:
        part = self._stager.ops(self._plan, index)
        memory = self._stager.memory(self._plan.parts[index].slot)
        sources = self._sources
        cuda = self._plan.pinned
        if part.targets:
            deque(map(memoryview.__setitem__, part.targets, repeat(_ALL),
                      map(self._plan.views.__getitem__, part.slots)), maxlen=0)
        if not part.ops and not part.wholes:
            return
        torch = sys.modules.get("torch")
        with torch.no_grad() if torch is not None else contextlib.nullcontext():
            wholes = list(map(sources.__getitem__, part.wholes))
            if wholes:
                try:
                    torch._foreach_copy_(part.into, wholes, non_blocking=cuda)  # type: ignore[union-attr]
                except NotImplementedError:  # a dtype torch cannot copy strided (float4)
                    for into, whole in zip(part.into, wholes, strict=True):
                        copy_bytes(into, whole, non_blocking=cuda)
            for op in part.ops:
                source = sources[op[1]]
                if op[0] == _CUT:
                    _copy_range(op[2], source, op[3], op[4], cuda)
                elif isinstance(source, memoryview):
                    memory[op[2] : op[2] + op[4]] = source[op[3] : op[3] + op[4]]
                else:  # an array whose memory does not hold its bytes as stored
                    np = sys.modules["numpy"]
                    into = np.frombuffer(memory[op[2] : op[2] + op[4]],
                                         source.dtype.newbyteorder("<"))
                    first = op[3] // source.itemsize
                    _copy_array_range(into, source, first, first + into.size)
            for device in part.devices:  # every device that copied, not only the current one
                torch.cuda.synchronize(device)  # type: ignore[union-attr]

    def stream(self) -> Iterator[tuple[WriteItem, memoryview]]:
        """The staged pieces in file order (the writer's thread), each once its part is staged.

        Raises:
            StagingAborted: staging failed.
        """
        for index, part in enumerate(self._plan.parts):
            with self._cond:
                self._cond.wait_for(partial(self._ready, index))
                error = self._error
                if error is not None:
                    raise StagingAborted(f"staging stopped ({type(error).__name__}: {error}); "
                                         "the save is abandoned") from None
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
