"""safepoint.testing itself: MemoryStorage passes the StorageSuite, MemoryBackend roots
URLs in one store and works through sp.save/sp.load, FaultyStorage fails the operations its
predicate picks."""

from __future__ import annotations

import errno

import pytest

import safepoint as sp
from safepoint.storage import open_storage
from safepoint.testing import (
    FaultyStorage,
    MemoryBackend,
    MemoryStorage,
    StorageSuite,
    fail_nth,
    memory_scheme,
)


class TestMemoryStorage(StorageSuite):
    @pytest.fixture
    def storage(self) -> MemoryStorage:
        return MemoryStorage("memory://suite")


class TestMemoryStorageInSharedStore(StorageSuite):
    """The suite again on an instance rooted below a shared store that holds other files."""

    @pytest.fixture
    def storage(self) -> MemoryStorage:
        backend = MemoryBackend()
        backend("mem-test://other").write("a/one.bin", [b"elsewhere"])
        backend("mem-test://rootish").write("x.bin", [b"sibling with a common prefix"])
        return backend("mem-test://root")


class TestFaultyStorageNeverFailing(StorageSuite):
    """A FaultyStorage whose predicate never fires is a transparent wrapper."""

    @pytest.fixture
    def storage(self) -> FaultyStorage:
        return FaultyStorage(MemoryStorage("memory://x"), lambda op, path, n: False)


def test_memory_storages_do_not_share_files() -> None:
    a, b = MemoryStorage("memory://same"), MemoryStorage("memory://same")
    a.write("f.bin", [b"1"])
    assert not b.exists("f.bin")


def test_memory_backend_roots_urls_in_one_store() -> None:
    backend = MemoryBackend()
    backend("mem-test://run/step1").write("data/x.bin", [b"abc"])
    root = backend("mem-test://run")
    assert root.list() == ["step1/data/x.bin"]
    assert root.read("step1/data/x.bin") == b"abc"
    assert backend.files() == {"run/step1/data/x.bin": b"abc"}


def test_memory_storage_refuses_paths_leaving_its_root() -> None:
    storage = MemoryStorage("memory://root")
    with pytest.raises(ValueError, match="leaves"):
        storage.write("../escape.bin", [b"x"])


def test_memory_scheme_registers_and_restores() -> None:
    with memory_scheme("mem-restore") as backend:
        storage = open_storage("mem-restore://a/b")
        assert isinstance(storage, MemoryStorage)
        storage.write("f.bin", [b"1"])
        assert backend.files() == {"a/b/f.bin": b"1"}
    with pytest.raises(sp.SafepointError, match="mem-restore"):
        open_storage("mem-restore://a/b")


def test_save_and_load_through_memory_scheme(memory_backend: MemoryBackend) -> None:
    import torch
    state = {"w": torch.arange(10, dtype=torch.float32), "step": 7, "name": "run"}
    sp.save("mem-test://run1/final", state)
    assert "run1/final/manifest.json" in memory_backend.files()
    loaded = sp.load("mem-test://run1/final")
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["step"] == 7
    assert loaded["name"] == "run"
    assert sp.verify("mem-test://run1/final").ok


def test_faulty_storage_fails_the_nth_write() -> None:
    storage = FaultyStorage(MemoryStorage(), fail_nth("write", 2))
    storage.write("one.bin", [b"1"])
    with pytest.raises(sp.StorageError) as excinfo:
        storage.write("two.bin", [b"2"])
    assert isinstance(excinfo.value, OSError)
    assert isinstance(excinfo.value.__cause__, OSError)
    assert excinfo.value.__cause__.errno == errno.EIO
    storage.write("three.bin", [b"3"])
    assert storage.inner.list() == ["one.bin", "three.bin"]
    assert storage.counts["write"] == 3
    assert storage.failures == [("write", "two.bin", 2)]


def test_faulty_storage_fails_mid_stream() -> None:
    inner = MemoryStorage()
    storage = FaultyStorage(inner, fail_nth("write_chunk", 3))
    with pytest.raises(sp.StorageError):
        storage.write("f.bin", [b"a", b"b", b"c", b"d"])
    assert storage.counts["write_chunk"] == 3
    assert not inner.exists("f.bin")


def test_faulty_storage_fails_a_link() -> None:
    inner = MemoryStorage("memory://f")
    storage = FaultyStorage(inner, fail_nth("link", 1))
    storage.write("a/x.bin", [b"data"])
    with pytest.raises(sp.StorageError):
        storage.link("memory://f/a/x.bin", "b/x.bin")
    assert not inner.exists("b/x.bin")
    assert storage.failures == [("link", "b/x.bin", 1)]
    storage.link("memory://f/a/x.bin", "b/x.bin")
    assert inner.read("b/x.bin") == b"data"


def test_faulty_storage_link_needs_one_inside() -> None:
    """`link` is optional: a wrapped storage without it cannot link."""

    class NoLink:
        url = "memory://n"

    storage = FaultyStorage(NoLink(), lambda op, path, n: False)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="NoLink"):
        storage.link("memory://n/a", "b")


def test_memory_backend_links_between_sibling_roots() -> None:
    backend = MemoryBackend()
    backend("mem-test://run/step1").write("data/x.bin", [b"abc"])
    step2 = backend("mem-test://run/step2")
    step2.link("mem-test://run/step1/data/x.bin", "data/x.bin")
    assert step2.read("data/x.bin") == b"abc"
    with pytest.raises(FileNotFoundError):
        MemoryStorage("mem-test://run/step3").link("mem-test://run/step1/data/x.bin", "x.bin")
    with pytest.raises(sp.StorageError, match="another storage"):
        step2.link("memory://run/step1/data/x.bin", "data/y.bin")


def test_faulty_storage_predicate_sees_op_path_and_count() -> None:
    calls: list[tuple[str, str, int]] = []

    def record(op: str, path: str, n: int) -> bool:
        calls.append((op, path, n))
        return op == "delete" and path == "b"

    storage = FaultyStorage(MemoryStorage(), record)
    storage.write("a", [b"1"])
    storage.write("b", [b"2"])
    storage.read("a")
    with pytest.raises(sp.StorageError):
        storage.delete(["a", "b"])
    assert ("read", "a", 1) in calls
    assert ("write", "b", 2) in calls
    assert calls[-2:] == [("delete", "a", 1), ("delete", "b", 2)]
    assert not storage.inner.exists("a")
    assert storage.inner.exists("b")
