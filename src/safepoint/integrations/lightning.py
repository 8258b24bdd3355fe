"""A Lightning `CheckpointIO` that stores Lightning's checkpoint dicts as safepoint checkpoints
(integrations and CLI layer): durable, atomic, checksummed, at a local path or any URL
safepoint has a storage backend for.

Example:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safepoint.integrations.lightning import SafepointCheckpointIO

    trainer = Trainer(plugins=[SafepointCheckpointIO()],
                      callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss",
                                                 save_last=True)])
    trainer.fit(model, ckpt_path="last")     # resumes from the last commit, if there is one

Every `*.ckpt` path Lightning asks for becomes a checkpoint *directory* of that name (a
`manifest.json` plus `data/`). Lightning's own file handling works on it unchanged:
`ModelCheckpoint` tests such paths with `fs.exists`, finds `last*.ckpt` with `fs.ls` and
`fs.modified`, and removes old ones through `remove_checkpoint`, none of which cares whether the
path is a file or a directory.

A checkpoint saved where nothing is yet, or where a file or link is (a `torch.save` file,
`save_last="link"`'s link), is written under a hidden sibling, `.safepoint-<digest of the
name>`, and renamed into place once committed, as Lightning's own IO writes through a
temporary file: a synchronous save killed midway leaves nothing under a name Lightning looks
for (`last*.ckpt`, `hpc_ckpt_*`). An asynchronous save of a new name makes its directory at
the name before it returns instead (`save_last="link"` links to it).

`LightningModule.load_from_checkpoint` reads files with `torch.load` and does not go through
a plugin: load the weights with
`SafepointCheckpointIO().load_checkpoint(path)["state_dict"]` instead, or convert the checkpoint
with `safepoint export CKPT OUT.pt`.

Both `lightning.pytorch` and the standalone `pytorch_lightning` take the plugin: the class
derives from `lightning`'s `CheckpointIO` (or `lightning_fabric`'s when only that is installed)
and, when an instance is made, registers itself with the other one's if that is loaded (as it
is once `pytorch_lightning` is imported).

The pickle policy: tensors, arrays, plain values (None, bool, int, float, str, bytes) and
dicts (str or int keys), lists and tuples of them are stored as safepoint stores any state, with
no pickle. Lightning's dicts can hold other objects too (hyper-parameters such as a `Namespace`
or a `torch.dtype`, a callback's custom state). With `pickle_policy="refuse"` (the default)
saving such a dict raises `sp.UnsupportedLeaf` naming every such path, before anything is
written; with `pickle_policy="allow"` each is stored as an `sp.Pickled` entry and loaded back
with `allow_pickle=True`, which runs code from the checkpoint: allow it only for checkpoints you
trust. Dict subclasses (`OrderedDict`, Lightning's `AttributeDict`) are stored as dicts and load
back as plain dicts, except one that carries `_metadata`: `nn.Module.state_dict()` attaches to
the OrderedDict it returns each submodule's state dict `version`, which `_load_from_state_dict`
reads to upgrade older formats (a quantization observer without it resets its `eps`). The
plugin records it in the checkpoint's metadata (`lightning/state_dict_metadata`, keyed by the
dict's path) and loads such a dict back as an `OrderedDict` with its `_metadata`, as
`torch.load` does.

A save of Lightning's SLURM requeue checkpoint, `hpc_ckpt_<N>.ckpt`, is synchronous even with
`async_save=True`: Lightning's SIGUSR1 handler saves it and at once runs `scontrol requeue`,
which ends the job, so it must be committed when `save_checkpoint` returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Literal, NoReturn

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError:  # only the standalone `pytorch_lightning` / `lightning_fabric` is installed
    try:
        from lightning_fabric.plugins import CheckpointIO  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError(
            "safepoint.integrations.lightning needs Lightning, which is not installed: pip "
            "install safepoint[lightning] (or lightning, or pytorch_lightning)") from exc

import safepoint as sp

from .._api import PreparedSave, prepare_save, write_and_commit
from .._commit import leftovers
from .._format import MANIFEST
from .._interchange import (
    STATE_DICT_METADATA,
    collect_state_dict_versions,
    state_dict_versions,
    storable,
    with_state_dict_metadata,
)
from .._leaves import is_tensor
from .._snapshot import Snapshot, Stager
from .._storage_local import absolute_url, fsync_dir
from ..errors import (
    CheckpointNotFound,
    PickleNotAllowed,
    SafepointError,
    StorageError,
    UnsupportedLeaf,
)
from ..storage import open_storage, split_url

__all__ = ["PicklePolicy", "SafepointCheckpointIO"]

logger = logging.getLogger(__name__)

#: What the plugin does with a value it can store only with pickle (see the module docstring).
PicklePolicy = Literal["refuse", "allow"]

#: The name Lightning's SLURM requeue handler saves before it requeues the job
#: (`_CheckpointConnector.hpc_save_path`: `hpc_ckpt_{max N there + 1}.ckpt`).
_HPC_CHECKPOINT = re.compile(r"hpc_ckpt_[0-9]+\.ckpt")


class SafepointCheckpointIO(CheckpointIO):
    """Saves, loads and removes Lightning checkpoints through `sp.save`, `sp.load` and a
    manifest-first delete.

    Args:
        pickle_policy: "refuse" (default) or "allow": what to do with values that only pickle
            can store (see the module docstring).
        async_save: return from `save_checkpoint` once the checkpoint is copied into host
            staging buffers (the manager's: reused between saves, pinned for CUDA tensors, within
            `max_staging_bytes`) and write and commit it in a background thread (a local
            checkpoint's directory is made before it returns, for Lightning's
            `save_last="link"` to link to; see `load_checkpoint` for such a link). One save is
            in flight at a time: the next `save_checkpoint` first waits for the previous commit
            (its buffers are reused). Removes queue behind the save; when the save queued last
            before one failed, it is skipped, so an older checkpoint is never deleted in favour
            of one that failed. A failure is raised at the next `save_checkpoint`,
            `load_checkpoint`, `remove_checkpoint`, `wait` or `teardown`. Lightning calls
            `teardown` at the end of `fit`, `validate`, `test` and `predict`, before `on_fit_end`
            hooks; from then on saves are synchronous and raise their failure to the caller
            (CheckpointIO has no hook for the start of a run), so a fit never ends with a save
            in flight, not even one made by an `on_fit_end` hook or by `Trainer.save_checkpoint`
            after `fit`. A Trainer that runs `validate` before `fit` therefore saves
            synchronously in that fit: give the fit a Trainer of its own for asynchronous saves.
            Lightning's SLURM requeue checkpoint (`hpc_ckpt_<N>.ckpt`) is always saved
            synchronously (see `save_checkpoint`).
        max_staging_bytes: the host-memory budget of asynchronous staging (None: as large as a
            checkpoint); a larger checkpoint streams through it.
        storage_options: options for the storage backend; a `storage_options` dict given to
            `Trainer.save_checkpoint` is merged over them.

    Raises:
        SafepointError: an unknown pickle policy, or a staging budget below the minimum.
    """

    def __init__(
        self,
        *,
        pickle_policy: PicklePolicy = "refuse",
        async_save: bool = False,
        max_staging_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if pickle_policy not in ("refuse", "allow"):
            raise SafepointError(
                f"pickle_policy={pickle_policy!r} is not a policy: use 'refuse' (the default) "
                "or 'allow'"
            )
        super().__init__()
        _register_with_loaded_bases()
        self.pickle_policy: PicklePolicy = pickle_policy
        self.async_save = async_save
        self.storage_options = dict(storage_options or {})
        self._stager = Stager(max_staging_bytes) if async_save else None
        self._executor: ThreadPoolExecutor | None = None
        self._saving: Future[None] | None = None
        self._pending: list[Future[None]] = []
        self._failure: BaseException | None = None
        self._torn_down = False
        #: An asynchronous save is in `save_checkpoint` (see there: a save nested in it).
        self._in_async_save = False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Commit `checkpoint` at `path`, replacing what is there (Lightning reuses names such
        as `last.ckpt`): the previous checkpoint stays loadable until the new manifest lands. A
        local file or link there (a `torch.save` checkpoint, `save_last="link"`'s link) stays
        until the checkpoint saved beside it is committed, and a new local checkpoint (nothing
        at `path` yet) is saved beside it too (synchronous saves; see the module docstring).

        A save made while an asynchronous one is inside this method (from a signal handler
        that interrupted it: Lightning's SLURM requeue handler saves `hpc_ckpt_<N>.ckpt` from
        its SIGUSR1 handler) is synchronous: it neither stages into the buffers the
        interrupted save holds nor waits for a write that waits for that save, and it is
        committed when it returns. So is a save of Lightning's SLURM requeue checkpoint
        (`hpc_ckpt_<N>.ckpt`) at any time: the handler runs `scontrol requeue`, which ends the
        job, as soon as the save returns; an asynchronous save would die uncommitted, and the
        requeued job, which resumes from the newest `hpc_ckpt_<N>.ckpt` by itself, would find
        nothing committed there. It neither waits for an asynchronous save in flight nor
        raises the failure of an earlier one (the next call does), to be committed soonest.

        Raises:
            UnsupportedLeaf: the checkpoint holds values only pickle can store and the policy
                is "refuse" (nothing was written); the message names their paths.
            SafepointError: a background save failed earlier (async mode), or the save failed.
        """
        url = absolute_url(str(path))
        options = {**self.storage_options, **(storage_options or {})} or None
        state = self._storable(checkpoint, url)
        lightning: dict[str, Any] = {
            key: state[key] for key in ("epoch", "global_step") if type(state.get(key)) is int
        }
        versions = collect_state_dict_versions(checkpoint)
        if versions:
            lightning[STATE_DICT_METADATA] = versions
        metadata = {"lightning": lightning}
        if (self._stager is None or self._torn_down or self._in_async_save
                or _HPC_CHECKPOINT.fullmatch(url.rstrip("/").rsplit("/", 1)[-1])):
            beside = _beside(url, new=True)
            # Lightning saves on global rank 0 alone: never a collective save.
            sp.save(beside or url, state, metadata=metadata, overwrite=True,
                    storage_options=options, dist=False)
            if beside is not None:
                _take_place(beside, url)
            return
        self._in_async_save = True
        try:
            self._save_async(self._stager, state, url, metadata, options)
        finally:
            self._in_async_save = False

    def _save_async(self, stager: Stager, state: dict[str, Any], url: str,
                    metadata: dict[str, Any], options: dict[str, Any] | None) -> None:
        """Stage `state` into the reused buffers and write it in the background; only one
        such call at a time (`_in_async_save`)."""
        if self._saving is not None:
            self._saving.exception()  # one save in flight: the staging buffers are reused
        self._raise_failure()
        # A new checkpoint's directory is made at `url` before this returns, for
        # `save_last="link"` to link to (`_make_local_dir`).
        beside = _beside(url, new=False)
        prepared = prepare_save(beside or url, state, metadata=metadata, overwrite=True,
                                storage_options=options)
        try:
            snapshot = stager.snapshot(prepared.leaves, prepared.kinds)
        except BaseException:
            prepared.close()
            raise
        made = _make_local_dir(prepared.url)
        self._saving = self._submit(self._write, prepared, snapshot, url if beside else None)
        try:
            snapshot.stage()
        except BaseException:
            self._saving.exception()  # the writer stops; its error is this one
            self._failure = None
            if made:  # a refused save leaves nothing, as a synchronous one
                with contextlib.suppress(OSError):
                    os.rmdir(made)
            raise
        prepared.staged()

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved at `path`, every byte checked against its checksum.

        Tensors load on the CPU unless `map_location` (a `torch.device` or device string)
        says otherwise. Pickled entries load only under `pickle_policy="allow"` and never
        with `weights_only=True`. A dict saved with `_metadata` (a module's state dict) comes
        back as an `OrderedDict` with it, as `torch.load` gives it back.

        A local link that leads to no committed checkpoint (Lightning's `last.ckpt` under
        `save_last="link"`, re-pointed at an asynchronous save that a kill interrupted before
        its commit) loads the full `*.ckpt` checkpoint committed last in the link's directory
        or below it (a weights-only one when there is no full one), with a warning: the one
        the run would resume from had the link waited for the commit. Only a committed
        checkpoint is ever loaded. A link to a file (a `torch.save` checkpoint) is refused as
        the file is, saying how to import it.

        Raises:
            CheckpointNotFound: nothing committed at `path` (for such a link: nothing committed
                in its directory or below it either).
            CorruptCheckpoint: damaged data or manifest.
            PickleNotAllowed: the checkpoint holds pickled entries that the policy (or
                `weights_only=True`) does not allow.
        """
        self.wait()
        url = absolute_url(str(path))
        try:
            checkpoint = self._load(url, weights_only)
        except CheckpointNotFound as exc:
            instead = _committed_instead_of_link(url)
            if instead is None:
                self._raise_not_found(url, exc)
            logger.warning(
                "%s links to %s, which holds no committed checkpoint (a save there was "
                "interrupted before it committed): resuming from %s instead, the full "
                "checkpoint committed last in the link's directory or below it (else the "
                "weights-only one)",
                url, os.readlink(split_url(url)[1]), instead,
            )
            checkpoint = self._load(instead, weights_only)
        if map_location is None:
            return checkpoint
        moved: dict[str, Any] = _to_device(checkpoint, _device(map_location, url))
        return moved

    def _load(self, url: str, weights_only: bool | None) -> dict[str, Any]:
        allow_pickle = self.pickle_policy == "allow" and weights_only is not True
        try:
            checkpoint: dict[str, Any] = sp.load(
                url, allow_pickle=allow_pickle, storage_options=self.storage_options or None,
                dist=False,  # each rank loads the whole dict, when Lightning asks it to
            )
        except PickleNotAllowed as exc:
            raise PickleNotAllowed(
                f"{url} holds pickled entries {exc.paths[:5]}: loading them runs code from the "
                "checkpoint; use SafepointCheckpointIO(pickle_policy='allow') only if you trust "
                "it" + (" (and not weights_only=True)" if weights_only else ""),
                url=url, paths=exc.paths,
            ) from exc
        versions = state_dict_versions(
            sp.info(url, storage_options=self.storage_options or None).metadata)
        if not versions:
            return checkpoint
        with_versions: dict[str, Any] = with_state_dict_metadata(checkpoint, "", versions)
        return with_versions

    def _raise_not_found(self, url: str, exc: CheckpointNotFound) -> NoReturn:
        storage = open_storage(url, self.storage_options or None)
        try:
            interrupted = bool(leftovers(storage))
        finally:
            storage.close()
        if not interrupted:  # a wrong path, or a torch.save file: sp.load says which
            raise exc
        raise CheckpointNotFound(
            f"no committed checkpoint at {url}: a save there was interrupted before it "
            "committed, and that directory holds only its leftovers; delete it and resume "
            "from another checkpoint (`safepoint ls` lists the committed ones)",
            url=url,
        ) from exc

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at `path`: its manifest first, so that a crash midway leaves an
        uncommitted leftover (`safepoint ls` names it), never a damaged committed checkpoint.
        A plain file at `path` (a `torch.save` checkpoint) is removed too, and a link (the
        "last" link of `save_last="link"`) is removed, not the checkpoint it points to."""
        url = absolute_url(str(path))
        if self.async_save:
            self._raise_failure()
        if self.async_save and self._executor is not None:  # queued behind the saves
            self._submit(self._remove_unless_failed, url, self._saving)
        else:  # nothing in flight (after `teardown`, which callbacks' own teardown follows)
            self._remove(url)

    def wait(self) -> None:
        """Block until every queued save and remove has finished (async mode).

        Raises:
            SafepointError: the first background failure since the last one raised.
        """
        for future in self._pending:
            future.exception()
        self._pending.clear()
        self._raise_failure()

    def teardown(self) -> None:
        """Wait for in-flight work, stop the background thread and free the staging buffers
        (Lightning calls this at the end of `fit`, `validate`, `test` and `predict`); saves are
        synchronous from then on.

        Raises:
            SafepointError: a background save failed.
        """
        self._torn_down = True
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.release()

    def _storable(self, checkpoint: dict[str, Any], url: str) -> dict[str, Any]:
        state: dict[str, Any]
        state, refused = storable(checkpoint, pickle_objects=self.pickle_policy == "allow")
        if refused:
            raise UnsupportedLeaf(
                f"cannot save the Lightning checkpoint {url}: {len(refused)} value(s) can be "
                f"stored only with pickle, at {refused[:5]}; make them plain values (for "
                "hyper-parameters: save_hyperparameters(ignore=[...])), or use "
                "SafepointCheckpointIO(pickle_policy='allow') if whoever loads the checkpoint "
                "trusts whoever wrote it",
                path=refused[0],
            )
        return state

    def _write(self, prepared: PreparedSave, snapshot: Snapshot, place: str | None) -> None:
        """The background half of an asynchronous save; then, saved beside `place` (a file or
        a link), the checkpoint takes its place."""
        with prepared:
            try:
                write_and_commit(prepared, snapshot)
                if place is not None:
                    _take_place(prepared.url, place)
            except BaseException as exc:
                snapshot.abort(exc)
                logger.error("background save of %s failed: %s", prepared.url, exc)
                self._failure = self._failure or exc
                raise

    def _remove_unless_failed(self, url: str, saving: Future[None] | None) -> None:
        """Remove `url` unless `saving`, the save queued last before this remove (done by
        now: one worker runs them in order), failed. Its own future, not `_failure`, which
        the training thread clears when it raises the failure, maybe before this runs."""
        if saving is not None and saving.exception() is not None:
            logger.warning("not removing %s: the save before it failed", url)
            return
        try:
            self._remove(url)
        except BaseException as exc:
            logger.error("background removal of %s failed: %s", url, exc)
            self._failure = exc
            raise

    def _remove(self, url: str) -> None:
        scheme, local = split_url(url)
        is_local = scheme in ("", "file")
        # A link (Lightning's `save_last="link"`) goes alone, never what it points to.
        if is_local and (os.path.islink(local) or os.path.isfile(local)):
            os.remove(local)
            return
        storage = open_storage(url, self.storage_options or None)
        try:
            storage.delete([MANIFEST])
            # IMPORTANT: from here on the checkpoint is uncommitted; only then go its data files.
            storage.delete(storage.list(""))
        finally:
            storage.close()
        if is_local and os.path.isdir(local) and not os.listdir(local):
            os.rmdir(local)
        logger.info("removed checkpoint %s", url)

    def _submit(self, work: Any, *args: Any) -> Future[None]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safepoint-io")
        self._pending = [future for future in self._pending if not future.done()]
        future = self._executor.submit(work, *args)
        self._pending.append(future)
        return future

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


def _register_with_loaded_bases() -> None:
    """Make the plugin an instance of the other Lightning distribution's `CheckpointIO` too,
    when that one is loaded: `lightning` and the standalone `pytorch_lightning` ship separate
    copies of the class, and each Trainer checks `isinstance` against its own. Looking only at
    loaded modules keeps the import of this module from loading a second Lightning."""
    for name in ("lightning.fabric.plugins.io.checkpoint_io",
                 "lightning_fabric.plugins.io.checkpoint_io"):
        base = getattr(sys.modules.get(name), "CheckpointIO", None)
        if base is not None and not issubclass(SafepointCheckpointIO, base):
            base.register(SafepointCheckpointIO)


def _committed_instead_of_link(url: str) -> str | None:
    """For a local link (Lightning's `last.ckpt` under `save_last="link"`) that leads to no
    committed checkpoint, the full `*.ckpt` checkpoint committed last in the link's directory
    or below it (else the weights-only one committed last); None when `url` is not a link, or
    is one to a file (a `torch.save` checkpoint that Lightning's own IO saved: not an
    interrupted save, and loading it says how to import it).
    Below it: a filename with a "/" (`"{epoch}-{val/loss:.2f}"`) puts checkpoints in
    subdirectories (`epoch=1-val/loss=0.93.ckpt`).

    Lightning re-points the link as soon as `save_checkpoint` returns, which in async mode is
    before the commit, so a run killed then leaves it leading to an interrupted save. Saves
    commit one at a time in the order they were made, and a remove runs only once the save
    queued before it has committed: at any instant, the checkpoint committed last is the save
    before the interrupted one, which the link led to until then. Only checkpoints this plugin
    saved count (their metadata has the `lightning` key); links are skipped, and so is a
    manifest that cannot be read (with a warning).

    Raises:
        CheckpointNotFound: nothing was committed there (the run was killed during its first
            save).
    """
    scheme, local = split_url(url)
    if scheme not in ("", "file") or not os.path.islink(local) or os.path.isfile(local):
        return None
    target = os.path.realpath(local)
    directory = os.path.dirname(os.path.abspath(local))
    newest: tuple[bool, datetime, int, str] | None = None  # full checkpoints first
    for path in _checkpoint_directories(directory):
        if os.path.realpath(path) == target:
            continue
        try:
            info = sp.info(path)
            committed = datetime.fromisoformat(info.created.replace("Z", "+00:00"))
            if committed.tzinfo is None:
                committed = committed.replace(tzinfo=timezone.utc)
        except CheckpointNotFound:
            continue  # not a checkpoint, or another interrupted save
        except (SafepointError, ValueError) as exc:
            logger.warning("not resuming from %s: %s", path, exc)
            continue
        lightning = info.metadata.get("lightning")
        if not isinstance(lightning, dict):
            continue  # not saved by this plugin
        # A weights-only checkpoint (save_weights_only=True) resumes no fit: taken only
        # when the directory holds no full one (a series of weights-only saves).
        full = any(entry.path.startswith(("callbacks/", "optimizer_states/"))
                   for entry in info.entries)
        step = lightning.get("global_step")
        key = (full, committed, step if type(step) is int else -1, path)
        if newest is None or key > newest:
            newest = key
    if newest is None:
        raise CheckpointNotFound(
            f"{url} links to {target}, which holds no committed checkpoint (a save there was "
            f"interrupted before it committed), and nothing else was committed in {directory} "
            "or below it: the run stopped before its first commit; remove the link and start "
            "the fit over (ckpt_path=None)",
            url=url,
        )
    return newest[3]


def _checkpoint_directories(directory: str) -> Iterator[str]:
    """The `*.ckpt` directories in `directory` and its subdirectories, not looking inside
    them; links and hidden directories (`_beside`'s) are skipped."""
    for root, names, _ in os.walk(directory):
        below = []
        for name in names:
            path = os.path.join(root, name)
            if name.startswith(".") or os.path.islink(path):
                continue
            if name.endswith(".ckpt"):
                yield path
            else:
                below.append(name)
        names[:] = below


def _make_local_dir(url: str) -> str | None:
    """Create the directory of a local checkpoint now, before the background write: Lightning's
    `save_last="link"` symlinks `last.ckpt` to it as soon as `save_checkpoint` returns, which
    fails when the directory it goes into does not exist yet, and a link leading nowhere is
    one that `ckpt_path="last"` does not see (`fs.exists` is False), so a killed run would
    start over instead of resuming (`load_checkpoint` resolves a link to an uncommitted
    directory to the last commit). Returns the directory when this made it."""
    scheme, local = split_url(url)
    if scheme not in ("", "file") or os.path.isdir(local):
        return None
    try:
        os.makedirs(local)  # the background write makes it durable
    except OSError as exc:  # that write fails at the same path and raises it then
        logger.debug("could not create %s ahead of its save: %s", local, exc)
        return None
    return local


def _beside(url: str, *, new: bool) -> str | None:
    """Where to save the checkpoint named `url` before it takes that name (`_take_place`),
    when `url` is local and a link (a save through it would write into the checkpoint it
    leads to, such as the best one), a file (a `torch.save` checkpoint, which a directory
    cannot be written into) or, with `new`, nothing yet (a save killed midway then leaves
    nothing under a name Lightning scans); else None: a checkpoint directory (saved over in
    place, its previous commit loadable until the new one lands), or a remote URL.

    The place is a hidden sibling named by a digest of the name, `.safepoint-<16 hex
    digits>`: nothing in it that Lightning's scans match (`last*.ckpt`, and the digits after
    any `ckpt_` that `hpc_ckpt_<N>` is found by), and the same for every save of that name,
    so the next one removes what a killed one left there, here and now (`sp.save`'s
    overwrite would remove it in the background, by path, racing the rename into place).
    """
    scheme, local = split_url(url)
    if scheme not in ("", "file"):
        return None
    if not (os.path.islink(local) or os.path.isfile(local)
            or (new and not os.path.lexists(local))):
        return None
    directory, name = os.path.split(os.path.abspath(local))
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    beside = os.path.join(directory, f".safepoint-{digest}")
    shutil.rmtree(beside, ignore_errors=True)  # what stays, the save's overwrite replaces
    return beside


def _take_place(saved: str, url: str) -> None:
    """Put the checkpoint committed at `saved` (a `_beside` place) at `url`: a rename, atomic
    when nothing is there; over a file or link (gone already when a remove queued before the
    save took it), as Lightning's own moves over its link, for microseconds between the
    unlink and the rename neither is there.

    Raises:
        StorageError: the move failed (the checkpoint stays committed at `saved`).
    """
    place = split_url(url)[1]
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(place)
        os.rename(saved, place)
        fsync_dir(os.path.dirname(os.path.abspath(place)))
    except OSError as exc:
        raise StorageError(
            f"the checkpoint for {url} is committed at {saved} but could not take its place "
            f"({exc}): move it there by hand", url=saved) from exc


def _device(map_location: Any, url: str) -> Any:
    import torch

    if isinstance(map_location, str | torch.device):
        return torch.device(map_location)
    raise SafepointError(
        f"map_location={map_location!r} for {url}: SafepointCheckpointIO takes a torch.device or "
        "a device string (tensors load on the CPU by default); move tensors yourself otherwise",
        url=url,
    )


def _to_device(value: Any, device: Any) -> Any:
    """`value`, a freshly loaded tree, with its tensors on `device`; its dicts are updated in
    place, so that a state dict stays an `OrderedDict` with its `_metadata`."""
    if is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        for key, child in value.items():
            value[key] = _to_device(child, device)
        return value
    if type(value) in (list, tuple):
        return type(value)(_to_device(child, device) for child in value)
    return value
