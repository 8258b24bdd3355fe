"""The commit protocol (engine layer): a checkpoint becomes visible when its manifest is
published, after every data file it references is durable; files no committed manifest
references are removed only after the new manifest landed.

What a crash leaves at each step of a save:
  1. data files being written or fsynced: no manifest references them; the previous commit
     (if any) is untouched, and the files are leftovers, removed by the next save there
     (or a manager's `gc`).
  2. manifest published (atomic rename or link, directory fsynced): the new checkpoint is
     committed; old data files may linger as leftovers.
  3. unreferenced files removed: done. A replaced checkpoint's data is removed by a
     background thread, off the caller's critical path (freeing a gigabyte of blocks takes
     most of a second on some disks); the interpreter waits for it at exit, and what a killed
     process left is removed by the next save there or by a manager's `gc`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._format import DATA_DIR, MANIFEST, Manifest, decode, written_by_safepoint
from ._leaves import flag
from .errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    SafepointError,
    StorageError,
)
from .storage import Storage, children, open_storage

__all__ = [
    "check_free",
    "committed_files",
    "discard_unless_committed",
    "document_at",
    "leftovers",
    "manifest_at",
    "publish",
    "raise_out_of_space",
    "read_document",
    "read_manifest",
    "refuse_a_parent",
    "remove_unreferenced",
    "wait_for_removals",
]

logger = logging.getLogger(__name__)


def manifest_at(url: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """`read_manifest` of the checkpoint at `url`."""
    return document_at(url, storage_options)[0]


def document_at(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Manifest, bytes]:
    """`read_document` of the checkpoint at `url`."""
    storage = open_storage(url, storage_options)
    try:
        return read_document(storage)
    finally:
        storage.close()


def _is_file(storage: Storage) -> bool:
    """Whether `storage`'s URL is itself a file (an object), for a hint only."""
    try:
        return storage.exists("")
    except Exception:
        return False


def read_manifest(
    storage: Storage, on_files: Callable[[dict[str, int]], object] | None = None
) -> Manifest:
    """The committed manifest at `storage`'s URL (`on_files`: see `_format.decode`).

    Raises:
        CheckpointNotFound: no manifest (an uncommitted leftover, or nothing at all).
        CorruptCheckpoint: the manifest does not parse or is inconsistent.
        FormatVersionError: written by a newer format.
    """
    return read_document(storage, on_files)[0]


def _below_a_file(storage: Storage) -> CheckpointNotFound:
    """The error for a checkpoint whose manifest's path runs through a file."""
    return CheckpointNotFound(
        f"{storage.url} is a file, not a checkpoint directory: a torch.save or safetensors "
        "file is read with sp.import_checkpoint (`safepoint import`)" if _is_file(storage) else
        f"no committed checkpoint at {storage.url}: a directory on its path is a file; check "
        "the path",
        url=storage.url,
    )


def read_document(
    storage: Storage, on_files: Callable[[dict[str, int]], object] | None = None
) -> tuple[Manifest, bytes]:
    """`read_manifest`, and the manifest's bytes as they are stored (what an archive holds:
    a newer writer's fields that this reader ignores too).

    Raises:
        as `read_manifest`.
    """
    try:
        data = storage.read(MANIFEST)
    except FileNotFoundError as exc:
        if isinstance(exc.__cause__, NotADirectoryError):  # the local backend's
            raise _below_a_file(storage) from exc
        gone = ""  # an object store's bucket, missing: its listing's StorageError says so
        try:
            orphans = written_files(storage)
        except (FileNotFoundError, StorageError) as listed:  # the hint only: not a failed read
            orphans = []
            if isinstance(listed, StorageError) and isinstance(listed.__cause__,
                                                                FileNotFoundError):
                gone = str(listed)
        hint = (
            f" ({gone})" if gone else
            f" (it holds {len(orphans)} file(s) of an uncommitted save, which a save there "
            "replaces; or delete the directory)" if orphans else
            " (it is a file: a torch.save or safetensors file is read with "
            "sp.import_checkpoint, `safepoint import`)" if _is_file(storage) else ""
        )
        raise CheckpointNotFound(
            f"no committed checkpoint at {storage.url}{hint}: check the path, or list what "
            "exists with `safepoint ls`",
            url=storage.url,
        ) from exc
    except StorageError as exc:
        # The storage seam maps every I/O failure but a missing file to StorageError; a
        # directory in the manifest's place is damage, not an I/O failure worth retrying.
        if isinstance(exc.__cause__, NotADirectoryError):
            raise _below_a_file(storage) from exc
        if not isinstance(exc.__cause__, IsADirectoryError):
            raise
        raise CorruptCheckpoint(
            f"{storage.url}/{MANIFEST} is a directory, not a manifest: the checkpoint is "
            "damaged; remove it, or restore an earlier checkpoint",
            url=storage.url,
        ) from exc
    return decode(data, storage.url, on_files), data


def publish(storage: Storage, document: bytes, *, overwrite: bool) -> None:
    """Commit `document`, an encoded manifest (see `_format.encode`; a save encodes it while
    its data file is still being fsynced). Every data file it references must already be
    durable.

    Raises:
        CheckpointExists: a committed checkpoint is there and `overwrite` is False.
    """
    try:
        storage.publish(MANIFEST, document, overwrite=overwrite)
    except FileExistsError as exc:
        raise _taken(storage.url) from exc


def check_free(storage: Storage, *, overwrite: bool, parent_check: bool = True) -> None:
    """Refuse, before anything is written, to commit where a checkpoint is committed unless
    `overwrite` (`publish` checks again, atomically where the storage can). `parent_check`
    False skips `refuse_a_parent`, which lists the directory (a LIST request on an object
    store): a manager's step directory under its own root is never a root of checkpoints.

    Raises:
        CheckpointExists: a committed checkpoint is there and `overwrite` is False, or
            checkpoints are committed under it (`refuse_a_parent`).
        SafepointError: `overwrite` is not a bool.
    """
    overwrite = flag("overwrite", overwrite, storage.url)
    if storage.exists(MANIFEST):
        if not overwrite:
            raise _taken(storage.url)
    elif parent_check:
        refuse_a_parent(storage)


def refuse_a_parent(storage: Storage) -> None:
    """Refuse to commit a checkpoint at a directory that holds checkpoints (a manager root,
    given where `ROOT/NAME` was meant): it would hide them from `safepoint ls` and `gc`,
    which would take the root for one checkpoint.

    Raises:
        CheckpointExists: checkpoints are committed under `storage`.
    """
    try:
        files = storage.list("")
    except FileNotFoundError:
        return
    under = sorted({path.rpartition("/")[0] for path in files if path.endswith(f"/{MANIFEST}")})
    if under:
        shown = ", ".join(under[:3]) + (f" and {len(under) - 3} more" if len(under) > 3 else "")
        raise CheckpointExists(
            f"{storage.url} holds checkpoints ({shown}): a checkpoint committed there would "
            f"hide them; save or copy it under a name of its own, such as "
            f"{storage.url.rstrip('/')}/NAME",
            url=storage.url,
        )


def _taken(url: str) -> CheckpointExists:
    return CheckpointExists(
        f"{url} already holds a committed checkpoint: pass overwrite=True (--overwrite) to "
        "replace it, or save under another name",
        url=url,
    )


def committed_files(storage: Storage) -> dict[str, int]:
    """The data files (name -> size) of the checkpoint committed at `storage`: none when there
    is none, or when its manifest is damaged."""
    try:
        return dict(read_manifest(storage).files)
    except (CheckpointNotFound, CorruptCheckpoint):
        return {}


def leftovers(storage: Storage, manifest: Manifest | None = None) -> list[str]:
    """Files under the checkpoint that `manifest` (or no manifest) does not reference: data of
    a save that never committed or of an overwritten commit, and stray temporary manifests."""
    referenced = set(manifest.files) if manifest is not None else set()
    try:
        files = storage.list("")
    except FileNotFoundError:
        return []
    return [path for path in files if written_by_safepoint(path) and path not in referenced]


def written_files(storage: Storage, directory: str = "") -> list[str]:
    """The files of a save that never committed in `directory` under `storage` (all those
    safepoint writes besides the manifest: `leftovers` with no manifest), as paths relative to
    `storage`'s URL. Only the directory and its `data/` are listed, so a tree below it (the
    directory may hold checkpoints or anything else) costs and fails nothing.

    Raises:
        FileNotFoundError: `directory` is not there.
    """
    base = f"{directory}/" if directory else ""
    files, directories = children(storage, directory)
    found = [f"{base}{name}" for name in files if written_by_safepoint(name)]
    if DATA_DIR in directories:
        found += [path for path in storage.list(f"{base}{DATA_DIR}")
                  if written_by_safepoint(path.removeprefix(base))]
    return found


_remover: tuple[int, ThreadPoolExecutor] | None = None
_remover_lock = threading.Lock()


def _background() -> ThreadPoolExecutor:
    """The one thread that removes replaced data, in the order of the commits that replaced
    it; a new one after a fork, where the parent's thread does not exist."""
    global _remover
    with _remover_lock:
        if _remover is None or _remover[0] != os.getpid():
            _remover = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="safepoint-remove"))
        return _remover[1]


def remove_unreferenced(
    storage: Storage, manifest: Manifest, *, background: bool = False
) -> list[str]:
    """Delete what `manifest` does not reference (after it was published). Returns them.

    With `background`, the deletes run in a background thread and a failure is logged, not
    raised. The list is taken now, so a later save's files are never among them; and since
    the new manifest references a data file, the data directory never empties, so no
    background prune of it can race a later save creating it. `storage` must stay usable
    after the caller closes it (local and fsspec storages do).
    """
    stale = leftovers(storage, manifest)
    if not stale:
        return stale
    if background and manifest.files:
        _background().submit(_remove, storage, stale)
    else:
        storage.delete(stale)
        logger.debug("removed %d unreferenced file(s) under %s", len(stale), storage.url)
    return stale


def raise_out_of_space(storage: Storage, exc: BaseException, save_id: str) -> None:
    """When a save `save_id` at `storage` failed for want of space (`exc`: a full disk, a
    quota), remove what killed saves left there beside the committed checkpoint, which the
    next commit would remove but which a save that runs out of space never reaches, and
    raise a `StorageError` that says so; else return. The files of save `save_id` (other
    ranks' of a collective save) and everything beside a manifest that cannot be read (what
    it references is unknown) stay.

    Raises:
        StorageError: the leftovers were removed: save again.
    """
    cause = exc.__cause__ if isinstance(exc, StorageError) else exc
    if not (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)):
        return
    try:
        manifest: Manifest | None = read_manifest(storage)
    except CheckpointNotFound:
        manifest = None
    except SafepointError:
        return
    try:
        stale = [path for path in leftovers(storage, manifest) if save_id not in path]
        freed = sum(storage.size(path) for path in stale)
        storage.delete(stale)
    except Exception:
        logger.warning("could not remove the leftovers under %s", storage.url, exc_info=True)
        return
    if freed:
        raise StorageError(
            f"{exc} (the space was taken partly by a killed save's leftovers under "
            f"{storage.url}, {freed / 2**20:.1f} MiB, now removed: save again)",
            url=storage.url,
        ) from exc


def discard_unless_committed(storage: Storage, save_id: str, names: list[str]) -> None:
    """After save `save_id` failed: remove its data files `names`, unless its manifest was
    committed after all (a publish that failed after the rename) or a committed manifest
    references them. When the manifest there cannot be read, nothing is removed (the next
    save there removes what is left)."""
    try:
        visible: Manifest | None = read_manifest(storage)
    except CheckpointNotFound:
        visible = None
    except (SafepointError, OSError):
        logger.warning("could not tell whether the failed save %s under %s committed; its "
                       "files stay", save_id, storage.url, exc_info=True)
        return
    if visible is not None and visible.save_id == save_id:
        return
    doomed = [name for name in names if visible is None or name not in visible.files]
    try:
        storage.delete(doomed)
    except Exception:
        logger.warning("could not remove %s of a failed save under %s; the next save there "
                       "will", doomed, storage.url, exc_info=True)


def _remove(storage: Storage, stale: list[str]) -> None:
    try:
        storage.delete(stale)
    except Exception:
        logger.warning("could not remove the replaced data under %s; the next save there "
                       "will", storage.url, exc_info=True)
    else:
        logger.debug("removed %d unreferenced file(s) under %s", len(stale), storage.url)


def wait_for_removals() -> None:
    """Return once every background removal submitted so far is done."""
    _background().submit(lambda: None).result()
