"""A checkpoint as one file: a tar archive, optionally compressed (gzip, bzip2, xz), holding
its data files and `manifest.json` byte for byte (API layer; what Composer's compressed
archives were). `sp.export_checkpoint` and `sp.import_checkpoint` choose it by suffix.

- Packing reads the checkpoint from any URL, checks every block against its checksum on the
  way (an archive never carries damaged bytes), and puts the manifest last: extracting the
  archive with `tar` gives a directory that loads as the checkpoint, and an extraction cut
  short leaves no manifest, so nothing half-extracted ever loads.
- Unpacking reads the manifest first (a pass over the archive that writes nothing), then
  follows the commit rule of a save: data files first, each read back and checked against
  the manifest's checksums, the manifest published last. An archive that holds anything else
  (links, sparse files, paths outside `data/`, files the manifest does not list or lists at
  another size) is refused before anything is written; one whose bytes fail their checksums
  is refused, and the files it wrote are removed.
"""

from __future__ import annotations

import collections
import io
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from ._api import CheckpointInfo, _corrupt, _publish, info_of
from ._commit import check_free, committed_files, discard_unless_committed, read_document
from ._copy import READ_AHEAD, _save_id_now, verified_pieces
from ._format import MANIFEST, Manifest, decode, is_data_file, written_by_safepoint
from .errors import CheckpointNotFound, CorruptCheckpoint, StorageError
from .storage import Storage, open_storage

__all__ = ["SUFFIXES", "pack", "unpack"]

#: Archive suffixes and their `tarfile` compression.
SUFFIXES = {".tar": "", ".tar.gz": "gz", ".tgz": "gz", ".tar.bz2": "bz2", ".tbz2": "bz2",
            ".tar.xz": "xz", ".txz": "xz"}
#: gzip's default level 9 packs a float checkpoint about 2% smaller than level 6, at half the
#: speed (~20 MB/s against ~40 MB/s).
_LEVELS = {"gz": {"compresslevel": 6}}
#: Bytes per copy of an archive member, both ways.
_PIECE_BYTES = 4 << 20
#: The largest manifest.json an import reads (it is read whole): far above any checkpoint's
#: (a few hundred bytes an entry), far below what a hostile archive's header could declare.
MAX_MANIFEST_BYTES = 1 << 30


#: `tarfile.open`, whose typed overloads want the mode as a literal.
_open_tar: Callable[..., tarfile.TarFile] = tarfile.open


class _Stream(io.RawIOBase):
    """A readable file over an iterable of byte pieces (what `tarfile.addfile` copies from)."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self._pieces = iter(pieces)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        """Fill `buffer` whole unless the pieces run out: `tarfile` takes a short read for
        the end of the data."""
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view):
            if not self._left:
                piece = next(self._pieces, None)
                if piece is None:
                    break
                self._left = memoryview(piece)
                continue
            n = min(len(view) - filled, len(self._left))
            view[filled : filled + n] = self._left[:n]
            self._left = self._left[n:]
            filled += n
        return filled


def _compression(name: str) -> str:
    return next(mode for suffix, mode in SUFFIXES.items() if name.lower().endswith(suffix))


def _member(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = mtime
    return info


def pack(url: str, out: IO[bytes], name: str,
         storage_options: dict[str, Any] | None = None) -> Manifest:
    """Write the checkpoint at `url` into `out` as an archive compressed as `name`'s suffix
    says; returns its manifest.

    Raises:
        CheckpointNotFound: nothing committed at `url`, or it was removed or replaced while
            it was read.
        CorruptCheckpoint: a block does not match its checksum.
    """
    source = open_storage(url, storage_options)
    try:
        manifest, document = read_document(source)
    except BaseException:
        source.close()
        raise
    try:
        mtime = time.time()
        compression = _compression(name)
        with (
            _open_tar(fileobj=out, mode=f"w:{compression}", format=tarfile.PAX_FORMAT,
                      copybufsize=_PIECE_BYTES, **_LEVELS.get(compression, {})) as tar,
            ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="safepoint-pack") as pool,
        ):
            for file in sorted(manifest.files):
                pieces = verified_pieces(source, manifest, file, pool)
                tar.addfile(_member(file, manifest.files[file], mtime), _Stream(pieces))
            tar.addfile(_member(MANIFEST, len(document), mtime), io.BytesIO(document))
    except CorruptCheckpoint as exc:
        # Removed or replaced while it was read (a writer's retention, an overwrite), or
        # damaged: which, its manifest now says.
        error = _corrupt(source, manifest, exc.problems or [str(exc)], "export")
        if isinstance(error, CheckpointNotFound):
            raise error from exc
        raise
    finally:
        source.close()
    return manifest


def _refused(src: str, problem: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"{src} is not an archive of a safepoint checkpoint, or is damaged: {problem}; nothing "
        "was committed: make the archive again with `safepoint export CKPT OUT.tar`",
        url=src,
    )


def _pieces(member: IO[bytes]) -> Iterator[bytes]:
    while piece := member.read(_PIECE_BYTES):
        yield piece


def _same_bytes(target: Storage, name: str, pieces: Iterable[bytes]) -> bool:
    """Whether `pieces`, joined, are the bytes of `target`'s file `name`."""
    offset = 0
    for piece in pieces:
        held = bytearray(len(piece))
        try:
            target.readinto(name, offset, [memoryview(held)])
        except (EOFError, FileNotFoundError):
            return False
        if held != piece:
            return False
        offset += len(piece)
    return offset == target.size(name)


def _contents(src: str, tar: tarfile.TarFile) -> tuple[dict[str, tarfile.TarInfo], bytes]:
    """The data members of the archive, by name in archive order, and its manifest, read
    whole: a first pass over `tar` that writes nothing, so that no member is written before
    the manifest (which comes last) says it belongs to the checkpoint, at that size. It reads
    only the headers of an uncompressed archive; a compressed one is decompressed once.

    Raises:
        CorruptCheckpoint: the archive holds anything but regular files under data/ and one
            manifest.json of at most `MAX_MANIFEST_BYTES`, or no manifest.
    """
    members: dict[str, tarfile.TarInfo] = {}
    document: bytes | None = None
    for member in tar:
        if member.isdir() and member.name.rstrip("/") in (".", "data", "./data"):
            continue
        name = member.name.removeprefix("./")
        if not member.isfile() or not (name == MANIFEST or is_data_file(name)):
            raise _refused(src, f"it holds {member.name!r}, which is not "
                           "manifest.json or a regular file under data/")
        if member.issparse():
            # tarfile fills a sparse member's holes with zeros: a few KiB of archive would
            # write any size. safepoint's export never writes one.
            raise _refused(src, f"its {name} is a sparse file (stored as its data regions, "
                           f"{member.size} bytes once expanded), which an export never holds")
        if name in members or (name == MANIFEST and document is not None):
            raise _refused(src, f"it holds {name!r} twice")
        if name != MANIFEST:
            members[name] = member
            continue
        if member.size > MAX_MANIFEST_BYTES:
            raise _refused(src, f"its {MANIFEST} declares {member.size} bytes, more than a "
                           f"manifest is ({MAX_MANIFEST_BYTES} at most), and is not read")
        reader = tar.extractfile(member)
        assert reader is not None  # a regular file has contents
        document = reader.read()
    if document is None:
        raise _refused(src, "it holds no manifest.json")
    return members, document


def unpack(src: str, url: str, *, overwrite: bool,
           storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """Commit the checkpoint in the archive file `src` at `url`, as it was saved (same save id
    and metadata).

    Two passes over the archive: the first reads its manifest (`_contents`), the second
    writes the data files, once every member is known to be one the manifest lists, at its
    size. What a hostile archive makes an import write is so bounded by what its manifest
    declares, and by the archive's size for an uncompressed one (no sparse members). A
    compressed archive is decompressed twice; an uncompressed one's first pass reads only
    its headers.

    Raises:
        CheckpointExists: `url` holds a committed checkpoint and `overwrite` is False.
        CorruptCheckpoint: `src` is not such an archive, or its bytes fail their checksums.
        FormatVersionError: the checkpoint was written by a newer format.
    """
    target = open_storage(url, storage_options)
    written: list[str] = []
    try:
        check_free(target, overwrite=overwrite)
        kept = committed_files(target) if overwrite else {}
        try:
            with tarfile.open(src, mode="r:*") as tar:
                members, document = _contents(src, tar)
                manifest = decode(document, url)
                for name in members:
                    if (name not in kept and not written_by_safepoint(name)
                            and target.exists(name)):
                        # Not a leftover of a crashed save (those it replaces): someone's file.
                        raise _refused(src, f"its {name} would replace a file of that name at "
                                       f"{url} that no committed checkpoint there lists (move "
                                       "it, or import elsewhere)")
                sizes = {name: member.size for name, member in members.items()}
                if sizes != manifest.files:
                    raise _refused(src, f"its data files {sorted(sizes)} are not those its "
                                   f"manifest lists ({sorted(manifest.files)}), or differ in "
                                   "size")
                for name, member in members.items():  # in archive order: reads go forward
                    reader = tar.extractfile(member)
                    assert reader is not None  # a regular file has contents
                    if name not in kept:
                        written.append(name)
                        target.write(name, _pieces(reader))
                    elif not _same_bytes(target, name, _pieces(reader)):
                        # The committed checkpoint's own file (data file names are unique per
                        # save): kept as it is, never rewritten or removed; the archive's
                        # bytes must be the same.
                        raise _refused(src, f"its {name} differs from the file of that name "
                                       f"that {url} holds (the same save: one of the two is "
                                       f"damaged; `safepoint verify {url}` checks the "
                                       "committed one)")
            with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="safepoint-unpack") as pool:
                for name in sorted(manifest.files):
                    collections.deque(verified_pieces(target, manifest, name, pool), maxlen=0)
        except StorageError:
            # Another import of this archive to the same place (with overwrite) that
            # committed first removes this one's files in progress as its leftovers.
            if written and _save_id_now(url, storage_options, "") == manifest.save_id:
                written.clear()
                return info_of(url, manifest)
            raise
        except CorruptCheckpoint as exc:
            if exc.url == src:
                raise
            raise _refused(src, str(exc).split(";")[0]) from exc
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise _refused(src, str(exc)) from exc
        _publish(target, manifest, document, overwrite=overwrite, tidy=overwrite,
                 background=False)
        written.clear()
        return info_of(url, manifest)
    finally:
        if written:  # unless another import of this archive committed them meanwhile
            discard_unless_committed(target, manifest.save_id, written)
        target.close()
