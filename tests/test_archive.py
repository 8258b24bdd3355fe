"""A checkpoint as one archive file: `sp.export_checkpoint(url, "x.tar.gz")` and
`sp.import_checkpoint("x.tar.gz", url)` keep it byte for byte (same save id, metadata and
entries), check every block both ways, and commit nothing from an archive that holds anything
but a checkpoint's files or bytes that fail their checksums."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from _states import assert_same, chunk_of, random_tensor, sealed
from safepoint._commit import wait_for_removals

SUFFIXES = [".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz"]


def _state() -> dict[str, Any]:
    return {
        "model": {"w": random_tensor(torch.bfloat16, (300, 7)), "b": torch.arange(5)},
        "big": random_tensor(torch.float32, (3 << 18,), seed=1),  # 3 MiB
        "arr": np.arange(12, dtype=np.int16).reshape(3, 4),
        "step": 7,
        "raw": b"\x00payload",
        "pair": (1.5, None),
        "obj": sp.Pickled({"any": "object"}),
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    url = str(tmp_path / "ckpt")
    state = _state()
    sp.save(url, state, metadata={"run": "a", "loss": 0.5})
    return url, state


def _expected(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "obj": {"any": "object"}}


def _files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_archive_holds_the_checkpoint_as_it_was_saved(
    tmp_path: Path, saved: tuple[str, dict[str, Any]], suffix: str
) -> None:
    url, state = saved
    out = tmp_path / f"ckpt{suffix}"
    report = sp.export_checkpoint(url, out)
    assert report.out == str(out) and report.nbytes == out.stat().st_size
    assert sorted(report.paths) == sorted(e.path for e in sp.info(url).entries)
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert names[-1] == "manifest.json"  # last: a cut-short extraction is not a checkpoint
    assert sorted(names[:-1]) == sorted(
        str(p.relative_to(url)) for p in _files_under(Path(url) / "data"))
    copy = str(tmp_path / "imported")
    info = sp.import_checkpoint(out, copy)
    original = sp.info(url)
    assert (info.save_id, info.metadata, info.entries) == (
        original.save_id, original.metadata, original.entries)
    assert Path(copy, "manifest.json").read_bytes() == Path(url, "manifest.json").read_bytes()
    assert sp.verify(copy).ok
    assert_same(sp.load(copy, allow_pickle=True), _expected(state))


def test_entries_of_several_blocks_at_any_offset_are_archived(tmp_path: Path) -> None:
    """The data file streams into the archive in pieces that end anywhere (here a 5 MiB entry
    whose second block ends mid-buffer): `tarfile` takes any short read for the end of the
    data, so every read but the last must come back full."""
    state = {"a": random_tensor(torch.float32, (1000,)),
             "b": random_tensor(torch.float32, (5 << 18,), seed=1),
             "c": random_tensor(torch.float32, (3 << 18,), seed=2)}
    url = str(tmp_path / "ckpt")
    sp.save(url, state)
    sp.export_checkpoint(url, tmp_path / "ckpt.tar")
    copy = str(tmp_path / "imported")
    sp.import_checkpoint(tmp_path / "ckpt.tar", copy)
    assert_same(sp.load(copy), state)


def test_tar_alone_extracts_a_checkpoint_that_loads(
    tmp_path: Path, saved: tuple[str, dict[str, Any]]
) -> None:
    url, state = saved
    sp.export_checkpoint(url, tmp_path / "ckpt.tar.gz")
    with tarfile.open(tmp_path / "ckpt.tar.gz") as tar:
        tar.extractall(tmp_path / "extracted", filter="data")
    assert sp.verify(str(tmp_path / "extracted")).ok
    assert_same(sp.load(str(tmp_path / "extracted"), allow_pickle=True), _expected(state))


def test_a_damaged_checkpoint_is_not_archived(
    tmp_path: Path, saved: tuple[str, dict[str, Any]]
) -> None:
    url, _ = saved
    data, offset, _ = chunk_of(Path(url), "big")
    with open(data, "r+b") as f:
        f.seek(offset + 123)
        byte = f.read(1)
        f.seek(offset + 123)
        f.write(bytes([byte[0] ^ 0x10]))
    out = tmp_path / "out" / "ckpt.tar"
    with pytest.raises(sp.CorruptCheckpoint, match="checksum mismatch") as caught:
        sp.export_checkpoint(url, out)
    assert url in str(caught.value)
    assert os.listdir(tmp_path / "out") == []  # no archive, no temporary file


def _rewrite(
    archive: Path, out: Path,
    change: Callable[[list[tuple[tarfile.TarInfo, bytes]]], list[tuple[tarfile.TarInfo, bytes]]],
) -> None:
    """Write `out`, a copy of `archive` with its members changed by `change`, compressed
    with gzip if its name ends in .gz."""
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else b"")  # type: ignore[union-attr]
                   for m in tar.getmembers()]
    with tarfile.open(out, "w:gz" if out.name.endswith(".gz") else "w") as tar:
        for member, data in change(members):
            member.size = len(data) if member.isfile() else 0
            tar.addfile(member, io.BytesIO(data) if member.isfile() else None)


def _flip_data(members: list[tuple[tarfile.TarInfo, bytes]]) -> list[tuple[tarfile.TarInfo, bytes]]:
    member, data = members[0]
    middle = len(data) // 2  # inside "big", which is most of the file
    return [(member, data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]),
            *members[1:]]


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, to: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, to
    return info, b""


def _version_99(
    members: list[tuple[tarfile.TarInfo, bytes]]
) -> list[tuple[tarfile.TarInfo, bytes]]:
    manifest = json.loads(members[-1][1])
    manifest["version"] = 99
    return [*members[:-1], (members[-1][0], sealed(manifest))]  # as a newer writer seals it


#: Archives that must be refused: (what they hold, the change, words the error must use).
REFUSED: dict[str, tuple[Callable[..., Any], str]] = {
    "flipped bit": (_flip_data, "checksum mismatch"),
    "path outside": (lambda m: [_file("../evil.bin", b"x"), *m], "'../evil.bin'"),
    "absolute path": (lambda m: [_file("/tmp/safepoint-evil.bin", b"x"), *m], "evil.bin"),
    "symbolic link": (lambda m: [_link("data/link.bin", "/etc/passwd"), *m], "link.bin"),
    "extra file": (lambda m: [_file("data/extra.bin", b"x" * 10), *m], "extra.bin"),
    "missing file": (lambda m: m[1:], "are not those its manifest lists"),
    "file twice": (lambda m: [m[0], *m], "twice"),
    "no manifest": (lambda m: m[:-1], "no manifest.json"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_archive_of_anything_else_commits_nothing(
    tmp_path: Path, saved: tuple[str, dict[str, Any]], case: str
) -> None:
    url, _ = saved
    sp.export_checkpoint(url, tmp_path / "good.tar")
    change, words = REFUSED[case]
    bad = tmp_path / "bad.tar"
    _rewrite(tmp_path / "good.tar", bad, change)
    target = tmp_path / "target"
    with pytest.raises(sp.CorruptCheckpoint) as caught:
        sp.import_checkpoint(bad, str(target))
    message = str(caught.value)
    assert str(bad) in message and words in message and "nothing was committed" in message
    assert _files_under(target) == []  # what it wrote is removed
    assert not (tmp_path / "evil.bin").exists()
    assert not Path("/tmp/safepoint-evil.bin").exists()
    with pytest.raises(sp.CheckpointNotFound):
        sp.load(str(target))


def test_an_archive_declaring_a_huge_manifest_is_refused_before_it_is_read(
    tmp_path: Path, saved: tuple[str, dict[str, Any]]
) -> None:
    """manifest.json was read whole into memory, whatever size its tar header declared: a
    hostile archive (a .tar.gz of zeros shrinks 1000 times) could make an import allocate any
    amount. A manifest declared above 1 GiB is refused, naming the archive, before a byte of
    it is read (here the archive stops after its header)."""
    url, _ = saved
    sp.export_checkpoint(url, tmp_path / "good.tar")
    with tarfile.open(tmp_path / "good.tar") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()  # type: ignore[union-attr]
                   if m.isfile() and m.name != "manifest.json"]
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w") as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
        head = stream.getvalue()[: tar.offset]  # without the end-of-archive blocks
    manifest = tarfile.TarInfo("manifest.json")
    manifest.size = 2 << 30
    bad = tmp_path / "bad.tar"
    bad.write_bytes(head + manifest.tobuf() + b"{" * 512)
    with pytest.raises(sp.CorruptCheckpoint, match=r"declares 2147483648 bytes") as caught:
        sp.import_checkpoint(bad, str(tmp_path / "target"))
    assert str(bad) in str(caught.value) and "nothing was committed" in str(caught.value)
    assert _files_under(tmp_path / "target") == []


def _sparse(name: str, size: int) -> tuple[tarfile.TarInfo, bytes]:
    """A sparse member (GNU's PAX format 0.1) of `size` bytes, one stored, the rest a hole
    that tarfile reads as zeros."""
    info = tarfile.TarInfo(name)
    info.pax_headers = {"GNU.sparse.size": str(size), "GNU.sparse.map": f"{size - 1},1"}
    return info, b"x"


#: Archives of a few KiB that expand to 64 MiB: (archive name, the change, words the error
#: must use).
EXPANDING: dict[str, tuple[str, Callable[..., Any], str]] = {
    "sparse": ("bad.tar", lambda m: [_sparse(m[0][0].name, 64 << 20), *m[1:]],
               "is a sparse file"),
    "unlisted": ("bad.tar.gz", lambda m: [_file("data/zeros.bin", bytes(64 << 20)), *m],
                 "are not those its manifest lists"),
    "another size": ("bad.tar.gz", lambda m: [_file(m[0][0].name, bytes(64 << 20)), *m[1:]],
                     "differ in size"),
}


@pytest.mark.parametrize("case", list(EXPANDING))
def test_an_expanding_archive_is_refused_before_anything_is_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, saved: tuple[str, dict[str, Any]],
    case: str,
) -> None:
    """A member was written as it streamed in, before the manifest (last in the archive) was
    read: an archive of 10 KiB holding a sparse member (tarfile expands its holes), or a
    .tar.gz of 0.5 MiB holding 512 MiB of zeros, made an import write it all before it was
    refused (found by a review). Every member is now checked against the manifest first, and
    sparse ones refused: here a destination that fails any write sees none."""
    from safepoint.storage import _REGISTERED, open_storage
    from safepoint.testing import FaultyStorage

    opened: list[FaultyStorage] = []

    def no_writes(url: str, options: dict[str, Any] | None = None) -> FaultyStorage:
        opened.append(FaultyStorage(open_storage(url.removeprefix("faulty+"), options),
                                    lambda op, path, n: op == "write"))
        return opened[-1]

    monkeypatch.setitem(_REGISTERED, "faulty+file", no_writes)
    url, _ = saved
    sp.export_checkpoint(url, tmp_path / "good.tar")
    name, change, words = EXPANDING[case]
    bad = tmp_path / name
    _rewrite(tmp_path / "good.tar", bad, change)
    assert bad.stat().st_size < 8 << 20
    with pytest.raises(sp.CorruptCheckpoint, match=words) as caught:
        sp.import_checkpoint(bad, f"faulty+file://{tmp_path}/target")
    assert str(bad) in str(caught.value) and "nothing was committed" in str(caught.value)
    assert opened and all(storage.counts["write"] == 0 for storage in opened)
    assert _files_under(tmp_path / "target") == []


def test_an_archive_never_replaces_a_file_of_the_users(
    tmp_path: Path, saved: tuple[str, dict[str, Any]]
) -> None:
    """An archive with a member data/train.csv its manifest does not list, imported into a
    project directory holding its own data/train.csv: refused, and the user's file is as it
    was (it used to be overwritten, then removed as a file the import wrote; found by a
    review)."""
    url, _ = saved
    sp.export_checkpoint(url, tmp_path / "good.tar")
    bad = tmp_path / "bad.tar"
    _rewrite(tmp_path / "good.tar", bad, lambda m: [_file("data/train.csv", b"bad"), *m])
    target = tmp_path / "project"
    (target / "data").mkdir(parents=True)
    (target / "data" / "train.csv").write_text("precious\n")
    with pytest.raises(sp.CorruptCheckpoint, match=r"data/train.csv would replace a file"):
        sp.import_checkpoint(bad, str(target))
    assert (target / "data" / "train.csv").read_text() == "precious\n"
    assert _files_under(target) == [target / "data" / "train.csv"]


def test_an_archive_of_a_newer_format_is_refused(
    tmp_path: Path, saved: tuple[str, dict[str, Any]]
) -> None:
    url, _ = saved
    sp.export_checkpoint(url, tmp_path / "good.tar")
    _rewrite(tmp_path / "good.tar", tmp_path / "new.tar", _version_99)
    with pytest.raises(sp.FormatVersionError, match="upgrade safepoint"):
        sp.import_checkpoint(tmp_path / "new.tar", str(tmp_path / "target"))
    assert _files_under(tmp_path / "target") == []


def test_a_file_that_is_not_an_archive_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "noise.tar.gz"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(sp.CorruptCheckpoint, match="not an archive of a safepoint checkpoint"):
        sp.import_checkpoint(bad, str(tmp_path / "target"))
    assert _files_under(tmp_path / "target") == []


def test_importing_over_a_committed_checkpoint_needs_overwrite(
    tmp_path: Path, saved: tuple[str, dict[str, Any]]
) -> None:
    url, state = saved
    sp.export_checkpoint(url, tmp_path / "ckpt.tar")
    other = str(tmp_path / "other")
    sp.save(other, {"x": torch.ones(3)})
    before = sorted(_files_under(Path(other)))
    with pytest.raises(sp.CheckpointExists, match="overwrite"):
        sp.import_checkpoint(tmp_path / "ckpt.tar", other)
    assert sorted(_files_under(Path(other))) == before
    assert_same(sp.load(other), {"x": torch.ones(3)})
    sp.import_checkpoint(tmp_path / "ckpt.tar", other, overwrite=True)
    assert_same(sp.load(other, allow_pickle=True), _expected(state))
    assert len(_files_under(Path(other) / "data")) == len(_files_under(Path(url) / "data"))


def test_an_archive_is_exported_whole_and_imported_as_saved(
    tmp_path: Path, saved: tuple[str, dict[str, Any]]
) -> None:
    url, _ = saved
    with pytest.raises(sp.SafepointError, match="whole checkpoint"):
        sp.export_checkpoint(url, tmp_path / "part.tar", keys=["model/"])
    with pytest.raises(sp.SafepointError, match="whole checkpoint"):
        sp.export_checkpoint(url, tmp_path / "part.tar", strip_prefix="model/")
    assert not (tmp_path / "part.tar").exists()
    sp.export_checkpoint(url, tmp_path / "ckpt.tar")
    with pytest.raises(sp.SafepointError, match="its own metadata"):
        sp.import_checkpoint(tmp_path / "ckpt.tar", str(tmp_path / "target"), metadata={"a": 1})
    assert _files_under(tmp_path / "target") == []


def test_archives_travel_between_object_stores(
    s3_server: Any, s3_url: str, tmp_path: Path
) -> None:
    options = s3_server.storage_options
    state = _state()
    sp.save(f"{s3_url}/ckpt", state, storage_options=options)
    sp.export_checkpoint(f"{s3_url}/ckpt", tmp_path / "ckpt.tar.gz", storage_options=options)
    info = sp.import_checkpoint(tmp_path / "ckpt.tar.gz", f"{s3_url}/restored",
                                storage_options=options)
    assert info.save_id == sp.info(f"{s3_url}/ckpt", storage_options=options).save_id
    assert sp.verify(f"{s3_url}/restored", storage_options=options).ok
    assert_same(sp.load(f"{s3_url}/restored", allow_pickle=True, storage_options=options),
                _expected(state))


def test_a_failed_import_over_the_same_save_keeps_the_committed_checkpoint(
    tmp_path: Path,
) -> None:
    """Re-importing a damaged copy of the archive of the checkpoint committed there (same
    save, same file names) fails without touching the committed files."""
    url = str(tmp_path / "ckpt")
    state = {"big": random_tensor(torch.float32, (9 << 18,), seed=1)}  # 9 MiB
    sp.save(url, state)
    sp.export_checkpoint(url, tmp_path / "good.tar")
    dst = str(tmp_path / "dst")
    sp.import_checkpoint(tmp_path / "good.tar", dst)
    damaged = bytearray((tmp_path / "good.tar").read_bytes())
    damaged[6 << 20] ^= 1
    (tmp_path / "bad.tar").write_bytes(bytes(damaged))
    with pytest.raises(sp.CorruptCheckpoint, match="differs from the file"):
        sp.import_checkpoint(tmp_path / "bad.tar", dst, overwrite=True)
    assert sp.verify(dst).ok
    sp.import_checkpoint(tmp_path / "good.tar", dst, overwrite=True)  # the same: a no-op
    assert_same(sp.load(dst), state)


def test_two_imports_of_one_archive_to_one_place_at_once_leave_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An import that found, once it had written its files, the same checkpoint committed
    there by another import of the archive raised CheckpointExists and removed the files it
    had written, which were the committed checkpoint's (same names): committed, then failing
    verify (found by a review: 15 of 30 racing pairs). Both now succeed, and it loads."""
    from safepoint import _archive

    url = str(tmp_path / "ckpt")
    state = {"big": random_tensor(torch.float32, (1 << 18,), seed=1), "n": 3}
    sp.save(url, state)
    sp.export_checkpoint(url, tmp_path / "a.tar")
    dst = str(tmp_path / "dst")
    contents = _archive._contents

    def the_other_import_commits_meanwhile(*args: Any) -> Any:
        found = contents(*args)
        monkeypatch.setattr(_archive, "_contents", contents)
        sp.import_checkpoint(tmp_path / "a.tar", dst)
        return found

    monkeypatch.setattr(_archive, "_contents", the_other_import_commits_meanwhile)
    info = sp.import_checkpoint(tmp_path / "a.tar", dst)
    assert info.save_id == sp.info(url).save_id
    assert sp.verify(dst).ok
    assert_same(sp.load(dst), state)


def test_an_export_of_a_checkpoint_whose_manifest_is_not_json_says_it_is_damaged(
    tmp_path: Path,
) -> None:
    url = tmp_path / "ckpt"
    sp.save(str(url), {"w": torch.ones(10)})
    (url / "manifest.json").write_bytes(b'{"format": "safepo')
    with pytest.raises(sp.CorruptCheckpoint, match="not valid JSON"):  # not UnboundLocalError
        sp.export_checkpoint(str(url), tmp_path / "out.tar")
    assert not (tmp_path / "out.tar").exists()


def test_an_import_whose_files_another_import_of_it_tidied_away_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two imports of one archive with overwrite=True: the one that commits first removes
    what its manifest does not reference, the other's data files in progress among them,
    and the other failed (a StorageError) though the checkpoint it was importing was there,
    whole (found by a review: 2 of 12 racing pairs)."""
    import concurrent.futures

    url = str(tmp_path / "ckpt")
    state = {"big": random_tensor(torch.float32, (1 << 18,), seed=1), "n": 3}
    sp.save(url, state)
    sp.export_checkpoint(url, tmp_path / "a.tar")
    dst = str(tmp_path / "dst")
    real_fsync, others = os.fsync, []

    def the_other_import_commits(fd: int) -> None:
        real_fsync(fd)
        if not others and ".bin.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            others.append(None)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # another process's
                others[0] = pool.submit(sp.import_checkpoint, tmp_path / "a.tar", dst,
                                        overwrite=True).result()

    monkeypatch.setattr(os, "fsync", the_other_import_commits)
    info = sp.import_checkpoint(tmp_path / "a.tar", dst, overwrite=True)
    assert info.save_id == others[0].save_id == sp.info(url).save_id
    assert sp.verify(dst).ok
    assert_same(sp.load(dst), state)


@pytest.mark.parametrize("then", ["removed", "replaced"])
def test_an_export_of_a_checkpoint_removed_while_it_is_read_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str,
) -> None:
    """A writer's retention removed (or an overwrite replaced) the step an export to .tar was
    reading: it said the checkpoint was damaged ('restore an earlier checkpoint'), where a
    .safetensors export, a copy or a load say it vanished (found by a review)."""
    from safepoint import _archive

    url = str(tmp_path / "step-1")
    sp.save(url, {"w": torch.ones(1000)})
    read_document = _archive.read_document

    def the_writer_moves_on(*args: Any, **kwargs: Any) -> Any:
        found = read_document(*args, **kwargs)
        if then == "removed":
            for path in sorted(Path(url).rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
        else:
            sp.save(url, {"w": torch.zeros(1000)}, overwrite=True)
            wait_for_removals()  # the replaced data goes in a background thread
        return found

    monkeypatch.setattr(_archive, "read_document", the_writer_moves_on)
    with pytest.raises(sp.CheckpointNotFound, match=f"{then} while it was being read to "
                       "export it"):
        sp.export_checkpoint(url, tmp_path / "out.tar")
    assert not (tmp_path / "out.tar").exists()


def test_archive_holds_the_manifest_byte_for_byte(tmp_path: Path) -> None:
    """docs/format.md ("As one file: archives") and README: an archive's members are the
    checkpoint's own files byte for byte, manifest.json included: that of another writer
    (pretty-printed, unsealed, with a field this reader ignores) too. Export re-encoded the
    parsed manifest, dropping what it did not know."""
    url = str(tmp_path / "c")
    sp.save(url, {"w": torch.randn(10), "s": 1})
    document = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    document.pop("manifest_checksum")
    document["checksum"].pop("manifest")
    document["writer_note"] = "an additive field this reader does not know"
    original = json.dumps(document, indent=1).encode()
    (tmp_path / "c" / "manifest.json").write_bytes(original)
    assert sp.verify(url).ok
    sp.export_checkpoint(url, tmp_path / "c.tar")
    with tarfile.open(tmp_path / "c.tar") as tar:
        member = tar.extractfile("manifest.json")
        assert member is not None
        archived = member.read()
    assert archived == original


def test_archive_import_that_committed_does_not_raise_for_the_cleanup_after_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, s3_server: Any,
    s3_url: str, tmp_path: Path,
) -> None:
    """An import with overwrite=True published its manifest on S3, then listing the
    replaced checkpoint's objects failed: the import raised StorageError though it was
    committed. As for sp.save, the failure is logged and the import returns."""
    from safepoint.storage import _REGISTERED, open_storage
    from safepoint.testing import FaultyStorage

    published: list[str] = []

    def list_after_publish(op: str, path: str, n: int) -> bool:
        if op == "publish":
            published.append(path)
        return op == "list" and bool(published)

    monkeypatch.setitem(_REGISTERED, "faulty+s3", lambda url, options=None: FaultyStorage(
        open_storage(url.removeprefix("faulty+"), options), list_after_publish))
    options = s3_server.storage_options
    state = {"w": np.arange(1000, dtype=np.float32)}
    sp.save(str(tmp_path / "ckpt"), state)
    sp.export_checkpoint(str(tmp_path / "ckpt"), tmp_path / "ckpt.tar")
    sp.save(f"{s3_url}/dst", {"w": np.zeros(1000, dtype=np.float32)}, storage_options=options)
    info = sp.import_checkpoint(tmp_path / "ckpt.tar", f"faulty+{s3_url}/dst", overwrite=True,
                                storage_options=options)
    assert published and "could not remove the replaced data" in caplog.text
    assert info.save_id == sp.info(str(tmp_path / "ckpt")).save_id
    assert_same(sp.load(f"{s3_url}/dst", storage_options=options), state)
