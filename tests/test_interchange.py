"""Export to and import from torch.save and safetensors files: round trips that `sp.diff` finds
identical, weights-only exports that `load_state_dict` takes, the pickle refusal of `.pt`
imports, plain values through safetensors metadata, and the errors."""

from __future__ import annotations

import argparse
import codecs
import collections
import io
import json
import os
import pickle
import random
import re
import struct
import subprocess
import sys
import types
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch as safetensors_torch
import torch

import safepoint as sp
import safepoint.cli


@pytest.fixture
def ckpt(tmp_path, make_training_state) -> str:
    """A training state with extra leaves: bf16 and fp8 tensors, a tuple, int keys, values."""
    state = make_training_state()
    state["extra"] = {
        "bf16": torch.linspace(-2, 2, 7, dtype=torch.bfloat16),
        "fp8": torch.linspace(-1, 1, 5).to(torch.float8_e4m3fn),
        "pair": (1.5, "text"),
        3: None,
    }
    url = str(tmp_path / "ckpt")
    sp.save(url, state)
    return url


def test_pt_round_trip_is_identical(tmp_path, ckpt):
    out = tmp_path / "all.pt"
    report = sp.export_checkpoint(ckpt, out)
    assert report.out == str(out) and report.nbytes == out.stat().st_size
    assert report.paths == [e.path for e in sp.info(ckpt).entries]
    assert not list(tmp_path.glob("*.tmp-*"))

    loaded = torch.load(out, weights_only=True)  # a plain torch file anyone can read
    assert loaded["extra"]["pair"] == (1.5, "text") and loaded["extra"][3] is None
    weights = sp.load(ckpt, keys=["model/"])["model"]
    assert torch.equal(loaded["model"]["0.weight"], weights["0.weight"])

    info = sp.import_checkpoint(out, str(tmp_path / "back"))
    assert info.metadata == {"imported_from": "all.pt"}
    assert sp.diff(ckpt, str(tmp_path / "back")).identical


def test_pt_export_turns_arrays_into_tensors(tmp_path):
    sp.save(str(tmp_path / "c"), {"a": np.arange(3, dtype=np.int32), "s": np.float64(2.5)})
    sp.export_checkpoint(str(tmp_path / "c"), tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(loaded["a"], torch.arange(3, dtype=torch.int32))
    assert loaded["s"].item() == 2.5


def test_weights_only_safetensors_export_loads_into_a_module(tmp_path, ckpt, make_training_state):
    out = tmp_path / "weights.safetensors"
    report = sp.export_checkpoint(ckpt, out, strip_prefix="model/")
    assert report.paths == ["0.weight", "0.bias", "2.weight", "2.bias"]

    fresh = make_training_state(seed=1)["model"]
    fresh.load_state_dict(safetensors_torch.load_file(out))
    saved = sp.load(ckpt, keys=["model/"])["model"]
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[name])


def test_keys_export_keeps_full_paths(tmp_path, ckpt):
    out = tmp_path / "model.safetensors"
    sp.export_checkpoint(ckpt, out, keys=["model/"])
    assert sorted(safetensors_torch.load_file(out)) == [
        "model/0.bias", "model/0.weight", "model/2.bias", "model/2.weight"
    ]


def test_safetensors_round_trip_keeps_values_dtypes_and_paths(tmp_path, ckpt):
    out = tmp_path / "all.safetensors"
    sp.export_checkpoint(ckpt, out)
    tensors = safetensors_torch.load_file(out)
    assert tensors["extra/bf16"].dtype == torch.bfloat16
    assert tensors["extra/fp8"].dtype == torch.float8_e4m3fn
    assert "optim/state/0/exp_avg" in tensors

    sp.import_checkpoint(out, str(tmp_path / "back"))
    back = sp.load(str(tmp_path / "back"))
    # Nested again at "/"; plain values come back from the header. Tuples and int keys do not
    # survive a flat format: paths do, so an in-place restore still matches.
    assert back["step"] == 3 and back["extra"]["3"] is None
    assert back["extra"]["pair"] == {"0": 1.5, "1": "text"}
    original = sp.load(ckpt)
    assert back["optim"]["param_groups"]["0"]["lr"] == original["optim"]["param_groups"][0]["lr"]
    # Every entry is the same; diff reports the containers that changed type (the tuple and
    # lists became dicts, int keys str ones), which a load without into= builds differently.
    report = sp.diff(ckpt, str(tmp_path / "back"))
    changed = {d.path: (d.a, d.b) for d in report.differences}
    assert {d.change for d in report.differences} == {"structure"}, report.differences
    assert changed["extra/pair"] == ("tuple", "dict")
    assert changed["extra/3"] == ("entry at key 3", "entry at key '3'")

    state = {"model": torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                          torch.nn.Linear(16, 4))}
    sp.load(str(tmp_path / "back"), into=state, keys=["model/"])
    assert torch.equal(state["model"][0].weight, tensors["model/0.weight"])


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".tar"])
def test_an_export_gets_the_mode_a_new_file_gets(tmp_path: Path, suffix: str) -> None:
    """safetensors writes its file 0600 whatever the umask: a .safetensors export was
    private to its owner while a .pt or .tar export beside it was readable by the group, as
    the umask said. Every export now gets 0666 less the umask, a replaced one too."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"w": torch.ones(3)})
    out = tmp_path / f"out{suffix}"
    previous = os.umask(0o002)
    try:
        for _ in range(2):  # a new file, then one replaced
            sp.export_checkpoint(url, out)
            assert out.stat().st_mode & 0o777 == 0o664
        os.umask(0o077)
        sp.export_checkpoint(url, out)
        assert out.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(previous)


def test_safetensors_export_refuses_bytes_and_pickles(tmp_path):
    url = str(tmp_path / "c")
    sp.save(url, {"w": torch.ones(2), "blob": b"raw", "obj": sp.Pickled({1, 2})})
    with pytest.raises(sp.UnsupportedLeaf, match="blob") as caught:
        sp.export_checkpoint(url, tmp_path / "c.safetensors", allow_pickle=True)
    assert "obj" in str(caught.value) and "--keys" in str(caught.value)
    assert not (tmp_path / "c.safetensors").exists()
    with pytest.raises(sp.PickleNotAllowed):
        sp.export_checkpoint(url, tmp_path / "c.pt")
    sp.export_checkpoint(url, tmp_path / "w.safetensors", keys=["w"])
    assert list(safetensors_torch.load_file(tmp_path / "w.safetensors")) == ["w"]


def test_safetensors_export_refuses_torch_bits_dtypes(tmp_path):
    url = str(tmp_path / "c")
    sp.save(url, {"w": torch.ones(2), "flags": torch.zeros(4, dtype=torch.uint8).view(
        torch.bits8)})
    with pytest.raises(sp.UnsupportedLeaf, match="flags") as caught:
        sp.export_checkpoint(url, tmp_path / "c.safetensors")
    assert "bits dtype" in str(caught.value) and ".pt" in str(caught.value)
    assert not (tmp_path / "c.safetensors").exists()
    sp.export_checkpoint(url, tmp_path / "c.pt")
    exported = torch.load(tmp_path / "c.pt")
    assert exported["flags"].dtype == torch.bits8


def test_safetensors_export_refuses_a_0d_float4_and_keeps_others(tmp_path):
    """safetensors stores a float4_e2m1fn_x2 element's two 4-bit values along the last
    dimension; a 0-d tensor has none, and its writer failed: the export raised StorageError
    telling to check the path, permissions and free space (found by a review). Refused as
    safetensors cannot hold it, naming the entry, before anything is written; a float4 tensor
    of any other shape still round-trips."""
    url = str(tmp_path / "c")
    packed = torch.arange(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    sp.save(url, {"w": torch.ones(2), "f4": packed[3].clone()})
    with pytest.raises(sp.UnsupportedLeaf, match=r"0-d float4_e2m1fn_x2.*\['f4'\]") as caught:
        sp.export_checkpoint(url, tmp_path / "c.safetensors")
    assert caught.value.path == "f4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    for shape in [(6,), (2, 3), (6, 1)]:
        sp.save(url, {"f4": packed.reshape(shape)}, overwrite=True)
        sp.export_checkpoint(url, tmp_path / "c.safetensors")
        sp.import_checkpoint(tmp_path / "c.safetensors", str(tmp_path / "back"), overwrite=True)
        back = sp.load(str(tmp_path / "back"))["f4"]
        assert back.dtype == packed.dtype and back.shape == shape
        assert torch.equal(back.view(torch.uint8), packed.reshape(shape).view(torch.uint8))
        (tmp_path / "c.safetensors").unlink()


def test_flat_safetensors_files_import_flat(tmp_path):
    src = tmp_path / "hf.safetensors"
    safetensors_torch.save_file({"model.embed.weight": torch.ones(2, 2),
                                 "lm_head.weight": torch.zeros(2)}, str(src))
    sp.import_checkpoint(src, str(tmp_path / "c"))
    assert sorted(e.path for e in sp.info(str(tmp_path / "c")).entries) == [
        "lm_head.weight", "model.embed.weight"
    ]


def test_pt_import_refuses_pickle_unless_allowed(tmp_path):
    src = tmp_path / "objects.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, src)
    with pytest.raises(sp.PickleNotAllowed, match="--allow-pickle") as caught:
        sp.import_checkpoint(src, str(tmp_path / "c"))
    assert "Namespace" in str(caught.value)
    with pytest.raises(sp.SafepointError, match=r"allow_pickle='False' for .*: pass True"):
        sp.import_checkpoint(src, str(tmp_path / "c"), allow_pickle="False")  # a true str
    assert not (tmp_path / "c").exists()

    sp.import_checkpoint(src, str(tmp_path / "c"), allow_pickle=True)
    kinds = {e.path: e.kind for e in sp.info(str(tmp_path / "c")).entries}
    assert kinds == {"w": "tensor", "args": "pickle"}
    with pytest.raises(sp.PickleNotAllowed):
        sp.load(str(tmp_path / "c"))
    assert sp.load(str(tmp_path / "c"), allow_pickle=True)["args"] == argparse.Namespace(lr=0.1)


def test_pt_import_stores_a_bytearray_natively(tmp_path):
    # The format stores a bytearray as its `bytes` kind, so an import needs no pickle for one.
    torch.save({"w": torch.ones(2), "blob": bytearray(b"\x00\x01")}, tmp_path / "x.pt")
    sp.import_checkpoint(tmp_path / "x.pt", str(tmp_path / "c"))
    assert {e.path: e.kind for e in sp.info(str(tmp_path / "c")).entries}["blob"] == "bytes"
    assert sp.load(str(tmp_path / "c"))["blob"] == b"\x00\x01"

    sp.import_checkpoint(tmp_path / "x.pt", str(tmp_path / "p"), allow_pickle=True)
    assert {e.path: e.kind for e in sp.info(str(tmp_path / "p")).entries}["blob"] == "bytes"


def test_import_errors(tmp_path):
    with pytest.raises(sp.SafepointError, match="file format"):
        sp.import_checkpoint(tmp_path / "x.txt", str(tmp_path / "c"))
    with pytest.raises(sp.CheckpointNotFound, match=r"missing\.pt"):
        sp.import_checkpoint(tmp_path / "missing.pt", str(tmp_path / "c"))
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(sp.CorruptCheckpoint, match=r"junk\.pt"):
        sp.import_checkpoint(tmp_path / "junk.pt", str(tmp_path / "c"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(sp.CorruptCheckpoint, match=r"junk\.safetensors"):
        sp.import_checkpoint(tmp_path / "junk.safetensors", str(tmp_path / "c"))
    torch.save(torch.ones(2), tmp_path / "bare.pt")
    with pytest.raises(sp.UnsupportedLeaf, match="not a dict"):
        sp.import_checkpoint(tmp_path / "bare.pt", str(tmp_path / "c"))
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    sp.import_checkpoint(tmp_path / "ok.pt", str(tmp_path / "c"), metadata={"note": 1})
    with pytest.raises(sp.CheckpointExists):
        sp.import_checkpoint(tmp_path / "ok.pt", str(tmp_path / "c"))
    sp.import_checkpoint(tmp_path / "ok.pt", str(tmp_path / "c"), overwrite=True)
    assert sp.info(str(tmp_path / "c")).metadata == {"imported_from": "ok.pt"}


def test_export_errors(tmp_path, ckpt):
    with pytest.raises(sp.SafepointError, match="file format"):
        sp.export_checkpoint(ckpt, tmp_path / "out.npz")
    with pytest.raises(sp.StateMismatch, match="match nothing"):
        sp.export_checkpoint(ckpt, tmp_path / "out.pt", keys=["nope/"])
    with pytest.raises(sp.CheckpointNotFound):
        sp.export_checkpoint(str(tmp_path / "none"), tmp_path / "out.pt")
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(sp.StorageError, match="a-file"):
        sp.export_checkpoint(ckpt, tmp_path / "a-file" / "out.pt")
    for prefix in ("optim/param_groups/0/lr", "optim/nothing/"):
        with pytest.raises(sp.StateMismatch, match="not a container"):
            sp.export_checkpoint(ckpt, tmp_path / "out.pt", keys=["optim/"],
                                 strip_prefix=prefix)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "ckpt"]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".tar"])
def test_export_to_where_no_file_can_be_made_is_a_storage_error(ckpt, suffix):
    """torch.save and safetensors report a failed write as RuntimeError or SafetensorError,
    and /proc takes no new file (ENOENT): each is a StorageError naming the file, which the
    command line prints as an error, not a traceback (found by a review)."""
    out = f"/proc/safepoint-export{suffix}"
    with pytest.raises(sp.StorageError, match=rf"writing {out} failed.*free space"):
        sp.export_checkpoint(ckpt, out)
    assert safepoint.cli.main(["export", ckpt, out]) == 1


def test_safetensors_values_header_is_plain_json(tmp_path, ckpt):
    out = tmp_path / "all.safetensors"
    sp.export_checkpoint(ckpt, out, keys=["step", "extra/pair"])
    header_size = int.from_bytes(out.read_bytes()[:8], "little")
    header = json.loads(out.read_bytes()[8 : 8 + header_size])
    assert json.loads(header["__metadata__"]["safepoint.values"]) == {
        "step": 3, "extra/pair/0": 1.5, "extra/pair/1": "text"
    }


def test_path_escapes_survive_safetensors(tmp_path):
    url = str(tmp_path / "c")
    sp.save(url, {"a/b": {"100%": torch.ones(1)}})
    sp.export_checkpoint(url, tmp_path / "c.safetensors")
    assert list(safetensors_torch.load_file(tmp_path / "c.safetensors")) == ["a%2Fb/100%25"]
    sp.import_checkpoint(tmp_path / "c.safetensors", str(tmp_path / "back"))
    assert list(sp.load(str(tmp_path / "back"))) == ["a/b"]
    assert Path(tmp_path / "back" / "manifest.json").is_file()


def test_tied_weights_export_and_import_under_both_names(tmp_path):
    """Tied weights are one tensor under two names: a .pt export keeps them one tensor, a
    safetensors export (which refuses shared memory) writes both names, and imports store the
    tie once again."""
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20, bias=False))
    model[1].weight = model[0].weight
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": model})
    sp.export_checkpoint(url, tmp_path / "tied.pt")
    loaded = torch.load(tmp_path / "tied.pt", weights_only=True)["model"]
    assert loaded["1.weight"] is loaded["0.weight"]
    sp.export_checkpoint(url, tmp_path / "tied.safetensors", strip_prefix="model/")
    flat = safetensors_torch.load_file(tmp_path / "tied.safetensors")
    assert torch.equal(flat["1.weight"], flat["0.weight"])
    fresh = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20, bias=False))
    fresh.load_state_dict(flat)
    assert torch.equal(fresh[1].weight, model[0].weight)
    info = sp.import_checkpoint(tmp_path / "tied.pt", str(tmp_path / "back"))
    assert [(e.path, e.kind) for e in info.entries] == [
        ("model/0.weight", "tensor"), ("model/1.weight", "alias")]
    assert sp.diff(url, str(tmp_path / "back")).identical


def test_strided_tensors_export_as_each_format_stores_them(tmp_path):
    """A tensor saved with its strides (channels_last, a transposed weight) loads with them.
    safetensors refuses non-contiguous tensors, so its export writes them in row-major
    order (a tied one's copy too); a .pt export keeps the strides, as torch.save does, and a
    .pt import records them again."""
    conv = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    state = {"conv": conv, "tied": conv, "proj": torch.randn(5, 3).t()}
    url = str(tmp_path / "ckpt")
    sp.save(url, state)
    sp.export_checkpoint(url, tmp_path / "flat.safetensors")
    flat = safetensors_torch.load_file(tmp_path / "flat.safetensors")
    assert all(torch.equal(flat[key], value) for key, value in state.items())
    sp.export_checkpoint(url, tmp_path / "all.pt")
    loaded = torch.load(tmp_path / "all.pt", weights_only=True)
    assert [loaded[key].stride() for key in state] == [value.stride() for value in state.values()]
    sp.import_checkpoint(tmp_path / "all.pt", str(tmp_path / "back"))
    back = sp.load(str(tmp_path / "back"))
    assert [back[key].stride() for key in state] == [value.stride() for value in state.values()]
    assert sp.diff(url, str(tmp_path / "back")).identical


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32])
def test_a_dtype_safetensors_lacks_is_refused_by_path(tmp_path, dtype):
    url = str(tmp_path / "ckpt")
    sp.save(url, {"w": torch.ones(3), "z": torch.zeros(3, dtype=dtype)})
    with pytest.raises(sp.UnsupportedLeaf, match=r"\['z'\]"):
        sp.export_checkpoint(url, tmp_path / "x.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_selection_of_part_of_a_list_is_refused_not_renumbered(tmp_path):
    """Loading models/2 alone gives a list of one: exported, it would be named models/0.
    Such a selection is refused, naming a path; the whole list exports under its names."""
    models = [torch.nn.Linear(2, 2) for _ in range(3)]
    url = str(tmp_path / "ckpt")
    sp.save(url, {"models": models})
    out = tmp_path / "m.safetensors"
    for options in ({"keys": ["models/2/"]}, {"strip_prefix": "models/2/"},
                    {"keys": ["models/0/", "models/2/"], "strip_prefix": "models/1/"}):
        with pytest.raises(sp.StateMismatch, match=r"'models/2/\w+'.*renumbered"):
            sp.export_checkpoint(url, out, **options)
    assert not out.exists()
    sp.export_checkpoint(url, out, keys=["models/"])
    assert torch.equal(safetensors_torch.load_file(out)["models/2/weight"], models[2].weight)


def test_import_of_what_is_not_a_file_says_what_is_there(tmp_path: Path) -> None:
    """A directory named last.ckpt (a checkpoint the Lightning plugin saved) or a FIFO named
    x.pt was reported as "no file at ...", as if nothing were there."""
    ckpt = tmp_path / "last.ckpt"
    sp.save(str(ckpt), {"w": torch.ones(2)})
    with pytest.raises(sp.CheckpointNotFound, match=r"last\.ckpt is a directory, not a file "
                       r"to import: a safepoint checkpoint .* needs no import"):
        sp.import_checkpoint(ckpt, str(tmp_path / "out"))
    fifo = tmp_path / "x.pt"
    os.mkfifo(fifo)
    with pytest.raises(sp.CheckpointNotFound, match=r"no file at .*x\.pt \(something that is "
                       r"not a regular file is there"):
        sp.import_checkpoint(fifo, str(tmp_path / "out"))
    with pytest.raises(sp.CheckpointNotFound, match=r"no file at .*y\.pt: check the path"):
        sp.import_checkpoint(tmp_path / "y.pt", str(tmp_path / "out"))


def test_a_strip_prefix_outside_the_keys_says_so(tmp_path: Path) -> None:
    """--strip-prefix optim/ with --keys model/ said "'optim/' is not a container", which it
    is: the keys left it out. The error now names the keys."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": {"w": torch.ones(2)}, "optim": {"m": torch.zeros(2)}})
    out = tmp_path / "x.safetensors"
    with pytest.raises(sp.StateMismatch, match=r"'optim/' is not a container among the entries "
                       r"keys=\['model/'\] selects .*or no keys"):
        sp.export_checkpoint(url, out, keys=["model/"], strip_prefix="optim/")
    assert not out.exists()


def test_lists_and_tuples_restore_in_place_from_an_imported_flat_file(tmp_path):
    """A safetensors import turns lists and tuples into dicts of their indices: the paths are
    the same, so a load into the live state fills its lists and tuples."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"lrs": [0.1, 0.2], "pair": (1, 2), "w": torch.ones(2)})
    sp.export_checkpoint(url, tmp_path / "s.safetensors")
    sp.import_checkpoint(tmp_path / "s.safetensors", str(tmp_path / "imported"))
    live = sp.load(str(tmp_path / "imported"),
                   into={"lrs": [0.0, 0.0], "pair": (0, 0), "w": torch.zeros(2)})
    assert live["lrs"] == [0.1, 0.2] and live["pair"] == (1, 2)
    assert torch.equal(live["w"], torch.ones(2))


@pytest.mark.parametrize("values", ["5", "[1, 2]", "null", '{"x": [1]}', '{"x": {"y": 1}}',
                                    "[" * 5000 + "]" * 5000])
def test_safetensors_with_malformed_values_header_is_corrupt(tmp_path, values):
    """A `safepoint.values` header that is JSON but no object of path -> plain value (or nests
    past the recursion limit) is a damaged file, not a TypeError or RecursionError (found by a
    review)."""
    src = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, src, metadata={"safepoint.values": values})
    with pytest.raises(sp.CorruptCheckpoint, match=r"m\.safetensors.*safepoint\.values.*remove"):
        sp.import_checkpoint(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_safetensors_values_header_cannot_replace_a_tensor(tmp_path):
    """A header value at a tensor's path would drop the tensor silently: refused, naming the
    key (found by a review)."""
    src = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, src,
                                metadata={"safepoint.values": '{"w": 1}'})
    with pytest.raises(sp.CorruptCheckpoint, match=r"m\.safetensors: key 'w' is both a tensor"):
        sp.import_checkpoint(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _deep_pt(path: Path, depth: int) -> None:
    """A torch.save file of {"a": [[[...]]]}, `depth` lists deep, pickled with flat opcodes
    (torch.load's unpickler reads it without recursing)."""
    pickled = b"\x80\x02}X\x01\x00\x00\x00a" + b"]" * depth + b"a" * (depth - 1) + b"s."
    torch.save({"a": 1}, path)
    with zipfile.ZipFile(path) as source:
        members = [(info.filename, source.read(info.filename)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name, data in members:
            out.writestr(name, pickled if name.endswith("data.pkl") else data)


@pytest.mark.parametrize("depth", [700, 5000])
def test_torch_file_with_deeply_nested_list_is_a_safepoint_error(tmp_path, depth):
    """Lists nested deeper than the recursion limit: an UnsupportedLeaf naming the file, not
    a RecursionError from walking the tree (found by a review)."""
    src = tmp_path / "deep.pt"
    _deep_pt(src, depth)
    assert isinstance(torch.load(src, weights_only=True), dict)
    with pytest.raises(sp.UnsupportedLeaf, match=r"deep\.pt nests .* too deeply.*flatten"):
        sp.import_checkpoint(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    _deep_pt(src, 20)
    sp.import_checkpoint(src, str(tmp_path / "out"))


def _damaged_torch_file(tmp_path: Path) -> Path:
    """A torch.save file one of whose pickled strings has become invalid UTF-8 (a few flipped
    bytes, as a bad disk or a torn download leaves)."""
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2), "name": "abcdef"}, good)
    raw = good.read_bytes()
    assert raw.count(b"abcdef") == 1
    bad = tmp_path / "bad.pt"
    bad.write_bytes(raw.replace(b"abcdef", b"\xff\xfe\xfdabc"))
    return bad


def test_import_of_a_damaged_torch_file_raises_corrupt_checkpoint(tmp_path: Path) -> None:
    """A torch.save file one of whose pickled strings no longer decodes as UTF-8 is
    `sp.CorruptCheckpoint` naming the file, as a truncated one is (a bare UnicodeDecodeError
    escaped from torch's unpickler)."""
    bad = _damaged_torch_file(tmp_path)
    with pytest.raises(sp.CorruptCheckpoint, match=r"bad\.pt"):
        sp.import_checkpoint(bad, str(tmp_path / "ckpt"))


def test_cli_import_of_a_damaged_torch_file_exits_1_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`safepoint import bad.pt CKPT` on a damaged torch file exits 1 with an error line (it
    printed a traceback)."""
    bad = _damaged_torch_file(tmp_path)
    assert safepoint.cli.main(["import", str(bad), str(tmp_path / "ckpt")]) == 1
    assert "safepoint: error:" in capsys.readouterr().err


def test_import_with_allow_pickle_of_a_class_that_is_gone_raises_safepoint_error(
    tmp_path: Path,
) -> None:
    """A user imports a legacy checkpoint that pickles an object of their own class. Without
    allow_pickle they get PickleNotAllowed, which tells them to pass allow_pickle=True; they
    do, but the class's module is not importable here (renamed, or another project's): a
    SafepointError names the file and the missing module (a bare ModuleNotFoundError
    escaped)."""
    module = types.ModuleType("legacy_cfg_mod")
    exec("class Cfg:\n    def __init__(self):\n        self.lr = 0.1\n", module.__dict__)
    module.Cfg.__module__ = "legacy_cfg_mod"
    sys.modules["legacy_cfg_mod"] = module
    try:
        torch.save({"w": torch.ones(2), "cfg": module.Cfg()}, tmp_path / "legacy.pt")
    finally:
        del sys.modules["legacy_cfg_mod"]
    with pytest.raises(sp.PickleNotAllowed):
        sp.import_checkpoint(tmp_path / "legacy.pt", str(tmp_path / "a"))
    with pytest.raises(sp.SafepointError, match=r"legacy\.pt.*legacy_cfg_mod.*install or import"):
        sp.import_checkpoint(tmp_path / "legacy.pt", str(tmp_path / "b"), allow_pickle=True)


def test_safetensors_round_trip_keeps_the_empty_key(tmp_path: Path) -> None:
    """README: a safetensors import keeps the paths unchanged, so `sp.load(url, into=state)`
    still matches them. A state with an empty-string key (path component `%`, per
    docs/format.md) is exported to .safetensors as `%/x` and imported as the same key (it
    came back as "%", path `%25/x`, and restoring into the original state was refused)."""
    state = {"": {"x": torch.arange(2.0)}, "n": 3}
    sp.save(str(tmp_path / "c"), state)
    sp.export_checkpoint(str(tmp_path / "c"), tmp_path / "c.safetensors")
    sp.import_checkpoint(tmp_path / "c.safetensors", str(tmp_path / "i"))
    assert [e.path for e in sp.info(str(tmp_path / "i")).entries] == ["%/x", "n"]
    target = {"": {"x": torch.zeros(2)}, "n": 0}
    sp.load(str(tmp_path / "i"), into=target)
    assert torch.equal(target[""]["x"], torch.arange(2.0))


def test_safetensors_export_of_an_unsupported_numpy_dtype_is_unsupported_leaf(
    tmp_path: Path,
) -> None:
    """A checkpoint holds a complex128 NumPy array; the user exports it to .safetensors.
    As for a complex128 tensor, the export raises UnsupportedLeaf naming the path (it was
    a StorageError blaming the path, permissions and free space)."""
    sp.save(str(tmp_path / "c"), {"z": np.zeros(3, np.complex128)})
    with pytest.raises(sp.UnsupportedLeaf) as raised:
        sp.export_checkpoint(str(tmp_path / "c"), tmp_path / "c.safetensors")
    assert raised.value.path == "z"


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".pt"])
def test_exporting_nothing_is_checkpoint_not_found(tmp_path: Path, suffix: str) -> None:
    """Exporting where nothing is committed is CheckpointNotFound for every format (to an
    archive it was a StorageError blaming the output file)."""
    with pytest.raises(sp.CheckpointNotFound):
        sp.export_checkpoint(str(tmp_path / "nothing"), str(tmp_path / f"out{suffix}"))
    assert list(tmp_path.iterdir()) == []


def test_importing_safetensors_without_torch_says_what_to_install(tmp_path: Path) -> None:
    """`safepoint import x.safetensors` where torch is not installed exits 1 saying to
    install torch, as for a .pt file (a ModuleNotFoundError traceback came out of
    safetensors)."""
    ckpt = str(tmp_path / "a")
    sp.save(ckpt, {"w": torch.ones(3)})
    out = str(tmp_path / "a.safetensors")
    sp.export_checkpoint(ckpt, out)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from safepoint.cli import main\n"
            f"sys.exit(main(['import', {out!r}, {str(tmp_path / 'b')!r}]))\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 1 and "Traceback" not in child.stderr, child.stderr[-2000:]
    assert "pip install torch" in child.stderr


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".tar"])
def test_export_to_a_long_valid_file_name(tmp_path, suffix):
    """A name of 250 characters is valid; the temporary name, the output's plus a suffix of
    37, went past NAME_MAX (255), and the export failed with "File name too long"."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"w": torch.arange(6.0)})
    out = tmp_path / ("x" * (250 - len(suffix)) + suffix)
    sp.export_checkpoint(url, out)
    assert [p.name for p in tmp_path.iterdir() if p.name != "ckpt"] == [out.name]
    assert sp.verify(url).ok and out.stat().st_size > 0


def test_export_and_import_take_a_home_directory_as_the_other_calls_do(
    tmp_path, monkeypatch
):
    """`~` is the home directory for sp.save and sp.load; export wrote under a directory
    named `~` in the working directory instead, and import read from there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    sp.save("~/ckpt", {"w": torch.arange(6.0)})
    sp.export_checkpoint("~/ckpt", "~/out.safetensors")
    assert (tmp_path / "home" / "out.safetensors").is_file()
    sp.import_checkpoint("~/out.safetensors", "~/back")
    assert torch.equal(sp.load(str(tmp_path / "home" / "back"))["w"], torch.arange(6.0))
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("out", ["sub/out.pt", "sub/out.safetensors", "sub/out.tar.gz"])
def test_export_under_a_link_to_nowhere_is_a_storage_error_naming_it(tmp_path, out):
    """The output's directory, under a link to a disk not mounted, cannot be made: a bare
    FileNotFoundError (a traceback from `safepoint export`)."""
    sp.save(str(tmp_path / "ckpt"), {"w": torch.ones(2)})
    (tmp_path / "dangling").symlink_to("/nonexistent-mount/x")
    with pytest.raises(sp.StorageError, match="not mounted"):
        sp.export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "dangling" / out))


def test_a_safetensors_export_without_torch_or_safetensors_names_both(tmp_path: Path) -> None:
    """Only torch was named: the missing safetensors came out once torch was installed."""
    ckpt = str(tmp_path / "a")
    sp.save(ckpt, {"w": np.ones(3)})
    code = ("import sys; sys.modules['torch'] = sys.modules['safetensors'] = None\n"
            "import safepoint as sp\n"
            f"sp.export_checkpoint({ckpt!r}, {str(tmp_path / 'a.safetensors')!r})\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 1
    assert "pip install torch safetensors" in child.stderr, child.stderr[-2000:]


@pytest.mark.parametrize("suffix", [".tar", ".safetensors", ".pt"])
def test_export_and_import_take_file_urls_and_refuse_remote_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """`export CKPT s3://bkt/a.tar` wrote ./s3:/bkt/a.tar on the local disk and said it had
    exported to s3 (one who then deleted the checkpoint lost it); `import s3://...` read that
    local file back; a file:// URL was a directory named `file:`."""
    monkeypatch.chdir(tmp_path)
    sp.save("c", {"w": np.arange(4.0)})
    for remote in (f"s3://bkt/a{suffix}", f"memory://x/a{suffix}"):
        with pytest.raises(sp.SafepointError, match=r"local file.*safepoint cp"):
            sp.export_checkpoint("c", remote)
        with pytest.raises(sp.SafepointError, match="local file"):
            sp.import_checkpoint(remote, "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    url = (tmp_path / f"a{suffix}").as_uri()
    sp.export_checkpoint("c", url)
    sp.import_checkpoint(url, "d")
    assert np.array_equal(sp.load("d")["w"], np.arange(4.0))


def test_pt_export_of_an_empty_bytes_leaf_reads_with_weights_only(tmp_path: Path) -> None:
    """torch.save pickles b"" as a call of the global `bytes`, which
    `torch.load(weights_only=True)` refuses: an export of a state with an empty blob was
    readable neither by torch.load(weights_only=True) nor by an import of that very file."""
    url = str(tmp_path / "c")
    sp.save(url, {"model": {"w": torch.ones(2)}, "extra_state": b"", "blobs": [b"", b"x"]})
    out = tmp_path / "c.pt"
    sp.export_checkpoint(url, out)
    loaded = torch.load(out, weights_only=True)
    assert loaded["extra_state"] == b"" and loaded["blobs"] == [b"", b"x"]
    sp.import_checkpoint(out, str(tmp_path / "back"))
    assert sp.diff(url, str(tmp_path / "back")).identical


def test_pt_import_of_torch_saves_own_empty_bytes(tmp_path: Path) -> None:
    """A file torch.save wrote with b"" in it (the global `bytes`, which runs no code) imports
    without allow_pickle."""
    torch.save({"extra_state": b"", "w": torch.ones(2)}, tmp_path / "m.pt")
    sp.import_checkpoint(tmp_path / "m.pt", str(tmp_path / "c"))
    assert sp.load(str(tmp_path / "c"))["extra_state"] == b""


def _strict_json(text: str) -> object:
    """`text` parsed as JSON, refusing the NaN and Infinity tokens Python accepts."""
    def refuse(token: str) -> object:
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_safetensors_values_are_strict_json_and_keep_a_nans_bits(tmp_path):
    """Non-finite floats were written as NaN and -Infinity tokens (not JSON: strict readers
    of the header refuse them), and a NaN of another sign came back as float("nan"): they
    are spelled as the manifest spells them, and come back bit for bit."""
    neg_nan = struct.unpack("<d", bytes.fromhex("000000000000f8ff"))[0]
    ckpt = str(tmp_path / "ck")
    sp.save(ckpt, {"w": torch.ones(2), "loss": float("nan"), "lo": float("-inf"),
                   "neg": neg_nan, "hi": float("inf")})
    out = tmp_path / "o.safetensors"
    sp.export_checkpoint(ckpt, out)
    with safetensors_torch.safe_open(str(out), framework="pt") as f:
        values = _strict_json(f.metadata()["safepoint.values"])
    assert values == {"loss": {"float": "nan"}, "lo": {"float": "-inf"}, "hi": {"float": "inf"},
                      "neg": {"float": "nan", "bits": "fff8000000000000"}}
    sp.import_checkpoint(out, str(tmp_path / "imp"))
    back = sp.load(str(tmp_path / "imp"))
    assert struct.pack("<d", back["neg"]) == struct.pack("<d", neg_nan)
    assert sp.diff(ckpt, str(tmp_path / "imp")).identical


def test_safetensors_values_written_with_bare_nan_tokens_still_import(tmp_path):
    """Files exported before spelled non-finite floats as NaN and Infinity tokens, which an
    import still reads, beside the manifest's spelling."""
    src = tmp_path / "old.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, src, metadata={
        "safepoint.values": '{"loss": NaN, "lo": -Infinity, "new": {"float": "nan"}}'})
    sp.import_checkpoint(src, str(tmp_path / "imp"))
    back = sp.load(str(tmp_path / "imp"))
    assert back["loss"] != back["loss"] and back["new"] != back["new"]
    assert back["lo"] == float("-inf")


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_an_rng_state_restores_after_export_and_import(tmp_path, suffix):
    """An export makes tensors of sp.RNGState's NumPy arrays, and the import keeps them
    tensors: a restore into a fresh sp.RNGState() failed "checkpoint has a tensor, target a
    ndarray" though path, dtype and shape agree. It fills the arrays, and the streams go on
    as saved."""
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ckpt = str(tmp_path / "ck")
    sp.save(ckpt, {"rng": sp.RNGState(), "w": torch.ones(2)})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    out = tmp_path / f"o{suffix}"
    sp.export_checkpoint(ckpt, out)
    sp.import_checkpoint(out, str(tmp_path / "imp"))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    sp.load(str(tmp_path / "imp"), into={"rng": sp.RNGState(), "w": torch.zeros(2)})
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])


def test_import_pt_with_class_from_blocked_module_is_pickle_not_allowed(tmp_path: Path) -> None:
    """torch words a global of a module it blocks outright (os, posix, sys, nt: an
    `os.stat_result`, or `os.system` in a hostile file) as "unsupported GLOBAL
    os.stat_result whose module os is blocked", without the "Unsupported global" other
    globals get: the import called the file damaged (CorruptCheckpoint) and did not name
    the class. It is PickleNotAllowed naming it, as for any other class."""
    src = tmp_path / "stats.pt"
    torch.save({"w": torch.ones(2), "stat": os.stat(tmp_path)}, src)
    with pytest.raises(sp.PickleNotAllowed, match=r"stats\.pt.*stat_result.*--allow-pickle"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def _big_endian_state() -> dict[str, np.ndarray]:
    return {"emb": np.arange(6, dtype=">f4").reshape(2, 3),
            "ids": np.array([1, -2, 2**40], dtype=">i8"), "one": np.array(7, dtype=">i2")}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_of_big_endian_array_round_trips(tmp_path: Path, suffix: str) -> None:
    """`sp.load` gives a big-endian array back big-endian, and torch.from_numpy refuses one:
    an export to .pt or .safetensors crashed with torch's bare ValueError ("given numpy
    array has byte order different from the native byte order"). The tensors hold the
    same values in native byte order."""
    state = _big_endian_state()
    sp.save(str(tmp_path / "ckpt"), state)
    out = tmp_path / f"out{suffix}"
    sp.export_checkpoint(str(tmp_path / "ckpt"), out)
    loaded = (torch.load(out, weights_only=True) if suffix == ".pt"
              else safetensors_torch.load_file(out))
    for key, array in state.items():
        assert loaded[key].shape == array.shape
        assert np.array_equal(loaded[key].numpy(), array)


def test_import_pt_holding_torch_size(tmp_path: Path) -> None:
    """A torch.Size (`{"w": w, "shape": w.shape}`) reads with torch.load(weights_only=True),
    and sp.save stores it as the tuple it is; the import refused it ("holds values safepoint
    stores only with pickle") and, with allow_pickle=True, stored a pickled entry. Tuple
    subclasses (torch.Size, namedtuples) are tuples there, as sp.save takes them, and list
    subclasses lists."""
    w = torch.arange(6.0).reshape(2, 3)
    src = tmp_path / "with_shape.pt"
    torch.save({"w": w, "shape": w.shape}, src)
    sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    loaded = sp.load(str(tmp_path / "ckpt"))
    assert loaded["shape"] == (2, 3) and torch.equal(loaded["w"], w)

    torch.save({"p": _Pair(1, 2), "l": _Items([3])}, tmp_path / "subclasses.pt")
    sp.import_checkpoint(tmp_path / "subclasses.pt", str(tmp_path / "sub"), allow_pickle=True)
    assert {e.kind for e in sp.info(str(tmp_path / "sub")).entries} == {"value"}
    assert sp.load(str(tmp_path / "sub")) == {"p": (1, 2), "l": [3]}


_Pair = collections.namedtuple("_Pair", "a b")


class _Items(list):  # type: ignore[type-arg]
    """A list subclass, as a torch.save file may hold."""


class _OfSize:
    """Pickles as a call of the global `kind` (bytes, bytearray) with a size: what a hostile
    file can hold."""

    def __init__(self, kind: type[bytes | bytearray], size: int) -> None:
        self.kind, self.size = kind, size

    def __reduce__(self) -> tuple[type[bytes | bytearray], tuple[int]]:
        return self.kind, (self.size,)


def test_import_pt_does_not_run_bytes_with_a_size(tmp_path: Path) -> None:
    """The global `bytes` was allowed for torch.save's b"" (a call with no argument), which
    let a file call it with any argument: a file of a few KB calling bytes(100 GiB) made the
    import allocate and zero-fill 100 GiB (torch.load(weights_only=True) alone refuses it).
    Only bytes() is run; anything else is refused, naming the file, before it runs."""
    src = tmp_path / "blob.pt"
    torch.save({"w": torch.ones(1), "blob": _OfSize(bytes, 64 << 10)}, src)
    with pytest.raises(sp.PickleNotAllowed, match=r"blob\.pt.*bytes"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_import_refuses_bytearray_allocating_any_amount(tmp_path: Path, zipped: bool) -> None:
    """After bytes, the next builtin torch's weights_only reader allows: a file of a few KB
    calling bytearray(64 GiB) made the import allocate and zero-fill 64 GiB. torch.save
    writes a bytearray as bytearray() or bytearray of bytes (`_codecs.encode`), never of a
    size: any other call is refused, naming the file and bytearray, before it runs (in
    either of torch.save's formats, the global called again through the pickle's memo)."""
    src = tmp_path / "blob.pt"
    blobs = [bytearray(b"ok"), _OfSize(bytearray, 64 << 10)]  # the second reuses the global
    torch.save({"w": torch.ones(1), "blob": blobs}, src, _use_new_zipfile_serialization=zipped)
    with pytest.raises(sp.PickleNotAllowed, match=r"blob\.pt calls bytearray"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


_MARK = "MARKERMARKER"
_MARK_PICKLED = b"X\x0c\x00\x00\x00" + _MARK.encode()  # BINUNICODE, as torch.save writes it


def _with_pickle_replaced(src: Path, new: bytes, zipped: bool) -> None:
    """Replace the pickled str `_MARK` in the torch.save file `src` by the opcodes `new`."""
    if not zipped:
        raw = src.read_bytes()
        assert raw.count(_MARK_PICKLED) == 1
        src.write_bytes(raw.replace(_MARK_PICKLED, new))
        return
    with zipfile.ZipFile(src) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(src, "w") as archive:
        for name, data in members:
            if name.endswith("data.pkl"):
                assert data.count(_MARK_PICKLED) == 1
                data = data.replace(_MARK_PICKLED, new)
            archive.writestr(name, data)


_BYTES_GLOBAL = b"cbuiltins\nbytes\n"  # GLOBAL builtins.bytes
_SIZE = b"J" + struct.pack("<i", 64 << 10)  # BININT 64 KiB
#: Pickle opcodes that make bytes of 64 KiB other than by a REDUCE of GLOBAL builtins.bytes.
_BYTES_OF_A_SIZE = {
    "newobj": _BYTES_GLOBAL + _SIZE + b"\x85\x81",  # TUPLE1, NEWOBJ
    "newobj-long1": _BYTES_GLOBAL + b"\x8a\x03\x00\x00\x01\x85\x81",  # LONG1 64 KiB
    "newobj-ex": _BYTES_GLOBAL + _SIZE + b"\x85}\x92",  # TUPLE1, EMPTY_DICT, NEWOBJ_EX
    # SHORT_BINUNICODE "builtins", "bytes", STACK_GLOBAL, then a call (REDUCE)
    "stack-global": b"\x8c\x08builtins\x8c\x05bytes\x93" + _SIZE + b"\x85R",
}


class _Encoded:
    """Pickles as `_codecs.encode(data, codec)`: with "hex", nested, each level doubles the
    bytes (40 levels ask for 2 TiB in a few hundred bytes of pickle)."""

    def __init__(self, data: object, codec: str) -> None:
        self.data, self.codec = data, codec

    def __reduce__(self) -> tuple[Any, tuple[object, str]]:
        return codecs.encode, (self.data, self.codec)


@pytest.mark.parametrize("in_bytearray", [False, True], ids=["alone", "in-bytearray"])
def test_import_refuses_codecs_encode_other_than_torch_saves(
    tmp_path: Path, in_bytearray: bool
) -> None:
    """torch's weights_only reader allows `_codecs.encode`, which torch.save calls only on a
    str literal with "latin1"; a1497a0 let any call of it through (bare, or inside the
    bytearray(_codecs.encode(...)) it allows), so nested "hex" encodings could allocate any
    amount from a few hundred bytes. Refused before anything runs."""
    bomb: object = b"ab"
    for _ in range(4):
        bomb = _Encoded(bomb, "hex")
    if in_bytearray:
        bomb = _Reduced(bytearray, (bomb,))
    src = tmp_path / "bomb.pt"
    torch.save({"w": torch.ones(1), "x": bomb}, src)
    with pytest.raises(sp.PickleNotAllowed, match=r"bomb\.pt calls _codecs\.encode"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


class _Reduced:
    """Pickles as `function(*args)`."""

    def __init__(self, function: Any, args: tuple[object, ...]) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:
        return self.function, self.args


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pt_import_of_torch_saves_own_bytearrays(tmp_path: Path, zipped: bool) -> None:
    """The bytearrays torch.save writes (bytearray() and bytearray of bytes) still import
    without allow_pickle, as the format's bytes."""
    torch.save({"blob": bytearray(b"ab\xff"), "empty": bytearray(), "w": torch.ones(2)},
               tmp_path / "m.pt", _use_new_zipfile_serialization=zipped)
    sp.import_checkpoint(tmp_path / "m.pt", str(tmp_path / "c"))
    loaded = sp.load(str(tmp_path / "c"))
    assert (loaded["blob"], loaded["empty"]) == (b"ab\xff", b"")


@pytest.mark.parametrize(
    "array", [np.array(["a", "bc"]), np.array(["2024-01-02"], dtype="datetime64[D]")],
    ids=["str", "datetime64"])
def test_pt_export_of_a_pickled_array_torch_has_no_dtype_for(
    tmp_path: Path, array: np.ndarray[Any, Any]
) -> None:
    """A checkpoint with an `sp.Pickled` NumPy array of a dtype torch lacks (an array of str,
    which the Lightning plugin's pickle_policy="allow" stores so, or datetime64) exported to
    .pt with allow_pickle=True failed with a bare TypeError from torch.from_numpy: every
    loaded array was turned into a tensor, the unpickled ones too. Such an array is kept as
    it is, pickled by torch.save."""
    url = str(tmp_path / "ckpt")
    sp.save(url, {"w": torch.ones(2), "names": sp.Pickled(array)})
    out = tmp_path / "all.pt"
    sp.export_checkpoint(url, out, allow_pickle=True)
    loaded = torch.load(out, weights_only=False)
    assert loaded["names"].dtype == array.dtype and (loaded["names"] == array).all()
    assert torch.equal(loaded["w"], torch.ones(2))


def test_export_of_lightning_checkpoint_keeps_state_dict_metadata(tmp_path: Path) -> None:
    """README offers `safepoint export ckpts/last.ckpt model.ckpt`, then
    `Model.load_from_checkpoint("model.ckpt")`; the plugin records each state dict's module
    versions (lightning/state_dict_metadata) but the export wrote plain dicts without
    `_metadata`, which modules load as the oldest format. The export's state dicts are
    OrderedDicts with their `_metadata`, named relative to strip_prefix too."""
    from safepoint.integrations.lightning import SafepointCheckpointIO

    state_dict = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict()
    expected = dict(state_dict._metadata)  # type: ignore[attr-defined]
    url = str(tmp_path / "epoch=0.ckpt")
    SafepointCheckpointIO().save_checkpoint(
        {"state_dict": state_dict, "epoch": 0, "global_step": 1}, url)
    sp.export_checkpoint(url, tmp_path / "model.ckpt")
    exported = torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"]
    assert dict(exported._metadata) == expected
    sp.export_checkpoint(url, tmp_path / "weights.pt", strip_prefix="state_dict/")
    assert dict(torch.load(tmp_path / "weights.pt", weights_only=True)._metadata) == expected


def test_pt_import_keeps_state_dict_metadata(tmp_path: Path) -> None:
    """A Lightning checkpoint written by torch.save (Lightning's own IO; README: import it
    with sp.import_checkpoint) holds `state_dict` as an OrderedDict with `_metadata` (the
    module versions). The import kept no trace of it, so neither a `.ckpt` export of the
    imported checkpoint nor `SafepointCheckpointIO().load_checkpoint` gave it back, and
    modules loaded the state as the oldest version. The import records it where the plugin
    does, so both give back torch.load's `_metadata`."""
    from safepoint.integrations.lightning import SafepointCheckpointIO

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state_dict = model.state_dict()
    expected = dict(state_dict._metadata)  # type: ignore[attr-defined]
    torch.save({"state_dict": state_dict, "epoch": 1, "global_step": 5}, tmp_path / "in.ckpt")
    url = str(tmp_path / "ckpt")
    sp.import_checkpoint(tmp_path / "in.ckpt", url, metadata={"run": "a"})
    assert sp.info(url).metadata["run"] == "a"
    sp.export_checkpoint(url, tmp_path / "out.ckpt")
    exported = torch.load(tmp_path / "out.ckpt", weights_only=True)["state_dict"]
    assert dict(getattr(exported, "_metadata", {})) == expected
    loaded = SafepointCheckpointIO().load_checkpoint(url)["state_dict"]
    assert dict(getattr(loaded, "_metadata", {})) == expected
    model.load_state_dict(loaded)

    # A state dict saved alone (the root) and one inside a list keep theirs too.
    torch.save(state_dict, tmp_path / "root.pt")
    sp.import_checkpoint(tmp_path / "root.pt", str(tmp_path / "root"))
    sp.export_checkpoint(str(tmp_path / "root"), tmp_path / "root-out.pt")
    assert dict(torch.load(tmp_path / "root-out.pt", weights_only=True)._metadata) == expected
    torch.save({"models": [state_dict]}, tmp_path / "list.pt")
    sp.import_checkpoint(tmp_path / "list.pt", str(tmp_path / "list"))
    sp.export_checkpoint(str(tmp_path / "list"), tmp_path / "list-out.pt")
    models = torch.load(tmp_path / "list-out.pt", weights_only=True)["models"]
    assert dict(models[0]._metadata) == expected


def test_pt_import_of_state_dict_metadata_json_cannot_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A `_metadata` that the checkpoint's JSON metadata cannot hold is left out with a
    warning naming the state dict; the import itself goes on."""
    state_dict = torch.nn.Linear(2, 2).state_dict()
    state_dict._metadata = {"": {"version": {1, 2}}}  # type: ignore[attr-defined]
    torch.save({"state_dict": state_dict}, tmp_path / "odd.pt")
    with caplog.at_level("WARNING", logger="safepoint"):
        info = sp.import_checkpoint(tmp_path / "odd.pt", str(tmp_path / "ckpt"))
    assert info.metadata == {"imported_from": "odd.pt"}
    assert "state dict at state_dict has a _metadata that JSON cannot hold" in caplog.text


def _zip_members(src: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(src) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


_BYTEARRAY_OF_A_SIZE = b"cbuiltins\nbytearray\n" + _SIZE + b"\x85R"  # bytearray(64 KiB)


def test_import_refuses_a_torch_zip_with_a_member_twice(tmp_path: Path) -> None:
    """The scan opened each .pkl member by name, which zipfile resolves to the name's last
    entry, while torch's reader (miniz's binary search) read another: of four data.pkl
    members, the third, calling bytearray(n), was never scanned and ran. torch.save never
    writes a name twice: such a zip is refused as damaged, naming the file, before anything
    runs."""
    src = tmp_path / "dup.pt"
    torch.save({"x": _MARK}, src)
    members = _zip_members(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        with zipfile.ZipFile(src, "w") as archive:
            for name, data in members:
                for copy in range(4 if name.endswith("data.pkl") else 1):
                    hostile = copy == 2 and name.endswith("data.pkl")
                    archive.writestr(name, data.replace(_MARK_PICKLED, _BYTEARRAY_OF_A_SIZE)
                                     if hostile else data)
    with pytest.raises(sp.CorruptCheckpoint, match=r"dup\.pt.*data\.pkl.*more than once"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_import_of_a_torchscript_archive_says_what_it_is(tmp_path: Path) -> None:
    """A torch.jit.save file (its code members compressed) was refused as a zip with a
    compressed member, telling to torch.load and torch.save it (found by a review)."""
    path = tmp_path / "scripted.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit, on its way out
        torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), str(path))
    with pytest.raises(sp.CorruptCheckpoint, match=r"TorchScript archive.*torch\.jit\.load"):
        sp.import_checkpoint(path, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("member", ["data.pkl", "data/0"])
def test_import_refuses_a_torch_zip_with_a_compressed_member(tmp_path: Path, member: str) -> None:
    """torch.save stores every zip member as it is, but the scan and torch's reader (miniz)
    inflate a deflated one: a .pt of 0.5 MiB whose data/0 declared a 512 MiB tensor took
    513 MiB of memory before a refusal for another reason, and one whose data.pkl held
    bytes(512 MiB) was imported (found by a review). Such a member is refused, naming the
    file and the member, before anything is read."""
    src = tmp_path / "deflated.pt"
    torch.save({"w": torch.zeros(1 << 20)}, src)
    members = _zip_members(src)
    with zipfile.ZipFile(src, "w") as archive:
        for name, data in members:
            archive.writestr(name, data, zipfile.ZIP_DEFLATED
                             if name.endswith(f"/{member}") else zipfile.ZIP_STORED)
    with pytest.raises(sp.CorruptCheckpoint, match=rf"deflated\.pt .*'deflated/{member}' "
                       r"is not stored uncompressed.*torch\.save it again"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_import_scans_a_pickle_member_named_in_another_case(tmp_path: Path) -> None:
    """torch's reader finds archive/data.pkl ignoring case, and the scan only read members
    ending in ".pkl": a DATA.PKL calling bytearray(n) ran unscanned. Scanned whatever its
    case, and refused before anything runs."""
    src = tmp_path / "upper.pt"
    torch.save({"x": _MARK}, src)
    members = _zip_members(src)
    with zipfile.ZipFile(src, "w") as archive:
        for name, data in members:
            if name.endswith("data.pkl"):
                name = name.replace("data.pkl", "DATA.PKL")
                data = data.replace(_MARK_PICKLED, _BYTEARRAY_OF_A_SIZE)
            archive.writestr(name, data)
    with pytest.raises(sp.PickleNotAllowed, match=r"upper\.pt calls bytearray"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("func", [bytearray, bytes], ids=["bytearray", "bytes"])
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_import_refuses_rebuild_from_type_v2_of_another_function(
    tmp_path: Path, zipped: bool, func: type[bytes | bytearray]
) -> None:
    """torch's reader allows `torch._tensor._rebuild_from_type_v2(func, new_type, args,
    state)`, which runs `func(*args)`, and the scan only looked at direct calls: with
    func=bytearray and args=(n,) a few bytes of pickle allocated n bytes. torch.save writes
    only one of torch's `_rebuild_` functions there; anything else is refused, naming the
    file, before it runs."""
    src = tmp_path / "blob.pt"
    hostile = _Reduced(torch._tensor._rebuild_from_type_v2, (func, func, (64 << 10,), {}))
    torch.save({"w": torch.ones(1), "blob": hostile}, src, _use_new_zipfile_serialization=zipped)
    with pytest.raises(sp.PickleNotAllowed, match=r"blob\.pt calls .*_rebuild_from_type_v2"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pt_import_of_a_tensor_with_attributes(tmp_path: Path, zipped: bool) -> None:
    """What torch.save writes through `_rebuild_from_type_v2` (a tensor with Python
    attributes) still imports without allow_pickle."""
    w = torch.arange(3.0)
    w.note = "kept by torch.save"  # type: ignore[attr-defined]
    torch.save({"w": w}, tmp_path / "m.pt", _use_new_zipfile_serialization=zipped)
    assert b"_rebuild_from_type_v2" in (tmp_path / "m.pt").read_bytes()
    sp.import_checkpoint(tmp_path / "m.pt", str(tmp_path / "c"))
    assert torch.equal(sp.load(str(tmp_path / "c"))["w"], w)


def test_import_refuses_rebuild_from_type_v2_named_in_two_parts(tmp_path: Path) -> None:
    """torch's reader looks a global up by "module.name", so GLOBAL "torch"
    "_tensor._rebuild_from_type_v2" is the same function: refused the same way."""
    src = tmp_path / "blob.pt"
    torch.save({"w": torch.ones(1), "blob": _MARK}, src)
    call = (b"ctorch\n_tensor._rebuild_from_type_v2\n(cbuiltins\nbytearray\n"
            b"cbuiltins\nbytearray\n" + _SIZE + b"\x85}tR")  # MARK, ..., EMPTY_DICT, TUPLE
    _with_pickle_replaced(src, call, zipped=True)
    with pytest.raises(sp.PickleNotAllowed, match=r"blob\.pt calls .*_rebuild_from_type_v2"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


_CLASS_CALLS = {
    "tensor-reduce": b"ctorch\nTensor\n" + _SIZE + b"\x85R",
    "tensor-newobj": b"ctorch\nTensor\n" + _SIZE + b"\x85\x81",
    "float-tensor": b"ctorch\nFloatTensor\n" + _SIZE + b"\x85R",
    "untyped-storage": b"ctorch.storage\nUntypedStorage\n" + _SIZE + b"\x85R",
    "typed-storage-newobj": b"ctorch.storage\nTypedStorage\n" + _SIZE + b"\x85\x81",
    # _rebuild_from_type_v2 calling torch.Tensor(n)
    "rebuild-from-type": (b"ctorch._tensor\n_rebuild_from_type_v2\n(ctorch\nTensor\n"
                          b"ctorch\nTensor\n" + _SIZE + b"\x85}tR"),
}


_ALLOCATING_CALLS = {**{f"bytes-{name}": (opcodes, "bytes")
                        for name, opcodes in _BYTES_OF_A_SIZE.items()},
                     **{f"class-{name}": (opcodes, "torch.")
                        for name, opcodes in _CLASS_CALLS.items()}}


@pytest.mark.parametrize("call", list(_ALLOCATING_CALLS))
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_import_refuses_allocating_calls_torch_save_never_writes(
    tmp_path: Path, zipped: bool, call: str
) -> None:
    """Refused, naming the file, before anything runs:
    - `bytes(n)` built through NEWOBJ (`bytes.__new__(bytes, n)`, which torch's weights-only
      reader runs for any allowed class, and `bytes` is allowed for b"") rather than called
      (REDUCE was refused): a few bytes of pickle allocated any amount (2**31 - 1 with
      BININT, more with LONG1); NEWOBJ_EX and a global named by STACK_GLOBAL alike;
    - `torch.Tensor`, its typed classes (`torch.FloatTensor`, ...) and the storage classes,
      allowed globals of the reader: `torch.Tensor(n)` (REDUCE, or NEWOBJ) allocates n
      uninitialized floats, a file of a few hundred bytes imported as a checkpoint of any
      size holding whatever the allocator gave back. torch.save never calls or builds them."""
    opcodes, callee = _ALLOCATING_CALLS[call]
    src = tmp_path / "blob.pt"
    torch.save({"w": torch.ones(1), "x": _MARK}, src, _use_new_zipfile_serialization=zipped)
    _with_pickle_replaced(src, opcodes, zipped)
    with pytest.raises(sp.PickleNotAllowed,
                       match=rf"blob\.pt (builds|calls) {re.escape(callee)}"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


# --- a small protocol 2 pickle assembler for the crafted files below --------------------------
def _op_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _op_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    return b"J" + struct.pack("<i", n)


def _op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _op_tuple(*parts: bytes) -> bytes:
    return b"(" + b"".join(parts) + b"t"


def _op_storage(cls: str, key: str, numel: int, legacy: bool) -> bytes:
    parts = [_op_str("storage"), _op_global("torch", cls), _op_str(key), _op_str("cpu"),
             _op_int(numel)]
    if legacy:
        parts.append(b"N")  # view_metadata
    return _op_tuple(*parts) + b"Q"  # BINPERSID


def _op_tensor(storage: bytes, size: tuple[int, ...], stride: tuple[int, ...],
               offset: int = 0) -> bytes:
    hooks = _op_global("collections", "OrderedDict") + b")R"
    return _op_global("torch._utils", "_rebuild_tensor_v2") + _op_tuple(
        storage, _op_int(offset), _op_tuple(*map(_op_int, size)),
        _op_tuple(*map(_op_int, stride)), b"\x89", hooks) + b"R"


def _op_root(key: str, value: bytes) -> bytes:
    return b"\x80\x02}" + _op_str(key) + value + b"s."


def _crafted_zip(pickled: bytes, data: bytes) -> bytes:
    """A torch.save zip whose data.pkl is `pickled` and whose one storage (key "0") `data`."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for entry in src.infolist():
            if entry.filename.endswith("/data.pkl"):
                archive.writestr(entry.filename, pickled)
            elif entry.filename.endswith("/data/0"):
                archive.writestr(entry.filename, data)
            else:
                archive.writestr(entry.filename, src.read(entry.filename))
    return out.getvalue()


_ITERATED = 1 << 12  # torch makes ~640 bytes a element: 1 << 24 elements is ~10 GiB


def _expanded_long(size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    return _op_tensor(_op_storage("LongStorage", "0", 1, legacy=False), size, stride)


_ITERATING_CALLS = {
    "Size": _op_global("torch", "Size") + _op_tuple(_expanded_long((_ITERATED,), (0,))) + b"R",
    "Size-newobj": (_op_global("torch", "Size") + _op_tuple(_expanded_long((_ITERATED,), (0,)))
                    + b"\x81"),
    "set": _op_global("builtins", "set") + _op_tuple(_expanded_long((_ITERATED,), (0,))) + b"R",
    "Counter": (_op_global("collections", "Counter")
                + _op_tuple(_expanded_long((_ITERATED,), (0,))) + b"R"),
    "OrderedDict": (_op_global("collections", "OrderedDict")
                    + _op_tuple(_expanded_long((_ITERATED, 2), (0, 0))) + b"R"),
}


@pytest.mark.parametrize("call", list(_ITERATING_CALLS))
def test_import_refuses_a_container_built_from_a_tensor(tmp_path: Path, call: str) -> None:
    """`torch.Size`, `set`, `collections.Counter` and `collections.OrderedDict`, allowed
    globals of torch's reader, called (or built with NEWOBJ) on a stride-0 view of a storage of
    one element make one Python object per element: GiBs from a file of 1 KiB. torch.save
    calls them with nothing or one list, tuple or dict written in the pickle: anything else is
    refused, naming the file, before anything runs."""
    src = tmp_path / "iterate.pt"
    src.write_bytes(_crafted_zip(_op_root("w", _ITERATING_CALLS[call]), b"\0" * 8))
    assert src.stat().st_size < 2000
    assert len(torch.load(src, weights_only=True)["w"]) == _ITERATED  # torch runs it
    with pytest.raises(sp.PickleNotAllowed, match=r"iterate\.pt (calls|builds) "):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pt_import_of_containers_torch_save_writes(tmp_path: Path, zipped: bool) -> None:
    """torch.save's own Size, OrderedDict, Counter and set values pass the scan: a set needs
    pickle (not refused as a call), the others import."""
    src = tmp_path / "plain.pt"
    linear = torch.nn.Linear(2, 3)
    torch.save({"size": torch.Size([2, 3]), "empty": torch.Size([]),
                "model": linear.state_dict(), "od": collections.OrderedDict(),
                "counter": collections.Counter("abca")},
               src, _use_new_zipfile_serialization=zipped)
    sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    loaded = sp.load(str(tmp_path / "ckpt"))
    assert loaded["size"] == (2, 3) and loaded["empty"] == ()
    assert loaded["counter"] == {"a": 2, "b": 1, "c": 1}
    assert torch.equal(loaded["model"]["weight"], linear.weight.detach())
    other = tmp_path / "set.pt"
    torch.save({"set": {1, 2}}, other, _use_new_zipfile_serialization=zipped)
    with pytest.raises(sp.UnsupportedLeaf, match="only with pickle"):
        sp.import_checkpoint(other, str(tmp_path / "set"))


_CONVERT_ARGS = _op_tuple(
    _op_tensor(_op_storage("FloatStorage", "0", 1, legacy=False), (1 << 20,), (0,)),
    _op_global("torch", "float64"), _op_str("cpu"), b"\x89")
_DEVICE_REBUILDS = {
    "from-cpu-tensor": (_op_global("torch._utils", "_rebuild_device_tensor_from_cpu_tensor")
                        + _CONVERT_ARGS + b"R"),
    "from-numpy": (_op_global("torch._utils", "_rebuild_device_tensor_from_numpy")
                   + _op_tuple(b"N", _op_global("torch", "float64"), _op_str("cpu"), b"\x89")
                   + b"R"),
    # _rebuild_from_type_v2 running _rebuild_device_tensor_from_cpu_tensor
    "from-type": (_op_global("torch._tensor", "_rebuild_from_type_v2") + _op_tuple(
        _op_global("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"),
        _op_global("torch", "Tensor"), _CONVERT_ARGS, b"}") + b"R"),
}


@pytest.mark.parametrize("call", list(_DEVICE_REBUILDS))
def test_import_refuses_a_device_tensor_rebuild(tmp_path: Path, call: str) -> None:
    """`_rebuild_device_tensor_from_cpu_tensor(data, dtype, device, requires_grad)` runs
    `data.to(dtype)`: of an expanded view of a one-element storage it makes every element (8
    MiB here from a file of 1 KiB; any amount). torch.save writes it (and `_from_numpy`) only
    for xla, mtia, maia and privateuse1 tensors: refused, naming the file, before it runs."""
    src = tmp_path / "convert.pt"
    src.write_bytes(_crafted_zip(_op_root("w", _DEVICE_REBUILDS[call]), b"\0" * 4))
    assert src.stat().st_size < 2000
    if call == "from-cpu-tensor":  # torch runs it
        assert torch.load(src, weights_only=True)["w"].dtype == torch.float64
    with pytest.raises(sp.PickleNotAllowed, match=r"convert\.pt calls .*_rebuild_"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_import_refuses_ordereddict_build_from_an_expanded_tensor(tmp_path: Path) -> None:
    """BUILD on an OrderedDict runs `inst.__dict__.update(state)`: with state a stride-0
    (n, 2) view of one stored element, dict.update iterates it, one entry (3 tensor objects)
    per row. torch.save BUILDs an OrderedDict only with a dict written in the pickle (a state
    dict's `_metadata`): anything else is refused, naming the file, before anything runs."""
    pickled = _op_root("w", _op_global("collections", "OrderedDict") + b")R"
                       + _expanded_long((_ITERATED, 2), (0, 0)) + b"b")
    src = tmp_path / "build.pt"
    src.write_bytes(_crafted_zip(pickled, b"\0" * 8))
    assert src.stat().st_size < 2000
    loaded = torch.load(src, weights_only=True)["w"]
    assert len(loaded.__dict__) == _ITERATED  # torch runs it: n entries from one element
    with pytest.raises(sp.PickleNotAllowed, match=r"build\.pt"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


_SPLATS = {
    # BUILD on a torch.Tensor: inst.set_(*state)
    "tensor-build": (_expanded_long((1,), (1,)) + _expanded_long((_ITERATED,), (0,)) + b"b"),
    # REDUCE whose args are no tuple: func(*args), any allowed global
    "reduce-device": _op_global("torch", "device") + _expanded_long((_ITERATED,), (0,)) + b"R",
    # _rebuild_from_type_v2(func, type, args, state) runs func(*args)
    "from-type-args": _op_global("torch._tensor", "_rebuild_from_type_v2") + _op_tuple(
        _op_global("torch._utils", "_rebuild_tensor_v2"), _op_global("torch", "Tensor"),
        _expanded_long((_ITERATED,), (0,)),
        _op_global("collections", "OrderedDict") + b")R") + b"R",
    # NEWOBJ whose args are no tuple: cls.__new__(cls, *args)
    "newobj-device": (_op_global("torch", "device") + _expanded_long((_ITERATED,), (0,))
                      + b"\x81"),
}


@pytest.mark.parametrize("splat", list(_SPLATS))
def test_import_refuses_splatting_an_expanded_tensor(tmp_path: Path, splat: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's reader splats what the pickle gives as arguments (`set_(*state)` for BUILD on
    a Tensor, `func(*args)` for REDUCE and in _rebuild_from_type_v2, `cls.__new__(cls,
    *args)` for NEWOBJ): a stride-0 view of n elements on one stored element makes n tensor
    objects (GiBs from ~600 bytes) before the call fails. torch.save always writes a tuple
    there: anything else is refused, naming the file, before torch.load runs."""
    src = tmp_path / "splat.pt"
    src.write_bytes(_crafted_zip(_op_root("w", _SPLATS[splat]), b"\0" * 8))
    assert src.stat().st_size < 2000
    with pytest.raises(Exception, match=rf"Tensor, Tensor, Tensor|{_ITERATED} were given"):
        torch.load(src, weights_only=True)  # torch splatted n tensors
    ran: list[int] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: ran.append(1) or real_load(*a, **k))
    with pytest.raises(sp.PickleNotAllowed, match=r"splat\.pt"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not ran, "torch.load ran the splat before the refusal"
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pt_import_of_states_torch_save_writes(tmp_path: Path, zipped: bool,
                                               protocol: int) -> None:
    """What torch.save writes for a state dict's `_metadata` (BUILD of its OrderedDict with a
    dict), a Parameter and a tensor with an attribute (`_rebuild_from_type_v2` with a tuple
    of arguments) passes the scan, in the zip and legacy formats and pickle protocols 2 and 3;
    a literal-tuple state on a rebuilt tensor (old torch's BUILD) does too."""
    src = tmp_path / "states.pt"
    linear = torch.nn.Linear(2, 3)
    tagged = torch.ones(2)
    tagged.tag = 1  # type: ignore[attr-defined]
    torch.save({"model": linear.state_dict(), "p": torch.nn.Parameter(torch.ones(2)),
                "tagged": tagged}, src, pickle_protocol=protocol,
               _use_new_zipfile_serialization=zipped)
    sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    loaded = sp.load(str(tmp_path / "ckpt"))
    assert torch.equal(loaded["model"]["weight"], linear.weight.detach())
    assert torch.equal(loaded["p"], torch.ones(2))
    stored = _op_storage("LongStorage", "0", 1, legacy=False)
    old_build = _expanded_long((1,), (1,)) + _op_tuple(stored, b"K\x00", _op_tuple(b"K\x01"),
                                                      _op_tuple(b"K\x01")) + b"b"
    crafted = tmp_path / "old.pt"
    crafted.write_bytes(_crafted_zip(_op_root("w", old_build), b"\0" * 8))
    sp._interchange._check_blob_calls(str(crafted))  # no refusal


def _crafted_legacy(pickled: bytes, keys: tuple[str, ...] = (), data: bytes = b"") -> bytes:
    """A legacy (not zip) torch.save file: magic, protocol, system info, `pickled`, the storage
    keys, `data`."""
    out = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
    out += pickle.dumps({"protocol_version": 1001, "little_endian": True,
                         "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2)
    return out + pickled + pickle.dumps(list(keys), protocol=2) + data


def _legacy_data(count: int, nbytes: int) -> bytes:
    return struct.pack("<q", count) + b"\1" * nbytes


_FLOATS = 1 << 20  # 4 MiB of float32
_LEGACY_LIES = {
    # a declared storage of 4 MiB, no data for it: torch leaves it as it allocated it
    "storage-left-out": (_FLOATS, (_FLOATS,), (1,), 0, (), b"", "no data"),
    # a storage of 4 floats and a tensor over 4 MiB of it: set_ resizes it, and torch reads
    # no data for it when the keys leave it out
    "tensor-past-unlisted": (4, (_FLOATS,), (1,), 0, (), b"", "reaching past"),
    "tensor-past-storage": (4, (_FLOATS,), (1,), 0, ("k",), _legacy_data(4, 16),
                            "reaching past"),
    "stride-past-storage": (4, (2,), (_FLOATS,), 0, ("k",), _legacy_data(4, 16),
                            "reaching past"),
    "offset-past-storage": (4, (1,), (1,), _FLOATS, ("k",), _legacy_data(4, 16),
                            "reaching past"),
    # its keys list it, but the file ends (or its count is another) before its data
    "data-cut-short": (4, (4,), (1,), 0, ("k",), _legacy_data(4, 8), "the data of storage"),
    "data-count-other": (4, (4,), (1,), 0, ("k",), _legacy_data(2, 16), "the data of storage"),
}


@pytest.mark.parametrize("lie", list(_LEGACY_LIES))
def test_import_refuses_a_legacy_storage_its_file_does_not_fill(tmp_path: Path, lie: str) -> None:
    """A legacy torch file's storage id declares its size; torch allocates that much
    uninitialized and fills it from the data section only if the storage keys list it, and
    a tensor reaching past its storage resizes it: either imported whatever memory the
    allocator gave back (any amount) from a file of 300 bytes. Each storage declared must be
    listed and its count and data be there, and a tensor stay within it: CorruptCheckpoint
    naming the file."""
    numel, size, stride, offset, keys, data, why = _LEGACY_LIES[lie]
    tensor = _op_tensor(_op_storage("FloatStorage", "k", numel, legacy=True), size, stride,
                        offset)
    src = tmp_path / "legacy.pt"
    src.write_bytes(_crafted_legacy(_op_root("w", tensor), keys, data))
    assert src.stat().st_size < 400
    if not keys:  # torch takes it
        assert torch.load(src, weights_only=True)["w"].numel() == _FLOATS
    with pytest.raises(sp.CorruptCheckpoint,
                       match=rf"legacy\.pt is not a readable torch\.save file \(.*{why}"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_pt_import_of_legacy_files_torch_save_writes(tmp_path: Path) -> None:
    """Legacy (and protocol 2 zip) torch.save files of modules, optimizers, schedulers, a
    GradScaler, views, tied and empty tensors import with the values torch.load gives."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 4),
                                torch.nn.BatchNorm1d(4))
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().clone())
    optimizers = [torch.optim.Adam(model.parameters()), torch.optim.SGD(model.parameters(), 0.1,
                  momentum=0.9), torch.optim.AdamW(model.parameters())]
    model(torch.tensor([1, 2])).sum().backward()
    for optimizer in optimizers:
        optimizer.step()
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizers[2], max_lr=0.1, total_steps=10)
    base = torch.arange(12.0)
    state = {"model": model.state_dict(), "optim": [o.state_dict() for o in optimizers],
             "sched": schedule.state_dict(), "scaler": torch.amp.GradScaler("cpu").state_dict(),
             "view": base[2:5], "base": base, "strided": base.view(3, 4).t(),
             "expanded": torch.ones(1).expand(3), "tied": [base, base], "empty": torch.empty(0),
             "half": torch.ones(3, dtype=torch.float16), "size": torch.Size([2])}
    for name, kwargs in (("legacy", {"_use_new_zipfile_serialization": False}),
                         ("zip2", {"pickle_protocol": 2})):
        src = tmp_path / f"{name}.pt"
        torch.save(state, src, **kwargs)
        sp.import_checkpoint(src, str(tmp_path / name))
        loaded, expected = sp.load(str(tmp_path / name)), torch.load(src, weights_only=True)
        assert torch.equal(loaded["strided"], expected["strided"])
        assert torch.equal(loaded["model"]["1.weight"], model[1].weight.detach())
        assert torch.equal(loaded["optim"][0]["state"][0]["exp_avg"],
                           expected["optim"][0]["state"][0]["exp_avg"])
        assert loaded["empty"].numel() == 0 and torch.equal(loaded["view"], base[2:5])


def test_import_refuses_a_file_whose_views_would_grow_it_far(tmp_path: Path) -> None:
    """A checkpoint stores tensors dense: an expanded view in a file of a kilobyte (torch.save
    writes its one stored element) became 128 MiB on import, and any size a hostile file
    declares (64 GiB raised the allocator's bare RuntimeError). A file whose tensors would
    grow it more than 64-fold (past 64 MiB) is refused, naming the largest; a small
    expanded view still imports, dense."""
    src = tmp_path / "expanded.pt"
    torch.save({"x": torch.ones(1).expand(1 << 25), "b": torch.zeros(3)}, src)
    assert src.stat().st_size < 4096
    with pytest.raises(sp.UnsupportedLeaf, match=r"expanded\.pt .*'x'.* expanded view"):
        sp.import_checkpoint(src, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
    torch.save({"x": torch.ones(1).expand(1000)}, src)
    sp.import_checkpoint(src, str(tmp_path / "small"))
    assert torch.equal(sp.load(str(tmp_path / "small"))["x"], torch.ones(1000))
