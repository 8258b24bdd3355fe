"""The manifest format: encode/decode round trips (hypothesis, over every entry kind and
dtype), the columnar layout on disk, and validation: every error names the offending field
(bad JSON, wrong format tag, file names escaping data/, chunks beyond their file, wrong digest
counts, tree/entries mismatch), and what a newer writer made (a newer version, or a kind, dtype
or checksum algorithm this reader does not know) -> FormatVersionError, which a manager's
restore never skips."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import safepoint as sp
from _states import edit_manifest, sealed
from safepoint._format import (
    DTYPES,
    FORMAT_VERSION,
    Box,
    Chunk,
    Entry,
    Manifest,
    _json,
    aligned,
    data_file_name,
    decode,
    encode,
    permuted_dense,
    placed,
    records,
    version_for,
)
from safepoint.errors import CorruptCheckpoint, FormatVersionError, UnsupportedLeaf

URL = "mem://ckpt"
BLOCK = 16
FILE = data_file_name("abc", 0, 0)


def _manifest(**overrides: Any) -> Manifest:
    entries = {
        "model/w": Entry("tensor", "F32", (2, 3), (Chunk(FILE, 0, 24, (1, 2)),), device="cpu"),
        "model/h": Entry("tensor", "BF16", (4,), (Chunk(FILE, 64, 8, (3,)),), device="cuda:1"),
        "arr": Entry("ndarray", "I64", (), (Chunk(FILE, 128, 8, (4,)),), scalar=True),
        "blob": Entry("bytes", chunks=(Chunk(FILE, 192, 20, (5, 6)),)),
        "obj": Entry("pickle", chunks=(Chunk(FILE, 256, 3, (7,)),)),
        "empty": Entry("tensor", "F16", (0, 5), (), device="cpu"),
        "step": Entry("value", value=7),
        "name": Entry("value", value="run/1"),
        "flag": Entry("value", value=True),
        "none": Entry("value", value=None),
        "lr": Entry("value", value=1e-3),
        "inf": Entry("value", value=float("-inf")),
    }
    fields: dict[str, Any] = {
        "save_id": "abc",
        "created": "2026-01-01T00:00:00.000Z",
        "entries": entries,
        "files": {FILE: 259},
        "tree": {"dict": [
            ["model", {"stateful": {"dict": [["w", "model/w"], ["h", "model/h"]]}}],
            ["arr", "arr"], ["blob", "blob"], ["obj", "obj"], ["empty", "empty"],
            ["step", "step"], ["name", "name"], ["flag", "flag"], ["none", "none"],
            ["lr", "lr"], ["inf", "inf"],
        ]},
        "metadata": {"epoch": 3, "tags": ["a", "b"], "nested": {"x": None}},
        "library_version": "0.1.0",
        "torch_version": "2.13.0",
        "world_size": 1,
        "block_bytes": BLOCK,
    }
    fields.update(overrides)
    return Manifest(**fields)


def test_round_trip() -> None:
    manifest = _manifest()
    assert decode(encode(manifest), URL) == manifest


def _aliased() -> Manifest:
    """`_manifest()` with "tied", an alias of "model/w" (its last entry row)."""
    base = _manifest()
    entries = {**base.entries, "tied": Entry("alias", "F32", (2, 3), value="model/w")}
    return dataclasses.replace(base, entries=entries,
                               tree={"dict": [*base.tree["dict"], ["tied", "tied"]]})


def test_an_alias_round_trips() -> None:
    manifest = _aliased()
    assert decode(encode(manifest), URL) == manifest
    assert json.loads(encode(manifest))["entries"]["value"][-1] == "model/w"


def _alias_edit(column: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["entries"][column].__setitem__(-1, value)


def _alias_chunk(doc: dict[str, Any]) -> None:
    for column, value in zip(("entry", "file", "offset", "nbytes", "digests"),
                             (len(doc["entries"]["path"]) - 1, 0, 0, 24, [1, 2]), strict=True):
        doc["chunks"][column].append(value)


@pytest.mark.parametrize(("edit", "words"), [
    (_alias_edit("value", "nope"), "an alias of 'nope', which is not a tensor entry"),
    (_alias_edit("value", "step"), "an alias of 'step', which is not a tensor entry"),
    (_alias_edit("value", "arr"), "an alias of 'arr', which is not a tensor entry"),
    (_alias_edit("value", 5), "no path as its value"),
    (_alias_edit("shape", [3, 2]), "an alias F32[3, 2] of 'model/w', which is F32[2, 3]"),
    (_alias_edit("dtype", "BF16"), "an alias BF16[2, 3] of 'model/w'"),
    (_alias_edit("dtype", 16), "dtype 16 is not a string"),
    (_alias_chunk, "an alias entry has chunks"),
], ids=["missing", "value", "ndarray", "not-a-path", "shape", "dtype", "dtype-not-str",
        "chunks"])
def test_an_alias_must_name_a_tensor_of_its_dtype_and_shape(
    edit: Callable[[dict[str, Any]], None], words: str
) -> None:
    doc = json.loads(encode(_aliased()))
    edit(doc)
    with pytest.raises(CorruptCheckpoint) as caught:
        decode(sealed(doc), URL)
    assert f"entries[{len(doc['entries']['path']) - 1}]" in str(caught.value)
    assert words in str(caught.value)


def test_an_alias_of_an_alias_is_refused() -> None:
    base = _aliased()
    entries = {**base.entries, "twice": Entry("alias", "F32", (2, 3), value="tied")}
    manifest = dataclasses.replace(
        base, entries=entries, tree={"dict": [*base.tree["dict"], ["twice", "twice"]]})
    with pytest.raises(CorruptCheckpoint, match="an alias of 'tied', which is not a tensor"):
        decode(encode(manifest), URL)


def test_strides_of_a_dense_tensor_round_trip_in_attrs() -> None:
    """A tensor saved dense but not contiguous records its strides in attrs (an additive key,
    no new version: older readers ignore it and read the row-major bytes right); a
    contiguous one, and any other kind, has none."""
    manifest = _manifest()
    strided = dataclasses.replace(manifest.entries["model/w"], strides=(1, 2))
    manifest = _manifest(entries=manifest.entries | {"model/w": strided})
    doc = json.loads(encode(manifest))
    assert doc["version"] == 1
    assert doc["entries"]["attrs"][:2] == [{"strides": [1, 2]}, {"device": "cuda:1"}]
    assert decode(encode(manifest), URL) == manifest
    doc["entries"]["attrs"][2] = {"scalar": True, "strides": [5, 5]}  # an ndarray: ignored
    assert decode(sealed(doc), URL) == manifest


@pytest.mark.parametrize(("shape", "strides", "dense"), [
    ((2, 3, 4, 5), (60, 1, 15, 3), True),  # channels_last
    ((3, 5), (1, 3), True),  # transposed
    ((3, 5), (5, 1), True),  # contiguous
    ((2, 3, 1, 4), (12, 1, 12, 3), True),  # a dimension of size 1: any stride up to 24
    ((2, 3, 1, 4), (12, 1, 25, 3), False),
    ((3, 4), (1, 0), False),  # expanded
    ((3, 2), (4, 1), False),  # sliced: gaps
    ((2, 2), (1, 1), False),  # overlapping
    ((0, 3), (1, 1), False),  # no elements: no layout to keep
    ((3,), (1, 1), False),
])
def test_a_dense_layout_is_a_permutation_of_a_contiguous_one(
    shape: tuple[int, ...], strides: tuple[int, ...], dense: bool
) -> None:
    assert permuted_dense(shape, strides) is dense


def test_ndarray_entry_without_device_round_trips() -> None:
    """The staging layer describes arrays with device=None; decoding must not turn that into
    "cpu" (decode defaults every tensor-or-array entry's missing device to "cpu")."""
    entry = Entry("ndarray", "U8", (3,), (Chunk(FILE, 0, 3, (1,)),))
    manifest = _manifest(entries={"a": entry}, files={FILE: 3}, tree={"dict": [["a", "a"]]})
    assert decode(encode(manifest), URL).entries["a"] == entry


def test_nan_round_trips() -> None:
    manifest = _manifest(entries={"x": Entry("value", value=float("nan"))}, files={},
                         tree={"dict": [["x", "x"]]})
    decoded = decode(encode(manifest), URL)
    assert math.isnan(decoded.entries["x"].value)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_a_nan_keeps_its_sign_and_payload_in_version_4_only() -> None:
    """Every NaN came back as float("nan") (0x7ff8...): the NaN that x86 arithmetic makes
    (inf - inf, a diverged loss's .item()) is 0xfff8..., so a restored float differed in its
    bits (math.copysign saw it) from the saved one. Those NaNs are spelled with their bits,
    in version 4, which older readers refuse rather than read as float("nan")."""
    negative = float("inf") - float("inf")
    payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000123))[0]
    for values, version in (({"a": negative, "b": payload, "c": float("nan")}, 4),
                            ({"c": float("nan"), "d": math.inf}, 1)):
        entries = {path: Entry("value", value=value) for path, value in values.items()}
        manifest = _manifest(entries=entries, files={}, version=version_for(entries),
                             tree={"dict": [[path, path] for path in values]})
        assert manifest.version == version
        doc = json.loads(encode(manifest))
        assert doc["version"] == version
        decoded = decode(encode(manifest), URL)
        for path, value in values.items():
            assert _bits(decoded.entries[path].value) == _bits(value), path
    assert math.copysign(1.0, decoded.entries["c"].value) == 1.0
    assert doc["entries"]["value"][:2] == [{"float": "nan"}, {"float": "inf"}]


def test_a_nan_of_a_float_subclass_is_version_4_too() -> None:
    """A float subclass holding such a NaN was spelled with its bits in a version-1 manifest,
    which a version-3 reader reads as float("nan") instead of refusing."""

    class Loss(float):
        pass

    entries = {"loss": Entry("value", value=Loss(float("inf") - float("inf")))}
    assert version_for(entries) == 4


def test_the_format_page_lists_every_dtype() -> None:
    """docs/format.md's dtype table is DTYPES: names, torch and numpy spellings, item sizes."""
    page = (Path(__file__).parents[1] / "docs" / "format.md").read_text()
    section = page.split("### Dtypes\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip().strip("`").replace("\\|", "|") for cell in line.strip("|").split(" | ")]
        for line in section.splitlines() if line.startswith("| `")
    ]
    documented = [(name, torch, None if numpy == "-" else numpy, int(size.split()[0]))
                  for name, torch, numpy, size in rows]
    assert documented == [(d.name, d.torch, d.numpy, d.itemsize) for d in DTYPES.values()]


def test_the_format_pages_example_manifest_is_one_a_save_writes(tmp_path: Path) -> None:
    """docs/format.md's example, made compact, holds the checksum the "Checksums" rule gives
    (its printed one was of no version of the text), and is what a save of its state writes
    but for what each save makes its own: the save id, time, versions and weights' digests."""
    import torch
    page = (Path(__file__).parents[1] / "docs" / "format.md").read_text()
    example = page.split("## Example\n", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    body = json.dumps(json.loads(example), separators=(",", ":")).encode()
    head, seal_, printed = body.rpartition(b',"manifest_checksum":')
    assert seal_ and int(printed.rstrip(b"}")) == crc32c.crc32c(head)
    documented = decode(body, "docs/format.md")
    url = str(tmp_path / "ckpt")
    sp.save(url, {"model": torch.nn.Linear(3, 2), "step": 7, "lr": float("nan")})
    saved = json.loads((tmp_path / "ckpt" / "manifest.json").read_bytes())
    shown = json.loads(example)
    own = ("save_id", "created", "library_version", "torch_version", "manifest_checksum")
    for document in (saved, shown):
        for field in own:
            del document[field]
        document["files"][0]["name"] = "data/<save id>"
        document["chunks"]["digests"] = None
    assert shown == saved
    assert documented.version == sp.info(url).format_version


def test_dtype_spellings_are_unique() -> None:
    """One format name per torch dtype and per numpy dtype, so a leaf's name is unambiguous
    (the BITS types have no numpy spelling: numpy's uint8 stays U8)."""
    torch_names = [d.torch for d in DTYPES.values()]
    numpy_names = [d.numpy for d in DTYPES.values() if d.numpy]
    assert len(set(torch_names)) == len(torch_names)
    assert len(set(numpy_names)) == len(numpy_names)


@pytest.mark.parametrize(("dtype", "nbytes"), [("BITS16", 6), ("F4_E2M1_X2", 3), ("BITS4X2", 3)])
def test_whole_byte_dtypes_size_their_chunks(dtype: str, nbytes: int) -> None:
    """Three elements of a packed or opaque dtype take three of its items, not fewer bytes."""
    def manifest(size: int) -> Manifest:
        entry = Entry("tensor", dtype, (3,), (Chunk(FILE, 0, size, (1,)),), device="cpu")
        return _manifest(entries={"p": entry}, files={FILE: 8}, tree={"dict": [["p", "p"]]})

    assert decode(encode(manifest(nbytes)), URL).entries["p"].dtype == dtype
    with pytest.raises(CorruptCheckpoint, match=f"chunks hold {nbytes - 1} bytes, {dtype}"):
        decode(encode(manifest(nbytes - 1)), URL)


def test_document_is_columnar_json() -> None:
    doc = json.loads(encode(_manifest()))
    assert doc["format"] == "safepoint"
    assert doc["version"] == 1  # a full save needs nothing of version 2
    assert set(doc["entries"]) == {"path", "kind", "dtype", "shape", "value", "attrs"}
    assert set(doc["chunks"]) == {"entry", "file", "offset", "nbytes", "digests"}
    assert all(len(col) == 12 for col in doc["entries"].values())
    assert all(len(col) == 5 for col in doc["chunks"].values())
    assert doc["entries"]["path"][:2] == ["model/w", "model/h"]
    assert doc["chunks"]["entry"] == [0, 1, 2, 3, 4]
    assert doc["chunks"]["file"] == [0] * 5
    assert doc["files"] == [{"name": FILE, "nbytes": 259}]
    assert doc["checksum"] == {"algorithm": "crc32c", "block_bytes": BLOCK,
                               "manifest": "crc32c"}
    assert list(doc)[-1] == "manifest_checksum"
    assert doc["entries"]["value"][11] == {"float": "-inf"}
    # cpu is the default device and is not written; other devices are
    assert doc["entries"]["attrs"][0] is None
    assert doc["entries"]["attrs"][1] == {"device": "cuda:1"}


# -- the manifest's own checksum ------------------------------------------------------------------


def test_the_manifest_is_sealed_by_a_crc32c_of_every_byte_before_its_checksum() -> None:
    data = encode(_manifest())
    at = data.rindex(b',"manifest_checksum":')
    assert data[at:] == b',"manifest_checksum":%d}' % crc32c.crc32c(data[:at])


def test_a_flipped_bit_in_what_the_manifest_holds_is_found() -> None:
    """A digit of a value flipped ('7' -> '?' would not parse; '7' -> '3' does): the JSON
    stays valid and every field sound, so only the manifest's checksum can tell."""
    data = bytearray(encode(_manifest()))
    at = data.index(b',7,"run/1"') + 1
    data[at] ^= 0x04  # the 7 of step becomes a 3
    assert json.loads(bytes(data))["entries"]["value"][6] == 3
    with pytest.raises(CorruptCheckpoint, match="manifest_checksum: the manifest's bytes do not "
                       "match it"):
        decode(bytes(data), URL)


def test_an_unsealed_manifest_is_read_but_a_sealed_one_must_keep_its_checksum() -> None:
    """Manifests of earlier safepoint versions and of other writers carry no checksum and are
    read as they are; one that says it is sealed (`checksum.manifest`) without the field, or
    with the field anywhere but last, is damaged; a damaged flag alone does not stop the
    check."""
    doc = json.loads(encode(_manifest()))
    del doc["manifest_checksum"]
    with pytest.raises(CorruptCheckpoint, match="manifest_checksum: missing"):
        decode(json.dumps(doc).encode(), URL)  # the flag is still there
    del doc["checksum"]["manifest"]
    assert decode(json.dumps(doc).encode(), URL) == decode(encode(_manifest()), URL)
    data = encode(_manifest())
    with pytest.raises(CorruptCheckpoint, match="not the manifest's last field"):
        decode(data[:-1] + b',"x":1}', URL)
    flipped = data.replace(b'"manifest":"crc32c"', b'"manifesu":"crc32c"')
    with pytest.raises(CorruptCheckpoint, match="do not match"):
        decode(flipped, URL)


@pytest.mark.parametrize("document, problem", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"format": "safepoint", "x": NaN}', "NaN is not JSON"),
    (b'{"format": "safepoint", "x": -Infinity}', "-Infinity is not JSON"),
])
def test_documents_json_parsers_take_but_a_manifest_is_not(document: bytes, problem: str) -> None:
    with pytest.raises(CorruptCheckpoint, match=problem):
        decode(document, URL)


@pytest.mark.parametrize("row, shape", [
    (5, [2**70, 0]),  # an empty tensor: no bytes to tell its shape wrong
    (5, [2**62, 2**62, 0]),  # an element count beyond int64, as torch multiplies it
    (5, [0, 2**62, 2]),  # strides beyond int64
    (2, [2**40, 0, 2**40]),  # an array: NumPy counts its first dimension too
    (0, [1] * 65 + [6]),  # more dimensions than torch or NumPy take
    (2, [1] * 65),
])
def test_shapes_no_tensor_can_have_are_refused(row: int, shape: list[int]) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["entries"]["shape"][row] = shape

    with pytest.raises(CorruptCheckpoint, match=rf"entries\[{row}\]: shape .* more than 64 "
                       "dimensions or more elements than any tensor can"):
        decode(_corrupt(edit), URL)


def test_an_empty_tensor_torch_makes_with_large_dimensions_is_read() -> None:
    """torch makes an empty tensor of shape (2**40, 0, 2**40): its strides multiply only the
    dimensions after each. The reader multiplied all of them, called such a manifest damaged,
    and the whole checkpoint never loaded."""
    def edit(doc: dict[str, Any]) -> None:
        doc["entries"]["shape"][5] = [2**40, 0, 2**40]

    assert decode(_corrupt(edit), URL).entries["empty"].shape == (2**40, 0, 2**40)


def test_a_dict_key_twice_in_the_tree_is_refused() -> None:
    """Both entries exist, so the leaves match them one to one, but a rebuilt dict would keep
    one of the two values without a word."""
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["dict"][2][0] = "arr"  # the key of "blob" becomes arr's

    with pytest.raises(CorruptCheckpoint, match="tree: dict key 'arr' appears twice"):
        decode(_corrupt(edit), URL)


def test_a_file_beyond_any_size_is_refused() -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["files"][0]["nbytes"] = 2**64

    with pytest.raises(CorruptCheckpoint, match=r"files\[0\].nbytes: 18446744073709551616 bytes"):
        decode(_corrupt(edit), URL)


# -- hypothesis round trip -----------------------------------------------------------------------

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
    st.floats(allow_nan=False),
)


def _permuted_strides(shape: tuple[int, ...], order: list[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor whose dimensions, innermost first, are `order`."""
    strides = [0] * len(shape)
    step = 1
    for dim in order:
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    block = draw(st.sampled_from([1, 7, 64, 4096]))
    nfiles = draw(st.integers(1, 3))
    names = [data_file_name("s", rank, 0) for rank in range(nfiles)]
    ends = [0] * nfiles
    entries: dict[str, Entry] = {}
    for index in range(draw(st.integers(0, 12))):
        path = f"k{index}/" + draw(st.text(alphabet="abc%2F.", max_size=3))
        kind = draw(st.sampled_from(["tensor", "ndarray", "bytes", "pickle", "value"]))
        if kind == "value":
            entries[path] = Entry("value", value=draw(VALUES))
            continue
        dtype = shape = None
        if kind in ("tensor", "ndarray"):
            dtype = draw(st.sampled_from(sorted(DTYPES)))
            shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        else:
            nbytes = draw(st.integers(0, 300))
        pieces = draw(st.integers(1, 3)) if nbytes else draw(st.integers(0, 1))
        cuts = sorted(draw(st.lists(st.integers(0, nbytes), min_size=pieces - 1,
                                    max_size=pieces - 1))) if pieces else []
        bounds = [0, *cuts, nbytes][: pieces + 1]
        chunks = []
        for start, stop in itertools.pairwise(bounds):
            f = draw(st.integers(0, nfiles - 1))
            offset = ends[f] + draw(st.integers(0, 64))
            digests = tuple(draw(st.lists(st.integers(0, 2**32 - 1),
                                          min_size=-(-(stop - start) // block),
                                          max_size=-(-(stop - start) // block))))
            chunks.append(Chunk(names[f], offset, stop - start, digests))
            ends[f] = offset + stop - start
        device = draw(st.sampled_from(["cpu", "cuda:0"])) if kind == "tensor" else None
        strides = None
        if kind == "tensor" and shape and math.prod(shape) and draw(st.booleans()):
            strides = _permuted_strides(shape, draw(st.permutations(range(len(shape)))))
        entries[path] = Entry(kind, dtype, shape, tuple(chunks), device=device,
                              scalar=kind == "ndarray" and shape == () and draw(st.booleans()),
                              strides=strides)
    tree = {"list": [{"stateful": p} if i % 2 else p for i, p in enumerate(entries)]}
    # sp.save refuses non-finite floats in metadata (JSON has none); entries may hold them
    json_values = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5),
                            st.floats(allow_nan=False, allow_infinity=False))
    metadata = draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
    return Manifest(
        save_id="s", created="2026-01-01T00:00:00.000Z", entries=entries,
        files={name: end + draw(st.integers(0, 10)) for name, end in zip(names, ends,
                                                                          strict=True)},
        tree=tree, metadata=metadata, library_version="x", torch_version=None,
        world_size=draw(st.integers(1, 8)), checksum=draw(st.sampled_from(["crc32c", "crc32"])),
        block_bytes=block,
    )


@settings(max_examples=150, deadline=None)
@given(manifests())
def test_round_trip_hypothesis(manifest: Manifest) -> None:
    assert decode(encode(manifest), URL) == manifest


# -- validation ----------------------------------------------------------------------------------

Edit = Callable[[dict[str, Any]], None]


def _corrupt(edit: Edit) -> bytes:
    doc = json.loads(encode(_manifest()))
    edit(doc)
    return sealed(doc)


def _set(*keys: Any, value: Any) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return edit


def _delete(*keys: Any) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]

    return edit


def test_not_json_names_the_document() -> None:
    for data in (b"{not json", b"\xff\xfe", b""):
        with pytest.raises(CorruptCheckpoint, match=r"document: not valid JSON") as excinfo:
            decode(data, URL)
        assert excinfo.value.url == URL
        assert f"{URL}/manifest.json" in str(excinfo.value)


@pytest.mark.parametrize("doc", [b"[]", b'"x"', b'{"format": "safetensors"}', b"{}"])
def test_wrong_format_tag(doc: bytes) -> None:
    with pytest.raises(CorruptCheckpoint, match=r"format: not a safepoint manifest"):
        decode(doc, URL)


def test_newer_version_is_refused() -> None:
    data = _corrupt(_set("version", value=FORMAT_VERSION + 1))
    with pytest.raises(FormatVersionError, match=f"version {FORMAT_VERSION + 1}") as excinfo:
        decode(data, URL)
    assert "upgrade safepoint" in str(excinfo.value)
    assert not isinstance(excinfo.value, CorruptCheckpoint)


@pytest.mark.parametrize("name", [
    "../escape.bin",
    "data/../../escape.bin",
    "data/../manifest.json",
    "/etc/passwd",
    "/data/x.bin",
    "other/x.bin",
    "data",
    "data/",
    "data//x.bin",
    "data/./x.bin",
    "data\\..\\x.bin",
    "data/x.bin\0",
    "",
])
def test_file_name_outside_data_dir(name: str) -> None:
    data = _corrupt(_set("files", 0, "name", value=name))
    with pytest.raises(CorruptCheckpoint, match=r"files\[0\]\.name") as excinfo:
        decode(data, URL)
    assert excinfo.value.problems


CASES = [
    pytest.param(_set("version", value="1"), r"manifest\.version: expected int", id="version-str"),
    pytest.param(_set("version", value=True), r"manifest\.version: expected int",
                 id="version-bool"),
    pytest.param(_delete("checksum"), r"manifest: missing field 'checksum'", id="no-checksum"),
    pytest.param(_set("checksum", "block_bytes", value=0), r"checksum\.block_bytes",
                 id="zero-block"),
    pytest.param(_set("checksum", "block_bytes", value=-4), r"checksum\.block_bytes: negative",
                 id="negative-block"),
    pytest.param(_set("files", value={}), r"files: expected a list", id="files-not-list"),
    pytest.param(_set("files", 0, "nbytes", value=-1), r"files\[0\]\.nbytes: negative",
                 id="negative-file-size"),
    pytest.param(lambda d: d["files"].append(dict(d["files"][0])), r"files\[1\]: .* twice",
                 id="file-twice"),
    pytest.param(_delete("chunks"), r"manifest: missing field 'chunks'", id="no-chunks"),
    pytest.param(_delete("entries", "dtype"), r"entries: missing field 'dtype'",
                 id="no-dtype-column"),
    pytest.param(lambda d: d["entries"]["kind"].pop(), r"entries: its columns differ",
                 id="ragged-entries"),
    pytest.param(lambda d: d["chunks"]["offset"].pop(), r"chunks: its columns differ",
                 id="ragged-chunks"),
    pytest.param(_set("chunks", "offset", 0, value=250), r"chunks\[0\]: bytes 250\.\.274 lie "
                 r"beyond the end of data/abc-r00000-0000\.bin \(259 bytes\)", id="beyond-end"),
    pytest.param(_set("files", 0, "nbytes", value=258), r"chunks\[4\]: .*beyond the end",
                 id="file-too-short"),
    pytest.param(_set("chunks", "offset", 0, value=-1), r"chunks\[0\]: offset and nbytes",
                 id="negative-offset"),
    pytest.param(_set("chunks", "digests", 0, value=[1]), r"chunks\[0\]: expected 2 digests",
                 id="too-few-digests"),
    pytest.param(_set("chunks", "digests", 2, value=[4, 5]), r"chunks\[2\]: expected 1 digests",
                 id="too-many-digests"),
    pytest.param(_set("chunks", "digests", 0, value=[1, -2]), r"chunks\[0\]: expected 2",
                 id="negative-digest"),
    pytest.param(_set("chunks", "entry", 0, value=99), r"chunks\[0\]: entry index 99",
                 id="chunk-entry-out-of-range"),
    pytest.param(_set("chunks", "file", 1, value=1), r"chunks\[1\]: file index 1",
                 id="chunk-file-out-of-range"),
    pytest.param(_set("entries", "dtype", 0, value=["F32"]),
                 r"entries\[0\]: dtype \['F32'\] is not a string", id="dtype-not-str"),
    pytest.param(_set("entries", "kind", 0, value=None),
                 r"entries\[0\]: kind None is not a string", id="kind-not-str"),
    pytest.param(_set("entries", "shape", 0, value=[2, -3]), r"entries\[0\]: shape",
                 id="negative-shape"),
    pytest.param(_set("entries", "shape", 0, value=[3, 3]),
                 r"entries\[0\]: chunks hold 24 bytes, F32\[3, 3\] needs 36", id="size-mismatch"),
    pytest.param(_set("entries", "path", 1, value="model/w"), r"entries\[1\]: path .* repeated",
                 id="repeated-path"),
    pytest.param(_set("chunks", "entry", 4, value=6), r"entries\[6\]: a value entry has chunks",
                 id="value-with-chunks"),
    pytest.param(_set("entries", "value", 6, value={"float": "big"}),
                 r"entries\[6\]: not a non-finite float", id="bad-float"),
    pytest.param(_set("entries", "value", 6, value={"float": "nan", "bits": "7ff0000000000000"}),
                 r"entries\[6\]: not a non-finite float", id="bits-of-a-number"),
    pytest.param(_set("entries", "value", 6, value={"float": "inf", "bits": "fff8000000000000"}),
                 r"entries\[6\]: not a non-finite float", id="bits-of-inf"),
    pytest.param(_set("entries", "value", 6, value={"float": "nan", "bits": "FFF8"}),
                 r"entries\[6\]: not a non-finite float", id="bits-malformed"),
    pytest.param(_set("entries", "value", 6, value={"float": "nan", "scale": 10}),
                 r"entries\[6\]: not a non-finite float", id="float-with-another-key"),
    pytest.param(_set("entries", "value", 6, value={"float": "inf", "bits": None}),
                 r"entries\[6\]: not a non-finite float", id="float-with-null-bits"),
    pytest.param(_set("entries", "value", 6,
                      value={"float": "nan", "bits": "fff8000000000000", "sign": 1}),
                 r"entries\[6\]: not a non-finite float", id="bits-with-another-key"),
    pytest.param(_set("created", value="2025-13-45T99:00:00.000Z"),
                 r"created: not an ISO 8601 time", id="created-impossible-date"),
    pytest.param(_set("created", value="yesterday"), r"created: not an ISO 8601 time",
                 id="created-not-a-time"),
    pytest.param(_set("entries", "attrs", 0, value={"strides": [1, 1]}),
                 r"entries\[0\]: attrs\.strides \[1, 1\] are no dense layout",
                 id="strides-overlapping"),
    pytest.param(_set("entries", "attrs", 0, value={"strides": [4, 1]}),
                 r"entries\[0\]: attrs\.strides", id="strides-with-gaps"),
    pytest.param(_set("entries", "attrs", 0, value={"strides": [3]}),
                 r"entries\[0\]: attrs\.strides", id="strides-too-few"),
    pytest.param(_set("entries", "attrs", 0, value={"strides": [-3, 1]}),
                 r"entries\[0\]: attrs\.strides", id="strides-negative"),
    pytest.param(_set("entries", "attrs", 0, value={"strides": [3, True]}),
                 r"entries\[0\]: attrs\.strides", id="strides-bool"),
    pytest.param(_set("entries", "attrs", 0, value={"strides": "3,1"}),
                 r"entries\[0\]: attrs\.strides", id="strides-not-a-list"),
    pytest.param(_set("entries", "attrs", 5, value={"strides": [1, 1]}),
                 r"entries\[5\]: attrs\.strides", id="strides-of-an-empty-tensor"),
    pytest.param(_set("tree", "dict", 0, 0, value=1.5), r"tree: malformed dict item",
                 id="tree-bad-key"),
    pytest.param(_set("tree", value={"set": []}), r"tree: malformed node", id="tree-bad-tag"),
    pytest.param(_set("tree", "dict", 1, 1, value="model/w"), r"tree: its leaves do not match",
                 id="tree-duplicate-leaf"),
    pytest.param(lambda d: d["tree"]["dict"].pop(), r"tree: its leaves do not match",
                 id="tree-missing-leaf"),
    pytest.param(_set("tree", "dict", 1, 1, value="nope"), r"tree: its leaves do not match",
                 id="tree-unknown-leaf"),
    pytest.param(_delete("save_id"), r"manifest: missing field 'save_id'", id="no-save-id"),
    pytest.param(_set("world_size", value=-1), r"manifest\.world_size: negative",
                 id="negative-world"),
]


@pytest.mark.parametrize(("edit", "where"), CASES)
def test_validation_names_the_field(edit: Edit, where: str) -> None:
    data = _corrupt(edit)
    with pytest.raises(CorruptCheckpoint, match=where) as excinfo:
        decode(data, URL)
    message = str(excinfo.value)
    assert message.startswith(f"{URL}/manifest.json: ")
    assert "restore an earlier one" in message
    assert excinfo.value.problems == [message]


@pytest.mark.parametrize(("edit", "where"), [
    pytest.param(_set("entries", "dtype", 0, value="F33"), r"entries\[0\]: unknown dtype 'F33'",
                 id="dtype"),
    pytest.param(_set("entries", "dtype", 2, value="F6_E3M2"),
                 r"entries\[2\]: unknown dtype 'F6_E3M2'", id="dtype-of-an-array"),
    pytest.param(_set("entries", "kind", 0, value="quantized"),
                 r"entries\[0\]: unknown kind 'quantized'", id="kind"),
    pytest.param(_set("checksum", "algorithm", value="xxh64"),
                 r"unknown checksum algorithm 'xxh64'", id="checksum-algorithm"),
    pytest.param(_set("checksum", "manifest", value="sha3"),
                 r"checksum\.manifest: unknown algorithm 'sha3'", id="seal-algorithm"),
])
def test_a_name_a_newer_safepoint_wrote_is_a_format_version_error(edit: Edit, where: str) -> None:
    """A kind, dtype or checksum algorithm added after this safepoint means the checkpoint is
    newer, not damaged: a manager must refuse it rather than restore an older step instead."""
    with pytest.raises(FormatVersionError, match=where) as excinfo:
        decode(_corrupt(edit), URL)
    assert URL in str(excinfo.value) and excinfo.value.url == URL
    assert "upgrade safepoint" in str(excinfo.value)
    assert not isinstance(excinfo.value, CorruptCheckpoint)


@pytest.mark.parametrize("edit", [
    pytest.param(_set("checksum", "algorithm", value="xxh64"), id="checksum-algorithm"),
    pytest.param(_set("entries", "dtype", 0, value="F6_E3M2"), id="dtype"),
    pytest.param(_set("entries", "kind", 0, value="quantized"), id="kind"),
])
def test_restore_never_falls_back_past_a_step_a_newer_safepoint_wrote(
    tmp_path: Path, edit: Edit
) -> None:
    """Restoring the step before it would silently lose the newer step's training (which the
    next saves then replace): the manager raises FormatVersionError and restores nothing."""
    root = tmp_path / "run"
    with sp.CheckpointManager(root, async_save=False, keep_last=None) as mgr:
        mgr.save(1, {"w": np.full(3, 1.0), "n": 1})
        mgr.save(2, {"w": np.full(3, 2.0), "n": 2})
    edit_manifest(root / "step-2", edit)
    state = {"w": np.zeros(3), "n": 0}
    with sp.CheckpointManager(root) as mgr, pytest.raises(
        FormatVersionError, match="upgrade safepoint"
    ) as excinfo:
        mgr.restore(state)
    assert str(root / "step-2") in str(excinfo.value)
    assert state["n"] == 0 and not state["w"].any()


@pytest.mark.parametrize(("before", "after"), [
    pytest.param(b'"version":1,', b'"version":9,', id="version"),
    pytest.param(b'"manifest":"crc32c"', b'"manifest":"crc32b"', id="seal-algorithm"),
    pytest.param(b'"algorithm":"crc32c"', b'"algorithm":"crc32b"', id="checksum-algorithm"),
])
def test_a_flipped_bit_that_names_a_newer_version_or_algorithm_is_damage(
    tmp_path: Path, before: bytes, after: bytes
) -> None:
    """One bit flipped in a sealed manifest ('1' -> '9', 'c' -> 'b') read as written by a
    newer safepoint ("upgrade safepoint"), and a manager's restore stopped there instead of
    falling back: the seal is checked before the version and the algorithms are judged."""
    root = tmp_path / "run"
    with sp.CheckpointManager(root, async_save=False, keep_last=None) as mgr:
        mgr.save(1, {"w": np.full(3, 1.0), "n": 1})
        mgr.save(2, {"w": np.full(3, 2.0), "n": 2})
    path = root / "step-2" / "manifest.json"
    data = path.read_bytes()
    assert data.count(before) == 1
    path.write_bytes(data.replace(before, after))
    with pytest.raises(CorruptCheckpoint, match="manifest_checksum: the manifest's bytes do not "
                       "match it"):
        sp.load(str(root / "step-2"))
    state = {"w": np.zeros(3), "n": 0}
    with sp.CheckpointManager(root) as mgr, pytest.warns(UserWarning, match="trying step 1"):
        assert mgr.restore(state) == 1
    assert state["n"] == 1


def _both(*edits: Edit) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        for one in edits:
            one(doc)

    return edit


@pytest.mark.parametrize(("edit", "where"), [
    pytest.param(_both(_set("entries", "kind", 1, value=1),
                       _set("entries", "shape", 5, value=[1, 5])),
                 r"entries\[1\]: kind 1 is not a string", id="other-row-before-plain-tensor"),
    pytest.param(_both(_set("entries", "shape", 0, value=[3, 3]),
                       _set("entries", "value", 6, value={"float": "big"})),
                 r"entries\[0\]: chunks hold 24 bytes", id="plain-tensor-before-other-row"),
    pytest.param(_both(_set("entries", "path", 7, value="model/w"),
                       _set("entries", "shape", 5, value=[1, 5])),
                 r"entries\[5\]: chunks hold 0 bytes", id="plain-tensor-before-repeated-path"),
    pytest.param(_set("entries", "dtype", 5, value=7), r"entries\[5\]: dtype 7 is not a string",
                 id="plain-tensor-dtype-not-str"),
])
def test_the_first_offending_row_is_named(edit: Edit, where: str) -> None:
    """Plain tensors are checked a column at a time and the other rows one by one; with
    problems in both, the error still names the first offending row."""
    with pytest.raises(CorruptCheckpoint, match=where):
        decode(_corrupt(edit), URL)


@given(st.integers(0, 1 << 22),
       st.lists(st.integers(0, 3 << 20) | st.integers(0, 200), max_size=40))
def test_entries_placed_at_once_start_where_placed_one_at_a_time(start: int,
                                                                 sizes: list[int]) -> None:
    """`placed` (a running sum when every entry is small) agrees with `aligned` entry by
    entry: 64-byte starts for small entries, 4 KiB for those of 1 MiB or more."""
    expected, end = [], start
    for nbytes in sizes:
        end = aligned(end, nbytes)
        expected.append(end)
        end += nbytes
    assert placed(start, sizes) == expected
    assert all(at % (4096 if n >= 1 << 20 else 64) == 0
               for at, n in zip(expected, sizes, strict=True))


def test_the_json_is_orjson_s_and_json_s_where_orjson_refuses() -> None:
    """orjson writes the manifest (ten times faster); an int beyond 64 bits, which it refuses,
    is written by json instead, and both read back the same."""
    doc = {"a": [1, -2.5, "é ✓", None, True], "b": {"c": (3, 4)}}
    assert _json(doc) == orjson.dumps(doc)
    assert json.loads(_json(doc)) == {"a": [1, -2.5, "é ✓", None, True], "b": {"c": [3, 4]}}
    big = {"v": [-(2**100) - 1, 2**64]}
    assert json.loads(_json(big)) == big


def test_column_built_records_equal_constructed_ones() -> None:
    """`records` sets the slots of frozen records a column at a time; what it makes is what the
    constructor makes (equal, same hash, still frozen)."""
    chunks = [Chunk(FILE, 0, 24, (1, 2)), Chunk(FILE, 64, 8, (3,), ((0,), (2,)))]
    made = records(Chunk, 2, *zip(*[(c.file, c.offset, c.nbytes, c.digests, c.box) for c in chunks],
                                strict=True))
    assert made == chunks and list(map(hash, made)) == list(map(hash, chunks))
    entry = Entry("tensor", "F32", (2, 3), (chunks[0],), None, "cpu", False, None)
    (built,) = records(Entry, 1, ["tensor"], ["F32"], [(2, 3)], [(chunks[0],)], [None], ["cpu"],
                     [False], [None], [False])
    assert built == entry and built.nbytes == 24
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.kind = "ndarray"  # type: ignore[misc]


def test_decode_reports_the_data_files_before_the_entries() -> None:
    """A load reads ahead the data files while the entries decode: `on_files` gets the checked
    file list even when an entry turns out to be damaged."""
    seen: list[dict[str, int]] = []
    assert decode(encode(_manifest()), URL, seen.append).files == {FILE: 259}
    assert seen == [{FILE: 259}]
    with pytest.raises(CorruptCheckpoint, match=r"entries\[0\]"):
        decode(_corrupt(_set("entries", "shape", 0, value=[3, 3])), URL, seen.append)
    assert seen == [{FILE: 259}] * 2


def test_decode_reports_the_data_files_it_writes_before_parsing_the_document() -> None:
    """Found in the bytes as safepoint writes them, before the JSON is parsed (a hint: the
    manifest is still refused when damaged); written another way (indented here), once
    the file list is checked."""
    written = encode(_manifest())
    seen: list[dict[str, int]] = []
    with pytest.raises(CorruptCheckpoint, match="not valid JSON"):
        decode(written[: written.index(b'"entries"') + 12], URL, seen.append)
    assert seen == [{FILE: 259}]
    doc = json.loads(written)
    del doc["manifest_checksum"], doc["checksum"]["manifest"]  # unsealed: other writers'
    indented = json.dumps(doc, indent=1).encode()
    with pytest.raises(CorruptCheckpoint, match="not valid JSON"):
        decode(indented[: indented.index(b'"entries"') + 12], URL, seen.append)
    assert seen == [{FILE: 259}]
    decode(indented, URL, seen.append)
    assert seen == [{FILE: 259}] * 2


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.floats(allow_nan=False)
    | st.text(max_size=4) | st.sampled_from(["F32", "BF16", "tensor", "sharded", "value", "alias",
                                             "bytes", "nan", FILE]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=2),
    max_leaves=4,
)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_cell_of_the_tables_decodes_or_is_reported(data: st.DataObject) -> None:
    """The entry and chunk tables are checked a column at a time, then row by row only to name
    the culprit: whatever JSON replaces one or two cells, the manifest decodes or raises
    CorruptCheckpoint, or FormatVersionError for a kind or dtype it does not know (never a
    TypeError or ValueError from a check that assumed a type)."""
    doc = json.loads(encode(_sharded() if data.draw(st.booleans()) else _manifest()))
    for _ in range(data.draw(st.integers(1, 2))):
        table = data.draw(st.sampled_from(["entries", "chunks"]))
        column = data.draw(st.sampled_from(sorted(doc[table])))
        row = data.draw(st.integers(0, len(doc[table][column]) - 1))
        doc[table][column][row] = data.draw(_JSON)
    try:
        decode(sealed(doc), URL)
    except (CorruptCheckpoint, FormatVersionError) as exc:
        assert str(exc).startswith(f"{URL}/manifest.json: ")


def test_unknown_additive_fields_are_ignored() -> None:
    """A newer writer of the same major version may add fields; this reader ignores them."""
    def edit(doc: dict[str, Any]) -> None:
        doc["future"] = {"x": 1}
        doc["entries"]["extra_column"] = [0] * 12

    assert decode(_corrupt(edit), URL) == _manifest()


# -- sharded entries and per-rank nodes ----------------------------------------------------------

F0, F1 = data_file_name("abc", 0, 0), data_file_name("abc", 1, 0)


def _sharded(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None) -> Manifest:
    """A (4, 3) F32 tensor in two pieces written by two ranks, and per-rank values."""
    boxes = boxes or [((0, 0), (1, 3)), ((1, 0), (3, 3))]
    chunks = tuple(
        Chunk((F0, F1)[n], 0, 4 * math.prod(size),
              tuple(range(-(-4 * math.prod(size) // BLOCK))), (offsets, size))
        for n, (offsets, size) in enumerate(boxes)
    )
    entries = {
        "emb": Entry("sharded", "F32", (4, 3), chunks),
        "rng/0/seed": Entry("value", value=1),
        "rng/1/seed": Entry("value", value=2),
    }
    tree = {"dict": [["emb", "emb"], ["rng", {"per_rank": [
        [0, {"dict": [["seed", "rng/0/seed"]]}], [1, {"dict": [["seed", "rng/1/seed"]]}],
    ]}]]}
    return Manifest("abc", "2026-01-01T00:00:00.000Z", entries, {F0: 64, F1: 64}, tree,
                    world_size=2, block_bytes=BLOCK)


def test_sharded_entries_and_per_rank_nodes_round_trip() -> None:
    manifest = _sharded()
    doc = json.loads(encode(manifest))
    assert doc["version"] == 1
    assert doc["chunks"]["offsets"] == [[0, 0], [1, 0]]
    assert doc["chunks"]["shape"] == [[1, 3], [3, 3]]
    assert decode(encode(manifest), URL) == manifest


def test_unsharded_manifests_have_no_box_columns() -> None:
    assert "offsets" not in json.loads(encode(_manifest()))["chunks"]


@pytest.mark.parametrize(("boxes", "where"), [
    ([((0, 0), (1, 3)), ((2, 0), (3, 3))], r"outside the global shape"),
    ([((0, 0), (2, 3)), ((1, 0), (3, 3))], r"piece 1 holds 36 bytes|pieces 0 and 1 overlap"),
    ([((0, 0), (1, 3)), ((0, 0), (3, 3))], r"pieces 0 and 1 overlap"),
    ([((0, 0), (1, 3)), ((1,), (3,))], r"outside the global shape"),
], ids=["outside", "overlap-wrong-size", "overlap", "wrong-rank"])
def test_sharded_pieces_are_validated(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], where: str
) -> None:
    with pytest.raises(CorruptCheckpoint, match=where):
        decode(encode(_sharded(boxes)), URL)


def test_sharded_piece_bytes_must_match_its_box() -> None:
    doc = json.loads(encode(_sharded()))
    doc["chunks"]["shape"][0] = [1, 2]
    with pytest.raises(CorruptCheckpoint, match=r"piece 0 holds 12 bytes, its box \[1, 2\]"):
        decode(sealed(doc), URL)


def test_boxes_only_on_sharded_entries() -> None:
    doc = json.loads(encode(_sharded()))
    doc["entries"]["kind"][0] = "tensor"
    with pytest.raises(CorruptCheckpoint, match=r"a tensor entry has chunks with boxes"):
        decode(sealed(doc), URL)
    doc = json.loads(encode(_sharded()))
    doc["chunks"]["offsets"][1] = None
    doc["chunks"]["shape"][1] = None
    with pytest.raises(CorruptCheckpoint, match=r"piece 1 of a sharded entry has no box"):
        decode(sealed(doc), URL)


def test_malformed_per_rank_node() -> None:
    doc = json.loads(encode(_sharded()))
    doc["tree"]["dict"][1][1]["per_rank"][0][0] = "zero"
    with pytest.raises(CorruptCheckpoint, match=r"malformed per_rank item"):
        decode(sealed(doc), URL)


def test_an_entry_in_several_chunks_needs_version_2() -> None:
    """Readers of version 1 took each chunk of a plain entry for the whole entry, so a
    manifest with such an entry (an incremental save's) is version 2; any other stays 1, and
    this reader reads both."""
    manifest = _manifest()
    assert version_for(manifest.entries) == 1
    split = Entry("tensor", "F32", (2, 3), (Chunk(FILE, 0, 16, (1,)), Chunk(FILE, 64, 8, (2,))))
    entries = {**manifest.entries, "model/w": split}
    assert version_for(entries) == 2
    doc = encode(dataclasses.replace(manifest, entries=entries, version=2))
    read = decode(doc, URL)
    assert read.version == 2 and read.entries["model/w"].chunks == split.chunks
    assert version_for(_sharded().entries) == 1


def _in_chunks(*pieces: tuple[Box, list[int]]) -> Manifest:
    """`_sharded()` with its entry stored as `pieces`: each a box and the byte counts of the
    consecutive chunks holding it, the chunks alternating between the two files."""
    chunks: list[Chunk] = []
    for box, sizes in pieces:
        for nbytes in sizes:
            chunks.append(Chunk((F0, F1)[len(chunks) % 2], 0, nbytes,
                                tuple(range(-(-nbytes // BLOCK))), box))
    base = _sharded()
    return dataclasses.replace(
        base, entries={**base.entries, "emb": Entry("sharded", "F32", (4, 3), tuple(chunks))}
    )


TOP, REST = ((0, 0), (1, 3)), ((1, 0), (3, 3))  # the pieces of `_sharded()`: 12 and 36 bytes


def test_a_piece_in_several_chunks_needs_version_3() -> None:
    """A piece stored as consecutive chunks with its box (an incremental save in a process
    group) makes the manifest version 3, which this reader reads back as it was written;
    pieces of one chunk each stay version 1, an unsharded entry in chunks 2."""
    manifest = dataclasses.replace(_in_chunks((TOP, [12]), (REST, [16, 16, 4])), version=3)
    assert version_for(manifest.entries) == 3
    split = Entry("tensor", "F32", (2, 3), (Chunk(F0, 0, 16, (1,)), Chunk(F1, 0, 8, (2,))))
    assert version_for({**manifest.entries, "w": split}) == 3
    assert version_for({**_sharded().entries, "w": split}) == 2
    assert version_for(_in_chunks((TOP, [12]), (REST, [36])).entries) == 1
    read = decode(encode(manifest), URL)
    assert read == manifest
    assert [c.box for c in read.entries["emb"].chunks] == [TOP, REST, REST, REST]


def test_a_piece_in_several_chunks_must_hold_its_box_bytes() -> None:
    with pytest.raises(CorruptCheckpoint,
                       match=r"entries\[0\]: piece 1 holds 32 bytes, its box \[3, 3\] needs 36"):
        decode(encode(_in_chunks((TOP, [12]), (REST, [16, 16]))), URL)


def test_a_box_met_again_after_another_is_an_overlapping_piece() -> None:
    """Only consecutive chunks with one box are one piece: the same box further down the
    table is a second piece over the same elements."""
    with pytest.raises(CorruptCheckpoint, match=r"entries\[0\]: pieces 0 and 2 overlap"):
        decode(encode(_in_chunks((TOP, [12]), (REST, [36]), (TOP, [12]))), URL)



def test_block_hashes_round_trip_and_are_checked() -> None:
    """An incremental save's block hashes (one list per entry row, null for entries without
    bytes) round-trip; hashes of an unknown algorithm are ignored, and a manifest without
    them has none."""
    manifest = _manifest()
    assert "hashes" not in json.loads(encode(manifest))
    hashes = {"model/w": ("a" * 32,), "blob": ("b" * 32, "c" * 32), "empty": ()}
    doc = json.loads(encode(dataclasses.replace(manifest, hashes=hashes)))
    assert doc["hashes"]["algorithm"] == "xxh3-128"
    assert decode(sealed(doc), URL).hashes == hashes
    doc["hashes"]["algorithm"] = "sha-999"
    assert decode(sealed(doc), URL).hashes == {}


@pytest.mark.parametrize("bad", [
    None, {}, [], "xxh3-128", {"algorithm": "xxh3-128"}, {"blocks": []},
    {"algorithm": 7, "blocks": [None] * 12}, {"algorithm": "xxh3-128", "blocks": [None]},
    {"algorithm": "xxh3-128", "blocks": [[1]] * 12}, {"algorithm": "xxh3-128", "blocks": None},
])
def test_a_malformed_hashes_field_is_ignored_with_a_warning(
    bad: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """`hashes` is optional and readers may ignore it: one spelled null (as JSON serialisers
    write an unset optional) or otherwise malformed made the whole checkpoint unloadable.
    It is read as absent (the next incremental save shares nothing), and a warning names
    the checkpoint."""
    doc = json.loads(encode(dataclasses.replace(_manifest(), hashes={"model/w": ("a" * 32,)})))
    doc["hashes"] = bad
    with caplog.at_level("WARNING", logger="safepoint._format"):
        assert decode(sealed(doc), URL) == _manifest()
    assert f"{URL}/manifest.json: its optional field hashes is malformed" in caplog.text


def test_value_objects_are_exactly_the_documented_ones() -> None:
    """{"float": "nan", "scale": 10} was read as NaN; the format allows exactly {"float":
    "nan"|"inf"|"-inf"} and {"float": "nan", "bits": ...}, so anything else is refused (the
    cases are in CASES), and these four decode."""
    values = [{"float": "nan"}, {"float": "inf"}, {"float": "-inf"},
              {"float": "nan", "bits": "fff8000000000000"}]
    doc = json.loads(encode(_manifest()))
    doc["entries"]["value"][6:10] = values
    decoded = decode(sealed(doc), URL)
    got = [decoded.entries[path].value for path in ("step", "name", "flag", "none")]
    assert [_bits(value) for value in got] == [
        _bits(float("nan")), _bits(math.inf), _bits(-math.inf),
        _bits(float("inf") - float("inf"))]


@pytest.mark.parametrize("created", ["2025-01-31T12:00:00.123Z", "2025-01-31T12:00:00+02:00",
                                     "2025-01-31T12:00:00", "2025-01-31"])
def test_a_commit_time_in_iso_8601_is_read(created: str) -> None:
    """`created` is checked to be an ISO 8601 time a manager can order steps by (an
    impossible one is refused, see CASES: it passed verify and then stopped retention)."""
    assert decode(encode(_manifest(created=created)), URL).created == created


@pytest.mark.parametrize("where", ["value", "metadata"])
def test_an_int_readers_cannot_parse_is_refused_whatever_the_process_allows(where: str) -> None:
    """The cap on an int's digits was the writing process's: one that lifted it
    (sys.set_int_max_str_digits(0)) wrote a manifest that every process with Python's default
    refused as damaged. The format's own cap, 4300 digits, is enforced instead, by path."""
    big = 10**4300
    fits = {"step": Entry("value", value=big - 1), "down": Entry("value", value=1 - big)}
    tree = {"dict": [["step", "step"], ["down", "down"]]}
    manifest = _manifest(entries=fits, files={}, tree=tree, metadata={"n": [1 - big]})
    assert decode(encode(manifest), URL) == manifest
    if where == "value":
        manifest = _manifest(entries=fits | {"down": Entry("value", value=-big)}, files={},
                             tree=tree)
    else:
        manifest = _manifest(entries=fits, files={}, tree=tree, metadata={"n": [{"m": big}]})
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(UnsupportedLeaf, match="more than 4300 digits") as excinfo:
            encode(manifest)
    finally:
        sys.set_int_max_str_digits(limit)
    assert excinfo.value.path == ("down" if where == "value" else "<metadata>")
