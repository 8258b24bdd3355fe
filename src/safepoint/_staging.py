"""Leaves to host bytes and back (engine layer): raw views of tensor and array memory for
writing, destination buffers for reading (a target's own memory when it can take the bytes
directly), and the loaded values built from them.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import operator
import pickle
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._format import (
    DTYPE_BY_NUMPY,
    DTYPE_BY_TORCH,
    DTYPES,
    Entry,
    aligned,
    permuted_dense,
    placed,
    records,
    shape_sound,
)
from ._leaves import ALIAS, BYTES, NDARRAY, PICKLE, TENSOR, UNINITIALIZED, VALUE
from ._plan import WriteItem
from ._types import StatePath
from .errors import SafepointError, StateMismatch, UnsupportedLeaf

__all__ = [
    "LOWEST_ADDRESS",
    "Destination",
    "HostData",
    "HostLeaf",
    "SaveData",
    "Ties",
    "check_makeable",
    "describe",
    "destination",
    "destinations",
    "device_batches",
    "finish",
    "host_array",
    "host_data",
    "host_leaf",
    "same_tensor",
    "tensor_entry",
]


_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PyBUF_WRITE = 0x200


def raw_view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` of memory at `address` (the owner must outlive it)."""
    if nbytes == 0:
        return memoryview(bytearray())
    view: memoryview = _memory_view(address, nbytes, _PyBUF_WRITE)
    return view


def raw_views(addresses: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """`raw_view` of many regions at once, as slices of one view that spans them all: for
    20,000 small tensors 6 ms instead of 18. Only the slices are ever read or written, so the
    span may cross memory that belongs to no one."""
    used = [address for address, nbytes in zip(addresses, sizes, strict=True) if nbytes]
    if not used:
        return [memoryview(bytearray()) for _ in sizes]
    base = min(used)
    span = raw_view(base, max(map(operator.add, addresses, sizes)) - base)
    return [span[a - base : a - base + n] if n else memoryview(bytearray())
            for a, n in zip(addresses, sizes, strict=True)]


def check_memory(path: StatePath, tensor: Any, address: int) -> None:
    """Refuse a tensor (at `address`, its `data_ptr()`) whose storage was freed (resized to
    0, as FSDP does to resharded parameters): its address is 0, or its offset from 0 for a
    view, and reading it would crash the process.

    Raises:
        UnsupportedLeaf: naming `path`.
    """
    if address < LOWEST_ADDRESS and tensor.nbytes and (not address or _lacks_memory(tensor)):
        if not _has_own_memory(tensor):
            raise UnsupportedLeaf(
                f"tensor at {path!r} is a {type(tensor).__qualname__}, a tensor subclass that "
                "holds its data in other tensors (a wrapper, such as torchao's float8 or NF4 "
                "weights): save it as a plain tensor (dequantize it, e.g. .dequantize() or "
                ".to(torch.bfloat16)), or wrap it in sp.Pickled", path=path,
            )
        raise UnsupportedLeaf(
            f"tensor at {path!r} has no memory (its storage was freed or resized to 0, as FSDP "
            "does to resharded parameters): save the module's state_dict(), or the tensor "
            "once its storage holds its data again", path=path,
        )


def _has_own_memory(tensor: Any) -> bool:
    """Whether a tensor is a plain `torch.Tensor` or `Parameter`, whose memory holds its
    elements. A subclass may keep them elsewhere (a wrapper made with
    `_make_wrapper_subclass`, such as torchao's float8 and NF4 weights, has a storage that
    claims their bytes at address 0), so only torch itself can fill it (`copy_`)."""
    torch = sys.modules["torch"]
    return type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter


def tensor_view(tensor: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return raw_view(tensor.data_ptr(), tensor.nbytes)


def array_view(array: Any) -> memoryview:
    """The bytes of a C-contiguous numpy array, without a copy."""
    if array.nbytes == 0:
        return memoryview(bytearray())
    return memoryview(array.reshape(-1).view("u1"))


@dataclass(frozen=True, slots=True)
class HostLeaf:
    """A leaf's bytes in host memory, ready to write, and how the manifest describes it.

    Attributes:
        data: the bytes (a view of the leaf's memory when no copy was needed).
        entry: the entry without chunks.
        owner: keeps the memory behind `data` alive.
    """

    data: memoryview
    entry: Entry
    owner: Any


#: (torch dtype, device, layout) -> (format dtype name, device name) of tensors that can be
#: stored: checked once per combination, not per tensor.
_TENSOR_TYPES: dict[tuple[Any, Any, Any], tuple[str, str]] = {}


def _tensor_type(tensor: Any, path: str) -> tuple[str, str]:
    """(format dtype name, device name) of a tensor that can be stored.

    Raises:
        UnsupportedLeaf: a sparse, nested or meta tensor, or a dtype that cannot be stored.
    """
    if tensor.is_nested:  # strided or jagged layout alike, so not told by the cache's key
        raise UnsupportedLeaf(
            f"tensor at {path!r} is nested: only dense tensors can be saved; save its "
            "components (.unbind()) or its padded form (.to_padded_tensor(0.0))",
            path=path,
        )
    key = (tensor.dtype, tensor.device, tensor.layout)
    known = _TENSOR_TYPES.get(key)
    if known is not None:
        return known
    device = tensor.device
    if tensor.layout != sys.modules["torch"].strided or device.type == "meta":
        raise UnsupportedLeaf(
            f"tensor at {path!r} is {'meta' if tensor.is_meta else tensor.layout}: only dense "
            "tensors with data can be saved; convert it (e.g. .to_dense())",
            path=path,
        )
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_BY_TORCH:
        raise UnsupportedLeaf(_refusal(tensor, name, path), path=path)
    known = _TENSOR_TYPES[key] = (DTYPE_BY_TORCH[name].name, str(device))
    return known


#: torch's sub-byte dtypes: placeholders whose bit layout torch does not define (it holds one
#: element per byte today and has almost no kernels for them), so the format has no name for
#: them.
_SUB_BYTE = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8))


def _refusal(tensor: Any, name: str, path: str) -> str:
    """Why a tensor of torch dtype `name` cannot be stored, and what to do instead."""
    if tensor.is_quantized:
        return (
            f"tensor at {path!r} is quantized ({name}): the format has no place for its scale "
            "and zero point; save tensor.dequantize(), or tensor.int_repr() and its "
            "quantization parameters as separate leaves, or wrap it in sp.Pickled"
        )
    if name in _SUB_BYTE:
        return (
            f"tensor at {path!r} has sub-byte dtype {name}, whose bit layout torch does not "
            "define: save its bytes as tensor.view(torch.uint8) (and .view() them back after "
            "loading), or the packed uint8 data of the library that made it"
        )
    return (
        f"tensor at {path!r} has dtype {name}, which safepoint cannot store: convert it to "
        f"one it can ({', '.join(sorted(DTYPE_BY_TORCH))}), or wrap it in sp.Pickled"
    )


def _numpy_dtype_name(array: Any, path: str) -> str:
    dtype = DTYPE_BY_NUMPY.get(array.dtype.newbyteorder("<").str)  # stored little-endian
    if dtype is None:
        raise UnsupportedLeaf(
            f"array at {path!r} has dtype {array.dtype}, which safepoint cannot store: "
            "convert it to a numeric or bool dtype, or wrap it in sp.Pickled",
            path=path,
        )
    return dtype.name


def tensor_entry(tensor: Any, path: str) -> Entry:
    """The manifest entry (without chunks) of a tensor on any device.

    Raises:
        UnsupportedLeaf: a sparse or meta tensor, or a dtype that cannot be stored.
    """
    return _entry_of(tensor, _tensor_type(tensor, path), path)


def _entry_of(tensor: Any, names: tuple[str, str], path: StatePath) -> Entry:
    """The entry of a tensor whose (dtype name, device name) `_tensor_type` returned, with
    its strides when it is dense but not contiguous (`Entry.strides`).

    Raises:
        UnsupportedLeaf: an empty tensor whose shape a reader refuses (`shape_sound`).
    """
    dtype, device = names
    shape = tuple(tensor.shape)
    if 0 in shape and not shape_sound(shape, DTYPES[dtype].itemsize):
        raise UnsupportedLeaf(
            f"tensor at {path!r} is empty but of shape {shape}, whose strides (in bytes) or "
            "element count pass int64: readers refuse it; save an empty tensor of a smaller "
            "shape (an empty tensor holds nothing but its shape)", path=path,
        )
    if tensor.is_contiguous():
        return Entry(TENSOR, dtype, shape, (), None, device)
    strides = tuple(tensor.stride())
    return Entry(TENSOR, dtype, shape, (), None, device, False,
                 strides if permuted_dense(shape, strides) else None)


def same_tensor(a: Any, b: Any) -> bool:
    """Whether two tensors are one (tied weights): the same memory, seen with the same dtype,
    shape, strides and conjugate and negative bits."""
    return bool(
        a.data_ptr() == b.data_ptr() and a.device == b.device and a.dtype == b.dtype
        and a.shape == b.shape and a.stride() == b.stride() and a.is_conj() == b.is_conj()
        and a.is_neg() == b.is_neg()
    )


class Ties:
    """Finds, among a state's tensors taken in order, those that are an earlier one
    (`same_tensor`: tied weights)."""

    def __init__(self) -> None:
        # address -> (path, tensor) of the first tensor there, or a list of those of each
        # distinct tensor there (views of one memory: a flat buffer and the weights in it).
        self._seen: dict[int, Any] = {}

    def of(self, path: StatePath, tensor: Any, address: int) -> StatePath | None:
        """The path of an earlier tensor that `tensor` (whose `data_ptr()` is `address`) is,
        else None."""
        if not address:  # every empty tensor is at 0: never tied
            return None
        seen = self._seen.get(address)
        if seen is None:
            self._seen[address] = (path, tensor)
            return None
        for first, other in [seen] if type(seen) is tuple else seen:
            if same_tensor(tensor, other):
                return first if first != path else None
        if type(seen) is tuple:
            seen = self._seen[address] = [seen]
        seen.append((path, tensor))
        return None

    def fresh(self, paths: list[StatePath], tensors: list[Any], addresses: list[int]) -> bool:
        """Record `tensors` (at `paths`, `addresses`, none 0) at once and return True when no
        two of them, nor one of them and an earlier tensor, share an address: then none is
        another. Else record nothing and return False: ask `of` for each."""
        seen = self._seen
        if len(set(addresses)) != len(addresses) or any(map(seen.__contains__, addresses)):
            return False
        seen.update(zip(addresses, zip(paths, tensors, strict=True), strict=True))
        return True


def _host_tensor(tensor: Any) -> Any:
    """`tensor` itself when its memory holds its bytes as stored (contiguous, on the CPU, no
    lazy conjugate or negative bit), else a copy that does."""
    if not tensor.is_cpu:
        tensor = tensor.detach().to("cpu")
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        torch = sys.modules["torch"]
        copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        copy_bytes(copy, tensor.detach())
        tensor = copy
    return tensor


def copy_bytes(into: Any, source: Any, *, non_blocking: bool = False) -> None:
    """`into.copy_(source)` (same shape and dtype), also for dtypes torch cannot copy between
    layouts (float4: no kernel), whose bytes are copied as uint8 of the same size."""
    try:
        into.copy_(source, non_blocking=non_blocking)
    except NotImplementedError:
        uint8 = sys.modules["torch"].uint8
        if source.element_size() != 1:
            raise
        into.view(uint8).copy_(source.view(uint8), non_blocking=non_blocking)


def host_array(value: Any, path: str) -> tuple[Entry, Any]:
    """The entry of an ndarray leaf (or NumPy scalar) and the leaf as an array, not copied.
    Its memory holds the bytes to write when it is C-contiguous and not big-endian; else they
    are those of its C-order, little-endian copy.

    Raises:
        UnsupportedLeaf: an array dtype that cannot be stored.
    """
    np = sys.modules["numpy"]
    array = np.asarray(value)
    entry = Entry(NDARRAY, dtype=_numpy_dtype_name(array, path), shape=tuple(array.shape),
                  scalar=isinstance(value, np.generic), big_endian=array.dtype.byteorder == ">")
    return entry, array


def host_leaf(value: Any, kind: str, path: str) -> HostLeaf:
    """The bytes to write for a data leaf (tensor, ndarray, bytes or pickled).

    Tensors on other devices are copied to the host; non-contiguous ones are made contiguous.

    Raises:
        UnsupportedLeaf: a tensor layout, dtype or array dtype that cannot be stored, or a
            tensor not materialized yet (every save meets it here, before writing).
    """
    if kind == UNINITIALIZED:
        raise UnsupportedLeaf(
            f"tensor at {path!r} is not materialized yet (a lazy module's parameter or "
            "buffer, such as nn.LazyLinear's, has no shape or data before its first forward "
            "pass): run one forward pass (a dummy batch) to materialize it first, then save",
            path=path,
        )
    if kind == TENSOR:
        entry = tensor_entry(value, path)
        tensor = _host_tensor(value)
        return HostLeaf(tensor_view(tensor), entry, tensor)
    if kind == NDARRAY:
        entry, array = host_array(value, path)
        array = sys.modules["numpy"].asarray(array, array.dtype.newbyteorder("<"), order="C")
        return HostLeaf(array_view(array), entry, array)
    if kind == BYTES:
        return HostLeaf(memoryview(value).cast("B"), Entry(BYTES), value)
    if kind == PICKLE:
        try:
            data = pickle.dumps(value.obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # what pickling raises varies: TypeError, PicklingError, ...
            raise UnsupportedLeaf(
                f"sp.Pickled at {path!r} cannot be pickled ({type(exc).__name__}: "
                f"{str(exc)[:200]}): leave it out of the state, or save what it holds in a "
                "form that pickles or needs no pickle", path=path,
            ) from exc
        return HostLeaf(memoryview(data), Entry(PICKLE), data)
    raise ValueError(f"{path!r} is a {kind}, which has no bytes to write")


class SaveData(Protocol):
    """The bytes a save writes, as the write step consumes them: the seam between preparing a
    save (the caller's thread) and writing it (possibly a background thread).

    Attributes:
        entries: each data leaf's manifest entry, without chunks (complete once `stream` is
            consumed).
        layout: where each data leaf lands in the data file, in offset order (complete once
            `stream` is consumed).
    """

    @property
    def entries(self) -> Mapping[StatePath, Entry]: ...

    @property
    def layout(self) -> list[WriteItem]: ...

    def stream(self) -> Iterable[tuple[WriteItem, memoryview]]:
        """Each item of `layout` with its bytes, in order. A view may be reused once the next
        item is requested."""
        ...


#: Leaves `HostData.stream` describes at once: enough that asking each tensor for its address,
#: shape and layout runs as C-level passes (W2's 20,000 small tensors: 41 ms instead of 60),
#: few enough that the writer starts soon.
_DESCRIBE_BATCH = 512
_HostBatch = list[tuple[StatePath, Any, tuple[str, str] | None]]


@dataclass(slots=True)
class HostData:
    """`SaveData` over the leaves' own memory, no staging copy (what a synchronous save writes
    from). Tensors are described, laid out and viewed as they stream: for 20,000 small
    tensors that work then overlaps the writing instead of preceding it.

    Attributes:
        leaves: the data leaves in tree order: (path, a tensor, the names `_tensor_type` gave
            it), or (path, the `HostLeaf` of any other kind, None).
    """

    leaves: _HostBatch
    entries: dict[StatePath, Entry] = field(default_factory=dict)
    layout: list[WriteItem] = field(default_factory=list)

    def stream(self) -> Iterator[tuple[WriteItem, memoryview]]:
        """Each leaf placed (see `_format.aligned`) with its bytes, described a batch at a
        time as the writing goes; a tensor that is an earlier one (`same_tensor`: tied
        weights) becomes an alias entry instead, with nothing to write."""
        entries, layout = self.entries, self.layout
        entries.clear()
        layout.clear()
        ties = Ties()
        end = 0
        for start in range(0, len(self.leaves), _DESCRIBE_BATCH):
            batch = self.leaves[start : start + _DESCRIBE_BATCH]
            plain = _plain_batch(batch, ties)
            if plain is not None:
                paths, described, sizes, views = plain
                items = list(map(WriteItem, paths, placed(end, sizes), sizes))
                entries.update(zip(paths, described, strict=True))
                layout.extend(items)
                end = items[-1].offset + sizes[-1]
                yield from zip(items, views, strict=True)
                continue
            for path, entry, data in _one_by_one(batch, ties):
                entries[path] = entry
                if data is None:
                    continue
                nbytes = len(data)
                item = WriteItem(path, aligned(end, nbytes), nbytes)
                end = item.offset + nbytes
                layout.append(item)
                yield item, data


def _plain_batch(
    batch: _HostBatch, ties: Ties
) -> tuple[list[StatePath], list[Entry], list[int], list[memoryview]] | None:
    """The paths, entries, sizes and bytes of the leaves of `batch`, described in C-level
    passes, when every one is a plain CPU tensor: contiguous, not empty, no lazy conjugate or
    negative bit, its memory at a sound address (see `LOWEST_ADDRESS`), none tied (recorded
    in `ties`), as in a state of many small tensors. None otherwise (see `_one_by_one`)."""
    if any(names is None for _, _, names in batch):
        return None
    tensors = [leaf for _, leaf, _ in batch]
    tensor = sys.modules["torch"].Tensor
    if not (all([t.is_cpu for t in tensors]) and all(map(tensor.is_contiguous, tensors))
            and not any(map(tensor.is_conj, tensors)) and not any(map(tensor.is_neg, tensors))):
        return None
    addresses = list(map(tensor.data_ptr, tensors))
    sizes = [t.nbytes for t in tensors]
    if min(addresses) < LOWEST_ADDRESS or 0 in sizes:
        return None
    paths = [path for path, _, _ in batch]
    if not ties.fresh(paths, tensors, addresses):
        return None
    names = [names for _, _, names in batch if names is not None]
    entries = records(
        Entry, len(batch), itertools.repeat(TENSOR), [dtype for dtype, _ in names],
        [tuple(t.shape) for t in tensors], itertools.repeat(()), itertools.repeat(None),
        [device for _, device in names], itertools.repeat(False), itertools.repeat(None),
        itertools.repeat(False),
    )
    return paths, entries, sizes, raw_views(addresses, sizes)


def _one_by_one(
    batch: _HostBatch, ties: Ties
) -> Iterator[tuple[StatePath, Entry, memoryview | None]]:
    """Each leaf of `batch` with its entry and bytes (None for an alias: a tensor that is an
    earlier one, see `Ties`), one at a time: a tensor whose memory does not hold its bytes as
    stored is copied (`_host_tensor`) and the copy kept only until the next leaf is asked."""
    for path, leaf, names in batch:
        if names is None:
            yield path, leaf.entry, leaf.data
            continue
        address = leaf.data_ptr()
        check_memory(path, leaf, address)
        entry = _entry_of(leaf, names, path)
        first = ties.of(path, leaf, address)
        if first is not None:
            yield path, Entry(ALIAS, entry.dtype, entry.shape, (), first), None
            continue
        tensor = _host_tensor(leaf)
        yield path, entry, raw_view(address, tensor.nbytes) if tensor is leaf else tensor_view(
            tensor)


def host_data(leaves: Mapping[StatePath, Any], kinds: Mapping[StatePath, str]) -> HostData:
    """The data leaves among `leaves` (of `kinds`) as `HostData`, laid out in tree order.

    Raises:
        UnsupportedLeaf: a leaf that cannot be stored (checked here, before anything is
            written).
    """
    checked: _HostBatch = []
    for path, kind in kinds.items():
        if kind == TENSOR:
            value = leaves[path]
            checked.append((path, value, _tensor_type(value, path)))
        elif kind != VALUE:
            checked.append((path, host_leaf(leaves[path], kind, path), None))
    return HostData(checked)


@functools.cache
def _dtype_name(dtype: Any) -> str:
    """The format's name of a torch dtype (torch's own name when the format has none), worked
    out once per dtype rather than once per tensor."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_BY_TORCH[name].name if name in DTYPE_BY_TORCH else name


def describe(value: Any, kind: str) -> tuple[str, str | None, tuple[int, ...] | None]:
    """(kind, dtype name, shape) of a target leaf of `kind`, for matching against a
    manifest; a tensor not materialized yet has no shape."""
    if kind == TENSOR:
        return kind, _dtype_name(value.dtype), tuple(value.shape)
    if kind == UNINITIALIZED:
        return kind, _dtype_name(value.dtype), None
    if kind == NDARRAY:
        array = sys.modules["numpy"].asarray(value)
        known = DTYPE_BY_NUMPY.get(array.dtype.newbyteorder("<").str)
        return kind, known.name if known else str(array.dtype), tuple(array.shape)
    return kind, None, None


#: Host memory between storage and tensors on an accelerator: two buffers of this size, one
#: read into while the other is copied to the device (see `device_batches`).
DEVICE_BATCH_BYTES = 128 << 20
_DEVICE_ALIGN = 64  # offsets of entries in a batch buffer: any dtype's alignment
_NO_BYTES = memoryview(b"")


@dataclass(slots=True)
class Destination:
    """Where a loaded entry's bytes go.

    Attributes:
        view: the bytes to fill.
        holder: the tensor, array or bytearray that owns `view`; None while a target on an
            accelerator waits for `device_batches`.
        target: the live target leaf to copy into afterwards, when the bytes could not land in
            it directly (another device, non-contiguous; a bytearray, whose length may
            change), or the new tensor of an entry's strides (`Entry.strides`) when there is
            no target; None otherwise.
        big_endian: `holder` is a new array of a big-endian entry (`Entry.big_endian`), which
            `finish` gives back big-endian unless it fills a target.
    """

    view: memoryview
    holder: Any
    target: Any = None
    big_endian: bool = False


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError as exc:
            raise SafepointError(
                "this checkpoint holds torch tensors and torch is not installed: install torch "
                "(pip install torch), or load only other entries with keys="
            ) from exc
    return torch


def _maker(kind: str, dtype_name: str, strides: tuple[int, ...] | None = None) -> Any:
    """The function making a new, uninitialised value of `kind` and dtype from a shape (a
    tensor laid out with `strides`, when given)."""
    dtype = DTYPES[dtype_name]
    if kind == TENSOR:
        torch = _torch()
        torch_dtype = getattr(torch, dtype.torch, None)
        if torch_dtype is None:
            raise SafepointError(
                f"this torch ({torch.__version__}) has no dtype {dtype.torch} ({dtype.name}): "
                "upgrade torch to load this entry, or leave it out with keys="
            )
        if strides is not None:
            return functools.partial(torch.empty_strided, stride=strides, dtype=torch_dtype)
        return functools.partial(torch.empty, dtype=torch_dtype)
    np = sys.modules.get("numpy") or __import__("numpy")
    if dtype.numpy is None:
        raise SafepointError(f"numpy has no dtype {dtype.name}; load this entry as a tensor")
    return functools.partial(np.empty, dtype=np.dtype(dtype.numpy))


def _fresh(entry: Entry, path: str, *, strided: bool = False) -> Any:
    """A new value for `entry` (uint8 memory for bytes and pickles, untouched until read, as
    a tensor's or array's is: a manifest claiming far more bytes than its files hold costs
    no memory before the reads find the files short), contiguous, or laid out with the
    entry's strides when `strided`; the allocator's refusal (the process lacks the memory)
    named by path."""
    dtype = entry.dtype or "U8"
    try:
        if entry.kind in (BYTES, PICKLE):
            return sys.modules["numpy"].empty(entry.nbytes, "u1")
        return _maker(entry.kind, dtype, entry.strides if strided else None)(entry.shape or ())
    except (MemoryError, RuntimeError, OverflowError, ValueError) as exc:
        raw = entry.kind in (BYTES, PICKLE)
        nbytes = entry.nbytes if raw else math.prod(entry.shape or ()) * DTYPES[dtype].itemsize
        what = entry.kind if raw else f"{entry.dtype}{list(entry.shape or ())}"
        raise SafepointError(
            f"cannot allocate {nbytes} bytes for {path!r} ({what}): {str(exc)[:200]}; if "
            "this process should have that "
            "much memory, run `safepoint verify` on the checkpoint (a damaged manifest can "
            "claim more bytes than its files hold), else load fewer entries with keys="
        ) from exc


def check_makeable(entries: Mapping[StatePath, Entry], url: str) -> None:
    """Refuse, before anything is read, a load that needs new values this process cannot make
    (torch not installed, or a torch or numpy without a saved dtype), naming an entry that
    needs one."""
    for kind, dtype in {(entry.kind, entry.dtype) for entry in entries.values()}:
        if kind not in (TENSOR, NDARRAY):
            continue
        try:
            _maker(kind, dtype or "U8")
        except SafepointError as exc:
            path = next(p for p, e in entries.items() if (e.kind, e.dtype) == (kind, dtype))
            raise SafepointError(f"cannot load {path!r} from {url}: {exc}", url=url) from None


def destination(entry: Entry, path: str, target: Any = None) -> Destination:
    """A buffer for `entry`'s bytes (`path`'s): the target's own memory when it is a
    contiguous CPU tensor or a writable C-contiguous array of the same dtype (the
    no-second-copy path), none yet for a tensor on an accelerator (`device_batches` reads it
    through reused host buffers), else a fresh host buffer (also for a tensor subclass:
    `finish` copies it in through torch). Without a target, an entry saved with strides
    gets a new tensor of those strides as its target, which `finish` fills from the buffer
    (the bytes are in row-major order)."""
    if entry.kind == TENSOR and target is not None and _has_own_memory(target):
        if not target.is_cpu:
            return Destination(_NO_BYTES, None, target)
        if _lacks_memory(target):
            raise _freed(path)
        if _plain(target):
            return Destination(tensor_view(target), target)
    if entry.kind in (BYTES, PICKLE):
        holder = _fresh(entry, path)
        return Destination(memoryview(holder), holder,
                           target if entry.kind == BYTES and type(target) is bytearray else None)
    np = sys.modules.get("numpy")
    if (
        target is not None and np is not None and isinstance(target, np.ndarray)
        and target.flags.c_contiguous and target.flags.writeable
        and target.dtype.byteorder != ">"
    ):
        return Destination(array_view(target), target)
    holder = _fresh(entry, path)
    view = tensor_view(holder) if entry.kind == TENSOR else array_view(holder)
    if target is None and entry.strides is not None:
        target = _fresh(entry, path, strided=True)
    return Destination(view, holder, target, entry.big_endian)


#: Below this, an address of tensor memory is suspect: a view into a storage that was freed
#: (FSDP's flat parameters) points at its offset from 0, 16 TiB at most. Asking each tensor's
#: storage costs 7 ms for 20,000 targets; a 64-bit Linux process's heap and mappings lie
#: above this (a position-independent Python's heap starts near 2**46), so only a Python
#: whose heap lies low asks for each of its small tensors.
LOWEST_ADDRESS = 1 << 44


def _lacks_memory(tensor: Any) -> bool:
    """Whether a CPU tensor's storage does not hold the elements it addresses (FSDP frees
    the storage of resharded parameters; `destinations` asks only for addresses below
    `LOWEST_ADDRESS`, where a view into a freed storage lies). One at address 0 has none to
    read into, whatever its storage claims."""
    if not tensor.numel():
        return False
    if not tensor.data_ptr():
        return True
    reach = tensor.storage_offset() + sum(
        (n - 1) * abs(stride) for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return bool(tensor.untyped_storage().nbytes() < (reach + 1) * tensor.element_size())


def _freed(path: str) -> StateMismatch:
    """The refusal of a target tensor without memory, before anything is read into it."""
    return StateMismatch(
        f"the target tensor at {path!r} has no memory (its storage was freed or resized to 0, "
        "as FSDP does to resharded parameters): load into the module once its storage holds "
        "memory again (after unshard()), or into its state_dict()", mismatched=[path],
    )


def _plain(tensor: Any) -> bool:
    """Whether a CPU tensor's memory holds its elements as they are saved."""
    return bool(tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg())


def destinations(
    entries: Sequence[Entry], paths: Sequence[str], targets: Sequence[Any],
    *, held_at: tuple[list[int], list[int], list[int]] | None = None,
) -> list[Destination]:
    """`destination` of each entry (at its path) and its target (or None), the views of
    contiguous CPU tensors made in bulk (`raw_views`): a load into 20,000 small tensors asks
    for them all. `held_at`, three empty lists when given, receives the index, address and
    size of each of those, which are their targets' own memory: a caller checks them for
    overlaps without asking every tensor again."""
    torch = sys.modules.get("torch")
    tensor, parameter = (torch.Tensor, torch.nn.Parameter) if torch is not None else (None, None)
    plain = [
        entry.kind == TENSOR and (type(target) is tensor or type(target) is parameter)
        and target.is_cpu and _plain(target)
        for entry, target in zip(entries, targets, strict=True)
    ]
    held = list(itertools.compress(targets, plain))
    addresses, sizes = [t.data_ptr() for t in held], [t.nbytes for t in held]
    if addresses and min(addresses) < LOWEST_ADDRESS:
        # An empty tensor's, or one in a storage that was freed (at its offset from 0).
        for path, target in zip(itertools.compress(paths, plain), held, strict=True):
            if _lacks_memory(target):
                raise _freed(path)
    if held_at is not None:
        held_at[0].extend(itertools.compress(range(len(plain)), plain))
        held_at[1].extend(addresses)
        held_at[2].extend(sizes)
    views = iter(raw_views(addresses, sizes))
    return [
        Destination(next(views), target) if lends else destination(entry, path, target)
        for entry, path, target, lends in zip(entries, paths, targets, plain, strict=True)
    ]


def device_batches(dests: dict[StatePath, Destination]) -> Iterator[dict[StatePath, Destination]]:
    """The destinations whose targets live on an accelerator, as host destinations a batch at
    a time: the caller fills each batch, and when it asks for the next one the batch is copied
    to its targets, asynchronously, while the next is read. Two reused buffers of
    `DEVICE_BATCH_BYTES` (pinned for CUDA; an entry larger than that gets its own) bound the
    host memory of a load into GPU tensors. Afterwards each such destination in `dests` holds
    its filled target, and the devices are synchronized."""
    torch = _torch()
    waiting = {path: dest.target for path, dest in dests.items() if dest.holder is None}
    if not waiting:
        return
    batches: list[list[tuple[StatePath, int, int]]] = [[]]  # (path, offset, bytes)
    filled = 0
    for path, target in waiting.items():
        offset = -(-filled // _DEVICE_ALIGN) * _DEVICE_ALIGN
        nbytes = target.numel() * target.element_size()
        if batches[-1] and offset + nbytes > DEVICE_BATCH_BYTES:
            batches.append([])
            offset = 0
        batches[-1].append((path, offset, nbytes))
        filled = offset + nbytes
    pinned = torch.cuda.is_available()
    buffers: list[Any] = [None, None]
    copied: list[list[Any]] = [[], []]  # per buffer: events of the copies still reading it
    with torch.no_grad():
        for index, batch in enumerate(batches):
            slot = index % 2
            for event in copied[slot]:
                event.synchronize()
            _, last_offset, last_bytes = batch[-1]
            size = max(last_offset + last_bytes, DEVICE_BATCH_BYTES)
            memory = buffers[slot]
            if memory is None or memory.numel() < size:
                memory = buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            hosts = {}
            for path, offset, nbytes in batch:
                target = waiting[path]
                holder = memory[offset : offset + nbytes].view(target.dtype).view(target.shape)
                hosts[path] = Destination(tensor_view(holder), holder)
            yield hosts
            targets = [waiting[path] for path in hosts]
            torch._foreach_copy_(targets, [host.holder for host in hosts.values()],
                                 non_blocking=pinned)
            for path, target in zip(hosts, targets, strict=True):
                dests[path] = Destination(_NO_BYTES, target)
            devices = {target.device for target in targets}
            copied[slot] = []
            if pinned:
                for device in devices:
                    if device.type == "cuda":
                        event = torch.cuda.Event()
                        event.record(torch.cuda.current_stream(device))
                        copied[slot].append(event)
    for events in copied:
        for event in events:
            event.synchronize()


def finish(entry: Entry, dest: Destination, path: StatePath, *, allow_pickle: bool) -> Any:
    """The loaded value of `path`: the target itself (filled in place, or copied into), or a
    new one.

    Raises:
        UnsupportedLeaf: a pickled entry that does not unpickle in this process (its class
            was renamed or moved since the save, its module is not installed, or its
            reduction raises), naming `path`.
    """
    target = dest.target
    if target is None and entry.kind == TENSOR:
        return dest.holder  # read in place, or a new tensor
    if entry.kind == BYTES:
        if target is not None:  # a bytearray stays one: code extends it after a resume
            target[:] = memoryview(dest.holder)
            return target
        return bytes(dest.holder)
    if entry.kind == PICKLE:
        if not allow_pickle:
            raise ValueError("pickled entries are refused before reading; this is a bug")
        try:
            return pickle.loads(dest.holder)
        except Exception as exc:  # what unpickling raises varies: AttributeError, ImportError, ...
            raise UnsupportedLeaf(
                f"the pickled entry at {path!r} cannot be unpickled here "
                f"({type(exc).__name__}: {str(exc)[:200]}): import or install the code that "
                "defines its class (under the module and name it had when saved), or leave "
                "it out with keys=", path=path,
            ) from exc
    if entry.kind == TENSOR:
        torch = _torch()
        # A tensor made under inference mode takes in-place writes only inside it.
        with torch.inference_mode() if target.is_inference() else torch.no_grad():
            copy_bytes(target, dest.holder)
        return target
    np = sys.modules.get("numpy")
    if np is not None and isinstance(target, np.ndarray) and target.flags.writeable:
        target[...] = dest.holder
        return target
    if dest.big_endian:  # swapped where it lies: a second array would double the memory
        swapped = dest.holder.byteswap(inplace=True)
        return swapped.view(swapped.dtype.newbyteorder(">"))
    return dest.holder[()] if entry.kind == NDARRAY and entry.scalar else dest.holder
