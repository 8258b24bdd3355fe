"""The tree layer: flatten/rebuild round trips (hypothesis: nested dicts, lists and tuples with
str and int keys, keys holding '/' and '%'), path escaping, the errors naming a path
(duplicate paths, unsupported leaves and keys, cycles), select() prefix and glob semantics,
and write_back into live states (containers in place, stateful objects, a fresh optimizer, keys
replaced as saved), the open keys of modules and optimizers, and nodes_at;
sp.PerRank values under their rank, merging the trees of several ranks."""

from __future__ import annotations

import collections
import enum
import fnmatch
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import safepoint as sp
from safepoint import _tree
from safepoint._tree import (
    escape_key,
    flatten,
    join,
    leaf_paths,
    merge_skeletons,
    nodes_at,
    open_keys,
    per_rank_paths,
    rebuild,
    replaces,
    select,
    selects,
    write_back,
)
from safepoint.errors import UnsupportedLeaf

# -- round trips --------------------------------------------------------------------------------

URL = "ckpt/step-5"  # the checkpoint write_back names in its errors
KEYS = st.one_of(st.text(alphabet="ab/%2F.", max_size=4), st.integers(-3, 30))
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
)
TREES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(KEYS, children, max_size=4),
    ),
    max_leaves=25,
)


def _keys_distinct_as_strings(tree: Any) -> bool:
    """False when a dict holds an int key and its str twin (1 and "1"), which share a path."""
    if isinstance(tree, dict):
        return len({str(k) for k in tree}) == len(tree) and all(
            _keys_distinct_as_strings(v) for v in tree.values()
        )
    if isinstance(tree, list | tuple):
        return all(_keys_distinct_as_strings(v) for v in tree)
    return True


def _count_leaves(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_count_leaves(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_count_leaves(v) for v in tree)
    return 1


def _same(a: Any, b: Any) -> bool:
    """Equality that also compares types (1 != True != 1.0, list != tuple, 1 != "1" keys)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            type(k1) is type(k2) for k1, k2 in zip(a, b, strict=True)
        ) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=200, deadline=None)
@given(TREES)
def test_flatten_rebuild_round_trip(tree: Any) -> None:
    assume(_keys_distinct_as_strings(tree))
    flat = flatten(tree)
    assert len(flat.leaves) == _count_leaves(tree), "every leaf gets its own path"
    assert _same(rebuild(flat.skeleton, flat.leaves), tree)
    # The manifest stores the skeleton as JSON: int keys and tuples must survive that.
    skeleton = json.loads(json.dumps(flat.skeleton))
    assert _same(rebuild(skeleton, flat.leaves), tree)


@settings(max_examples=100, deadline=None)
@given(st.lists(KEYS, min_size=1, max_size=4))
def test_path_components_are_unambiguous(keys: list[str | int]) -> None:
    """A path splits on '/' into exactly one escaped component per key."""
    tree: Any = "leaf"
    for key in reversed(keys):
        tree = {key: tree}
    (path,) = flatten(tree).leaves
    assert path.split("/") == [escape_key(k) for k in keys]
    unescaped = [
        "" if c == "%" else c.replace("%2F", "/").replace("%25", "%") for c in path.split("/")
    ]
    assert unescaped == [str(k) for k in keys]


def test_escape_key() -> None:
    assert escape_key("a/b") == "a%2Fb"
    assert escape_key("100%") == "100%25"
    assert escape_key("%2F") == "%252F"
    assert escape_key(3) == "3"
    assert escape_key("") == "%"
    assert join("", "x") == "x"
    assert join("a/b", "c/d") == "a/b/c%2Fd"


def test_paths_of_a_training_like_state() -> None:
    flat = flatten({"model": {"layer.0.weight": 1}, "optim": {"state": {0: {"step": 2}}}})
    assert list(flat.leaves) == ["model/layer.0.weight", "optim/state/0/step"]
    assert flat.kinds == {"model/layer.0.weight": "value", "optim/state/0/step": "value"}


def test_empty_containers_survive() -> None:
    tree = {"d": {}, "l": [], "t": (), "n": [{}, ()]}
    flat = flatten(tree)
    assert flat.leaves == {}
    assert _same(rebuild(flat.skeleton, {}), tree)


def test_rebuild_subset_leaves_out_missing_leaves() -> None:
    tree = {"a": {"x": 1, "y": 2}, "b": [3, 4], "e": {}}
    flat = flatten(tree)
    assert rebuild(flat.skeleton, {"a/x": 1}, keep_empty=False) == {"a": {"x": 1}}
    assert rebuild(flat.skeleton, {"b/1": 4}, keep_empty=True) == {"b": [4], "e": {}}
    assert rebuild(flat.skeleton, {}, keep_empty=False) == {}


_WITH_EMPTY = {"a": {"x": 1, "e": {}, "l": [], "n": {"d": {}, "k": 5}}, "b": {"y": 2, "e": {}},
               "w[0]": {"v": 3, "e": {}}, "w0": {"e": {}}, 7: {"z": [(), 4], "e": {}}}


@pytest.mark.parametrize(("keys", "expected"), [
    (["a"], {"a": _WITH_EMPTY["a"]}),
    (["a/n/"], {"a": {"n": {"d": {}, "k": 5}}}),
    (["a/x", "7/"], {"a": {"x": 1}, 7: {"z": [(), 4], "e": {}}}),  # an int key: its digits
    (["a/*"], {"a": _WITH_EMPTY["a"]}),  # a glob: what it matches, empty or not
    (["a/[xe]"], {"a": {"x": 1, "e": {}}}),
    (["a/x", "b/y"], {"a": {"x": 1}, "b": {"y": 2}}),  # what they do not select is left out
    (["7/z/1"], {7: {"z": [(), 4]}}),  # an item before it keeps its place, as before
    ([""], _WITH_EMPTY),
    (["w[0]"], {"w[0]": {"v": 3, "e": {}}}),  # a path as it is, not a glob matching w0
])
def test_rebuild_keeps_the_empty_containers_the_keys_select(
    keys: list[str], expected: dict[Any, Any]
) -> None:
    """A load with keys= left out every container saved empty, those inside the subtree
    the keys selected too (a fresh optimizer's `state: {}`, loaded with keys=['optim/']):
    only those outside it are left out."""
    flat = flatten(_WITH_EMPTY)
    selected = select(flat.leaves, keys)
    values = {path: flat.leaves[path] for path in selected}
    assert rebuild(flat.skeleton, values, keep_empty=selects(keys, selected)) == expected


def test_leaf_at_the_root() -> None:
    flat = flatten(5)
    assert flat.leaves == {"": 5}
    assert rebuild(flat.skeleton, flat.leaves) == 5


def test_empty_string_key_does_not_collide_with_its_parent() -> None:
    """{"": {"x": 1}} and {"x": 2} are different keys; both must get their own path (an empty
    key is spelled `%`, so it can neither vanish into its parent's path nor meet a real key)."""
    tree = {"": {"x": 1}, "x": 2, "%": {"": 3}}
    flat = flatten(tree)
    assert list(flat.leaves) == ["%/x", "x", "%25/%"]
    assert rebuild(flat.skeleton, flat.leaves) == tree


# -- errors naming a path ------------------------------------------------------------------------


def test_int_key_and_its_str_twin_is_an_error() -> None:
    with pytest.raises(UnsupportedLeaf, match="same path 'opt/1'") as excinfo:
        flatten({"opt": {1: "a", "1": "b"}})
    assert excinfo.value.path == "opt/1"


def test_unsupported_leaf_names_its_path() -> None:
    class Opaque:
        pass

    with pytest.raises(UnsupportedLeaf, match=r"Opaque.*'a/b/1'") as excinfo:
        flatten({"a": {"b": [0, Opaque()]}})
    assert excinfo.value.path == "a/b/1"
    assert isinstance(excinfo.value, TypeError)
    assert "sp.Pickled" in str(excinfo.value)


def test_pickled_wrapper_is_a_leaf() -> None:
    class Opaque:
        pass

    flat = flatten({"x": sp.Pickled(Opaque())})
    assert flat.kinds == {"x": "pickle"}


@pytest.mark.parametrize("key", [(1, 2), 1.5, b"k", True, None])
def test_unsupported_key_names_its_container(key: Any) -> None:
    with pytest.raises(UnsupportedLeaf, match="only str and int keys") as excinfo:
        flatten({"outer": {key: 1}})
    assert excinfo.value.path == "outer"


def test_cycle_is_an_error_naming_where_it_closes() -> None:
    state: dict[str, Any] = {"a": {"b": []}}
    state["a"]["b"].append(state["a"])
    with pytest.raises(UnsupportedLeaf, match="refers to itself") as excinfo:
        flatten(state)
    assert excinfo.value.path == "a/b/0"


def test_shared_subtree_is_not_a_cycle() -> None:
    shared = [1, 2]
    flat = flatten({"x": shared, "y": shared})
    assert list(flat.leaves) == ["x/0", "x/1", "y/0", "y/1"]


def test_an_int_key_too_long_to_print_is_refused_by_path() -> None:
    """An int value over Python's 4300 digits was refused by path, the same int as a dict
    key escaped as a bare ValueError from str(key)."""
    with pytest.raises(UnsupportedLeaf, match="under 'table' is an int too long") as info:
        flatten({"table": {10**5000: 1}})
    assert info.value.path == "table"


def test_an_int_key_over_the_formats_digits_is_refused_whatever_the_process_allows() -> None:
    """A process that lifted Python's limit (sys.set_int_max_str_digits(0)) committed a key
    of 5000 digits, which every reader with the default limit then called damaged."""
    default = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(UnsupportedLeaf, match="more than 4300 digits"):
            flatten({"table": {10**5000: 1}})
        assert flatten({"table": {10**4299: 1}}).leaves == {f"table/{10**4299}": 1}
    finally:
        sys.set_int_max_str_digits(default)


# -- large dicts, recorded in bulk ---------------------------------------------------------------


class _Key(str):
    """A str subclass: not a key that can be saved."""


def _big(make: Any) -> dict[Any, Any]:
    return {f"k{i}": make(i) for i in range(40)}


BIG_TREES = {
    "leaves of several types": {"m": {**_big(lambda i: [i, "s", None, 1.5][i % 4]), "b": b"x"}},
    "tensors": {"model": _big(lambda i: torch.full((1,), float(i))), "n": _big(float)},
    "escaped keys": {"d": {**_big(int), "a/b": 1, "50%": 2}},
    "an empty key": {"d": {**_big(int), "": 3}},
    "int keys": {"state": {**{i: i for i in range(30)}, "x": 1}},
    "a container among leaves": {"d": {**_big(int), "sub": {"z": 1}}},
    "a leaf at the root level": _big(str),
}


@pytest.mark.parametrize("name", list(BIG_TREES))
def test_large_dicts_flatten_as_one_leaf_at_a_time(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tree = BIG_TREES[name]
    bulk = flatten(tree)
    monkeypatch.setattr(_tree, "_BULK", 1 << 30)  # every dict walked leaf by leaf
    single = flatten(tree)
    assert list(bulk.leaves.items()) == list(single.leaves.items())
    assert list(bulk.kinds.items()) == list(single.kinds.items())
    assert bulk.skeleton == single.skeleton
    assert json.loads(json.dumps(bulk.skeleton)) == bulk.skeleton  # JSON as it is
    assert _same(rebuild(bulk.skeleton, bulk.leaves), tree)


def test_large_dicts_meeting_at_one_path_are_an_error() -> None:
    with pytest.raises(UnsupportedLeaf, match="same path '1/k0'") as excinfo:
        flatten({1: _big(int), "1": _big(int)})
    assert excinfo.value.path == "1/k0"


@pytest.mark.parametrize("bad", [_Key("sub"), 2.5])
def test_large_dict_with_a_key_that_cannot_be_saved_names_it(bad: Any) -> None:
    with pytest.raises(UnsupportedLeaf, match="only str and int keys") as excinfo:
        flatten({"outer": {**_big(int), bad: 1}})
    assert excinfo.value.path == "outer"


def test_large_dict_with_an_unsupported_leaf_names_the_first() -> None:
    class Opaque:
        pass

    with pytest.raises(UnsupportedLeaf, match="'d/k1'") as excinfo:
        flatten({"d": {**_big(int), "k1": Opaque(), "k2": Opaque()}})
    assert excinfo.value.path == "d/k1"


def _variants() -> list[tuple[str, Any]]:
    """A state, then the changes a series of saves may meet, one after another."""
    model = _big(lambda i: torch.full((1,), float(i)))
    return [
        ("first", {"model": model, "opt": _big(int)}),
        ("same", {"model": model, "opt": _big(int)}),
        ("new values", {"model": {k: v + 1 for k, v in model.items()}, "opt": _big(int)}),
        ("a key added", {"model": {**model, "x": model["k0"]}, "opt": _big(int)}),
        ("a key renamed", {"model": {("z" if k == "k2" else k): v for k, v in model.items()},
                           "opt": _big(int)}),
        ("keys reordered", {"model": dict(reversed(model.items())), "opt": _big(int)}),
        ("a leaf of another kind", {"model": {**model, "k7": 7}, "opt": _big(int)}),
        ("a key to escape", {"model": {**model, "a/b": model["k1"]}, "opt": _big(int)}),
        ("kinds swapped", {"model": _big(int), "opt": model}),
        ("back to the first", {"model": model, "opt": _big(int)}),
    ]


def test_a_memo_flattens_a_series_of_states_as_each_alone() -> None:
    memo: _tree.Memo = {}
    bodies: dict[str, Any] = {}
    for name, tree in _variants():
        flat = flatten(tree, memo=memo)
        alone = flatten(tree)
        assert list(flat.leaves.items()) == list(alone.leaves.items()), name
        assert list(flat.kinds.items()) == list(alone.kinds.items()), name
        assert flat.skeleton == alone.skeleton, name
        bodies[name] = flat.skeleton["dict"][0][1]["dict"]  # the "model" dict's node
    assert bodies["same"] is bodies["first"]  # reused, not made again
    assert bodies["a key renamed"] is not bodies["same"]


def test_a_memo_does_not_let_a_twin_or_a_bad_key_through() -> None:
    memo: _tree.Memo = {}
    flatten({"1": _big(int)}, memo=memo)
    with pytest.raises(UnsupportedLeaf, match="same path '1/k0'"):
        flatten({1: _big(int), "1": _big(int)}, memo=memo)
    flatten({"d": _big(int)}, memo=memo)
    subclassed = {(_Key(k) if k == "k3" else k): v for k, v in _big(int).items()}
    with pytest.raises(UnsupportedLeaf, match="only str and int keys"):
        flatten({"d": subclassed}, memo=memo)  # equal to the memo's keys, but not a str


# -- select --------------------------------------------------------------------------------------

PATHS = [
    "model/layer1.0.weight",
    "model/layer1.0.bias",
    "model/head/weight",
    "model2/weight",
    "optim/state/0/exp_avg",
    "optim/state/1/exp_avg",
    "optim/param_groups/0/lr",
    "step",
]


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (None, PATHS),
        ([], []),
        ([""], PATHS),
        (["model"], PATHS[:3]),
        (["model/"], PATHS[:3]),
        (["model/head"], ["model/head/weight"]),
        (["model/layer1"], []),  # a prefix is whole components, not characters
        (["step"], ["step"]),
        (["model/*.weight"], ["model/layer1.0.weight"]),
        (["model/*weight"], ["model/layer1.0.weight", "model/head/weight"]),  # '*' spans '/'
        (["optim/state/*"], PATHS[4:6]),
        (["optim/*/0"], ["optim/state/0/exp_avg", "optim/param_groups/0/lr"]),
        (["model?"], ["model2/weight"]),
        (["*/weight"], ["model/head/weight", "model2/weight"]),
        (["step", "model2"], ["model2/weight", "step"]),
    ],
)
def test_select(keys: list[str] | None, expected: list[str]) -> None:
    assert select(PATHS, keys) == expected


_PART = st.sampled_from(["a", "b", "ab", "0", "1", "a*", "[ab]"])


@given(st.lists(st.lists(_PART, min_size=1, max_size=4).map("/".join), max_size=12),
       st.lists(st.one_of(st.lists(_PART, max_size=3).map("/".join),
                          st.lists(_PART, max_size=3).map("/".join).map(lambda k: k + "/"),
                          st.sampled_from(["a*", "*b", "a/?", "*/0", "[ab]"])), max_size=6))
def test_select_is_each_key_matched_against_each_path(paths: list[str], keys: list[str]) -> None:
    """Looking prefixes up by the paths' ancestors selects what matching every key against
    every path selects (one key being a path, a prefix of whole components, or a glob that
    names no path as it is)."""
    def named(path: str, key: str) -> bool:
        prefix = key.rstrip("/")
        return not prefix or path == prefix or path.startswith(prefix + "/")

    def matches(path: str, key: str) -> bool:
        if named(path, key):
            return True
        if not any(c in key for c in "*?[") or any(named(p, key) for p in paths):
            return False
        parts = path.split("/")
        return any(fnmatch.fnmatchcase("/".join(parts[:n]), key.rstrip("/"))
                   for n in range(len(parts), 0, -1))

    assert select(paths, keys) == [p for p in paths if any(matches(p, k) for k in keys)]


def test_a_key_naming_a_path_with_glob_characters_selects_that_path() -> None:
    """A path as `sp.info` lists it selects itself though it holds glob characters: keys=
    ["w[0]"] selected `w0` (the glob's match) and not `w[0]`, and no key could select
    `metrics/acc[top1]` alone; a key that names no path is still a glob."""
    paths = ["w[0]", "w0", "metrics/acc[top1]", "metrics/acc[top5]", "metrics/acct", "a*",
             "ab", "c[1]/x", "c1/x"]
    assert select(paths, ["w[0]"]) == ["w[0]"]
    assert select(paths, ["metrics/acc[top1]"]) == ["metrics/acc[top1]"]
    assert select(paths, ["a*"]) == ["a*"]
    assert select(paths, ["c[1]/"]) == ["c[1]/x"]  # a prefix of a path, as it is
    assert select(paths, ["metrics/acc[top]"]) == ["metrics/acct"]  # names no path: a glob
    assert select(paths, ["w[0]", "c?/x"]) == ["w[0]", "c1/x"]
    assert select(["w0", "ab"], ["w[0]", "a*"]) == ["w0", "ab"]


def test_a_load_selects_a_listed_path_with_glob_characters(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    sp.save(url, {"w[0]": torch.tensor([1.0]), "w0": torch.tensor([2.0])})
    assert "w[0]" in [entry.path for entry in sp.info(url).entries]
    loaded = sp.load(url, keys=["w[0]"])
    assert list(loaded) == ["w[0]"] and torch.equal(loaded["w[0]"], torch.tensor([1.0]))


@pytest.mark.parametrize("keys", [[0], [None], [b"a"], ["a", 0], 5])
def test_keys_that_are_not_str_are_refused(keys: Any) -> None:
    """keys=[0] (a root list's index) or a None from a config raised TypeError "'int' object
    is not iterable"; keys="a" was already refused saying what to pass."""
    with pytest.raises(sp.SafepointError, match="keys= takes path prefixes or globs as str"):
        select(PATHS, keys)


def test_keys_are_taken_from_an_iterator_once() -> None:
    assert _tree.checked_keys(k for k in ["model/", "step"]) == ["model/", "step"]
    assert _tree.checked_keys(None) is None
    with pytest.raises(sp.SafepointError, match=r"keys=\['step'\]"):
        _tree.checked_keys("step")


# -- write_back ----------------------------------------------------------------------------------


class Counter:
    """A user's stateful object."""

    def __init__(self) -> None:
        self.count = 0
        self.loads: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads.append(dict(state))
        self.count = state["count"]


Pair = collections.namedtuple("Pair", "first second")


def _restore(live: Any, saved_state: Any, values: dict[str, Any] | None = None) -> Any:
    saved = flatten(saved_state)
    target = flatten(live)
    return write_back(live, target, saved.skeleton,
                      saved.leaves if values is None else values, URL)


def test_write_back_replaces_values_in_place() -> None:
    inner_list = [1, 2]
    inner_dict = {"x": 1}
    live = {"l": inner_list, "d": inner_dict, "t": (1, 2), "p": Pair(1, 2), "same": (7, 8)}
    saved = {"l": [10, 20], "d": {"x": 11}, "t": (3, 4), "p": Pair(5, 6), "same": (7, 8)}
    same = live["same"]
    result = _restore(live, saved)
    assert result is live
    assert live["l"] is inner_list and inner_list == [10, 20]
    assert live["d"] is inner_dict and inner_dict == {"x": 11}
    assert live["t"] == (3, 4)
    assert type(live["p"]) is Pair and live["p"] == Pair(5, 6)
    assert live["same"] is same, "an unchanged tuple is kept as is"


def test_write_back_tuple_root_returns_a_new_tuple() -> None:
    live = (1, [2])
    result = _restore(live, (5, [6]))
    assert result == (5, [6])
    assert result[1] is live[1]


def test_write_back_leaves_unloaded_values_alone() -> None:
    live = {"a": 1, "b": 2}
    saved = flatten({"a": 10, "b": 20})
    write_back(live, flatten(live), saved.skeleton, {"a": 10}, URL)
    assert live == {"a": 10, "b": 2}


def test_a_load_state_dict_that_refuses_is_a_state_mismatch_naming_path_and_checkpoint(
) -> None:
    """A stateful object's own refusal (a sampler over a dataset of another size, an
    optimizer with other parameter groups) names where it sits in the state and which
    checkpoint it came from."""

    class Picky(Counter):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise ValueError("drew from 10 samples and this one from 12")

    live = {"data": {"train": Picky()}}
    saved = flatten({"data": {"train": Counter()}})
    with pytest.raises(sp.StateMismatch, match=r"ckpt/step-5: 'data/train' \(Picky\) refused "
                       r"the checkpoint's state: drew from 10 samples") as raised:
        write_back(live, flatten(live), saved.skeleton, {"data/train/count": 0}, URL)
    assert raised.value.url == URL and raised.value.mismatched[0].startswith("data/train: ")
    assert isinstance(raised.value.__cause__, ValueError)


def test_write_back_calls_load_state_dict() -> None:
    live = {"counter": Counter(), "other": Counter()}
    saved_counter = Counter()
    saved_counter.count = 42
    saved = flatten({"counter": saved_counter, "other": Counter()})
    target = flatten(live)
    write_back(live, target, saved.skeleton, {"counter/count": 42}, URL)
    assert live["counter"].count == 42
    assert live["counter"].loads == [{"count": 42}]
    assert live["other"].loads == [], "a stateful object with nothing loaded is not touched"


def test_write_back_into_a_fresh_optimizer(make_training_state: Any) -> None:
    trained = make_training_state(seed=1, steps=3)
    fresh = make_training_state(seed=2, steps=0)
    assert fresh["optim"].state_dict()["state"] == {}
    saved = flatten({"optim": trained["optim"]})
    target = flatten({"optim": fresh["optim"]})
    # The checkpoint's optimizer state is unexpected for the target, yet lies inside a
    # stateful object: it is built from the saved skeleton and handed to load_state_dict.
    assert any(p.startswith("optim/state/") for p in saved.leaves)
    assert not any(p.startswith("optim/state/") for p in target.leaves)
    write_back({"optim": fresh["optim"]}, target, saved.skeleton, saved.leaves, URL)
    want = trained["optim"].state_dict()
    got = fresh["optim"].state_dict()
    assert sorted(got["state"]) == sorted(want["state"])
    for index, slots in want["state"].items():
        for name, value in slots.items():
            assert torch.equal(got["state"][index][name], value), (index, name)
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]


def test_write_back_replaces_a_replaced_key_as_saved() -> None:
    """At a replaced key the value is built from the checkpoint alone: what the live value
    has and the checkpoint lacks (an optimizer's state for a parameter that had none when it
    was saved, a longer history list) is gone; next to it, live keys stay."""

    class Holder(Counter):
        def __init__(self) -> None:
            super().__init__()
            self.state: dict[int, Any] = {0: {"m": 1.0}, 1: {"m": 2.0, "hist": [1, 2, 3]}}
            self.kept = {"a": 1}

        def state_dict(self) -> dict[str, Any]:
            return {"count": self.count, "state": self.state, "kept": self.kept}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.loads.append(state)

    live = Holder()
    saved = flatten({"h": {"count": 5, "state": {1: {"m": 9.0, "hist": [7]}}, "kept": {}}})
    target = flatten({"h": live})
    write_back({"h": live}, target, saved.skeleton, saved.leaves, URL, replaced=["h/state"])
    assert live.loads == [{"count": 5, "state": {1: {"m": 9.0, "hist": [7]}}, "kept": {"a": 1}}]


def _with_str_keys(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict as a flat file (safetensors) gives it back: int keys as str."""
    return {"state": {str(index): dict(slots) for index, slots in state_dict["state"].items()},
            "param_groups": state_dict["param_groups"]}


@pytest.mark.parametrize("steps", [0, 2], ids=["fresh", "with-state"])
def test_an_optimizers_state_saved_under_str_ids_is_given_back_under_its_ints(
    make_training_state: Any, steps: int
) -> None:
    """torch's Optimizer keeps a state key that is no parameter id as it is, and the
    parameters start over: a str spelling of an id is that id again, whether the target
    optimizer holds state there (its own int keys) or none yet (its `param_groups`' ids)."""
    trained = make_training_state(seed=1, steps=3)
    want = trained["optim"].state_dict()
    saved = flatten({"optim": _with_str_keys(want)})
    live = make_training_state(seed=2, steps=steps)
    target = flatten({"optim": live["optim"]})
    write_back({"optim": live["optim"]}, target, saved.skeleton, saved.leaves, URL,
               replaced=["optim/state"])
    got = live["optim"].state_dict()["state"]
    assert sorted(got) == sorted(want["state"]) == list(range(4))
    for index, slots in want["state"].items():
        for name, value in slots.items():
            assert torch.equal(got[index][name], value), (index, name)


def test_an_optimizers_state_keeps_only_its_own_parameters(
    make_training_state: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved state under ids no parameter of the optimizer has (a group added after the
    one it was built with, or what an earlier load left under bare ids) is left out, with
    a warning: torch's `load_state_dict` would keep it under those ids in `optimizer.state`,
    in every later state dict, where a group added later collides with it (found by a
    review). Strings that spell such an id are left out too."""
    trained = make_training_state(seed=1, steps=3)
    want = trained["optim"].state_dict()
    extra = {**want["state"], 4: dict(want["state"][0]), "5": dict(want["state"][1])}
    saved = flatten({"optim": {"state": extra, "param_groups": want["param_groups"]}})
    live = make_training_state(seed=2, steps=0)
    target = flatten({"optim": live["optim"]})
    with caplog.at_level("WARNING", logger="safepoint._tree"):
        write_back({"optim": live["optim"]}, target, saved.skeleton, saved.leaves, URL,
                   replaced=["optim/state"])
    assert all(isinstance(key, torch.Tensor) for key in live["optim"].state)
    assert sorted(live["optim"].state_dict()["state"]) == [0, 1, 2, 3]
    assert "'optim/state' holds state for parameters [4, '5']" in caplog.text
    assert _tree.parameter_groups(target.stateful) == {"optim/param_groups": [[0, 1, 2, 3]]}


def test_a_replaced_dicts_str_keys_become_ints_only_where_the_target_may_hold_them() -> None:
    """A str key spelling one of the live dict's int keys is that int; a key that spells no
    int held there stays as saved."""

    class Holder(Counter):
        def __init__(self) -> None:
            super().__init__()
            self.state: dict[Any, Any] = {0: 1.0, 5: 2.0, "x": 3.0}

        def state_dict(self) -> dict[str, Any]:
            return {"state": self.state}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.loads.append(state)

    live = Holder()
    saved = flatten({"h": {"state": {"0": 9.0, "05": 8.0, "7": 7.0, "x": 6.0, 5: 5.0}}})
    write_back({"h": live}, flatten({"h": live}), saved.skeleton, saved.leaves, URL,
               replaced=["h/state"])
    assert live.loads == [{"state": {0: 9.0, "05": 8.0, "7": 7.0, "x": 6.0, 5: 5.0}}]


def test_an_optimizer_exported_to_safetensors_restores_into_an_optimizer(
    tmp_path: Path, make_training_state: Any
) -> None:
    """The import gives its int keys back as str; a restore into an optimizer, fresh or with
    state of its own, attaches every moment to its parameter again."""
    trained = make_training_state(seed=1, steps=3)
    sp.save(tmp_path / "src", {"model": trained["model"], "optim": trained["optim"]})
    sp.export_checkpoint(tmp_path / "src", tmp_path / "x.safetensors")
    sp.import_checkpoint(tmp_path / "x.safetensors", tmp_path / "imported")
    want = trained["optim"].state_dict()["state"]
    for steps in (0, 2):
        live = make_training_state(seed=2, steps=steps)
        sp.load(tmp_path / "imported", into={"model": live["model"], "optim": live["optim"]})
        got = live["optim"].state_dict()["state"]
        assert sorted(got) == sorted(want), steps
        for index, slots in want.items():
            for name, value in slots.items():
                assert torch.equal(got[index][name], value), (steps, index, name)


def test_open_keys_of_modules_optimizers_and_other_objects() -> None:
    """A module's extra state (at any depth) and an optimizer's `state` are open and taken
    as saved; keys a class declares open take saved keys beside the live ones; any other
    object judges what it is given (None)."""

    class Extra(torch.nn.Module):
        def get_extra_state(self) -> Any:
            return {"n": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    model = torch.nn.Sequential(Extra(), torch.nn.Sequential(torch.nn.Linear(1, 1), Extra()))
    assert open_keys(model, model.state_dict()) == ("0._extra_state", "1.1._extra_state")
    assert open_keys(model[1][1], model[1][1].state_dict()) == ("_extra_state",)
    assert open_keys(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1).state_dict()) == ()
    adam = torch.optim.Adam(model.parameters())
    assert open_keys(adam, adam.state_dict()) == ("state",)
    assert open_keys(Counter(), Counter().state_dict()) is None
    rng = sp.RNGState()
    assert open_keys(rng, rng.state_dict()) == ("torch", "cuda")
    assert replaces(model) and replaces(adam) and not replaces(rng)


def test_optional_paths_of_optimizers_schedulers_and_declared_keys() -> None:
    """An optimizer's settings in each param group (not its `params`), every top-level key of
    an LR scheduler but `last_epoch` (ReduceLROnPlateau too) and the keys a class declares
    may be missing from a checkpoint; nothing of a module or another object may."""
    model = torch.nn.Linear(2, 2)
    adamw = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 1.0}])
    state = {"a/b": adamw, "sched": torch.optim.lr_scheduler.StepLR(adamw, 2),
             "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(adamw),
             "rng": sp.RNGState(), "model": model, "count": Counter()}
    flat = flatten(state)
    found = _tree.optional_paths(flat.stateful)
    settings = [key for key in adamw.state_dict()["param_groups"][0] if key != "params"]
    assert "decoupled_weight_decay" in settings
    assert found == (
        [f"a%2Fb/param_groups/{group}/{key}" for group in (0, 1) for key in settings]
        + [f"sched/{key}" for key in state["sched"].state_dict() if key != "last_epoch"]
        + [f"plateau/{key}" for key in state["plateau"].state_dict() if key != "last_epoch"]
        + ["rng/torch", "rng/cuda"])


def test_nodes_at_finds_skeleton_nodes_by_path() -> None:
    """Nodes of containers, leaves and stateful objects' state dicts by path; paths the
    skeleton lacks are left out."""
    state = {"optim": Counter(), "d": {"a/b": [1, {"x": 2}]}}
    skeleton = flatten(state).skeleton
    found = nodes_at(skeleton, ["optim", "optim/count", "d/a%2Fb/1", "d/zz", "d/a%2Fb/1/x"])
    assert found == {"optim": {"dict": [["count", "optim/count"]]}, "optim/count": "optim/count",
                     "d/a%2Fb/1": {"dict": [["x", "d/a%2Fb/1/x"]]},
                     "d/a%2Fb/1/x": "d/a%2Fb/1/x"}
    assert nodes_at(skeleton, []) == {}


def test_write_back_scheduler_and_model(make_training_state: Any) -> None:
    trained = make_training_state(seed=1, steps=3)
    live = make_training_state(seed=2, steps=0)
    saved = flatten({"model": trained["model"], "sched": trained["sched"]})
    values = {p: (v.clone() if isinstance(v, torch.Tensor) else v) for p, v in saved.leaves.items()}
    write_back({"model": live["model"], "sched": live["sched"]},
               flatten({"model": live["model"], "sched": live["sched"]}), saved.skeleton, values,
               URL)
    for (name, a), (_, b) in zip(trained["model"].state_dict().items(),
                                 live["model"].state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert live["sched"].state_dict()["last_epoch"] == 3


class Phase(enum.IntEnum):
    WARMUP = 1
    DECAY = 2


class Mode(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Access(enum.IntFlag):
    READ = 1
    WRITE = 2


def test_write_back_keeps_a_live_enum_member_an_enum_member(tmp_path: Path) -> None:
    """IntEnum, IntFlag and str-mixin Enum members save as their int or str; restoring in
    place put that bare int or str in the member's place, so `state["phase"] is
    Phase.DECAY` and `.name` broke after a resume. A value that no member has stays plain."""
    live = {"phase": Phase.WARMUP, "mode": Mode.TRAIN, "access": Access.READ,
            "phases": [Phase.WARMUP], "gone": Phase.WARMUP, "n": 1}
    saved = {"phase": Phase.DECAY, "mode": Mode.EVAL, "access": Access.READ | Access.WRITE,
             "phases": [Phase.DECAY], "gone": 7, "n": 2}
    sp.save(str(tmp_path / "ck"), saved)
    assert type(sp.load(str(tmp_path / "ck"))["phase"]) is int  # what the format keeps
    sp.load(str(tmp_path / "ck"), into=live)
    assert live["phase"] is Phase.DECAY and live["mode"] is Mode.EVAL
    assert live["access"] is Access.READ | Access.WRITE
    assert live["phases"][0] is Phase.DECAY
    assert type(live["gone"]) is int and live["gone"] == 7
    assert live["n"] == 2


# -- per-rank values and the trees of several ranks ----------------------------------------------


def test_per_rank_values_flatten_under_their_rank() -> None:
    flat = flatten({"rng": sp.PerRank({"seed": 4, "pos": [1, 2]}), "step": 3}, rank=2)
    assert list(flat.leaves) == ["rng/2/seed", "rng/2/pos/0", "rng/2/pos/1", "step"]
    assert flat.skeleton["dict"][0][1] == {"per_rank": [[2, {"dict": [
        ["seed", "rng/2/seed"], ["pos", {"list": ["rng/2/pos/0", "rng/2/pos/1"]}]]}]]}


def test_merge_skeletons_gathers_per_rank_nodes() -> None:
    trees = [flatten({"w": 1, "r": sp.PerRank(rank)}, rank=rank).skeleton for rank in range(3)]
    merged = merge_skeletons(trees)
    assert merged == {"dict": [["w", "w"], ["r", {"per_rank": [[0, "r/0"], [1, "r/1"],
                                                               [2, "r/2"]]}]]}
    assert per_rank_paths(merged) == {"r": [0, 1, 2]}
    assert leaf_paths(merged) == ["w", "r/0", "r/1", "r/2"]
    values = {"w": 1, "r/0": "a", "r/1": "b", "r/2": "c"}
    assert rebuild(merged, values) == {"w": 1, "r": {0: "a", 1: "b", 2: "c"}}


@pytest.mark.parametrize("other", [{"w": 1, "x": 2}, {"w": [1]}, {"v": 1}, [1]])
def test_merge_skeletons_refuses_trees_that_differ(other: Any) -> None:
    trees = [flatten({"w": 1}).skeleton, flatten(other).skeleton]
    with pytest.raises(UnsupportedLeaf, match="differs between rank 0 and rank 1"):
        merge_skeletons(trees)


def test_write_back_restores_this_ranks_value() -> None:
    saved = merge_skeletons([flatten({"r": sp.PerRank({"pos": 0})}, rank=r).skeleton
                             for r in range(2)])
    live = {"r": sp.PerRank({"pos": 0})}
    target = flatten(live, rank=1)
    write_back(live, target, saved, {"r/1/pos": 9}, URL)
    assert live["r"].value == {"pos": 9}
    scalar = {"r": sp.PerRank(0)}
    write_back(scalar, flatten(scalar, rank=1), saved, {"r/1": 5}, URL)
    assert scalar["r"].value == 5


def test_an_int_key_and_its_str_twin_holding_containers_are_refused() -> None:
    """{1: {...}, "1": {...}} would put both subtrees under the path "1": refused like two
    leaves on one path, naming it."""
    with pytest.raises(UnsupportedLeaf, match=r"same path 'x/1'"):
        flatten({"x": {1: {"a": torch.ones(1)}, "1": {"b": torch.zeros(1)}}})
    flatten({"x": {1: {"a": torch.ones(1)}, "2": {"b": torch.zeros(1)}}})  # no twins: fine


def test_a_tuple_subclass_that_is_not_a_namedtuple_is_written_back() -> None:
    """torch.Size (a tuple subclass taking one iterable) in a live state is rebuilt as one."""
    live = {"shape": torch.Size([4, 5])}
    target = flatten(live)
    saved = flatten({"shape": torch.Size([2, 3])})
    back = write_back(live, target, saved.skeleton, dict(saved.leaves), URL)
    assert back["shape"] == torch.Size([2, 3]) and type(back["shape"]) is torch.Size


def test_a_glob_ending_in_a_slash_selects_like_one_without() -> None:
    """keys=["optim/*/0/"], written in the prefix style, selects what "optim/*/0" does (the
    slash was stripped from prefixes only, and the glob matched nothing)."""
    paths = ["optim/state/0/exp_avg", "optim/state/1/exp_avg", "x"]
    assert select(paths, ["optim/*/0/"]) == select(paths, ["optim/*/0"]) == [paths[0]]


@pytest.mark.parametrize("saved, live, expected", [
    ({"k": {2: (1.5, "x")}}, {"k": {"2": (0.0, "")}}, {"k": {"2": (1.5, "x")}}),
    ({"k": {"2": [7, None]}}, {"k": {2: [0, 1]}}, {"k": {2: [7, None]}}),
    ({"k": {-3: {"a": 1}}}, {"k": {"-3": {"a": 0}}}, {"k": {"-3": {"a": 1}}}),
])
def test_write_back_finds_a_containers_saved_node_under_its_twin_key(
        saved: Any, live: Any, expected: Any) -> None:
    """An int key and its str twin share one path, so the match loads the values below it;
    the live container under one spelling is filled from the saved one under the other
    (it was left as it was, though a strict restore reported nothing)."""
    assert _restore(live, saved) == expected


def test_write_back_fills_a_live_dict_of_indices_from_a_saved_list() -> None:
    """A saved list or tuple and a live dict of its indices (as int or digits) share their
    paths: the live dict is filled in place and keeps its type and keys."""
    inner = {"0": 0, 1: ""}
    live = {"a": inner, "b": {0: None}}
    _restore(live, {"a": [5, "x"], "b": (2.5,)})
    assert live["a"] is inner and inner == {"0": 5, 1: "x"}
    assert live["b"] == {0: 2.5}


def test_write_back_of_nothing_loaded_leaves_a_root_that_cannot_take_the_saved_one() -> None:
    """A lenient load of a checkpoint whose root is a leaf into a dict loads nothing; the
    root counted as touched whatever was loaded, so the write raised StateMismatch claiming
    values loaded below it would stay as they were. With a value loaded it still raises,
    naming the root `<root>`, not ''."""
    live = {"w": 0}
    assert write_back(live, flatten(live), "", {}, URL) is live and live == {"w": 0}
    saved = merge_skeletons([flatten(sp.PerRank({"pos": 0}), rank=r).skeleton
                             for r in range(2)])
    live = {1: {"pos": 0}}
    with pytest.raises(sp.StateMismatch, match="at '<root>'") as caught:
        write_back(live, flatten(live), saved, {"1/pos": 9}, URL)
    assert caught.value.mismatched == ["<root>: a per-rank node in the checkpoint, a dict in "
                                       "the target"]


def test_write_back_raises_rather_than_leave_loaded_values_unwritten() -> None:
    """Values loaded below a live container that cannot take what the checkpoint holds there
    (a per-rank node meeting a plain dict of the same paths) are a StateMismatch naming the
    path, never silently left as they were."""
    saved = merge_skeletons([flatten({"r": sp.PerRank({"pos": 0})}, rank=r).skeleton
                             for r in range(2)])
    live = {"r": {1: {"pos": 0}}}
    with pytest.raises(sp.StateMismatch, match=r"'r'.*ckpt/step-5|ckpt/step-5.*'r'") as caught:
        write_back(live, flatten(live), saved, {"r/1/pos": 9}, URL)
    assert caught.value.mismatched == ["r: a per-rank node in the checkpoint, a dict in the "
                                       "target"]


def test_a_safetensors_import_restores_containers_under_int_keys(tmp_path: Path) -> None:
    """The import holds every key as str; a restore into a target whose int keys hold a tuple
    and a list fills them (strict matched every path, yet they kept their old values)."""
    sp.save(tmp_path / "ck", {"hist": {0: 5, 2: (1.5, "x"), 3: [7, None]}, "w": torch.ones(2)})
    sp.export_checkpoint(tmp_path / "ck", tmp_path / "o.safetensors")
    sp.import_checkpoint(tmp_path / "o.safetensors", tmp_path / "imp")
    live = {"hist": {0: 0, 2: (0.0, ""), 3: [0, 1]}, "w": torch.zeros(2)}
    sp.load(tmp_path / "imp", into=live)
    assert live["hist"] == {0: 5, 2: (1.5, "x"), 3: [7, None]}
    assert torch.equal(live["w"], torch.ones(2))


def test_a_strict_load_refuses_a_checkpoint_without_the_chained_scheduler(
    tmp_path: Path
) -> None:
    """Every key of an LR scheduler's state but `last_epoch` is optional, and a
    ChainedScheduler's state has none: a strict load from a checkpoint saved before one was
    in the state succeeded, and the resumed run restarted its LR schedule from step 0. Its
    `_schedulers` stay required; a checkpoint that has it restores."""
    def made() -> dict[str, Any]:
        optim = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        lr = torch.optim.lr_scheduler
        chained = lr.ChainedScheduler([lr.ConstantLR(optim, 0.5, total_iters=2),
                                       lr.ExponentialLR(optim, 0.9)])
        return {"optim": optim, "sched": chained}

    state = made()
    sp.save(tmp_path / "before", {"optim": state["optim"]})
    optional = _tree.optional_paths(flatten(state).stateful)
    assert [path for path in optional if path.startswith("sched/")] == ["sched/_last_lr"]
    with pytest.raises(sp.StateMismatch, match="missing from the checkpoint: sched/_schedulers"):
        sp.load(tmp_path / "before", into=made())
    state["optim"].step()
    state["sched"].step()
    sp.save(tmp_path / "after", state)
    target = made()
    sp.load(tmp_path / "after", into=target)
    assert target["sched"].state_dict() == state["sched"].state_dict()
