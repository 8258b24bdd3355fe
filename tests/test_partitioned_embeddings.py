"""examples/partitioned_embeddings.py, the PyTorch-BigGraph-style user story: every partition
saved together, each loaded back alone, exactly, reading only its own bytes (counted at the
storage)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import safepoint.storage
from safepoint.testing import memory_scheme

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "partitioned_embeddings.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("partitioned_embeddings", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CountingStorage:
    """A storage that counts the bytes of data files read through it."""

    def __init__(self, inner: Any, counts: list[int]) -> None:
        self.inner = inner
        self.counts = counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        data: bytes = self.inner.read(path, start, end)
        if path.startswith("data/"):
            self.counts.append(len(data))
        return data

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.inner.readinto(path, offset, buffers)
        self.counts.append(sum(len(b) for b in buffers))


def test_each_partition_loads_alone_and_exactly(example, capsys):
    counts: list[int] = []
    with memory_scheme("counted") as backend:
        safepoint.storage.register(
            "counted", lambda url, options: CountingStorage(backend(url, options), counts)
        )
        summary = example.main(["--root", "counted://pbg", "--partitions", "4", "--rows", "3000",
                                "--dim", "16", "--epochs", "2"])
    out = capsys.readouterr().out

    assert summary["matches"] == [True] * 4
    sizes, total = summary["partition_bytes"], summary["total_bytes"]
    # 3000 x 16 float32 embeddings and as large an Adagrad sum, plus small step tensors.
    assert all(2 * 3000 * 16 * 4 <= size < 2 * 3000 * 16 * 4 + 1024 for size in sizes)
    assert sum(sizes) < total
    # Only the loads read data. Each needs at least its own partition's bytes, so reading no
    # more than their sum in all means each load read its partition and nothing else.
    assert sum(sizes) <= sum(counts) <= sum(sizes) + 4 * 4096
    assert "epoch 1: mean loss" in out and "partition 3: restored exactly" in out
