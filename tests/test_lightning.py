"""safepoint.integrations.lightning under a real Lightning Trainer on the CPU: fit with
ModelCheckpoint (top-k and last), resume from `ckpt_path="last"` in a fresh Trainer and after a
SIGKILL mid-fit, and the result equals an uninterrupted run's; the pickle policy, removal,
asynchronous saving and its failures."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch

import safepoint as sp
from safepoint._commit import wait_for_removals
from safepoint.integrations.lightning import SafepointCheckpointIO

pytestmark = [
    pytest.mark.filterwarnings(r"ignore:.*isinstance\(treespec, LeafSpec\).*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
]

TESTS = Path(__file__).parent
EPOCHS = 4


def model_class(lightning: Any) -> type:
    """A tiny LightningModule (Adam, logged loss) for `lightning.pytorch` or `pytorch_lightning`."""

    class Tiny(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, lr: float = 0.05, tied: bool = False) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(4, 2)
            if tied:  # a square layer shared by two names, as tied embeddings are
                self.square = torch.nn.Linear(4, 4, bias=False)
                self.again = torch.nn.Linear(4, 4, bias=False)
                self.again.weight = self.square.weight

        def training_step(self, batch: Any, _: int) -> Any:
            x, y = batch
            if self.hparams.tied:
                x = self.again(self.square(x))
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    return Tiny


def loader() -> Any:
    """Two batches per epoch, same order every time."""
    g = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    data = torch.utils.data.TensorDataset(inputs, targets)
    return torch.utils.data.DataLoader(data, batch_size=4)


def fit(
    lightning: Any, dirpath: Path, *, max_epochs: int, seed: int, ckpt_path: str | None = None,
    plugin: Any = None, callbacks: tuple[Any, ...] = (), save_last: bool | str = True,
    tied: bool = False,
) -> Any:
    """A fresh model (initialised from `seed`) fitted by a fresh Trainer; returns the trainer."""
    torch.manual_seed(seed)
    model = model_class(lightning)(tied=tied)
    checkpoint = lightning.callbacks.ModelCheckpoint(
        dirpath=dirpath, save_last=save_last, save_top_k=2, monitor="train_loss"
    )
    trainer = lightning.Trainer(
        max_epochs=max_epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[plugin or SafepointCheckpointIO()],
        callbacks=[checkpoint, *callbacks],
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


def assert_same_training_state(a: Any, b: Any) -> None:
    assert a.global_step == b.global_step
    for (name, x), (_, y) in zip(a.lightning_module.state_dict().items(),
                                 b.lightning_module.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a.optimizers[0].state_dict(), b.optimizers[0].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for index, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][index][key]), (index, key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return fit(L, tmp_path_factory.mktemp("uninterrupted"), max_epochs=EPOCHS, seed=0)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_from_last_in_a_fresh_trainer_equals_the_uninterrupted_run(
    tmp_path, uninterrupted, async_save
):
    fit(L, tmp_path, max_epochs=2, seed=0, plugin=SafepointCheckpointIO(async_save=async_save))
    # ModelCheckpoint kept the best two and last, each a committed, intact checkpoint directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"
    ]
    for path in tmp_path.iterdir():
        assert (path / "manifest.json").is_file()
        assert sp.verify(str(path)).ok
    assert sp.info(str(tmp_path / "last.ckpt")).metadata == {"lightning": {
        "epoch": 1, "global_step": 4,
        "state_dict_metadata": {"state_dict": {"": {"version": 1}, "net": {"version": 1}}},
    }}

    resumed = fit(L, tmp_path, max_epochs=EPOCHS, seed=1, ckpt_path="last",
                  plugin=SafepointCheckpointIO(async_save=async_save))

    assert resumed.global_step == 2 * EPOCHS
    assert_same_training_state(resumed, uninterrupted)
    # save_top_k=2 removed the older epochs through remove_checkpoint: nothing of them is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"
    ]


def test_tied_weights_are_saved_once_and_resume_tied(tmp_path):
    whole = fit(L, tmp_path / "whole", max_epochs=EPOCHS, seed=0, tied=True)
    plugin = SafepointCheckpointIO(async_save=True)
    fit(L, tmp_path / "run", max_epochs=2, seed=0, tied=True, plugin=plugin)
    entries = {e.path: e for e in sp.info(str(tmp_path / "run" / "last.ckpt")).entries}
    assert entries["state_dict/again.weight"].kind == "alias"
    assert entries["state_dict/again.weight"].value == "state_dict/square.weight"
    resumed = fit(L, tmp_path / "run", max_epochs=EPOCHS, seed=1, ckpt_path="last",
                  tied=True, plugin=SafepointCheckpointIO(async_save=True))
    module = resumed.lightning_module
    assert module.again.weight is module.square.weight
    assert_same_training_state(resumed, whole)


def test_save_last_as_a_link_to_the_newest_checkpoint(tmp_path, uninterrupted):
    """ModelCheckpoint(save_last="link") symlinks last.ckpt to the newest checkpoint directory;
    resuming from it works the same."""
    fit(L, tmp_path, max_epochs=2, seed=0, save_last="link")
    assert (tmp_path / "last.ckpt").readlink() == Path("epoch=1-step=4.ckpt")
    resumed = fit(L, tmp_path, max_epochs=EPOCHS, seed=1, ckpt_path="last", save_last="link")
    assert_same_training_state(resumed, uninterrupted)
    assert (tmp_path / "last.ckpt").readlink() == Path("epoch=3-step=8.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"
    ]


def test_async_saves_with_save_last_link_into_a_new_directory(tmp_path, uninterrupted):
    """The README's setup, `SafepointCheckpointIO(async_save=True)`, with
    `ModelCheckpoint(dirpath=<a directory that does not exist yet>, save_last="link")`: the fit
    runs, `last.ckpt` links the newest checkpoint, committed by the end of the fit, and a resume
    from it continues exactly. (`save_checkpoint` returned before anything was on disk, so
    Lightning's symlink into the missing directory raised FileNotFoundError at the first
    checkpoint.)"""
    dirpath = tmp_path / "run1"
    fit(L, dirpath, max_epochs=2, seed=0, save_last="link",
        plugin=SafepointCheckpointIO(async_save=True))
    assert (dirpath / "last.ckpt").readlink() == Path("epoch=1-step=4.ckpt")
    assert sp.verify(str(dirpath / "last.ckpt")).ok
    resumed = fit(L, dirpath, max_epochs=EPOCHS, seed=1, ckpt_path="last", save_last="link",
                  plugin=SafepointCheckpointIO(async_save=True))
    assert_same_training_state(resumed, uninterrupted)


def test_a_last_link_to_an_interrupted_save_loads_the_last_commit(tmp_path, caplog):
    """`last.ckpt` links to a checkpoint whose save was killed before its commit (what an
    asynchronous save with `save_last="link"` leaves): loading it loads the checkpoint committed
    last in that directory, with a warning naming both, never the uncommitted one, nor a
    weights-only checkpoint another ModelCheckpoint saved there (a fit cannot resume from one:
    it was picked, and Lightning failed on the missing optimizer state); with nothing
    committed there, `CheckpointNotFound` says to start over."""
    plugin = SafepointCheckpointIO()

    def full(step: int) -> dict[str, Any]:
        return {**_checkpoint(), "global_step": step, "optimizer_states": [{"lr": 0.1}],
                "callbacks": {"ModelCheckpoint": {"best_model_score": 0.5}}}

    plugin.save_checkpoint(full(10), tmp_path / "epoch=2-step=10.ckpt")
    plugin.save_checkpoint(full(11), tmp_path / "epoch=2-step=11.ckpt")
    plugin.save_checkpoint({**_checkpoint(), "global_step": 11}, tmp_path / "weights.ckpt")
    sp.save(str(tmp_path / "not-lightning"), {"global_step": 99})  # not the plugin's: ignored
    (tmp_path / "older-last.ckpt").symlink_to("epoch=2-step=10.ckpt")
    interrupted = tmp_path / "epoch=2-step=12.ckpt" / "data"
    interrupted.mkdir(parents=True)
    (interrupted / f"{uuid.uuid4().hex}-r00000-0000.bin").write_bytes(b"half written")
    (tmp_path / "last.ckpt").symlink_to("epoch=2-step=12.ckpt")

    with caplog.at_level("WARNING", logger="safepoint.integrations.lightning"):
        loaded = plugin.load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 11 and loaded["optimizer_states"] == [{"lr": 0.1}]
    assert "epoch=2-step=12.ckpt" in caplog.text
    assert str(tmp_path / "epoch=2-step=11.ckpt") in caplog.text

    weights = tmp_path / "weights-only"  # a series of weights-only saves: the last one
    weights.mkdir()
    for step in (10, 11):
        plugin.save_checkpoint({**_checkpoint(), "global_step": step},
                               weights / f"epoch=2-step={step}.ckpt")
    (weights / "epoch=2-step=12.ckpt").mkdir()
    (weights / "last.ckpt").symlink_to("epoch=2-step=12.ckpt")
    assert plugin.load_checkpoint(weights / "last.ckpt")["global_step"] == 11

    fresh = tmp_path / "fresh"
    (fresh / "epoch=0-step=2.ckpt").mkdir(parents=True)  # a first async save, killed
    (fresh / "last.ckpt").symlink_to("epoch=0-step=2.ckpt")
    with pytest.raises(sp.CheckpointNotFound, match=r"start the fit over"):
        plugin.load_checkpoint(fresh / "last.ckpt")


def test_a_last_link_to_a_torch_file_says_to_import_it(tmp_path: Path) -> None:
    """A run that used Lightning's own IO with `save_last="link"` leaves `last.ckpt` linking
    to a complete `torch.save` file: loading it through the link said a save there was
    interrupted and to start the fit over (ckpt_path=None), throwing the run's progress
    away; it now refuses it as loading the file itself does, saying how to import it."""
    torch.save(_plain_checkpoint(40), tmp_path / "epoch=3-step=40.ckpt")
    (tmp_path / "last.ckpt").symlink_to("epoch=3-step=40.ckpt")
    plugin = SafepointCheckpointIO()
    for name in ("last.ckpt", "epoch=3-step=40.ckpt"):
        with pytest.raises(sp.CheckpointNotFound, match=r"sp\.import_checkpoint") as caught:
            plugin.load_checkpoint(tmp_path / name)
        assert "start the fit over" not in str(caught.value)


KILLED_AT_EPOCH_3 = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import {lightning} as L
from test_lightning import Ballast, fit
from safepoint.integrations.lightning import SafepointCheckpointIO

class Kill(L.Callback):
    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 2:
            trainer.strategy.checkpoint_io.wait()  # epochs 0 and 1 are committed
        if trainer.current_epoch == 3:  # epoch 2's saves are queued or being written
            os.kill(os.getpid(), signal.SIGKILL)

fit(L, {dirpath!r}, max_epochs={epochs}, seed=0, plugin=SafepointCheckpointIO(async_save=True),
    callbacks=({callbacks}Kill(),){options})
"""


def killed_at_epoch_3(dirpath: Path, lightning: str, callbacks: str = "",
                      options: str = "") -> None:
    """Run an asynchronous fit (`lightning`: the package) in a child SIGKILLed at the start
    of epoch 3; `callbacks` and `options` add to its Trainer (Python source)."""
    code = textwrap.dedent(KILLED_AT_EPOCH_3).format(
        tests=str(TESTS), dirpath=str(dirpath), epochs=EPOCHS, lightning=lightning,
        callbacks=callbacks, options=options)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_mid_fit_then_resume_from_last_equals_the_uninterrupted_run(
    tmp_path, uninterrupted
):
    """A pytorch_lightning fit with asynchronous saves is SIGKILLed at the start of epoch 3;
    a lightning.pytorch Trainer resumes from the last committed checkpoint and ends where the
    uninterrupted run ended (whichever epoch's save had committed before the kill)."""
    killed_at_epoch_3(tmp_path, "pytorch_lightning")
    last = sp.info(str(tmp_path / "last.ckpt")).metadata["lightning"]
    assert last["global_step"] in (4, 6)

    resumed = fit(L, tmp_path, max_epochs=EPOCHS, seed=1, ckpt_path="last")

    assert_same_training_state(resumed, uninterrupted)


class Ballast(L.Callback):  # type: ignore[misc,name-defined]
    """Callback state of 64 MiB, so that a checkpoint takes a moment to write."""

    def state_dict(self) -> dict[str, Any]:
        return {"ballast": torch.zeros(16 * 2**20)}


class StartStep(L.Callback):  # type: ignore[misc,name-defined]
    """Records the global step a fit starts (or resumes) at."""

    step: int | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.step = trainer.global_step


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_during_an_async_save_with_save_last_link_resumes_from_the_last_commit(
    tmp_path, uninterrupted
):
    """With asynchronous saves and `save_last="link"`, Lightning re-points `last.ckpt` at each
    checkpoint as soon as it is staged. A fit SIGKILLed right after epoch 2's checkpoint was
    staged (64 MiB of callback state, so it is still being written) is restarted with
    `ckpt_path="last"`: it resumes from the last committed checkpoint (epoch 1's, unless epoch
    2's committed before the kill) and ends where the uninterrupted run ended. (The link led to
    the uncommitted checkpoint: the restart raised CheckpointNotFound, or, the link leading
    nowhere yet, Lightning started over from step 0.)"""
    killed_at_epoch_3(tmp_path, "lightning.pytorch", callbacks="Ballast(), ",
                      options=', save_last="link"')
    assert (tmp_path / "last.ckpt").readlink() == Path("epoch=2-step=6.ckpt")
    assert (tmp_path / "last.ckpt").is_dir(), "the link leads to a directory from the start"
    assert sp.verify(str(tmp_path / "epoch=1-step=4.ckpt")).ok
    committed = (tmp_path / "last.ckpt" / "manifest.json").is_file()

    start = StartStep()
    resumed = fit(L, tmp_path, max_epochs=EPOCHS, seed=1, ckpt_path="last", save_last="link",
                  plugin=SafepointCheckpointIO(async_save=True), callbacks=(Ballast(), start))

    assert start.step == (6 if committed else 4)
    assert_same_training_state(resumed, uninterrupted)


DDP_RANK = """
import os, sys
from datetime import timedelta
sys.path.insert(0, {tests!r})
import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from test_lightning import loader, model_class
from safepoint.integrations.lightning import SafepointCheckpointIO

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK=sys.argv[1],
                  LOCAL_RANK=sys.argv[1], WORLD_SIZE="2", NODE_RANK="0", LOCAL_WORLD_SIZE="2")
for epochs, resume in ((2, None), (3, "last")):
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        plugins=[SafepointCheckpointIO(async_save={async_save})],
        callbacks=[L.callbacks.ModelCheckpoint(dirpath={dirpath!r}, save_last=True)])
    trainer.fit(model_class(L)(), loader(), ckpt_path=resume)
    print("STEP", trainer.global_step, trainer.lightning_module.net.weight.sum().item())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_ddp_fit_on_two_processes_saves_on_rank_0_and_resumes_on_both(tmp_path, async_save):
    """Lightning saves on global rank 0 alone and loads on every rank: under DDP (gloo, two
    processes) the plugin's saves and loads are its own, never collectives that the other
    rank would have to join (a collective save waited there for the whole timeout)."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    code = textwrap.dedent(DDP_RANK).format(tests=str(TESTS), port=port, dirpath=str(tmp_path),
                                            async_save=async_save)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(rank)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(2)]
    outputs = []
    for rank in ranks:
        try:
            outputs.append(rank.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            raise
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, output[-3000:]
    steps = [[line.split()[1:] for line in out.splitlines() if line.startswith("STEP ")]
             for out in outputs]
    assert [[step for step, _ in lines] for lines in steps] == [["2", "3"]] * 2
    assert steps[0][1][1] == steps[1][1][1], "both ranks resumed the same weights"
    assert sp.info(str(tmp_path / "last.ckpt")).metadata["lightning"]["global_step"] == 3


def test_removing_an_old_last_link_keeps_the_checkpoint_it_points_to(tmp_path):
    """With `save_last="link"` and a last name per epoch (Lightning's documented
    `CHECKPOINT_NAME_LAST = "{epoch}-last"`), Lightning removes the previous link through the
    plugin: the link goes, the checkpoint it pointed to stays."""
    torch.manual_seed(0)
    checkpoint = L.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last="link", save_top_k=-1)
    checkpoint.CHECKPOINT_NAME_LAST = "{epoch}-last"
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[SafepointCheckpointIO()], callbacks=[checkpoint])
    trainer.fit(model_class(L)(), loader())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-last.ckpt", "epoch=2-step=6.ckpt"]
    for name in ("epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"):
        assert sp.verify(str(tmp_path / name)).ok


def test_a_checkpoint_saved_at_a_home_path_resumes_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trainer.save_checkpoint("~/final.ckpt")`, then `fit(ckpt_path="~/final.ckpt")`: the
    storage expanded `~` (as Lightning's own IO does) but the plugin's own path handling
    took it literally: the save went to a directory named `~` under the working directory
    and the resume failed (CheckpointNotFound)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    torch.manual_seed(0)
    first = _trainer(SafepointCheckpointIO(), [], max_epochs=1, enable_checkpointing=False)
    first.fit(model_class(L)(), loader())
    first.save_checkpoint("~/final.ckpt")
    assert not (cwd / "~").exists()
    assert sp.verify(str(home / "final.ckpt")).ok
    resumed = _trainer(SafepointCheckpointIO(), [], max_epochs=2, enable_checkpointing=False)
    resumed.fit(model_class(L)(), loader(), ckpt_path="~/final.ckpt")
    assert resumed.global_step == 4


def test_removing_a_last_link_named_from_home_keeps_the_checkpoint_it_points_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`remove_checkpoint("~/ckpt/last.ckpt")` of a `save_last="link"` link: checked
    literally, it was not seen as a link and was removed through the storage, which
    followed it and deleted the manifest of the checkpoint it pointed to."""
    home = tmp_path / "home"
    (home / "ckpt").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    io = SafepointCheckpointIO()
    io.save_checkpoint(_checkpoint(), str(home / "ckpt" / "epoch=0.ckpt"))
    os.symlink("epoch=0.ckpt", home / "ckpt" / "last.ckpt")
    io.remove_checkpoint("~/ckpt/last.ckpt")
    assert sp.verify(str(home / "ckpt" / "epoch=0.ckpt")).ok
    assert not os.path.lexists(home / "ckpt" / "last.ckpt")


def test_pytorch_lightning_trainer_accepts_the_plugin():
    import pytorch_lightning.plugins as pl_plugins

    assert isinstance(SafepointCheckpointIO(), pl_plugins.CheckpointIO)


def _checkpoint(**extra: Any) -> dict[str, Any]:
    return {
        "epoch": 2, "global_step": 10, "state_dict": {"w": torch.arange(6.0).reshape(2, 3)},
        "hyper_parameters": {"lr": 0.1, "layers": [4, 2], **extra},
    }


def test_plain_checkpoint_dicts_need_no_pickle(tmp_path):
    plugin = SafepointCheckpointIO()
    plugin.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(6.0).reshape(2, 3))
    assert loaded["hyper_parameters"] == {"lr": 0.1, "layers": [4, 2]}
    assert all(e.kind != "pickle" for e in sp.info(str(tmp_path / "a.ckpt")).entries)


def test_a_bytearray_is_stored_without_pickle_under_either_policy(tmp_path):
    for policy in ("refuse", "allow"):
        plugin = SafepointCheckpointIO(pickle_policy=policy)  # type: ignore[arg-type]
        url = tmp_path / f"{policy}.ckpt"
        plugin.save_checkpoint(_checkpoint(blob=bytearray(b"\x02")), url)
        assert {e.path: e.kind for e in sp.info(str(url)).entries}[
            "hyper_parameters/blob"] == "bytes"
        assert plugin.load_checkpoint(url)["hyper_parameters"]["blob"] == b"\x02"


def test_refuse_policy_names_every_object_and_writes_nothing(tmp_path):
    plugin = SafepointCheckpointIO()
    checkpoint = _checkpoint(args=argparse.Namespace(lr=0.1), dtype=torch.float16, keys={1, 2})
    with pytest.raises(sp.UnsupportedLeaf) as caught:
        plugin.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    message = str(caught.value)
    for path in ("hyper_parameters/args", "hyper_parameters/dtype", "hyper_parameters/keys"):
        assert path in message
    assert "pickle_policy='allow'" in message
    assert caught.value.path == "hyper_parameters/args"
    assert not (tmp_path / "a.ckpt").exists()


def test_allow_policy_pickles_only_the_objects_and_loads_them_back(tmp_path):
    checkpoint = _checkpoint(args=argparse.Namespace(lr=0.1), dtype=torch.float16,
                             odd_keys={(1, 2): "tuple key"})
    SafepointCheckpointIO(pickle_policy="allow").save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    kinds = {e.path: e.kind for e in sp.info(str(tmp_path / "a.ckpt")).entries}
    assert kinds["hyper_parameters/args"] == "pickle"
    assert kinds["hyper_parameters/odd_keys"] == "pickle"
    assert kinds["state_dict/w"] == "tensor" and kinds["hyper_parameters/lr"] == "value"

    loaded = SafepointCheckpointIO(pickle_policy="allow").load_checkpoint(tmp_path / "a.ckpt")
    assert loaded["hyper_parameters"]["args"] == argparse.Namespace(lr=0.1)
    assert loaded["hyper_parameters"]["dtype"] is torch.float16
    assert loaded["hyper_parameters"]["odd_keys"] == {(1, 2): "tuple key"}

    # Loading never unpickles unless the loading plugin's policy allows it.
    with pytest.raises(sp.PickleNotAllowed, match="pickle_policy='allow'") as caught:
        SafepointCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    assert "hyper_parameters/args" in caught.value.paths
    with pytest.raises(sp.PickleNotAllowed, match="weights_only"):
        SafepointCheckpointIO(pickle_policy="allow").load_checkpoint(
            tmp_path / "a.ckpt", weights_only=True
        )


def test_bad_options_and_map_location(tmp_path):
    with pytest.raises(sp.SafepointError, match="'refuse'"):
        SafepointCheckpointIO(pickle_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(sp.SafepointError, match="max_staging_bytes"):
        SafepointCheckpointIO(async_save=True, max_staging_bytes=1)
    plugin = SafepointCheckpointIO()
    plugin.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "a.ckpt", map_location="cpu")
    assert loaded["state_dict"]["w"].device.type == "cpu"
    with pytest.raises(sp.SafepointError, match="map_location"):
        plugin.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda s, _: s)


def test_save_replaces_and_remove_deletes_manifest_first(tmp_path):
    plugin = SafepointCheckpointIO()
    path = tmp_path / "last.ckpt"
    plugin.save_checkpoint(_checkpoint(), path)
    plugin.save_checkpoint({**_checkpoint(), "global_step": 11}, path)
    assert plugin.load_checkpoint(path)["global_step"] == 11
    wait_for_removals()  # the replaced data goes in a background thread
    assert len(list((path / "data").iterdir())) == 1

    plugin.remove_checkpoint(path)
    assert not path.exists()
    with pytest.raises(sp.CheckpointNotFound, match="check the path"):
        plugin.load_checkpoint(path)
    # A torch.save file (a run that switched to the plugin): sp.load's hint, not "delete it"
    legacy_file = tmp_path / "legacy.ckpt"
    torch.save(_checkpoint(), legacy_file)
    with pytest.raises(sp.CheckpointNotFound, match=r"sp\.import_checkpoint") as raised:
        plugin.load_checkpoint(legacy_file)
    assert "delete" not in str(raised.value)

    # What a save killed before its commit leaves: data, no manifest. The next save replaces it.
    (path / "data").mkdir(parents=True)
    (path / "data" / f"{uuid.uuid4().hex}-r00000-0000.bin").write_bytes(b"half written")
    with pytest.raises(sp.CheckpointNotFound, match=r"interrupted.*delete it"):
        plugin.load_checkpoint(path)
    plugin.save_checkpoint(_checkpoint(), path)
    assert plugin.load_checkpoint(path)["global_step"] == 10
    wait_for_removals()
    assert len(list((path / "data").iterdir())) == 1

    legacy = tmp_path / "old.ckpt"
    legacy.write_bytes(b"torch.save output")
    plugin.remove_checkpoint(legacy)
    assert not legacy.exists()


def test_a_failed_async_save_is_raised_later_and_skips_queued_removes(tmp_path):
    plugin = SafepointCheckpointIO(async_save=True)
    good = tmp_path / "epoch=0.ckpt"
    plugin.save_checkpoint(_checkpoint(), good)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    plugin.save_checkpoint(_checkpoint(), blocker / "epoch=1.ckpt")  # fails in the background
    # ModelCheckpoint then removes the previous best. The failure is raised either right here
    # (when the save already failed) or at the next wait; in both cases the remove never runs.
    with pytest.raises(sp.StorageError):
        plugin.remove_checkpoint(good)
        plugin.wait()
    assert sp.verify(str(good)).ok
    plugin.wait()  # a failure is raised once

    # Staged copies are independent of the live tensors once save_checkpoint returns.
    live = _checkpoint()
    plugin.save_checkpoint(live, tmp_path / "staged.ckpt")
    live["state_dict"]["w"].add_(100)
    plugin.teardown()
    assert torch.equal(
        plugin.load_checkpoint(tmp_path / "staged.ckpt")["state_dict"]["w"],
        torch.arange(6.0).reshape(2, 3),
    )
    assert os.path.isdir(tmp_path / "staged.ckpt")


def test_fit_and_resume_on_s3(s3_server, s3_url, uninterrupted, monkeypatch):
    """ModelCheckpoint on an s3:// dirpath (moto over HTTP): the plugin commits checkpoint
    prefixes there, Lightning's fsspec calls see them, top-k removes the old ones, and a fresh
    Trainer resumes from `last.ckpt`. (Named explicitly: Lightning 2.6's `ckpt_path="last"`
    drops the URL scheme of what `fs.ls` lists, with any CheckpointIO.)"""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    options = s3_server.storage_options
    fit(L, s3_url, max_epochs=2, seed=0, plugin=SafepointCheckpointIO(storage_options=options))
    resumed = fit(L, s3_url, max_epochs=EPOCHS, seed=1, ckpt_path=f"{s3_url}/last.ckpt",
                  plugin=SafepointCheckpointIO(storage_options=options))
    assert_same_training_state(resumed, uninterrupted)
    names = sorted(info.url.rsplit("/", 1)[1] for info in [
        sp.info(f"{s3_url}/{name}", storage_options=options)
        for name in ("epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt")
    ])
    assert names == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    with pytest.raises(sp.CheckpointNotFound):
        sp.info(f"{s3_url}/epoch=0-step=2.ckpt", storage_options=options)



@pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning")  # moved: expected
def test_a_root_with_a_last_link_copied_to_s3_resumes_from_its_last(
    tmp_path, s3_server, s3_url, uninterrupted, monkeypatch
):
    """`safepoint cp` of a local checkpoint root whose `last.ckpt` is a link (save_last="link")
    to S3 copies the link as the checkpoint it leads to: a run resumed from the copy's
    `last.ckpt` continues exactly (the link was left out, silently, so the run found no last
    checkpoint there)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    options = s3_server.storage_options
    fit(L, tmp_path, max_epochs=2, seed=0, save_last="link")
    report = sp.copy(str(tmp_path), s3_url, dst_storage_options=options)
    assert report.copied == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    resumed = fit(L, s3_url, max_epochs=EPOCHS, seed=1, ckpt_path=f"{s3_url}/last.ckpt",
                  plugin=SafepointCheckpointIO(storage_options=options))
    assert_same_training_state(resumed, uninterrupted)

def test_exported_checkpoint_loads_with_load_from_checkpoint(tmp_path, uninterrupted):
    """`load_from_checkpoint` reads files with torch.load, bypassing plugins: an export to a
    torch file is what it takes (read with torch.load's weights_only default)."""
    last = Path(uninterrupted.checkpoint_callback.dirpath) / "last.ckpt"
    sp.export_checkpoint(str(last), tmp_path / "model.ckpt")
    model = model_class(L).load_from_checkpoint(tmp_path / "model.ckpt")
    for name, tensor in uninterrupted.lightning_module.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model.hparams.lr == 0.05


def _trainer(plugin: Any, callbacks: list[Any], **options: Any) -> Any:
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, plugins=[plugin], callbacks=callbacks,
                     **options)


_SCORES = [1.0, 3.0, 2.0, 0.5]  # epoch 1 is the best; epoch 2 is not


class _Scored(model_class(L)):  # type: ignore[misc]
    def validation_step(self, batch: Any, _: int) -> None:
        self.log("score", _SCORES[self.current_epoch])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("resumed_with", ["link", "save_last=True"])
def test_a_full_last_saved_over_a_last_link_never_writes_into_what_it_leads_to(
    tmp_path: Path, async_save: bool, resumed_with: str
) -> None:
    """A run resumed from `save_last="link"` saves a full `last.ckpt` where the link is (its
    first epoch that top-k does not save, or a switch to save_last=True). Lightning's own IO
    moves a file over the link; the plugin saved through it, into the checkpoint it led to:
    the best checkpoint then held the last model."""
    def callback(save_last: Any) -> Any:
        return L.callbacks.ModelCheckpoint(tmp_path, save_last=save_last, save_top_k=1,
                                           monitor="score", mode="max")

    torch.manual_seed(0)
    _trainer(SafepointCheckpointIO(async_save=async_save), [callback("link")],
             max_epochs=2).fit(_Scored(), loader(), loader())
    assert os.path.islink(tmp_path / "last.ckpt")
    trainer = _trainer(SafepointCheckpointIO(async_save=async_save),
                       [callback("link" if resumed_with == "link" else True)], max_epochs=4)
    trainer.fit(_Scored(), loader(), loader(), ckpt_path="last")
    best = trainer.checkpoint_callback.best_model_path
    io = SafepointCheckpointIO()
    assert os.path.basename(best) == "epoch=1-step=4.ckpt"
    assert io.load_checkpoint(best)["global_step"] == 4, "the best checkpoint was overwritten"
    assert io.load_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 8
    assert not [p for p in tmp_path.iterdir() if ".safepoint-" in p.name]


class _Boom(L.Callback):  # type: ignore[misc,name-defined]
    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        if trainer.current_epoch == 1 and index == 1:
            raise RuntimeError("boom")


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*:UserWarning",
                            "ignore:You're resuming from a checkpoint that ended before")
def test_a_remove_after_teardown_is_done_when_fit_returns(tmp_path: Path) -> None:
    """OnExceptionCheckpoint removes its checkpoint in its own teardown, which Lightning calls
    after the plugin's: with async_save=True the remove went to a new background thread that
    nothing waited for, so fit returned with it still on disk and the thread running."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(SafepointCheckpointIO(async_save=True),
                 [L.callbacks.OnExceptionCheckpoint(tmp_path), _Boom()],
                 max_epochs=3).fit(model_class(L)(), loader())
    assert (tmp_path / "on_exception.ckpt").exists()
    plugin = SafepointCheckpointIO(async_save=True)
    trainer = _trainer(plugin, [L.callbacks.OnExceptionCheckpoint(tmp_path)], max_epochs=3)
    trainer.fit(model_class(L)(), loader(), ckpt_path="last")
    assert trainer.global_step == 6
    assert not (tmp_path / "on_exception.ckpt").exists() and plugin._executor is None


class _SparseBuffer(model_class(L)):  # type: ignore[misc]
    """A graph's adjacency as a sparse buffer, as GNNs keep one."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("adj", torch.eye(4).to_sparse())


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*:UserWarning")
def test_the_allow_policy_pickles_tensors_the_format_has_no_place_for(tmp_path: Path) -> None:
    """A sparse buffer stopped the fit at its first checkpoint (UnsupportedLeaf), whatever
    the policy; Lightning's own IO saves and resumes it."""
    torch.manual_seed(0)
    _trainer(SafepointCheckpointIO(pickle_policy="allow"),
             [L.callbacks.ModelCheckpoint(tmp_path, save_last=True)],
             max_epochs=2).fit(_SparseBuffer(), loader())
    model = _SparseBuffer()
    trainer = _trainer(SafepointCheckpointIO(pickle_policy="allow"),
                       [L.callbacks.ModelCheckpoint(tmp_path, save_last=True)], max_epochs=3)
    trainer.fit(model, loader(), ckpt_path="last")
    assert trainer.global_step == 6 and model.adj.layout == torch.sparse_coo
    with pytest.raises(sp.UnsupportedLeaf, match="adj"):
        _trainer(SafepointCheckpointIO(), [L.callbacks.ModelCheckpoint(tmp_path / "refused")],
                 max_epochs=1).fit(_SparseBuffer(), loader())


class _Names(L.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, names: Any) -> None:
        self.names = names

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names}


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*:UserWarning")
def test_an_async_save_refused_while_it_stages_leaves_nothing(tmp_path: Path) -> None:
    """An array of str is refused when it is staged, after the checkpoint's directory was
    made: the failed fit left an empty `last.ckpt`, and the fixed rerun with
    ckpt_path="last" raised CheckpointNotFound instead of starting over."""
    import numpy as np

    def run(names: Any) -> Any:
        trainer = _trainer(SafepointCheckpointIO(async_save=True),
                           [L.callbacks.ModelCheckpoint(tmp_path, save_top_k=0, save_last=True),
                            _Names(names)], max_epochs=1)
        trainer.fit(model_class(L)(), loader(), ckpt_path="last")
        return trainer

    with pytest.raises(sp.UnsupportedLeaf, match="_Names/names"):
        run(np.array(["cat", "dog"]))
    assert list(tmp_path.iterdir()) == []
    assert run(np.array([0, 1])).global_step == 2


def _plain_checkpoint(step: int) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step,
            "epoch": step}


def test_a_save_beside_a_link_takes_its_place_when_the_link_is_gone_already(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remove of the link queued before the save (or a link removed by hand) is gone when
    the saved checkpoint takes its place: the swap raised a bare FileNotFoundError and left
    the checkpoint under its sibling name, with no last.ckpt at all."""
    import threading

    io = SafepointCheckpointIO()
    io.save_checkpoint(_plain_checkpoint(1), str(tmp_path / "epoch=1.ckpt"))
    os.symlink("epoch=1.ckpt", tmp_path / "last.ckpt")
    plugin = SafepointCheckpointIO(async_save=True)
    gate = threading.Event()
    remove = plugin._remove

    def held_remove(url: str) -> None:
        assert gate.wait(30)
        remove(url)

    monkeypatch.setattr(plugin, "_remove", held_remove)
    plugin.save_checkpoint(_plain_checkpoint(2), str(tmp_path / "epoch=2.ckpt"))
    plugin.remove_checkpoint(str(tmp_path / "last.ckpt"))  # queued behind that save
    plugin.save_checkpoint(_plain_checkpoint(3), str(tmp_path / "last.ckpt"))  # a link still
    gate.set()
    plugin.teardown()
    assert io.load_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 3
    assert io.load_checkpoint(str(tmp_path / "epoch=1.ckpt"))["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert not os.path.islink(tmp_path / "last.ckpt")


def test_what_a_killed_save_beside_a_link_left_is_replaced_by_the_next(tmp_path: Path) -> None:
    """Each save beside a link had a name of its own: what a kill left there (its data, or
    a whole committed checkpoint) was never replaced nor removed."""
    from safepoint.integrations import lightning as plugin_module

    io = SafepointCheckpointIO()
    io.save_checkpoint(_plain_checkpoint(1), str(tmp_path / "epoch=1.ckpt"))
    os.symlink("epoch=1.ckpt", tmp_path / "last.ckpt")
    beside = plugin_module._beside(str(tmp_path / "last.ckpt"), new=False)
    assert beside is not None
    sp.save(beside, _plain_checkpoint(2))  # committed, killed before it took the link's place
    io.save_checkpoint(_plain_checkpoint(3), str(tmp_path / "last.ckpt"))
    assert io.load_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1.ckpt", "last.ckpt"]


def test_the_allow_policy_leaves_a_lazy_parameter_to_the_saves_refusal(tmp_path: Path) -> None:
    """Asking whether the format stores it read the shape of a parameter not materialized
    yet: torch's bare RuntimeError, where "refuse" says to run a forward pass first."""
    lazy = torch.nn.LazyLinear(3)
    checkpoint = {"state_dict": dict(lazy.state_dict()), "global_step": 0, "epoch": 0}
    for policy in ("refuse", "allow"):
        with pytest.raises(sp.UnsupportedLeaf, match="materialized"):
            SafepointCheckpointIO(pickle_policy=policy).save_checkpoint(  # type: ignore[arg-type]
                checkpoint, str(tmp_path / f"{policy}.ckpt"))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_over_a_torch_file_of_the_same_name_replaces_it(
    tmp_path: Path, async_save: bool
) -> None:
    """A run that moved to the plugin from Lightning's own IO in the same dirpath (with
    `enable_version_counter=False`, Lightning reuses `last.ckpt`), or `Trainer.save_checkpoint`
    over an old file: the checkpoint replaces the `torch.save` file, as Lightning's own IO
    does. It failed with "[Errno 20] Not a directory ... retry", which no retry fixes."""
    torch.save(_plain_checkpoint(99), tmp_path / "last.ckpt")
    torch.save(_plain_checkpoint(99), tmp_path / "model.ckpt")
    plugin = SafepointCheckpointIO(async_save=async_save)
    trainer = _trainer(plugin, [L.callbacks.ModelCheckpoint(
        tmp_path, save_last=True, save_top_k=0, enable_version_counter=False)], max_epochs=2)
    trainer.fit(model_class(L)(), loader())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    plugin.teardown()
    io = SafepointCheckpointIO()
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4
    assert io.load_checkpoint(tmp_path / "model.ckpt")["global_step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "model.ckpt"]


_LOSSES = [1.0, 0.75, 0.5, 0.25]


class _SlashMetric(model_class(L)):  # type: ignore[misc]
    """Logs "val/loss", Lightning's usual grouping of metrics."""

    def validation_step(self, batch: Any, _: int) -> None:
        self.log("val/loss", _LOSSES[self.current_epoch])


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*:UserWarning")
def test_a_last_link_to_an_interrupted_save_in_a_subdirectory_resumes_from_the_last_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With `filename="{epoch}-{val/loss:.2f}"` each checkpoint is in a subdirectory
    (`epoch=1-val/loss=0.75.ckpt`). An asynchronous save under `save_last="link"` that did not
    commit (here its directory holds a file where `data/` goes) leaves the link leading to it:
    loading the link loads epoch 1's commit, and the fit resumes from it. The fallback looked
    only in the interrupted checkpoint's own subdirectory and said "the run stopped before its
    first commit; remove the link and start the fit over"."""
    def run(ckpt_path: str | None) -> Any:
        callback = L.callbacks.ModelCheckpoint(
            tmp_path, monitor="val/loss", save_top_k=-1, filename="{epoch}-{val/loss:.2f}",
            save_last="link", enable_version_counter=False)
        start = StartStep()
        trainer = _trainer(SafepointCheckpointIO(async_save=True), [callback, start],
                           max_epochs=EPOCHS)
        trainer.fit(_SlashMetric(), loader(), loader(), ckpt_path=ckpt_path)
        return start.step

    blocker = tmp_path / "epoch=2-val" / "loss=0.50.ckpt" / "data"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the data directory goes")
    torch.manual_seed(0)
    with pytest.raises(sp.StorageError):
        run(None)
    assert (tmp_path / "last.ckpt").readlink() == Path("epoch=2-val/loss=0.50.ckpt")

    with caplog.at_level("WARNING", logger="safepoint.integrations.lightning"):
        loaded = SafepointCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert (loaded["epoch"], loaded["global_step"]) == (1, 4)
    assert str(tmp_path / "epoch=1-val" / "loss=0.75.ckpt") in caplog.text
    blocker.unlink()
    torch.manual_seed(0)
    assert run("last") == 4


class _SaveAtFitEnd(L.Callback):  # type: ignore[misc,name-defined]
    """Saves the final model in `on_fit_end`, which Lightning calls after the plugin's
    teardown."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        trainer.save_checkpoint(self.path)


def test_a_save_after_teardown_is_committed_or_raised_when_it_returns(tmp_path: Path) -> None:
    """A save in `on_fit_end` or by `Trainer.save_checkpoint` after `fit` comes after the
    plugin's teardown: with async_save=True it went to a new background thread that nothing
    waited for, so `fit` returned with the checkpoint uncommitted and a failure was only
    logged (the script exited 0, the final checkpoint missing)."""
    plugin = SafepointCheckpointIO(async_save=True)
    trainer = _trainer(plugin, [_SaveAtFitEnd(tmp_path / "final.ckpt")], max_epochs=1,
                       enable_checkpointing=False)
    trainer.fit(model_class(L)(), loader())
    assert (tmp_path / "final.ckpt" / "manifest.json").is_file()
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert (tmp_path / "after.ckpt" / "manifest.json").is_file()
    assert plugin._executor is None

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(sp.StorageError, match="not-a-dir"):
        _trainer(SafepointCheckpointIO(async_save=True), [_SaveAtFitEnd(blocker / "final.ckpt")],
                 max_epochs=1, enable_checkpointing=False).fit(model_class(L)(), loader())


HPC_KILLED = """
import os, signal, sys, threading, time
sys.path.insert(0, {tests!r})
import lightning.pytorch as L
import torch
from test_lightning import Ballast, loader, model_class
from safepoint.integrations.lightning import SafepointCheckpointIO

root = {root!r}

def kill_when_a_save_begins(known):
    while set(os.listdir(root)) == known:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)

class HpcSave(L.Callback):  # what Lightning's SLURM handler does on SIGUSR1
    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch == 1:  # kill the second save midway
            known = set(os.listdir(root))
            threading.Thread(target=kill_when_a_save_begins, args=(known,), daemon=True).start()
        connector = trainer._checkpoint_connector
        trainer.save_checkpoint(connector.hpc_save_path(trainer.default_root_dir))

torch.manual_seed(0)
L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
          enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
          plugins=[SafepointCheckpointIO()], callbacks=[Ballast(), HpcSave()]
          ).fit(model_class(L)(), loader())
"""


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:.*ckpt_path.*:UserWarning")
def test_a_save_killed_midway_leaves_nothing_that_lightning_resumes_from(tmp_path) -> None:
    """Lightning's SLURM support saves `hpc_ckpt_<N+1>.ckpt` before a requeue and the requeued
    job resumes from the highest `hpc_ckpt_<N>` there (`ckpt_path="hpc"`). A save killed
    midway left the directory `hpc_ckpt_2.ckpt`, uncommitted: every requeued job picked it and
    died with CheckpointNotFound. Now it leaves only a hidden sibling, which the next save of
    that name replaces."""
    code = textwrap.dedent(HPC_KILLED).format(tests=str(TESTS), root=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [
        "hpc_ckpt_1.ckpt"]

    start = StartStep()
    trainer = _trainer(SafepointCheckpointIO(), [start], max_epochs=3,
                       enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(model_class(L)(), loader(), ckpt_path="hpc")
    assert start.step == 2
    trainer.save_checkpoint(tmp_path / "hpc_ckpt_2.ckpt")  # the requeued job's next save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"]


def test_a_failed_async_save_never_costs_the_previous_checkpoint_whatever_runs_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remove queued behind a save that fails is skipped. It tested the failure the
    training thread clears when it raises it: a worker that reached the remove only after
    the next `save_checkpoint` had raised the failure (a descheduled thread) deleted the
    previous best, the only good checkpoint."""
    import threading

    plugin = SafepointCheckpointIO(async_save=True)
    good = tmp_path / "epoch=0.ckpt"
    plugin.save_checkpoint(_plain_checkpoint(0), good)
    plugin.wait()
    written, raised = threading.Event(), threading.Event()
    write, remove = plugin._write, plugin._remove_unless_failed

    def held_write(*args: Any) -> None:
        assert written.wait(30)
        write(*args)

    def held_remove(*args: Any) -> None:
        assert raised.wait(30)
        remove(*args)

    monkeypatch.setattr(plugin, "_write", held_write)
    monkeypatch.setattr(plugin, "_remove_unless_failed", held_remove)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    plugin.save_checkpoint(_plain_checkpoint(1), blocker / "epoch=1.ckpt")  # fails, later
    plugin.remove_checkpoint(good)  # ModelCheckpoint's remove of the previous best
    written.set()
    with pytest.raises(sp.StorageError):
        plugin.save_checkpoint(_plain_checkpoint(1), tmp_path / "last.ckpt")
    raised.set()
    plugin.teardown()
    assert sp.verify(str(good)).ok


NESTED_SAVE = """
import faulthandler, signal, sys, torch
from safepoint import _snapshot
from safepoint.integrations.lightning import SafepointCheckpointIO

faulthandler.dump_traceback_later(30, exit=True)  # a hang fails the test, with its stack
root, at = sys.argv[1], sys.argv[2]
io = SafepointCheckpointIO(async_save=True)

def state(sign, step):
    return {"state_dict": {f"w{i}": torch.full((64, 64), sign * float(i))
                           for i in range(50)}, "epoch": 0, "global_step": step}

def requeue(signum, frame):  # what Lightning's _slurm_sigusr_handler_fn does
    io.save_checkpoint(state(1, 5), f"{root}/hpc_ckpt_1.ckpt")

signal.signal(signal.SIGUSR1, requeue)
armed = []
def interrupting(original):
    def method(*args, **kwargs):
        if armed and armed.pop():
            signal.raise_signal(signal.SIGUSR1)
        return original(*args, **kwargs)
    return method

def after(original):
    def method(*args, **kwargs):
        taken = original(*args, **kwargs)
        if armed and armed.pop():
            signal.raise_signal(signal.SIGUSR1)
        return taken
    return method

if at == "staging":  # while the outer save copies into its buffers
    _snapshot.Snapshot._copy = interrupting(_snapshot.Snapshot._copy)
else:  # once the outer save reserved its buffers, before its write was submitted
    _snapshot.Stager.snapshot = after(_snapshot.Stager.snapshot)
io.save_checkpoint(state(-1, 8), f"{root}/warm.ckpt")
io.wait()
armed.append(True)
io.save_checkpoint(state(-1, 9), f"{root}/epoch=0-step=9.ckpt")
io.teardown()
"""


@pytest.mark.parametrize("at", ["staging", "reserved"])
def test_a_save_from_a_signal_handler_inside_an_async_save_commits_both(
    tmp_path: Path, at: str
) -> None:
    """Lightning's SLURM requeue handler saves `hpc_ckpt_<N>.ckpt` from its SIGUSR1 handler,
    which can interrupt an asynchronous `save_checkpoint`. Landing while it staged, the nested
    save waited for the write that waited for that staging: a hang, no hpc checkpoint, no
    requeue. Landing after it reserved its buffers, the nested save staged into the same
    buffers and committed the outer save's tensors under its own names, checksums valid. The
    nested save is now synchronous and touches neither; each holds what was saved to it."""
    child = subprocess.run([sys.executable, "-c", NESTED_SAVE, str(tmp_path), at],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    io = SafepointCheckpointIO()
    for name, sign, step in (("hpc_ckpt_1.ckpt", 1, 5), ("epoch=0-step=9.ckpt", -1, 9)):
        loaded = io.load_checkpoint(tmp_path / name)
        assert loaded["global_step"] == step
        for i in range(50):
            assert torch.equal(loaded["state_dict"][f"w{i}"],
                               torch.full((64, 64), sign * float(i))), (name, i)


def slurm_job(tmp_path: Path, scontrol: str) -> dict[str, str]:
    """The environment of a child that Lightning takes for SLURM job 7's only task, with an
    `scontrol` on its PATH that runs the shell commands `scontrol` (for `scontrol requeue`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{scontrol}\n")
    (bin_dir / "scontrol").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                SLURM_JOB_ID="7", SLURM_JOB_NAME="train", SLURM_NTASKS="1",
                SLURM_NODELIST="localhost", SLURM_PROCID="0", SLURM_LOCALID="0",
                SLURM_NODEID="0")


SLURM_REQUEUE_DURING_AN_ASYNC_SAVE = """
import faulthandler, signal, sys
sys.path.insert(0, {tests!r})
import lightning.pytorch as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from safepoint import _snapshot
from test_lightning import loader, model_class
from safepoint.integrations.lightning import SafepointCheckpointIO

faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the test, with its stack
copy, snapshots = _snapshot.Snapshot._copy, []
def copy_once_signalled(self, index):  # SLURM's SIGUSR1 lands while epoch 1's save stages
    if self not in snapshots:
        snapshots.append(self)
        if len(snapshots) == 2:
            signal.raise_signal(signal.SIGUSR1)
    return copy(self, index)
_snapshot.Snapshot._copy = copy_once_signalled

torch.manual_seed(0)
L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
          enable_model_summary=False, default_root_dir={root!r},
          plugins=[SafepointCheckpointIO(async_save=True), SLURMEnvironment(auto_requeue=True)],
          callbacks=[L.callbacks.ModelCheckpoint(dirpath={root!r}, save_top_k=-1)],
          ).fit(model_class(L)(), loader())
"""


@pytest.mark.multiprocess
def test_a_slurm_requeue_signal_during_an_async_save_saves_the_hpc_checkpoint(
    tmp_path: Path,
) -> None:
    """A real Trainer with SLURM auto-requeue: Lightning's SIGUSR1 handler saves
    `hpc_ckpt_1.ckpt` while ModelCheckpoint's asynchronous save of epoch 1 stages. It hung
    (the nested save waited for the write that waited for the staging it interrupted); now
    the fit ends with every checkpoint committed, the hpc one at that step."""
    root = tmp_path / "ckpts"
    code = SLURM_REQUEUE_DURING_AN_ASYNC_SAVE.format(tests=str(TESTS), root=str(root))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=slurm_job(tmp_path, "exit 0"), timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    io = SafepointCheckpointIO()
    assert io.load_checkpoint(root / "hpc_ckpt_1.ckpt")["global_step"] == 4
    for step in (2, 4, 6):
        assert io.load_checkpoint(root / f"epoch={step // 2 - 1}-step={step}.ckpt")[
            "global_step"] == step


SLURM_REQUEUE = """
import faulthandler, signal, sys, time
sys.path.insert(0, {tests!r})
import lightning.pytorch as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
import safepoint.integrations.lightning as spl
from test_lightning import loader, model_class

faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the test, with its stack
write = spl.write_and_commit
def slow_write(*args, **kwargs):  # a large checkpoint on a shared filesystem
    time.sleep(1.5)  # longer than the KillWait of `scontrol` below
    return write(*args, **kwargs)
spl.write_and_commit = slow_write

class Usr1(L.Callback):  # SLURM's --signal=USR1@90 lands during step 3
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            signal.raise_signal(signal.SIGUSR1)

torch.manual_seed(0)
L.Trainer(max_epochs=1000, accelerator="cpu", logger=False, enable_progress_bar=False,
          enable_model_summary=False, default_root_dir={root!r}, enable_checkpointing=False,
          plugins=[spl.SafepointCheckpointIO(async_save=True),
                   SLURMEnvironment(auto_requeue=True)],
          callbacks=[Usr1()]).fit(model_class(L)(), loader())
"""


@pytest.mark.multiprocess
def test_slurm_requeue_with_async_save_commits_the_hpc_checkpoint_before_requeue(
    tmp_path: Path,
) -> None:
    """Lightning's SIGUSR1 handler saves `hpc_ckpt_1.ckpt`, then runs `scontrol requeue`,
    which ends the job (SIGTERM, then SIGKILL once KillWait has passed). With
    `async_save=True` that save went to the background and the job was killed before its
    commit: the requeued job resumed from the uncommitted `hpc_ckpt_1.ckpt` and raised
    CheckpointNotFound, every time. The save is now synchronous: committed before the
    requeue."""
    root = tmp_path / "ckpts"
    # SLURM's KillWait is 30 s by default; 0.5 s here, shorter than the write above.
    scontrol = "kill -TERM $PPID\n(sleep 0.5; kill -KILL $PPID) >/dev/null 2>&1 &\nexit 0"
    code = SLURM_REQUEUE.format(tests=str(TESTS), root=str(root))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=slurm_job(tmp_path, scontrol), timeout=120)
    assert "Requeued SLURM job: 7" in child.stderr, child.stderr[-3000:]
    assert SafepointCheckpointIO().load_checkpoint(root / "hpc_ckpt_1.ckpt")[
        "global_step"] == 3


class _Observed(model_class(L)):  # type: ignore[misc]
    """Quantization-aware training's observer: its `eps` is a buffer that
    `_load_from_state_dict` resets when the state dict's `_metadata` gives no version."""

    def __init__(self) -> None:
        super().__init__()
        self.obs = torch.ao.quantization.MinMaxObserver(eps=1e-3)

    def training_step(self, batch: Any, _: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.obs(self.net(x)), y)


def test_resume_keeps_buffers_that_depend_on_state_dict_version_metadata(
    tmp_path: Path,
) -> None:
    """`nn.Module.state_dict()` attaches each submodule's version to the OrderedDict it returns
    (`_metadata`), which `torch.load` keeps. The plugin stored the state dict as a plain dict
    and dropped it: resumed, the observer took its state for the oldest version and its eps
    became float32's (1.2e-07), silently; so did the state dict of `load_checkpoint`, with or
    without `map_location`. It is recorded in the checkpoint's metadata and reattached."""
    def trainer(max_epochs: int) -> Any:
        return _trainer(SafepointCheckpointIO(),
                        [L.callbacks.ModelCheckpoint(tmp_path, save_last=True)],
                        max_epochs=max_epochs)

    torch.manual_seed(0)
    trainer(1).fit(_Observed(), loader())
    resumed = _Observed()
    resumed.obs.eps.fill_(0.5)
    trainer(2).fit(resumed, loader(), ckpt_path="last")
    assert resumed.obs.eps.item() == pytest.approx(1e-3)
    expected = _Observed().state_dict()._metadata
    for map_location in (None, "cpu"):
        loaded = SafepointCheckpointIO().load_checkpoint(tmp_path / "last.ckpt", map_location)
        assert loaded["state_dict"]._metadata == expected
        fresh = _Observed()
        fresh.load_state_dict(loaded["state_dict"])
        assert fresh.obs.eps.item() == pytest.approx(1e-3)
