"""Flatten a state into `(path, leaf)` entries and a skeleton; rebuild a state from a skeleton,
or write loaded values back into a live state (tree layer; knows nothing about storage).

A skeleton is plain JSON-able data (see `_types.Node`), so the format layer stores it as is:
it records every container's type and key types, and which nodes were stateful objects, so a
load can rebuild the saved tree exactly or call `load_state_dict` where `state_dict` was called.
"""

from __future__ import annotations

import copy
import enum
import fnmatch
import functools
import logging
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._leaves import (
    MAX_INT_DIGITS,
    SHARDED,
    VALUE,
    PerRank,
    check_text,
    leaf_kind,
    too_long_int,
)
from ._types import Node, StatePath
from .errors import SafepointError, StateMismatch, UnsupportedLeaf

__all__ = ["MAX_DEPTH", "Flat", "checked_keys", "flatten", "join", "leaf_paths",
           "merge_skeletons", "nodes_at", "open_keys", "optional_paths", "parameter_groups",
           "per_rank_paths", "rebuild", "renumbered", "replaces", "select", "write_back"]

logger = logging.getLogger(__name__)

_GLOB_CHARS = frozenset("*?[")
_MISSING: Any = object()
#: Which containers saved empty `rebuild` keeps: all (True), none (False), or those whose path
#: the predicate accepts (see `selects`).
KeepEmpty = bool | Callable[[str], bool]
#: Where `_rebuild` is: None at the root, else the parent's and the key, joined into a path
#: only at a container saved empty that a predicate `KeepEmpty` decides.
_Where = tuple[Any, str | int] | None


@dataclass(slots=True)
class Flat:
    """A flattened state.

    Attributes:
        leaves: path -> leaf, in tree order.
        kinds: path -> the leaf's kind (see `_leaves`).
        skeleton: the containers, as stored in the manifest.
        stateful: path -> (object, the state dict its `state_dict()` returned), so that loading
            in place writes into that very dict and hands it to `load_state_dict`.
    """

    leaves: dict[StatePath, Any] = field(default_factory=dict)
    kinds: dict[StatePath, str] = field(default_factory=dict)
    skeleton: Node = None
    stateful: dict[StatePath, tuple[Any, Any]] = field(default_factory=dict)


def escape_key(key: str | int) -> str:
    """One path component: `%` and `/` are percent-encoded so paths split unambiguously, and
    the empty key is spelled `%` (which no other key produces), so that no component is empty
    and a root-level `""` key does not share the root's path `""`."""
    return str(key).replace("%", "%25").replace("/", "%2F") if key != "" else "%"


def join(parent: StatePath, key: str | int) -> StatePath:
    """The path of `key` inside the container at `parent`."""
    return f"{parent}/{escape_key(key)}" if parent else escape_key(key)


def is_stateful(value: Any) -> bool:
    """True for objects that save themselves through `state_dict()`/`load_state_dict()`."""
    cls = type(value)
    return callable(getattr(cls, "state_dict", None)) and callable(
        getattr(cls, "load_state_dict", None)
    )


def open_keys(obj: Any, state_dict: Any) -> tuple[str | int, ...] | None:
    """The keys of a stateful object's state dict (`state_dict`, what its `state_dict()`
    returned) under which its `load_state_dict` takes saved keys that its `state_dict()` lacks
    now, or None for anywhere.

    An object says so with a `safepoint_open_keys` attribute (a collection of top-level keys;
    empty: none). Without one: a module lists every key it loads except its extra state
    (`get_extra_state`, at any submodule depth: whatever it saved, such as an fp8 layer's
    amax history) and what its state dict holds that is no tensor (a torchmetrics metric's
    list of the tensors its updates gathered, which a fresh one holds none of: the module's
    own `_load_from_state_dict` takes it), and the placeholder buffers (one value or none) of
    its quantization observers and fake-quantizers (`torch.ao.quantization`: their scales
    grow from one value to one per channel once they see data, and their
    `_load_from_state_dict` resizes a fresh one's; observed ones load in place, checked);
    an optimizer's per-parameter `state` is whatever its steps made (none before the first,
    history lists in LBFGS that grow every step); any other object is trusted to judge what
    it is given (anywhere).
    """
    declared = getattr(obj, "safepoint_open_keys", None)
    if declared is not None:
        return tuple(declared)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        resizing = _quantization_prefixes(obj)
        return tuple(key for key, value in state_dict.items()
                     if (key.endswith(_EXTRA_STATE)
                         and (key == _EXTRA_STATE or key.endswith("." + _EXTRA_STATE)))
                     or not torch.is_tensor(value)
                     or (key.startswith(resizing) and value.numel() <= 1))
    if torch is not None and isinstance(obj, torch.optim.Optimizer):
        return ("state",)
    return None


def _quantization_prefixes(module: Any) -> tuple[str, ...]:
    """The state dict prefixes of `module`'s quantization observers and fake-quantizers
    (none unless `torch.ao.quantization` was imported)."""
    quantization = sys.modules.get("torch.ao.quantization")
    if quantization is None:
        return ()
    kinds = (quantization.ObserverBase, quantization.FakeQuantizeBase)
    return tuple(f"{name}." if name else "" for name, sub in module.named_modules()
                 if isinstance(sub, kinds))


def replaces(obj: Any) -> bool:
    """Whether what a checkpoint holds at a stateful object's open keys replaces the live
    value whole, structure not compared, as a module's extra state and an optimizer's `state`
    are replaced by `load_state_dict`. Not for keys an object declares open: there the saved
    keys join the live ones (`sp.RNGState` keeps the state of CUDA devices the checkpoint has
    none for)."""
    return getattr(obj, "safepoint_open_keys", None) is None


#: The key of a module's extra state in its state dict, after its submodule's prefix
#: (torch.nn.Module.get_extra_state).
_EXTRA_STATE = "_extra_state"


def optional_paths(stateful: Mapping[StatePath, tuple[Any, Any]]) -> list[StatePath]:
    """The paths in stateful objects' state dicts (`Flat.stateful`: path -> (object, what its
    `state_dict()` returned)) that a checkpoint may lack, because the object's
    `load_state_dict` does without them: the live value stays, and restores stay strict
    across versions that add a key.

    An object lists such top-level keys in a `safepoint_optional_keys` attribute (as
    `sp.RNGState` does). Without one: an optimizer's settings in each of its `param_groups`
    other than `params` (torch 2.7's AdamW added `decoupled_weight_decay`; torch's own
    `load_state_dict` fills in what an older one lacks), and every top-level key of an LR
    scheduler but `last_epoch` (its `load_state_dict` updates its attributes with what it is
    given, such as a StepLR saved before `_is_initial` existed); none for any other object.
    """
    return [functools.reduce(join, keys, path) for path, (obj, state_dict) in stateful.items()
            for keys in _optional_keys(obj, state_dict)]


def _optional_keys(obj: Any, state_dict: Any) -> list[tuple[str | int, ...]]:
    """The keys, one tuple per path, of what `optional_paths` finds in one object's state
    dict."""
    declared = getattr(obj, "safepoint_optional_keys", None)
    if declared is not None:
        return [(key,) for key in declared]
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(state_dict, Mapping):
        return []
    if isinstance(obj, torch.optim.Optimizer):
        groups = state_dict.get("param_groups")
        return [("param_groups", index, key) for index, group in enumerate(groups)
                if isinstance(group, Mapping) for key in group if key != "params"
                ] if isinstance(groups, list) else []
    schedulers = torch.optim.lr_scheduler
    if isinstance(obj, (schedulers.LRScheduler, schedulers.ReduceLROnPlateau)):
        # `last_epoch`, which every version saved, stays required, as `params` does for an
        # optimizer: a checkpoint without the object at all is still a mismatch. A
        # ChainedScheduler's state has none: its `_schedulers` stay required instead, and a
        # state with neither has every key required.
        required = next((key for key in ("last_epoch", "_schedulers") if key in state_dict),
                        None)
        return [(key,) for key in state_dict if key != required] if required else []
    return []


def parameter_groups(
    stateful: Mapping[StatePath, tuple[Any, Any]]
) -> dict[StatePath, list[list[Any]]]:
    """The parameter ids in each param group of the torch optimizers among `stateful`
    (`Flat.stateful`), by the path of the optimizer's `param_groups`. They name which saved
    state belongs to which parameter, so a load compares them with the checkpoint's and never
    writes them (see `_plan.match_target`)."""
    found = {join(path, "param_groups"): _parameter_groups(obj, state_dict)
             for path, (obj, state_dict) in stateful.items()}
    return {path: groups for path, groups in found.items() if groups is not None}


def _parameter_groups(obj: Any, state_dict: Any) -> list[list[Any]] | None:
    """The parameter ids of each group in a torch optimizer's state dict, or None for any
    other object."""
    torch = sys.modules.get("torch")
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if torch is None or not (isinstance(obj, torch.optim.Optimizer) and isinstance(groups, list)):
        return None
    return [list(group.get("params", ())) if isinstance(group, Mapping) else []
            for group in groups]


@dataclass(frozen=True, slots=True)
class _Recorded:
    """A dict of leaves that `flatten` recorded in bulk: its keys, their paths, its skeleton
    node's body, and when all its leaves are of one kind that kind and path -> kind."""

    keys: list[str]
    paths: list[StatePath]
    body: list[Any]
    kind: str | None
    kinds: dict[StatePath, str]


#: What `flatten` keeps between the saves of one series to flatten the next one faster.
Memo = dict[StatePath, _Recorded]


def flatten(
    state: Any, rank: int = 0, memo: Memo | None = None, max_depth: int | None = None
) -> Flat:
    """Flatten `state`, calling `state_dict()` on every stateful object once. The value of a
    `PerRank` is flattened under the component `rank` (`rng/3/...`), in a `per_rank` node.
    `max_depth` (a save's `MAX_DEPTH`) refuses containers nested deeper; a load's target
    takes what an earlier release saved.

    `memo` (an empty dict at first, then the one the last call filled) lets a series of
    states of the same shape share the paths and skeleton nodes of their large dicts of
    leaves: a dict with the same keys, in order, whose leaves are of the same kind reuses
    them instead of making them again. The skeleton's nodes may thus be shared between
    flattens; they are never changed.

    Raises:
        UnsupportedLeaf: a value, key or cycle that cannot be stored; names its path.
    """
    flat = Flat()
    last = {} if memo is None else dict(memo)
    if memo is not None:
        memo.clear()
    try:
        flat.skeleton = _Flattener(flat, rank, last, memo, max_depth).node(state, "")
    except RecursionError as exc:
        raise UnsupportedLeaf(
            "the state nests dicts, lists or tuples deeper than Python's recursion limit "
            "lets safepoint walk: flatten that structure (or keep it in a stateful object's "
            "state_dict of fewer levels)", path="<root>",
        ) from exc
    return flat


#: What a value is to `flatten`, besides a leaf kind: decided by its type alone.
_STATEFUL, _PER_RANK, _DICT, _LIST, _TUPLE = range(5)
#: A piece of a global tensor: a leaf, but each one is checked (`leaf_kind`).
_PIECE = 5
#: The deepest nesting of containers a state may have: each level is three levels of the
#: manifest's JSON tree, which readers parse with a recursion limit (Python's: 1000).
MAX_DEPTH = 100
#: Dicts of at least this many leaves are recorded in bulk (`_Flattener.leaf_dict`).
_BULK = 16


def _category(value: Any, path: StatePath) -> int | str:
    """`value`'s category (an int above) or, for a leaf, its kind (a str)."""
    if is_stateful(value):
        _refuse_zero_redundancy(value, path)
        return _STATEFUL
    if isinstance(value, PerRank):
        return _PER_RANK
    if isinstance(value, dict):
        return _DICT
    if isinstance(value, list):
        return _LIST
    if isinstance(value, tuple):
        return _TUPLE
    kind = leaf_kind(value, path)
    return _PIECE if kind == SHARDED else kind


def _refuse_zero_redundancy(value: Any, path: StatePath) -> None:
    """Refuse a `ZeroRedundancyOptimizer`: its `state_dict()` is the whole state, which a
    collective `consolidate_state_dict()` gathers to one rank first, and it raises on every
    other rank (and on a fresh one to restore into), so neither a group's save nor a load works
    through it; each rank's own optimizer over its shard does."""
    optim = sys.modules.get("torch.distributed.optim")
    zero = getattr(optim, "ZeroRedundancyOptimizer", None)
    if zero is not None and isinstance(value, zero):
        raise UnsupportedLeaf(
            f"the ZeroRedundancyOptimizer at {path!r} holds one shard of the optimizer state "
            "per rank, and its state_dict() works only on a rank that gathered them all first "
            "(consolidate_state_dict): save and load each rank's shard as "
            "sp.PerRank(optimizer.optim), which restores at the same world size", path=path,
        )


class _Flattener:
    """One `flatten`: a state of many thousands of leaves holds few types, so each type is
    classified once, and the leaves of a container are recorded in its own loop."""

    def __init__(self, flat: Flat, rank: int, last: Memo, memo: Memo | None,
                 max_depth: int | None) -> None:
        self.flat = flat
        self.max_depth = max_depth
        self.rank = rank
        self.last = last
        self.memo = memo
        self.parents: set[int] = set()
        self.categories: dict[type, int | str] = {}

    def node(self, value: Any, path: StatePath) -> Node:
        category = self.categories.get(type(value))
        if category is None:
            category = self.categories[type(value)] = _category(value, path)
        if type(category) is str:
            self.record(path, value, category)
            return path
        if category == _STATEFUL:
            state_dict = value.state_dict()
            self.flat.stateful[path] = (value, state_dict)
            return {"stateful": self.node(state_dict, path)}
        if category == _PER_RANK:
            return {"per_rank": [[self.rank, self.node(value.value, join(path, self.rank))]]}
        if category == _PIECE:
            self.record(path, value, leaf_kind(value, path))
            return path
        if id(value) in self.parents:
            raise UnsupportedLeaf(
                f"the state refers to itself at {path!r}: break the cycle before saving",
                path=path,
            )
        if self.max_depth is not None and len(self.parents) >= self.max_depth:
            raise UnsupportedLeaf(
                f"the state nests dicts, lists or tuples deeper than {self.max_depth} levels (at "
                f"{path[:200]!r}), more than a manifest's JSON can hold for its readers: "
                "flatten that structure (or wrap it in sp.Pickled)", path=path,
            )
        self.parents.add(id(value))
        try:
            if category == _DICT:
                body = self.leaf_dict(value, path)
                return {"dict": body if body is not None
                        else self.children(value.items(), path, keyed=True)}
            body = self.children(enumerate(value), path, keyed=False)
            return {"list" if category == _LIST else "tuple": body}
        finally:
            self.parents.discard(id(value))

    def children(self, items: Iterable[tuple[Any, Any]], path: StatePath,
                 keyed: bool) -> list[Any]:
        """The nodes of a container's `(key, child)` items: `[key, node]` pairs when `keyed`
        (a dict), else the nodes alone."""
        prefix = f"{path}/" if path else ""
        categories = self.categories
        body: list[Any] = []
        numbered: list[StatePath] = []  # the paths of int keys, which a str twin could take
        for key, child in items:
            if type(key) is int:
                child_path = prefix + _int_key(key, path)
                numbered.append(child_path)
            elif type(key) is str and key and "%" not in key and "/" not in key:
                child_path = prefix + key
                check_text(key, child_path)
            else:
                child_path = prefix + escape_key(_checked_key(key, path))
                check_text(str(key), child_path)
            category = categories.get(type(child))
            if type(category) is str:  # a leaf of a known type, the bulk of a large state
                self.record(child_path, child, category)
                node: Node = child_path
            else:
                node = self.node(child, child_path)
            body.append([key, node] if keyed else node)
        if keyed and numbered:
            twins = {str(key) for key, _ in body if type(key) is str}
            taken = next((p for p in numbered if p.rpartition("/")[2] in twins), None)
            if taken is not None:
                raise _same_path(taken)
        return body

    def leaf_dict(self, value: dict[Any, Any], path: StatePath) -> list[Any] | None:
        """The nodes of a dict of `_BULK` or more leaves whose keys are plain str (the path
        components themselves), recorded in bulk (the loops run in C: a model's thousands of
        tensors cost little per leaf; the paths and nodes are the memo's when it has them);
        None for any other dict, which `children` walks."""
        if len(value) < _BULK:
            return None
        children = list(value.values())
        kinds = self.leaf_kinds(children, path)
        keys = list(value)
        if kinds is None or set(map(type, keys)) - {str}:
            return None
        if str in kinds:
            for key, child in value.items():
                if type(child) is str:
                    check_text(child, join(path, key))
        kind = next(iter(kinds.values())) if len(set(kinds.values())) == 1 else None
        recorded = self.last.get(path)
        if recorded is None or recorded.kind is None or recorded.kind != kind or (
                recorded.keys != keys):
            joined = "\0".join(keys)
            if "" in value or "%" in joined or "/" in joined or not joined.isascii():
                return None  # `children` escapes (and checks) such keys
            paths = list(map(f"{path}/".__add__, keys)) if path else keys
            recorded = _Recorded(keys, paths, list(map(list, zip(keys, paths, strict=True))),
                                 kind, dict.fromkeys(paths, kind) if kind is not None else {})
        if self.memo is not None:
            self.memo[path] = recorded
        leaves, paths = self.flat.leaves, recorded.paths
        if not leaves.keys().isdisjoint(paths):
            raise _same_path(next(p for p in paths if p in leaves))
        leaves.update(zip(paths, children, strict=True))
        if kind is not None:
            self.flat.kinds.update(recorded.kinds)
        else:
            self.flat.kinds.update(zip(paths, map(kinds.__getitem__, map(type, children)),
                                       strict=True))
        return recorded.body

    def leaf_kinds(self, children: list[Any], path: StatePath) -> dict[type, str] | None:
        """The kind of each type among `children` when all of them are leaves, else None."""
        categories = self.categories
        types = set(map(type, children))
        for unseen in types - categories.keys():
            child = next(c for c in children if type(c) is unseen)
            try:
                categories[unseen] = _category(child, path)
            except UnsupportedLeaf:
                return None  # `children` raises it, in order
        kinds: dict[type, str] = {}
        for leaf_type in types:
            category = categories[leaf_type]
            if type(category) is not str:
                return None
            kinds[leaf_type] = category
        return kinds

    def record(self, path: StatePath, value: Any, kind: str) -> None:
        leaves = self.flat.leaves
        if path in leaves:
            raise _same_path(path)
        if kind == VALUE and type(value) is str:
            check_text(value, path)
        leaves[path] = value
        self.flat.kinds[path] = kind


def _same_path(path: StatePath) -> UnsupportedLeaf:
    return UnsupportedLeaf(
        f"two keys map to the same path {path!r} (an int key and its str twin?): "
        "rename one of them",
        path=path,
    )


def _int_key(key: int, path: StatePath) -> str:
    """An int key's path component: its digits.

    Raises:
        UnsupportedLeaf: an int of more than `MAX_INT_DIGITS` digits (more than readers
            parse, whatever this process allows itself), naming the dict's path.
    """
    if too_long_int(key):
        raise UnsupportedLeaf(
            f"a dict key under {path or '<root>'!r} is an int too long to turn into a path "
            f"(more than {MAX_INT_DIGITS} digits): use a shorter key, or keep that table in "
            "a tensor or in sp.Pickled",
            path=path,
        )
    return str(key)


def _checked_key(key: Any, path: StatePath) -> str | int:
    if type(key) is str or type(key) is int:
        return key
    raise UnsupportedLeaf(
        f"dict key {key!r} of type {type(key).__name__} under {path or '<root>'!r}: "
        "only str and int keys can be saved; convert the key",
        path=path,
    )


def _globbed(path: StatePath, key: str) -> bool:
    """Whether glob `key` matches `path` or one of its ancestors."""
    parts = path.split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[:n]), key) for n in range(len(parts), 0, -1))


def checked_keys(keys: Iterable[str] | None) -> list[str] | None:
    """`keys=` as a list, taken from an iterator once (a load passes over it several times),
    or None.

    Raises:
        SafepointError: `keys` is a str or no iterable, or holds an item that is no str.
    """
    if keys is None:
        return None
    if isinstance(keys, str):
        raise SafepointError(f"keys={keys!r}: pass a list of path prefixes or globs, such as "
                             f"keys=[{keys!r}] (a str is not split into keys)")
    listed = list(keys) if isinstance(keys, Iterable) else [keys]
    wrong = next((key for key in listed if not isinstance(key, str)), _MISSING)
    if wrong is not _MISSING:
        digits = (f", such as keys=[{str(wrong)!r}] (an int key or a list index is its digits)"
                  if type(wrong) is int else "")
        raise SafepointError(f"keys= takes path prefixes or globs as str, not {wrong!r} "
                             f"({type(wrong).__name__}): spell each key as text{digits}")
    return listed


def select(paths: Iterable[StatePath], keys: Iterable[str] | None) -> list[StatePath]:
    """The paths selected by `keys`: each key is a path prefix (`model/` or `model`) that
    selects that path and everything below it, or a glob (`model/*.weight`, `*` also matching
    `/`) that selects what it matches and everything below. A key that names one of `paths`
    (or a prefix of them) as it is selects that alone, glob characters and all: a path as
    `sp.info` lists it (`w[0]`, `acc[top1]`) selects itself, not what it matches as a glob
    (`w0`). `keys=None` selects everything. Prefixes are looked up by each path's ancestors,
    so a selection of 10,000 keys among 20,000 paths does not compare every key with every
    path.

    Raises:
        SafepointError: `keys` is not a collection of str (see `checked_keys`).
    """
    keys = checked_keys(keys)
    if keys is None:
        return list(paths)
    paths = list(paths)
    prefixes = {key.rstrip("/") for key in keys}
    if "" in prefixes:
        return paths
    globs = {key for key in prefixes if not _GLOB_CHARS.isdisjoint(key)}
    if globs:
        named = {path[:end] for path in paths for end in (*_slashes(path), len(path))}
        globs -= named
    return [path for path in paths
            if path in prefixes or any(path[:end] in prefixes for end in _slashes(path))
            or any(_globbed(path, key) for key in globs)]


def selects(keys: Sequence[str], selected: Collection[StatePath]) -> Callable[[StatePath], bool]:
    """Whether `keys`, which selected the paths `selected` (see `select`), select a path
    that holds no leaf (a container saved empty): the path or one of its ancestors is one of
    the keys, or matches one of their globs, as `select` matches them (a glob that names one
    of the selected paths or their ancestors as it is is that name alone). Work in
    proportion to the keys, and to the selection when a key is a glob."""
    prefixes = {key.rstrip("/") for key in keys}
    if "" in prefixes:
        return lambda path: True
    globs = {key for key in prefixes if not _GLOB_CHARS.isdisjoint(key)}
    if globs:
        globs -= {path[:end] for path in selected for end in (*_slashes(path), len(path))}

    def selected_path(path: StatePath) -> bool:
        return (path in prefixes or any(path[:end] in prefixes for end in _slashes(path))
                or any(_globbed(path, key) for key in globs))

    return selected_path


def rebuild(node: Node, values: Mapping[StatePath, Any], *, keep_empty: KeepEmpty = True) -> Any:
    """The tree a skeleton describes, with leaves from `values`; a stateful node becomes the
    state dict it produced. Leaves absent from `values` are left out, and so are their
    containers, but for those saved empty that `keep_empty` keeps: all, none, or those at
    the paths a predicate accepts (`selects(keys, selected)`: those a load's `keys=`
    select, so that a subtree selected comes back whole, empty containers and all)."""
    result = _rebuild(node, values, keep_empty)
    return {} if result is _MISSING else result


def renumbered(node: Node, selected: set[StatePath]) -> StatePath | None:
    """The first of the `selected` paths that `rebuild` from them alone would put at another
    index: one in an item of a list or tuple after an item with leaves, none of them
    selected, left out (the rebuilt sequence closes the gap), or None."""
    if isinstance(node, str):
        return None
    ((tag, body),) = node.items()
    if tag == "stateful":
        return renumbered(body, selected)
    children = _children(tag, body)
    if tag in ("list", "tuple"):
        gap = False
        for child in children:
            paths = leaf_paths(child)
            taken = next((path for path in paths if path in selected), None)
            if taken is not None and gap:
                return taken
            gap = gap or (taken is None and bool(paths))
    for child in children:
        found = renumbered(child, selected)
        if found is not None:
            return found
    return None


def _children(tag: str, body: Any) -> list[Node]:
    """The child nodes of a container node's `body`."""
    return [child for _, child in body] if tag in ("dict", "per_rank") else list(body)


def _rebuild(
    node: Node, values: Mapping[StatePath, Any], keep_empty: KeepEmpty, where: _Where = None
) -> Any:
    if isinstance(node, str):
        return values.get(node, _MISSING)
    ((tag, body),) = node.items()
    if tag == "stateful":
        return _rebuild(body, values, keep_empty, where)
    if tag == "per_rank":
        ranks = {rank: _rebuild(child, values, keep_empty, (where, rank)) for rank, child in body}
        kept_ranks = {rank: value for rank, value in ranks.items() if value is not _MISSING}
        return kept_ranks or _MISSING
    if tag == "dict":
        built = {key: _rebuild(child, values, keep_empty, (where, key)) for key, child in body}
        out = {key: value for key, value in built.items() if value is not _MISSING}
        return out if out or (not body and _keeps(keep_empty, where)) else _MISSING
    items = [_rebuild(c, values, keep_empty, (where, i)) for i, c in enumerate(body)]
    kept = [value for value in items if value is not _MISSING]
    if not kept and not (not body and _keeps(keep_empty, where)):
        return _MISSING
    if keep_empty is not True and len(kept) < len(items):  # items without leaves keep their place
        kept = [_rebuild(c, values, True) if v is _MISSING and not leaf_paths(c) else v
                for c, v in zip(body, items, strict=True)]
        kept = [value for value in kept if value is not _MISSING]
    return kept if tag == "list" else tuple(kept)


def _keeps(keep_empty: KeepEmpty, where: _Where) -> bool:
    """Whether `_rebuild` keeps the container saved empty at `where`."""
    if isinstance(keep_empty, bool):
        return keep_empty
    keys: list[str | int] = []
    while where is not None:
        where, key = where
        keys.append(key)
    return keep_empty(functools.reduce(join, reversed(keys), ""))


def write_back(
    state: Any, target: Flat, saved: Node, values: Mapping[StatePath, Any], url: str,
    replaced: Collection[StatePath] = (),
) -> Any:
    """Write loaded `values` into the live `state` that `target` was flattened from.

    Plain values are replaced in their containers (dicts and lists in place, tuples rebuilt),
    then every stateful object with a loaded value below it gets `load_state_dict` with its own
    state dict, updated. Inside a stateful object, what the checkpoint has and the target lacks
    (a fresh optimizer's empty state) is built from the saved skeleton; `load_state_dict` is the
    judge of it. The value at each of the `replaced` paths (open keys of stateful objects, see
    `open_keys`) is built from the saved skeleton alone, so that what the live one has and the
    checkpoint lacks (an optimizer's state for a parameter that had none when it was saved) is
    gone. Tensors already filled in place appear in `values` as themselves.

    Returns:
        the state: the same object unless its root is a tuple.

    Raises:
        StateMismatch: a stateful object's `load_state_dict` refused its state (a ValueError
            or KeyError, such as a sampler over a dataset of another size), named by its path
            and the checkpoint's `url`.
    """
    writer = _WriteBack(target, values, url, frozenset(replaced))
    return writer.write(state, target.skeleton, saved, "", inside=False)


class _WriteBack:
    def __init__(self, target: Flat, values: Mapping[StatePath, Any], url: str,
                 replaced: frozenset[StatePath]) -> None:
        self.target = target
        self.values = values
        self.url = url
        self.replaced = replaced

    def touched(self, path: StatePath) -> bool:
        """Whether a value was loaded at or below `path`, or a replaced key lies there (whose
        saved subtree may hold no value: a module's extra state saved as `{}`); below the
        root, whether anything was (a lenient load may load nothing: a leaf at the root on
        one side, a container on the other)."""
        if not path:
            return bool(self.values) or bool(self.replaced)
        prefix = path + "/"
        return any(p == path or p.startswith(prefix)
                   for paths in (self.values, self.replaced) for p in paths)

    def write(self, live: Any, node: Node, saved: Node, path: StatePath, inside: bool) -> Any:
        if path in self.replaced:
            return self.replacement(live, saved, path)
        if isinstance(saved, dict) and "stateful" in saved:
            saved = saved["stateful"]
        if isinstance(node, str):
            if node in self.values:
                return _like(live, self.values[node])
            if inside and saved is not None and not isinstance(saved, str):
                built = _rebuild(saved, self.values, True)
                return live if built is _MISSING else built
            return live
        ((tag, body),) = node.items()
        if tag == "per_rank":
            ((rank, child),) = body
            saved_ranks = dict(saved.get("per_rank", [])) if isinstance(saved, dict) else {}
            live.value = self.write(live.value, child, saved_ranks.get(rank), join(path, rank),
                                    inside)
            return live
        if tag == "stateful":
            obj, state_dict = self.target.stateful[path]
            if self.touched(path):
                restored = self.write(state_dict, body, saved, path, inside=True)
                try:
                    obj.load_state_dict(restored)
                except (ValueError, KeyError, RuntimeError) as exc:
                    # nn.Module refuses with a plain RuntimeError; its subclasses (out of
                    # memory, NotImplementedError, RecursionError, a collective's failure)
                    # are no mismatch and go on as they are.
                    if isinstance(exc, RuntimeError) and type(exc) is not RuntimeError:
                        raise
                    where = repr(path) if path else "the state"
                    raise StateMismatch(
                        f"restoring {self.url}: {where} ({type(obj).__name__}) refused the "
                        f"checkpoint's state: {exc}. Tensors read before it hold the "
                        "checkpoint's bytes. Restore into a state that matches, or leave "
                        f"{where} out (keys= without it; through sp.Run or a manager, a state "
                        "without it)",
                        url=self.url, mismatched=[f"{path}: {exc}"],
                    ) from exc
            return obj
        saved_tag = next(iter(saved)) if isinstance(saved, dict) else None
        if saved_tag == "dict" and tag in ("list", "tuple"):
            # Saved as a dict of its indices (imported from a flat file): the same paths.
            by_index = {str(key): child for key, child in saved["dict"]}
            saved, saved_tag = {tag: [by_index.get(str(i)) for i in range(len(body))]}, tag
        elif {saved_tag, tag} == {"list", "tuple"}:
            # The same paths: the values go into the live container, which keeps its type.
            saved, saved_tag = {tag: saved[saved_tag]}, tag
        elif saved_tag in ("list", "tuple") and tag == "dict":
            # A dict of the indices in the target (its keys int or their digits): the same
            # paths, the live dict keeps its type and keys.
            saved, saved_tag = {tag: list(enumerate(saved[saved_tag]))}, tag
        if saved_tag != tag:
            if inside and saved is not None:
                built = _rebuild(saved, self.values, True)
                return live if built is _MISSING else built
            if self.touched(path):
                raise self.unwritable(path, live, saved)
            return live
        if tag == "dict":
            # Inside a stateful object the containers are its state_dict()'s, which may be
            # its live attributes, even another object's (a SequentialLR's `_last_lr` is its
            # first scheduler's): changed ones are copied, for load_state_dict to take.
            # Outside, the caller's own containers are filled in place.
            saved_children = dict(saved["dict"])
            values = self.values
            out = live
            for key, child in body:
                if type(child) is str:  # a leaf, whose node is its path
                    new = values[child] if child in values else self.write(
                        live[key], child, _saved_child(saved_children, key), child, inside)
                else:
                    new = self.write(live[key], child, _saved_child(saved_children, key),
                                     join(path, key), inside)
                if new is not live[key]:
                    if inside and out is live:
                        out = copy.copy(live)
                    out[key] = _like(live[key], new)
            if inside:
                for key, child in saved_children.items():
                    if key not in live and _twin(key) not in live:
                        built = _rebuild(child, self.values, True)
                        if built is not _MISSING:
                            if out is live:
                                out = copy.copy(live)
                            out[key] = built
            return out
        saved_items = saved[tag]
        items = [
            self.write(
                live[i], child, saved_items[i] if i < len(saved_items) else None,
                child if type(child) is str else join(path, i), inside,
            )
            for i, child in enumerate(body)
        ]
        if inside:
            extra = (_rebuild(child, self.values, True) for child in saved_items[len(body):])
            items.extend(value for value in extra if value is not _MISSING)
        unchanged = len(items) == len(live) and all(a is b for a, b in zip(items, live,
                                                                              strict=True))
        if tag == "list":
            if inside and not unchanged:
                live = copy.copy(live)
            live[:] = items
            return live
        if unchanged:
            return live
        # A namedtuple takes its fields one by one; a tuple or other subclass (torch.Size)
        # an iterable.
        return type(live)(*items) if hasattr(type(live), "_fields") else type(live)(items)

    def unwritable(self, live_path: StatePath, live: Any, saved: Node) -> StateMismatch:
        """The error for values loaded below `live_path` that its live container cannot take
        from what the checkpoint holds there (a strict restore restores or raises; it never
        leaves matched values as they were)."""
        held = ("nothing" if saved is None else "a value" if isinstance(saved, str)
                else f"a {next(iter(saved)).replace('_', '-')} node")
        named = live_path or "<root>"
        return StateMismatch(
            f"restoring {self.url}: the checkpoint holds {held} at {named!r}, which the "
            f"target's {type(live).__name__} there cannot take, so the values loaded below it "
            "would stay as they were. Tensors read before it hold the checkpoint's bytes. "
            f"Restore into a state of the saved structure (sp.load({self.url!r}) shows it), or "
            f"leave {named!r} out with keys=",
            url=self.url, mismatched=[f"{named}: {held} in the checkpoint, a "
                                      f"{type(live).__name__} in the target"],
        )

    def replacement(self, live: Any, saved: Node, path: StatePath) -> Any:
        """The value at a replaced `path`, built from the saved skeleton. A checkpoint
        imported from a flat file (safetensors) holds int keys as str: such a key of a dict
        built here that spells an int the live value may hold there (one of its own int
        keys; in an optimizer's `state`, a parameter id) is that int again, or the object's
        `load_state_dict` would not find it (torch's Optimizer keeps it as an unknown key,
        and the parameters start over). An optimizer's `state` keeps only the ids of its own
        parameters: torch would keep the others under bare ids, in every later state dict."""
        built = _rebuild(saved, self.values, True)
        if built is _MISSING or not isinstance(built, dict):
            return live if built is _MISSING else built
        parameters = self.parameter_ids(path)
        if str in set(map(type, built)):  # as saved natively, int keys are already ints
            ints = {key for key in live if type(key) is int} if isinstance(live, dict) else set()
            ints.update(number for number in parameters or () if type(number) is int)
            spelled = {str(number): number for number in ints if number not in built}
            built = {spelled.get(key, key): value for key, value in built.items()}
        if parameters is None:
            return built
        # An optimizer's state keyed by no parameter of its own (a group it lacks, or what
        # an earlier load left under a bare id) would stay in its `state` for good.
        owned = frozenset(parameters)
        dropped = [key for key in built if key not in owned]
        if dropped:
            logger.warning("restoring %s: %r holds state for parameters %s that the optimizer "
                           "has none of; it is left out", self.url, path, dropped[:10])
        return {key: value for key, value in built.items() if key in owned} if dropped else built

    def parameter_ids(self, path: StatePath) -> list[Any] | None:
        """The parameter ids of the optimizer whose `state` is at `path` (its state dict's
        `param_groups`), or None when `path` is no optimizer's `state`."""
        parent, _, key = path.rpartition("/")
        found = self.target.stateful.get(parent)
        groups = _parameter_groups(*found) if key == "state" and found is not None else None
        return None if groups is None else [number for group in groups for number in group]


def _twin(key: Any) -> str | int | None:
    """The other key of `key`'s path component: an int's digits, the int a str spells
    (exactly, as `str(int)` would), else None. A checkpoint imported from a flat file holds
    int keys as str; a target may hold as int what a checkpoint holds as str, and the
    reverse."""
    if type(key) is int:
        return str(key)
    if type(key) is not str:
        return None
    digits = key[1:] if key[:1] == "-" else key
    if not (digits.isascii() and digits.isdecimal() and len(digits) <= MAX_INT_DIGITS):
        return None
    number = int(key)
    return number if str(number) == key else None


def _saved_child(saved_children: Mapping[Any, Node], key: Any) -> Node:
    """The saved node at a live dict's `key`: under that key, else under its twin (the same
    path, see `_twin`), else None."""
    child = saved_children.get(key)
    if child is None and saved_children:
        child = saved_children.get(_twin(key))
    return child


def _like(live: Any, value: Any) -> Any:
    """The loaded `value` of a live leaf: a member of the live value's Enum when it is one
    and `value` its value's type (an IntEnum, IntFlag or str-mixin Enum member is saved as
    its int or str), so that restoring in place keeps `state["phase"] is Phase.DECAY`; else
    `value` itself."""
    if isinstance(live, enum.Enum) and type(value) is type(live.value):
        try:
            return type(live)(value)
        except ValueError:  # no member of that value now
            return value
    return value


def merge_skeletons(skeletons: Sequence[Node]) -> Node:
    """The skeleton of a distributed save from every rank's own (in rank order): they must be
    equal except inside `per_rank` nodes, whose ranks are gathered into one node.

    Raises:
        UnsupportedLeaf: two ranks' states differ outside a `PerRank`; names the path.
    """
    return _merge(list(skeletons), "")


def _merge(nodes: list[Node], path: StatePath) -> Node:
    first = nodes[0]
    tags = [next(iter(n)) if isinstance(n, dict) else n for n in nodes]
    if isinstance(first, dict) and all(isinstance(n, dict) for n in nodes) and len(set(tags)) == 1:
        ((tag, body),) = first.items()
        bodies = [n[tag] for n in nodes]
        if tag == "per_rank":
            return {"per_rank": [item for b in bodies for item in b]}
        if tag == "stateful":
            return {"stateful": _merge(bodies, path)}
        if all(len(b) == len(body) for b in bodies):
            if tag == "dict" and all([k for k, _ in b] == [k for k, _ in body] for b in bodies):
                return {"dict": [
                    [key, _merge([b[i][1] for b in bodies], join(path, key))]
                    for i, (key, _) in enumerate(body)
                ]}
            if tag in ("list", "tuple"):
                return {tag: [_merge([b[i] for b in bodies], join(path, i))
                              for i in range(len(body))]}
    elif all(n == first for n in nodes):
        return first
    differs = next(rank for rank, n in enumerate(nodes) if n != first)
    raise UnsupportedLeaf(
        f"the state differs between rank 0 and rank {differs} at {path or '<root>'!r}"
        f"{_difference(first, nodes[differs], differs)}: every rank must save the same tree "
        "(same keys and containers); wrap values that differ per rank in sp.PerRank",
        path=path,
    )


def _difference(node: Node, other: Node, rank: int) -> str:
    """What tells two ranks' dict nodes apart, for `_merge`'s error: the keys only one has,
    or their order; nothing for other nodes."""
    if not (isinstance(node, dict) and isinstance(other, dict)
            and "dict" in node and "dict" in other):
        return ""
    keys, other_keys = [k for k, _ in node["dict"]], [k for k, _ in other["dict"]]
    only = [k for k in keys if k not in other_keys][:5]
    other_only = [k for k in other_keys if k not in keys][:5]
    if not (only or other_only):
        return f" (the same keys in another order: {keys[:5]} and {other_keys[:5]})"
    return (f" (keys only rank 0 has: {only}; only rank {rank} has: {other_only})")


def per_rank_paths(node: Node, path: StatePath = "") -> dict[StatePath, list[int]]:
    """Paths of the `per_rank` nodes in a skeleton, with the ranks each holds."""
    found: dict[StatePath, list[int]] = {}
    if not isinstance(node, dict):
        return found
    ((tag, body),) = node.items()
    if tag == "per_rank":
        found[path] = [rank for rank, _ in body]
    elif tag == "stateful":
        found.update(per_rank_paths(body, path))
    else:
        pairs = body if tag == "dict" else enumerate(body)
        for key, child in pairs:
            if isinstance(child, dict):  # leaves (str) hold no per_rank node
                found.update(per_rank_paths(child, join(path, key)))
    return found


def nodes_at(node: Node, paths: Collection[StatePath]) -> dict[StatePath, Node]:
    """The nodes of a skeleton at those of `paths` it has (a stateful object's node as its
    state dict's), walking only the containers on the way to them."""
    ahead = {path[:end] for path in paths for end in _slashes(path)}
    wanted = set(paths)
    found: dict[StatePath, Node] = {}

    def walk(node: Node, path: StatePath) -> None:
        if isinstance(node, dict) and "stateful" in node:
            node = node["stateful"]
        if path in wanted:
            found[path] = node
        if (path not in ahead and path) or not isinstance(node, dict):
            return
        ((tag, body),) = node.items()
        for key, child in body if tag in ("dict", "per_rank") else enumerate(body):
            child_path = join(path, key)
            if child_path in ahead or child_path in wanted:
                walk(child, child_path)

    if wanted:
        walk(node, "")
    return found


def _slashes(path: StatePath) -> Iterator[int]:
    """Where `path`'s components end before its last one (the lengths of its ancestors'
    paths)."""
    end = path.find("/")
    while end != -1:
        yield end
        end = path.find("/", end + 1)


def leaf_paths(node: Node) -> list[StatePath]:
    """The leaf paths of a skeleton, in tree order."""
    if isinstance(node, str):
        return [node]
    if not isinstance(node, dict):
        return []
    ((tag, body),) = node.items()
    if tag == "stateful":
        return leaf_paths(body)
    return [path for child in _children(tag, body) for path in leaf_paths(child)]
