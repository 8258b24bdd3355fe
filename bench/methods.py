"""The save and load methods compared, each as a setup step and a timed operation.

Every method is a ``setup(state) -> op`` function: setup does the untimed preparation (imports,
an aligned buffer, a warning filter) and returns ``op(path)``, which does exactly the work being
timed: save ``state`` to ``path``, or load ``path`` into ``state``. Whatever ``op`` returns is
kept alive until the peak RSS has been read, so a method that allocates its result
(``torch.load``) is charged for it.

Saves are all durable, so that they compare like with like: each ends with the file data and
the directory entry on stable storage (fsync of the file(s) and of the directory), added here
where the library does not do it itself. Loads write into the existing destination tensors,
except ``torch_load``, which cannot and is measured as-is (it allocates a second copy).
"""

from __future__ import annotations

import json
import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from workloads import State, tensor_bytes, tensor_leaves

Op = Callable[[Path], object]
Setup = Callable[[State], Op]

ALIGN = 4096  # O_DIRECT alignment of buffer address, file offset and length


@dataclass(frozen=True)
class Method:
    """One benchmarked method.

    ``filename`` is what it writes (a save) in the workload's scratch directory; a load reads
    the file written by its ``source`` save method.
    """

    name: str
    op: str  # "save" or "load"
    setup: Setup
    filename: str = ""
    source: str = ""


def _fsync(path: Path) -> None:
    """fsync a file or a directory by path (a directory makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (works for every dtype, bfloat16 and bool included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _without_tensors(tree: Any) -> Any:
    """The tree with tensors dropped: the plain values safetensors keeps as JSON metadata."""
    if isinstance(tree, dict):
        return {str(k): _without_tensors(v) for k, v in tree.items() if not _is_tensor(v)}
    if isinstance(tree, (list, tuple)):
        return [_without_tensors(v) for v in tree if not _is_tensor(v)]
    return tree


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _quiet_dcp() -> None:
    """Silence DCP's warnings that it runs without a process group and that it overwrites a
    checkpoint: both are what the benchmark intends, once per call."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


# --- saves -----------------------------------------------------------------------------------


def safepoint_save(state: State) -> Op:
    import safepoint as sp

    return lambda path: sp.save(str(path), state, overwrite=True)


def torch_save(state: State) -> Op:
    def op(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync(path.parent)

    return op


def safetensors_save(state: State) -> Op:
    from safetensors.torch import save_file

    def op(path: Path) -> None:
        # Flattening and the metadata are part of what a safetensors user must do: timed.
        metadata = {"tree": json.dumps(_without_tensors(state))}
        save_file(tensor_leaves(state), str(path), metadata=metadata)
        _fsync(path)
        _fsync(path.parent)

    return op


def dcp_save(state: State) -> Op:
    from torch.distributed.checkpoint.state_dict_saver import save

    _quiet_dcp()

    def op(path: Path) -> None:
        # FileSystemWriter(sync_files=True) fsyncs its files but not the directories.
        save(state, checkpoint_id=str(path))
        _fsync(path)
        _fsync(path.parent)

    return op


def raw_buffered_save(state: State) -> Op:
    tensors = list(tensor_leaves(state).values())

    def op(path: Path) -> None:
        with open(path, "wb", buffering=0) as f:
            for tensor in tensors:
                view = _bytes_of(tensor)
                while view:
                    view = view[f.write(view) :]
            os.fsync(f.fileno())
        _fsync(path.parent)

    return op


def _aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``size`` rounded up to ALIGN, every page touched."""
    buffer = mmap.mmap(-1, -(-size // ALIGN) * ALIGN)
    np.frombuffer(buffer, dtype=np.uint8).fill(0)
    return buffer


def raw_odirect_save(state: State) -> Op:
    total = tensor_bytes(state)
    buffer = _aligned_buffer(total)
    offset = 0
    for tensor in tensor_leaves(state).values():
        data = _bytes_of(tensor)
        buffer[offset : offset + len(data)] = data
        offset += len(data)

    def op(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            view, written = memoryview(buffer), 0
            while written < len(view):  # one write(2) unless the kernel returns short
                written += os.write(fd, view[written:])
            os.ftruncate(fd, total)  # drop the alignment padding
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync(path.parent)

    return op


# --- loads -----------------------------------------------------------------------------------


def safepoint_load(state: State) -> Op:
    import safepoint as sp

    return lambda path: sp.load(str(path), into=state)


def torch_load(state: State) -> Op:
    del state  # it cannot load into existing tensors (which the worker keeps alive)
    return lambda path: torch.load(path, weights_only=True)


def safetensors_load(state: State) -> Op:
    from safetensors.torch import load_file

    def op(path: Path) -> None:
        loaded = load_file(str(path))
        for key, tensor in tensor_leaves(state).items():
            tensor.copy_(loaded[key])

    return op


def dcp_load(state: State) -> Op:
    from torch.distributed.checkpoint.state_dict_loader import load

    _quiet_dcp()
    return lambda path: load(state, checkpoint_id=str(path))


def raw_readinto_load(state: State) -> Op:
    total = tensor_bytes(state)  # the size of raw_buffered's file, read into one flat buffer
    buffer = _aligned_buffer(total)

    def op(path: Path) -> None:
        with open(path, "rb", buffering=0) as f:
            view, done = memoryview(buffer)[:total], 0
            while done < total:
                n = f.readinto(view[done:])
                if not n:
                    raise EOFError(f"{path} is shorter than {total} bytes")
                done += n

    return op


def raw_odirect_read_load(state: State) -> Op:
    """Not one of the project's targets: the device's read limit, free of page-cache costs."""
    total = tensor_bytes(state)
    buffer = _aligned_buffer(total)

    def op(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            view, done = memoryview(buffer), 0
            while done < total:  # the last read, of a whole block, stops short at end of file
                n = os.readv(fd, [view[done:]])
                if not n:
                    raise EOFError(f"{path} is shorter than {total} bytes")
                done += n
        finally:
            os.close(fd)

    return op


SAVES: dict[str, Method] = {
    m.name: m
    for m in (
        Method("safepoint", "save", safepoint_save, filename="safepoint.ckpt"),
        Method("torch_save", "save", torch_save, filename="torch.pt"),
        Method("safetensors", "save", safetensors_save, filename="model.safetensors"),
        Method("dcp", "save", dcp_save, filename="dcp"),
        Method("raw_buffered", "save", raw_buffered_save, filename="raw_buffered.bin"),
        Method("raw_odirect", "save", raw_odirect_save, filename="raw_odirect.bin"),
    )
}

LOADS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("safepoint", "load", safepoint_load, source="safepoint"),
        Method("torch_load", "load", torch_load, source="torch_save"),
        Method("safetensors", "load", safetensors_load, source="safetensors"),
        Method("dcp", "load", dcp_load, source="dcp"),
        Method("raw_readinto", "load", raw_readinto_load, source="raw_buffered"),
        Method("raw_odirect_read", "load", raw_odirect_read_load, source="raw_buffered"),
    )
}


def read_through(path: Path) -> None:
    """Read every file under ``path`` once, so that a warm load finds it in the page cache."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    chunk = bytearray(16 << 20)
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(chunk):
                pass
