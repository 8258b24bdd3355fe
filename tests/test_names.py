"""`sp.format_name`: Composer's placeholders in checkpoint names and manager roots, format specs,
the rank default, and errors naming the placeholder to pass."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp


def test_composer_placeholders():
    name = sp.format_name("ckpt/{run_name}/ep{epoch}-ba{batch}-rank{rank}",
                          run_name="gpt-small", epoch=3, step=1200, rank=5)
    assert name == "ckpt/gpt-small/ep3-ba1200-rank5"
    assert sp.format_name("s3://b/{run_name}/step-{step:07d}", run_name="r", step=42) == (
        "s3://b/r/step-0000042"
    )
    assert sp.format_name("{node}/{{literal}}/{step}", step=1, extra={"node": "n3"}) == (
        "n3/{literal}/1"
    )
    assert sp.format_name("plain/name") == "plain/name"


def test_rank_defaults_to_this_process_rank():
    # torch.distributed is not initialised in the test process: rank 0.
    assert sp.format_name("rank{rank}") == "rank0"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("ep{epoch}", "pass epoch="),
        ("{host}", r"pass extra={'host': ...}"),
        ("{step.real}", "plain names"),
        ("{}", "plain names"),
        ("{step", "malformed"),
        ("{run_name:d}", "cannot format"),
        ("ba{step:{width}}", "'width'"),
    ],
)
def test_errors_say_what_to_pass(template, message):
    with pytest.raises(sp.SafepointError) as caught:
        sp.format_name(template, step=1, run_name="r")
    assert message in str(caught.value) and template in str(caught.value)


def test_a_named_save_and_a_named_manager_root(tmp_path):
    url = sp.format_name(f"{tmp_path}/{{run_name}}/ep{{epoch}}-ba{{batch}}", run_name="r1",
                         epoch=2, step=300)
    sp.save(url, {"w": np.arange(3)}, metadata={"epoch": 2, "step": 300})
    assert sp.info(str(tmp_path / "r1" / "ep2-ba300")).metadata == {"epoch": 2, "step": 300}

    root = sp.format_name(f"{tmp_path}/{{run_name}}/checkpoints", run_name="r1")
    with sp.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(300, {"w": np.arange(3)})
    assert (tmp_path / "r1" / "checkpoints" / "step-300" / "manifest.json").is_file()


@pytest.mark.parametrize("step", ["1", 1.0, True, -1])
def test_a_manager_refuses_a_step_that_is_not_a_whole_number_wherever_it_is_named(
    tmp_path: Any, step: Any
) -> None:
    """restore(step="1") loaded step 1 and returned "1"; metadata(1.0) looked for `step-1.0`
    and said it was missing: every step a manager is given is checked, as save checks it."""
    with sp.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(2)})
        calls = [lambda: mgr.restore({"w": np.zeros(2)}, step=step), lambda: mgr.metadata(step),
                 lambda: mgr.step_url(step), lambda: mgr.save(step, {"w": np.ones(2)})]
        for call in calls:
            with pytest.raises(sp.SafepointError, match=r"step=.*: pass a whole number 0 or"):
                call()


@pytest.mark.parametrize("step", [10**200, 10**5000], ids=["201 digits", "5001 digits"])
def test_a_manager_refuses_a_step_too_long_to_name_a_directory(tmp_path: Any, step: int) -> None:
    """A step of 5,000 digits raised a bare ValueError (Python's limit on int to str); one of
    260 a StorageError from the file system. Below 10**200, `step-<step>` fits a file name."""
    with sp.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        for call in (lambda: mgr.save(step, {"w": np.ones(2)}), lambda: mgr.step_url(step)):
            with pytest.raises(sp.SafepointError, match=r"step=.*: pass a whole number 0 or "
                                                        r"more, below 10\*\*200"):
                call()
        mgr.save(10**200 - 1, {"w": np.ones(2)})
        assert mgr.steps() == [10**200 - 1]


def test_a_manager_takes_numpy_and_torch_integer_steps(tmp_path: Any) -> None:
    """A step picked with NumPy (`steps[np.argmin(losses)]`, an np.int64) or torch is a whole
    number: saved, restored and described as the int it is."""
    with sp.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(np.int64(2), {"w": np.ones(2)})
        best = np.array([5, 2])[np.argmin([1.0, 0.5])]
        info = mgr.metadata(best)
        assert info.step == 2 and type(info.step) is int
        state = {"w": np.zeros(2)}
        assert mgr.restore(state, step=torch.tensor(2)) == 2
        assert state["w"].tolist() == [1.0, 1.0] and mgr.steps() == [2]


def test_a_torch_integer_step_names_its_directory_in_a_process_group(tmp_path: Any) -> None:
    """With torch.distributed initialised (the collective path, a world of one here), a torch
    integer step is the int it holds, as alone (it committed `step-tensor([6])`, which no
    listing saw); a bool tensor is no step."""
    root = str(tmp_path / "root")
    code = textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist, safepoint as sp
        root = sys.argv[1]
        dist.init_process_group("gloo", init_method=f"file://{root}.store", rank=0,
                                world_size=1)
        with sp.CheckpointManager(root, async_save=False) as mgr:
            handle = mgr.save(torch.tensor([6]), {"w": torch.ones(2)})
            try:
                mgr.save(torch.tensor(True), {"w": torch.ones(2)})
            except sp.SafepointError:
                print("refused")
            print(sorted(os.listdir(root)), mgr.steps(), type(handle.step).__name__)
        dist.destroy_process_group()
    """)
    child = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[:2] == ["refused", "['lease', 'step-6'] [6] int"]


def test_manager_metadata_may_be_any_mapping(tmp_path: Any) -> None:
    """metadata=MappingProxyType(config) (or a ChainMap) is copied and saved, as before the
    manager checked that metadata is a mapping."""
    with sp.CheckpointManager(str(tmp_path / "root"), async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(2)}, metadata=types.MappingProxyType({"lr": 0.1}))
        assert mgr.metadata(1).metadata == {"lr": 0.1}

