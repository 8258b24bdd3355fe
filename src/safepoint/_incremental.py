"""Incremental saves (engine layer): a save of a series writes only the checksum blocks whose
bytes changed since the series' last commit, and shares the data files that hold the others.

Each block of each entry (`block_bytes` of it, counted from the entry's first byte) is hashed
with xxh3-128 as the save streams it, and the hashes are recorded in the manifest (so a
restarted job can go on sharing). A block whose entry path, index, size and hash are those of
a block of the last commit is not written: the new manifest's chunk rows point at
the data file that holds it, and that file joins the new checkpoint's directory under its own
name (a hard link on a local disk, a server-side copy on an object store) before the manifest
is published. So each checkpoint holds every file it references, and loading, verifying,
copying, retention and `gc` treat it as any other: deleting an earlier step removes only its
own names. An entry then has several chunks, its bytes their concatenation, as the format
allows; chunk boundaries fall on block boundaries, so its digests read as those of a full
save.

A distributed save matches pieces the same way: each rank streams the pieces it writes (a
shard, a slab of a replicated tensor, a whole entry), and a block of a piece is matched by the
entry's path, the piece's box and the block's index within the piece. A piece kept in several
files is several consecutive chunks with its box (format version 3).

The data files shared with the next save keep alive the old copies of blocks that changed
since they were written: files are shared, the most referenced first (by the share of their
bytes the last commit references), while those dead bytes stay within three times all the
bytes the last commit references. So what a series holds stays within four times a
checkpoint, and a frozen part, however small beside what changes, stays in the file that
first held it: written once, then shared. Blocks are shared only from a commit
checksummed with the algorithm this save uses, since a chunk's digests are copied as they
are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice

import xxhash

from ._checksum import DEFAULT_ALGORITHM
from ._commit import discard_unless_committed, wait_for_removals
from ._format import BLOCK_BYTES, Box, Chunk, Manifest, aligned
from ._plan import WriteItem
from ._types import StatePath
from .errors import CorruptCheckpoint
from .storage import Storage

__all__ = ["Increment", "Lineage", "Piece", "piece"]

logger = logging.getLogger(__name__)

#: The data files shared hold at most this many times the bytes the last commit references.
_SHARE_RATIO = 4

#: A piece of an entry a save streams: its path and its box (None: the whole entry).
Piece = tuple[StatePath, Box | None]


def piece(path: StatePath, box: Box | None, shape: Sequence[int] | None) -> Piece:
    """How blocks name the piece `box` of the entry at `path` of global `shape`: a piece
    that is the whole tensor, or has no box, by the path alone (whether the manifest stores
    it as a plain entry or as one piece of a sharded entry beside empty ones)."""
    if box is None or shape is None or box == ((0,) * len(shape), tuple(shape)):
        return path, None
    return path, box


@dataclass(frozen=True, slots=True)
class _Block:
    """Where one block of an entry lies in a committed checkpoint, and what it holds."""

    hash: str
    file: str
    offset: int
    nbytes: int
    digest: int


@dataclass(frozen=True)
class Lineage:
    """What the next incremental save of a series needs of its last commit.

    Attributes:
        url: the committed checkpoint.
        blocks: (entry path, piece box or None for the whole tensor (see `piece`), block
            index in the piece) -> the block's place, size, hash and digest.
        files: the data files a later save may share, with their sizes.
    """

    url: str
    blocks: dict[tuple[StatePath, Box | None, int], _Block]
    files: dict[str, int]

    @classmethod
    def of(cls, url: str, manifest: Manifest) -> Lineage | None:
        """The lineage of the checkpoint at `url` from its manifest's block hashes (None
        when it has none: a full save's; or when its blocks or checksums are not the ones a
        save writes now: a shared chunk keeps its digests, which must read as this save's);
        an entry whose hashes do not match its blocks is left out. Its data files may be
        shared as `_shareable` picks them."""
        if (not manifest.hashes or manifest.block_bytes != BLOCK_BYTES
                or manifest.checksum != DEFAULT_ALGORITHM):
            return None
        block = manifest.block_bytes
        blocks: dict[tuple[StatePath, Box | None, int], _Block] = {}
        live: dict[str, int] = dict.fromkeys(manifest.files, 0)
        for path, entry in manifest.entries.items():
            for chunk in entry.chunks:
                live[chunk.file] += chunk.nbytes
            hashes = manifest.hashes.get(path)
            if hashes is None or len(hashes) != sum(len(c.digests) for c in entry.chunks):
                continue
            hashed = iter(hashes)
            box: Box | None = None
            index = 0  # in the piece: consecutive chunks with one box
            for chunk in entry.chunks:
                if chunk.box != box:
                    box, index = chunk.box, 0
                key = piece(path, box, entry.shape)
                for n, start in enumerate(range(0, chunk.nbytes, block)):
                    blocks[key[0], key[1], index] = _Block(next(hashed), chunk.file,
                                                      chunk.offset + start,
                                                      min(block, chunk.nbytes - start),
                                                      chunk.digests[n])
                    index += 1
        return cls(url, blocks, _shareable(manifest.files, live))


def _shareable(sizes: Mapping[str, int], live: Mapping[str, int]) -> dict[str, int]:
    """The data files (name -> size) a later save may share, given the bytes of each that
    the last commit references (`live`): the most referenced first (by the share of their
    size), while the bytes they hold unreferenced stay within `_SHARE_RATIO` - 1 times all
    the bytes it references. A file that does not fit has its unchanged blocks written
    anew, and ages out with its steps."""
    budget = (_SHARE_RATIO - 1) * sum(live.values())
    shared: dict[str, int] = {}
    for name in sorted(sizes, key=lambda name: (1 - live[name] / sizes[name] if sizes[name]
                                                else 0.0, name)):
        dead = max(0, sizes[name] - live[name])
        if dead <= budget:
            budget -= dead
            shared[name] = sizes[name]
    return shared


@dataclass(slots=True)
class _Run:
    """Consecutive blocks of one entry in one data file (`file` None: the new one)."""

    file: str | None
    offset: int
    nbytes: int
    digests: list[int] = field(default_factory=list)


class Increment:
    """One save of a series written against `previous`, its last commit (None: everything
    is written, and hashed for the next save).

    Attributes:
        name: the new data file (set by `stream`).
        reused: bytes of blocks not written because `previous` holds them.
        next: the `Lineage` of this save, once `committed` was called.
    """

    def __init__(self, previous: Lineage | None) -> None:
        self.previous = previous
        self.name = ""
        self.reused = 0
        self.next: Lineage | None = None
        self._runs: dict[str, list[_Run]] = {}
        self._hashes: dict[str, list[str]] = {}

    def stream(
        self, items: Iterable[tuple[WriteItem, memoryview]], name: str,
        pieces: Mapping[str, Piece] | None = None,
    ) -> Iterator[tuple[WriteItem, memoryview]]:
        """`items` (a save's stream, whole entries or consecutive parts of one starting on
        its block boundaries) less the blocks `previous` holds, laid out anew for the new
        data file `name`, in order. An item's path is its entry's, or a key of `pieces`
        naming the piece it holds. Each item of `items` is hashed whole before any of it is
        passed on, so its memory must stay as it is until the next one is requested (as
        `SaveData.stream` promises)."""
        self.name = name
        block = BLOCK_BYTES
        end = 0
        key: str | None = None
        piece: Piece = ("", None)  # the piece `key` names
        origin = 0
        runs: list[_Run] = []
        for item, data in items:
            if item.path != key:
                key, origin = item.path, item.offset
                piece = pieces[key] if pieces is not None else (key, None)
                runs = self._runs[key] = []
                hashes = self._hashes[key] = []
            first = (item.offset - origin) // block
            # The item's blocks in order: a block the previous commit holds, or a range of
            # `data` to write. Decided for the whole item before any of it is passed on.
            plan: list[_Block | tuple[int, int]] = []
            for index, start in enumerate(range(0, item.nbytes, block), first):
                view = data[start : start + block]
                digest = xxhash.xxh3_128_hexdigest(view)
                hashes.append(digest)
                old = self._held(piece, index, len(view), digest)
                if old is not None:
                    plan.append(old)
                elif plan and isinstance(plan[-1], tuple):
                    plan[-1] = (plan[-1][0], start + len(view))
                else:
                    plan.append((start, start + len(view)))
            if not item.nbytes:
                plan.append((0, 0))
            for step in plan:
                last = runs[-1] if runs else None
                joins = last is not None and last.nbytes % block == 0
                if isinstance(step, _Block):
                    self.reused += step.nbytes
                    if (joins and last is not None and last.file == step.file
                            and last.offset + last.nbytes == step.offset):
                        last.nbytes += step.nbytes
                        last.digests.append(step.digest)
                    else:
                        runs.append(_Run(step.file, step.offset, step.nbytes, [step.digest]))
                    continue
                start, stop = step
                nbytes = stop - start
                if (joins and last is not None and last.file is None and nbytes
                        and last.offset + last.nbytes == end):
                    offset = end
                    last.nbytes += nbytes
                else:
                    offset = aligned(end, nbytes)
                    runs.append(_Run(None, offset, nbytes))
                end = offset + nbytes
                yield WriteItem(item.path, offset, nbytes), data[start:stop]

    def _held(self, piece: Piece, index: int, nbytes: int, digest: str) -> _Block | None:
        """The previous commit's block `index` of `piece`, if it holds these very bytes in a
        file that may be shared."""
        previous = self.previous
        if previous is None:
            return None
        old = previous.blocks.get((piece[0], piece[1], index))
        if old is None or old.nbytes != nbytes or old.hash != digest:
            return None
        return old if old.file in previous.files else None

    def chunks(self, digests: dict[str, list[int]]) -> dict[str, tuple[Chunk, ...]]:
        """Each streamed entry's (or piece's) chunks, given the digests the writer computed
        for the new data file (per item path, in order); chunks carry no box."""
        block = BLOCK_BYTES
        out: dict[str, tuple[Chunk, ...]] = {}
        for key, runs in self._runs.items():
            written = iter(digests.get(key, ()))
            out[key] = tuple(
                Chunk(self.name, run.offset, run.nbytes,
                      tuple(islice(written, -(-run.nbytes // block))))
                if run.file is None
                else Chunk(run.file, run.offset, run.nbytes, tuple(run.digests))
                for run in runs
            )
        return out

    def shared(self) -> dict[str, int]:
        """The previous commit's data files this save references, with their sizes."""
        if self.previous is None:
            return {}
        files = self.previous.files
        return {run.file: files[run.file] for runs in self._runs.values() for run in runs
                if run.file is not None}

    def share(self, storage: Storage, names: Iterable[str] | None = None) -> None:
        """Make the shared files `names` (default: this save's) part of the checkpoint at
        `storage` (after its data files are durable, before its manifest is published).
        When one cannot be, those linked before it are removed again (as `gc` would), but
        not one that the checkpoint committed there references: on an overwrite a name may
        be there already, which `link` leaves as it is.

        Raises:
            CorruptCheckpoint: a shared file is gone from the previous commit (removed, or
                its checkpoint replaced while this save ran); nothing is committed.
            StorageError: the storage failed.
        """
        previous = self.previous
        if previous is None or previous.url == storage.url:
            return
        # A replaced checkpoint's files are removed in the background: let that finish, so
        # that a file it removes is linked anew rather than found there and then lost.
        wait_for_removals()
        link = getattr(storage, "link")  # noqa: B009 (optional; the manager checked it)
        linked: list[str] = []
        try:
            for name in self.shared() if names is None else names:
                source = f"{previous.url.rstrip('/')}/{name}"
                try:
                    link(source, name)
                except FileNotFoundError as exc:
                    raise CorruptCheckpoint(
                        f"{source} is missing (removed, or {previous.url} was replaced while "
                        f"this save ran): the incremental save to {storage.url} shares its "
                        "unchanged blocks, so nothing was committed there; save again (a "
                        "manager's next save writes every block)",
                        url=previous.url, problems=[f"{name}: data file is missing"],
                    ) from exc
                linked.append(name)
        except BaseException:
            if linked:
                # This save published nothing yet (its manifest comes after), so no save id
                # of a manifest there is its own: only the names a commit there references
                # are kept.
                discard_unless_committed(storage, "", linked)
            raise

    def hashes(self) -> dict[str, tuple[str, ...]]:
        """Each streamed entry's (or piece's) block hashes, in order, for the manifest."""
        return {key: tuple(hashes) for key, hashes in self._hashes.items()}

    def committed(self, url: str, manifest: Manifest) -> None:
        """Record `manifest` (with this save's hashes), just committed at `url`, as the next
        save's `previous`."""
        self.next = Lineage.of(url, manifest)
        if self.next is not None:
            logger.debug("%s: %d of %d data file(s) may be shared with the next save", url,
                         len(self.next.files), len(manifest.files))
