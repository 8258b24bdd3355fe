"""Error paths end to end: each test damages or misuses a real checkpoint on disk and checks
the exception type, that its message names the URL, file or entry, and that it says what to do
next; `sp.verify` reports (not raises) the same damage, and nothing ever unpickles unasked."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from _states import assert_same, chunk_of, edit_manifest
from safepoint._commit import wait_for_removals

BLOCK = 4 << 20


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A committed checkpoint: a 6 MiB tensor (two checksum blocks) and small entries."""
    ckpt = tmp_path / "ckpt"
    state = {
        "big": torch.arange(6 << 18, dtype=torch.float32).reshape(-1, 1024),
        "small": torch.randn(100),
        "arr": np.arange(50, dtype=np.int64),
        "raw": b"payload" * 10,
        "step": 3,
    }
    sp.save(str(ckpt), state)
    return ckpt, state


def _data_file(ckpt: Path) -> Path:
    (name,) = os.listdir(ckpt / "data")
    return ckpt / "data" / name


def _flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


# -- nothing committed ----------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["load", "info", "verify"])
def test_missing_checkpoint(tmp_path: Path, call: str) -> None:
    url = str(tmp_path / "never" / "saved")
    with pytest.raises(sp.CheckpointNotFound) as caught:
        getattr(sp, call)(url)
    assert isinstance(caught.value, FileNotFoundError)
    assert isinstance(caught.value, sp.SafepointError)
    assert url in str(caught.value)
    assert "check the path" in str(caught.value) or "safepoint ls" in str(caught.value)
    assert caught.value.url == url


def test_uncommitted_leftover_is_not_a_checkpoint(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    (ckpt / "manifest.json").unlink()
    assert (ckpt / "data").is_dir()
    for call in (sp.load, sp.info, sp.verify):
        with pytest.raises(sp.CheckpointNotFound) as caught:
            call(str(ckpt))
        message = str(caught.value)
        assert str(ckpt) in message
        assert "uncommitted" in message
        assert "a save there replaces" in message
    leftover = {p.name for p in (ckpt / "data").iterdir()}
    sp.save(str(ckpt), {"x": torch.ones(2)})  # as the message says
    wait_for_removals()
    committed = {f["name"].split("/")[1]
                 for f in json.loads((ckpt / "manifest.json").read_bytes())["files"]}
    assert {p.name for p in (ckpt / "data").iterdir()} == committed
    assert not committed & leftover


def test_empty_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(sp.CheckpointNotFound):
        sp.load(str(tmp_path / "empty"))


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a checkpoint directory")
    for call in (sp.load, sp.info, sp.verify):
        with pytest.raises(sp.CheckpointNotFound) as caught:
            call(str(path))
        assert f"{path} is a file, not a checkpoint directory" in str(caught.value)
        assert "sp.import_checkpoint" in str(caught.value)
    # A path under a file names no file: it said the path itself was one.
    with pytest.raises(sp.CheckpointNotFound) as caught:
        sp.load(str(path / "ckpt"))
    assert "a directory on its path is a file" in str(caught.value)
    assert "import" not in str(caught.value)


# -- damaged data ---------------------------------------------------------------------------------


def test_bit_flip_in_a_small_entry(saved: tuple[Path, dict[str, Any]]) -> None:
    ckpt, state = saved
    data, offset, nbytes = chunk_of(ckpt, "small")
    _flip_bit(data, offset + nbytes // 2, bit=3)
    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.load(str(ckpt))
    message = str(caught.value)
    assert str(ckpt) in message
    assert data.name in message
    assert f"byte {offset}" in message
    assert "'small'" in message
    assert "earlier checkpoint" in message and "safepoint verify" in message
    assert caught.value.problems and "'small'" in caught.value.problems[0]

    report = sp.verify(str(ckpt))
    assert not report.ok
    assert len(report.problems) == 1
    assert data.name in report.problems[0] and "'small'" in report.problems[0]

    # What is not damaged still loads: ranged reads check only what they read.
    rest = sp.load(str(ckpt), keys=["big", "arr", "raw", "step"])
    assert_same(rest, {k: v for k, v in state.items() if k != "small"})


def test_bit_flip_in_the_second_block_of_a_large_entry(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    data, offset, nbytes = chunk_of(ckpt, "big")
    assert nbytes > BLOCK
    _flip_bit(data, offset + BLOCK + 12345, bit=7)
    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.load(str(ckpt))
    assert f"byte {offset + BLOCK}" in str(caught.value)
    assert "'big'" in str(caught.value)
    report = sp.verify(str(ckpt))
    assert not report.ok and f"byte {offset + BLOCK}" in report.problems[0]


def test_bit_flip_detected_when_restoring_in_place(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    data, offset, _ = chunk_of(ckpt, "raw")
    _flip_bit(data, offset)
    target = {"big": torch.zeros(6 << 8, 1024), "small": torch.zeros(100),
              "arr": np.zeros(50, dtype=np.int64), "raw": b"", "step": 0}
    with pytest.raises(sp.CorruptCheckpoint, match="'raw'"):
        sp.load(str(ckpt), into=target)
    assert target["raw"] == b"" and target["step"] == 0  # values are replaced only at the end


def test_several_corruptions_are_all_reported(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    for path in ("small", "arr", "raw"):
        data, offset, _ = chunk_of(ckpt, path)
        _flip_bit(data, offset)
    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.load(str(ckpt))
    assert len(caught.value.problems) == 3
    assert "2 more" in str(caught.value)
    report = sp.verify(str(ckpt))
    assert len(report.problems) == 3
    for path in ("small", "arr", "raw"):
        assert any(repr(path) in p for p in report.problems)


def test_truncated_data_file(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    data = _data_file(ckpt)
    size = data.stat().st_size
    os.truncate(data, size // 2)
    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.load(str(ckpt))
    message = str(caught.value)
    assert str(ckpt) in message and data.name in message and "truncated" in message
    assert "earlier checkpoint" in message
    report = sp.verify(str(ckpt))
    assert not report.ok
    assert any(f"{size // 2} bytes" in p and str(size) in p for p in report.problems)
    assert any("truncated" in p for p in report.problems)


def test_truncated_large_data_file_is_one_problem(tmp_path: Path) -> None:
    """A data file cut short: verify says so once (not once per read past the cut) and
    still checks the entries before the cut, finding a flipped bit there."""
    ckpt = tmp_path / "ckpt"
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(40)}  # 160 MiB
    sp.save(str(ckpt), state)
    data, offset, _ = chunk_of(ckpt, "t0")
    os.truncate(data, data.stat().st_size // 4)
    _flip_bit(data, offset + 100)
    report = sp.verify(str(ckpt))
    truncated = [p for p in report.problems if "truncated" in p]
    assert len(truncated) == 1 and data.name in truncated[0], report.problems
    assert any("checksum mismatch in 't0'" in p for p in report.problems), report.problems
    assert len(report.problems) == 2


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink to a fifo"])
def test_a_data_file_that_is_not_a_regular_file(
    saved: tuple[Path, Any], tmp_path: Path, kind: str
) -> None:
    """A FIFO (which would block every read), a directory, or a symlink to either in place of
    a data file: load raises CorruptCheckpoint naming it, verify reports it; neither hangs."""
    ckpt, _ = saved
    data = _data_file(ckpt)
    data.unlink()
    if kind == "directory":
        data.mkdir()
    elif kind == "fifo":
        os.mkfifo(data)
    else:
        os.mkfifo(tmp_path / "elsewhere")
        data.symlink_to(tmp_path / "elsewhere")
    noun = "directory" if kind == "directory" else "FIFO"
    with pytest.raises(sp.CorruptCheckpoint, match=f"{data.name} is a {noun}, not a regular"
                       ) as caught:
        sp.load(str(ckpt))
    assert str(caught.value).count("restore an earlier") == 1, "the advice said twice"
    report = sp.verify(str(ckpt))
    assert not report.ok
    assert report.problems == [f"{data} is a {noun}, not a regular file"], report.problems


def test_a_data_directory_that_is_a_file(saved: tuple[Path, Any]) -> None:
    """`data` a regular file instead of the directory of the data files: load raised a
    StorageError ('Not a directory ... check the path, permissions and free space'), which a
    manager's restore does not fall back past. The data files are missing: CorruptCheckpoint,
    and verify reports them."""
    ckpt, _ = saved
    data = _data_file(ckpt)
    shutil.rmtree(data.parent)
    data.parent.write_bytes(b"not a directory")
    with pytest.raises(sp.CorruptCheckpoint, match=f"{data.name}: data file is missing"):
        sp.load(str(ckpt))
    report = sp.verify(str(ckpt))
    assert not report.ok
    assert any(f"{data.name}" in p and "missing" in p for p in report.problems), report.problems


def test_a_data_file_symlinked_to_a_regular_file_loads(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    """Data files kept as symlinks into a cache (DVC, git-annex) load and verify: the
    checksums guard their bytes."""
    ckpt, state = saved
    data = _data_file(ckpt)
    cached = tmp_path / "cache.bin"
    data.rename(cached)
    data.symlink_to(cached)
    assert_same(sp.load(str(ckpt)), state)
    assert sp.verify(str(ckpt)).ok


def test_data_file_with_extra_bytes_is_reported(saved: tuple[Path, Any]) -> None:
    ckpt, state = saved
    data = _data_file(ckpt)
    with open(data, "ab") as f:
        f.write(b"junk")
    assert_same(sp.load(str(ckpt)), state)  # every byte the manifest records is intact
    report = sp.verify(str(ckpt))
    assert not report.ok and data.name in report.problems[0]


def test_deleted_data_file(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    data = _data_file(ckpt)
    data.unlink()
    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.load(str(ckpt))
    assert data.name in str(caught.value) and "missing" in str(caught.value)
    assert not isinstance(caught.value, sp.CheckpointNotFound)
    report = sp.verify(str(ckpt))
    assert not report.ok
    assert report.problems == [f"data/{data.name}: data file is missing"]  # once, not per read
    # Values that live in the manifest still load.
    assert sp.load(str(ckpt), keys=["step"]) == {"step": 3}


@pytest.mark.parametrize("doing", ["load", "verify"])
@pytest.mark.parametrize("meanwhile", ["removed", "replaced"])
def test_a_checkpoint_removed_or_replaced_while_it_is_read_is_not_called_corrupt(
    saved: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, meanwhile: str,
    doing: str,
) -> None:
    """A reader racing a writer (its retention deleting the step, an overwrite) finds the data
    gone mid-read: that is a checkpoint no longer there, not a damaged one (verify reported
    a whole checkpoint, replaced, as one whose data file is missing)."""
    from safepoint._storage_local import LocalStorage

    ckpt, _ = saved
    stretches = LocalStorage.readinto_stretches

    def racing(self: LocalStorage, *args: Any) -> Iterator[int]:
        monkeypatch.setattr(LocalStorage, "readinto_stretches", stretches)  # once
        if meanwhile == "removed":
            shutil.rmtree(ckpt)
        else:
            sp.save(str(ckpt), {"other": torch.ones(3)}, overwrite=True)
            from safepoint._commit import wait_for_removals

            wait_for_removals()  # the replaced data is gone
        yield from stretches(self, *args)

    monkeypatch.setattr(LocalStorage, "readinto_stretches", racing)
    if (meanwhile, doing) == ("replaced", "load"):  # a load alone reads the new one
        assert torch.equal(sp.load(str(ckpt))["other"], torch.ones(3))
        return
    with pytest.raises(sp.CheckpointNotFound) as caught:
        sp.load(str(ckpt)) if doing == "load" else sp.verify(str(ckpt))
    message = str(caught.value)
    assert f"{ckpt} was {meanwhile} while it was being read to {doing} it" in message
    assert f"{doing} it again" in message and "data file is missing" in message
    assert not isinstance(caught.value, sp.CorruptCheckpoint)


# -- damaged manifest -----------------------------------------------------------------------------


def _expect_corrupt_manifest(ckpt: Path, *fragments: str) -> None:
    for call in (sp.load, sp.info):
        with pytest.raises(sp.CorruptCheckpoint) as caught:
            call(str(ckpt))
        message = str(caught.value)
        assert str(ckpt) in message
        assert "manifest.json" in message
        for fragment in fragments:
            assert fragment in message
        assert "earlier one" in message  # what to do next
    report = sp.verify(str(ckpt))
    assert not report.ok and report.problems


@pytest.mark.parametrize(
    "content", [b"", b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b"null",
                b'{"format": "safepoint"'],
)
def test_manifest_that_does_not_parse(saved: tuple[Path, Any], content: bytes) -> None:
    ckpt, _ = saved
    (ckpt / "manifest.json").write_bytes(content)
    _expect_corrupt_manifest(ckpt)


@pytest.mark.parametrize("value", ["pytorch", "", None, 1])
def test_manifest_of_another_format(saved: tuple[Path, Any], value: Any) -> None:
    ckpt, _ = saved
    edit_manifest(ckpt, lambda doc: doc.__setitem__("format", value))
    _expect_corrupt_manifest(ckpt, "format")


def test_manifest_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "manifest.json").mkdir(parents=True)
    with pytest.raises(sp.CorruptCheckpoint, match="directory"):
        sp.load(str(tmp_path / "ckpt"))


@pytest.mark.parametrize(
    "name",
    ["../outside.bin", "data/../../outside.bin", "/etc/passwd", "../../etc/passwd",
     "data/../manifest.json", "data/./x/../../../outside.bin", "data\\..\\..\\outside.bin",
     "manifest.json", "outside.bin", "data", "data/", ""],
)
def test_path_traversal_in_the_manifest_is_refused(saved: tuple[Path, Any], name: str) -> None:
    """A manifest pointing outside its checkpoint is refused before anything is read. The
    outside file holds the real data, so following the name would make the load succeed."""
    ckpt, _ = saved
    data = _data_file(ckpt)
    shutil.copy(data, ckpt.parent / "outside.bin")

    def change(doc: dict[str, Any]) -> None:
        doc["files"][0]["name"] = name

    edit_manifest(ckpt, change)
    _expect_corrupt_manifest(ckpt, "files[0]")


def test_absolute_path_to_a_real_copy_is_refused(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    outside = ckpt.parent / "outside.bin"
    shutil.copy(_data_file(ckpt), outside)
    edit_manifest(ckpt, lambda doc: doc["files"][0].__setitem__("name", str(outside)))
    _expect_corrupt_manifest(ckpt, "outside the checkpoint")


def test_chunk_beyond_the_end_of_its_file(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    data = _data_file(ckpt)

    def change(doc: dict[str, Any]) -> None:
        doc["chunks"]["offset"][-1] = doc["files"][0]["nbytes"] + 64

    edit_manifest(ckpt, change)
    _expect_corrupt_manifest(ckpt, "beyond the end", data.name)


def test_file_shorter_than_its_manifest_says(saved: tuple[Path, Any]) -> None:
    """The manifest claims a bigger file and a chunk in the part that is not there."""
    ckpt, _ = saved
    size = _data_file(ckpt).stat().st_size

    def change(doc: dict[str, Any]) -> None:
        doc["files"][0]["nbytes"] = size + 4096
        doc["chunks"]["offset"][-1] = size + 64

    edit_manifest(ckpt, change)
    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.load(str(ckpt))
    assert "truncated" in str(caught.value)
    assert not sp.verify(str(ckpt)).ok


MANIFEST_EDITS = {
    "negative_offset": lambda d: d["chunks"]["offset"].__setitem__(0, -1),
    "file_index": lambda d: d["chunks"]["file"].__setitem__(0, 5),
    "entry_index": lambda d: d["chunks"]["entry"].__setitem__(0, 99),
    "digest_count": lambda d: d["chunks"]["digests"].__setitem__(0, []),
    "column_length": lambda d: d["entries"]["kind"].pop(),
    # (a dtype or kind that is a string this safepoint does not know is a newer writer's:
    # FormatVersionError, see test_format)
    "dtype_not_str": lambda d: d["entries"]["dtype"].__setitem__(0, 128),
    "kind_not_str": lambda d: d["entries"]["kind"].__setitem__(0, None),
    "shape_vs_bytes": lambda d: d["entries"]["shape"].__setitem__(0, [7]),
    "tree_mismatch": lambda d: d.__setitem__("tree", {"dict": []}),
    "duplicate_file": lambda d: d["files"].append(dict(d["files"][0])),
    "no_checksum": lambda d: d.pop("checksum"),
    "zero_block": lambda d: d["checksum"].__setitem__("block_bytes", 0),
    "version_type": lambda d: d.__setitem__("version", "1"),
    # found by a review's fuzzing:
    "version_zero": lambda d: d.__setitem__("version", 0),
    "version_negative": lambda d: d.__setitem__("version", -1),
    "value_list": lambda d: d["entries"]["value"].__setitem__(
        d["entries"]["path"].index("step"), [1, {"a": 2}]),
    "rank_twice": lambda d: d.__setitem__("tree", {"dict": [
        ["big", "big"], ["small", "small"], ["arr", "arr"],
        ["x", {"per_rank": [[0, "raw"], [0, "step"]]}]]}),
    "lone_surrogate": lambda d: d["files"][0].__setitem__("name", "data/\ud800.bin"),
}


@pytest.mark.parametrize("case", list(MANIFEST_EDITS))
def test_inconsistent_manifest(saved: tuple[Path, Any], case: str) -> None:
    ckpt, _ = saved
    edit_manifest(ckpt, MANIFEST_EDITS[case])
    _expect_corrupt_manifest(ckpt)


def test_a_bytes_entry_claiming_terabytes_is_refused_not_allocated(
    saved: tuple[Path, Any],
) -> None:
    """A crafted manifest whose bytes entry (and file) claim 32 TiB: a SafepointError naming
    the entry, not a raw MemoryError (found by a review)."""
    ckpt, _ = saved

    def change(doc: dict[str, Any]) -> None:
        row = doc["entries"]["path"].index("raw")
        chunk = doc["chunks"]["entry"].index(row)
        huge = 1 << 45
        doc["files"][0]["nbytes"] = doc["chunks"]["offset"][chunk] + huge
        doc["chunks"]["nbytes"][chunk] = huge
        doc["chunks"]["digests"][chunk] = [0] * (huge // doc["checksum"]["block_bytes"])

    edit_manifest(ckpt, change)
    with pytest.raises(sp.SafepointError, match=r"cannot allocate 35184372088832 bytes for "
                       r"'raw' \(bytes\).*safepoint verify"):
        sp.load(str(ckpt))


def test_sharded_pieces_naming_the_same_bytes_fill_both(saved: tuple[Path, Any]) -> None:
    """A crafted sharded entry whose two disjoint pieces point at the same bytes: each piece
    is filled (a review found the second piece's landing replacing the first's, which left
    rows of uninitialised memory in the result, silently)."""
    ckpt, state = saved

    def change(doc: dict[str, Any]) -> None:
        row = doc["entries"]["path"].index("small")
        chunk = doc["chunks"]["entry"].index(row)
        doc["entries"]["kind"][row] = "sharded"
        doc["entries"]["shape"][row] = [200]
        for column in ("entry", "file", "offset", "nbytes", "digests"):
            doc["chunks"][column].insert(chunk, doc["chunks"][column][chunk])
        count = len(doc["chunks"]["entry"])
        doc["chunks"]["offsets"] = [None] * count
        doc["chunks"]["shape"] = [None] * count
        doc["chunks"]["offsets"][chunk: chunk + 2] = [[0], [100]]
        doc["chunks"]["shape"][chunk: chunk + 2] = [[100], [100]]

    edit_manifest(ckpt, change)
    expected = state["small"].repeat(2)
    assert torch.equal(sp.load(str(ckpt))["small"], expected)
    into = {**state, "small": torch.full((200,), -1.0), "raw": b""}
    sp.load(str(ckpt), into=into)
    assert torch.equal(into["small"], expected)


class _Pair(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(3, 3, bias=False)
        self.head = torch.nn.Linear(3, 3, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_a_target_that_ties_weights_saved_apart_is_no_reason_to_fall_back(tmp_path: Path) -> None:
    """An intact step whose weights were saved apart, restored into a model that ties them,
    is a StateMismatch from the manager's restore: it is not reported corrupt, and the
    manager does not fall back to an older step (step 1, saved tied, would have loaded)."""
    root = str(tmp_path / "run")
    torch.manual_seed(0)
    with sp.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"m": _Pair(tie=True), "step": 1})
        mgr.save(2, {"m": _Pair(tie=False), "step": 2})
    target = _Pair(tie=True)
    before = target.emb.weight.detach().clone()
    state = {"m": target, "step": 0}
    with sp.CheckpointManager(root) as mgr, pytest.raises(
            sp.StateMismatch, match=r"step-2 stores 'm/emb.weight' and 'm/head.weight' apart"):
        mgr.restore(state)
    assert state["step"] == 0 and torch.equal(target.emb.weight, before)
    assert sp.verify(f"{root}/step-2").ok


def test_unknown_checksum_algorithm(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    edit_manifest(ckpt, lambda d: d["checksum"].__setitem__("algorithm", "md5000"))
    with pytest.raises(sp.FormatVersionError, match="md5000") as caught:
        sp.load(str(ckpt))
    assert "upgrade safepoint" in str(caught.value)


def test_newer_format_version(saved: tuple[Path, Any]) -> None:
    ckpt, _ = saved
    edit_manifest(ckpt, lambda doc: doc.__setitem__("version", 99))
    for call in (sp.load, sp.info):
        with pytest.raises(sp.FormatVersionError) as caught:
            call(str(ckpt))
        message = str(caught.value)
        assert str(ckpt) in message and "99" in message
        assert "upgrade safepoint" in message
        assert isinstance(caught.value, sp.SafepointError)
        assert not isinstance(caught.value, sp.CorruptCheckpoint)


# -- pickle safety --------------------------------------------------------------------------------


class Booby:
    """Unpickling it creates a marker file: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture
def booby_trapped(tmp_path: Path) -> tuple[Path, Path]:
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "MARKER"
    state = {"weights": torch.arange(5.0), "extra": {"obj": sp.Pickled(Booby(marker))},
             "step": 1}
    sp.save(str(ckpt), state)
    assert not marker.exists()
    return ckpt, marker


def test_pickled_entry_refused_by_default(booby_trapped: tuple[Path, Path]) -> None:
    ckpt, marker = booby_trapped
    with pytest.raises(sp.PickleNotAllowed) as caught:
        sp.load(str(ckpt))
    message = str(caught.value)
    assert str(ckpt) in message and "extra/obj" in message
    assert "allow_pickle=True (--allow-pickle)" in message and "keys= (--keys)" in message
    assert caught.value.paths == ["extra/obj"]
    assert not marker.exists()


def test_pickled_entry_refused_when_restoring_in_place(booby_trapped: tuple[Path, Path]) -> None:
    ckpt, marker = booby_trapped
    target = {"weights": torch.zeros(5), "extra": {"obj": None}, "step": 0}
    with pytest.raises(sp.PickleNotAllowed):
        sp.load(str(ckpt), into=target)
    assert not marker.exists()
    assert torch.equal(target["weights"], torch.zeros(5)) and target["step"] == 0
    with pytest.raises(sp.PickleNotAllowed):
        sp.load(str(ckpt), into=target, strict=False)
    assert not marker.exists()


def test_keys_can_leave_the_pickled_entry_out(booby_trapped: tuple[Path, Path]) -> None:
    ckpt, marker = booby_trapped
    loaded = sp.load(str(ckpt), keys=["weights", "step"])
    assert_same(loaded, {"weights": torch.arange(5.0), "step": 1})
    target = {"weights": torch.zeros(5), "step": 0}
    sp.load(str(ckpt), into=target, keys=["weights", "step"])
    assert torch.equal(target["weights"], torch.arange(5.0))
    assert not marker.exists()


def test_info_and_verify_never_unpickle(booby_trapped: tuple[Path, Path]) -> None:
    ckpt, marker = booby_trapped
    info = sp.info(str(ckpt))
    assert {e.path: e.kind for e in info.entries}["extra/obj"] == "pickle"
    assert sp.verify(str(ckpt)).ok
    assert not marker.exists()


def test_allow_pickle_runs_the_pickle(booby_trapped: tuple[Path, Path]) -> None:
    ckpt, marker = booby_trapped
    loaded = sp.load(str(ckpt), allow_pickle=True)
    assert marker.exists()
    assert loaded["extra"] == {"obj": None}  # Path.touch returns None
    assert torch.equal(loaded["weights"], torch.arange(5.0))


def test_corrupt_pickle_is_caught_by_its_checksum(booby_trapped: tuple[Path, Path]) -> None:
    ckpt, marker = booby_trapped
    data, offset, _ = chunk_of(ckpt, "extra/obj")
    _flip_bit(data, offset + 2)
    with pytest.raises(sp.CorruptCheckpoint, match="extra/obj"):
        sp.load(str(ckpt), allow_pickle=True)
    assert not marker.exists()


def test_manifest_cannot_smuggle_a_pickle_as_bytes(booby_trapped: tuple[Path, Path]) -> None:
    """Retagging a pickle entry as bytes hands back the raw bytes, never an object."""
    ckpt, marker = booby_trapped

    def change(doc: dict[str, Any]) -> None:
        kinds = doc["entries"]["kind"]
        kinds[kinds.index("pickle")] = "bytes"

    edit_manifest(ckpt, change)
    loaded = sp.load(str(ckpt))
    assert isinstance(loaded["extra"]["obj"], bytes)
    assert not marker.exists()


def test_manifest_values_are_json_only(saved: tuple[Path, Any]) -> None:
    """A value entry in the manifest is plain JSON: a crafted dict is refused, not decoded."""
    ckpt, _ = saved

    def change(doc: dict[str, Any]) -> None:
        index = doc["entries"]["path"].index("step")
        doc["entries"]["value"][index] = {"py/object": "os.system"}

    edit_manifest(ckpt, change)
    with pytest.raises(sp.CorruptCheckpoint):
        sp.load(str(ckpt))


def test_storage_error_for_an_unwritable_target(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    url = str(blocker / "ckpt")  # a path below a regular file cannot be created
    with pytest.raises(sp.StorageError) as caught:
        sp.save(url, {"w": torch.zeros(3)})
    assert isinstance(caught.value, OSError)
    assert str(blocker) in str(caught.value) and "retry" in str(caught.value)
    assert caught.value.__cause__ is not None


_REFUSED_WRITES = r"""
import resource, signal, sys
import torch
import safepoint as sp

root = sys.argv[1]
sp.save(root + "/a", {"w": torch.arange(1 << 18, dtype=torch.float32)})  # 1 MiB
with sp.CheckpointManager(root + "/m") as manager:
    manager.save(1, {"w": torch.zeros(1000)})
    manager.wait()
    # From here the kernel refuses to grow any file past 2 MiB, as a full disk refuses writes.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    big = {"w": torch.ones(2 << 20)}  # 8 MiB
    for call in (lambda: sp.save(root + "/a", big, overwrite=True),
                 lambda: sp.save(root + "/b", big),
                 lambda: (manager.save(2, big), manager.wait())):
        try:
            call()
        except sp.StorageError as exc:
            print("refused:", exc, flush=True)
"""


def test_a_write_the_os_refuses_leaves_every_committed_checkpoint_as_it_was(
    tmp_path: Path,
) -> None:
    """A real refusal by the kernel mid-save (a file-size limit stands in for a full disk):
    each save fails with a StorageError naming the file, the checkpoint it would have replaced
    still loads, and nothing half-written lists, loads or stays behind."""
    done = subprocess.run([sys.executable, "-c", _REFUSED_WRITES, str(tmp_path)],
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    refusals = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 3, done.stdout
    for refusal, where in zip(refusals, ("a/data/", "b/data/", "m/step-2/data/"), strict=True):
        assert str(tmp_path / where) in refusal and "File too large" in refusal, refusal
        assert "free space" in refusal
    assert_same(sp.load(str(tmp_path / "a")), {"w": torch.arange(1 << 18, dtype=torch.float32)})
    assert sp.verify(str(tmp_path / "a")).ok
    assert len(os.listdir(tmp_path / "a" / "data")) == 1  # the failed save's file is removed
    with pytest.raises(sp.CheckpointNotFound):
        sp.load(str(tmp_path / "b"))
    assert not any(path.is_file() for path in (tmp_path / "b").rglob("*"))
    manager = sp.CheckpointManager(str(tmp_path / "m"))
    assert manager.steps() == [1] and manager.latest_step() == 1
    assert not any(path.is_file() for path in (tmp_path / "m" / "step-2").rglob("*"))
    assert_same(sp.load(str(tmp_path / "m" / "step-1")), {"w": torch.zeros(1000)})


def test_unknown_url_scheme(tmp_path: Path) -> None:
    with pytest.raises(sp.SafepointError, match="nosuchscheme"):
        sp.save("nosuchscheme://bucket/x", {"w": 1})
    with pytest.raises(sp.SafepointError, match="nosuchscheme"):
        sp.load("nosuchscheme://bucket/x")


def test_manifest_document_is_what_edit_manifest_expects(saved: tuple[Path, Any]) -> None:
    """Guard for the surgery above: the manifest is columnar as `_format.encode` writes it."""
    ckpt, _ = saved
    doc = json.loads((ckpt / "manifest.json").read_text())
    assert set(doc["entries"]) >= {"path", "kind", "dtype", "shape", "value"}
    assert set(doc["chunks"]) >= {"entry", "file", "offset", "nbytes", "digests"}
    assert [f["name"].startswith("data/") for f in doc["files"]] == [True]
