"""The public API is a contract (DESIGN.md): `safepoint.__all__` is sorted and is exactly what
the package exports, the signatures of save/load/info/verify stay as documented, and the error
hierarchy derives from `SafepointError` and from the built-ins callers already catch."""

from __future__ import annotations
import __future__

import dataclasses
import inspect
import pickle
import types
from typing import Any

import pytest

import safepoint as sp
import safepoint.errors

ERRORS = [
    sp.SafepointError,
    sp.CheckpointNotFound,
    sp.CheckpointExists,
    sp.CorruptCheckpoint,
    sp.FormatVersionError,
    sp.StateMismatch,
    sp.UnsupportedLeaf,
    sp.PickleNotAllowed,
    sp.StorageError,
]


def test_all_is_sorted_and_unique() -> None:
    assert sp.__all__ == sorted(sp.__all__)
    assert len(set(sp.__all__)) == len(sp.__all__)


def test_all_is_exactly_the_public_names() -> None:
    public = {
        name for name, value in vars(sp).items()
        if not name.startswith("_")
        # submodules, and `annotations` of `from __future__ import annotations`
        and not isinstance(value, types.ModuleType | __future__._Feature)
    }
    assert set(sp.__all__) - {"__version__"} == public
    for name in sp.__all__:
        assert hasattr(sp, name), name


def test_star_import_gives_all() -> None:
    namespace: dict[str, Any] = {}
    exec("from safepoint import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(sp.__all__)


def test_core_names_of_design_are_exported() -> None:
    for name in ["save", "load", "info", "verify", "Pickled", "SafepointError",
                 "CheckpointNotFound", "CorruptCheckpoint", "StateMismatch", "PickleNotAllowed",
                 "FormatVersionError", "CheckpointInfo", "VerifyReport", "__version__"]:
        assert name in sp.__all__, name
    assert isinstance(sp.__version__, str) and sp.__version__.count(".") >= 2


def test_errors_module_all_matches_its_classes() -> None:
    classes = {
        name for name, value in vars(safepoint.errors).items()
        if isinstance(value, type) and issubclass(value, BaseException)
        and value.__module__ == "safepoint.errors"
    }
    assert set(safepoint.errors.__all__) == classes
    assert safepoint.errors.__all__ == sorted(safepoint.errors.__all__)
    assert set(safepoint.errors.__all__) <= set(sp.__all__)


POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD = inspect.Parameter.KEYWORD_ONLY
SIGNATURES: dict[str, list[tuple[str, Any, Any]]] = {
    "save": [
        ("url", POSITIONAL, inspect.Parameter.empty),
        ("state", POSITIONAL, inspect.Parameter.empty),
        ("metadata", KEYWORD, None),
        ("overwrite", KEYWORD, False),
        ("storage_options", KEYWORD, None),
        ("process_group", KEYWORD, None),
        ("dist", KEYWORD, None),
        ("on_event", KEYWORD, None),
    ],
    "load": [
        ("url", POSITIONAL, inspect.Parameter.empty),
        ("into", POSITIONAL, None),
        ("keys", KEYWORD, None),
        ("strict", KEYWORD, True),
        ("allow_pickle", KEYWORD, False),
        ("storage_options", KEYWORD, None),
        ("process_group", KEYWORD, None),
        ("dist", KEYWORD, None),
        ("on_event", KEYWORD, None),
        ("progress", KEYWORD, None),
    ],
    "info": [
        ("url", POSITIONAL, inspect.Parameter.empty),
        ("storage_options", KEYWORD, None),
    ],
    "verify": [
        ("url", POSITIONAL, inspect.Parameter.empty),
        ("storage_options", KEYWORD, None),
        ("progress", KEYWORD, None),
    ],
}


def test_the_manager_shows_its_options() -> None:
    """`CheckpointManager.__new__` (which picks the two-tier class) would hide them from
    help() and IDEs."""
    parameters = inspect.signature(sp.CheckpointManager).parameters
    assert list(parameters)[:7] == ["root", "keep_last", "keep_every", "keep_best",
                                    "best_metric", "best_mode", "async_save"]
    assert {"storage_options", "local_dir", "process_group"} <= set(parameters)


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_match_design(name: str) -> None:
    signature = inspect.signature(getattr(sp, name))
    got = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
    assert got == SIGNATURES[name]


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_public_functions_document_what_they_raise(name: str) -> None:
    doc = inspect.getdoc(getattr(sp, name)) or ""
    assert "Raises:" in doc
    assert "CheckpointNotFound" in doc or name == "save"


def test_value_types_are_frozen_dataclasses() -> None:
    for cls, fields in [
        (sp.CheckpointInfo, {"url", "metadata", "entries", "nbytes", "format_version"}),
        (sp.EntryInfo, {"path", "kind", "dtype", "shape", "nbytes"}),
        (sp.VerifyReport, {"url", "ok", "problems"}),
        (sp.Pickled, {"obj"}),
    ]:
        assert dataclasses.is_dataclass(cls)
        assert fields <= {f.name for f in dataclasses.fields(cls)}, cls
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]


def test_pickled_wraps_any_object() -> None:
    obj = object()
    assert sp.Pickled(obj).obj is obj
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.Pickled(1).obj = 2  # type: ignore[misc]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_derives_from_safepoint_error(cls: type[BaseException]) -> None:
    assert issubclass(cls, sp.SafepointError)
    assert issubclass(sp.SafepointError, Exception)
    assert (inspect.getdoc(cls) or "").strip(), f"{cls.__name__} needs a docstring"


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (sp.CheckpointNotFound, FileNotFoundError),
        (sp.CheckpointExists, FileExistsError),
        (sp.StateMismatch, ValueError),
        (sp.UnsupportedLeaf, TypeError),
        (sp.StorageError, OSError),
    ],
)
def test_errors_are_also_the_natural_builtin(cls: type, builtin: type) -> None:
    assert issubclass(cls, builtin)


def test_errors_that_are_not_builtins() -> None:
    for cls in (sp.CorruptCheckpoint, sp.FormatVersionError, sp.PickleNotAllowed):
        assert not issubclass(cls, OSError | ValueError | TypeError), cls
    assert not issubclass(sp.CorruptCheckpoint, FileNotFoundError)


def _instances() -> list[BaseException]:
    return [
        sp.SafepointError("m", url="u"),
        sp.CheckpointNotFound("m", url="u"),
        sp.CheckpointExists("m", url="u"),
        sp.CorruptCheckpoint("m", url="u", problems=["p1", "p2"]),
        sp.FormatVersionError("m", url="u"),
        sp.StateMismatch("m", url="u", missing=["a"], unexpected=["b"], mismatched=["c: x"]),
        sp.UnsupportedLeaf("m", path="a/b"),
        sp.PickleNotAllowed("m", url="u", paths=["p"]),
        sp.StorageError("m", url="u"),
    ]


def _pickle_cases() -> list[Any]:
    return [pytest.param(error, id=type(error).__name__) for error in _instances()]


def test_errors_carry_machine_readable_fields() -> None:
    by_type = {type(e): e for e in _instances()}
    assert by_type[sp.CorruptCheckpoint].problems == ["p1", "p2"]  # type: ignore[attr-defined]
    assert sp.CorruptCheckpoint("only").problems == ["only"]
    mismatch = by_type[sp.StateMismatch]
    assert (mismatch.missing, mismatch.unexpected, mismatch.mismatched) == (  # type: ignore[attr-defined]
        ["a"], ["b"], ["c: x"])
    assert by_type[sp.UnsupportedLeaf].path == "a/b"  # type: ignore[attr-defined]
    assert by_type[sp.PickleNotAllowed].paths == ["p"]  # type: ignore[attr-defined]
    for error in _instances():
        assert str(error) == "m"
        if not isinstance(error, sp.UnsupportedLeaf):
            assert error.url == "u"  # type: ignore[attr-defined]


@pytest.mark.parametrize("error", _pickle_cases())
def test_errors_survive_pickling(error: BaseException) -> None:
    """Errors cross process boundaries (worker pools, spawned ranks) by pickle."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)
