"""The storage seam: a small protocol over a base URL, and the registry that picks a backend by
URL scheme (storage layer). Public for backend authors.

Third-party packages add a scheme through the entry point group ``safepoint.storage``::

    [project.entry-points."safepoint.storage"]
    myscheme = "mypackage.module:factory"   # factory(url, storage_options) -> Storage
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from .errors import SafepointError, StorageError

__all__ = ["Storage", "StorageFactory", "open_storage", "register", "split_url"]

#: Accepted by `Storage.write`: anything exposing the buffer protocol.
Buffer = Any
StorageFactory = Callable[[str, "dict[str, Any] | None"], "Storage"]


@runtime_checkable
class Storage(Protocol):
    """Bytes-level access to the files under one base URL.

    Paths are relative to the base URL and `/`-separated. Every method may be called from any
    thread, concurrently. A missing file raises `FileNotFoundError`; any other I/O failure
    raises `StorageError` with the backend's error as `__cause__`.

    A save calls `write` once per data file (from a background thread), then `publish` once
    for the manifest, which must be the last thing to become visible. A load calls `read` for
    the manifest, then `readinto` for data, from several threads at once.

    Optional methods (not part of the protocol's checked members, so backends without them
    stay `Storage`s). A load uses the first when a backend has it:

    ``readinto_stretches(self, path: str, offset: int, buffers: Sequence[memoryview],
    stretch: int) -> Iterator[int]``
        `readinto`, at most `stretch` bytes per read, yielding the bytes landed so far after
        each read: the load checks each stretch while it is still in the CPU's cache (the
        local disk's backend has it). It replaces `readinto` for loads, except where a
        subclass (or the instance) overrides `readinto` below the class that defines it: a
        subclass that counts or alters reads keeps seeing every one. A wrapper that delegates
        by other means must leave it out or wrap it too.

    Incremental saves need the second; a backend without it cannot take them:

    ``link(self, source_url: str, path: str) -> None``
        Make `path` a file with the bytes of the file at `source_url` (a full URL or plain
        path of the same backend, usually a data file of a sibling checkpoint), without
        copying the bytes through the client, durable when this returns (with its directory
        entry): a hard link on a local disk, a server-side copy on an object store. An
        existing `path` with the source's size is left as it is (data file names are unique
        per save and files are immutable, so it is the same file). Raises
        `FileNotFoundError` when the source is missing, `StorageError` for any other failure,
        a `path` of another size included (a foreign file, never replaced).

    `safepoint ls`, and a read that finds no manifest, use the third when a backend has it
    (through the function `children`), and `list` otherwise:

    ``children(self, prefix: str = "") -> tuple[list[str], list[str]]``
        The names (not paths) of the files and of the directories directly under `prefix`,
        each list sorted, listing nothing deeper: `ls DIR` looks only at or directly under
        DIR, however large the trees below it, and whatever below them cannot be listed. A
        link to a directory counts as a file. Raises `FileNotFoundError` when `prefix` is
        not there, `StorageError` for any other failure.
    """

    url: str

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Create `path` holding the concatenation of `chunks`, durable when this returns
        (fsynced, with its directory entry). A chunk may be reused by the caller as soon as the
        next one is requested. Returns the bytes written."""
        ...

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes `start` to `end` (to the end of file when None) of `path`."""
        ...

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill `buffers`, in order, with the bytes of `path` from `offset` on.

        Raises:
            EOFError: the file ends before the buffers are full.
        """
        ...

    def size(self, path: str) -> int:
        """The size of `path` in bytes."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Every file under `prefix` (recursively), as paths relative to the base URL."""
        ...

    def exists(self, path: str) -> bool:
        """Whether file `path` exists."""
        ...

    def delete(self, paths: Iterable[str]) -> None:
        """Remove files; a missing one is not an error."""
        ...

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        """Make `data` visible at `path` atomically and durably: a reader sees the old file
        or the whole new one, never a part.

        Raises:
            FileExistsError: `path` exists and `overwrite` is False.
        """
        ...

    def close(self) -> None:
        """Release connections and file handles."""
        ...


_BUILTIN: dict[str, str] = {
    "": "safepoint._storage_local:LocalStorage",
    "file": "safepoint._storage_local:LocalStorage",
}
#: Every other scheme: fsspec's filesystem for it (it raises when fsspec does not know it).
_FSSPEC = "safepoint._storage_fsspec:FsspecStorage"
_REGISTERED: dict[str, StorageFactory] = {}


def register(scheme: str, factory: StorageFactory) -> None:
    """Use `factory(url, storage_options)` for URLs of `scheme` in this process (entry points
    do the same for installed packages)."""
    _REGISTERED[scheme] = factory


def split_url(url: str) -> tuple[str, str]:
    """(scheme, rest): `("", "/ckpt/a")` for a plain path, `("s3", "bucket/a")` for s3://.

    Raises:
        SafepointError: `url` is neither a str nor an `os.PathLike` of one: None (an unset
            setting) or bytes would otherwise name a directory 'None' or "b'/ckpt'" under
            the working directory.
    """
    text = os.fspath(url) if isinstance(url, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise SafepointError(
            f"{url!r} is not a checkpoint location: pass a path (a str or os.PathLike) or a "
            "URL string such as 's3://bucket/run1' (is the setting that names it unset?)")
    scheme, sep, rest = text.partition("://")
    return (scheme.lower(), rest) if sep else ("", text)


def _load(dotted: str) -> StorageFactory:
    module, _, name = dotted.partition(":")
    factory: StorageFactory = getattr(importlib.import_module(module), name)
    return factory


def _factory(scheme: str, url: str) -> StorageFactory:
    if scheme in _REGISTERED:
        return _REGISTERED[scheme]
    if scheme in _BUILTIN:
        return _load(_BUILTIN[scheme])
    for ep in entry_points(group="safepoint.storage"):
        if ep.name == scheme:
            factory: StorageFactory = ep.load()
            return factory
    return _load(_FSSPEC)


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The backend for `url`, chosen by its scheme: one `register`ed in this process, the
    local filesystem for plain paths and file://, one from the ``safepoint.storage`` entry
    points, else fsspec's filesystem for the scheme (s3, gs, az, memory, ...), given
    `storage_options` as they are.

    Raises:
        SafepointError: `storage_options` is not a mapping (a JSON string read from a flag or
            an environment variable, a list of pairs), no backend handles the scheme, or its
            fsspec driver is not installed (the message names the package).
    """
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise SafepointError(
            f"cannot open {url}: storage_options must be a dict of the backend's options, "
            f"not a {type(storage_options).__name__}; pass a dict (json.loads a JSON string "
            "first)",
            url=str(url),
        )
    scheme, _ = split_url(url)
    return _factory(scheme, url)(str(url), storage_options)


def children(storage: Storage, prefix: str = "") -> tuple[list[str], list[str]]:
    """The names of the files and of the directories directly under `prefix`: the backend's
    optional `children` where it has one, else taken from its whole `list(prefix)`.

    Raises:
        FileNotFoundError: nothing is there.
    """
    direct: Callable[[str], tuple[list[str], list[str]]] | None = getattr(
        storage, "children", None)
    if direct is not None:
        return direct(prefix)
    files: set[str] = set()
    directories: set[str] = set()
    for path in storage.list(prefix):
        name, deeper, _ = path.removeprefix(f"{prefix}/" if prefix else "").partition("/")
        (directories if deeper else files).add(name)
    return sorted(files), sorted(directories)


@contextlib.contextmanager
def mapped_errors(url: str, action: str) -> Iterator[None]:
    """Turn a backend's I/O failure into `StorageError`, keeping the signals callers act on
    (missing file, existing file, short read) as they are."""
    try:
        yield
    except (FileNotFoundError, FileExistsError, EOFError, SafepointError):
        raise
    except OSError as exc:
        raise StorageError(
            f"{action} {url} failed: {exc}; check the path, permissions and free space, then "
            "retry",
            url=url,
        ) from exc
