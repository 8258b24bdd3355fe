"""sp.RNGState: every global random stream (and named extra generators) survives a save and a
load through a real checkpoint, bit for bit, with no pickle; CUDA parts are skipped cleanly
where CUDA is unavailable."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp


def _draws(extra: dict[str, object] | None = None) -> list[float]:
    """A few values from every stream, consuming them."""
    out = [random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn())]
    out += torch.rand(3).tolist() + torch.randn(2).tolist()
    for generator in (extra or {}).values():
        if isinstance(generator, torch.Generator):
            out += torch.rand(2, generator=generator).tolist()
        else:
            out += np.asarray(generator.random(2)).tolist()  # type: ignore[attr-defined]
    return out


def _scramble() -> None:
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def test_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.randn()  # and one in NumPy's
    rng = sp.RNGState()
    url = str(tmp_path / "rng")
    sp.save(url, {"rng": rng})
    expected = _draws()
    _scramble()
    sp.load(url, into={"rng": rng})
    assert _draws() == expected


def test_the_checkpoint_holds_no_pickle(tmp_path: Path) -> None:
    url = str(tmp_path / "rng")
    sp.save(url, {"rng": sp.RNGState()})
    kinds = {entry.path: entry.kind for entry in sp.info(url).entries}
    assert "pickle" not in kinds.values()
    assert kinds["rng/torch"] == "tensor"
    assert kinds["rng/python/words"] == "ndarray"
    assert kinds["rng/numpy/keys"] == "ndarray"
    tree = sp.load(url)  # allow_pickle=False: loads
    assert tree["rng"]["python"]["version"] == 3


def test_named_generators_round_trip(tmp_path: Path) -> None:
    extra = {"aug": torch.Generator().manual_seed(5), "noise": np.random.default_rng(7)}
    extra["noise"].random(3)  # type: ignore[attr-defined]
    rng = sp.RNGState(generators=extra)
    url = str(tmp_path / "rng")
    sp.save(url, {"rng": rng})
    expected = _draws(extra)
    _scramble()
    fresh = {"aug": torch.Generator().manual_seed(0), "noise": np.random.default_rng(0)}
    restored = sp.RNGState(generators=fresh)
    sp.load(url, into={"rng": restored})
    assert _draws(fresh) == expected


def test_a_generator_the_checkpoint_lacks_is_an_error(tmp_path: Path) -> None:
    url = str(tmp_path / "rng")
    sp.save(url, {"rng": sp.RNGState()})
    target = sp.RNGState(generators={"aug": torch.Generator()})
    with pytest.raises(sp.StateMismatch, match="aug"):
        sp.load(url, into={"rng": target})


def test_a_saved_generator_the_target_lacks_is_an_error(tmp_path: Path) -> None:
    """A resumed script that forgot a named generator would draw another data stream than
    the saved run: strict restore names it (lenient skips it, as with any unexpected key)."""
    url = str(tmp_path / "rng")
    sp.save(url, {"rng": sp.RNGState(generators={"data": torch.Generator().manual_seed(5)})})
    with pytest.raises(sp.StateMismatch, match="not in the target: rng/generators/data"):
        sp.load(url, into={"rng": sp.RNGState()})
    sp.load(url, into={"rng": sp.RNGState()}, strict=False)


def test_a_generator_of_another_kind_is_an_error(tmp_path: Path) -> None:
    url = str(tmp_path / "rng")
    sp.save(url, {"rng": sp.RNGState(generators={"g": torch.Generator()})})
    target = sp.RNGState(generators={"g": np.random.default_rng(0)})
    with pytest.raises(sp.StateMismatch, match="generators/g"):
        sp.load(url, into={"rng": target})


def test_unsupported_generator_is_refused_by_name() -> None:
    for other in (random.Random(0), np.random.RandomState(0)):
        with pytest.raises(sp.UnsupportedLeaf, match="'bad' is a") as caught:
            sp.RNGState(generators={"bad": other})
        assert caught.value.path == "generators/bad"


@pytest.mark.parametrize("generators", [[torch.Generator()], torch.Generator()],
                         ids=["list", "generator"])
def test_generators_not_named_are_refused_saying_what_to_pass(generators: Any) -> None:
    """`generators=[g]` or `generators=g` (forgetting the names) raised a bare TypeError from
    `dict(...)` (found by a review)."""
    with pytest.raises(sp.UnsupportedLeaf, match=r"generators=.*pass a dict") as caught:
        sp.RNGState(generators=generators)
    assert caught.value.path == "generators"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cuda_states_are_skipped_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    rng = sp.RNGState()
    state = rng.state_dict()
    assert state["cuda"] == []
    torch.manual_seed(4)
    state = rng.state_dict()
    expected = torch.rand(2).tolist()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2  # as written on a 2-GPU host
    with caplog.at_level(logging.WARNING, logger="safepoint._rng"):
        rng.load_state_dict(state)
    assert "2 CUDA devices" in caplog.text
    assert torch.rand(2).tolist() == expected


def test_a_checkpoint_of_fewer_cuda_devices_restores_on_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint from a CPU or 1-GPU machine restores on a host with more GPUs (a job
    moved to a bigger instance): each device it has a state for gets it, the others keep
    their own. The CUDA calls are stand-ins here, recording what was set."""
    def fake_cuda(devices: int, value: int) -> dict[int, list[int]]:
        set_states: dict[int, list[int]] = {}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [
            torch.full((16,), value + device, dtype=torch.uint8) for device in range(devices)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=0: set_states
                            .__setitem__(device, state.tolist()))
        return set_states

    for saved in (0, 1):
        url = str(tmp_path / f"rng-{saved}")
        fake_cuda(saved, 100)
        sp.save(url, {"rng": sp.RNGState()})
        set_states = fake_cuda(2, 0)
        sp.load(url, into={"rng": sp.RNGState()})
        assert set_states == {0: [100 if saved else 0] * 16, 1: [1] * 16}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_cuda_device_round_trips(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(11)
    rng = sp.RNGState()
    url = str(tmp_path / "rng")
    sp.save(url, {"rng": rng})
    count = torch.cuda.device_count()
    expected = [torch.rand(4, device=f"cuda:{d}").tolist() for d in range(count)]
    torch.cuda.manual_seed_all(0)
    sp.load(url, into={"rng": rng})
    assert [torch.rand(4, device=f"cuda:{d}").tolist() for d in range(count)] == expected


@pytest.mark.multiprocess
def test_restores_torch_s_stream_into_an_object_made_before_torch_was_imported(
    tmp_path: Path,
) -> None:
    """A process that made its RNGState before importing torch (its state dict lacks
    "torch") still restores the saved torch stream, strictly."""
    url = str(tmp_path / "rng")
    torch.manual_seed(3)
    sp.save(url, {"rng": sp.RNGState()})
    expected = torch.rand(3).tolist()
    code = f"""
        import sys
        import safepoint as sp
        assert "torch" not in sys.modules
        rng = sp.RNGState()
        sp.load({url!r}, into={{"rng": rng}})
        import torch
        print(torch.rand(3).tolist())
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(expected)


def test_works_without_torch(tmp_path: Path) -> None:
    code = f"""
        import random, sys
        sys.modules["torch"] = None
        import numpy as np
        import safepoint as sp
        rng = sp.RNGState()
        assert "torch" not in rng.state_dict()
        sp.save({str(tmp_path / "np")!r}, {{"rng": rng}})
        expected = (random.random(), np.random.rand())
        random.seed(5); np.random.seed(5)
        sp.load({str(tmp_path / "np")!r}, into={{"rng": rng}})
        assert (random.random(), np.random.rand()) == expected
        print("OK")
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"


def test_a_state_saved_where_torch_is_missing_restores_strictly_where_it_is_imported(
    tmp_path: Path,
) -> None:
    """A NumPy-only job's RNGState has no "torch" stream: restored where torch is imported,
    the strict load refused it as missing from the checkpoint (as "cuda" is not)."""
    url = str(tmp_path / "ckpt")
    code = ("import sys; sys.modules['torch'] = None\n"
            "import random, numpy as np, safepoint as sp\n"
            "random.seed(3); np.random.seed(3)\n"
            f"sp.save({url!r}, {{'rng': sp.RNGState()}})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    random.seed(3)
    np.random.seed(3)
    expected = (random.random(), np.random.random())
    random.seed(0)
    np.random.seed(0)
    sp.load(url, into={"rng": sp.RNGState()})
    assert (random.random(), np.random.random()) == expected


@pytest.mark.parametrize("kind", ["PCG64", "PCG64DXSM", "Philox", "SFC64"])
def test_numpy_s_global_stream_round_trips_with_another_bit_generator(
    tmp_path: Path, kind: str
) -> None:
    """`np.random.set_bit_generator` gives the global stream another bit generator, whose
    state `np.random.get_state(legacy=True)` returns as a dict: state_dict() failed with a raw
    ValueError unpacking it. It is saved as NumPy's own dict (128-bit ints kept exactly), with
    its cached Gaussian."""
    previous = np.random.get_bit_generator()
    np.random.set_bit_generator(getattr(np.random, kind)(5))
    try:
        np.random.randn()  # leaves a cached Gaussian
        rng = sp.RNGState()
        url = str(tmp_path / "rng")
        sp.save(url, {"rng": rng})
        expected = [float(np.random.randn()), *np.random.random(4).tolist()]
        np.random.random(7)
        sp.load(url, into={"rng": rng})
        assert [float(np.random.randn()), *np.random.random(4).tolist()] == expected
        assert sp.load(url)["rng"]["numpy"]["bit_generator"] == kind
    finally:
        np.random.set_bit_generator(previous)
