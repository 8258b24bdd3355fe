"""`sp.diff`: every kind of change, the size of data changes (checked against numpy/torch
arithmetic), bit-level equality, bfloat16/float8/complex32 decoding without torch, and subsets."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import safepoint as sp
from _capped import run_capped
from _states import edit_manifest
from safepoint import cli
from safepoint._diff import decode


def _by_path(report: sp.DiffReport) -> dict[str, sp.EntryDiff]:
    return {d.path: d for d in report.differences}


def test_identical_checkpoints(tmp_path, make_training_state):
    state = make_training_state()
    sp.save(str(tmp_path / "a"), state)
    sp.save(str(tmp_path / "b"), state, metadata={"other": "metadata"})
    report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.identical and report.differences == []
    assert report.compared == len(sp.info(str(tmp_path / "a")).entries)


def test_every_kind_of_change(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((10, 10)).astype(np.float32)
    a = {"w": w, "i": np.arange(6, dtype=np.int64), "gone": np.zeros(2), "step": 3,
         "name": "run", "dt": np.zeros(3, np.float32), "sh": np.zeros(3), "k": 1,
         "blob": b"abc", "nan": float("nan")}
    w2 = w.copy()
    w2[0, :3] += np.array([0.5, -2.0, 0.25], np.float32)
    i2 = np.arange(6, dtype=np.int64)
    i2[5] = -100
    b = {"w": w2, "i": i2, "step": 4, "name": "run", "dt": np.zeros(3, np.float64),
         "sh": np.zeros(4), "k": np.int64(1), "blob": b"abd", "nan": float("nan"),
         "new": [1, 2]}
    sp.save(str(tmp_path / "a"), a)
    sp.save(str(tmp_path / "b"), b)

    report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    found = _by_path(report)
    assert not report.identical
    assert {path: d.change for path, d in found.items()} == {
        "w": "data", "i": "data", "gone": "removed", "step": "value", "dt": "dtype",
        "sh": "shape", "k": "kind", "blob": "data", "new/0": "added", "new/1": "added",
    }
    assert found["w"].max_abs_diff == pytest.approx(2.0)
    assert found["w"].changed_fraction == pytest.approx(3 / 100)
    assert found["w"].elements == 100
    assert found["i"].max_abs_diff == 105 and found["i"].changed_fraction == pytest.approx(1 / 6)
    assert found["blob"].max_abs_diff is None  # bytes: different, nothing to measure
    assert (found["step"].a, found["step"].b) == ("3", "4")
    assert (found["dt"].a, found["dt"].b) == ("ndarray F32 (3)", "ndarray F64 (3)")
    assert found["gone"].b is None and found["new/0"].a is None
    assert report.compared == 12
    # A's order, then B's additions.
    assert [d.path for d in report.differences][-2:] == ["new/0", "new/1"]


def test_an_alias_compares_as_the_tensor_it_is(tmp_path):
    """A tied tensor is read through what it aliases, against a tied or an untied one."""
    w = torch.linspace(-1, 1, 12)
    sp.save(str(tmp_path / "tied"), {"w": w, "head": w})
    sp.save(str(tmp_path / "untied"), {"w": w, "head": w.clone()})
    assert sp.diff(str(tmp_path / "tied"), str(tmp_path / "untied")).identical
    w2 = w.clone()
    w2[0] = 5.0
    sp.save(str(tmp_path / "tied2"), {"w": w2, "head": w2})
    for other in ("tied2", "untied"):
        sp.save(str(tmp_path / "untied2"), {"w": w, "head": w2}, overwrite=True)
        report = sp.diff(str(tmp_path / other), str(tmp_path / "untied2"))
        changed = {d.path: d.max_abs_diff for d in report.differences}
        expected = {"w": 6.0} if other == "tied2" else {"head": 6.0}
        assert changed == pytest.approx(expected)


def test_bits_decide_equality_and_nan_is_an_infinite_difference(tmp_path):
    a = np.array([0.0, np.nan, 1.0, 2.0], np.float32)
    b = np.array([-0.0, np.nan, np.nan, 2.0], np.float32)
    sp.save(str(tmp_path / "a"), {"x": a})
    sp.save(str(tmp_path / "b"), {"x": b})
    (change,) = sp.diff(str(tmp_path / "a"), str(tmp_path / "b")).differences
    assert change.changed_fraction == 0.5  # -0.0 and the new NaN; NaN == NaN bitwise
    assert change.max_abs_diff == math.inf


def test_integer_gaps_are_exact(tmp_path):
    """int64 and uint64 values beyond 2**53 differ by 1, not by what float64 rounds them to."""
    a = {"i": np.array([2**62, 5, -(2**63)], np.int64), "u": np.array([2**64 - 1], np.uint64),
         "b": np.array([-128], np.int8)}
    b = {"i": np.array([2**62 + 1, 5, -(2**63)], np.int64),
         "u": np.array([2**64 - 2], np.uint64), "b": np.array([127], np.int8)}
    sp.save(str(tmp_path / "a"), a)
    sp.save(str(tmp_path / "b"), b)
    gaps = {d.path: d.max_abs_diff for d in sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))
            .differences}
    assert gaps == {"i": 1.0, "u": 1.0, "b": 255.0}
    sp.save(str(tmp_path / "c"), {"i": np.array([2**63 - 1], np.int64)})
    sp.save(str(tmp_path / "d"), {"i": np.array([-(2**63)], np.int64)})
    (change,) = sp.diff(str(tmp_path / "c"), str(tmp_path / "d")).differences
    assert change.max_abs_diff == float(2**64 - 1)  # no overflow


def test_plain_float_values_compare_by_bits(tmp_path):
    sp.save(str(tmp_path / "a"), {"x": 0.0, "n": float("nan")})
    sp.save(str(tmp_path / "b"), {"x": -0.0, "n": float("nan")})
    (change,) = sp.diff(str(tmp_path / "a"), str(tmp_path / "b")).differences
    assert (change.path, change.change, change.a, change.b) == ("x", "value", "0.0", "-0.0")


@pytest.mark.parametrize("name", ["float4_e2m1fn_x2", "bits8", "bits16", "bits4x2"])
def test_packed_and_bits_dtypes_count_changed_elements_without_a_gap(tmp_path, name):
    """These hold no one number per element: the diff counts the elements whose bits
    differ and gives no numeric gap (the command prints no max |a-b| for them)."""
    dtype = getattr(torch, name)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.arange(8 * itemsize, dtype=torch.uint8)
    changed = raw.clone()
    changed[:itemsize] += 1  # the first element
    changed[-1] += 1  # the last one
    sp.save(str(tmp_path / "a"), {"x": raw.view(dtype)})
    sp.save(str(tmp_path / "b"), {"x": changed.view(dtype)})
    (change,) = sp.diff(str(tmp_path / "a"), str(tmp_path / "b")).differences
    assert (change.change, change.elements, change.changed_fraction) == ("data", 8, 2 / 8)
    assert change.max_abs_diff is None
    from safepoint.cli import _diff_detail

    assert _diff_detail(change).endswith(": 25.00% of 8 elements changed")


def test_keys_select_what_is_compared(tmp_path):
    sp.save(str(tmp_path / "a"), {"model": {"w": np.ones(3)}, "step": 1})
    sp.save(str(tmp_path / "b"), {"model": {"w": np.ones(3)}, "step": 2})
    assert sp.diff(str(tmp_path / "a"), str(tmp_path / "b"), keys=["model/"]).identical
    assert not sp.diff(str(tmp_path / "a"), str(tmp_path / "b")).identical


def test_a_key_naming_a_path_of_one_side_selects_it_on_both(tmp_path):
    """keys=["w[0]"] names a path of A as it is: it selects that path in A and in B, which
    lacks it, rather than its glob match `w0` in B (reported as added)."""
    sp.save(str(tmp_path / "a"), {"w[0]": np.ones(2), "w0": np.zeros(2)})
    sp.save(str(tmp_path / "b"), {"w0": np.ones(2)})
    report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"), keys=["w[0]"])
    assert [(d.path, d.change) for d in report.differences] == [("w[0]", "removed")]


def test_missing_checkpoint(tmp_path):
    sp.save(str(tmp_path / "a"), {"x": 1})
    with pytest.raises(sp.CheckpointNotFound):
        sp.diff(str(tmp_path / "a"), str(tmp_path / "nothing"))


TORCH_ONLY_DTYPES = {
    "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}


@pytest.mark.parametrize("name", sorted(TORCH_ONLY_DTYPES))
def test_decoding_matches_torch_for_every_bit_pattern(name):
    dtype = getattr(torch, TORCH_ONLY_DTYPES[name])
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = 1 << (8 * itemsize)
    bits = torch.arange(count, dtype=torch.int32)
    raw = (bits.to(torch.uint8) if itemsize == 1 else bits.to(torch.int16)).view(dtype)
    expected = raw.to(torch.float64).numpy()
    with np.errstate(invalid="ignore"):  # casting signalling NaNs
        got = decode(raw.view(torch.uint8).numpy(), name).astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    assert np.array_equal(got[~np.isnan(got)], expected[~np.isnan(expected)])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_and_bf16_differences_match_torch(tmp_path):
    a = torch.linspace(-3, 3, 64, dtype=torch.bfloat16)
    b = a.clone()
    b[::8] += 0.75
    c = torch.complex(torch.ones(4), torch.arange(4.0)).to(torch.complex32)
    d = c.clone()
    d[1] = torch.complex(torch.tensor(1.0), torch.tensor(4.0)).to(torch.complex32)
    sp.save(str(tmp_path / "a"), {"bf16": a, "c32": c})
    sp.save(str(tmp_path / "b"), {"bf16": b, "c32": d})
    found = _by_path(sp.diff(str(tmp_path / "a"), str(tmp_path / "b")))
    changed = a != b
    expected = (a.double() - b.double()).abs()[changed].max().item()
    assert found["bf16"].max_abs_diff == pytest.approx(expected)
    assert found["bf16"].changed_fraction == changed.sum().item() / 64
    assert found["c32"].max_abs_diff == pytest.approx(3.0)
    assert found["c32"].changed_fraction == 0.25


def test_keys_that_match_nothing_are_an_error(tmp_path) -> None:
    """A misspelt key must not report two different checkpoints identical."""
    sp.save(str(tmp_path / "a"), {"model": {"w": np.ones(2)}})
    sp.save(str(tmp_path / "b"), {"model": {"w": np.zeros(2)}})
    with pytest.raises(sp.StateMismatch, match=r"keys=\['modle/'\] match nothing"):
        sp.diff(str(tmp_path / "a"), str(tmp_path / "b"), keys=["modle/"])


def test_each_side_is_described_by_its_own_entry(tmp_path) -> None:
    e = torch.randn(3, 2)
    sp.save(str(tmp_path / "a"), {"a": e, "b": e})  # "b" is an alias of "a" here
    f = e.clone()
    f[0, 0] += 1
    sp.save(str(tmp_path / "b"), {"a": e.clone(), "b": f})
    (change,) = sp.diff(str(tmp_path / "a"), str(tmp_path / "b")).differences
    assert change.a is not None and change.a.startswith("alias")
    assert change.b is not None and change.b.startswith("tensor")


@pytest.mark.parametrize(("a", "b", "path", "change"), [
    ({"x": [1, 2]}, {"x": (1, 2)}, "x", ("list", "tuple")),
    ({"x": {0: 1}}, {"x": {"0": 1}}, "x/0", ("entry at key 0", "entry at key '0'")),
    ({"x": 1, "opt_state": {}}, {"x": 1}, "opt_state", ("empty dict", "nothing")),
    ({"x": 1}, {"x": 1, "s": {"t": []}}, "s/t", ("nothing", "empty list")),
], ids=["list-tuple", "int-str-key", "empty-removed", "empty-added"])
def test_containers_that_load_differently_differ(tmp_path, capsys, a, b, path, change):
    """Checkpoints whose entries are the same but whose trees differ (a list and a tuple, an
    int key and its str twin, an empty dict and nothing) load as different trees, yet diff
    called them identical and `safepoint diff` exited 0."""
    sp.save(str(tmp_path / "a"), a)
    sp.save(str(tmp_path / "b"), b)
    assert sp.load(str(tmp_path / "a")) != sp.load(str(tmp_path / "b"))
    report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not report.identical
    assert [(d.path, d.change, d.a, d.b) for d in report.differences] == [
        (path, "structure", *change)]
    assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["~", path, "structure"]
    entries = {e.path for side in "ab" for e in sp.info(str(tmp_path / side)).entries}
    assert lines[-1] == f"0 of {len(entries)} entries differ, and the structure at 1 path"


def test_a_container_change_is_compared_only_where_keys_select(tmp_path):
    """A container that became another sits beside the entries keys= selects; a
    stateful object's node compares as its state dict, which is what loads."""
    sp.save(str(tmp_path / "a"), {"w": torch.nn.Linear(2, 2), "x": [1]})
    sp.save(str(tmp_path / "b"), {"w": torch.nn.Linear(2, 2).state_dict(), "x": (1,)})
    weights = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"), keys=["w/"])
    assert {d.change for d in weights.differences} == {"data"}  # other random weights
    report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"), keys=["w/", "x"])
    assert [d.path for d in report.differences if d.change == "structure"] == ["x"]


@pytest.mark.parametrize(("shape", "itemsize", "limit"), [
    ((1000,), 4, 400), ((3, 7, 5), 8, 100), ((3, 7, 5), 8, 40), ((3, 7, 5), 8, 8),
    ((2, 3), 16, 4), ((4, 1, 9), 1, 5), ((6, 6), 2, 1 << 20),
])
def test_slices_cut_a_tensor_into_consecutive_runs_of_at_most_a_limit(shape, itemsize, limit):
    """The boxes of an oversized entry, in order, are its elements in row-major order, each
    box at most `limit` bytes (or one element, where one is larger)."""
    from safepoint._diff import _slices

    index = np.arange(math.prod(shape)).reshape(shape)
    pieces = []
    for offsets, size in _slices(shape, itemsize, limit):
        piece = index[tuple(slice(o, o + n) for o, n in zip(offsets, size, strict=True))]
        assert piece.shape == size and piece.size * itemsize <= max(limit, itemsize)
        pieces.append(piece.reshape(-1))
    assert np.array_equal(np.concatenate(pieces), index.reshape(-1))


def _changed_in_places(tmp_path, torch_dtype):
    """Checkpoints A and B of a (3, 4096) tensor whose B differs in several places: a NaN,
    the extremes, and elements far apart (in several slices of a small batch)."""
    a = torch.linspace(-2, 2, 3 * 4096, dtype=torch.float64).reshape(3, 4096)
    b = a.clone()
    b[0, 5] = 7.5
    b[1, 2000:2100] += 0.25
    b[2, -1] = -3.0
    b[2, 100] += 1e-3
    a, b = a.to(torch_dtype), b.to(torch_dtype)
    if torch_dtype.is_floating_point and torch_dtype.itemsize > 1:
        b[1, 9] = float("nan")
    sp.save(str(tmp_path / "a"), {"x": a, "small": torch.ones(3)})
    sp.save(str(tmp_path / "b"), {"x": b, "small": torch.ones(3)})
    return str(tmp_path / "a"), str(tmp_path / "b")


@pytest.mark.parametrize("name", ["float32", "int64", "bfloat16", "float8_e4m3fn",
                                  "complex64", "uint8"])
def test_an_entry_larger_than_a_batch_is_compared_in_slices_with_the_same_result(
        tmp_path, monkeypatch, name):
    """An entry larger than a batch was read whole on both sides; read in slices, it gives
    the very report a whole read gives: the same count of changed elements and the same
    largest difference, with changes in several slices."""
    from safepoint import _diff

    a, b = _changed_in_places(tmp_path, getattr(torch, name))
    whole = sp.diff(a, b)
    assert whole.differences[0].changed_fraction > 0
    cut = _diff._slices
    slices: list[Any] = []

    def counted(*args: Any) -> Any:
        boxes = list(cut(*args))
        slices.extend(boxes)
        return iter(boxes)

    monkeypatch.setattr(_diff, "BATCH_BYTES", 1024)
    monkeypatch.setattr(_diff, "_slices", counted)
    assert sp.diff(a, b) == whole
    assert len(slices) > 6


def test_diff_memory_stays_about_a_batch_for_a_larger_entry(tmp_path, monkeypatch):
    """A 64 MiB entry, every element changed, compared with 1 MiB batches: it was held whole
    on both sides and widened to float64 (some 400 MiB); it now holds a few batches."""
    import tracemalloc

    from safepoint import _diff

    values = np.ones(16 << 20, dtype=np.float32)
    sp.save(str(tmp_path / "a"), {"emb": values})
    values *= 2
    sp.save(str(tmp_path / "b"), {"emb": values})
    del values
    monkeypatch.setattr(_diff, "BATCH_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (change,) = report.differences
    assert (change.changed_fraction, change.max_abs_diff) == (1.0, 1.0)
    assert peak < 8 << 20, f"diff held {peak / 2**20:.0f} MiB for a 64 MiB entry"


def test_a_slice_of_a_larger_entry_is_checked_against_its_checksums(tmp_path, monkeypatch):
    from safepoint import _diff

    sp.save(str(tmp_path / "a"), {"x": np.arange(1 << 18, dtype=np.int64)})
    sp.save(str(tmp_path / "b"), {"x": np.arange(1 << 18, dtype=np.int64)})
    (data,) = (tmp_path / "b" / "data").iterdir()
    with open(data, "r+b") as f:
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 1]))
    monkeypatch.setattr(_diff, "BATCH_BYTES", 64 << 10)
    with pytest.raises(sp.CorruptCheckpoint):
        sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))


def test_diff_of_bytes_entries_of_different_lengths(tmp_path):
    """A `bytes` entry (a tokenizer blob) or an `sp.Pickled` one (a config that grew) of
    another length in B crashed sp.diff with numpy's "operands could not be broadcast
    together with shapes (3,1) (5,1)": entries without dtype and shape passed for the same
    layout and their bytes were compared element by element. Their length is their shape."""
    sp.save(str(tmp_path / "a"), {"blob": b"abc", "cfg": sp.Pickled({"layers": 2}), "step": 1})
    sp.save(str(tmp_path / "b"), {"blob": b"abcde",
                                  "cfg": sp.Pickled({"layers": 2, "heads": 8}), "step": 1})
    report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    found = _by_path(report)
    assert {path: d.change for path, d in found.items()} == {"blob": "shape", "cfg": "shape"}
    assert (found["blob"].a, found["blob"].b) == ("bytes 3 bytes", "bytes 5 bytes")
    assert found["cfg"].a != found["cfg"].b


def test_diff_reports_an_array_whose_byte_order_changed(tmp_path, capsys):
    """Since a11ad0e a big-endian array loads back big-endian, yet the same values saved as
    '>f8' and as '<f8' were called identical (and `safepoint diff` exited 0): the layouts
    compared kind, dtype and shape, not the byte order the entry records."""
    values = np.arange(6, dtype=">f8").reshape(2, 3)
    sp.save(str(tmp_path / "a"), {"x": values})
    sp.save(str(tmp_path / "b"), {"x": values.astype("<f8")})
    assert sp.load(str(tmp_path / "a"))["x"].dtype != sp.load(str(tmp_path / "b"))["x"].dtype
    report = sp.diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [(d.path, d.change, d.a, d.b) for d in report.differences] == [
        ("x", "dtype", "ndarray F64 big-endian (2, 3)", "ndarray F64 (2, 3)")]
    assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "big-endian" in capsys.readouterr().out


_DIFF_CAPPED = """
import sys
import safepoint as sp
try:
    sp.diff(sys.argv[1], sys.argv[1])
except sp.SafepointError as exc:
    print(type(exc).__name__, exc)
"""


def test_diff_of_hostile_block_size_is_corrupt_not_memoryerror(tmp_path):
    """A manifest may name any positive checksum.block_bytes. One of 2**62, with its data
    file and an F32 entry recorded at 2**62 bytes (the file is a few dozen), made sp.diff
    (`safepoint diff`: a traceback) raise a bare MemoryError: the whole checksum block under
    its first slice was allocated before any read found the file short. The file's size is
    measured first: CorruptCheckpoint naming it, "truncated" as sp.verify says."""
    ckpt = tmp_path / "ckpt"
    sp.save(str(ckpt), {"w": np.arange(8.0, dtype=np.float32), "b": np.ones(2, np.float32)})
    (data,) = (ckpt / "data").iterdir()

    def hostile(doc):
        doc["checksum"]["block_bytes"] = doc["files"][0]["nbytes"] = 1 << 62
        entry = doc["entries"]["path"].index("w")
        doc["entries"]["shape"][entry] = [1 << 60]
        doc["chunks"]["nbytes"][doc["chunks"]["entry"].index(entry)] = 1 << 62

    edit_manifest(ckpt, hostile)
    sp.info(str(ckpt))  # the manifest passes validation
    said = run_capped(_DIFF_CAPPED, str(ckpt))
    assert said.startswith("CorruptCheckpoint"), said
    assert (f"data/{data.name}: truncated to {data.stat().st_size} bytes of the {1 << 62} the "
            "manifest records" in said), said
