"""Compare two checkpoints entry by entry (API layer): entries added, removed, changed in kind,
dtype or shape, plain values changed, and for data that differs, by how much.

Data is read as raw bytes and compared with numpy, never torch, so `safepoint diff` runs where
torch is not installed: bfloat16, float8 and complex32 are decoded from their bits. Two
elements are equal when their bits are equal (so -0.0 differs from 0.0, and NaN equals itself).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._api import _read
from ._commit import read_manifest
from ._format import DTYPES, Box, Entry, Manifest, element_count
from ._leaves import ALIAS, BYTES, PICKLE, SHARDED, VALUE, same_value
from ._staging import Destination
from ._tree import checked_keys, join, select
from ._types import Node, StatePath
from .errors import StateMismatch
from .storage import Storage, open_storage

__all__ = ["DiffReport", "EntryDiff", "diff"]

#: Bytes of data read from each checkpoint at a time.
BATCH_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class EntryDiff:
    """One entry that differs between checkpoints A and B.

    Attributes:
        path: the entry's `/`-joined path.
        change: "added" (only in B), "removed" (only in A), "kind", "dtype" (or an array's
            byte order), "shape" (the
            dtype may differ too; of bytes and pickled entries, the length), "value" (a
            plain value), "data" (same kind, dtype and shape, different bytes) or
            "structure" (a container that is of another type, such as a list that became a
            tuple, or a value under a key of another type, such as int 0 and str "0", or an
            empty container only one side has).
        a: the entry in A, described ("tensor F32 (3, 4)", "ndarray F64 big-endian (2,)", or
            the value's repr); None if absent.
            For a "structure" change, the container or key in A ("list", "entry at key 0"),
            or "nothing".
        b: the same for B.
        max_abs_diff: for numeric "data" changes, the largest |a - b| over changed elements
            (`inf` where one side is NaN or infinite and the other is not); None for dtypes
            that hold no one number per element (F4_E2M1_X2, the BITS types).
        changed_fraction: for "data" changes of tensors and arrays, the fraction of elements
            whose bits differ.
        elements: for "data" changes of tensors and arrays, the element count.
    """

    path: str
    change: str
    a: str | None
    b: str | None
    max_abs_diff: float | None = None
    changed_fraction: float | None = None
    elements: int | None = None


@dataclass(frozen=True, slots=True)
class DiffReport:
    """The outcome of `sp.diff`.

    Attributes:
        a: the first checkpoint.
        b: the second checkpoint.
        compared: how many entries (of either) were compared.
        differences: one per entry that differs, in A's entry order, then B's additions,
            then the containers that differ (see `EntryDiff.change`), in A's tree order and
            then B's: two checkpoints that `sp.load` turns into different trees differ.
    """

    a: str
    b: str
    compared: int
    differences: list[EntryDiff] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        """True when no entry or container differs."""
        return not self.differences


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "(" + ", ".join(map(str, shape or ())) + ")"


def _describe(entry: Entry) -> str:
    if entry.kind == VALUE:
        return repr(entry.value)
    kind = "tensor" if entry.kind == SHARDED else entry.kind
    if entry.dtype is None:
        return f"{kind} {entry.nbytes} bytes"
    order = " big-endian" if entry.big_endian else ""
    return f"{kind} {entry.dtype}{order} {_shape_text(entry.shape)}"


def _nbytes(entry: Entry) -> int:
    if entry.kind in (BYTES, PICKLE):
        return entry.nbytes
    return DTYPES[entry.dtype or "U8"].itemsize * element_count(entry.shape or ())


def diff(
    a: str,
    b: str,
    *,
    keys: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> DiffReport:
    """Compare the checkpoints at `a` and `b`, reading the data of every entry both hold with
    the same kind, dtype and shape (each byte checked against its checksum; an alias compares
    as the tensor it is, whether tied in the other checkpoint or not), and their trees'
    containers, which `sp.load` rebuilds (a list and a tuple, an int key and its str twin,
    an empty dict and nothing differ).

    Args:
        a: the first checkpoint.
        b: the second checkpoint.
        keys: compare only paths under these prefixes or matching these globs.
        storage_options: options for both checkpoints' storage backends.

    Returns:
        the differences; `report.identical` is True when there are none.

    Raises:
        CheckpointNotFound: nothing committed at `a` or `b`.
        CorruptCheckpoint: a manifest or the data read is damaged.
        FormatVersionError: `a` or `b` was written by a newer format.
        StateMismatch: `keys` match nothing in either checkpoint.
        SafepointError: `keys` is a str, or holds an item that is not one.
    """
    keys = checked_keys(keys)
    storage_a = open_storage(a, storage_options)
    storage_b = open_storage(b, storage_options)
    try:
        manifest_a, manifest_b = read_manifest(storage_a), read_manifest(storage_b)
        # One selection of both sides' paths: a key names a path as it is in either
        # checkpoint, or is a glob in both.
        chosen = set(select([*manifest_a.entries, *manifest_b.entries.keys()
                             - manifest_a.entries.keys()], keys))
        paths_a = [path for path in manifest_a.entries if path in chosen]
        paths_b = [path for path in manifest_b.entries if path in chosen]
        if keys is not None and not paths_a and not paths_b:
            raise StateMismatch(
                f"keys={list(keys)} match nothing in {a} or {b}: fix the keys (prefixes like "
                "'model/' or globs like 'model/*')", url=a,
            )
        in_a = set(paths_a)
        found: dict[StatePath, EntryDiff] = {}
        same_layout: list[StatePath] = []
        for path in paths_a:
            ea = manifest_a.entries[path]
            eb = manifest_b.entries.get(path)
            if eb is None:
                found[path] = EntryDiff(path, "removed", _describe(ea), None)
            elif change := _layout_change(ea, eb):
                found[path] = EntryDiff(path, change, _describe(ea), _describe(eb))
            elif ea.kind == VALUE:
                if not same_value(ea.value, eb.value):
                    found[path] = EntryDiff(path, "value", _describe(ea), _describe(eb))
            else:
                same_layout.append(path)
        for path, changes in _compared(storage_a, manifest_a, storage_b, manifest_b,
                                       same_layout):
            entry_diff = _data_diff(path, manifest_a.entries[path], manifest_b.entries[path],
                                    changes)
            if entry_diff is not None:
                found[path] = entry_diff
        differences = [found[path] for path in paths_a if path in found]
        differences += [
            EntryDiff(path, "added", None, _describe(manifest_b.entries[path]))
            for path in paths_b if path not in in_a
        ]
        differences += _structure_diffs(manifest_a.tree, manifest_b.tree, keys)
    finally:
        storage_a.close()
        storage_b.close()
    compared = len(in_a | set(paths_b))
    return DiffReport(a, b, compared, differences)


def _nodes(tree: Node) -> dict[StatePath, tuple[str, str, bool]]:
    """Each node of a skeleton by path, as (what it is, how its dict keys it, whether it is
    an empty container). What it is: a container's type ("dict", "list", "tuple", "per-rank
    values"; a stateful object's node as its state dict's, which is what loads), or "entry".
    How it is keyed: `key 0` or `key '0'` for a dict's child (an int key and its str twin
    share a path), else ""."""
    found: dict[StatePath, tuple[str, str, bool]] = {}

    def walk(node: Node, path: StatePath, key: str) -> None:
        if not isinstance(node, dict):
            found[path] = ("entry", key, False)
            return
        ((tag, body),) = node.items()
        if tag == "stateful":
            walk(body, path, key)
            return
        found[path] = ("per-rank values" if tag == "per_rank" else tag, key, not body)
        for child_key, child in body if tag in ("dict", "per_rank") else enumerate(body):
            walk(child, join(path, child_key), f"key {child_key!r}" if tag == "dict" else "")

    walk(tree, "", "")
    return found


def _structure_diffs(tree_a: Node, tree_b: Node, keys: list[str] | None) -> list[EntryDiff]:
    """How the containers of two skeletons differ, among the paths `keys` select: at one
    path, a container of another type, or a node of two dicts under keys of different types
    (not a leaf on one side and a container on the other: their entries differ already); an
    empty container only one side has (one with entries shows in them)."""
    nodes_a, nodes_b = _nodes(tree_a), _nodes(tree_b)
    paths = select([*nodes_a, *(path for path in nodes_b if path not in nodes_a)], keys)
    found: list[EntryDiff] = []
    for path in paths:
        a, b = nodes_a.get(path), nodes_b.get(path)
        if a is not None and b is not None:
            if (a[0] == "entry") != (b[0] == "entry"):
                continue
            if a[1] and b[1] and a[1] != b[1]:  # children of dicts on both sides
                found.append(EntryDiff(path, "structure", f"{a[0]} at {a[1]}",
                                       f"{b[0]} at {b[1]}"))
            elif a[0] != b[0]:
                found.append(EntryDiff(path, "structure", a[0], b[0]))
        elif a is not None and a[2]:
            found.append(EntryDiff(path, "structure", f"empty {a[0]}", "nothing"))
        elif b is not None and b[2]:
            found.append(EntryDiff(path, "structure", "nothing", f"empty {b[0]}"))
    return found


def _layout_change(a: Entry, b: Entry) -> str | None:
    """How the layouts of two entries at one path differ (None: the same, so their data can
    be compared byte for byte). Bytes and pickled entries have no dtype or shape: their
    length is their shape. An array's byte order is part of its dtype, since `sp.load`
    gives a big-endian array back big-endian."""
    kind_a = "tensor" if a.kind in (SHARDED, ALIAS) else a.kind
    kind_b = "tensor" if b.kind in (SHARDED, ALIAS) else b.kind
    if kind_a != kind_b:
        return "kind"
    if a.dtype != b.dtype or a.big_endian != b.big_endian:
        return "dtype"
    if a.shape != b.shape or (a.kind in (BYTES, PICKLE) and a.nbytes != b.nbytes):
        return "shape"
    return None


def _batches(manifest: Manifest, paths: list[StatePath]) -> Iterator[list[StatePath]]:
    """`paths` in batches of at most `BATCH_BYTES` of data, or of one larger entry."""
    batch: list[StatePath] = []
    total = 0
    for path in paths:
        nbytes = _nbytes(manifest.entries[path])
        if batch and total + nbytes > BATCH_BYTES:
            yield batch
            batch, total = [], 0
        batch.append(path)
        total += nbytes
    if batch:
        yield batch


#: What differs in the bytes of (a part of) an entry: how many elements, and the largest
#: |a - b| among them (None for data that holds no one number per element).
_Changes = tuple[int, float | None]


def _compared(
    storage_a: Storage, manifest_a: Manifest, storage_b: Storage, manifest_b: Manifest,
    paths: list[StatePath],
) -> Iterator[tuple[StatePath, list[_Changes]]]:
    """What differs in the data of each of `paths` (entries of the same layout in A and B),
    read a batch at a time from each side: an entry larger than a batch in slices of half a
    batch per side, each compared before the next is read, so that memory stays about a
    batch however large the entry (a 2 GiB embedding is not held whole, twice)."""
    for batch in _batches(manifest_a, paths):
        entry = manifest_a.entries[batch[0]]
        if (len(batch) == 1 and _nbytes(entry) > BATCH_BYTES and entry.dtype is not None
                and entry.kind not in (BYTES, PICKLE)):
            path = batch[0]
            slices = _slices(entry.shape or (), DTYPES[entry.dtype].itemsize, BATCH_BYTES // 2)
            yield path, [_changes(_raw(storage_a, manifest_a, batch, {path: box})[path],
                                  _raw(storage_b, manifest_b, batch, {path: box})[path], entry)
                         for box in slices]
            continue
        raw_a = _raw(storage_a, manifest_a, batch)
        raw_b = _raw(storage_b, manifest_b, batch)
        for path in batch:
            yield path, [_changes(raw_a[path], raw_b[path], manifest_a.entries[path])]


def _slices(shape: tuple[int, ...], itemsize: int, limit: int) -> Iterator[Box]:
    """Boxes that cut a tensor of `shape` into consecutive runs of its row-major elements,
    in order, each of at most `limit` bytes (or of one element, where one is larger): whole
    trailing blocks of the largest dimensions that fit, several along the dimension before
    them, one index at a time along the dimensions before that."""
    inner, dim = itemsize, len(shape)  # bytes of the block of dimensions from `dim` on
    while dim > 0 and inner * shape[dim - 1] <= limit:
        dim -= 1
        inner *= shape[dim]
    if dim == 0:
        yield (0,) * len(shape), shape
        return
    step = max(1, limit // inner)
    outer, rest = shape[: dim - 1], shape[dim:]
    for index in itertools.product(*map(range, outer)):
        for start in range(0, shape[dim - 1], step):
            yield ((*index, start, *(0,) * len(rest)),
                   ((1,) * len(outer) + (min(step, shape[dim - 1] - start),) + rest))


def _raw(storage: Storage, manifest: Manifest, paths: list[StatePath],
         boxes: dict[StatePath, Box] | None = None) -> dict[StatePath, Any]:
    """The bytes of each entry, or of its piece in `boxes`, as uint8 arrays, checked against
    their checksums."""
    boxes = boxes or {}
    holders = {}
    for path in paths:
        entry = manifest.entries[path]
        box = boxes.get(path)
        holders[path] = np.empty(_nbytes(entry) if box is None else
                                 DTYPES[entry.dtype or "U8"].itemsize * element_count(box[1]),
                                 np.uint8)
    _read(storage, manifest, {
        path: Destination(holder.data, holder) for path, holder in holders.items()
    }, boxes)
    return holders


def _data_diff(path: StatePath, entry: Entry, entry_b: Entry, changes: list[_Changes]
               ) -> EntryDiff | None:
    """How `path` differs, from what differs in each part of its data (None: nothing);
    `entry` (A's) and `entry_b` have the same layout."""
    changed = sum(count for count, _ in changes)
    if not changed:
        return None
    description, description_b = _describe(entry), _describe(entry_b)
    if entry.kind in (BYTES, PICKLE) or entry.dtype is None:
        return EntryDiff(path, "data", description, description_b)
    elements = element_count(entry.shape or ())
    gaps = [gap for _, gap in changes if gap is not None]
    return EntryDiff(path, "data", description, description_b,
                     max_abs_diff=max(gaps) if gaps else None,
                     changed_fraction=changed / elements, elements=elements)


def _changes(a: Any, b: Any, entry: Entry) -> _Changes:
    """What differs between the bytes `a` and `b` (uint8 arrays of whole elements of
    `entry`'s dtype; of single bytes for other data). Elements are compared a window at a
    time, and only those that differ are decoded and widened, so the temporaries stay a
    small part of a batch."""
    dtype = entry.dtype if entry.kind not in (BYTES, PICKLE) else None
    measured = dtype if dtype not in _OPAQUE else None  # a dtype of one number per element
    itemsize = DTYPES[dtype].itemsize if dtype is not None else 1
    unit = math.gcd(itemsize, 8)  # compared as words of `unit` bytes, `itemsize // unit` each
    words_a = a.view(f"<u{unit}").reshape(-1, itemsize // unit)
    words_b = b.view(f"<u{unit}").reshape(-1, itemsize // unit)
    window = max(1, BATCH_BYTES // 64)
    changed, largest = 0, 0.0
    for start in range(0, len(words_a), window):
        differ = words_a[start : start + window] != words_b[start : start + window]
        differ = differ[:, 0] if differ.shape[1] == 1 else differ.any(axis=1)
        count = int(np.count_nonzero(differ))
        if not count:
            continue
        changed += count
        if measured is not None:
            span = slice(start * itemsize, (start + len(differ)) * itemsize)
            picked_a = a[span].reshape(-1, itemsize)[differ].reshape(-1)
            picked_b = b[span].reshape(-1, itemsize)[differ].reshape(-1)
            gaps = _gaps(decode(picked_a, measured), decode(picked_b, measured))
            largest = max(largest, float(gaps.max()))
    return changed, largest if measured is not None else None


def _gaps(a: Any, b: Any) -> Any:
    """|a - b| element by element: exact for integers (as uint64: a float64 would round 2**62
    and 2**62 + 1 to the same number), else in float64 (complex128) so that fp16 and bf16
    differences neither overflow nor round, with `inf` where one side is NaN."""
    if a.dtype.kind in "biu":
        if a.dtype.kind == "u":
            a, b = a.astype(np.uint64), b.astype(np.uint64)
            bigger = a >= b
        else:  # the true gap fits in uint64, and uint64 subtraction wraps to it
            bigger = a.astype(np.int64) >= b.astype(np.int64)
            a, b = a.astype(np.int64).view(np.uint64), b.astype(np.int64).view(np.uint64)
        return np.where(bigger, a - b, b - a)
    # Signalling NaNs raise "invalid" when cast.
    with np.errstate(invalid="ignore", over="ignore"):
        widened = np.complex128 if a.dtype.kind == "c" else np.float64
        gaps = np.abs(a.astype(widened) - b.astype(widened))
    gaps[np.isnan(gaps)] = np.inf
    return gaps


def _minifloat_table(exponent_bits: int, mantissa_bits: int, bias: int,
                     nan_codes: Sequence[int]) -> Any:
    """The float64 value of every byte of an 8-bit float format without infinities."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (codes & ((1 << mantissa_bits) - 1)) / (1 << mantissa_bits)
    table = sign * np.where(
        exponent == 0, mantissa * 2.0 ** (1 - bias), (1 + mantissa) * 2.0 ** (exponent - bias)
    )
    table[list(nan_codes)] = np.nan
    return table


#: Dtypes whose bytes hold no one number per element (packed FP4 pairs, raw bit containers):
#: a diff counts the elements that changed, with no numeric gap.
_OPAQUE = frozenset({"F4_E2M1_X2", "BITS8", "BITS16", "BITS1X8", "BITS2X4", "BITS4X2"})

_FLOAT8_TABLES = {
    "F8_E4M3": _minifloat_table(4, 3, 7, [0x7F, 0xFF]),
    "F8_E4M3FNUZ": _minifloat_table(4, 3, 8, [0x80]),
    "F8_E5M2FNUZ": _minifloat_table(5, 2, 16, [0x80]),
    "F8_E8M0": np.where(np.arange(256) == 0xFF, np.nan, 2.0 ** (np.arange(256) - 127.0)),
}


def decode(raw: Any, dtype: str) -> Any:
    """The elements of little-endian bytes `raw` (a uint8 array) of safepoint dtype `dtype`, as
    a numpy array of a type numpy computes with: the dtype's own where numpy has it (integers
    stay integers), else float16, float32, float64 or complex64."""
    numpy_name = DTYPES[dtype].numpy
    if numpy_name is not None:
        return raw.view(np.dtype(numpy_name))
    if dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E5M2":
        return (raw.astype(np.uint16) << 8).view(np.float16)
    if dtype == "C32":
        halves = raw.view("<f2").astype(np.float32)
        return halves[0::2] + 1j * halves[1::2]
    return _FLOAT8_TABLES[dtype][raw]
