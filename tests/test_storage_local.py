"""LocalStorage: the StorageSuite on a tmp directory (O_DIRECT on and off, and on tmpfs), exact
bytes through the O_DIRECT writer for aligned and unaligned chunks of any size, no temporary
files left by publish, empty directories pruned by delete, errors mapped to StorageError."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import safepoint as sp
from safepoint import _storage_local
from safepoint._commit import wait_for_removals
from safepoint._storage_local import LocalStorage
from safepoint.storage import open_storage
from safepoint.testing import StorageSuite

SHM = Path("/dev/shm")
PAGE = 4096


class TestLocalStorage(StorageSuite):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> LocalStorage:
        return LocalStorage(str(tmp_path / "root"))


class TestLocalStorageBuffered(StorageSuite):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> LocalStorage:
        return LocalStorage(str(tmp_path / "root"), {"direct_io": False})


class TestLocalStorageFileURL(StorageSuite):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> LocalStorage:
        storage = open_storage(f"file://{tmp_path}/root")
        assert isinstance(storage, LocalStorage)
        return storage


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    assert SHM.is_dir() and os.access(SHM, os.W_OK), f"the tmpfs tests need a writable {SHM}"
    path = SHM / f"safepoint-test-{os.getpid()}-{random.getrandbits(32):08x}"
    path.mkdir()
    try:
        yield path
    finally:
        for directory, dirs, files in os.walk(path, topdown=False):
            for name in files:
                os.unlink(os.path.join(directory, name))
            for name in dirs:
                os.rmdir(os.path.join(directory, name))
        path.rmdir()


class TestLocalStorageOnTmpfs(StorageSuite):
    """tmpfs (/dev/shm) takes or refuses O_DIRECT depending on the kernel; both must work."""

    @pytest.fixture
    def storage(self, shm_dir: Path) -> LocalStorage:
        return LocalStorage(str(shm_dir / "root"))


def _aligned_buffer(data: bytes, shift: int = 0) -> memoryview:
    """`data` in page-aligned anonymous memory, starting `shift` bytes past a page boundary."""
    region = mmap.mmap(-1, len(data) + shift + PAGE)
    view = memoryview(region)[shift : shift + len(data)]
    view[:] = data
    return view


# (chunk sizes, shift of each chunk's start from a page boundary)
LAYOUTS = [
    pytest.param([PAGE], [0], id="one-page"),
    pytest.param([3 * PAGE, PAGE], [0, 0], id="aligned-pages"),
    pytest.param([100], [0], id="tiny"),
    pytest.param([PAGE + 1], [0], id="page-plus-one"),
    pytest.param([PAGE, 10, PAGE], [0, 0, 0], id="aligned-unaligned-aligned"),
    pytest.param([PAGE, PAGE], [1, 7], id="misaligned-addresses"),
    pytest.param([5000, 3000, 12_345], [0, 3, 0], id="odd-sizes"),
    pytest.param([(8 << 20) + 5, 4093], [0, 1], id="beyond-scratch-buffer"),
    pytest.param([0, 0, 17], [0, 0, 0], id="empty-chunks"),
]


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize(("sizes", "shifts"), LAYOUTS)
def test_write_produces_exact_bytes(
    tmp_path: Path, sizes: list[int], shifts: list[int], direct_io: bool
) -> None:
    rng = random.Random(sum(sizes))
    pieces = [rng.randbytes(n) for n in sizes]
    chunks = [_aligned_buffer(p, s) for p, s in zip(pieces, shifts, strict=True)]
    storage = LocalStorage(str(tmp_path), {"direct_io": direct_io})
    expected = b"".join(pieces)
    assert storage.write("data/f.bin", chunks) == len(expected)
    assert os.path.getsize(tmp_path / "data" / "f.bin") == len(expected)
    assert (tmp_path / "data" / "f.bin").read_bytes() == expected


@pytest.mark.parametrize(("sizes", "shifts"), LAYOUTS[:7])
def test_write_on_tmpfs_produces_exact_bytes(
    shm_dir: Path, sizes: list[int], shifts: list[int]
) -> None:
    rng = random.Random(len(sizes))
    pieces = [rng.randbytes(n) for n in sizes]
    storage = LocalStorage(str(shm_dir))
    storage.write("f.bin", [_aligned_buffer(p, s) for p, s in zip(pieces, shifts, strict=True)])
    assert (shm_dir / "f.bin").read_bytes() == b"".join(pieces)


def test_a_path_with_a_tilde_is_under_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sp.save("~/ckpt") in a script (no shell to expand it) lands in the home directory, as
    fsspec takes it, not in a directory named "~" (found by a review); an empty path, which
    used to mean the working directory, is refused."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    sp.save("~/ckpt", {"x": 1})
    assert (tmp_path / "home" / "ckpt" / "manifest.json").exists()
    assert not (tmp_path / "~").exists() and sp.load("~/ckpt") == {"x": 1}
    with pytest.raises(sp.SafepointError, match="names no directory"):
        sp.save("", {"x": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


@pytest.mark.parametrize("fails", ["write", "fsync"])
def test_a_publish_whose_write_or_fsync_fails_leaves_no_temporary_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str,
) -> None:
    """A full disk while the manifest is written or fsynced: a StorageError naming it, and no
    `manifest.json.tmp-*` left behind (it was, as a leftover; found by a review). A save
    that fails so removes everything it wrote."""
    real_fsync = os.fsync

    def full(*args: Any) -> int:
        if fails == "fsync" and not stat.S_ISREG(os.fstat(args[0]).st_mode):
            return real_fsync(args[0])  # a directory's fsync
        raise OSError(errno.ENOSPC, "No space left on device")

    storage = LocalStorage(str(tmp_path / "ckpt"))
    with monkeypatch.context() as patch:
        patch.setattr(os, fails, full)
        with pytest.raises(sp.StorageError, match=r"publishing .*manifest\.json"):
            storage.publish("manifest.json", b"{}", overwrite=fails == "write")
    assert os.listdir(tmp_path / "ckpt") == []
    with monkeypatch.context() as patch:  # the manifest's fsync alone fails, in a save
        patch.setattr(os, "fsync", lambda fd: full(fd) if ".tmp-" in os.readlink(
            f"/proc/self/fd/{fd}") else real_fsync(fd))
        with pytest.raises(sp.StorageError):
            sp.save(str(tmp_path / "saved"), {"w": np.arange(1 << 16)})
    wait_for_removals()
    assert not (tmp_path / "saved").exists() or not list((tmp_path / "saved").rglob("*.*"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_publish_whose_temporary_file_is_removed_meanwhile_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool,
) -> None:
    """A writer that lost its lease while paused before its publish, whose successor removed
    its step's leftovers, its temporary manifest among them: a raw FileNotFoundError escaped
    the manager's save (found by a review). Now a StorageError saying what happened."""
    storage = LocalStorage(str(tmp_path / "ckpt"))
    with monkeypatch.context() as patch:
        _once_synced(patch, os.unlink)  # the successor's cleanup
        with pytest.raises(sp.StorageError, match=r"manifest\.json failed: its temporary "
                           r"file was removed .* writer that took the root over"):
            storage.publish("manifest.json", b"{}", overwrite=overwrite)
    assert os.listdir(tmp_path / "ckpt") == []


def _once_synced(patch: pytest.MonkeyPatch, then: Callable[[str], object]) -> None:
    """Have `then(name)` run on each temporary file (`*.tmp-*`) once it is fsynced: another
    process acting between a write and its rename."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        name = os.readlink(f"/proc/self/fd/{fd}")
        if ".tmp-" in name:
            then(name)

    patch.setattr(os, "fsync", fsync)


def test_a_publish_that_lost_the_race_to_a_writer_that_removed_its_file_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two saves to one path at once: the winner committed, then removed the loser's
    temporary manifest as a leftover, and the loser got a StorageError (a review saw 5 in
    250 races); it is a CheckpointExists, as a loser whose link failed gets. A publish of
    the very bytes committed there (another copy of the same save) is a success."""
    storage = LocalStorage(str(tmp_path / "ckpt"))

    def winner_commits_and_tidies(name: str) -> None:
        (tmp_path / "ckpt" / "manifest.json").write_bytes(b'{"winner": 1}')
        os.unlink(name)

    with monkeypatch.context() as patch:
        _once_synced(patch, winner_commits_and_tidies)
        with pytest.raises(FileExistsError):
            storage.publish("manifest.json", b'{"loser": 1}', overwrite=False)
    storage.publish("manifest.json", b'{"winner": 1}', overwrite=False)  # the same bytes
    with pytest.raises(FileExistsError):
        storage.publish("manifest.json", b'{"winner": 2}', overwrite=False)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["manifest.json"]
    assert (tmp_path / "ckpt" / "manifest.json").read_bytes() == b'{"winner": 1}'


def test_a_write_whose_temporary_file_another_writer_removed_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = LocalStorage(str(tmp_path))
    with monkeypatch.context() as patch:
        _once_synced(patch, os.unlink)  # another writer's tidying, once it committed
        with pytest.raises(sp.StorageError, match="temporary file was removed while it was "
                           "written, by another process"):
            storage.write("data/f.bin", [b"x" * 100])
    assert os.listdir(tmp_path / "data") == []


def test_a_file_being_written_is_never_seen_under_its_name_in_part(tmp_path: Path) -> None:
    """A write went to its final name as it went (truncated first): two copies of one
    checkpoint to one place, whose data files have the same names, each cut the other's
    file short, under a committed manifest (found by a review). A file is now written under
    a temporary name and renamed whole into place."""
    storage = LocalStorage(str(tmp_path))
    storage.write("data/f.bin", [b"old" * 1000])
    seen: list[bytes] = []

    def chunks() -> Iterator[bytes]:
        for _ in range(4):
            seen.append((tmp_path / "data" / "f.bin").read_bytes())
            yield b"new" * 1000

    assert storage.write("data/f.bin", chunks()) == 12000
    assert seen == [b"old" * 1000] * 4
    assert (tmp_path / "data" / "f.bin").read_bytes() == b"new" * 4000
    assert os.listdir(tmp_path / "data") == ["f.bin"]
    with pytest.raises(RuntimeError):  # a write that fails leaves the file as it was
        storage.write("data/f.bin", (_ for _ in [b"x"] if _raise(RuntimeError())))
    assert (tmp_path / "data" / "f.bin").read_bytes() == b"new" * 4000
    assert os.listdir(tmp_path / "data") == ["f.bin"]


def _raise(exc: BaseException) -> bool:
    raise exc


@pytest.mark.parametrize("call", ["pwrite", "write"])
def test_a_write_that_writes_nothing_is_an_error_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str,
) -> None:
    """Some FUSE and network filesystems report a full disk by writing 0 bytes: a
    StorageError, not a loop that spins forever (found by a review)."""
    monkeypatch.setattr(os, call, lambda *args: 0)
    with pytest.raises(sp.StorageError, match="wrote nothing"):
        if call == "pwrite":
            sp.save(str(tmp_path / "ckpt"), {"w": np.arange(4096)})
        else:
            LocalStorage(str(tmp_path / "ckpt")).publish("manifest.json", b"{}",
                                                         overwrite=False)


def test_a_file_system_that_refuses_o_direct_after_making_the_file_is_written_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Linux makes the file, then refuses O_DIRECT with EINVAL (tmpfs before 6.6, ramfs):
    the buffered retry of the temporary name met the file just made (O_EXCL) and every
    save failed with a raw FileExistsError, leaving the file (found by a review)."""
    from safepoint import _storage_local

    real_open = os.open

    def open_as_ramfs(path: str, flags: int, *args: Any) -> int:
        fd = real_open(path, flags & ~_storage_local._O_DIRECT, *args)
        if flags & _storage_local._O_DIRECT:
            os.close(fd)
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return fd

    monkeypatch.setattr(os, "open", open_as_ramfs)
    storage = LocalStorage(str(tmp_path))
    assert storage.direct_io
    data = random.Random(2).randbytes(3 * PAGE + 5)
    assert storage.write("data/f.bin", [data]) == len(data)
    assert (tmp_path / "data" / "f.bin").read_bytes() == data
    assert os.listdir(tmp_path / "data") == ["f.bin"]


def test_write_read_only_chunks(tmp_path: Path) -> None:
    """bytes objects (read-only buffers) take the scratch path under O_DIRECT."""
    storage = LocalStorage(str(tmp_path))
    data = random.Random(1).randbytes(3 * PAGE)
    storage.write("f.bin", [data[:PAGE], data[PAGE:]])
    assert (tmp_path / "f.bin").read_bytes() == data


def test_rewrite_shorter_truncates(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    storage.write("f.bin", [_aligned_buffer(bytes(3 * PAGE))])
    storage.write("f.bin", [b"short"])
    assert (tmp_path / "f.bin").read_bytes() == b"short"


def test_save_load_round_trip_on_tmpfs(shm_dir: Path) -> None:
    import torch
    state = {"big": torch.randn(300_000), "small": torch.arange(7), "n": 3}
    sp.save(str(shm_dir / "ckpt"), state)
    loaded = sp.load(str(shm_dir / "ckpt"))
    assert torch.equal(loaded["big"], state["big"])
    assert torch.equal(loaded["small"], state["small"])
    assert sp.verify(str(shm_dir / "ckpt")).ok


def test_publish_leaves_no_temporary_files(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    storage.publish("c/manifest.json", b"one", overwrite=False)
    with pytest.raises(FileExistsError):
        storage.publish("c/manifest.json", b"two", overwrite=False)
    storage.publish("c/manifest.json", b"three", overwrite=True)
    assert sorted(os.listdir(tmp_path / "c")) == ["manifest.json"]
    assert (tmp_path / "c" / "manifest.json").read_bytes() == b"three"


def test_a_save_under_a_file_fails_once_with_no_noise_about_its_cleanup(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A path whose parent is a file: the write fails (StorageError), and removing the data
    file that could never have been made is not a second failure with a traceback."""
    (tmp_path / "ckpt").write_bytes(b"a file")
    with pytest.raises(sp.StorageError, match="Not a directory"):
        sp.save(str(tmp_path / "ckpt" / "step-1"), {"w": [1.0] * 3, "t": b"x" * 100})
    assert "could not remove" not in caplog.text


def test_delete_prunes_empty_directories(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    storage = LocalStorage(str(root))
    storage.write("ckpt1/data/a.bin", [b"1"])
    storage.write("ckpt1/data/b.bin", [b"2"])
    storage.write("ckpt2/data/c.bin", [b"3"])
    storage.delete(["ckpt1/data/a.bin"])
    assert (root / "ckpt1" / "data").is_dir()
    storage.delete(["ckpt1/data/b.bin"])
    assert not (root / "ckpt1").exists()
    assert (root / "ckpt2" / "data" / "c.bin").is_file()
    storage.delete(["ckpt2/data/c.bin"])
    assert root.is_dir(), "a storage root that was there before is never removed"
    assert os.listdir(root) == []


def test_delete_removes_the_root_and_parents_it_made_once_empty(tmp_path: Path) -> None:
    """What a storage made itself, the root and the parents it lacked, goes once a delete
    leaves it empty (a save that failed on a fresh path leaves no empty checkpoint directory
    behind); a directory that was there before stays, and so does one that another process
    wrote into meanwhile."""
    storage = LocalStorage(str(tmp_path / "new" / "ckpt"))
    storage.write("data/a.bin", [b"1"])
    other = LocalStorage(str(tmp_path / "new" / "ckpt"))  # found it there: made nothing
    other.write("data/b.bin", [b"2"])
    storage.delete(["data/a.bin"])
    assert (tmp_path / "new" / "ckpt" / "data" / "b.bin").is_file()
    other.delete(["data/b.bin"])
    ckpt = tmp_path / "new" / "ckpt"
    assert ckpt.is_dir() and not (ckpt / "data").exists()
    storage.write("data/a.bin", [b"1"])
    (tmp_path / "new" / "notes.txt").write_bytes(b"another process's")
    storage.delete(["data/a.bin"])
    assert not (tmp_path / "new" / "ckpt").exists()
    assert os.listdir(tmp_path / "new") == ["notes.txt"]


@pytest.mark.parametrize("fails", ["chunk", "open"])
def test_a_save_that_fails_on_a_fresh_path_leaves_no_empty_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """A failed save removed its data file but left the directories it made for it, empty,
    beside the previous steps: a storage error on the write's first chunk (a failing storage
    wrapper), or a disk too full to create the file at all (which leaves nothing to delete).
    A directory that was there before the save stays, even empty."""
    from safepoint.storage import _REGISTERED
    from safepoint.testing import FaultyStorage, fail_nth

    monkeypatch.setitem(_REGISTERED, "failing", lambda url, options=None: FaultyStorage(
        LocalStorage(url, options), fail_nth("write_chunk", 1) if fails == "chunk"
        else lambda op, path, n: False))
    real_open = os.open

    def full(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if fails == "open" and flags & os.O_CREAT and "/data/" in os.fspath(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    (tmp_path / "there").mkdir()
    for path in (tmp_path / "run" / "ckpt", tmp_path / "there"):
        with pytest.raises(sp.StorageError):
            sp.save(f"failing://{path}", {"w": np.arange(1000)})
    wait_for_removals()
    assert sorted(os.listdir(tmp_path)) == ["there"] and os.listdir(tmp_path / "there") == []


@pytest.mark.parametrize("meanwhile", ["removed", "refilled"])
def test_delete_tolerates_a_concurrent_delete_of_the_same_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """Two deletes of one checkpoint at once (a background removal of replaced data beside a
    retention delete): the directory may vanish, or gain a file, between our unlink and our
    prune; neither is an error."""
    root = tmp_path / "root"
    storage = LocalStorage(str(root))
    storage.write("ckpt/data/a.bin", [b"1"])
    data = root / "ckpt" / "data"
    unlink = os.unlink

    def racing_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        unlink(path, *args, **kwargs)
        if meanwhile == "removed":
            os.rmdir(data)
            os.rmdir(data.parent)
        else:
            (data / "new.bin").write_bytes(b"2")

    monkeypatch.setattr(os, "unlink", racing_unlink)
    storage.delete(["ckpt/data/a.bin"])
    monkeypatch.setattr(os, "unlink", unlink)
    assert os.listdir(data) == ["new.bin"] if meanwhile == "refilled" else not data.exists()


def test_io_failure_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    storage = LocalStorage(str(tmp_path / "file"))  # the root is a file: every write fails
    with pytest.raises(sp.StorageError) as excinfo:
        storage.write("a.bin", [b"1"])
    assert isinstance(excinfo.value.__cause__, OSError)
    assert str(tmp_path / "file") in str(excinfo.value)


def test_missing_file_stays_file_not_found(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(FileNotFoundError) as excinfo:
        storage.read("nope")
    assert not isinstance(excinfo.value, sp.StorageError)



def test_readinto_stretches_reads_at_most_a_stretch_at_a_time(tmp_path: Path) -> None:
    """One read per stretch across buffer boundaries, each followed by the bytes landed so far;
    every buffer filled as `readinto` fills it."""
    storage = LocalStorage(str(tmp_path))
    blob = os.urandom(5000)
    storage.write("data/f.bin", [blob])
    buffers = [memoryview(bytearray(n)) for n in (300, 2500, 0, 700)]
    landed = list(storage.readinto_stretches("data/f.bin", 100, buffers, 1000))
    assert landed == [1000, 2000, 3000, 3500]
    assert b"".join(bytes(b) for b in buffers) == blob[100:3600]


def test_readinto_stretches_of_a_short_file_raise_eof_after_what_landed(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    storage.write("data/f.bin", [b"x" * 2500])
    stretches = storage.readinto_stretches("data/f.bin", 0, [memoryview(bytearray(4000))], 1000)
    assert [next(stretches) for _ in range(3)] == [1000, 2000, 2500]
    with pytest.raises(EOFError, match=r"f\.bin ends at byte 2500"):
        next(stretches)



def test_linked_checkpoints_are_links_to_checkpoint_directories(tmp_path: Path) -> None:
    """Links directly under the root that lead to a directory holding a manifest, by name,
    with where they point; not links to files, to other directories, broken ones, or the
    checkpoints themselves. `list` does not follow them (nothing is deleted through one)."""
    sp.save(str(tmp_path / "epoch=1.ckpt"), {"w": np.zeros(3)})
    (tmp_path / "plain").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for name, target in (("last.ckpt", "epoch=1.ckpt"), ("best", str(tmp_path / "epoch=1.ckpt")),
                         ("to-plain", "plain"), ("to-file", "file.txt"), ("broken", "nowhere")):
        (tmp_path / name).symlink_to(target)
    storage = LocalStorage(str(tmp_path))
    assert storage.linked_checkpoints() == {"best": str(tmp_path / "epoch=1.ckpt"),
                                            "last.ckpt": "epoch=1.ckpt"}
    assert not [path for path in storage.list() if path.startswith(("last.ckpt/", "best/"))]
    assert LocalStorage(str(tmp_path / "missing")).linked_checkpoints() == {}


def test_link_on_the_way_finds_the_first_link_from_the_root_down(tmp_path: Path) -> None:
    (tmp_path / "real" / "a").mkdir(parents=True)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "alias").symlink_to(tmp_path / "root")
    storage = LocalStorage(str(tmp_path / "root"))
    assert storage.link_on_the_way("plain/step-1") is None
    assert storage.link_on_the_way("linked/a") == str(tmp_path / "root" / "linked")
    assert LocalStorage(str(tmp_path / "alias")).link_on_the_way("x") == str(tmp_path / "alias")

def _resident_pages(path: Path) -> int:
    """How many pages of `path` are in the page cache (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as region:
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        try:
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del address
    return sum(v & 1 for v in vector)


def test_prefetch_brings_a_range_into_the_page_cache(tmp_path: Path) -> None:
    """In the background, and all of it (posix_fadvise WILLNEED, which reads ahead at most
    about 8 MiB per call, cached a third of this range)."""
    storage = LocalStorage(str(tmp_path))
    pages = (24 << 20) // PAGE
    path = _evicted(storage, "data/a.bin", pages * PAGE)
    storage.prefetch({"data/a.bin": (PAGE, (pages - 1) * PAGE)})
    _wait_for_prefetches()
    deadline = time.monotonic() + 10
    while _resident_pages(path) < pages - 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the advice has queued the reads; the disk may still be at them
    assert _resident_pages(path) >= pages - 2


def _evicted(storage: LocalStorage, name: str, nbytes: int) -> Path:
    storage.write(name, [os.urandom(nbytes)])
    path = Path(storage.root) / name
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert _resident_pages(path) <= nbytes // PAGE // 8, (
        f"{path}'s file system kept the file cached after POSIX_FADV_DONTNEED (tmpfs?): "
        "run pytest with --basetemp on a disk-backed directory")
    return path


def _wait_for_prefetches() -> None:
    for thread in threading.enumerate():
        if thread.name == "safepoint-prefetch":
            thread.join()


@pytest.mark.parametrize("end", ["read", "close"])
def test_prefetch_ends_once_the_storage_reads_or_closes(tmp_path: Path, end: str) -> None:
    """The load's own reads then drive the disk (a read-ahead beside them slowed cold loads of
    large tensors); a closed storage's load is over."""
    storage = LocalStorage(str(tmp_path))
    storage.write("data/small.bin", [b"x" * PAGE])
    path = _evicted(storage, "data/a.bin", 24 << 20)
    if end == "read":
        storage.readinto("data/small.bin", 0, [memoryview(bytearray(PAGE))])
    else:
        storage.close()
    storage.prefetch({"data/a.bin": (0, 24 << 20)})
    _wait_for_prefetches()
    assert _resident_pages(path) < (24 << 20) // PAGE // 8


@pytest.mark.parametrize("cached", [True, False])
def test_a_read_of_what_the_prefetch_cached_leaves_it_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    """A load of many small tensors reads the cached bytes slowly (copying, checking): the
    read-ahead goes on meanwhile. A read of bytes it has not reached ends it (that read
    drives the disk). Here the read-ahead's windows past the first wait until the test has
    read."""
    storage = LocalStorage(str(tmp_path))
    path = _evicted(storage, "data/a.bin", 24 << 20)
    monkeypatch.setattr(_storage_local, "_READ_AHEAD_BYTES", 1 << 20)
    gate, sendfile = threading.Event(), os.sendfile

    def gated(out: int, fd: int, offset: int, count: int) -> int:
        if offset >= 1 << 20:
            assert gate.wait(10)
        return sendfile(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", gated)
    storage.prefetch({"data/a.bin": (0, 24 << 20)})
    deadline = time.monotonic() + 10
    while storage._ahead.get("data/a.bin", (0, 0))[1] < 1 << 20:
        assert time.monotonic() < deadline, "the first window was never read"
        time.sleep(0.005)
    offset = 0 if cached else 12 << 20
    storage.readinto("data/a.bin", offset, [memoryview(bytearray(1 << 20))])
    gate.set()
    _wait_for_prefetches()
    if cached:
        assert _resident_pages(path) == (24 << 20) // PAGE
        assert storage._ahead["data/a.bin"] == (0, 24 << 20)
    else:
        assert _resident_pages(path) < (18 << 20) // PAGE


@pytest.mark.parametrize("threads", [1, 3])
def test_prefetch_threads_cache_every_window_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """The threads take the windows from one frontier; what is cached counts from the start
    without a hole (a read inside it leaves the read-ahead running)."""
    storage = LocalStorage(str(tmp_path))
    path = _evicted(storage, "data/a.bin", 10 << 20)
    monkeypatch.setattr(_storage_local, "_READ_AHEAD_BYTES", 1 << 20)
    monkeypatch.setattr(_storage_local, "_READ_AHEAD_THREADS", threads)
    asked: list[tuple[int, int]] = []
    sendfile = os.sendfile

    def counted(out: int, fd: int, offset: int, count: int) -> int:
        asked.append((offset, count))
        time.sleep(random.random() / 100)  # the windows finish out of order
        return sendfile(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", counted)
    storage.prefetch({"data/a.bin": (PAGE, (10 << 20) - PAGE)})
    _wait_for_prefetches()
    assert sorted(asked) == [(PAGE + i * (1 << 20), 1 << 20) for i in range(9)] + [
        (PAGE + (9 << 20), (1 << 20) - 2 * PAGE)]
    assert storage._ahead["data/a.bin"] == (PAGE, (10 << 20) - PAGE)
    assert _resident_pages(path) >= (10 << 20) // PAGE - 2


@pytest.mark.parametrize("threads", [1, 2])
def test_prefetch_of_many_files_reads_them_in_turn_on_the_same_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """A checkpoint of many ranks' files loaded by one process starts `_READ_AHEAD_THREADS`
    threads, not that many per file; they read the files in the order given, and a file
    that cannot be opened is skipped, not the ones after it."""
    storage = LocalStorage(str(tmp_path))
    names = [f"data/{i}.bin" for i in range(5)]
    paths = [_evicted(storage, name, 3 << 20) for name in names]
    monkeypatch.setattr(_storage_local, "_READ_AHEAD_BYTES", 1 << 20)
    monkeypatch.setattr(_storage_local, "_READ_AHEAD_THREADS", threads)
    gate, sendfile = threading.Event(), os.sendfile
    asked: list[tuple[int, int]] = []

    def gated(out: int, fd: int, offset: int, count: int) -> int:
        assert gate.wait(10)
        asked.append((os.fstat(fd).st_ino, offset))
        return sendfile(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", gated)
    spans = {name: (0, 3 << 20) for name in names[:2]}
    spans["data/missing.bin"] = (0, 3 << 20)
    spans.update({name: (0, 3 << 20) for name in names[2:]})
    storage.prefetch(spans)
    started = [t for t in threading.enumerate() if t.name == "safepoint-prefetch"]
    gate.set()
    _wait_for_prefetches()
    assert len(started) == threads
    inodes = [path.stat().st_ino for path in paths]
    assert sorted(asked) == sorted((inode, i << 20) for inode in inodes for i in range(3))
    if threads == 1:  # (two threads may ask for the windows they took in either order)
        assert asked == [(inode, i << 20) for inode in inodes for i in range(3)]
    assert all(storage._ahead[name] == (0, 3 << 20) for name in names)
    assert all(_resident_pages(path) >= (3 << 20) // PAGE - 2 for path in paths)


def test_prefetch_of_a_missing_file_is_left_to_the_reads(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    storage.prefetch({"data/missing.bin": (0, 100)})  # only a hint: nothing raised
    with pytest.raises(FileNotFoundError):
        storage.readinto("data/missing.bin", 0, [memoryview(bytearray(100))])


def test_link_is_a_hard_link(tmp_path: Path) -> None:
    """A sibling checkpoint's data file joins the new checkpoint without a byte copied."""
    root = tmp_path / "root"
    storage = LocalStorage(str(root / "step2"))
    LocalStorage(str(root / "step1")).write("data/a.bin", [b"tensor bytes"])
    storage.link(str(root / "step1" / "data" / "a.bin"), "data/a.bin")
    source = os.stat(root / "step1" / "data" / "a.bin")
    linked = os.stat(root / "step2" / "data" / "a.bin")
    assert linked.st_ino == source.st_ino
    assert linked.st_nlink == source.st_nlink == 2
    assert storage.read("data/a.bin") == b"tensor bytes"


def test_link_takes_a_file_url(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"123")
    storage = LocalStorage(str(tmp_path / "c"))
    storage.link(f"file://{tmp_path}/a.bin", "b.bin")
    assert (tmp_path / "c" / "b.bin").read_bytes() == b"123"


@pytest.mark.parametrize("refused", ["cross-device", "no-hard-links"])
def test_link_copies_where_hard_links_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """Another file system (EXDEV for the source only) or none at all (EPERM everywhere): a
    copy, published from a temporary name, with nothing else left behind."""
    source = tmp_path / "step1" / "a.bin"
    source.parent.mkdir()
    data = random.Random(4).randbytes((3 << 20) + 5)
    source.write_bytes(data)
    link = os.link

    def refusing_link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if refused == "no-hard-links":
            raise OSError(errno.EPERM, "Operation not permitted", src)
        if os.fspath(src) == str(source):
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", refusing_link)
    storage = LocalStorage(str(tmp_path / "step2"))
    storage.link(str(source), "data/a.bin")
    monkeypatch.setattr(os, "link", link)
    target = tmp_path / "step2" / "data" / "a.bin"
    assert target.read_bytes() == data
    assert os.stat(target).st_ino != os.stat(source).st_ino
    assert os.listdir(target.parent) == ["a.bin"]
    assert source.read_bytes() == data


def test_link_failed_copy_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "a.bin"
    source.write_bytes(b"x" * 5000)

    def refusing_link(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    fsync = os.fsync

    def failing_file_fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "link", refusing_link)
    monkeypatch.setattr(os, "fsync", failing_file_fsync)
    with pytest.raises(sp.StorageError, match="linking"):
        LocalStorage(str(tmp_path / "c")).link(str(source), "data/b.bin")
    assert os.listdir(tmp_path / "c" / "data") == []


def test_link_from_another_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sp.StorageError, match="not on the local file system"):
        LocalStorage(str(tmp_path)).link("s3://bucket/a.bin", "b.bin")


def test_directories_found_existing_are_made_durable_in_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crashed process may have made `run/step-5/data` without fsyncing the entries: a save
    into it fsyncs every parent holding one (once per process), as it does for the
    directories it makes itself."""
    from safepoint import _storage_local

    existing = tmp_path / "run" / "step-5" / "data"
    existing.mkdir(parents=True)
    synced: list[str] = []
    real = _storage_local.fsync_dir
    monkeypatch.setattr(_storage_local, "fsync_dir", lambda p: (synced.append(p), real(p)))
    monkeypatch.setattr(_storage_local, "_DURABLE", set())
    storage = LocalStorage(str(tmp_path / "run"))
    storage.write("step-5/data/a.bin", [b"x" * 10])
    for directory in (tmp_path, tmp_path / "run", tmp_path / "run" / "step-5", existing):
        assert str(directory) in synced, directory
    synced.clear()
    storage.write("step-5/data/b.bin", [b"y" * 10])
    assert synced == [str(existing)]  # only the new file's entry: its parents are known durable


def test_a_write_whose_directory_another_process_prunes_while_it_is_made_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another rank's delete prunes the empty step directory just as this write makes its
    data directory in it: the write is tried again, as for a prune before the open (it
    raised at once, blaming a link to a disk not mounted)."""
    from safepoint import _storage_local

    (tmp_path / "step-1").mkdir()
    _storage_local.makedirs_durable(str(tmp_path / "step-1"))  # known to exist
    mkdir = os.mkdir
    pruned: list[str] = []

    def pruning_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path).endswith(os.path.join("step-1", "data")) and not pruned:
            pruned.append(os.fspath(path))
            os.rmdir(os.path.dirname(os.fspath(path)))
        mkdir(path, *args, **kwargs)

    monkeypatch.setattr(_storage_local.os, "mkdir", pruning_mkdir)
    storage = LocalStorage(str(tmp_path))
    assert storage.write("step-1/data/x.bin", [b"abc"]) == 3
    assert pruned and (tmp_path / "step-1" / "data" / "x.bin").read_bytes() == b"abc"


def _denied(monkeypatch: pytest.MonkeyPatch, call: str, where: Path) -> None:
    """Make `os.<call>` of `where` fail as for a directory another account owns (mode 0700),
    which root, running these tests, cannot be refused."""
    real = getattr(os, call)

    def refusing(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path).startswith(str(where)):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, refusing)


def test_a_step_that_cannot_be_listed_is_an_error_not_a_missing_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory os.walk could not list was left out silently: a manager root whose newest
    step another account wrote listed the older steps only, and restore resumed from one of
    them, `safepoint ls` and `gc` reporting all well."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": np.full(3, float(step))})
    _denied(monkeypatch, "scandir", root / "step-20")
    with pytest.raises(sp.StorageError, match=r"Permission denied.*step-20"):
        LocalStorage(str(root)).list("")
    with pytest.raises(sp.StorageError, match="step-20"):
        sp.CheckpointManager(str(root)).restore({"w": np.zeros(3)})


def test_exists_of_a_file_that_cannot_be_looked_at_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`exists` said no for a manifest in a directory without search permission: a committed
    checkpoint looked absent, not unreadable."""
    sp.save(str(tmp_path / "c"), {"w": np.ones(3)})
    _denied(monkeypatch, "stat", tmp_path / "c")
    with pytest.raises(sp.StorageError, match="Permission denied"):
        LocalStorage(str(tmp_path / "c")).exists("manifest.json")
    assert not LocalStorage(str(tmp_path / "d")).exists("manifest.json")


def test_a_root_at_a_file_systems_top_lists_past_its_lost_and_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager root at a mount point holds ext4's lost+found, which only root may list: a
    job running as a user could no longer list or restore its steps."""
    root = tmp_path / "run"
    with sp.CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(10, {"w": np.ones(3)})
    (root / "lost+found").mkdir()
    _denied(monkeypatch, "scandir", root / "lost+found")
    with sp.CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [10] and mgr.restore({"w": np.zeros(3)}) == 10


@pytest.mark.parametrize("op", ["publish", "link", "manager save"])
def test_a_root_under_a_dangling_link_is_a_storage_error(tmp_path: Path, op: str) -> None:
    """A root under a link to a disk that is not mounted: publishing a file there (the
    manager's first save takes its lease by one) raised a raw FileNotFoundError, which
    callers read as a missing file (for `link`: a missing source); it is a StorageError
    naming the path, as a data file's write there is."""
    link = tmp_path / "scratch"
    os.symlink(tmp_path / "not-mounted" / "scratch", link)
    root = str(link / "run1")
    source = tmp_path / "source.bin"
    source.write_bytes(b"abc")
    with pytest.raises(sp.StorageError, match=r"run1/.*directory cannot be made.*not mounted"):
        if op == "publish":
            LocalStorage(root).publish("lease/holder", b"x", overwrite=False)
        elif op == "link":
            LocalStorage(root).link(str(source), "step-1/data/x.bin")
        else:
            sp.CheckpointManager(root).save(1, {"w": np.zeros(4)})


def test_two_tier_local_dir_on_a_link_to_an_unmounted_disk_raises_storage_error(
    tmp_path: Path,
) -> None:
    """A directory that is itself a link to a disk that is not mounted (a node-local NVMe
    path missing on this host): publishing a file in it raised a bare FileNotFoundError (the
    link passes for the directory until a file is made in it), which callers read as a
    missing file; a two-tier manager with it as `local_dir` raised that when made. It is a
    StorageError naming the path, as a write there is."""
    link = tmp_path / "nvme"
    link.symlink_to(tmp_path / "not-mounted" / "run1")
    with pytest.raises(sp.StorageError, match=r"nvme/x.*directory cannot be made.*not mounted"):
        LocalStorage(str(link)).publish("x", b"x", overwrite=False)
    with pytest.raises(sp.StorageError, match=r"nvme/.*directory cannot be made"):
        sp.CheckpointManager(str(tmp_path / "remote"), local_dir=str(link), async_save=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvme"]
