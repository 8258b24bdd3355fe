"""README's examples run as written: the tour and the manager loop are executed from the
README text itself (the loop with a small model and the names it leaves to the reader
defined), so the documentation cannot drift from the API."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(heading: str) -> str:
    """The first Python code block after the README heading `heading`."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    found = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert found, f"no python block under {heading!r}"
    return found.group(1)


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)


def test_the_tour_runs(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_block("## A tour"), "README.md: A tour", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith("{'loss': 0.25}")
    assert printed[1] == "['model', 'optim', 'seen', 'step'] ['bias', 'weight']"
    assert (in_tmp / "ckpt" / "step-100" / "manifest.json").is_file()


def test_the_manager_loop_runs_and_resumes(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    steps: list[int] = []

    def train_one_step() -> None:
        optimizer.zero_grad()
        model(torch.ones(4, 8)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        steps.append(len(steps))

    names: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                             "total_steps": 1500, "train_one_step": train_one_step,
                             "val_loss": 1.0}
    code = compile(_block("## A series of checkpoints: `sp.CheckpointManager`"),
                   "README.md: CheckpointManager", "exec")
    exec(code, names)
    assert len(steps) == 1500
    saves = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("Event(kind='save'")]  # on_event=print
    assert [line.split("step=")[1].split(",")[0] for line in saves] == ["500", "1000", "1500"]
    trained = model.weight.detach().clone()
    exec(code, names)  # a rerun restores step 1500 and has nothing left to train
    assert len(steps) == 1500
    assert torch.equal(model.weight, trained)
    # The relative root as the manager took it: absolute, against the working directory then.
    assert f"Event(kind='load', url='{in_tmp}/ckpt/run1/step-1500'" in capsys.readouterr().out
    assert sorted(p.name for p in (in_tmp / "ckpt" / "run1").glob("step-*")) == [
        "step-1000", "step-1500", "step-500"]


def test_the_incremental_example_shares_the_frozen_backbone(in_tmp: Path) -> None:
    exec(compile(_block("### Incremental saves: frozen weights written once"),
                 "README.md: incremental", "exec"), {})
    steps = [in_tmp / "ckpt" / "finetune" / f"step-{n}" / "data" for n in (2, 3)]
    inodes = [{p.stat().st_ino for p in data.iterdir()} for data in steps]
    assert inodes[0] & inodes[1], "steps 2 and 3 share no file"
    own = [p.stat().st_size for p in steps[1].iterdir() if p.stat().st_nlink == 1]
    assert sum(own) < 1 << 20  # the head and its optimizer state, not the 16 MiB backbone
