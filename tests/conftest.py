"""Shared fixtures: a tmp checkpoint directory, a memory:// scheme and a small training state
(model, AdamW optimizer with a few steps taken, LR scheduler)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from safepoint.testing import MemoryBackend, memory_scheme


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A directory path for one checkpoint (not created yet)."""
    return tmp_path / "ckpt"


@pytest.fixture
def memory_backend() -> Iterator[MemoryBackend]:
    """The scheme ``mem-test://`` backed by a fresh in-memory store for this test."""
    with memory_scheme("mem-test") as backend:
        yield backend


def _make_training_state(seed: int = 0, steps: int = 3) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(5, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return {"model": model, "optim": optimizer, "sched": scheduler, "step": steps}


@pytest.fixture
def make_training_state() -> Callable[..., dict[str, Any]]:
    """A factory: `make_training_state(seed=0, steps=3)` -> {"model", "optim", "sched", "step"},
    the optimizer and scheduler having taken `steps` AdamW steps."""
    return _make_training_state
