"""Incremental saves (`safepoint._incremental`): which blocks are written, which are shared
and where the chunks of each entry then lie, on saves written the way the manager writes
them (`prepare_save` + `write_and_commit` with an `Increment`)."""

from __future__ import annotations

import os
import shutil
import threading
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import safepoint as sp
from safepoint._api import prepare_save, write_and_commit
from safepoint._commit import read_manifest
from safepoint._format import BLOCK_BYTES, Chunk, Entry, Manifest
from safepoint._incremental import Increment, Lineage, _shareable
from safepoint._leaves import SHARDED
from safepoint._plan import WriteItem
from safepoint._snapshot import MIN_STAGING_BYTES, Stager
from safepoint.storage import _REGISTERED, open_storage
from safepoint.testing import FaultyStorage, MemoryBackend, fail_nth

BLOCK = BLOCK_BYTES
ITEMS = BLOCK // 4  # float32 elements in a block


def _save(url: str, state: dict[str, Any], previous: Lineage | None,
          stager: Stager | None = None) -> Increment:
    """Save `state` at `url` against `previous`, from its own memory or through `stager`."""
    with prepare_save(url, state) as prepared:
        increment = Increment(previous)
        if stager is None:
            write_and_commit(prepared, prepared.host_data(), increment)
        else:
            snapshot = stager.snapshot(prepared.leaves, prepared.kinds)
            assert snapshot.streaming  # pieces of entries, not whole ones
            writer = threading.Thread(target=write_and_commit,
                                      args=(prepared, snapshot, increment))
            writer.start()
            snapshot.stage()
            writer.join()
    assert increment.next is not None
    return increment


def _manifest(url: str) -> Manifest:
    storage = open_storage(url)
    try:
        return read_manifest(storage)
    finally:
        storage.close()


def _own_bytes(url: str) -> int:
    """Bytes of the data file the save at `url` wrote itself."""
    manifest = _manifest(url)
    own = [name for name in manifest.files if manifest.save_id in name]
    return sum(manifest.files[name] for name in own)


def _state(blocks: int = 3) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "frozen": rng.standard_normal(blocks * ITEMS + 1000).astype(np.float32),
        "trained": rng.standard_normal(ITEMS // 2).astype(np.float32),
        "small": rng.standard_normal(10),
        "empty": np.zeros(0, dtype=np.float32),
        "raw": b"header",
        "step": 0,
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
        for k in a
    )


@pytest.mark.parametrize("staged", [False, True], ids=["own-memory", "staged-in-pieces"])
def test_unchanged_blocks_are_shared_not_written(tmp_path: Path, staged: bool) -> None:
    """Only the blocks that changed are written; the rest are read from the first save's
    file, which the second checkpoint holds too (a hard link here), and both load exactly.
    Staged through the smallest budget, the frozen entry arrives in pieces and the result
    is the same."""
    stager = Stager(MIN_STAGING_BYTES) if staged else None
    state = _state(blocks=9 if staged else 3)  # staged: larger than the budget
    first_url, second_url = str(tmp_path / "a"), str(tmp_path / "b")
    first = _save(first_url, state, None, stager)
    assert first.reused == 0
    state["trained"] += 1
    state["step"] = 1
    second = _save(second_url, state, first.next, stager)
    assert second.reused == state["frozen"].nbytes + state["small"].nbytes + len(state["raw"])
    manifest = _manifest(second_url)
    (shared,) = [name for name in manifest.files if manifest.save_id not in name]
    assert os.path.samefile(tmp_path / "a" / shared, tmp_path / "b" / shared)
    assert {c.file for c in manifest.entries["frozen"].chunks} == {shared}
    assert {c.file for c in manifest.entries["trained"].chunks} != {shared}
    assert _own_bytes(second_url) < state["trained"].nbytes + 4096
    assert _equal(sp.load(second_url), state)
    assert sp.verify(first_url).ok and sp.verify(second_url).ok
    assert manifest.version == 1  # whole entries shared or written: one chunk each


def test_a_change_inside_a_large_entry_writes_only_its_block(tmp_path: Path) -> None:
    """A change in the middle block of a 4-block entry writes that block alone: the entry
    becomes three chunks (old, new, old) whose digests join into a full save's."""
    state = _state()
    first = _save(str(tmp_path / "a"), state, None)
    state["frozen"][ITEMS + 5] += 1
    url = str(tmp_path / "b")
    _save(url, state, first.next)
    chunks = _manifest(url).entries["frozen"].chunks
    assert [c.nbytes for c in chunks] == [BLOCK, BLOCK, BLOCK + 4000]
    assert _manifest(url).version == 2  # older readers must refuse it, not misread it
    assert chunks[0].file == chunks[2].file != chunks[1].file
    sp.save(str(tmp_path / "full"), state)
    (whole,) = _manifest(str(tmp_path / "full")).entries["frozen"].chunks
    assert [d for c in chunks for d in c.digests] == list(whole.digests)
    loaded = sp.load(url)
    assert np.array_equal(loaded["frozen"], state["frozen"])
    target = {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    sp.load(url, into=target)
    assert _equal(target, state)


def test_nothing_changed_writes_nothing_but_a_chain_keeps_loading(tmp_path: Path) -> None:
    """Saves of an unchanged state write no data; each one references the first file, and
    deleting the earlier checkpoints leaves the last loadable (its own link survives)."""
    state = _state()
    previous = None
    urls = [str(tmp_path / f"s{n}") for n in range(4)]
    for url in urls:
        previous = _save(url, state, previous).next
    assert _own_bytes(urls[-1]) == 0
    for url in urls[:-1]:
        shutil.rmtree(url)
    assert sp.verify(urls[-1]).ok
    assert _equal(sp.load(urls[-1]), state)


def test_a_frozen_part_smaller_than_a_quarter_is_written_once(tmp_path: Path) -> None:
    """A frozen embedding of a fifth of the state (README: "written once, then linked"): a
    file was shared only while a quarter of it was still referenced, so the second save's
    share of the first file (the embedding alone) fell below, the third save wrote the
    embedding again beside the changed weights, and so on every second save. It now stays
    in the first file, which every later save shares."""
    rng = np.random.default_rng(2)
    state = {"embedding": rng.standard_normal(2 * ITEMS).astype(np.float32),
             "trained": rng.standard_normal(8 * ITEMS).astype(np.float32)}
    first_file = None
    previous = None
    for step in range(4):
        state["trained"] += 1
        url = str(tmp_path / f"s{step}")
        previous = _save(url, state, previous).next
        files = {c.file for c in _manifest(url).entries["embedding"].chunks}
        first_file = first_file or files
        assert files == first_file, f"save {step} wrote the frozen embedding again"
        assert _own_bytes(url) < (9 if step else 11) * BLOCK
    assert _equal(sp.load(url), state)


def test_a_file_that_would_keep_too_many_dead_bytes_is_not_shared_again(
    tmp_path: Path,
) -> None:
    """Shared files keep the old copies of what changed alive: once a file's unreferenced
    bytes exceed three times all the bytes the last commit references (here most of the
    state was dropped), the unchanged entries it holds are written again."""
    rng = np.random.default_rng(1)
    kept = rng.standard_normal(ITEMS // 4).astype(np.float32)
    first = _save(str(tmp_path / "a"), {"kept": kept, "dropped": np.zeros(8 * ITEMS)}, None)
    first_file = _manifest(str(tmp_path / "a")).entries["kept"].chunks[0].file
    state = {"kept": kept, "step": 1}
    second = _save(str(tmp_path / "b"), state, first.next)
    assert _manifest(str(tmp_path / "b")).entries["kept"].chunks[0].file == first_file
    assert second.next is not None and first_file not in second.next.files
    state["step"] = 2
    _save(str(tmp_path / "c"), state, second.next)
    manifest = _manifest(str(tmp_path / "c"))
    assert list(manifest.files) == [next(n for n in manifest.files if manifest.save_id in n)]
    assert _equal(sp.load(str(tmp_path / "c")), state)


def test_shared_files_are_picked_most_referenced_first_within_the_dead_bytes_bound() -> None:
    """The files shared keep at most three times the bytes the commit references unreferenced,
    taking the most referenced files first; a mostly dead file beside them is left out."""
    live = {"a": 100, "b": 10, "c": 5, "d": 0}
    sizes = {"a": 100, "b": 300, "c": 200, "d": 0}
    assert _shareable(sizes, live) == {"a": 100, "b": 300, "d": 0}  # 290 dead of 3 * 115
    # b (490 of 500 dead) now comes after c (195 of 200) and no longer fits
    assert _shareable({**sizes, "b": 500}, live) == {"a": 100, "c": 200, "d": 0}


def test_same_bytes_under_another_path_or_shape_are_written(tmp_path: Path) -> None:
    """Blocks are matched by entry path and index: the same bytes under another name are
    written again, and a reshaped entry with the same bytes shares them."""
    state = _state()
    first = _save(str(tmp_path / "a"), state, None)
    renamed = {"other": state["frozen"], "reshaped": state["trained"].reshape(2, -1)}
    state2 = {**{k: v for k, v in state.items() if k not in ("frozen", "trained")},
              "other": renamed["other"], "trained": renamed["reshaped"]}
    second = _save(str(tmp_path / "b"), state2, first.next)
    assert second.reused == state["trained"].nbytes + state["small"].nbytes + len(state["raw"])
    assert _equal(sp.load(str(tmp_path / "b")), state2)


def test_the_manifest_records_what_the_next_save_needs(tmp_path: Path) -> None:
    """The hashes go into the manifest, so the lineage read back from it is the one the save
    kept in memory (a restarted job shares as the running one did); an entry whose hashes do
    not fit its blocks is left out, and a full save's manifest gives none."""
    state = _state()
    url = str(tmp_path / "a")
    kept = _save(url, state, None).next
    manifest = _manifest(url)
    assert len(manifest.hashes["frozen"]) == 4 and manifest.hashes["empty"] == ()
    assert "step" not in manifest.hashes
    assert Lineage.of(url, manifest) == kept
    damaged = Lineage.of(url, replace(manifest, hashes={**manifest.hashes, "frozen": ("0",)}))
    assert damaged is not None and ("frozen", None, 0) not in damaged.blocks
    assert ("trained", None, 0) in damaged.blocks
    sp.save(str(tmp_path / "full"), state)
    assert Lineage.of("x", _manifest(str(tmp_path / "full"))) is None


def test_a_commit_checksummed_with_another_algorithm_is_not_shared(tmp_path: Path) -> None:
    """docs/format.md allows crc32 digests (a restored step written by another writer). A
    shared chunk keeps its digests, so sharing with such a commit put crc32 digests in a
    crc32c manifest: committed, then failing verify and load though every byte was right.
    Such a commit gives no lineage: the next save writes everything."""
    state = _state()
    url = str(tmp_path / "a")
    _save(url, state, None)
    manifest = _manifest(url)
    data = (tmp_path / "a" / next(iter(manifest.files))).read_bytes()

    def crc32(chunk: Chunk) -> Chunk:
        ends = range(chunk.offset, chunk.offset + chunk.nbytes, BLOCK)
        return replace(chunk, digests=tuple(
            zlib.crc32(data[start : min(start + BLOCK, chunk.offset + chunk.nbytes)])
            for start in ends))

    other = replace(manifest, checksum="crc32", entries={
        path: replace(entry, chunks=tuple(crc32(c) for c in entry.chunks))
        for path, entry in manifest.entries.items()})
    assert Lineage.of(url, other) is None
    assert Lineage.of(url, manifest) is not None


def test_pieces_are_matched_by_box_and_block_index_within_the_piece() -> None:
    """In a collective save the stream's items are pieces (named by `pieces`): a block is
    matched by the entry's path, the piece's box and its index counted from the piece's first
    byte; the lineage read from a manifest whose piece lies in two chunks finds each block."""
    a, b, c = (bytes([n]) * BLOCK for n in (1, 2, 3))
    low, high = ((0,), (2 * BLOCK,)), ((2 * BLOCK,), (2 * BLOCK,))
    hashes = [xxhash.xxh3_128_hexdigest(block) for block in (a, b, c, a)]
    chunks = (Chunk("data/old-0", 0, 2 * BLOCK, (11, 12), low),
              Chunk("data/old-1", 0, BLOCK, (13,), high),
              Chunk("data/old-2", 0, BLOCK, (14,), high))
    manifest = Manifest(
        save_id="0" * 32, created="", entries={"w": Entry(SHARDED, "U8", (4 * BLOCK,), chunks)},
        files={"data/old-0": 2 * BLOCK, "data/old-1": BLOCK, "data/old-2": BLOCK}, tree="w",
        metadata={}, hashes={"w": tuple(hashes)},
    )
    lineage = Lineage.of("old", manifest)
    assert lineage is not None
    assert lineage.blocks["w", high, 1].file == "data/old-2"  # index 1 of the second piece
    increment = Increment(lineage)
    items = [(WriteItem("0", 0, 2 * BLOCK), memoryview(a + c)),  # block 1 changed
             (WriteItem("1", 2 * BLOCK, 2 * BLOCK), memoryview(c + a))]  # unchanged
    written = list(increment.stream(items, "data/new", {"0": ("w", low), "1": ("w", high)}))
    assert [(item.path, item.nbytes) for item, _ in written] == [("0", BLOCK)]
    assert increment.reused == 3 * BLOCK
    got = increment.chunks({"0": [99]})
    assert got["0"] == (Chunk("data/old-0", 0, BLOCK, (11,)), Chunk("data/new", 0, BLOCK, (99,)))
    assert got["1"] == (Chunk("data/old-1", 0, BLOCK, (13,)), Chunk("data/old-2", 0, BLOCK, (14,)))
    assert increment.shared() == {name: manifest.files[name] for name in manifest.files}


def _trained(step: int) -> dict[str, Any]:
    """A frozen block, one that changes up to step 2, one that changes every step."""
    return {"frozen": np.arange(ITEMS, dtype=np.float32),
            "settled": np.full(ITEMS, min(step, 2), dtype=np.float32),
            "trained": np.full(ITEMS, step, dtype=np.float32)}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_whose_second_link_fails_leaves_no_files(
    monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """Step 3 shares two files (step 1's and step 2's) and the second link fails: the save
    fails and removes what it wrote, the file it linked first (a server-side copy on an
    object store) included, not only its own data file."""
    backend = MemoryBackend()

    def factory(url: str, storage_options: dict[str, Any] | None = None) -> Any:
        inner = backend(url, storage_options)
        return FaultyStorage(inner, fail_nth("link", 2)) if url.endswith("step-3") else inner

    monkeypatch.setitem(_REGISTERED, "mem-link", factory)
    with sp.CheckpointManager("mem-link://run", incremental=True, keep_last=None,
                              async_save=async_save) as mgr:
        mgr.save(1, _trained(1))
        mgr.save(2, _trained(2))
        mgr.wait()
        storage = backend("mem-link://run/step-2")
        assert len(read_manifest(storage).files) == 2  # step 3 shares both
        with pytest.raises(sp.StorageError, match="injected"):
            mgr.save(3, _trained(3))
            mgr.wait()
        assert mgr.steps() == [1, 2]
    assert [name for name in backend.files() if "step-3" in name] == []


def test_a_failed_share_keeps_the_names_a_commit_there_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overwriting a checkpoint that already holds a shared file (`link` leaves it as it is):
    when a later link fails, what was linked is removed, but not a file the checkpoint
    committed there references, which still loads."""
    before, after = _trained(1), _trained(2)
    first = _save(str(tmp_path / "a"), before, None)
    second = _save(str(tmp_path / "b"), after, first.next)
    target = str(tmp_path / "c")
    _save(target, before, first.next)  # shares step a's file alone
    (own,) = [name for name in _manifest(str(tmp_path / "b")).files
              if _manifest(str(tmp_path / "b")).save_id in name]
    opened: list[FaultyStorage] = []

    def faulty(url: str, storage_options: dict[str, Any] | None = None) -> FaultyStorage:
        storage = FaultyStorage(open_storage(url.removeprefix("faulty-link://"),
                                             storage_options),
                                lambda op, path, _: op == "link" and path == own)
        opened.append(storage)
        return storage

    monkeypatch.setitem(_REGISTERED, "faulty-link", faulty)
    with prepare_save(f"faulty-link://{target}", after, overwrite=True) as prepared, \
            pytest.raises(sp.StorageError, match="injected"):
        write_and_commit(prepared, prepared.host_data(), Increment(second.next))
    assert opened[0].counts["link"] == 2  # step a's file, already there, then the failure
    assert _equal(sp.load(target), before)
    assert sp.verify(target).ok
    assert not (tmp_path / "c" / own).exists()
