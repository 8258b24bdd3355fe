"""Crash safety end to end: a child process saves a ~200 MB state over and over and the test
SIGKILLs it at random (seeded) moments. After every kill the newest committed checkpoint loads,
verifies, and holds exactly one version the child was saving (never a mix, never older than
the last save that returned), and a directory without a manifest is never loadable."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import safepoint as sp
from _states import data_files, manifest_files

pytestmark = pytest.mark.multiprocess

ARRAYS = 4
ARRAY_ITEMS = 50 << 18  # 50 MiB of uint32 each: 200 MiB in all
KILLS = 4
MAX_DELAY_S = 1.5
#: Half the kills are timed from the child's first save starting, half from its first save
#: returning: every run of the test sees both committed saves and kills inside a save.
WAIT_FOR = ("begin", "done")

CHILD = r'''
"""Save versions base, base+1, ... of a deterministic state until killed (or `count` saves)."""
import os, shutil, sys
import numpy as np
import safepoint as sp

mode, root, base, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ARRAYS, ITEMS = int(sys.argv[5]), int(sys.argv[6])
arrays = [np.empty(ITEMS, dtype=np.uint32) for _ in range(ARRAYS)]


FROZEN = ARRAYS // 2 if mode == "incremental" else 0  # arrays that never change


def state(version):
    for k, array in enumerate(arrays):
        array.fill(k if k < FROZEN else version * ARRAYS + k)
    rng = np.random.default_rng(version)
    return {"version": version, "tag": f"v{version}", "small": rng.standard_normal(257),
            "arrays": {f"a{k}": array for k, array in enumerate(arrays)}}


version = base
manager = None
while count:
    print(f"begin {version}", flush=True)
    if mode == "incremental":
        # Keeps the newest two; each save shares the frozen arrays with the one before.
        manager = manager or sp.CheckpointManager(root, keep_last=2, incremental=True,
                                                  async_save=False)
        manager.save(version, state(version))
    elif mode == "overwrite":
        sp.save(os.path.join(root, "ckpt"), state(version), overwrite=True)
    else:
        sp.save(os.path.join(root, f"step-{version:08d}"), state(version))
        # Keep the newest two: unpublish (manifest first), then remove the data.
        for name in sorted(os.listdir(root)):
            if name.startswith("step-") and int(name[5:]) < version - 1:
                manifest = os.path.join(root, name, "manifest.json")
                if os.path.exists(manifest):
                    os.unlink(manifest)
                shutil.rmtree(os.path.join(root, name))
    print(f"done {version}", flush=True)
    version += 1
    count -= 1
'''


class Child:
    """One run of the saving child."""

    def __init__(self, script: Path, mode: str, root: Path, base: int, count: int = -1) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script), mode, str(root), str(base), str(count),
             str(ARRAYS), str(ARRAY_ITEMS)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

    def kill_after(self, wait_for: str, delay_s: float) -> tuple[list[int], list[int]]:
        """SIGKILL the child `delay_s` after it first prints a line starting with `wait_for`
        ("begin": inside its first save; "done": once a save returned), so the kill lands at a
        random moment of the saving loop however slowly the child starts on a loaded machine.
        Returns (versions begun, versions done)."""
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:
            seen.append(line)
            if line.startswith(wait_for):
                break
        time.sleep(delay_s)
        alive = self.proc.poll() is None
        self.proc.kill()
        # Read on through the same buffered stream (communicate() would bypass its buffer and
        # lose the lines it already holds).
        with self.proc.stdout:
            out = "".join(seen) + self.proc.stdout.read()
        self.proc.wait(timeout=60)
        assert alive, f"the child died on its own (rc {self.proc.returncode}):\n{out}"
        return _parse(out)

    def finish(self) -> list[int]:
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, out
        return _parse(out)[1]


def _parse(out: str) -> tuple[list[int], list[int]]:
    begun = [int(line.split()[1]) for line in out.splitlines() if line.startswith("begin ")]
    done = [int(line.split()[1]) for line in out.splitlines() if line.startswith("done ")]
    return begun, done


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    yield path
    shutil.rmtree(tmp_path / "run", ignore_errors=True)  # up to a GB; pytest keeps tmp dirs


def _target() -> dict[str, Any]:
    """A live state to restore into, so loading reuses memory across iterations."""
    return {"version": -1, "tag": "", "small": np.zeros(257),
            "arrays": {f"a{k}": np.zeros(ARRAY_ITEMS, dtype=np.uint32) for k in range(ARRAYS)}}


def _check_version(url: str, target: dict[str, Any], frozen: int = 0) -> int:
    """Load `url` into `target`, check it verifies and holds one whole version (its first
    `frozen` arrays the same in every version); returns it."""
    assert sp.verify(url).ok, sp.verify(url).problems
    sp.load(url, into=target)
    version = target["version"]
    assert target["tag"] == f"v{version}"
    assert np.array_equal(target["small"], np.random.default_rng(version).standard_normal(257))
    for k in range(ARRAYS):
        array = target["arrays"][f"a{k}"]
        expected = k if k < frozen else version * ARRAYS + k
        assert array[0] == expected and array[-1] == expected, (version, k, array[0], array[-1])
        assert (array == expected).all(), f"a{k} of version {version} is torn"
    return int(version)


def _committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def test_sigkill_while_overwriting_one_url(tmp_path: Path, script: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    url = str(root / "ckpt")
    rng = random.Random(20240611)
    target = _target()
    committed: int | None = None
    saves = 0
    for iteration in range(KILLS):
        base = iteration * 1000
        begun, done = Child(script, "overwrite", root, base).kill_after(
            WAIT_FOR[iteration % 2], rng.uniform(0, MAX_DELAY_S)
        )
        saves += len(done)
        if committed is None and not (root / "ckpt" / "manifest.json").exists():
            assert not done
            with pytest.raises(sp.CheckpointNotFound):
                sp.load(url)
            continue
        version = _check_version(url, target)
        allowed = set(begun) | ({committed} if committed is not None else set())
        assert version in allowed, (version, begun, committed)
        if done:
            # A save that returned is durable: only it or a later (in-flight) one can be there.
            assert version >= done[-1], (version, done)
        committed = version
    assert saves, "the kills never let a save finish; raise MAX_DELAY_S"

    # A save that completes cleans up everything the killed ones left behind.
    done = Child(script, "overwrite", root, 10_000, count=1).finish()
    assert _check_version(url, target) == done[-1] == 10_000
    ckpt = root / "ckpt"
    assert data_files(ckpt) == manifest_files(ckpt)
    assert sorted(os.listdir(ckpt)) == ["data", "manifest.json"]


def test_sigkill_while_saving_new_steps(tmp_path: Path, script: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    rng = random.Random(7)
    target = _target()
    newest: int | None = None
    uncommitted_seen = 0
    for iteration in range(KILLS):
        base = iteration * 1000
        begun, done = Child(script, "steps", root, base).kill_after(
            WAIT_FOR[iteration % 2], rng.uniform(0, MAX_DELAY_S)
        )
        for directory in root.glob("step-*"):
            if not (directory / "manifest.json").exists():
                uncommitted_seen += 1
                with pytest.raises(sp.CheckpointNotFound):
                    sp.load(str(directory))
                with pytest.raises(sp.CheckpointNotFound):
                    sp.info(str(directory))
        steps = _committed_steps(root)
        if not steps:
            assert newest is None and not done
            continue
        for step in steps:
            assert sp.verify(str(root / f"step-{step:08d}")).ok
        step = steps[-1]
        assert _check_version(str(root / f"step-{step:08d}"), target) == step
        if done:
            assert step >= done[-1], (step, done)
            assert step in begun
        else:
            assert step in set(begun) | {newest}, (step, begun, newest)
        newest = step
    assert uncommitted_seen, "no kill landed inside a save; the test checked nothing uncommitted"


def test_sigkill_while_saving_incremental_steps(tmp_path: Path, script: Path) -> None:
    """An incremental manager's steps share the unchanged arrays (hard links to one file):
    after every kill, each committed step verifies, the newest holds one whole version, and
    the data shared by the kept steps is never lost to a deleted or interrupted one."""
    root = tmp_path / "run"
    root.mkdir()
    rng = random.Random(11)
    target = _target()
    shared_seen = 0
    for iteration in range(KILLS // 2):
        base = iteration * 1000
        _, done = Child(script, "incremental", root, base).kill_after(
            WAIT_FOR[iteration % 2], rng.uniform(0, MAX_DELAY_S)
        )
        steps = _committed_steps(root)
        for step in steps:
            url = str(root / f"step-{step}")
            assert _check_version(url, target, frozen=ARRAYS // 2) == step
        if len(steps) >= 2:
            newest, before = (data_files(root / f"step-{s}") for s in steps[-1:-3:-1])
            shared_seen += bool(newest & before)
        if done:
            assert steps and steps[-1] >= done[-1], (steps, done)
    assert shared_seen, "no two kept steps shared a file; the test checked no sharing"
