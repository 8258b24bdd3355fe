"""Fakes and a conformance suite for the storage seam, shipped for backend authors and for
safepoint's own tests (storage layer; stdlib only, pytest is needed only to run the suite).

- `MemoryStorage`: the `Storage` protocol over an in-memory dict, thread-safe, no global state.
- `MemoryBackend` and `memory_scheme`: a storage factory (and a context manager registering
  it) so `sp.save`/`sp.load` work on URLs like ``mem-test://run1/step5``.
- `FaultyStorage`: wraps any `Storage` and fails the operations a predicate picks.
- `StorageSuite`: test methods every backend must pass; subclass it with a `storage` fixture::

      class TestMyStorage(StorageSuite):
          @pytest.fixture
          def storage(self, tmp_path):
              return MyStorage(str(tmp_path))
"""

from __future__ import annotations

import contextlib
import errno
import posixpath
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from . import storage as _storage
from .errors import StorageError
from .storage import Buffer, Storage, split_url

__all__ = [
    "FaultyStorage",
    "MemoryBackend",
    "MemoryStorage",
    "StorageSuite",
    "fail_nth",
    "memory_scheme",
]


def _as_bytes(chunk: Buffer) -> bytes:
    """A copy of any buffer's bytes (the caller may reuse the buffer right after)."""
    view = memoryview(chunk)
    return view.tobytes() if view.format == "B" and view.ndim == 1 else view.cast("B").tobytes()


class _Store:
    """The files of one memory backend and the lock guarding them."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.lock = threading.Lock()


class MemoryStorage:
    """The `Storage` protocol over a dict of path -> bytes.

    Every instance owns its files unless it is handed the store of another (see
    `MemoryBackend`, which roots many instances in one store at their URLs' paths). A file
    written by `write` appears once its last chunk arrived; `publish` swaps bytes under the
    lock, so readers see the old or the new file, never a part.

    Args:
        url: the base URL; its path (after ``scheme://``) is where this instance is rooted in
            a shared store.
        storage_options: accepted for the factory signature and ignored.
    """

    def __init__(
        self,
        url: str = "memory://",
        storage_options: dict[str, Any] | None = None,
        *,
        store: _Store | None = None,
    ) -> None:
        self.url = url
        _, rest = split_url(url)
        self._root = posixpath.normpath(rest).strip("/") if rest.strip("/") else ""
        self._store = store if store is not None else _Store()

    def _key(self, path: str) -> str:
        """The store key of `path`, which must stay below the root."""
        norm = posixpath.normpath(path) if path else ""
        if norm in (".", ""):
            norm = ""
        if norm.startswith(("/", "../")) or norm == "..":
            raise ValueError(f"path {path!r} leaves {self.url}")
        if not self._root:
            return norm
        return f"{self._root}/{norm}" if norm else self._root

    def _missing(self, path: str) -> FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, "no such file", f"{self.url.rstrip('/')}/{path}")

    def _get(self, path: str) -> bytes:
        with self._store.lock:
            data = self._store.files.get(self._key(path))
        if data is None:
            raise self._missing(path)
        return data

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        key = self._key(path)
        data = b"".join(_as_bytes(chunk) for chunk in chunks)
        with self._store.lock:
            self._store.files[key] = data
        return len(data)

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        data = self._get(path)
        return data[start:] if end is None else data[start:end]

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        data = memoryview(self._get(path))
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            piece = data[offset : offset + len(view)]
            if len(piece) < len(view):
                raise EOFError(
                    f"{self.url.rstrip('/')}/{path} ends at byte {len(data)}, before byte "
                    f"{offset + len(view)}"
                )
            view[:] = piece
            offset += len(view)

    def size(self, path: str) -> int:
        return len(self._get(path))

    def list(self, prefix: str = "") -> list[str]:
        base = self._key("")
        top = self._key(prefix)
        with self._store.lock:
            keys = list(self._store.files)
        under = [k for k in keys if not top or k == top or k.startswith(top + "/")]
        cut = len(base) + 1 if base else 0
        return sorted(k[cut:] for k in under)

    def exists(self, path: str) -> bool:
        with self._store.lock:
            return self._key(path) in self._store.files

    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._key(path) for path in paths]
        with self._store.lock:
            for key in keys:
                self._store.files.pop(key, None)

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        key = self._key(path)
        payload = _as_bytes(data)
        with self._store.lock:
            if not overwrite and key in self._store.files:
                raise FileExistsError(errno.EEXIST, "file exists", f"{self.url}/{path}")
            self._store.files[key] = payload

    def link(self, source_url: str, path: str) -> None:
        """Make `path` a file with the bytes of the file at `source_url` (a URL of this
        storage's scheme, or a path, both naming a key of the store: in a `MemoryBackend`'s
        store any URL of the backend). An existing `path` of the source's size is left as it
        is.

        Raises:
            FileNotFoundError: the source is missing.
            StorageError: `source_url` has another scheme, or `path` exists with another size.
        """
        scheme, rest = split_url(source_url)
        if scheme and scheme != split_url(self.url)[0]:
            raise StorageError(
                f"cannot link {source_url} into {self.url}: another storage's URL",
                url=self.url,
            )
        source = posixpath.normpath(rest).strip("/")
        key = self._key(path)
        with self._store.lock:
            data = self._store.files.get(source)
            if data is None:
                raise FileNotFoundError(errno.ENOENT, "no such file", source_url)
            existing = self._store.files.get(key)
            if existing is None:
                self._store.files[key] = data  # bytes are immutable: sharing is copying
                return
        if len(existing) != len(data):
            raise StorageError(
                f"cannot link {source_url} into {self.url.rstrip('/')}/{path}: a file of "
                f"{len(existing)} bytes is there, not the source's {len(data)}",
                url=self.url,
            )

    def close(self) -> None:
        """Nothing to release; the files stay in the store."""

    def files(self) -> dict[str, bytes]:
        """A snapshot of the files below this storage's root (relative path -> bytes)."""
        return {path: self.read(path) for path in self.list("")}


class MemoryBackend:
    """A storage factory for `safepoint.storage.register`: every URL of its scheme is a
    `MemoryStorage` rooted at the URL's path in one store this object owns, so a save and a
    later load of the same URL (or of a parent URL) see the same files.

    Example:
        backend = MemoryBackend()
        safepoint.storage.register("mem-test", backend)
        sp.save("mem-test://run1/final", state)
    """

    def __init__(self) -> None:
        self._store = _Store()

    def __call__(self, url: str, storage_options: dict[str, Any] | None = None) -> MemoryStorage:
        return MemoryStorage(url, storage_options, store=self._store)

    def files(self) -> dict[str, bytes]:
        """A snapshot of every file in the store (full path -> bytes)."""
        with self._store.lock:
            return dict(self._store.files)


@contextlib.contextmanager
def memory_scheme(scheme: str = "mem-test") -> Iterator[MemoryBackend]:
    """Register a fresh `MemoryBackend` for `scheme` while the block runs; whatever was
    registered for `scheme` before is restored afterwards.

    Example:
        with memory_scheme("mem-test") as backend:
            sp.save("mem-test://a", state)
            assert "a/manifest.json" in backend.files()
    """
    scheme = scheme.lower()
    registered = _storage._REGISTERED
    had, previous = scheme in registered, registered.get(scheme)
    backend = MemoryBackend()
    _storage.register(scheme, backend)
    try:
        yield backend
    finally:
        if had and previous is not None:
            registered[scheme] = previous
        else:
            registered.pop(scheme, None)


#: `fail_on(op, path, n)`: whether the n-th call (1-based, counted per op) of `op` on `path`
#: fails. Ops: write, write_chunk (each chunk a write consumes), read, readinto, size, list,
#: exists, delete (each path), publish, link.
FailurePredicate = Callable[[str, str, int], bool]


def fail_nth(op: str, n: int) -> FailurePredicate:
    """A predicate failing exactly the `n`-th (1-based) call of `op`."""

    def predicate(name: str, path: str, count: int) -> bool:
        return name == op and count == n

    return predicate


class FaultyStorage:
    """Wraps a `Storage` and raises `StorageError` (an `OSError`, with an `EIO` `OSError` as
    its cause) from the operations `fail_on` picks, in the style of httpx's `MockTransport`.

    Attributes:
        counts: calls so far per op name.
        failures: `(op, path, n)` of every injected failure.
    """

    def __init__(self, inner: Storage, fail_on: FailurePredicate) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail_on = fail_on
        self.counts: Counter[str] = Counter()
        self.failures: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    def _check(self, op: str, path: str) -> None:
        with self._lock:
            self.counts[op] += 1
            n = self.counts[op]
        if self.fail_on(op, path, n):
            with self._lock:
                self.failures.append((op, path, n))
            cause = OSError(errno.EIO, f"injected failure of {op} #{n}", path)
            raise StorageError(
                f"{op} {self.url}/{path} failed: injected failure #{n}", url=self.url
            ) from cause

    def _chunks(self, path: str, chunks: Iterable[Buffer]) -> Iterator[Buffer]:
        for chunk in chunks:
            self._check("write_chunk", path)
            yield chunk

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        self._check("write", path)
        return self.inner.write(path, self._chunks(path, chunks))

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self._check("read", path)
        return self.inner.read(path, start, end)

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self._check("readinto", path)
        self.inner.readinto(path, offset, buffers)

    def size(self, path: str) -> int:
        self._check("size", path)
        return self.inner.size(path)

    def list(self, prefix: str = "") -> list[str]:
        self._check("list", prefix)
        return self.inner.list(prefix)

    def exists(self, path: str) -> bool:
        self._check("exists", path)
        return self.inner.exists(path)

    def delete(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._check("delete", path)
            self.inner.delete([path])

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        self._check("publish", path)
        self.inner.publish(path, data, overwrite=overwrite)

    def link(self, source_url: str, path: str) -> None:
        """Forward `link` (checked as op ``link`` on `path`) to the inner storage.

        Raises:
            NotImplementedError: the inner storage has no `link` (an optional method).
        """
        self._check("link", path)
        link: Callable[[str, str], None] | None = getattr(self.inner, "link", None)
        if link is None:
            raise NotImplementedError(f"{type(self.inner).__name__} has no link method")
        link(source_url, path)

    def close(self) -> None:
        self.inner.close()


# -- conformance suite -------------------------------------------------------------------------


@contextlib.contextmanager
def _raises(kind: type[BaseException]) -> Iterator[None]:
    """Like `pytest.raises`, without importing pytest at module import."""
    try:
        yield
    except kind:
        return
    raise AssertionError(f"expected {kind.__name__}")


def _pattern(nbytes: int, seed: int = 0) -> bytes:
    """Deterministic random bytes, so a misplaced range is caught."""
    return random.Random(seed).randbytes(nbytes)


def _linker(storage: Storage) -> Callable[[str, str], None]:
    """`storage.link`, or a skip of the test for a backend without the optional method."""
    link: Callable[[str, str], None] | None = getattr(storage, "link", None)
    if link is None:
        import pytest

        pytest.skip(f"{type(storage).__name__} has no link (optional)")
    return link


def _url(storage: Storage, path: str) -> str:
    """The full URL of `path` under `storage`."""
    return f"{storage.url.rstrip('/')}/{path}"


class StorageSuite:
    """Behaviour every `Storage` must have. Subclass it in a test module and provide a
    `storage` fixture returning an empty storage (fsspec's `tests/abstract` style).

    Nothing here depends on one backend's layout: only the protocol's methods are used.
    """

    def test_is_storage(self, storage: Storage) -> None:
        assert isinstance(storage, Storage)
        assert isinstance(storage.url, str)

    def test_write_read_round_trip(self, storage: Storage) -> None:
        data = _pattern(10_000)
        assert storage.write("a.bin", [data[:3000], data[3000:7001], data[7001:]]) == len(data)
        assert storage.read("a.bin") == data
        assert storage.read("a.bin", 100) == data[100:]
        assert storage.read("a.bin", 100, 4200) == data[100:4200]
        assert storage.size("a.bin") == len(data)

    def test_write_accepts_any_buffer(self, storage: Storage) -> None:
        chunks: list[Buffer] = [b"ab", bytearray(b"cd"), memoryview(b"xxefxx")[2:4]]
        assert storage.write("buffers.bin", chunks) == 6
        assert storage.read("buffers.bin") == b"abcdef"

    def test_write_skips_empty_chunks(self, storage: Storage) -> None:
        chunks: list[Buffer] = [bytearray(), b"ab", memoryview(bytearray(0)), b"", b"c"]
        assert storage.write("gaps.bin", chunks) == 3
        assert storage.read("gaps.bin") == b"abc"

    def test_write_copies_each_chunk_before_the_next(self, storage: Storage) -> None:
        """The caller may reuse a chunk's buffer once the next chunk is requested."""
        buffer = bytearray(4096)

        def chunks() -> Iterator[memoryview]:
            for value in range(5):
                buffer[:] = bytes([value]) * len(buffer)
                yield memoryview(buffer)

        storage.write("reused.bin", chunks())
        assert storage.read("reused.bin") == b"".join(bytes([v]) * 4096 for v in range(5))

    def test_write_empty_and_nested(self, storage: Storage) -> None:
        assert storage.write("deep/er/empty.bin", []) == 0
        assert storage.exists("deep/er/empty.bin")
        assert storage.size("deep/er/empty.bin") == 0
        assert storage.read("deep/er/empty.bin") == b""

    def test_write_replaces_a_file(self, storage: Storage) -> None:
        storage.write("f.bin", [b"long old contents"])
        storage.write("f.bin", [b"new"])
        assert storage.read("f.bin") == b"new"

    def test_missing_file(self, storage: Storage) -> None:
        with _raises(FileNotFoundError):
            storage.read("nope.bin")
        with _raises(FileNotFoundError):
            storage.size("nope.bin")
        with _raises(FileNotFoundError):
            storage.readinto("nope.bin", 0, [memoryview(bytearray(4))])
        assert not storage.exists("nope.bin")

    def test_readinto_scatters_into_buffers(self, storage: Storage) -> None:
        data = _pattern(9000, seed=3)
        storage.write("s.bin", [data])
        sizes = [1, 0, 4095, 4096, 7]
        buffers = [memoryview(bytearray(n)) for n in sizes]
        storage.readinto("s.bin", 500, buffers)
        position = 500
        for size, buffer in zip(sizes, buffers, strict=True):
            assert bytes(buffer) == data[position : position + size]
            position += size

    def test_readinto_slices_of_one_buffer(self, storage: Storage) -> None:
        data = _pattern(2048, seed=5)
        storage.write("s.bin", [data])
        target = bytearray(2048)
        view = memoryview(target)
        storage.readinto("s.bin", 0, [view[:1000], view[1000:]])
        assert bytes(target) == data

    def test_readinto_past_the_end_is_eof(self, storage: Storage) -> None:
        storage.write("short.bin", [b"0123456789"])
        with _raises(EOFError):
            storage.readinto("short.bin", 4, [memoryview(bytearray(4)), memoryview(bytearray(4))])
        with _raises(EOFError):
            storage.readinto("short.bin", 10, [memoryview(bytearray(1))])
        exact = memoryview(bytearray(6))
        storage.readinto("short.bin", 4, [exact])
        assert bytes(exact) == b"456789"

    def test_list_is_recursive_and_relative(self, storage: Storage) -> None:
        for path in ("top.bin", "a/one.bin", "a/b/two.bin", "ab/three.bin"):
            storage.write(path, [b"x"])
        assert sorted(storage.list()) == ["a/b/two.bin", "a/one.bin", "ab/three.bin", "top.bin"]
        assert sorted(storage.list("a")) == ["a/b/two.bin", "a/one.bin"]
        assert sorted(storage.list("a/")) == ["a/b/two.bin", "a/one.bin"]
        assert storage.list("a/b") == ["a/b/two.bin"]
        assert storage.list("top.bin") == ["top.bin"]

    def test_list_missing_prefix_is_empty(self, storage: Storage) -> None:
        storage.write("x/y.bin", [b"1"])
        try:
            found = storage.list("nothing-here")
        except FileNotFoundError:
            found = []
        assert found == []

    def test_exists_is_for_files(self, storage: Storage) -> None:
        storage.write("d/f.bin", [b"1"])
        assert storage.exists("d/f.bin")
        assert not storage.exists("d/g.bin")
        assert not storage.exists("d")

    def test_delete(self, storage: Storage) -> None:
        for path in ("keep.bin", "d/gone1.bin", "d/gone2.bin"):
            storage.write(path, [b"1"])
        storage.delete(["d/gone1.bin", "d/gone2.bin", "never-existed.bin"])
        assert not storage.exists("d/gone1.bin")
        assert not storage.exists("d/gone2.bin")
        assert storage.exists("keep.bin")
        assert sorted(storage.list()) == ["keep.bin"]
        storage.delete([])

    def test_publish_creates(self, storage: Storage) -> None:
        storage.publish("ckpt/manifest.json", b"{}", overwrite=False)
        assert storage.read("ckpt/manifest.json") == b"{}"
        assert storage.list("ckpt") == ["ckpt/manifest.json"]

    def test_publish_without_overwrite_refuses(self, storage: Storage) -> None:
        storage.publish("m.json", b"first", overwrite=False)
        with _raises(FileExistsError):
            storage.publish("m.json", b"second", overwrite=False)
        assert storage.read("m.json") == b"first"
        assert storage.list() == ["m.json"]

    def test_publish_with_overwrite_replaces(self, storage: Storage) -> None:
        storage.publish("m.json", b"first, and longer", overwrite=False)
        storage.publish("m.json", b"second", overwrite=True)
        assert storage.read("m.json") == b"second"
        assert storage.list() == ["m.json"]

    def test_publish_is_atomic_for_readers(self, storage: Storage) -> None:
        versions = [_pattern(64 << 10, seed=s) for s in range(2)]
        storage.publish("m.json", versions[0], overwrite=False)
        seen: list[bytes] = []
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                seen.append(storage.read("m.json"))

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for i in range(40):
                storage.publish("m.json", versions[(i + 1) % 2], overwrite=True)
        finally:
            stop.set()
            thread.join()
        assert seen
        assert all(data in versions for data in seen)

    def test_concurrent_readinto(self, storage: Storage) -> None:
        data = _pattern(1 << 20, seed=9)
        storage.write("big.bin", [data[: 1 << 19], data[1 << 19 :]])
        ranges = [(start, 40_000 + start % 777) for start in range(0, 900_000, 37_000)]
        results: dict[int, bytes] = {}
        errors: list[BaseException] = []

        def work(start: int, nbytes: int) -> None:
            try:
                for _ in range(3):
                    buffer = bytearray(nbytes)
                    storage.readinto("big.bin", start, [memoryview(buffer)])
                    results[start] = bytes(buffer)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=r) for r in ranges]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        for start, nbytes in ranges:
            assert results[start] == data[start : start + nbytes]

    # -- link (optional: skipped for a backend without it) ------------------------------------

    def test_link_round_trip(self, storage: Storage) -> None:
        link = _linker(storage)
        data = _pattern(70_000, seed=11)
        storage.write("a/x.bin", [data])
        link(_url(storage, "a/x.bin"), "b/x.bin")
        assert storage.read("b/x.bin") == data
        assert storage.size("b/x.bin") == len(data)
        assert storage.read("a/x.bin") == data, "the source stays as it is"
        assert sorted(storage.list()) == ["a/x.bin", "b/x.bin"]

    def test_write_over_a_linked_file_leaves_its_source(self, storage: Storage) -> None:
        link = _linker(storage)
        storage.write("a/x.bin", [b"shared bytes"])
        link(_url(storage, "a/x.bin"), "b/x.bin")
        storage.write("b/x.bin", [b"new"])
        assert storage.read("b/x.bin") == b"new"
        assert storage.read("a/x.bin") == b"shared bytes"

    def test_link_into_nested_directories(self, storage: Storage) -> None:
        link = _linker(storage)
        storage.write("a/x.bin", [b"nested"])
        link(_url(storage, "a/x.bin"), "deep/er/still/x.bin")
        assert storage.read("deep/er/still/x.bin") == b"nested"
        assert storage.list("deep") == ["deep/er/still/x.bin"]

    def test_link_empty_file(self, storage: Storage) -> None:
        link = _linker(storage)
        storage.write("a/empty.bin", [])
        link(_url(storage, "a/empty.bin"), "b/empty.bin")
        assert storage.exists("b/empty.bin")
        assert storage.read("b/empty.bin") == b""

    def test_link_missing_source(self, storage: Storage) -> None:
        link = _linker(storage)
        storage.write("a/other.bin", [b"1"])
        with _raises(FileNotFoundError):
            link(_url(storage, "a/nope.bin"), "b/x.bin")
        assert not storage.exists("b/x.bin")

    def test_link_onto_a_file_of_the_same_size_keeps_it(self, storage: Storage) -> None:
        """The same name is the same file (names are unique per save): left as it is."""
        link = _linker(storage)
        storage.write("a/x.bin", [b"source"])
        storage.write("b/x.bin", [b"theirs"])
        link(_url(storage, "a/x.bin"), "b/x.bin")
        assert storage.read("b/x.bin") == b"theirs"
        link(_url(storage, "a/x.bin"), "c/x.bin")
        link(_url(storage, "a/x.bin"), "c/x.bin")  # again: a no-op
        assert storage.read("c/x.bin") == b"source"

    def test_link_onto_a_file_of_another_size_refuses(self, storage: Storage) -> None:
        link = _linker(storage)
        storage.write("a/x.bin", [b"source"])
        storage.write("b/x.bin", [b"a foreign file"])
        try:
            link(_url(storage, "a/x.bin"), "b/x.bin")
        except FileExistsError as exc:
            raise AssertionError("FileExistsError means a committed checkpoint") from exc
        except StorageError:
            pass
        else:
            raise AssertionError("expected StorageError")
        assert storage.read("b/x.bin") == b"a foreign file"
        assert storage.read("a/x.bin") == b"source"
