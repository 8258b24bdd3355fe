"""Helpers for the end-to-end tests: bit-exact comparison of saved and loaded trees, small
training states, and manifest surgery (owned by test_api, test_errors and test_crash)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from safepoint._format import seal


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor's values in C order (conj and neg views resolved)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def assert_same_tensor(loaded: Any, expected: torch.Tensor, where: str = "") -> None:
    """`loaded` is a CPU tensor holding exactly the bits of `expected` (NaN payloads included)."""
    assert isinstance(loaded, torch.Tensor), f"{where}: {type(loaded)} is not a tensor"
    assert loaded.dtype == expected.dtype, f"{where}: {loaded.dtype} != {expected.dtype}"
    assert loaded.shape == expected.shape, f"{where}: {loaded.shape} != {expected.shape}"
    assert tensor_bytes(loaded) == tensor_bytes(expected), f"{where}: bytes differ"


def assert_same_array(loaded: Any, expected: np.ndarray, where: str = "") -> None:
    """`loaded` is an ndarray of `expected`'s dtype (byte order included) with its values bit
    for bit."""
    assert type(loaded) is np.ndarray, f"{where}: {type(loaded)} is not an ndarray"
    assert loaded.dtype == expected.dtype, f"{where}: {loaded.dtype} != {expected.dtype}"
    assert loaded.shape == expected.shape, f"{where}: {loaded.shape} != {expected.shape}"
    want = np.ascontiguousarray(expected).tobytes()
    assert np.ascontiguousarray(loaded).tobytes() == want, f"{where}: bytes differ"


def assert_same(loaded: Any, expected: Any, where: str = "<root>") -> None:
    """Deep, bit-exact equality with exact container and key types (a dict may come back for
    an OrderedDict; everything else must keep its type)."""
    if isinstance(expected, torch.Tensor):
        assert_same_tensor(loaded, expected, where)
    elif isinstance(expected, np.ndarray):
        assert_same_array(loaded, expected, where)
    elif isinstance(expected, np.generic):
        assert type(loaded) is type(expected), f"{where}: {type(loaded)} != {type(expected)}"
        assert loaded.tobytes() == expected.tobytes(), f"{where}: {loaded!r} != {expected!r}"
    elif isinstance(expected, float):
        assert type(loaded) is float, f"{where}: {type(loaded)} is not float"
        if math.isnan(expected):
            assert math.isnan(loaded), f"{where}: {loaded!r} is not nan"
        else:
            assert loaded == expected, f"{where}: {loaded!r} != {expected!r}"
            assert math.copysign(1, loaded) == math.copysign(1, expected), f"{where}: sign"
    elif isinstance(expected, Mapping):
        assert isinstance(loaded, Mapping), f"{where}: {type(loaded)} is not a mapping"
        keys = [(type(k), k) for k in expected]
        got = [(type(k), k) for k in loaded]
        assert got == keys, f"{where}: keys {got} != {keys}"
        for key in expected:
            assert_same(loaded[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert type(loaded) is type(expected), f"{where}: {type(loaded)} != {type(expected)}"
        assert len(loaded) == len(expected), f"{where}: length {len(loaded)} != {len(expected)}"
        for index, (a, b) in enumerate(zip(loaded, expected, strict=True)):
            assert_same(a, b, f"{where}/{index}")
    else:
        assert type(loaded) is type(expected), f"{where}: {type(loaded)} != {type(expected)}"
        assert loaded == expected, f"{where}: {loaded!r} != {expected!r}"


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of `shape` whose bytes are random (NaN and other special patterns included);
    bools are 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def training_state(seed: int = 0, steps: int = 3) -> dict[str, Any]:
    """A model, an AdamW optimizer and a StepLR scheduler after `steps` steps, a grad scaler,
    a plain tensor and counters."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    for _ in range(steps):
        train_step(model, optimizer, scaler, torch.randn(4, 6))
        scheduler.step()
    return {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "scaler": scaler,
        "ema": torch.randn(7, 3),
        "step": steps,
    }


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batch: torch.Tensor,
) -> None:
    """One scaled AdamW step on a squared-output loss."""
    optimizer.zero_grad()
    loss = model(batch).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def sealed(document: dict[str, Any]) -> bytes:
    """A manifest document encoded with its own checksum made anew (see `_format.seal`), as
    a writer that meant every byte of it would: tests edit manifests to reach the checks
    behind the checksum."""
    body = {key: value for key, value in document.items() if key != "manifest_checksum"}
    return seal(json.dumps(body, separators=(",", ":")).encode())


def edit_manifest(ckpt: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Rewrite `ckpt/manifest.json` (sealed) after `change(document)` edited it in place."""
    path = ckpt / "manifest.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_bytes(sealed(document))


def chunk_of(ckpt: Path, entry_path: str) -> tuple[Path, int, int]:
    """(data file, offset, nbytes) of the first chunk of `entry_path`, read from the manifest."""
    document = json.loads((ckpt / "manifest.json").read_text())
    index = document["entries"]["path"].index(entry_path)
    chunks = document["chunks"]
    row = chunks["entry"].index(index)
    name = document["files"][chunks["file"][row]]["name"]
    return ckpt / name, chunks["offset"][row], chunks["nbytes"][row]


def flip_bit_of(ckpt: Path, entry_path: str, at: int = 100) -> None:
    """Damage the entry `entry_path` of the checkpoint at `ckpt` in place (bit rot): flip one
    bit of its byte `at`, so its file keeps its size."""
    file, offset, _ = chunk_of(ckpt, entry_path)
    with open(file, "r+b") as opened:
        opened.seek(offset + at)
        byte = opened.read(1)
        opened.seek(offset + at)
        opened.write(bytes([byte[0] ^ 1]))


def data_files(ckpt: Path) -> set[str]:
    """Every file under `ckpt/data`, as `data/...` names."""
    root = ckpt / "data"
    if not root.exists():
        return set()
    return {f"data/{p.relative_to(root).as_posix()}" for p in root.rglob("*") if p.is_file()}


def manifest_files(ckpt: Path) -> set[str]:
    """The data files `ckpt/manifest.json` references."""
    document = json.loads((ckpt / "manifest.json").read_text())
    return {record["name"] for record in document["files"]}
