"""Local filesystem storage: O_DIRECT writes of large aligned chunks, fsync of files and
directories, atomic publish by link or rename (storage layer).

O_DIRECT matters on a first call: writing through the page cache makes the kernel fault in
fresh page-cache memory, 4-10x slower than a direct write from already-touched buffers on
virtual machines that hand freed memory back to the hypervisor.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import shutil
import stat
import sys
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ._format import MANIFEST
from .errors import CorruptCheckpoint, SafepointError, StorageError
from .storage import _REGISTERED, Buffer, mapped_errors, split_url

__all__ = ["LocalStorage", "absolute_url", "location", "no_directory"]

logger = logging.getLogger(__name__)

_PAGE = 4096
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Tries to create a file whose directory a concurrent delete keeps pruning (see `write`).
_CREATE_TRIES = 3
#: Bytes a prefetch reads ahead per call; it stops between calls once the storage reads.
_READ_AHEAD_BYTES = 64 << 20
#: Threads a prefetch reads ahead on, each a window at a time from one frontier: while the
#: CPUs are busy planning and copying, a single one left the disk idle between its calls
#: (450 MB beside two busy threads: 0.28 s on one, 0.23 s on two; 0.19 s on an idle machine).
_READ_AHEAD_THREADS = 2
#: Unaligned chunks are gathered here until whole pages can go out with O_DIRECT.
_SCRATCH_BYTES = 8 << 20
#: `os.link` failures meaning "no hard link here" (file system without them, another file
#: system, too many links to the inode): `link` copies the bytes instead.
_NO_HARD_LINK = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                           errno.EMLINK})


def _address(view: memoryview) -> int:
    """The address of a contiguous writable buffer's first byte (-1 for read-only ones)."""
    if view.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def fsync_dir(path: str) -> None:
    """Make `path`'s entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Directories whose entry in their parent this process has made durable.
_DURABLE: set[str] = set()


def _below_a_file(where: str) -> FileNotFoundError:
    """A file to read whose path runs through a file (`data` a file, not a directory): it
    is missing, as the callers that report a missing file say (a damaged checkpoint)."""
    return FileNotFoundError(errno.ENOENT, "missing (a directory above it is a file)", where)


def _unless_gone(exc: OSError) -> None:
    """`os.walk`'s error handler: a directory that cannot be listed (no permission, a stale
    NFS handle) is an error, not an empty one (a step left out of a listing, an older step
    restored); one removed meanwhile (a concurrent delete) is simply gone, and so is the
    `lost+found` of a root at a file system's top, which only its owner may list."""
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return
    if isinstance(exc, PermissionError) and os.path.basename(str(exc.filename)) == "lost+found":
        return
    raise exc


def makedirs_durable(path: str) -> str | None:
    """Create `path` and its missing parents, each one's entry fsynced into its parent; also
    of directories that exist already (once per process), since a process that crashed may
    have made them without the fsync (a failure to sync those is ignored: it may be a
    read-only or foreign ancestor). Returns the topmost directory this call made, if any."""
    path = os.path.abspath(path)
    if path in _DURABLE and os.path.isdir(path):
        return None
    parent = os.path.dirname(path)
    if parent == path:
        return None
    made = makedirs_durable(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        with contextlib.suppress(OSError):
            fsync_dir(parent)
    else:
        fsync_dir(parent)
        made = made or path
    _DURABLE.add(path)
    return made


class _DirectWriter:
    """Writes a stream of chunks to a file descriptor, with O_DIRECT when the file system
    allows it: page-aligned chunks go out as they are, others through a page-aligned scratch
    buffer; the tail is padded to a page and the file truncated to its true size."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd = fd
        self.direct = direct
        self.offset = 0  # file offset of the next page-aligned write
        self.scratch: mmap.mmap | None = None
        self.pending = 0  # bytes waiting in scratch

    def _pwrite(self, view: memoryview) -> None:
        while view:
            try:
                written = os.pwrite(self.fd, view, self.offset)
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self._drop_direct()
                continue
            self.offset += _wrote(written)  # the caller's error names the file
            view = view[written:]

    def _drop_direct(self) -> None:
        import fcntl

        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False
        logger.debug("O_DIRECT refused by the file system; writing through the page cache")

    def _buffer(self) -> memoryview:
        if self.scratch is None:
            self.scratch = mmap.mmap(-1, _SCRATCH_BYTES,
                                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return memoryview(self.scratch)

    def _flush(self, final: bool) -> None:
        scratch = self._buffer()
        whole = self.pending if final else self.pending - self.pending % _PAGE
        if final and self.direct and whole % _PAGE:
            padded = -(-whole // _PAGE) * _PAGE
            scratch[whole:padded] = bytes(padded - whole)
            self._pwrite(scratch[:padded])
            self.offset -= padded - whole
        elif whole:
            self._pwrite(scratch[:whole])
        rest = self.pending - whole
        scratch[:rest] = scratch[whole : self.pending]
        self.pending = rest

    def write(self, chunk: Buffer) -> int:
        view = memoryview(chunk).cast("B")
        size = len(view)
        if not size:
            return 0
        if not self.direct:
            if self.pending:
                self._flush(final=True)
            self._pwrite(view)
            return size
        if (
            self.pending == 0
            and size % _PAGE == 0
            and _address(view) % _PAGE == 0
        ):
            self._pwrite(view)
            return size
        scratch = self._buffer()
        while view:
            room = _SCRATCH_BYTES - self.pending
            scratch[self.pending : self.pending + min(room, len(view))] = view[:room]
            self.pending += min(room, len(view))
            view = view[room:]
            if self.pending == _SCRATCH_BYTES:
                self._flush(final=False)
        return size

    def finish(self, total: int) -> None:
        self._flush(final=True)
        if os.fstat(self.fd).st_size != total:
            os.ftruncate(self.fd, total)
        os.fsync(self.fd)


def no_directory(where: str, exc: OSError) -> StorageError:
    """The error of a write to `where` whose directory cannot be made (under a link that
    leads nowhere): not a missing file to the caller, which takes FileNotFoundError for one."""
    return StorageError(
        f"writing {where} failed: its directory cannot be made there ({exc}); check the path "
        "(a link to a disk that is not mounted?)", url=where)


def absolute_url(url: str) -> str:
    """`url` with a local path (plain, or after file://) made absolute against the working
    directory now, `~` expanded, as `LocalStorage` takes it when opened; any other URL as it
    is. A root kept for later calls then names the same place after an `os.chdir`."""
    scheme, path = split_url(url)
    if scheme not in ("", "file") or scheme in _REGISTERED or not path:
        return str(url)
    path = os.path.abspath(os.path.expanduser(path))
    return f"{scheme}://{path}" if scheme else path


def location(url: str) -> str:
    """The storage location `url` names, to compare roots by: the scheme in lower case, no
    trailing slash, and a local path (plain or file://) absolute and plain, as
    `absolute_url` and `LocalStorage` take it."""
    scheme, rest = split_url(absolute_url(url))
    if scheme in ("", "file"):
        return rest
    return f"{scheme}://{rest.rstrip('/')}"


class LocalStorage:
    """Files under a local directory (plain path or file:// URL)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        _, path = split_url(url)
        if not path:
            raise SafepointError(
                f"{url!r} names no directory: pass one, such as 'ckpt/run1' ('.' for the "
                "working directory)")
        self.url = url
        self.root = os.path.abspath(os.path.expanduser(path))  # "~/ckpt" as fsspec takes it
        self.direct_io = bool((storage_options or {}).get("direct_io", True)) and _O_DIRECT != 0
        #: Set by `close` or by a read of bytes the read-ahead has not reached: ends `prefetch`.
        self._reading = threading.Event()
        #: The bytes of each file that the read-ahead has cached so far: (start, end).
        self._ahead: dict[str, tuple[int, int]] = {}
        #: The topmost directory, the root or one of its parents, that this storage made:
        #: `delete` removes up to it what it leaves empty (see `_prune`).
        self._made: str | None = None

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def _where(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}" if path else self.url

    def _makedirs(self, directory: str) -> None:
        """`makedirs_durable(directory)`, remembering the root or a parent of it made."""
        made = makedirs_durable(directory)
        if (made is not None and (made == self.root or self.root.startswith(made + os.sep))
                and (self._made is None or len(made) < len(self._made))):
            self._made = made

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Write `path` under a temporary name, fsync it and rename it into place: a file at
        its name is always whole, as an object store's is, however many processes write it
        (two copies of one checkpoint to one place); and a new inode, never the old one
        truncated, since a data file may be a hard link another checkpoint holds too."""
        full = self._full(path)
        tmp = f"{full}.tmp-{uuid.uuid4().hex}"
        with mapped_errors(self._where(path), "writing"):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            direct = self.direct_io
            for attempt in range(_CREATE_TRIES):
                try:
                    self._makedirs(os.path.dirname(full))
                except FileNotFoundError as exc:
                    # A parent pruned meanwhile (as below), or a link that leads nowhere.
                    if attempt == _CREATE_TRIES - 1:
                        raise no_directory(self._where(path), exc) from exc
                    continue
                try:
                    fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o644)
                    break
                except FileNotFoundError as exc:
                    # Another process's delete pruned the directory while it was empty (a
                    # failed rank or node removing its own file): make it again.
                    if attempt == _CREATE_TRIES - 1:
                        raise no_directory(self._where(path), exc) from exc
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    # Refused O_DIRECT (tmpfs before Linux 6.6, ramfs, some FUSE): the file
                    # was made before the refusal.
                    direct = False
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                    fd = os.open(tmp, flags, 0o644)
                    break
            try:
                try:
                    writer = _DirectWriter(fd, direct)
                    total = sum(writer.write(chunk) for chunk in chunks)
                    writer.finish(total)
                finally:
                    os.close(fd)
                try:
                    os.replace(tmp, full)
                except FileNotFoundError as exc:
                    raise _removed_meanwhile("writing", self._where(path)) from exc
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            fsync_dir(os.path.dirname(full))
            return total

    def _open_file(self, path: str) -> int:
        """A descriptor of `path` for reading, refused unless it is a regular file (a symlink
        is followed to one): a FIFO would block every read, a directory or device is no
        checkpoint's."""
        try:
            fd = os.open(self._full(path),
                         os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except NotADirectoryError as exc:
            raise _below_a_file(self._where(path)) from exc
        try:
            self._regular(path, os.fstat(fd))
        except CorruptCheckpoint:
            os.close(fd)
            raise
        return fd

    def _regular(self, path: str, info: os.stat_result) -> os.stat_result:
        """`info`, unless `path` is not a regular file."""
        if stat.S_ISREG(info.st_mode):
            return info
        mode = info.st_mode
        kind = ("directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode)
                else "socket" if stat.S_ISSOCK(mode) else "device")
        problem = f"{self._where(path)} is a {kind}, not a regular file"
        raise CorruptCheckpoint(
            f"{problem}: the checkpoint is damaged or was tampered with; restore an earlier one",
            url=self.url, problems=[problem],
        )

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        with mapped_errors(self._where(path), "reading"), open(self._open_file(path), "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        for _ in self.readinto_stretches(path, offset, buffers, sys.maxsize):
            pass

    def readinto_stretches(
        self, path: str, offset: int, buffers: Sequence[memoryview], stretch: int
    ) -> Iterator[int]:
        """`readinto`, at most `stretch` bytes per read, yielding the bytes landed so far after
        each: a caller checks every stretch while it is still in the CPU's cache (a load then
        moves each byte through memory twice, not three times), and one descriptor serves all
        the reads, so the kernel's read-ahead carries on across them."""
        start, end = self._ahead.get(path, (0, 0))
        if not (start <= offset and offset + sum(map(len, buffers)) <= end):
            self._reading.set()
        with mapped_errors(self._where(path), "reading"):
            fd = self._open_file(path)
            try:
                pending = [b for b in buffers if len(b)]
                first = landed = 0  # pending[first] is the first buffer not yet full
                while first < len(pending):
                    batch: list[memoryview] = []
                    room = stretch
                    for buffer in itertools.islice(pending, first, first + _IOV_MAX):
                        batch.append(buffer[:room] if len(buffer) > room else buffer)
                        room -= len(batch[-1])
                        if not room:
                            break
                    got = os.preadv(fd, batch, offset + landed)
                    if got == 0:
                        raise EOFError(
                            f"{self._where(path)} ends at byte {offset + landed}, before the "
                            "data the manifest records"
                        )
                    landed += got
                    while first < len(pending) and got >= len(pending[first]):
                        got -= len(pending[first])
                        first += 1
                    if got:
                        pending[first] = pending[first][got:]
                    yield landed
            finally:
                os.close(fd)

    def prefetch(self, spans: Mapping[str, tuple[int, int]]) -> None:
        """Start reading `spans` (file -> `(start, end)`) into the page cache, file after file,
        on background threads (`_READ_AHEAD_THREADS` in all, however many files), and return
        at once: a load calls it before it plans, so that the disk reads while the planning
        runs. The read-ahead ends when one of this storage's own reads asks for bytes it has
        not cached yet, as that read then drives the disk (read ahead beside them, it slowed
        cold loads of large tensors), or when it is closed. Reads of what it has cached leave
        it running: a load of many small tensors spends them copying and checking, and the
        disk would wait meanwhile. Only a hint: a file that cannot be opened or read is left
        to the reads to report."""
        if not hasattr(os, "sendfile"):
            return
        windows = [(path, start, end, window) for path, (start, end) in spans.items()
                   for window in range(start, end, _READ_AHEAD_BYTES)]
        shared = iter(windows)  # each window taken once, by whichever thread is free
        cached: dict[tuple[str, int], int] = {}  # windows read out of order -> their ends
        lock = threading.Lock()
        for _ in range(min(_READ_AHEAD_THREADS, len(windows))):
            threading.Thread(target=self._read_ahead, args=(shared, cached, lock),
                             name="safepoint-prefetch", daemon=True).start()

    def _read_ahead(
        self, windows: Iterator[tuple[str, int, int, int]], cached: dict[tuple[str, int], int],
        lock: threading.Lock,
    ) -> None:
        # sendfile to /dev/null: the kernel reads the pages into its cache and copies nothing,
        # a window per call with the GIL released. (posix_fadvise WILLNEED reads at most about
        # 8 MiB per call, and between calls this thread waited for the GIL the planning holds:
        # it cached too little to shorten W2's cold reads.)
        try:
            null = os.open(os.devnull, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        opened: tuple[str, int] | None = None  # (file, descriptor) of the last window
        try:
            for path, start, end, window in windows:
                if self._reading.is_set():
                    return
                if opened is None or opened[0] != path:
                    if opened is not None:
                        os.close(opened[1])
                        opened = None
                    try:
                        opened = (path, self._open_file(path))
                    except (OSError, CorruptCheckpoint):
                        continue
                stop = min(window + _READ_AHEAD_BYTES, end)
                offset = window
                with contextlib.suppress(OSError):
                    while offset < stop and not self._reading.is_set():
                        sent = os.sendfile(null, opened[1], offset, stop - offset)
                        if not sent:
                            break
                        offset += sent
                if offset < stop:
                    continue
                with lock:  # what is cached of the file from `start` on, without a hole
                    cached[path, window] = stop
                    reached = self._ahead.get(path, (start, start))[1]
                    while (path, reached) in cached:
                        reached = cached.pop((path, reached))
                    self._ahead[path] = (start, reached)
        finally:
            if opened is not None:
                os.close(opened[1])
            os.close(null)

    def linked_checkpoints(self) -> dict[str, str]:
        """The symbolic links directly under the root that lead to a checkpoint directory (a
        manifest inside, such as Lightning's `last.ckpt` with `save_last="link"`): name ->
        where the link points, in name order. `list` never follows links, so that nothing is
        deleted through one; a copy or a listing of a root names these."""
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {entry.name: os.readlink(entry.path)
                for entry in sorted(entries, key=lambda entry: entry.name)
                if entry.is_symlink() and os.path.isfile(os.path.join(entry.path, MANIFEST))}

    def link_on_the_way(self, path: str) -> str | None:
        """The first symbolic link on the way from the root (itself included) to `path`, as a
        local path, or None: writing through one changes what it leads to."""
        here = self.root
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts) + 1):
            if depth:
                here = os.path.join(here, parts[depth - 1])
            if os.path.islink(here):
                return here
        return None

    def size(self, path: str) -> int:
        with mapped_errors(self._where(path), "reading the size of"):
            try:
                info = os.stat(self._full(path))
            except NotADirectoryError as exc:
                raise _below_a_file(self._where(path)) from exc
            return self._regular(path, info).st_size

    def children(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """The files and the directories directly under `prefix` (the protocol's optional
        `children`); a link to a directory is a file here, as `list` never follows one."""
        files: list[str] = []
        directories: list[str] = []
        with mapped_errors(self._where(prefix), "listing"):
            try:
                entries = os.scandir(self._full(prefix))
            except NotADirectoryError as exc:  # a file: no directory there
                raise FileNotFoundError(errno.ENOENT, "no directory", self._where(prefix)) from exc
            with entries:
                for entry in entries:
                    is_dir = entry.is_dir(follow_symlinks=False)
                    (directories if is_dir else files).append(entry.name)
        return sorted(files), sorted(directories)

    def list(self, prefix: str = "") -> list[str]:
        top = self._full(prefix)
        found: list[str] = []
        with mapped_errors(self._where(prefix), "listing"):
            if os.path.isfile(top):
                return [prefix]
            for directory, _, files in os.walk(top, onerror=_unless_gone):
                rel = os.path.relpath(directory, self.root)
                found.extend(
                    name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}" for name in files
                )
        return sorted(found)

    def exists(self, path: str) -> bool:
        with mapped_errors(self._where(path), "looking for"):
            try:
                return stat.S_ISREG(os.stat(self._full(path)).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                return False

    def delete(self, paths: Iterable[str]) -> None:
        directories: set[str] = set()
        for path in paths:
            full = self._full(path)
            with mapped_errors(self._where(path), "deleting"):
                try:
                    os.unlink(full)
                except NotADirectoryError:  # no such file can be there
                    continue
                except FileNotFoundError:
                    pass  # never made (a write that could not create it): still prune
            directories.add(os.path.dirname(full))
        for directory in sorted(directories, key=len, reverse=True):
            with mapped_errors(directory, "syncing"):
                self._prune(directory)

    def _prune(self, directory: str) -> None:
        """fsync `directory` after deletes, and remove it and its parents (below the root)
        while they are empty, so no empty checkpoint directory lingers: nor the root and its
        parents that this storage made, so that a save that failed on a fresh path leaves
        no empty directory there. A root that was there before stays, even empty. A directory
        another delete removed meanwhile, or that is not empty any more (another process
        wrote into it), ends the walk: only an empty directory is removed."""
        kept = self.root if self._made is None else os.path.dirname(self._made)
        while True:
            try:
                if directory == kept or os.listdir(directory):
                    fsync_dir(directory)
                    return
                os.rmdir(directory)
            except FileNotFoundError:
                return  # removed meanwhile (a concurrent delete of the same checkpoint)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return  # a file arrived meanwhile: the directory stays
                raise
            directory = os.path.dirname(directory)

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        full = self._full(path)
        directory = os.path.dirname(full)
        tmp = f"{full}.tmp-{uuid.uuid4().hex}"
        with mapped_errors(self._where(path), "publishing"):
            try:
                self._makedirs(directory)
                # A link that leads nowhere passes for the directory until a file is made in it.
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError as exc:
                raise no_directory(self._where(path), exc) from exc
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[_wrote(os.write(fd, view), tmp) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    if overwrite:
                        os.replace(tmp, full)
                    else:
                        _link_no_clobber(tmp, full)
                except (FileExistsError, FileNotFoundError) as exc:
                    # FileNotFoundError: a writer that won the race committed, then removed
                    # this one's temporary file as a leftover.
                    if _holds(full, data):
                        return  # the same manifest, published by another copy of this save
                    if not overwrite and os.path.lexists(full):
                        raise FileExistsError(errno.EEXIST, "exists", full) from exc
                    if isinstance(exc, FileExistsError):
                        raise
                    raise _removed_meanwhile("publishing", self._where(path)) from exc
            finally:  # what a failed write, fsync or link left: never a leftover
                if os.path.exists(tmp):
                    os.unlink(tmp)
            fsync_dir(directory)

    def link(self, source_url: str, path: str) -> None:
        """Make `path` a file with the bytes of the local file at `source_url` (a plain path
        or file:// URL, usually a sibling checkpoint's data file), durable when this returns:
        a hard link, so no byte is copied; where the file system refuses one (no hard links,
        another file system, the inode's link limit) a copy, written under a temporary name
        and renamed, so a crash never leaves a partial file under `path`.

        A hard link shares the inode: this relies on data files never being rewritten in
        place (a `write` to either name would change both).

        An existing `path` of the source's size is left as it is (data file names are unique
        per save, so it is the same file, linked before).

        Raises:
            FileNotFoundError: the source is missing.
            StorageError: `source_url` is not local, `path` exists with another size (a
                foreign file in the checkpoint directory; not FileExistsError, which callers
                read as "the checkpoint is committed"), or the file system failed.
        """
        scheme, rest = split_url(source_url)
        if scheme not in ("", "file"):
            raise StorageError(
                f"cannot link {source_url} into {self._where(path)}: the source is not on the "
                "local file system (link takes a file of the same storage backend)",
                url=self._where(path),
            )
        source = os.path.abspath(rest)
        full = self._full(path)
        directory = os.path.dirname(full)
        with mapped_errors(self._where(path), f"linking {source_url} as"):
            try:
                self._makedirs(directory)
            except FileNotFoundError as exc:  # not the source missing, as callers take it
                raise no_directory(self._where(path), exc) from exc
            try:
                try:
                    os.link(source, full)
                except OSError as exc:
                    if exc.errno not in _NO_HARD_LINK:
                        raise
                    logger.debug("no hard link from %s to %s (%s); copying the bytes",
                                 source, full, os.strerror(exc.errno or 0))
                    _copy_durable(source, full)
            except FileNotFoundError:
                if not os.path.exists(source):
                    raise FileNotFoundError(errno.ENOENT, "no such file", source_url) from None
                raise
            except FileExistsError:
                self._check_same(source_url, source, path)
            fsync_dir(directory)

    def _check_same(self, source_url: str, source: str, path: str) -> None:
        """Accept an existing `path` as the linked file when its size is the source's."""
        try:
            want = os.stat(source).st_size
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such file", source_url) from None
        have = os.stat(self._full(path)).st_size
        if have != want:
            raise StorageError(
                f"cannot link {source_url} into {self._where(path)}: a file of {have} bytes is "
                f"there, not the source's {want}; the checkpoint directory holds a foreign "
                "file (remove the incomplete checkpoint, then save again)",
                url=self._where(path),
            )

    def close(self) -> None:
        """End any read-ahead (a load that failed before reading wants none); every other
        call opens and closes its own file."""
        self._reading.set()


def _removed_meanwhile(action: str, where: str) -> StorageError:
    """The error of a write whose temporary file another process removed as a leftover
    before it was renamed into place: a second writer of that path (a save, copy or import
    that committed there, a successor that took the root over, a gc)."""
    return StorageError(
        f"{action} {where} failed: its temporary file was removed while it was written, by "
        "another process writing or clearing this checkpoint (a second save, copy or import "
        "to this path, a writer that took the root over, a gc); nothing was committed by "
        "this one: use one writer per path",
        url=where,
    )


def _holds(path: str, data: bytes) -> bool:
    """Whether the file at `path` holds exactly `data` (a manifest or lease names a unique
    save id or token, so only another copy of the same save publishes the same bytes)."""
    try:
        with open(path, "rb") as file:
            return file.read(len(data) + 1) == data
    except OSError:
        return False


def _link_no_clobber(source: str, target: str) -> None:
    """Give `source` the name `target` atomically, failing if `target` exists."""
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        # File systems without hard links: rename after a check, which a concurrent writer of
        # the same checkpoint could race; one writer per checkpoint is the rule anyway.
        if os.path.exists(target):
            raise FileExistsError(errno.EEXIST, "exists", target) from exc
        os.rename(source, target)


def _wrote(count: int, path: str | None = None) -> int:
    """`count`, the bytes a write of a non-empty buffer wrote; none is an error (some FUSE and
    network filesystems report a full disk so), which a retry would spin on forever."""
    if count == 0:
        raise OSError(errno.ENOSPC, "the write wrote nothing (is the disk full?)", path)
    return count


def _copy_durable(source: str, target: str) -> None:
    """Copy `source` to `target` through a fsynced temporary file in `target`'s directory,
    given its name without replacing a file there (FileExistsError)."""
    tmp = f"{target}.tmp-{uuid.uuid4().hex}"
    try:
        shutil.copyfile(source, tmp)  # in the kernel where it can (sendfile)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _link_no_clobber(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
