"""examples/read_without_safepoint.py, the reader docs/format.md prints as proof that the format
can be read without safepoint, reads what safepoint writes and catches damage."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

import safepoint as sp
from _states import random_tensor, tensor_bytes

REPO = Path(__file__).resolve().parent.parent
READER = REPO / "examples" / "read_without_safepoint.py"


@pytest.fixture(scope="module")
def reader() -> ModuleType:
    spec = importlib.util.spec_from_file_location("read_without_safepoint", READER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_format_page_prints_the_example_reader() -> None:
    page = (REPO / "docs" / "format.md").read_text()
    printed = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert printed.startswith("import json")
    assert printed in READER.read_text()


def test_the_reader_imports_only_json_numpy_and_crc32c() -> None:
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(READER.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert imported == {"json", "os", "sys", "crc32c", "numpy"}


def test_the_reader_reads_every_tensor_and_array_bit_for_bit(
    tmp_path: Path, reader: ModuleType
) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
              torch.complex64, torch.int64, torch.uint8, torch.bool]
    tensors = {f"t{i}": random_tensor(dtype, (3, 5), seed=i) for i, dtype in enumerate(dtypes)}
    state = {
        "model": torch.nn.Linear(4, 2),
        "tensors": tensors,
        "big": random_tensor(torch.float32, (5 << 18,), seed=99),  # 5 MiB: two checksum blocks
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "arr": np.arange(12, dtype=">i4").reshape(3, 4),
        "step": 7,
        "blob": b"not an array",
    }
    state["tied"] = state["big"]  # stored once, as an alias
    ckpt = tmp_path / "ckpt"
    assert [e.kind for e in sp.save(str(ckpt), state).entries if e.path == "tied"] == ["alias"]

    arrays = reader.read_checkpoint(str(ckpt))
    expected = {"model/weight": state["model"].weight, "model/bias": state["model"].bias,
                **{f"tensors/{k}": v for k, v in tensors.items()},
                "big": state["big"], "tied": state["big"], "empty": state["empty"],
                "scalar": state["scalar"]}
    assert set(arrays) == {*expected, "arr"}
    for path, tensor in expected.items():
        assert arrays[path].shape == tuple(tensor.shape), path
        assert arrays[path].tobytes() == tensor_bytes(tensor), path
    np.testing.assert_array_equal(arrays["arr"], state["arr"])
    assert arrays["arr"].dtype == np.dtype("<i4")


def test_the_reader_reads_an_incremental_step(tmp_path: Path, reader: ModuleType) -> None:
    """A version 2 manifest (an entry in chunks of two files, one shared with the step
    before) reads as its state."""
    big = random_tensor(torch.float32, (3 << 20,), seed=1)  # 12 MiB: three blocks
    with sp.CheckpointManager(str(tmp_path), incremental=True, async_save=False) as mgr:
        mgr.save(1, {"big": big})
        big.view(torch.int32)[(1 << 20) + 3] ^= 1  # the middle block changes
        mgr.save(2, {"big": big})
    assert sp.info(mgr.step_url(2)).format_version == 2
    arrays = reader.read_checkpoint(str(tmp_path / "step-2"))
    assert arrays["big"].tobytes() == tensor_bytes(big)


def test_the_reader_catches_a_flipped_bit(tmp_path: Path, reader: ModuleType) -> None:
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), {"w": torch.arange(1000.0)})
    (data,) = (ckpt / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum mismatch"):
        reader.read_checkpoint(str(ckpt))


@pytest.mark.timeout(240)
def test_the_demo_resumes_bit_for_bit_after_its_interruptions(tmp_path: Path) -> None:
    """`make demo`, shortened: two SIGKILLs and a SIGTERM, then the same weights, optimizer
    and scheduler state as the job that ran through."""
    root = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--root", str(root),
         "--steps", "200", "--every", "10", "--seed", "7"],
        capture_output=True, text=True, timeout=220, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-2].startswith("IDENTICAL (5 processes"), done.stdout
    assert any(line.startswith("final checkpoint: step 200") and "sp.verify ok" in line
               for line in lines), done.stdout
    hashes = [line.split()[-1] for line in lines if "sha256:" in line]
    assert len(hashes) == 2 and hashes[0] == hashes[1] and len(hashes[0]) == 64
    with sp.CheckpointManager(str(root / "interrupted")) as manager:
        assert manager.latest_step() == 200
