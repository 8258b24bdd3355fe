"""The commit protocol of docs/format.md, observed at the system calls of real saves to the local
filesystem: every data file and the `data/` directory are fsynced before the manifest gets its
name; the manifest goes to a temporary name and is fsynced first; the checkpoint directory is
fsynced after; on overwrite the old data is removed only after the new manifest landed.

A SIGKILL (tests/test_crash.py) leaves the page cache intact, so it cannot tell whether an
fsync was skipped; a power loss would. The calls are recorded, not replaced: each one runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from safepoint._commit import check_free, leftovers, read_manifest, wait_for_removals
from safepoint._format import data_file_name
from safepoint._storage_local import LocalStorage
from safepoint.storage import _REGISTERED as storage_registry
from safepoint.testing import FailurePredicate, FaultyStorage, fail_nth

Event = tuple[str, str]


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """(call, path) for every fsync, link, rename, replace and unlink in this process, in order,
    appended once the call succeeded."""
    events: list[Event] = []
    real = {name: getattr(os, name) for name in ("fsync", "link", "rename", "replace", "unlink")}

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        real["fsync"](fd)
        events.append(("fsync", path))

    def naming(name: str) -> Any:
        def call(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real[name](src, dst, *args, **kwargs)
            events.append((name, os.path.realpath(dst)))
        return call

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        real["unlink"](path, *args, **kwargs)
        events.append(("unlink", os.path.realpath(path)))

    monkeypatch.setattr(os, "fsync", fsync)
    for name in ("link", "rename", "replace"):
        monkeypatch.setattr(os, name, naming(name))
    monkeypatch.setattr(os, "unlink", unlink)
    return events


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(3 << 18), "b": torch.randn(17), "arr": np.arange(1000) * seed,
            "blob": b"x" * 100, "step": seed}


def _data_files(ckpt: Path) -> list[str]:
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    return [os.path.realpath(ckpt / record["name"]) for record in doc["files"]]


def _index(events: list[Event], event: Event) -> int:
    assert event in events, f"{event} never happened: {events}"
    return events.index(event)


def test_a_new_checkpoint_is_durable_before_its_manifest_is_named(
    tmp_path: Path, syscalls: list[Event]
) -> None:
    ckpt = tmp_path / "runs" / "ckpt"
    sp.save(str(ckpt), _state(1))
    real = Path(os.path.realpath(ckpt))
    manifest = str(real / "manifest.json")
    commit = _index(syscalls, ("link", manifest))
    before, after = syscalls[:commit], syscalls[commit + 1 :]

    files = _data_files(ckpt)
    assert len(files) == 1
    # Each data file is durable under a temporary name, then renamed whole into place.
    for name in files:
        (written,) = [i for i, (call, path) in enumerate(before)
                      if call == "fsync" and path.startswith(name + ".tmp-")]
        assert written < _index(before, ("replace", name))
    data_synced = max(_index(before, ("replace", name)) for name in files)
    dir_synced = _index(before, ("fsync", str(real / "data")))
    assert data_synced < dir_synced
    # Every directory the save created is fsynced into its parent before the commit.
    for created in (real.parent, real):
        assert ("fsync", str(created.parent)) in before, created
    # The manifest's bytes are durable under a temporary name before it is given its name.
    temporary = [path for call, path in before
                 if call == "fsync" and path.startswith(manifest + ".tmp-")]
    assert len(temporary) == 1
    assert before.index(("fsync", temporary[0])) > dir_synced
    # After the name: the temporary name goes, the directory entry is made durable.
    assert ("unlink", temporary[0]) in after
    assert ("fsync", str(real)) in after
    assert not any(call in ("link", "rename", "replace") for call, _ in after)
    assert sorted(p.name for p in ckpt.iterdir()) == ["data", "manifest.json"]


def test_overwrite_replaces_the_manifest_then_removes_the_old_data(
    tmp_path: Path, syscalls: list[Event]
) -> None:
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), _state(1))
    old = _data_files(ckpt)
    syscalls.clear()
    sp.save(str(ckpt), _state(2), overwrite=True)
    wait_for_removals()  # the replaced data goes in a background thread
    real = Path(os.path.realpath(ckpt))
    new = _data_files(ckpt)
    assert not set(old) & set(new), "an overwrite must write new names, never the old bytes"

    commit = _index(syscalls, ("replace", str(real / "manifest.json")))
    before, after = syscalls[:commit], syscalls[commit + 1 :]
    assert all(("replace", name) in before for name in new)  # written whole, then named
    assert not any(call == "unlink" and path in old for call, path in before)
    dir_synced = _index(after, ("fsync", str(real)))
    assert all(_index(after, ("unlink", name)) > dir_synced for name in old)
    assert all(not os.path.exists(name) for name in old)
    assert torch.equal(sp.load(str(ckpt))["w"], _state(2)["w"])


@pytest.fixture
def faulty_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`make(predicate)`: a `faulty://` URL of a local checkpoint directory whose storage
    (the real LocalStorage) fails the operations `predicate` picks."""

    def make(predicate: FailurePredicate) -> str:
        def factory(url: str, options: dict[str, Any] | None) -> FaultyStorage:
            return FaultyStorage(LocalStorage(url, options), predicate)

        monkeypatch.setitem(storage_registry, "faulty", factory)
        return f"faulty://{tmp_path / 'ckpt'}"

    return make


@pytest.mark.parametrize(
    ("predicate", "committed"),
    [
        pytest.param(fail_nth("write", 1), 1, id="data-file"),
        pytest.param(fail_nth("write_chunk", 1), 1, id="data-bytes"),
        pytest.param(fail_nth("publish", 1), 1, id="manifest"),
        pytest.param(fail_nth("delete", 1), 2, id="old-data-after-commit"),
    ],
)
def test_a_failed_overwrite_leaves_one_whole_checkpoint(
    tmp_path: Path, faulty_url: Any, predicate: FailurePredicate, committed: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An I/O failure at any step of an overwrite before the commit raises StorageError and
    the URL holds the old checkpoint; a failure to remove the old data after the commit is
    logged (the save did commit) and the URL holds the new one. Either way it is whole and
    verified, and the files of the other are unreferenced leftovers."""
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), _state(1))
    if committed == 1:
        with pytest.raises(sp.StorageError, match="injected failure"):
            sp.save(faulty_url(predicate), _state(2), overwrite=True)
    else:
        sp.save(faulty_url(predicate), _state(2), overwrite=True)
        wait_for_removals()
        assert "could not remove the replaced data" in caplog.text
    assert sp.verify(str(ckpt)).ok
    loaded = sp.load(str(ckpt))
    assert loaded["step"] == committed
    assert torch.equal(loaded["w"], _state(committed)["w"])
    storage = LocalStorage(str(ckpt))
    stale = leftovers(storage, read_manifest(storage))
    assert all(name.startswith("data/") for name in stale)
    # The next save cleans them up.
    sp.save(str(ckpt), _state(3), overwrite=True)
    wait_for_removals()
    assert leftovers(storage, read_manifest(storage)) == []


def test_a_save_that_loses_the_race_to_commit_removes_its_data_file(tmp_path: Path) -> None:
    """Another writer commits the URL while this save writes (CheckpointExists at publish):
    the losing save's data file is removed, so data/ holds only what the winner's manifest
    references (it stayed there, unreferenced, before)."""
    url = str(tmp_path / "ckpt")

    class Racer:
        def state_dict(self) -> dict[str, Any]:
            sp.save(url, _state(1))  # the other writer, committing meanwhile
            return {"w": torch.zeros(1 << 16)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(sp.CheckpointExists):
        sp.save(url, {"m": Racer()})
    storage = LocalStorage(url)
    assert sorted(storage.list("data")) == sorted(read_manifest(storage).files)
    assert sp.verify(url).ok and sp.load(url)["step"] == 1


def test_a_publish_that_fails_after_committing_keeps_the_data_it_committed(
    tmp_path: Path, late_scheme: str
) -> None:
    ckpt = tmp_path / "ckpt"
    with pytest.raises(sp.StorageError, match="after the rename"):
        sp.save(f"{late_scheme}{ckpt}", _state(2))
    assert sp.verify(str(ckpt)).ok
    assert sp.load(str(ckpt))["step"] == 2


def test_a_save_removes_the_leftovers_of_a_crashed_save_at_its_url(tmp_path: Path) -> None:
    """A save killed before its commit leaves data files and no manifest; the next save there
    (not an overwrite: nothing was committed) removes them once it committed."""
    ckpt, crashed = tmp_path / "ckpt", uuid.uuid4().hex
    (ckpt / "data").mkdir(parents=True)
    (ckpt / data_file_name(crashed, 0, 0)).write_bytes(bytes(4096))
    (ckpt / f"{data_file_name(crashed, 0, 0)}.tmp-{crashed}").write_bytes(bytes(4096))
    (ckpt / f"manifest.json.tmp-{crashed}").write_bytes(b"{")
    sp.save(str(ckpt), _state(1))
    wait_for_removals()
    storage = LocalStorage(str(ckpt))
    assert sorted(storage.list("")) == sorted([*read_manifest(storage).files, "manifest.json"])


def test_a_save_into_a_directory_leaves_the_users_own_files(tmp_path: Path) -> None:
    """Saving into a project directory that has a `data/` folder of its own: a leftover is
    only a file named as safepoint names its files, so the user's files stay, through the
    save, an overwrite and the removal of the old data."""
    ours = {"data/train.csv": b"a,b\n", "data/images/0.png": b"png",
            "data/0123-r00000-0000.bin": b"not of a save", "manifest.json.tmp": b"mine"}
    for name, data in ours.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    sp.save(str(tmp_path), _state(1))
    sp.save(str(tmp_path), _state(2), overwrite=True)
    wait_for_removals()
    assert {name: (tmp_path / name).read_bytes() for name in ours} == ours
    assert sp.verify(str(tmp_path)).ok


class _SlowDeletes(LocalStorage):
    """The real local storage whose deletes wait for `release` (set by the test)."""

    release = threading.Event()

    def delete(self, paths: Any) -> None:
        assert self.release.wait(30)
        super().delete(paths)


def test_an_overwrite_returns_before_the_old_data_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing the replaced data is off the save's critical path: `sp.save` returns while the
    removal is still blocked, the new checkpoint already loads, and the old files go once the
    removal runs."""
    monkeypatch.setitem(storage_registry, "slow", _SlowDeletes)
    url = f"slow://{tmp_path / 'ckpt'}"
    sp.save(url, _state(1))
    old = _data_files(tmp_path / "ckpt")
    _SlowDeletes.release.clear()
    try:
        sp.save(url, _state(2), overwrite=True)
        assert all(os.path.exists(name) for name in old)
        assert sp.load(url)["step"] == 2
    finally:
        _SlowDeletes.release.set()
    wait_for_removals()
    assert not any(os.path.exists(name) for name in old)
    assert sp.verify(url).ok


def test_the_interpreter_finishes_removals_before_it_exits(tmp_path: Path) -> None:
    """A process that overwrites a checkpoint and exits at once leaves no leftovers."""
    ckpt = tmp_path / "ckpt"
    script = f"""
import time, numpy as np, safepoint as sp
from safepoint._storage_local import LocalStorage
from safepoint.storage import register

class Slow(LocalStorage):
    def delete(self, paths):
        time.sleep(0.5)
        super().delete(paths)

register("slow", Slow)
sp.save("slow://{ckpt}", {{"a": np.arange(10)}})
sp.save("slow://{ckpt}", {{"a": np.arange(20)}}, overwrite=True)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    storage = LocalStorage(str(ckpt))
    assert leftovers(storage, read_manifest(storage)) == []
    assert len(list((ckpt / "data").iterdir())) == 1


def test_check_free_refuses_a_committed_checkpoint_before_anything_is_written(
    tmp_path: Path,
) -> None:
    storage = LocalStorage(str(tmp_path / "ckpt"))
    check_free(storage, overwrite=False)  # nothing there yet
    sp.save(str(tmp_path / "ckpt"), {"w": torch.ones(2)})
    check_free(storage, overwrite=True)
    with pytest.raises(sp.CheckpointExists) as caught:
        check_free(storage, overwrite=False)
    assert str(tmp_path / "ckpt") in str(caught.value) and "overwrite=True" in str(caught.value)
    assert caught.value.url == storage.url


def test_a_checkpoint_is_not_committed_over_a_directory_of_checkpoints(tmp_path: Path) -> None:
    """`safepoint cp best ROOT/` (as one copies a file into a directory), `sp.save(ROOT)` or
    an import there committed a manifest at a manager root: `ls` then showed one checkpoint
    and hid the steps, and `gc` refused the root as 'one checkpoint'."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(10, {"w": np.ones(3)})
    sp.save(str(tmp_path / "best"), {"w": np.zeros(3)})
    refusals = [
        lambda: sp.copy(str(tmp_path / "best"), str(root)),
        lambda: sp.save(str(root), {"w": np.zeros(3)}),
        lambda: sp.save(str(root), {"w": np.zeros(3)}, overwrite=True),
        lambda: sp.save(str(tmp_path), {"w": np.zeros(3)}),  # a root two levels down
    ]
    for refused in refusals:
        with pytest.raises(sp.CheckpointExists, match=r"holds checkpoints.*step-10.*NAME"):
            refused()
    assert not (root / "manifest.json").exists() and not (tmp_path / "manifest.json").exists()
    sp.copy(str(tmp_path / "best"), str(root / "best"))  # a name of its own
    with sp.CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [10]
