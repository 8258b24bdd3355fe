"""The on-disk format: manifest records, JSON encoding with validation, dtype names and the
byte layout of data files (format layer). `docs/format.md` is the normative description.

A checkpoint is a directory (or object prefix) holding `manifest.json` and `data/` files. The
manifest is written last and is the only commit marker. Data files hold raw little-endian bytes
at the offsets the manifest records; every chunk carries one checksum per `block_bytes`.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import operator
import posixpath
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import orjson

from ._checksum import checksum_function
from ._leaves import (
    ALIAS,
    BYTES,
    MAX_INT_DIGITS,
    NDARRAY,
    PICKLE,
    SHARDED,
    TENSOR,
    VALUE,
    too_long_int,
)
from ._types import Node, StatePath
from .errors import CorruptCheckpoint, FormatVersionError, UnsupportedLeaf

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "MANIFEST",
    "Box",
    "Chunk",
    "DType",
    "Entry",
    "Manifest",
    "box_runs",
    "decode",
    "decode_float",
    "encode",
    "encode_value",
    "is_data_file",
    "records",
    "version_for",
]

logger = logging.getLogger(__name__)

FORMAT = "safepoint"
#: The highest major version this reader reads; it refuses a higher one. Additive fields do
#: not bump it. Writers emit the lowest version that reads their manifest right (`version_for`).
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
#: How incremental saves hash each block to match it with an earlier save's.
BLOCK_HASH = "xxh3-128"
DATA_DIR = "data"
#: Default bytes covered by one checksum: small enough that a ranged read verifies little
#: more than it reads, large enough that a 10 GB checkpoint has a short digest list.
BLOCK_BYTES = 4 << 20
#: Entries of at least LARGE_ENTRY bytes start on a 4 KiB boundary (page and O_DIRECT friendly);
#: smaller ones on a 64-byte boundary, which any dtype and memory map accepts without padding
#: thousands of small tensors to pages.
LARGE_ENTRY = 1 << 20
PAGE = 4096
SMALL_ALIGN = 64

_DATA_KINDS = frozenset({TENSOR, NDARRAY, BYTES, PICKLE, SHARDED})

#: A box in a global tensor: (offsets, shape), one int per dimension.
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class DType:
    """An element type: its stable name in the format and its torch and numpy spellings."""

    name: str
    torch: str
    numpy: str | None
    itemsize: int


#: Every torch dtype whose elements are whole bytes, stored as torch holds them. `F4_E2M1_X2`
#: and the `BITS*` types are opaque to safepoint (two FP4 values per byte, raw bit containers):
#: their bytes are copied, never interpreted, and they have no numpy spelling (`BITS8` as
#: `|u1` would take numpy's uint8 from `U8`). Quantized dtypes (a scale and zero point beside
#: the bytes) and the sub-byte `uint1`..`uint7`, `int1`..`int7` (no bit layout defined by torch)
#: have no name: `_staging` refuses them.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("F64", "float64", "<f8", 8),
        DType("F32", "float32", "<f4", 4),
        DType("F16", "float16", "<f2", 2),
        DType("BF16", "bfloat16", None, 2),
        DType("F8_E4M3", "float8_e4m3fn", None, 1),
        DType("F8_E5M2", "float8_e5m2", None, 1),
        DType("F8_E4M3FNUZ", "float8_e4m3fnuz", None, 1),
        DType("F8_E5M2FNUZ", "float8_e5m2fnuz", None, 1),
        DType("F8_E8M0", "float8_e8m0fnu", None, 1),
        DType("F4_E2M1_X2", "float4_e2m1fn_x2", None, 1),
        DType("C32", "complex32", None, 4),
        DType("C64", "complex64", "<c8", 8),
        DType("C128", "complex128", "<c16", 16),
        DType("I64", "int64", "<i8", 8),
        DType("I32", "int32", "<i4", 4),
        DType("I16", "int16", "<i2", 2),
        DType("I8", "int8", "|i1", 1),
        DType("U64", "uint64", "<u8", 8),
        DType("U32", "uint32", "<u4", 4),
        DType("U16", "uint16", "<u2", 2),
        DType("U8", "uint8", "|u1", 1),
        DType("BOOL", "bool", "|b1", 1),
        DType("BITS8", "bits8", None, 1),
        DType("BITS16", "bits16", None, 2),
        DType("BITS1X8", "bits1x8", None, 1),
        DType("BITS2X4", "bits2x4", None, 1),
        DType("BITS4X2", "bits4x2", None, 1),
    )
}
DTYPE_BY_TORCH = {d.torch: d for d in DTYPES.values()}
DTYPE_BY_NUMPY = {d.numpy: d for d in DTYPES.values() if d.numpy}


@dataclass(frozen=True, slots=True)
class Chunk:
    """Bytes of one entry stored contiguously in one data file.

    Attributes:
        file: the data file, relative to the checkpoint (`data/...`).
        offset: where the bytes start in that file.
        nbytes: how many bytes.
        digests: one checksum per `block_bytes` of the chunk.
        box: for a chunk of a "sharded" entry, where its piece lies in the global tensor; the
            piece's elements in row-major order are the bytes of this chunk and of the
            consecutive chunks with the same box, joined (see `box_runs`).
    """

    file: str
    offset: int
    nbytes: int
    digests: tuple[int, ...]
    box: Box | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """One leaf of the saved state.

    Attributes:
        kind: "tensor", "ndarray", "bytes", "pickle", "sharded" (bytes in data files),
            "value" (in the manifest) or "alias". A "sharded" entry is a tensor of `shape`
            stored as pieces, each in one chunk or several consecutive ones, every chunk
            carrying its piece's box. An "alias" entry is a tensor whose bytes are those of
            the "tensor" entry its `value` names (tied weights), with the same dtype and
            shape, and no chunks of its own.
        dtype: the element type's name (tensor, ndarray, alias).
        shape: the shape (tensor, ndarray, alias).
        chunks: where the bytes are.
        value: the plain value (kind "value"), or the path of the aliased entry ("alias").
        device: where a tensor lived when saved, for information only.
        scalar: an ndarray entry that was a numpy scalar.
        strides: a "tensor" entry's strides (in elements) when it was dense but not
            contiguous (channels_last, a transposed weight): a layout `permuted_dense`
            accepts, which a load without a target gives the new tensor, as `torch.load`
            does (fused optimizers need their state laid out as the parameters are). The
            bytes are still the elements in row-major order of `shape`. None otherwise.
        big_endian: an "ndarray" entry whose array was big-endian (its bytes are stored
            little-endian, as every entry's): a load without a target gives it back so.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunks: tuple[Chunk, ...] = ()
    value: Any = None
    device: str | None = None
    scalar: bool = False
    strides: tuple[int, ...] | None = None
    big_endian: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of data this entry holds in data files."""
        chunks = self.chunks
        # One chunk is the usual case: asked for each of 20,000 entries, 1 ms instead of 4.
        return chunks[0].nbytes if len(chunks) == 1 else sum(map(_NBYTES, chunks))


_NBYTES = operator.attrgetter("nbytes")


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a reader needs: entries, files, the tree and who wrote it."""

    save_id: str
    created: str
    entries: dict[StatePath, Entry]
    files: dict[str, int]
    tree: Node
    metadata: dict[str, Any] = field(default_factory=dict)
    library_version: str = ""
    torch_version: str | None = None
    world_size: int = 1
    checksum: str = "crc32c"
    block_bytes: int = BLOCK_BYTES
    version: int = 1
    hashes: dict[StatePath, tuple[str, ...]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of all data files."""
        return sum(self.files.values())


def data_file_name(save_id: str, rank: int, index: int) -> str:
    """The name of a save's data file: unique per save, so a save never touches bytes that a
    committed manifest references."""
    return f"{DATA_DIR}/{save_id}-r{rank:05d}-{index:04d}.bin"


#: The names safepoint writes in a checkpoint besides its manifest: data files and the
#: temporary files their copies and the manifest are written to before a rename.
_WRITTEN = re.compile(
    rf"(?:{DATA_DIR}/[0-9a-f]{{32}}-r\d{{5}}-\d{{4}}\.bin(?:\.tmp-[0-9a-f]{{32}})?"
    rf"|{re.escape(MANIFEST)}\.tmp-[0-9a-f]{{32}})"
)


def written_by_safepoint(name: str) -> bool:
    """Whether `name` (relative to a checkpoint) is one safepoint writes there, other than the
    manifest: the only files it may remove as leftovers of a save that never committed. A
    user's own `data/` folder in a directory saved into is not its to remove."""
    return _WRITTEN.fullmatch(name) is not None


def is_data_file(name: str) -> bool:
    """Whether `name` is a normalised relative path inside a checkpoint's `data/`: the only
    place a manifest may point to, and the only files an archive of one may hold besides it."""
    parts = name.split("/")
    return (
        posixpath.normpath(name) == name and "\\" not in name and "\0" not in name
        and len(parts) >= 2 and parts[0] == DATA_DIR and ".." not in parts
    )


def aligned(offset: int, nbytes: int) -> int:
    """Where an entry of `nbytes` may start at or after `offset`."""
    align = PAGE if nbytes >= LARGE_ENTRY else SMALL_ALIGN
    return -(-offset // align) * align


def placed(offset: int, sizes: Sequence[int]) -> list[int]:
    """Where entries of `sizes` start, laid one after another from `offset`, each `aligned`;
    when all are small, as a C-level running sum (a save of 20,000 small tensors)."""
    if sizes and max(sizes) < LARGE_ENTRY:
        padded = [-(-nbytes // SMALL_ALIGN) * SMALL_ALIGN for nbytes in sizes]
        return list(itertools.accumulate(padded[:-1], initial=aligned(offset, 0)))
    starts = []
    for nbytes in sizes:
        offset = aligned(offset, nbytes)
        starts.append(offset)
        offset += nbytes
    return starts


def version_for(entries: Mapping[StatePath, Entry]) -> int:
    """The lowest format version that reads `entries` right: 4 once a value is a NaN other
    than `float("nan")` (spelled with its bits, which readers of version 3 ignore and read
    `float("nan")`); else 3 once a piece of a "sharded" entry lies in several chunks (as
    incremental saves in a process group write), which readers of version 2 refuse as a
    piece whose bytes do not match its box; else 2 once an entry of another kind has several
    chunks (as incremental saves write), which readers of version 1 took for one chunk each;
    else 1."""
    version = 1
    for entry in entries.values():
        if len(entry.chunks) < 2:
            if isinstance(entry.value, float) and _other_nan(entry.value):
                return 4
        elif entry.kind != SHARDED:
            version = max(version, 2)
        elif len(box_runs(entry.chunks)) < len(entry.chunks):
            version = 3
    return version


def permuted_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether `strides` lay out a tensor of `shape` (at least one element) densely, without
    overlap: a contiguous layout with its dimensions permuted, such as channels_last or a
    transpose. A dimension of size 1 may have any stride up to the element count (torch
    gives them several), since it never moves through memory; an expanded or sliced view
    is no such layout."""
    count = math.prod(shape)
    if not count or len(strides) != len(shape):
        return False
    expected = 1
    for stride, size in sorted(zip(strides, shape, strict=True)):
        if size == 1:
            if not 0 <= stride <= count:
                return False
        elif stride != expected:
            return False
        else:
            expected *= size
    return True


def box_runs(chunks: Sequence[Chunk]) -> list[tuple[Box | None, tuple[Chunk, ...]]]:
    """The runs of consecutive `chunks` with one box, as (box, chunks): the pieces of a
    "sharded" entry, whose bytes are those of their chunks joined in order, or the one run
    (box None) of any other entry's chunks, whose piece is its whole tensor."""
    return [(box, tuple(run))
            for box, run in itertools.groupby(chunks, operator.attrgetter("box"))]


def element_count(shape: Sequence[int]) -> int:
    """Elements in a tensor of `shape`."""
    return math.prod(shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The box where `a` and `b` overlap, or None when they share no element."""
    offsets, shape = [], []
    for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True):
        start, end = max(ao, bo), min(ao + an, bo + bn)
        if end <= start:
            return None
        offsets.append(start)
        shape.append(end - start)
    return tuple(offsets), tuple(shape)


def overlapping_pair(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Indices of two boxes sharing an element, or None when they are pairwise disjoint (a
    sweep along the first dimension, so split pieces compare only with their neighbours)."""
    nonempty = [i for i, box in enumerate(boxes) if element_count(box[1])]
    if not nonempty or not boxes[nonempty[0]][1]:
        return (nonempty[0], nonempty[1]) if len(nonempty) > 1 else None
    order = sorted(nonempty, key=lambda i: boxes[i][0][0])
    active: list[int] = []
    for i in order:
        start = boxes[i][0][0]
        active = [j for j in active if boxes[j][0][0] + boxes[j][1][0] > start]
        for j in active:
            if intersect(boxes[i], boxes[j]) is not None:
                return j, i
        active.append(i)
    return None


# -- encoding ---------------------------------------------------------------------------------


#: The bits of `float("nan")`, the NaN that {"float": "nan"} stands for.
_NAN_BITS = 0x7FF8000000000000
#: How {"float": "nan", "bits": ...} spells any other NaN: its 64 bits in lowercase hex.
_HEX_BITS = re.compile("[0-9a-f]{16}")


def _float_bits(value: float) -> int:
    """A float's IEEE 754 binary64 bits."""
    return int.from_bytes(struct.pack("<d", value), "little")


def _other_nan(value: float) -> bool:
    """Whether `value` is a NaN other than `float("nan")`: its sign or payload differs (the
    NaN x86 arithmetic makes, inf - inf, has the sign bit set)."""
    return value != value and _float_bits(value) != _NAN_BITS


def encode_value(value: Any) -> Any:
    """A plain value as JSON; non-finite floats become {"float": "nan"} (JSON has no NaN, and
    a dict is never a leaf value, so the spelling is unambiguous), and a NaN other than
    `float("nan")` {"float": "nan", "bits": "fff8000000000000"}, its bits in hex.

    Raises:
        ValueError: an int of more than `MAX_INT_DIGITS` digits (`encode` names its path).
    """
    if isinstance(value, float) and not math.isfinite(value):
        if _other_nan(value):
            return {"float": "nan", "bits": f"{_float_bits(value):016x}"}
        return {"float": repr(value)}
    if too_long_int(value):
        raise ValueError(f"an int of more than {MAX_INT_DIGITS} digits")
    return value


def _holds_too_long_int(value: Any) -> bool:
    """Whether JSON data (the metadata) holds an int of more than `MAX_INT_DIGITS` digits."""
    if isinstance(value, dict):
        return any(_holds_too_long_int(child) for child in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_too_long_int(child) for child in value)
    return too_long_int(value)


def decode_float(value: dict[str, Any]) -> float | None:
    """The non-finite float a value object spells, or None when it spells none (an object
    with any key besides "float", or "float" and "bits", spells none)."""
    name, bits = value.get("float"), value.get("bits")
    if bits is None:
        return float(name) if len(value) == 1 and name in ("nan", "inf", "-inf") else None
    if (len(value) != 2 or name != "nan" or type(bits) is not str
            or not _HEX_BITS.fullmatch(bits)):
        return None
    number: float = struct.unpack("<d", int(bits, 16).to_bytes(8, "little"))[0]
    return number if number != number else None


#: Devices that `_attrs` leaves out (checked inline: one call per entry adds up).
_PLAIN_DEVICES = frozenset({None, "cpu"})


def _attrs(entry: Entry) -> dict[str, Any] | None:
    attrs: dict[str, Any] = {}
    if entry.device is not None and entry.device != "cpu":
        attrs["device"] = entry.device
    if entry.scalar:
        attrs["scalar"] = True
    if entry.strides is not None:
        attrs["strides"] = entry.strides
    if entry.big_endian:
        attrs["byteorder"] = "big"
    return attrs or None


def encode(manifest: Manifest) -> bytes:
    """The manifest as UTF-8 JSON, its entries and chunks as column tables (compact, and fast
    to parse for states of many thousands of tensors). Columns are built one at a time: a
    state of 20,000 tensors makes a few hundred thousand cells.

    Raises:
        UnsupportedLeaf: a value or the metadata holds an int of more than `MAX_INT_DIGITS`
            digits, which readers would refuse to parse; named by path ("<metadata>").
    """
    try:
        if _holds_too_long_int(manifest.metadata):
            raise ValueError(f"an int of more than {MAX_INT_DIGITS} digits")
        return seal(_json(_document(manifest)))
    except ValueError as exc:  # an int too long for readers to parse
        path = _long_int(manifest)
        raise UnsupportedLeaf(
            f"{exc}: the {'metadata' if path == '<metadata>' else 'state'} holds an int too "
            f"long for JSON readers (more than {MAX_INT_DIGITS} digits, at {path!r}); store "
            "it as a str or a tensor, or wrap it in sp.Pickled",
            path=path,
        ) from exc


def _json(document: dict[str, Any]) -> bytes:
    """`document` as compact JSON: by orjson, ten times faster than json (W2's manifest of
    20,000 entries in 2 ms instead of 19), or by json where orjson refuses (an int beyond 64
    bits, a lone surrogate in a str). Neither meets a float that is not finite: values spell
    those as objects (`encode_value`), and metadata is refused with one."""
    try:
        return orjson.dumps(document)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def _document(manifest: Manifest) -> dict[str, Any]:
    """The manifest as a JSON object, without its seal (see `encode`)."""
    file_index = {name: index for index, name in enumerate(manifest.files)}
    rows = list(manifest.entries.values())
    entries: dict[str, list[Any]] = {
        "path": list(manifest.entries),
        "kind": [entry.kind for entry in rows],
        "dtype": [entry.dtype for entry in rows],
        "shape": [entry.shape for entry in rows],
        "value": [encode_value(entry.value) if entry.kind == VALUE
                  else entry.value if entry.kind == ALIAS else None for entry in rows],
        "attrs": [
            _attrs(entry)
            if entry.scalar or entry.device not in _PLAIN_DEVICES or entry.strides is not None
            or entry.big_endian else None
            for entry in rows
        ],
    }
    placed = [(index, chunk) for index, entry in enumerate(rows) for chunk in entry.chunks]
    pieces = [chunk for _, chunk in placed]
    chunks: dict[str, list[Any]] = {
        "entry": [index for index, _ in placed],
        "file": [file_index[chunk.file] for chunk in pieces],
        "offset": [chunk.offset for chunk in pieces],
        "nbytes": [chunk.nbytes for chunk in pieces],
        "digests": [chunk.digests for chunk in pieces],
    }
    if any(chunk.box for chunk in pieces):
        chunks["offsets"] = [chunk.box[0] if chunk.box else None for chunk in pieces]
        chunks["shape"] = [chunk.box[1] if chunk.box else None for chunk in pieces]
    document = {
        "format": FORMAT,
        "version": manifest.version,
        "save_id": manifest.save_id,
        "created": manifest.created,
        "library_version": manifest.library_version,
        "torch_version": manifest.torch_version,
        "world_size": manifest.world_size,
        "checksum": {"algorithm": manifest.checksum, "block_bytes": manifest.block_bytes},
        "metadata": manifest.metadata,
        "files": [{"name": name, "nbytes": nbytes} for name, nbytes in manifest.files.items()],
        "entries": entries,
        "chunks": chunks,
        "tree": manifest.tree,
    }
    if manifest.hashes:
        document["hashes"] = {
            "algorithm": BLOCK_HASH,
            "blocks": [manifest.hashes.get(path) for path in manifest.entries],
        }
    document["checksum"]["manifest"] = MANIFEST_CHECKSUM
    return document


def seal(body: bytes) -> bytes:
    """`body` (a manifest's JSON object) with its checksum as the last field: the crc32c of
    every byte before that field. Data bytes have their block digests; this covers what the
    manifest holds itself (a step counter, a data position, the learning rate), so a flipped
    bit there is found too."""
    head = body.rstrip()[:-1]  # without the closing brace
    return head + b"%s%d}" % (_SEAL, checksum_function(MANIFEST_CHECKSUM)(head))


def _long_int(manifest: Manifest) -> StatePath:
    """The path of the first int value of `manifest` that is too long (`too_long_int`), else
    "<metadata>" when the metadata holds one, else "<tree>" (a dict key too long for this
    process to print)."""
    for path, entry in manifest.entries.items():
        if entry.kind == VALUE and too_long_int(entry.value):
            return path
    return "<metadata>" if _holds_too_long_int(manifest.metadata) else "<tree>"


# -- decoding with validation ------------------------------------------------------------------


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _all_counts(values: list[Any]) -> bool:
    """Whether every item is a non-negative int (not a bool), checked in bulk: a state of
    20,000 tensors has a hundred thousand such cells."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0)


def shape_sound(shape: Sequence[int], itemsize: int, *, array: bool = False) -> bool:
    """Whether a tensor (or, with `array`, a NumPy array) of `shape` (non-negative ints) can
    be made, as its library decides even when it has no elements: at most `MAX_DIMS`
    dimensions and, within int64, for a tensor the product of the dimensions after the first
    (its largest stride) times `itemsize` and each running product of the dimensions (torch's
    element count), for an array the product of all of them times `itemsize`, empty
    dimensions counted as 1 in those products (NumPy refuses more than torch: it counts the
    first dimension too). Writers refuse a tensor readers would refuse
    (`_staging.tensor_entry`)."""
    if len(shape) > MAX_DIMS:
        return False
    strides = math.prod(max(d, 1) for d in (shape if array else shape[1:])) * itemsize
    return strides <= _INT64_MAX and (array or max(itertools.accumulate(shape, operator.mul),
                                                   default=0) <= _INT64_MAX)


def _box_sound(offsets: Any, shape: Any) -> bool:
    """Whether a chunk's `offsets` and `shape` cells are both null, or lists of non-negative
    integers of one length."""
    if offsets is None and shape is None:
        return True
    return (
        isinstance(offsets, list) and isinstance(shape, list) and len(offsets) == len(shape)
        and all(map(_is_count, offsets + shape))
    )


_T = TypeVar("_T")

#: The algorithm sealing a manifest (`checksum.manifest`), and what precedes its value.
MANIFEST_CHECKSUM = "crc32c"
_SEAL = b',"manifest_checksum":'
_SEAL_TAIL = re.compile(rb"(0|[1-9][0-9]{0,9})\}\s*\Z")
#: The most dimensions a tensor or array may have (torch and NumPy 2 allow 64), and the
#: largest size, stride or file offset (torch and file offsets are int64).
MAX_DIMS = 64
_INT64_MAX = (1 << 63) - 1


def records(cls: type[_T], count: int, *columns: Iterable[Any]) -> list[_T]:
    """`count` instances of the frozen slots dataclass `cls`, one column of values per field
    (in field order), equal to what `cls(*row)` makes: each slot is set a column at a time
    instead of through the generated `__init__`, whose `object.__setattr__` per field made
    W2's 20,000 entries and 20,000 chunks cost 60 ms to decode (or to save) instead of 15."""
    made = list(map(cls.__new__, itertools.repeat(cls, count)))
    for name, column in zip(cls.__dataclass_fields__, columns, strict=True):  # type: ignore[attr-defined]
        collections.deque(map(getattr(cls, name).__set__, made, column), maxlen=0)
    return made


class _Reader:
    """Decodes one manifest document, naming the offending field in every error.

    A table of many similar records (chunks) is checked a column at a time; only when that
    fails does a row-by-row pass run, to name the first offending row, so the error is the
    same either way.
    """

    def __init__(self, url: str, on_files: Callable[[dict[str, int]], object] | None) -> None:
        self.url = url
        self.on_files = on_files

    def fail(self, where: str, problem: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"{self.url}/{MANIFEST}: {where}: {problem}; the checkpoint is damaged or was not "
            "written by safepoint: restore an earlier one",
            url=self.url,
        )

    def newer(self, where: str, problem: str) -> FormatVersionError:
        """The error for a name this safepoint does not know (a kind, dtype or checksum
        algorithm added since): the checkpoint is not damaged, and an older step must not be
        restored in its place."""
        return FormatVersionError(
            f"{self.url}/{MANIFEST}: {where}: {problem}; it was written by a newer safepoint "
            "(or another tool): upgrade safepoint (pip install -U safepoint) to read it",
            url=self.url,
        )

    def get(self, obj: Any, key: str, kind: type, where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(where, f"missing field {key!r}")
        value = obj[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise self.fail(f"{where}.{key}", f"expected {kind.__name__}, got {value!r:.60}")
        return value

    def count(self, obj: Any, key: str, where: str) -> int:
        value: int = self.get(obj, key, int, where)
        if value < 0:
            raise self.fail(f"{where}.{key}", f"negative {value}")
        return value

    def columns(self, doc: Any, table: str, names: tuple[str, ...]) -> list[list[Any]]:
        raw = self.get(doc, table, dict, "manifest")
        columns = [self.get(raw, name, list, table) for name in names]
        if len({len(column) for column in columns}) > 1:
            raise self.fail(table, "its columns differ in length")
        return columns

    def file_name(self, name: Any, where: str) -> str:
        if not isinstance(name, str) or not name:
            raise self.fail(where, "file name must be a non-empty string")
        if not is_data_file(name):
            raise self.fail(where, f"file {name!r} points outside the checkpoint's data/")
        return name

    def files(self, raw: Any) -> dict[str, int]:
        if not isinstance(raw, list):
            raise self.fail("files", "expected a list")
        files: dict[str, int] = {}
        for index, record in enumerate(raw):
            where = f"files[{index}]"
            name = self.file_name(self.get(record, "name", str, where), f"{where}.name")
            if name in files:
                raise self.fail(where, f"{name!r} is listed twice")
            files[name] = self.count(record, "nbytes", where)
            if files[name] > _INT64_MAX:
                raise self.fail(f"{where}.nbytes", f"{files[name]} bytes is beyond any file")
        return files

    def chunks(
        self, doc: Any, files: dict[str, int], entries: int, block_bytes: int
    ) -> tuple[dict[int, tuple[Chunk, ...]], bool]:
        """Chunks grouped by entry index, every one checked to lie inside its file, and
        whether any has a box."""
        names, sizes = list(files), list(files.values())
        fields = ("entry", "file", "offset", "nbytes", "digests")
        table = doc.get("chunks")
        boxed = isinstance(table, dict) and ("offsets" in table or "shape" in table)
        entry, file, offset, nbytes, digests = self.columns(doc, "chunks", fields)
        offsets, shape = ([None] * len(entry),) * 2
        if boxed:
            offsets, shape = self.columns(doc, "chunks", ("offsets", "shape"))
            if len(offsets) != len(entry):
                raise self.fail("chunks", "its columns differ in length")
        sound = (
            _all_counts(entry) and _all_counts(file) and _all_counts(offset)
            and _all_counts(nbytes)
            and (not entry or (max(entry) < entries and max(file) < len(names)))
            and all(map(operator.le, map(operator.add, offset, nbytes),
                        map(sizes.__getitem__, file)))
            and set(map(type, digests)) <= {list}
            and list(map(len, digests)) == [-(-n // block_bytes) for n in nbytes]
            and _all_counts(list(itertools.chain.from_iterable(digests)))
            and (not boxed or all(map(_box_sound, offsets, shape)))
        )
        if not sound:
            rows = zip(entry, file, offset, nbytes, digests, offsets, shape, strict=True)
            for row, (e, f, o, n, d, box_offsets, box_shape) in enumerate(rows):
                self.check_chunk(f"chunks[{row}]", e, f, o, n, d, box_offsets, box_shape,
                                 names, sizes, entries, block_bytes)
        boxes = [
            None if o is None and s is None else (tuple(o), tuple(s))
            for o, s in zip(offsets, shape, strict=True)
        ] if boxed else offsets
        built = records(Chunk, len(entry), map(names.__getitem__, file), offset, nbytes,
                      map(tuple, digests), boxes)
        if len(set(entry)) == len(entry):  # one chunk per entry, the usual case
            return dict(zip(entry, zip(built), strict=True)), boxed
        grouped: dict[int, list[Chunk]] = {}
        for index, chunk in zip(entry, built, strict=True):
            grouped.setdefault(index, []).append(chunk)
        return {index: tuple(chunks) for index, chunks in grouped.items()}, boxed

    def check_chunk(
        self, where: str, entry: Any, file: Any, offset: Any, nbytes: Any, digests: Any,
        offsets: Any, shape: Any, names: list[str], sizes: list[int], entries: int,
        block_bytes: int,
    ) -> None:
        """Raise for the first problem of one chunk record."""
        if not (_is_count(entry) and entry < entries):
            raise self.fail(where, f"entry index {entry!r:.20} is not in entries")
        if not (_is_count(file) and file < len(names)):
            raise self.fail(where, f"file index {file!r:.20} is not in files")
        if not (_is_count(offset) and _is_count(nbytes)):
            raise self.fail(where, "offset and nbytes must be non-negative integers")
        if offset + nbytes > sizes[file]:
            raise self.fail(
                where, f"bytes {offset}..{offset + nbytes} lie beyond the end of "
                f"{names[file]} ({sizes[file]} bytes)"
            )
        blocks = -(-nbytes // block_bytes)
        if not (
            isinstance(digests, list) and len(digests) == blocks and all(map(_is_count, digests))
        ):
            raise self.fail(where, f"expected {blocks} digests (non-negative integers)")
        if not _box_sound(offsets, shape):
            raise self.fail(where, "offsets and shape must be lists of non-negative integers "
                            "of one length")

    def entries(
        self, doc: Any, files: dict[str, int], block_bytes: int
    ) -> dict[StatePath, Entry]:
        """The entries in row order. Plain CPU tensors (the bulk of a large state) are checked
        and built a column at a time; every other row, and every row when any plain tensor
        fails a check or a path is not unique, goes through `entry`'s row-by-row checks, so
        the first offending row is named either way."""
        columns = self.columns(doc, "entries", ("path", "kind", "dtype", "shape", "value", "attrs"))
        grouped, boxed = self.chunks(doc, files, len(columns[0]), block_bytes)
        paths, kinds, dtypes, shapes, values, attrs = columns
        built: list[Entry | None] = [None] * len(paths)
        checked = set(map(type, paths)) <= {str} and len(set(paths)) == len(paths)
        if checked and not self.plain_tensors(columns, grouped, boxed, built):
            checked = False
            built = [None] * len(paths)
        rest = [row for row, entry in enumerate(built) if entry is None]
        # Every dimension of every shape at once; a row's own check runs only if this fails.
        shapes_sound = _all_counts(list(itertools.chain.from_iterable(
            shapes[row] for row in rest if type(shapes[row]) is list
        )))
        seen: set[str] = set()
        for row in rest:
            path = paths[row]
            if not checked:
                if type(path) is not str or path in seen:
                    raise self.fail(f"entries[{row}]", f"path {path!r:.60} is not a string or "
                                    "is repeated")
                seen.add(path)
            built[row] = self.entry(f"entries[{row}]", kinds[row], dtypes[row], shapes[row],
                                    values[row], attrs[row], grouped.get(row, ()), boxed,
                                    shapes_sound)
        entries = dict(zip(paths, built, strict=True))
        for row in rest:
            alias = entries[paths[row]]
            if alias.kind == ALIAS:
                self.aliased(f"entries[{row}]", alias, entries.get(alias.value))
        return entries

    def aliased(self, where: str, alias: Entry, entry: Entry | None) -> None:
        """Check that an alias names a tensor entry of its own dtype and shape."""
        if entry is None or entry.kind != TENSOR:
            raise self.fail(where, f"an alias of {alias.value!r:.60}, which is not a tensor "
                            "entry of this checkpoint")
        if (entry.dtype, entry.shape) != (alias.dtype, alias.shape):
            raise self.fail(where, f"an alias {alias.dtype}{list(alias.shape or ())} of "
                            f"{alias.value!r}, which is {entry.dtype}{list(entry.shape or ())}")

    def plain_tensors(
        self, columns: list[list[Any]], grouped: dict[int, tuple[Chunk, ...]], boxed: bool,
        built: list[Entry | None],
    ) -> bool:
        """Fill `built` at the rows of plain CPU tensors (kind "tensor", no attrs), checked a
        column at a time: known dtypes, shapes of non-negative ints, chunks without boxes
        holding exactly the bytes the shape needs. False (and `built` partly filled) when any
        of them fails a check."""
        _, kinds, dtypes, shapes, _, attrs = columns
        rows = [row for row, (kind, extra) in enumerate(zip(kinds, attrs, strict=True))
                if kind == TENSOR and extra is None]
        row_dtypes = [dtypes[row] for row in rows]
        row_shapes = [shapes[row] for row in rows]
        row_pieces = [grouped.get(row, ()) for row in rows]
        if not (
            set(map(type, row_dtypes)) <= {str} and set(row_dtypes) <= DTYPES.keys()
            and set(map(type, row_shapes)) <= {list}
            and _all_counts(list(itertools.chain.from_iterable(row_shapes)))
            and not (boxed and any([chunk.box for pieces in row_pieces for chunk in pieces]))
        ):
            return False
        itemsizes = {name: DTYPES[name].itemsize for name in set(row_dtypes)}
        expected = list(map(operator.mul, map(math.prod, row_shapes),
                            map(itemsizes.__getitem__, row_dtypes)))
        stored = [pieces[0].nbytes if len(pieces) == 1 else sum(c.nbytes for c in pieces)
                  for pieces in row_pieces]
        if stored != expected or not all(
            shape_sound(shape, itemsizes[dtype])
            for shape, dtype, n in zip(row_shapes, row_dtypes, expected, strict=True) if not n
        ) or max(map(len, row_shapes), default=0) > MAX_DIMS:
            return False
        made = records(Entry, len(rows), itertools.repeat(TENSOR), row_dtypes,
                     map(tuple, row_shapes), row_pieces, itertools.repeat(None),
                     itertools.repeat("cpu"), itertools.repeat(False), itertools.repeat(None),
                     itertools.repeat(False))
        for row, entry in zip(rows, made, strict=True):
            built[row] = entry
        return True

    def entry(
        self, where: str, kind: Any, dtype: Any, shape: Any, value: Any, attrs: Any,
        pieces: tuple[Chunk, ...], boxed: bool, shapes_sound: bool,
    ) -> Entry:
        """One entry record, checked (`shapes_sound`: every list shape is already known to
        hold non-negative ints)."""
        if kind == VALUE:
            if pieces:
                raise self.fail(where, "a value entry has chunks")
            if isinstance(value, dict):
                number = decode_float(value)
                if number is None:
                    raise self.fail(where, f"not a non-finite float (exactly {{\"float\": "
                                    f"...}}, or with \"bits\"): {value!r:.60}")
                value = number
            elif not (value is None or isinstance(value, bool | int | float | str)):
                raise self.fail(where, f"a value is null, a boolean, a number or a string, "
                                f"not {value!r:.60}")
            return Entry(VALUE, value=value)
        if type(kind) is not str:
            raise self.fail(where, f"kind {kind!r:.40} is not a string")
        if kind not in _DATA_KINDS | {ALIAS}:
            raise self.newer(where, f"unknown kind {kind!r:.40}")
        stored = pieces[0].nbytes if len(pieces) == 1 else sum(c.nbytes for c in pieces)
        if boxed and kind != SHARDED and any([chunk.box for chunk in pieces]):
            raise self.fail(where, f"a {kind} entry has chunks with boxes")
        if kind in (BYTES, PICKLE):
            return Entry(kind, chunks=pieces)
        if type(dtype) is not str:
            raise self.fail(where, f"dtype {dtype!r:.40} is not a string")
        known = DTYPES.get(dtype)
        if known is None:
            raise self.newer(where, f"unknown dtype {dtype!r:.40}")
        if not (type(shape) is list and (shapes_sound or all(map(_is_count, shape)))):
            raise self.fail(where, f"shape is not a list of non-negative ints: {shape!r:.60}")
        if not shape_sound(shape, known.itemsize, array=kind == NDARRAY):
            raise self.fail(where, f"shape {shape!r:.80} has more than {MAX_DIMS} dimensions "
                            "or more elements than any tensor can")
        if kind == ALIAS:
            if pieces or type(value) is not str:
                raise self.fail(where, "an alias entry has chunks, or no path as its value")
            return Entry(ALIAS, dtype, tuple(shape), (), value)
        expected = math.prod(shape) * known.itemsize
        if kind == SHARDED:
            self.pieces(where, tuple(shape), known.itemsize, pieces)
        if stored != expected:
            raise self.fail(where, f"chunks hold {stored} bytes, {dtype}{shape} needs {expected}")
        strides = None
        big_endian = False
        if attrs is None:
            device, scalar = ("cpu" if kind == TENSOR else None), False
        else:
            attrs = attrs if isinstance(attrs, dict) else {}
            device = attrs.get("device", "cpu" if kind == TENSOR else None)
            device = device if isinstance(device, str) else None
            scalar = attrs.get("scalar") is True
            if kind == TENSOR and "strides" in attrs:
                strides = self.strides(where, shape, attrs["strides"])
            big_endian = kind == NDARRAY and attrs.get("byteorder") == "big"
        return Entry(kind, dtype, tuple(shape), pieces, None, device, scalar, strides,
                     big_endian)

    def strides(self, where: str, shape: list[int], strides: Any) -> tuple[int, ...]:
        """A tensor entry's `attrs.strides`, checked to lay out its shape (`permuted_dense`),
        so that a tensor made with them holds every element once."""
        if not (type(strides) is list and all(map(_is_count, strides))
                and permuted_dense(shape, strides)):
            raise self.fail(where, f"attrs.strides {strides!r:.80} are no dense layout of "
                            f"shape {shape!r:.80} (one stride per dimension, a permutation "
                            "of a contiguous layout)")
        return tuple(strides)

    def pieces(
        self, where: str, shape: tuple[int, ...], itemsize: int, chunks: Sequence[Chunk]
    ) -> None:
        """Check that a sharded entry's pieces (runs of consecutive chunks with one box, see
        `box_runs`) tile its global shape exactly: each inside it, each holding its box's
        bytes, no two overlapping (the byte total then proves that every element is stored
        once). A box met again after another one is a second piece, so an overlap."""
        boxes = []
        for n, (box, run) in enumerate(box_runs(chunks)):
            if box is None:
                raise self.fail(where, f"piece {n} of a sharded entry has no box")
            offsets, size = box
            if len(offsets) != len(shape) or any(
                o + s > g for o, s, g in zip(offsets, size, shape, strict=True)
            ):
                raise self.fail(where, f"piece {n} at {list(offsets)} of shape {list(size)} "
                                f"lies outside the global shape {list(shape)}")
            stored = sum(chunk.nbytes for chunk in run)
            if stored != element_count(size) * itemsize:
                raise self.fail(where, f"piece {n} holds {stored} bytes, its box "
                                f"{list(size)} needs {element_count(size) * itemsize}")
            boxes.append(box)
        pair = overlapping_pair(boxes)
        if pair is not None:
            raise self.fail(where, f"pieces {pair[0]} and {pair[1]} overlap")

    def tree_paths(self, node: Any, out: list[str]) -> None:
        if isinstance(node, str):
            out.append(node)
            return
        if not isinstance(node, dict) or len(node) != 1:
            raise self.fail("tree", f"malformed node {node!r:.60}")
        ((tag, body),) = node.items()
        if tag == "stateful":
            self.tree_paths(body, out)
        elif tag == "per_rank" and isinstance(body, list):
            ranks: set[int] = set()
            for item in body:
                if not (isinstance(item, list) and len(item) == 2 and _is_count(item[0])):
                    raise self.fail("tree", f"malformed per_rank item {item!r:.60}")
                if item[0] in ranks:  # a rebuilt {rank: value} would keep one silently
                    raise self.fail("tree", f"per_rank rank {item[0]} appears twice")
                ranks.add(item[0])
                self.tree_paths(item[1], out)
        elif tag == "dict" and isinstance(body, list):
            # The items at once (a dict of a thousand tensors is common); one by one only to
            # name a malformed one.
            if not (
                set(map(type, body)) <= {list} and set(map(len, body)) <= {2}
                and set(map(type, map(operator.itemgetter(0), body))) <= {str, int}
            ):
                for item in body:
                    if not (isinstance(item, list) and len(item) == 2
                            and type(item[0]) in (str, int)):
                        raise self.fail("tree", f"malformed dict item {item!r:.60}")
            keys = list(map(operator.itemgetter(0), body))
            if len(set(keys)) != len(keys):  # a rebuilt dict would keep one value silently
                repeated = next(key for key in keys if keys.count(key) > 1)
                raise self.fail("tree", f"dict key {repeated!r:.60} appears twice")
            children = list(map(operator.itemgetter(1), body))
            leaves = [child for child in children if type(child) is str]
            out.extend(leaves)  # leaves inline: most nodes are
            if len(leaves) != len(children):
                for child in children:
                    if type(child) is not str:
                        self.tree_paths(child, out)
        elif tag in ("list", "tuple") and isinstance(body, list):
            for child in body:
                if type(child) is str:
                    out.append(child)
                else:
                    self.tree_paths(child, out)
        else:
            raise self.fail("tree", f"malformed node {node!r:.60}")

    def manifest(self, data: bytes) -> Manifest:
        try:
            doc = json.loads(data, parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            raise self.fail("document", f"not valid JSON ({exc})") from exc
        except RecursionError as exc:
            raise self.fail("document", "nested too deeply to be a manifest") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise self.fail("format", "not a safepoint manifest")
        if _ESCAPED_SURROGATE.search(data) and _lone_surrogate(doc):
            raise self.fail("document", "it holds text that is no valid Unicode (a lone "
                            "surrogate), which no file or path can be named with")
        # The seal first: a flipped bit in the version or an algorithm's name is damage,
        # not a newer writer (which would send a manager's restore no further back).
        checksum = self.get(doc, "checksum", dict, "manifest")
        self.unseal(data, doc, checksum)
        version = self.get(doc, "version", int, "manifest")
        if version < 1:
            raise self.fail("version", f"{version} is no format version (they start at 1)")
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{self.url} was written in format version {version}; this safepoint reads up "
                f"to {FORMAT_VERSION}: upgrade safepoint (pip install -U safepoint)",
                url=self.url,
            )
        algorithm = self.get(checksum, "algorithm", str, "checksum")
        checksum_function(algorithm, url=self.url)  # a newer one is refused before any read
        block_bytes = self.count(checksum, "block_bytes", "checksum")
        if block_bytes == 0:
            raise self.fail("checksum.block_bytes", "must be positive")
        files = self.files(doc.get("files"))
        if self.on_files is not None:
            self.on_files(files)
        entries = self.entries(doc, files, block_bytes)
        tree = doc.get("tree")
        paths: list[str] = []
        self.tree_paths(tree, paths)
        if len(paths) != len(entries) or set(paths) != entries.keys():
            raise self.fail("tree", "its leaves do not match the entries one to one")
        metadata = doc.get("metadata", {})
        torch_version = doc.get("torch_version")
        hashes = self.hashes(doc["hashes"], list(entries)) if "hashes" in doc else {}
        return Manifest(
            save_id=self.get(doc, "save_id", str, "manifest"),
            created=self.created(doc),
            entries=entries,
            files=files,
            tree=tree,
            metadata=metadata if isinstance(metadata, dict) else {},
            library_version=str(doc.get("library_version", "")),
            torch_version=torch_version if isinstance(torch_version, str) else None,
            world_size=self.count(doc, "world_size", "manifest"),
            checksum=algorithm,
            block_bytes=block_bytes,
            version=version,
            hashes=hashes,
        )

    def created(self, doc: dict[str, Any]) -> str:
        """The commit time, checked to be an ISO 8601 time that maps to seconds since the
        epoch (with a trailing `Z` for UTC), as a manager orders and retains steps by it."""
        created: str = self.get(doc, "created", str, "manifest")
        try:
            datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError) as exc:
            raise self.fail("created", f"not an ISO 8601 time such as "
                            f"2025-01-31T12:00:00.123Z ({exc}): {created!r:.60}") from exc
        return created

    def unseal(self, data: bytes, doc: dict[str, Any], checksum: dict[str, Any]) -> None:
        """Check the manifest's own checksum (see `seal`), a CRC-32C whatever the manifest
        names (a flipped bit in the name is caught too), before anything else in it is
        judged. A manifest without one (older safepoint, other writers) is taken as it is,
        but one that says it is sealed (`checksum.manifest`) must be: a flipped bit cannot
        remove both."""
        named = checksum.get("manifest")
        if "manifest_checksum" not in doc:
            if named is not None:
                raise self.fail("manifest_checksum", "missing, though checksum.manifest says "
                                "the manifest is sealed")
            return
        at = data.rfind(_SEAL)
        tail = _SEAL_TAIL.match(data, at + len(_SEAL)) if at >= 0 else None
        if tail is None:
            raise self.fail("manifest_checksum", "not the manifest's last field, or not an "
                            "integer")
        if checksum_function(MANIFEST_CHECKSUM)(memoryview(data)[:at]) != int(tail.group(1)):
            raise self.fail("manifest_checksum", "the manifest's bytes do not match it (a bit "
                            "flipped or a byte changed after it was written)")
        if named not in (None, MANIFEST_CHECKSUM):
            raise self.newer("checksum.manifest", f"unknown algorithm {named!r:.40}")

    def hashes(self, table: Any, paths: list[StatePath]) -> dict[StatePath, tuple[str, ...]]:
        """The optional block hashes of an incremental save: one list (or null) per entry
        row. Hashes of another algorithm are ignored (they only save writing), and so is a
        malformed table, with a warning: readers may ignore the field, and without it the
        next incremental save shares no block with this checkpoint, which costs only time."""
        algorithm = table.get("algorithm") if isinstance(table, dict) else None
        blocks = table.get("blocks") if isinstance(table, dict) else None
        if not (
            type(algorithm) is str and type(blocks) is list and len(blocks) == len(paths)
            and all(row is None or (type(row) is list and all(type(h) is str for h in row))
                    for row in blocks)
        ):
            logger.warning(
                "%s/%s: its optional field hashes is malformed (an object with an algorithm "
                "and a list of strings or null per entry, not %.60r); ignored: an incremental "
                "save after this checkpoint writes all its blocks anew", self.url, MANIFEST,
                table,
            )
            return {}
        if algorithm != BLOCK_HASH:
            return {}
        return {path: tuple(row) for path, row in zip(paths, blocks, strict=True)
                if row is not None}


#: A JSON escape of a UTF-16 surrogate: only text holding one can hold a lone one.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(doc: Any) -> bool:
    """Whether decoded JSON holds a string that is no valid Unicode (a lone surrogate, which
    JSON's escapes can spell and UTF-8 cannot encode)."""
    try:
        json.dumps(doc, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except RecursionError:  # refused as nested too deeply once the tree is read
        return False
    return False


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON (a non-finite float is the object {{\"float\": ...}})")


#: A data file's record as safepoint writes it (see `decode`'s `on_files`).
_FILE_RECORD = re.compile(rb'\{"name":"(data/[A-Za-z0-9._-]+)","nbytes":([0-9]{1,19})\}')


def decode(
    data: bytes, url: str, on_files: Callable[[dict[str, int]], object] | None = None
) -> Manifest:
    """Parse and validate a manifest read from checkpoint `url`. `on_files`, if given, is
    called with the data files (name -> size) before the entries are checked (a load starts
    reading ahead meanwhile): found in the bytes as safepoint writes their records before
    any is parsed (a large manifest's JSON takes a while: 11 ms for 20,000 entries), else
    once the file list is checked. A hint only: a damaged manifest is still refused.

    Raises:
        CorruptCheckpoint: it does not parse, misses a field, or points outside the checkpoint.
        FormatVersionError: it was written by a newer format version, or names a kind, dtype
            or checksum algorithm this safepoint does not know (a newer one's).
    """
    if on_files is not None:
        found = {name.decode("ascii"): int(nbytes)
                 for name, nbytes in _FILE_RECORD.findall(data)}
        if found and all(map(is_data_file, found)):
            on_files(found)
            on_files = None
    return _Reader(url, on_files).manifest(data)
