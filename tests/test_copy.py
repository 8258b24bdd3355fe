"""sp.copy: one checkpoint or a whole root between URLs (local, memory, s3 on moto), checksums
verified on the way, the manifest published last, nothing published from a corrupt source,
reruns skip what is there."""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import safepoint as sp
from _capped import run_capped
from _states import edit_manifest
from safepoint._checksum import checksum_function
from safepoint._commit import read_manifest, wait_for_removals
from safepoint._copy import _PIECE_BYTES, _pieces, copy_files
from safepoint._format import encode
from safepoint._storage_fsspec import FsspecStorage
from safepoint.storage import open_storage
from safepoint.testing import FaultyStorage, MemoryBackend, MemoryStorage


def _state(seed: int, big: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    state: dict[str, Any] = {"w": rng.standard_normal(1000), "step": seed,
                             "many": [rng.integers(0, 100, i + 1) for i in range(50)]}
    if big:
        state["big"] = rng.standard_normal((_PIECE_BYTES * 2 + 12345) // 8)  # three pieces
    return state


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "many":
            assert all(np.array_equal(x, y) for x, y in zip(a[key], b[key], strict=True))
        elif isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key])
        else:
            assert a[key] == b[key]


def test_copy_one_checkpoint(tmp_path: Path, memory_backend: MemoryBackend) -> None:
    src = str(tmp_path / "ckpt")
    saved = sp.save(src, _state(1, big=True), metadata={"loss": 1.5})
    seen: list[tuple[int, int]] = []
    report = sp.copy(src, "mem-test://copy", progress=lambda done, total: seen.append(
        (done, total)))
    assert report.copied == [""]
    assert report.nbytes == saved.nbytes
    assert seen[0] == (0, saved.nbytes) and seen[-1] == (saved.nbytes, saved.nbytes)
    assert len(seen) >= 4, "progress while the big file is copied"
    info = sp.info("mem-test://copy")
    assert (info.save_id, info.metadata) == (saved.save_id, {"loss": 1.5})
    _same(sp.load("mem-test://copy"), _state(1, big=True))
    assert sp.verify("mem-test://copy").ok


def test_copy_a_root_skips_what_is_there(tmp_path: Path, memory_backend: MemoryBackend) -> None:
    root = tmp_path / "run"
    for step in (1, 2):
        sp.save(str(root / f"step_{step}"), _state(step))
    sp.save(str(root / "step_3"), _state(3))
    (root / "step_3" / "manifest.json").unlink()  # uncommitted: not copied
    report = sp.copy(str(root), "mem-test://run")
    assert report.copied == ["step_1", "step_2"]
    assert sorted({p.split("/")[1] for p in memory_backend.files()}) == ["step_1", "step_2"]
    sp.save(str(root / "step_4"), _state(4))
    again = sp.copy(str(root), "mem-test://run")
    assert (again.copied, again.skipped) == (["step_4"], ["step_1", "step_2"])
    _same(sp.load("mem-test://run/step_4"), _state(4))



def test_copy_a_root_takes_a_link_to_a_checkpoint_as_that_checkpoint(
    tmp_path: Path, memory_backend: MemoryBackend
) -> None:
    """A link under a local root leading to one of its checkpoints (Lightning's last.ckpt with
    save_last="link") is copied as the checkpoint it leads to, under its own name: an object
    store has no links (it was left out, and a run resumed from the copy found no last
    checkpoint). Copied again, it is skipped like the others."""
    root = tmp_path / "run"
    sp.save(str(root / "epoch=1.ckpt"), _state(1))
    (root / "last.ckpt").symlink_to("epoch=1.ckpt")
    report = sp.copy(str(root), "mem-test://run")
    assert report.copied == ["epoch=1.ckpt", "last.ckpt"]
    _same(sp.load("mem-test://run/last.ckpt"), _state(1))
    again = sp.copy(str(root), "mem-test://run")
    assert (again.copied, again.skipped) == ([], ["epoch=1.ckpt", "last.ckpt"])


def test_copying_a_root_again_after_its_link_moved_copies_what_it_leads_to_now(
    tmp_path: Path
) -> None:
    """Lightning moves last.ckpt every epoch: the next copy of the root replaces the link's
    copy with what it leads to now (it refused the whole copy: another checkpoint there)."""
    root, dst = tmp_path / "run", str(tmp_path / "copy")
    sp.save(str(root / "epoch=1.ckpt"), _state(1))
    (root / "last.ckpt").symlink_to("epoch=1.ckpt")
    sp.copy(str(root), dst)
    sp.save(str(root / "epoch=2.ckpt"), _state(2))
    (root / "last.ckpt").unlink()
    (root / "last.ckpt").symlink_to("epoch=2.ckpt")
    report = sp.copy(str(root), dst)
    assert (report.copied, report.skipped) == (["epoch=2.ckpt", "last.ckpt"], ["epoch=1.ckpt"])
    _same(sp.load(f"{dst}/last.ckpt"), _state(2))


def test_a_link_named_like_a_step_is_no_step_of_the_copy(tmp_path: Path) -> None:
    """A link in a manager root named like a step (step-9 -> step-1), which the manager
    ignores, is not copied: it became a step 9 holding step 1's state."""
    root, dst = str(tmp_path / "run"), str(tmp_path / "copy")
    with sp.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    (tmp_path / "run" / "step-9").symlink_to("step-1")
    assert sp.copy(root, dst).copied == ["step-1", "step-2"]
    with sp.CheckpointManager(dst) as copied:
        assert copied.steps() == [1, 2]


def test_a_link_copied_never_replaces_a_checkpoint_the_copy_did_not_make(
    tmp_path: Path
) -> None:
    """A link's copy replaces only an earlier copy of a link (a save the source or the
    destination holds under another name): a checkpoint saved at the destination under the
    link's name is refused as any other checkpoint there (it was replaced silently)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    sp.save(str(src / "epoch=3.ckpt"), _state(3))
    (src / "last.ckpt").symlink_to("epoch=3.ckpt")
    sp.save(str(dst / "last.ckpt"), _state(9))
    with pytest.raises(sp.CheckpointExists, match=r"last\.ckpt"):
        sp.copy(str(src), str(dst))
    _same(sp.load(str(dst / "last.ckpt")), _state(9))


def test_a_copy_never_writes_through_a_link_at_the_destination(tmp_path: Path) -> None:
    """Copying a Lightning root into another whose last.ckpt is a link: refused before
    anything is written (the copy of the source's link followed the destination's and
    replaced the checkpoint it leads to, which the copy never named)."""
    a, b = tmp_path / "a", tmp_path / "b"
    sp.save(str(a / "epoch=3.ckpt"), _state(3))
    (a / "last.ckpt").symlink_to("epoch=3.ckpt")
    sp.save(str(b / "epoch=7.ckpt"), _state(7))
    (b / "last.ckpt").symlink_to("epoch=7.ckpt")
    with pytest.raises(sp.CheckpointExists, match=r"lies through the link"):
        sp.copy(str(a), str(b), overwrite=True)
    _same(sp.load(str(b / "epoch=7.ckpt")), _state(7))
    assert not (b / "epoch=3.ckpt").exists()


def test_a_root_with_a_link_copied_into_itself_writes_nothing(tmp_path: Path) -> None:
    """A Lightning root copied onto itself: every checkpoint, the link's too, is there
    already (the link was refused as a link at the destination)."""
    root = tmp_path / "run"
    sp.save(str(root / "epoch=3.ckpt"), _state(3))
    (root / "last.ckpt").symlink_to("epoch=3.ckpt")
    report = sp.copy(str(root), str(root))
    assert (report.copied, report.skipped) == ([], ["epoch=3.ckpt", "last.ckpt"])


def test_a_link_copy_is_replaced_after_its_save_left_the_source(tmp_path: Path) -> None:
    """save_top_k=1: the save the link's copy holds is gone from the source but still at the
    destination under its own name, so the copy of the link is an earlier copy: replaced
    (the whole copy was refused)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    sp.save(str(src / "epoch=1.ckpt"), _state(1))
    (src / "last.ckpt").symlink_to("epoch=1.ckpt")
    sp.copy(str(src), str(dst))
    shutil.rmtree(src / "epoch=1.ckpt")
    (src / "last.ckpt").unlink()
    sp.save(str(src / "epoch=2.ckpt"), _state(2))
    (src / "last.ckpt").symlink_to("epoch=2.ckpt")
    sp.copy(str(src), str(dst))
    _same(sp.load(str(dst / "last.ckpt")), _state(2))
    _same(sp.load(str(dst / "epoch=1.ckpt")), _state(1))


@pytest.mark.parametrize("where", ["the destination", "a directory on the way"])
def test_a_copy_never_writes_through_a_link_on_the_way(tmp_path: Path, where: str) -> None:
    """A destination that is a link, or lies under a linked directory, is refused before
    anything is written, with overwrite too (the copy replaced what the link leads to)."""
    src, other = tmp_path / "src", tmp_path / "other"
    sp.save(str(other / "step-1"), _state(99))
    if where == "the destination":
        sp.save(str(src / "epoch=3.ckpt"), _state(3))
        (tmp_path / "last.ckpt").symlink_to(other / "step-1")
        args = (str(src / "epoch=3.ckpt"), str(tmp_path / "last.ckpt"))
    else:
        sp.save(str(src / "run1" / "step-1"), _state(1))
        (tmp_path / "dst").mkdir()
        (tmp_path / "dst" / "run1").symlink_to(other)
        args = (str(src), str(tmp_path / "dst"))
    with pytest.raises(sp.CheckpointExists, match="lies through the link"):
        sp.copy(*args, overwrite=True)
    _same(sp.load(str(other / "step-1")), _state(99))

def test_two_copies_of_one_checkpoint_to_one_place_at_once_both_succeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An overlapping backup run: the other copy commits while this one writes a data file,
    and removes this one's temporary file as a leftover. This copy raised a raw
    FileNotFoundError (or CheckpointExists); the checkpoint is there, whole: it is skipped."""
    import os

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    sp.save(src, {"w": np.arange(1 << 16), "n": 3})
    real_fsync, others = os.fsync, []

    def the_other_copy_commits(fd: int) -> None:
        real_fsync(fd)
        if not others and ".bin.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            others.append(None)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # another process's copy
                others[0] = pool.submit(sp.copy, src, dst).result()

    monkeypatch.setattr(os, "fsync", the_other_copy_commits)
    report = sp.copy(src, dst)
    assert others[0].copied == [""] and report.copied == [] and report.skipped == [""]
    assert sp.verify(dst).ok
    assert sorted(p.name for p in (tmp_path / "dst" / "data").iterdir()) == sorted(
        p.name for p in (tmp_path / "src" / "data").iterdir())


def test_copy_refuses_another_checkpoint_unless_overwrite(
    tmp_path: Path, memory_backend: MemoryBackend
) -> None:
    src = str(tmp_path / "a")
    sp.save(src, _state(1))
    sp.save("mem-test://b", _state(2))
    with pytest.raises(sp.CheckpointExists, match="mem-test://b"):
        sp.copy(src, "mem-test://b")
    with pytest.raises(sp.SafepointError, match="overwrite='False' for mem-test://b: pass"):
        sp.copy(src, "mem-test://b", overwrite="False")  # type: ignore[arg-type]  # true
    _same(sp.load("mem-test://b"), _state(2))
    sp.copy(src, "mem-test://b", overwrite=True)
    _same(sp.load("mem-test://b"), _state(1))
    data = [p for p in memory_backend.files() if p.startswith("b/data/")]
    assert len(data) == 1, "the replaced checkpoint's data is removed"


def test_copy_of_a_corrupt_source_publishes_nothing(
    tmp_path: Path, memory_backend: MemoryBackend
) -> None:
    src = tmp_path / "a"
    sp.save(str(src), _state(1, big=True))
    (data,) = (src / "data").glob("*.bin")
    raw = bytearray(data.read_bytes())
    raw[_PIECE_BYTES + 100] ^= 1  # in the second piece: the first was already written
    data.write_bytes(bytes(raw))
    with pytest.raises(sp.CorruptCheckpoint, match="checksum mismatch"):
        sp.copy(str(src), "mem-test://b")
    assert memory_backend.files() == {}


def test_copy_nothing_committed(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(sp.CheckpointNotFound):
        sp.copy(str(tmp_path / "empty"), str(tmp_path / "dst"))


@pytest.mark.filterwarnings("ignore:datetime.datetime.utcnow:DeprecationWarning")
def test_copy_to_s3_and_back(tmp_path: Path, s3_server: Any, s3_url: str) -> None:
    src = str(tmp_path / "a")
    sp.save(src, _state(5, big=True))
    options = s3_server.storage_options
    sp.copy(src, s3_url, dst_storage_options=options)
    assert sp.verify(s3_url, storage_options=options).ok
    sp.copy(s3_url, str(tmp_path / "b"), storage_options=options, dst_storage_options={})
    _same(sp.load(str(tmp_path / "b")), _state(5, big=True))


def test_a_copy_whose_publish_fails_after_committing_keeps_its_data(
    tmp_path: Path, late_scheme: str
) -> None:
    """The copy raises, but the manifest it committed stays whole: its data files are not
    removed (they were, leaving a committed manifest without its data)."""
    src = str(tmp_path / "src")
    sp.save(src, {"w": np.arange(1000.0), "step": 3})
    with pytest.raises(sp.StorageError, match="after the rename"):
        sp.copy(src, f"{late_scheme}{tmp_path / 'dst'}")
    assert sp.verify(str(tmp_path / "dst")).ok
    assert sp.load(str(tmp_path / "dst"))["step"] == 3


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_an_overwrite_copy_never_rewrites_a_file_the_destination_committed(
    tmp_path: Path,
) -> None:
    """An incremental root copied, then step 2 saved again at the source (sharing step 1's
    file, which the copied step 2 holds too) and that shared file damaged at the source: the
    overwrite copy leaves the destination's own copy of it alone, so whatever the copy does,
    the destination's steps verify (the failed copy used to rewrite, then remove it: a
    committed step without its data; found by a review)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    frozen = np.random.default_rng(0).standard_normal(3 << 20)

    def state(x: float) -> dict[str, Any]:
        return {"frozen": frozen, "w": np.full(1 << 18, x)}

    with sp.CheckpointManager(str(src), incremental=True, async_save=False,
                              keep_last=None) as mgr:
        mgr.save(1, state(1.0))
        mgr.save(2, state(2.0))
    sp.copy(str(src), str(dst))
    with sp.CheckpointManager(str(src), incremental=True, async_save=False,
                              keep_last=None) as mgr:
        assert mgr.restore(state(0.0)) == 2
        mgr.save(2, state(3.0))
    shared = sorted({p.name for p in (src / "step-1" / "data").iterdir()}
                    & {p.name for p in (src / "step-2" / "data").iterdir()})
    assert shared and (dst / "step-2" / "data" / shared[0]).exists()
    _flip_byte(src / "step-1" / "data" / shared[0], 100)
    with contextlib.suppress(sp.CorruptCheckpoint):  # the source's own copy is damaged
        sp.copy(str(src), str(dst), overwrite=True)
    for step in (1, 2):
        assert sp.verify(str(dst / f"step-{step}")).ok


def test_a_copy_removes_leftovers_at_the_destination_once_committed(tmp_path: Path) -> None:
    """A save or copy killed at the destination left data files; the copy that commits
    there removes them, as a save does (it kept them for good; found by a review)."""
    sp.save(str(tmp_path / "src"), _state(1))
    leftover = tmp_path / "dst" / "data" / f"{'ab' * 16}-r00000-0000.bin"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a file")
    sp.copy(str(tmp_path / "src"), str(tmp_path / "dst"))
    wait_for_removals()
    assert not leftover.exists() and sp.verify(str(tmp_path / "dst")).ok


def test_copy_with_overwrite_replaces_a_destination_whose_manifest_is_damaged(
    s3_server: Any, s3_url: str, tmp_path: Path
) -> None:
    """A user copies a good checkpoint onto s3://.../b, whose manifest.json is damaged (does
    not parse), with overwrite=True (`safepoint cp --overwrite`).

    The damaged checkpoint is replaced. The copy used to raise CheckpointExists ("pass
    overwrite=True", which was passed) and leave its data files behind.
    """
    options = s3_server.storage_options
    src, dst = str(tmp_path / "a"), f"{s3_url}/b"
    saved = sp.save(src, _state(1))
    sp.save(dst, _state(2), storage_options=options)
    FsspecStorage(dst, options).publish("manifest.json", b"{not json", overwrite=True)

    report = sp.copy(src, dst, overwrite=True, dst_storage_options=options)

    assert report.copied == [""]
    assert sp.info(dst, storage_options=options).save_id == saved.save_id
    assert sp.verify(dst, storage_options=options).ok


@pytest.mark.parametrize("to", ["local", "s3"])
def test_copy_of_an_s3_checkpoint_missing_a_data_file_raises_corrupt_checkpoint(
    s3_server: Any, s3_url: str, tmp_path: Path, to: str
) -> None:
    """A data object of a committed checkpoint on S3 is gone (a lifecycle rule, a stray
    `aws s3 rm`). The user copies the checkpoint to a local disk or to another prefix.

    CorruptCheckpoint naming the source, as sp.load and sp.verify say ("data file is
    missing"), and nothing committed at the destination. A bare FileNotFoundError used to
    escape to a local destination, and to S3 a StorageError blamed the destination's bucket.
    """
    options = s3_server.storage_options
    src = f"{s3_url}/src"
    sp.save(src, _state(1), storage_options=options)
    storage = FsspecStorage(src, options)
    storage.delete([name for name in storage.list("data")])
    dst, dst_options = ((str(tmp_path / "dst"), None) if to == "local"
                        else (f"{s3_url}/dst", options))

    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.copy(src, dst, storage_options=options, dst_storage_options=dst_options)
    assert "create the bucket" not in str(caught.value)
    assert f"{src}/data/" in str(caught.value) and "is missing" in str(caught.value)
    with pytest.raises(sp.CheckpointNotFound):
        sp.info(dst, storage_options=dst_options)


def test_a_copy_publishes_the_manifest_byte_for_byte(tmp_path: Path) -> None:
    """A newer writer's manifest (a field this reader does not know) reaches the copy as it
    is: a copy re-encoded the parsed manifest, dropping what it did not know, so the newer
    reader of the copy lost it."""
    src = tmp_path / "ckpt"
    sp.save(str(src), _state(3))
    edit_manifest(src, lambda document: document.update(writer_note="a newer writer's"))
    original = (src / "manifest.json").read_bytes()
    assert sp.verify(str(src)).ok
    sp.copy(str(src), str(tmp_path / "copy"))
    assert (tmp_path / "copy" / "manifest.json").read_bytes() == original


@pytest.mark.parametrize("blocks, size", [
    ([(0, 100, 1)], 3 * _PIECE_BYTES + 7),  # a block, then bytes no block covers
    ([(0, 100, 1), (3 * _PIECE_BYTES, 100, 2)], 3 * _PIECE_BYTES + 100),  # a gap
    ([(_PIECE_BYTES * 5 // 2, _PIECE_BYTES, 1)], 4 * _PIECE_BYTES),  # before, over, after
    ([(n * (1 << 20), 1 << 20, n) for n in range(40)], 40 << 20),  # blocks end to end
    # Blocks that overlap (two chunks over the same bytes): the second one's end moved the
    # cut back inside the first, which was then checked against a part of its bytes.
    ([(0, 2 * _PIECE_BYTES, 1), (_PIECE_BYTES // 2, 100, 2)], 3 * _PIECE_BYTES),
    # A block starting a piece or more after its piece's start, inside bytes the one before
    # it reaches: it went into the next piece, which starts after it.
    ([(0, _PIECE_BYTES * 5 // 4, 1), (_PIECE_BYTES * 17 // 16, _PIECE_BYTES // 16, 2)],
     _PIECE_BYTES * 3 // 2),
])
def test_pieces_cover_a_file_in_bounded_reads_never_cutting_a_block(
        blocks: list[tuple[int, int, int]], size: int) -> None:
    """Pieces cover the file end to end, each block inside one of them, and none is much
    larger than `_PIECE_BYTES` where no block covers the bytes (an incremental step's file
    shared with an earlier step: they were one read of all of them)."""
    pieces = list(_pieces(blocks, size))
    assert [start for start, _, _ in pieces] == [0] + [end for _, end, _ in pieces[:-1]]
    assert pieces[-1][1] == size
    assert [block for _, _, inside in pieces for block in inside] == blocks
    for start, end, inside in pieces:
        assert all(start <= offset and offset + nbytes <= end for offset, nbytes, _ in inside)
        assert end - start <= _PIECE_BYTES + max(nbytes for _, nbytes, _ in blocks)


def test_copy_of_checkpoint_with_overlapping_blocks_that_verify_accepts(tmp_path: Path) -> None:
    """Entry b's chunk lies inside entry a's 20 MiB block, 17 MiB in (a crafted manifest,
    which verify and load accept): copy put b's block into the piece after a's, which starts
    past it, checked it against the wrong bytes and called the source damaged."""
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    sp.save(str(src), {"a": rng.integers(0, 255, 20 << 20, dtype=np.uint8),
                       "b": rng.integers(0, 255, 1 << 20, dtype=np.uint8)})
    manifest = read_manifest(open_storage(str(src)))
    checksum = checksum_function(manifest.checksum)
    block_bytes = 32 << 20
    (chunk_a,), (chunk_b,) = manifest.entries["a"].chunks, manifest.entries["b"].chunks
    data = memoryview((src / chunk_a.file).read_bytes())
    # Both chunks are in one block each; b's moves into the file's bytes of a's.
    within_a = chunk_a.offset + (17 << 20)
    entries = {
        "a": replace(manifest.entries["a"], chunks=(replace(chunk_a, digests=(
            checksum(data[chunk_a.offset : chunk_a.offset + chunk_a.nbytes]),)),)),
        "b": replace(manifest.entries["b"], chunks=(replace(chunk_b, offset=within_a, digests=(
            checksum(data[within_a : within_a + chunk_b.nbytes]),)),)),
    }
    (src / "manifest.json").write_bytes(
        encode(replace(manifest, entries=entries, block_bytes=block_bytes)))
    assert sp.verify(str(src)).ok
    sp.copy(str(src), str(tmp_path / "copy"))
    assert sp.verify(str(tmp_path / "copy")).ok
    loaded = sp.load(str(tmp_path / "copy"))
    assert np.array_equal(loaded["b"], loaded["a"][17 << 20 : 18 << 20])


class _Reads(FaultyStorage):
    """A storage that records the size of every read."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, lambda op, path, n: False)
        self.sizes: list[int] = []

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        data = super().read(path, start, end)
        self.sizes.append(len(data))
        return data


def test_a_copy_of_an_incremental_step_reads_the_dead_bytes_it_shares_in_pieces(
        tmp_path: Path) -> None:
    """Step 2 shares step 1's file, where what step 2 rewrote is bytes no chunk of step 2
    covers: a copy (sp.copy, safepoint cp, an archive) read them in one piece, a model-sized
    read (up to READ_AHEAD of them in flight); it reads them a piece at a time, and the copy
    is whole."""
    root = tmp_path / "root"
    state = {"a": np.ones(1000), "big": np.zeros(3 * _PIECE_BYTES // 8), "z": np.ones(10)}
    with sp.CheckpointManager(str(root), incremental=True, async_save=False) as mgr:
        mgr.save(1, state)
        state["big"] += 1
        mgr.save(2, state)
    source = _Reads(open_storage(str(root / "step-2")))
    manifest = read_manifest(source)
    target = MemoryStorage("memory://copy")
    copy_files(source, target, manifest, sorted(manifest.files), {})
    assert max(source.sizes) <= _PIECE_BYTES + manifest.block_bytes
    assert target.files() == {name: (root / "step-2" / name).read_bytes()
                            for name in manifest.files}


def test_a_copy_of_a_live_root_leaves_out_a_step_its_writer_removes(tmp_path: Path) -> None:
    """A running job's retention removes its oldest step while its root is copied: the copy
    failed as "the source is damaged" and never copied the newer steps. The step no longer
    committed is reported vanished, nothing of it is left at the destination, and the others
    are copied."""
    root = tmp_path / "root"
    with sp.CheckpointManager(str(root), async_save=False, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))

    def retention(done: int, total: int) -> None:  # once everything is listed and planned
        if done == 0 and (root / "step-1").exists():
            with sp.CheckpointManager(str(root), async_save=False, keep_last=2) as writer:
                writer.gc()

    dst = tmp_path / "backup"
    report = sp.copy(str(root), str(dst), progress=retention)
    assert (report.copied, report.vanished) == (["step-2", "step-3"], ["step-1"])
    assert not (dst / "step-1").exists()
    for step in (2, 3):
        _same(sp.load(str(dst / f"step-{step}")), _state(step))


def test_a_checkpoint_removed_while_it_is_copied_is_not_found_not_damaged(
        tmp_path: Path) -> None:
    """The one checkpoint asked for, removed mid-copy: CheckpointNotFound, nothing at the
    destination; a data file missing under a manifest still there stays CorruptCheckpoint."""
    src = tmp_path / "ckpt"
    sp.save(str(src), _state(1))

    def removal(done: int, total: int) -> None:
        if done == 0 and src.exists():
            shutil.rmtree(src)

    with pytest.raises(sp.CheckpointNotFound, match="removed while it was copied"):
        sp.copy(str(src), str(tmp_path / "copy"), progress=removal)
    assert not (tmp_path / "copy").exists() or not any((tmp_path / "copy").rglob("*.bin"))
    sp.save(str(src), _state(1))
    for data in (src / "data").iterdir():
        data.unlink()
    with pytest.raises(sp.CorruptCheckpoint, match="is missing"):
        sp.copy(str(src), str(tmp_path / "copy"))


def test_copy_of_a_checkpoint_overwritten_meanwhile_is_not_called_damaged(
        tmp_path: Path) -> None:
    """The one checkpoint asked for, saved again with overwrite=True once the copy read its
    manifest: the copy raised CorruptCheckpoint ("the source is damaged ... restore an
    earlier checkpoint") for a healthy checkpoint. It raises CheckpointNotFound saying it
    was replaced while it was copied, as sp.load says, and publishes nothing."""
    src, dst = tmp_path / "latest", tmp_path / "copy"
    sp.save(str(src), _state(1))

    def overwrite(done: int, total: int) -> None:  # the manifest is read: nothing copied yet
        if done == 0:
            sp.save(str(src), _state(2), overwrite=True)
            wait_for_removals()

    with pytest.raises(sp.CheckpointNotFound, match=r"replaced while it was copied.*again"):
        sp.copy(str(src), str(dst), progress=overwrite)
    assert not dst.exists() or not any(dst.rglob("*.bin"))
    assert sp.verify(str(src)).ok


def test_root_copy_goes_on_when_a_step_is_saved_again_meanwhile(tmp_path: Path) -> None:
    """A running job saves step 2 again (after a rollback) while its root is copied: the
    copy stopped as "the source is damaged" and never copied step 3. The step replaced
    since the root was listed is left out as a vanished one is, and the others are copied."""
    root, dst = tmp_path / "root", tmp_path / "backup"
    with sp.CheckpointManager(str(root), async_save=False, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))

    def rollback(done: int, total: int) -> None:  # once everything is listed and planned
        if done == 0:
            with sp.CheckpointManager(str(root), async_save=False, keep_last=None) as writer:
                writer.save(2, _state(22))
            wait_for_removals()

    report = sp.copy(str(root), str(dst), progress=rollback)
    assert (report.copied, report.vanished) == (["step-1", "step-3"], ["step-2"])
    assert not (dst / "step-2").exists() or not any((dst / "step-2").rglob("*.bin"))
    for step in (1, 3):
        _same(sp.load(str(dst / f"step-{step}")), _state(step))


def test_root_copy_from_s3_never_writes_outside_the_destination(
        tmp_path: Path, s3_server: Any, s3_url: str) -> None:
    """An S3 key may hold `..` parts: `root/../../escaped/manifest.json` lies under the
    prefix `root/`. Copying the root to a local disk copied that checkpoint as
    `../../escaped`, writing beside the destination's parent. The copy is refused, naming
    the key, before anything is written."""
    import s3fs

    options = s3_server.storage_options
    sp.save(f"{s3_url}/root/good", _state(1), storage_options=options)
    sp.save(f"{s3_url}/template", _state(2), storage_options=options)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket, base = s3_url.removeprefix("s3://").split("/", 1)
    for path in fs.find(f"{bucket}/{base}/template"):
        fs.call_s3("copy_object", Bucket=bucket, CopySource=path,
                   Key=f"{base}/root/../../escaped/{path.split('/template/', 1)[1]}")
    dst = tmp_path / "a" / "b" / "backup"
    with pytest.raises(sp.CorruptCheckpoint, match=r"'\.\./\.\./escaped'.*nothing was copied"):
        sp.copy(f"{s3_url}/root", str(dst), storage_options=options, dst_storage_options={})
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize("after_commit", ["list", "delete"])
def test_copy_that_committed_does_not_raise_for_the_cleanup_after_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, s3_server: Any,
        s3_url: str, after_commit: str) -> None:
    """An overwrite copy published its manifest, then listing or deleting the replaced
    checkpoint's objects failed: the copy raised StorageError, so `safepoint cp`, a root
    copy and a two-tier upload took the copy for unpublished while the destination held it.
    As for sp.save, the failure is logged and the copy succeeds."""
    from safepoint.storage import _REGISTERED

    seen = {"publish": 0, "failed": 0}

    def after_publish(op: str, path: str, n: int) -> bool:
        """Fail the first `after_commit` call once the manifest is published."""
        seen[op] = seen.get(op, 0) + 1
        if op != after_commit or not seen["publish"] or seen["failed"]:
            return False
        seen["failed"] = 1
        return True

    monkeypatch.setitem(_REGISTERED, "faulty+s3", lambda url, options=None: FaultyStorage(
        open_storage(url.removeprefix("faulty+"), options), after_publish))
    options = s3_server.storage_options
    sp.save(f"{s3_url}/src", _state(2), storage_options=options)
    sp.save(f"{s3_url}/dst", _state(1), storage_options=options)
    report = sp.copy(f"{s3_url}/src", f"faulty+{s3_url}/dst", overwrite=True,
                     storage_options=options)
    assert report.copied == [""] and seen["failed"], "the failure was injected"
    assert "could not remove the replaced data" in caplog.text
    _same(sp.load(f"{s3_url}/dst", storage_options=options), _state(2))


_COPY_CAPPED = """
import sys
import safepoint as sp
try:
    if sys.argv[1] == "cp":
        sp.copy(sys.argv[2], sys.argv[3])
    else:
        sp.export_checkpoint(sys.argv[2], sys.argv[3])
except sp.SafepointError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("command", ["cp", "export-tar"])
def test_a_data_file_longer_than_the_manifest_records_is_damage(
    tmp_path: Path, command: str
) -> None:
    """Bytes appended to a data file: verify fails the checkpoint, but cp and an archive
    export copied the recorded bytes and exited 0, and the copy then verified: the damage
    was hidden. Now both refuse it as verify does, and publish nothing."""
    src = tmp_path / "ckpt"
    sp.save(str(src), _state(1))
    (data,) = (src / "data").iterdir()
    size = data.stat().st_size
    with open(data, "ab") as f:
        f.write(b"extra\n")
    assert any(f"{size + 6} bytes, the manifest records {size}" in p
               for p in sp.verify(str(src)).problems)
    out = tmp_path / ("copy" if command == "cp" else "out.tar")
    with pytest.raises(sp.CorruptCheckpoint, match=f"{data} is {size + 6} bytes, the manifest "
                       f"records {size}"):
        if command == "cp":
            sp.copy(str(src), str(out))
        else:
            sp.export_checkpoint(str(src), out)
    if command == "cp":
        with pytest.raises(sp.CheckpointNotFound):
            sp.info(str(out))
    else:
        assert not out.exists()


@pytest.mark.parametrize("command", ["cp", "export-tar"])
def test_hostile_file_size_is_corrupt_not_unbounded_memory(tmp_path: Path, command: str) -> None:
    """A manifest that records its small data file at 2**62 bytes (below the 2**63 its
    validation allows): sp.copy (`safepoint cp`) and an archive export (`safepoint export
    CKPT x.tar`) planned 16 MiB reads over all 2**62 bytes before the first one, and grew
    until the OOM killer came (here, capped at 1 GiB, a MemoryError). The file's size is
    measured first: CorruptCheckpoint, "truncated" as sp.verify says, naming the file."""
    src = tmp_path / "ckpt"
    sp.save(str(src), {"w": np.arange(8.0, dtype=np.float32), "b": np.ones(2, np.float32)})
    (data,) = (src / "data").iterdir()
    edit_manifest(src, lambda doc: doc["files"][0].update(nbytes=1 << 62))
    out = tmp_path / ("copy" if command == "cp" else "out.tar")

    said = run_capped(_COPY_CAPPED, command.split("-")[0], str(src), str(out))
    assert said.startswith("CorruptCheckpoint"), said
    assert (f"{data} is truncated to {data.stat().st_size} bytes of the {1 << 62} the "
            "manifest records" in said), said
    if command == "cp":
        with pytest.raises(sp.CheckpointNotFound):
            sp.info(str(out))
    else:
        assert not out.exists()
