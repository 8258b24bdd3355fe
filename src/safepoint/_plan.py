"""Pure planning (engine layer): where each entry goes in a data file, which byte ranges a load
reads, and how a target state matches a manifest. No I/O here, so all of it is tested directly.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, TypeVar

import numpy as np

from ._format import Box, Chunk, Entry, element_count, intersect, overlapping_pair, placed
from ._leaves import ALIAS, NDARRAY, SHARDED, TENSOR, UNINITIALIZED, VALUE
from ._types import StatePath

__all__ = [
    "Held",
    "Match",
    "Read",
    "Run",
    "Segment",
    "WriteItem",
    "copy_runs",
    "coverage_problem",
    "group_ranges",
    "match_target",
    "meeting",
    "plan_layout",
    "plan_ranged_reads",
    "plan_reads",
    "plan_writers",
    "wrapper_hint",
]


_T = TypeVar("_T")


class WriteItem(NamedTuple):
    """One entry's place in a data file (a named tuple: a save of 20,000 small tensors makes
    one per tensor, and a tuple is made in half the time of a frozen dataclass)."""

    path: StatePath
    offset: int
    nbytes: int


def plan_layout(sizes: Iterable[tuple[StatePath, int]]) -> tuple[list[WriteItem], int]:
    """Pack entries one after another in one file, each aligned (see `_format.placed`), in
    the order given. Returns the items and the file's size."""
    pairs = list(sizes)
    nbytes = [size for _, size in pairs]
    items = list(map(WriteItem, [path for path, _ in pairs], placed(0, nbytes), nbytes))
    return items, items[-1].offset + items[-1].nbytes if items else 0


class Segment(NamedTuple):
    """A run of whole checksum blocks of one chunk, read and verified together (a named
    tuple, not a frozen dataclass: a load of 20,000 small tensors makes one per tensor, and
    a tuple is made in half the time).

    Attributes:
        path: the entry it belongs to.
        chunk: the chunk.
        start: byte offset inside the chunk (a multiple of the block size).
        nbytes: bytes in the run.
    """

    path: StatePath
    chunk: Chunk
    start: int
    nbytes: int

    @property
    def file_offset(self) -> int:
        """Where the run starts in its data file."""
        return self.chunk.offset + self.start


@dataclass(frozen=True, slots=True)
class Read:
    """One ranged read of a data file covering several segments in file order; the bytes
    between segments (alignment padding, entries not wanted) are read and dropped."""

    file: str
    offset: int
    end: int
    segments: tuple[Segment, ...]


def plan_reads(
    wanted: Iterable[tuple[StatePath, Chunk]],
    *,
    block_bytes: int,
    max_read_bytes: int,
    max_gap: int,
) -> list[Read]:
    """Cover every wanted chunk with reads of at most about `max_read_bytes`: large chunks split
    on block boundaries so threads share them, small ones coalesced while the gap between them
    stays under `max_gap`."""
    return plan_ranged_reads(
        ((path, chunk, 0, chunk.nbytes) for path, chunk in wanted),
        block_bytes=block_bytes, max_read_bytes=max_read_bytes, max_gap=max_gap,
    )


def plan_ranged_reads(
    wanted: Iterable[tuple[StatePath, Chunk, int, int]],
    *,
    block_bytes: int,
    max_read_bytes: int,
    max_gap: int,
) -> list[Read]:
    """As `plan_reads`, for byte ranges `[start, end)` of chunks: each range is widened to the
    checksum blocks it touches, since a block is verified whole."""
    step = max(block_bytes, max_read_bytes // block_bytes * block_bytes)
    placed: list[tuple[str, int, int, Segment]] = []
    for path, chunk, first, last in wanted:
        first = first // block_bytes * block_bytes
        last = -(-last // block_bytes) * block_bytes
        if last > chunk.nbytes:
            last = chunk.nbytes
        offset = chunk.offset
        if last - first <= step:
            if last > first:
                placed.append((chunk.file, offset + first, offset + last,
                               Segment(path, chunk, first, last - first)))
            continue
        for start in range(first, last, step):
            stop = min(start + step, last)
            placed.append((chunk.file, offset + start, offset + stop,
                           Segment(path, chunk, start, stop - start)))
    return [Read(file, head, end, tuple(segments))
            for file, head, end, segments in group_ranges(placed, max_read_bytes, max_gap)]


def group_ranges(
    placed: list[tuple[str, int, int, _T]], max_read_bytes: int, max_gap: int
) -> list[tuple[str, int, int, list[_T]]]:
    """Byte ranges `(file, start, end, payload)` sorted into file order and joined into reads
    `(file, start, end, payloads)` of at most about `max_read_bytes`, while the gap between
    neighbours stays under `max_gap`. A range that starts before the previous one ended (two
    chunks sharing bytes, which the format allows) starts a read of its own: a read fills
    its destinations one after the other."""
    placed.sort(key=_PLACE)
    reads: list[tuple[str, int, int, list[_T]]] = []
    group: list[_T] = []
    file, head, end = "", 0, 0
    for name, start, stop, payload in placed:
        if group and (name != file or not 0 <= start - end <= max_gap
                      or stop - head > max_read_bytes):
            reads.append((file, head, end, group))
            group = []
        if not group:
            file, head = name, start
        group.append(payload)
        end = stop
    if group:
        reads.append((file, head, end, group))
    return reads


_PLACE = operator.itemgetter(0, 1)


@dataclass(slots=True)
class Match:
    """How a target state lines up with a manifest.

    Attributes:
        load: checkpoint paths to load.
        missing: selected target paths the checkpoint lacks.
        unexpected: selected checkpoint paths the target lacks (outside stateful objects).
        mismatched: paths whose kind, dtype or shape differ, with what differs (a
            container on one side and a leaf on the other too, by the leaf's path).
        fresh: paths of `load` under a replaced key whose target leaf differs, or whose
            target tensor is not materialized yet: they load as new values, which replace
            the target's.
        kept: selected target paths the checkpoint lacks under optional paths, which keep
            their live values (not missing).
        retyped: paths of `load` whose saved tensor meets a target ndarray, or saved ndarray
            a target tensor, of the same dtype and shape (an export turns arrays into
            tensors), with the entry as the target's kind, which the load reads in its stead
            to fill the target in place.
    """

    load: list[StatePath] = field(default_factory=list)
    missing: list[StatePath] = field(default_factory=list)
    unexpected: list[StatePath] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    fresh: list[StatePath] = field(default_factory=list)
    kept: list[StatePath] = field(default_factory=list)
    retyped: dict[StatePath, Entry] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing is missing, unexpected or mismatched."""
        return not (self.missing or self.unexpected or self.mismatched)


def match_target(
    entries: Mapping[StatePath, Entry],
    selected: Iterable[StatePath],
    target: Mapping[StatePath, tuple[str, str | None, tuple[int, ...] | None]],
    target_selected: Iterable[StatePath],
    open_paths: Iterable[StatePath],
    optional_paths: Iterable[StatePath] = (),
    replaced_paths: Iterable[StatePath] = (),
    parameter_groups: Mapping[StatePath, Sequence[Sequence[object]]] | None = None,
) -> Match:
    """Match selected checkpoint entries against a target's leaves, given as path ->
    `(kind, dtype, shape)`.

    A checkpoint path absent from the target is unexpected unless it is or lies under one of
    `open_paths`: a part of a stateful object whose `load_state_dict` takes keys that its
    current `state_dict()` lacks (the state of a fresh optimizer, which has none yet). A
    target path absent from the checkpoint is missing unless it lies under one of
    `optional_paths` (the RNG states of CUDA devices the saving machine did not have, the
    settings a newer torch added to an optimizer or scheduler: `Match.kept`) or is
    or lies under one of `replaced_paths`: open paths whose saved subtree replaces the
    target's (an optimizer's `state`, a module's extra state), where the structure is not
    compared either: a saved leaf whose target leaf differs loads as a new value
    (`Match.fresh`), unless the target leaf is a piece of a global tensor. A saved tensor
    loads as a new value into a target tensor not materialized yet (a lazy module's) of its
    dtype, whatever its shape, for the module's `load_state_dict` to materialize it.

    A path that is a leaf on one side and a container on the other is mismatched, by the
    leaf's path, rather than the leaf missing or unexpected and the container's leaves
    unexpected or missing: both sides hold something there. Under an open path, where the
    checkpoint's side loads, it replaces the target's value whole, which is not missing.

    `parameter_groups` gives the parameter ids in each param group of the target's optimizers,
    by the path of their `param_groups` (`_tree.parameter_groups`): see `_match_groups`.
    """
    match = Match()
    open_paths = list(open_paths)
    prefixes = tuple(p + "/" for p in open_paths if p) + (("",) if "" in open_paths else ())
    opened = frozenset(open_paths)  # an open key that is a leaf itself
    optional_paths = frozenset(optional_paths)  # a leaf itself (RNGState's "torch"), or above
    optional = tuple(p + "/" for p in optional_paths)
    replaced = frozenset(replaced_paths)
    replaced_prefixes = tuple(p + "/" for p in replaced)
    not_missing = optional + replaced_prefixes
    selected = list(selected)
    chosen = set(selected)
    for path in selected:
        entry = entries[path]
        wanted = target.get(path)
        if wanted is None:
            if path in opened or (prefixes and path.startswith(prefixes)):
                match.load.append(path)
            else:
                match.unexpected.append(path)
            continue
        if wanted[0] == entry.kind and wanted[1] == entry.dtype and wanted[2] == entry.shape:
            match.load.append(path)  # the same leaf: the usual case, decided at once
            continue
        problem = _difference(entry, wanted)
        if problem and wanted[0] != SHARDED and (
                path in replaced or path.startswith(replaced_prefixes)):
            match.fresh.append(path)  # a piece of a global tensor is no value to replace
            match.load.append(path)
        elif problem:
            match.mismatched.append(f"{path or '<root>'}: {problem}")
        else:
            if wanted[0] == UNINITIALIZED:
                match.fresh.append(path)
            elif wanted[0] != entry.kind and wanted[0] in _ARRAYS and entry.kind in _ARRAYS:
                match.retyped[path] = replace(entry, kind=wanted[0], scalar=False,
                                              strides=None, big_endian=False)
            match.load.append(path)
    absent = [p for p in target_selected if p not in chosen]
    match.missing = [p for p in absent if not (
        (not_missing and p.startswith(not_missing)) or p in replaced or p in optional_paths)]
    if len(match.missing) < len(absent) and optional_paths:
        match.kept = [p for p in absent if (p in optional_paths or p.startswith(optional))
                      and not (p in replaced or p.startswith(replaced_prefixes))]
    for groups_path, groups in (parameter_groups or {}).items():
        _match_groups(match, entries, selected, groups_path, groups)
    if match.missing:
        _pair_containers(match, entries, target)
    return match


def _match_groups(
    match: Match, entries: Mapping[StatePath, Entry], selected: Sequence[StatePath],
    groups_path: StatePath, groups: Sequence[Sequence[object]],
) -> None:
    """Settle an optimizer's param groups (its `param_groups` at `groups_path`, the target's
    parameter ids in each of `groups`) and its `state` beside them, keyed by the saved ids.

    The ids are no values to load: they say which saved state is whose (torch numbers the
    parameters across the groups in order). A saved group whose ids differ from the target's
    group at its index (the parameters split into groups otherwise) is mismatched as a whole,
    by its path: none of its leaves loads, nor the state of its saved parameters, which would
    go to other parameters. Saved state whose parameter is in no matching group (a group the
    target lacks) does not load either, and is unexpected. A saved group without parameters
    counts as none (nothing of it is compared), and so do those after it past the target's.
    """
    saved: list[list[object]] = []
    while len(saved) < len(groups) or f"{groups_path}/{len(saved)}/params/0" in entries:
        params = f"{groups_path}/{len(saved)}/params/"
        ids: list[object] = []
        while (entry := entries.get(f"{params}{len(ids)}")) is not None:
            ids.append(entry.value if entry.kind == VALUE else entry.kind)
        saved.append(ids)
    differ = [index for index, ids in enumerate(saved[:len(groups)])
              if ids and ids != list(groups[index])]
    if not differ and len(saved) <= len(groups):
        return  # the usual case: the same groups, or fewer saved
    owned = {str(number) for index, ids in enumerate(saved[:len(groups)])
             if index not in differ for number in ids}
    whose = {str(number): index for index in differ for number in saved[index]}
    state = f"{groups_path.rpartition('/')[0]}/state/".lstrip("/")
    skipped: dict[StatePath, str] = {}  # loaded state path -> its saved parameter id
    for path in match.load:
        if path.startswith(state):
            number = path[len(state):].split("/", 1)[0]
            if number not in owned:
                skipped[path] = number
    touched = {whose[number] for number in skipped.values() if number in whose}
    prefixes = {index: f"{groups_path}/{index}/" for index in differ}
    touched.update(index for index, prefix in prefixes.items()
                   if any(path.startswith(prefix) for path in selected))
    group_prefixes = tuple(prefixes.values())
    match.load = [p for p in match.load if p not in skipped and not p.startswith(group_prefixes)]
    match.fresh = [p for p in match.fresh if p not in skipped]
    match.missing = [p for p in match.missing if not p.startswith(group_prefixes)]
    match.kept = [p for p in match.kept if not p.startswith(group_prefixes)]
    match.unexpected = [p for p in match.unexpected if not p.startswith(group_prefixes)]
    match.unexpected += [path for path, number in skipped.items() if number not in whose]
    match.mismatched += [
        f"{groups_path}/{index}: checkpoint has parameter ids {_some(saved[index])} in this "
        f"group, target {_some(groups[index])} (the parameters are grouped otherwise than "
        "at the save): neither the group nor its parameters' state can load"
        for index in sorted(touched)]


def _some(ids: Sequence[object]) -> str:
    """A list of parameter ids for a message: the first few, and how many in all."""
    if len(ids) <= 6:
        return str(list(ids))
    return f"[{', '.join(map(str, ids[:5]))}, ...] ({len(ids)} in all)"


def _pair_containers(
    match: Match, entries: Mapping[StatePath, Entry],
    target: Mapping[StatePath, tuple[str, str | None, tuple[int, ...] | None]],
) -> None:
    """Settle each missing target path that is a leaf on one side and a container on the
    other (a value that became a dict since the save, or the other way round): mismatched
    when the checkpoint's side is unexpected, by the leaf's path, taken out of `missing` or
    `unexpected` with the container's leaves; not missing when the checkpoint's side loads
    (under an open key), as what it holds there replaces the target's value whole."""
    missing, unexpected = frozenset(match.missing), frozenset(match.unexpected)
    taken = [path for path in match.load if path not in target]  # under open keys
    saved_side = unexpected.union(taken)
    differs: dict[StatePath, str] = {}
    replaced: set[StatePath] = set()
    for path in itertools.chain(match.unexpected, taken):
        leaf = _ancestor(path, missing)  # a target leaf, a container in the checkpoint
        if leaf is not None and path in unexpected:
            differs[leaf] = f"checkpoint has a container, target a {_kind(target[leaf][0])}"
        elif leaf is not None:
            replaced.add(leaf)
    for path in match.missing:
        leaf = _ancestor(path, saved_side)  # a checkpoint leaf, a container in the target
        if leaf is not None and leaf in unexpected:
            differs[leaf] = f"checkpoint has a {_kind(entries[leaf].kind)}, target a container"
        elif leaf is not None:
            replaced.add(path)
    if not (differs or replaced):
        return
    match.unexpected = [p for p in match.unexpected
                        if p not in differs and _ancestor(p, differs) is None]
    match.missing = [p for p in match.missing if p not in differs and p not in replaced
                     and _ancestor(p, differs) is None]
    match.mismatched += [f"{path or '<root>'}: {problem}" for path, problem in differs.items()]


def _ancestor(path: StatePath, paths: Collection[StatePath]) -> StatePath | None:
    """The nearest path among `paths` that contains `path` (a prefix ending before one of its
    `/`, or the root's `""`, a leaf at the root on one side), or None."""
    end = path.rfind("/")
    while end != -1:
        if path[:end] in paths:
            return path[:end]
        end = path.rfind("/", 0, end)
    return "" if path and "" in paths else None


def _kind(kind: str) -> str:
    """How a mismatch names a leaf's kind: every kind of tensor is a tensor."""
    return TENSOR if kind in (SHARDED, ALIAS, UNINITIALIZED) else kind


def meeting(addresses: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """The indices, ascending, of the memory ranges `[address, address + size)` that share a
    byte with another (empty ranges share none). A sort and a running maximum of the ends,
    in NumPy: 20,000 ranges take about a millisecond, however many of them meet."""
    starts = np.asarray(addresses, dtype=np.int64)
    ends = starts + np.asarray(sizes, dtype=np.int64)
    used = np.flatnonzero(ends > starts)
    order = used[np.argsort(starts[used], kind="stable")]
    starts, ends = starts[order], ends[order]
    met = np.zeros(len(order), dtype=bool)
    met[1:] = starts[1:] < np.maximum.accumulate(ends)[:-1]  # starts inside an earlier one
    met[:-1] |= ends[:-1] > starts[1:]  # the next one starts inside it
    return sorted(int(index) for index in order[met])

#: Key prefixes that wrappers add to a module's `state_dict()`: torch.compile's
#: OptimizedModule, and DistributedDataParallel and DataParallel.
_WRAPPERS = ("_orig_mod.", "module.")


def _unwrapped(path: StatePath) -> StatePath:
    head, slash, key = path.rpartition("/")
    while key.startswith(_WRAPPERS):
        key = key.split(".", 1)[1]
    return head + slash + key


def wrapper_hint(missing: Sequence[StatePath], entries: Mapping[StatePath, Entry]) -> str:
    """A sentence for a mismatch whose missing target paths are in the checkpoint with other
    wrapper key prefixes (the saved module and the target are wrapped differently); else
    ""."""
    if not missing:
        return ""
    unwrapped: dict[StatePath, StatePath] = {}
    for path in entries:
        unwrapped.setdefault(_unwrapped(path), path)
    for path in missing:
        other = unwrapped.get(_unwrapped(path))
        if other is not None and other != path:
            return (f" The checkpoint has {other!r} for {path!r}: the saved module and this one "
                    "are wrapped differently (torch.compile adds '_orig_mod.' to state_dict "
                    "keys, (Distributed)DataParallel 'module.'); restore into a module wrapped "
                    "as the saved one was, and save unwrapped modules (model._orig_mod, "
                    "model.module) from now on.")
    return ""


#: The kinds of whole tensors and arrays, which load into each other (see `Match.retyped`).
_ARRAYS = (TENSOR, NDARRAY)
#: The entry kinds that load into either of `_ARRAYS`: an alias is the whole tensor it names.
_WHOLE = (*_ARRAYS, ALIAS)


def _difference(entry: Entry, target: tuple[str, str | None, tuple[int, ...] | None]) -> str:
    kind, dtype, shape = target
    # A tensor saved whole loads into a piece of one (compared by global shape), and the other
    # way round; an alias is a tensor; a tensor not materialized yet takes any shape; a tensor
    # loads into an array, and the other way round.
    saved, kind = _kind(entry.kind), _kind(kind)
    if saved == NDARRAY and entry.scalar and kind == VALUE:
        return ""  # a NumPy scalar (np.float64 is a float) restores over a plain value
    if saved in _ARRAYS or kind in _ARRAYS:
        if saved != kind and not (entry.kind in _WHOLE and target[0] in _ARRAYS):
            return f"checkpoint has a {saved}, target a {kind}"
        if entry.dtype != dtype:
            return f"checkpoint dtype {entry.dtype}, target {dtype}"
        if entry.shape != shape and target[0] != UNINITIALIZED:
            return f"checkpoint shape {list(entry.shape or ())}, target {list(shape or ())}"
    return ""


# -- distributed writing -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    """A piece of an entry that one or more ranks hold, to be written once.

    Attributes:
        path: the entry.
        box: where the piece lies in the entry's global tensor (the whole tensor for a plain
            leaf; None for a leaf without a shape: bytes, pickled).
        itemsize: bytes per element (the leaf's byte size when `box` is None).
        ranks: the ranks holding the same piece.
        splittable: whether the piece may be cut along its first dimension to share the
            writing (tensors only).
    """

    path: StatePath
    box: Box | None
    itemsize: int
    ranks: tuple[int, ...]
    splittable: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes of the piece."""
        return self.itemsize * (element_count(self.box[1]) if self.box is not None else 1)


def plan_writers(
    held: Sequence[Held], world_size: int, *, split_bytes: int
) -> list[list[tuple[StatePath, Box | None]]]:
    """Which rank writes what, so that each piece is written once and no rank writes much more
    than its share: pieces held by one rank go to it; a piece several ranks hold goes to the
    least loaded of them, largest first, and one of at least `split_bytes` is cut into
    near-equal slabs along its first dimension, one per holder.

    Returns:
        per rank, the `(path, box)` pieces it writes, in the order of `held`.
    """
    load = [0] * world_size
    chosen: dict[int, list[tuple[int, Box | None]]] = {}
    by_size = sorted(range(len(held)), key=lambda i: (len(held[i].ranks) > 1, -held[i].nbytes))
    for index in by_size:
        piece = held[index]
        box = piece.box
        ranks = sorted(piece.ranks, key=lambda r: (load[r], r))
        if (
            len(ranks) > 1 and piece.splittable and box is not None and box[1]
            and piece.nbytes >= split_bytes and box[1][0] >= 2
        ):
            (first, *rest), (rows, *tail) = box
            count = min(len(ranks), rows)
            for n, rank in enumerate(ranks[:count]):
                start, end = rows * n // count, rows * (n + 1) // count
                slab = ((first + start, *rest), (end - start, *tail))
                chosen.setdefault(index, []).append((rank, slab))
                load[rank] += piece.nbytes * (end - start) // rows
            continue
        chosen.setdefault(index, []).append((ranks[0], box))
        load[ranks[0]] += piece.nbytes
    plan: list[list[tuple[StatePath, Box | None]]] = [[] for _ in range(world_size)]
    for index in range(len(held)):
        for rank, box in chosen[index]:
            plan[rank].append((held[index].path, box))
    return plan


# -- resharded reading ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """Bytes to copy from a saved piece into a destination piece, both in row-major order.

    Attributes:
        source: byte offset in the saved piece.
        dest: byte offset in the destination piece.
        nbytes: how many bytes.
    """

    source: int
    dest: int
    nbytes: int


def _strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return strides


def copy_runs(source: Box, dest: Box, itemsize: int) -> list[Run]:
    """The contiguous runs that copy the overlap of a saved piece `source` into a destination
    piece `dest` (both boxes in the same global tensor), in source order. The trailing
    dimensions that the overlap spans fully in both pieces join into one run, so a split along
    the first dimension gives a single run."""
    overlap = intersect(source, dest)
    if overlap is None or not element_count(overlap[1]):
        return []
    offsets, shape = overlap
    ndim = len(shape)
    split = ndim
    while split > 0 and shape[split - 1] == source[1][split - 1] == dest[1][split - 1]:
        split -= 1
    # Dimension `split - 1` may be partial; it still belongs to each run.
    lead = max(split - 1, 0)
    length = element_count(shape[lead:]) * itemsize
    src_strides, dst_strides = _strides(source[1]), _strides(dest[1])
    src_base = [o - s for o, s in zip(offsets, source[0], strict=True)]
    dst_base = [o - d for o, d in zip(offsets, dest[0], strict=True)]
    runs = []
    for index in itertools.product(*(range(n) for n in shape[:lead])):
        src = sum((b + i) * s for b, i, s in zip(src_base, index, src_strides, strict=False))
        dst = sum((b + i) * s for b, i, s in zip(dst_base, index, dst_strides, strict=False))
        src += sum(b * s for b, s in zip(src_base[lead:], src_strides[lead:], strict=True))
        dst += sum(b * s for b, s in zip(dst_base[lead:], dst_strides[lead:], strict=True))
        runs.append(Run(src * itemsize, dst * itemsize, length))
    return runs


def coverage_problem(dest: Box, sources: Sequence[Box]) -> str:
    """Why the saved pieces `sources` do not cover every element of `dest` exactly once, or
    "" when they do (checked by volume, and for overlap by the save side's sweep over what
    each covers: a whole load of thousands of ranks' pieces must not compare every pair)."""
    parts = [part for part in (intersect(source, dest) for source in sources) if part]
    covered = sum(element_count(part[1]) for part in parts)
    wanted = element_count(dest[1])
    pair = overlapping_pair(parts)
    if pair is not None:
        both = intersect(parts[pair[0]], parts[pair[1]])
        assert both is not None
        return (f"saved pieces overlap at {list(both[0])} (shape {list(both[1])}) "
                "inside the destination")
    if covered != wanted:
        return (f"saved pieces cover {covered} of the destination's {wanted} elements "
                f"(destination at {list(dest[0])}, shape {list(dest[1])})")
    return ""
