"""Events: what a manager reports for saves, loads, deletes and errors, with timings and
bytes; callbacks that raise do not break saving; events reach logging."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import safepoint as sp
from safepoint._events import Event, emit


def test_manager_reports_save_load_delete(tmp_path: Path) -> None:
    events: list[sp.Event] = []
    state = {"w": torch.randn(256, 256)}
    with sp.CheckpointManager(str(tmp_path), keep_last=1, on_event=events.append) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.wait()
        mgr.restore(state)
    kinds = [(e.kind, e.step) for e in events]
    assert kinds == [("save", 1), ("save", 2), ("delete", 1), ("load", 2)]
    save = events[0]
    assert save.nbytes >= 256 * 256 * 4
    assert 0 < save.blocked_seconds <= save.seconds
    assert save.url == save.path == str(tmp_path / "step-1")
    assert save.bytes_per_second > 0
    assert events[2].nbytes == save.nbytes


def test_sync_save_blocks_for_the_whole_save(tmp_path: Path) -> None:
    events: list[sp.Event] = []
    with sp.CheckpointManager(str(tmp_path), async_save=False, on_event=[events.append]) as mgr:
        mgr.save(1, {"x": torch.ones(10)})
    assert events[0].blocked_seconds == events[0].seconds


def test_a_raising_callback_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: sp.Event) -> None:
        raise RuntimeError("watcher bug")

    with sp.CheckpointManager(str(tmp_path), on_event=broken) as mgr:
        mgr.save(1, {"x": torch.ones(10)}).result()
        assert mgr.steps() == [1]
    assert "watcher bug" in caplog.text


def test_events_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="safepoint"):
        emit(Event("save", "/ckpt/step-3", 3, 2.0, 0.5, 4_000_000), [])
        emit(Event("error", "/ckpt/step-4", 4, error="disk full"), [])
    assert "save step 3 (/ckpt/step-3): 4.0 MB in 2.000 s, 2 MB/s, blocked 0.500 s" in caplog.text
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert "disk full" in caplog.records[1].getMessage()


def test_save_and_load_report_to_on_event(tmp_path: Path) -> None:
    events: list[sp.Event] = []
    url = str(tmp_path / "one")
    sp.save(url, {"w": torch.ones(1000)}, on_event=events.append)
    sp.load(url, on_event=events.append)
    with pytest.raises(sp.CheckpointExists):
        sp.save(url, {"w": torch.ones(3)}, on_event=events.append)
    with pytest.raises(sp.CheckpointNotFound):
        sp.load(str(tmp_path / "missing"), on_event=events.append)
    assert [(e.kind, e.step) for e in events] == [
        ("save", None), ("load", None), ("error", None), ("error", None)]
    assert events[0].nbytes >= 4000 and events[1].nbytes == 4000
    assert events[0].url == url and events[0].blocked_seconds == events[0].seconds
    assert "CheckpointExists" in (events[2].error or "")
    assert "CheckpointNotFound" in (events[3].error or "")


def test_a_load_reports_the_bytes_it_reads(tmp_path: Path) -> None:
    """A load of 4 rows of a 4 MiB tensor into an sp.Shard reads 16 KiB: its event and its
    progress say so, not the size of the selected entries."""
    url = str(tmp_path / "c")
    sp.save(url, {"a": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)})
    events: list[sp.Event] = []
    seen: list[tuple[int, int]] = []
    part = torch.zeros(4, 1024)
    sp.load(url, {"a": sp.Shard(part, (0, 0), (1024, 1024))}, on_event=events.append,
            progress=lambda done, total: seen.append((done, total)))
    assert torch.equal(part, torch.arange(4096, dtype=torch.float32).reshape(4, 1024))
    assert seen[-1] == (16384, 16384)
    assert [(e.kind, e.nbytes) for e in events] == [("load", 16384)]


@pytest.mark.parametrize("on_event", [5, [print, 5]], ids=["number", "list-with-a-number"])
def test_on_event_must_be_callables(tmp_path: Path, on_event: object) -> None:
    """on_event=5 raised a bare TypeError; [print, 5] was taken and failed on every event."""
    with pytest.raises(sp.SafepointError, match=r"on_event=.*pass a function"):
        sp.CheckpointManager(str(tmp_path / "run"), on_event=on_event)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_manager_save_or_restore_refused_in_the_caller_is_an_error_event(
    tmp_path: Path, async_save: bool,
) -> None:
    """Every error produces an event, as sp.save and sp.load give one: a manager's save of
    an unsupported leaf, a restore refused as a mismatch or of a step not there, a bad step
    (each gave none)."""
    events: list[sp.Event] = []
    with sp.CheckpointManager(str(tmp_path / "run"), on_event=events.append,
                              async_save=async_save) as mgr:
        mgr.save(1, {"x": torch.ones(2)}).result()
        calls = [
            (sp.UnsupportedLeaf, lambda: mgr.save(2, {"x": object()})),
            (sp.UnsupportedLeaf, lambda: mgr.save(2, {"x": 1}, metadata=[("a", 1)])),
            (sp.StateMismatch, lambda: mgr.restore({"y": torch.ones(2)})),
            (sp.CheckpointNotFound, lambda: mgr.restore({"x": torch.ones(2)}, step=7)),
            (sp.SafepointError, lambda: mgr.save("2", {"x": 1})),
        ]
        for error, call in calls:
            events.clear()
            with pytest.raises(error):
                call()
            assert [e.kind for e in events] == ["error"], (error, events)
            assert error.__name__ in (events[0].error or "")


def test_a_save_refused_in_the_caller_names_the_step_s_url(tmp_path: Path) -> None:
    """The event of a save refused in the caller's thread names the step's URL, as every
    other path's does (it named the root)."""
    events: list[sp.Event] = []
    with sp.CheckpointManager(str(tmp_path / "run"), on_event=events.append) as mgr:
        with pytest.raises(sp.UnsupportedLeaf):
            mgr.save(2, {"x": object()})
        assert [(e.kind, e.step, e.url) for e in events] == [("error", 2, mgr.step_url(2))]


def test_a_generator_of_callbacks_reaches_every_manager_of_two_tiers(tmp_path: Path) -> None:
    """on_event=(a generator) is listed once: a two-tier manager passed it on to three
    managers, and the first used it up (no event reached the caller)."""
    seen: list[str] = []
    with sp.CheckpointManager(str(tmp_path / "remote"), local_dir=str(tmp_path / "local"),
                              on_event=(f for f in [lambda e: seen.append(e.kind)])) as mgr:
        mgr.save(1, {"w": torch.zeros(3)}).result()
        mgr.wait()
    assert "save" in seen and "upload" in seen, seen

