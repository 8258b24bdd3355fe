"""The layer order of DESIGN.md, enforced on the source: every module of src/safepoint is
placed in one layer, and imports only its own or lower layers (parsed with ast, including
imports inside functions). Also: the core imports without torch, and a numpy-only state saves,
loads and verifies in a process where torch cannot be imported."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import safepoint

PACKAGE = Path(safepoint.__file__).parent

#: Module (relative to the package, dotted) -> layer. A new module must be placed here.
LAYERS: dict[str, int] = {
    # 0 tree
    "_types": 0,
    "_version": 0,
    "errors": 0,
    "_leaves": 0,
    "_tree": 0,
    "_rng": 0,
    "_sampler": 0,
    # 1 format
    "_format": 1,
    "_checksum": 1,
    # 2 storage
    "storage": 2,
    "_storage_local": 2,
    "_storage_fsspec": 2,
    # 3 engine
    "_plan": 3,
    "_staging": 3,
    "_engine": 3,
    "_commit": 3,
    "_events": 3,
    "_retention": 3,
    "_snapshot": 3,
    "_dist": 3,
    "_reshard": 3,
    "_incremental": 3,
    # 4 api
    "_api": 4,
    "_archive": 4,
    "_copy": 4,
    "_diff": 4,
    "_interchange": 4,
    "_names": 4,
    # 5 manager and run
    "__init__": 5,
    "_lease": 5,
    "_manager": 5,
    "_tiered": 5,
    "_run": 5,
    # 6 cli and integrations
    "cli": 6,
    "__main__": 6,
    "testing": 6,
    "integrations": 6,
}
LAYER_NAMES = ["tree", "format", "storage", "engine", "api", "manager/run", "cli/integrations"]
#: Importable from every layer.
ANYWHERE = frozenset({"_types", "_version", "errors"})
#: Packages whose every submodule belongs to the package's layer.
SUBPACKAGES = frozenset({"integrations"})


def _modules() -> dict[str, Path]:
    """Every module of the package, as dotted names relative to it (`integrations.lightning`;
    the package itself is `__init__`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if len(parts) > 1 and parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _layer(module: str) -> int | None:
    """The layer of a module name relative to the package, or None when unplaced."""
    if module in LAYERS:
        return LAYERS[module]
    top = module.split(".")[0]
    if top in SUBPACKAGES:
        return LAYERS[top]
    return None


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The safepoint modules an ImportFrom in `module` refers to (relative to the package):
    `from .x import y` is x (or x.y when that is a module), `from . import y` is y."""
    path = _modules()[module]
    parts = [] if module == "__init__" else module.split(".")
    package = parts if path.name == "__init__.py" else parts[:-1]
    if node.level:
        if node.level - 1 > len(package):
            return []
        target = package[: len(package) - (node.level - 1)]
        target += (node.module or "").split(".") if node.module else []
    elif node.module == "safepoint" or (node.module or "").startswith("safepoint."):
        target = node.module.split(".")[1:]  # type: ignore[union-attr]
    else:
        return []
    known = set(_modules()) | set(LAYERS)
    resolved = []
    for alias in node.names:
        candidate = ".".join([*target, alias.name])
        resolved.append(candidate if candidate in known else ".".join(target) or "__init__")
    return resolved


def _imports(module: str, path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """(imported safepoint module, line) for every import in `module` (its file's text, or
    `source` in its place)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "safepoint" or alias.name.startswith("safepoint."):
                    name = alias.name.removeprefix("safepoint").lstrip(".")
                    out.append((name or "__init__", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            out.extend((name, node.lineno) for name in _resolve(module, node))
    return out


def test_every_module_is_placed_in_a_layer() -> None:
    unplaced = [m for m in _modules() if _layer(m) is None]
    assert not unplaced, (
        f"modules {unplaced} are in no layer: add them to LAYERS in tests/test_layering.py "
        "(see DESIGN.md, Layers)"
    )


def test_the_layer_table_names_real_modules() -> None:
    modules = _modules()
    planned = {"cli"}  # __main__ already imports it; it lands with the CLI
    stale = [m for m in LAYERS if m not in modules and m not in SUBPACKAGES and m not in planned]
    assert not stale, f"LAYERS lists modules that do not exist: {stale}"


def _upward(module: str, source: str | None = None) -> list[str]:
    """One line per import of `module` that goes up the layers (or to an unplaced module)."""
    layer = _layer(module)
    assert layer is not None, f"{module} is in no layer"
    bad = []
    for imported, line in _imports(module, _modules()[module], source):
        if imported in ANYWHERE:
            continue
        target = _layer(imported)
        if target is None:
            bad.append(f"line {line}: {imported} (in no layer)")
        elif target > layer:
            bad.append(
                f"line {line}: {imported} ({LAYER_NAMES[target]}) from {module} "
                f"({LAYER_NAMES[layer]})"
            )
    return bad


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_go_down_the_layers(module: str) -> None:
    bad = _upward(module)
    assert not bad, f"{module} imports upward:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("_format", "from ._plan import plan_layout\n"),
        ("_tree", "def f():\n    from . import _format\n"),
        ("storage", "import safepoint._engine\n"),
        ("_engine", "from safepoint import load\n"),
        ("_commit", "from . import _api\n"),
        ("_api", "from .cli import main\n"),
        ("_leaves", "from .newthing import x\n"),
    ],
)
def test_the_checker_catches_upward_imports(module: str, source: str) -> None:
    assert _upward(module, source)


def test_the_checker_allows_errors_and_types_everywhere() -> None:
    source = (
        "from .errors import SafepointError\nfrom ._types import Node\nfrom . import _version\n"
    )
    assert _upward("_types", source) == []


def test_resolver_sees_relative_and_absolute_imports() -> None:
    """Guard for the parser above, on modules whose imports are known."""
    api = {name for name, _ in _imports("_api", _modules()["_api"])}
    assert {"_format", "_commit", "storage", "errors", "_tree"} <= api
    main = {name for name, _ in _imports("__main__", _modules()["__main__"])}
    assert main == {"cli"}
    assert _imports("_types", _modules()["_types"]) == []


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120,
    )


def test_core_modules_import_without_torch() -> None:
    result = _run(
        """
        import sys
        import safepoint, safepoint.errors, safepoint._format, safepoint.storage
        import safepoint._checksum, safepoint._commit, safepoint._storage_local
        sp = safepoint
        assert sp.save and sp.load and sp.info and sp.verify
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("TORCH", loaded)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "TORCH []" in result.stdout


@pytest.fixture
def torch_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint written here (with torch) holding a tensor and numpy entries."""
    import torch
    url = tmp_path / "with_tensor"
    safepoint.save(str(url), {"t": torch.arange(3), "a": __import__("numpy").arange(4),
                              "n": 1})
    return url


def test_numpy_only_state_works_with_torch_hidden(tmp_path: Path, torch_checkpoint: Path) -> None:
    result = _run(
        f"""
        import sys
        sys.modules["torch"] = None  # `import torch` now raises ImportError
        import numpy as np
        import safepoint as sp

        url = {str(tmp_path / "numpy_only")!r}
        state = {{"w": np.arange(12, dtype=np.float32).reshape(3, 4), "s": np.int16(-3),
                  "be": np.arange(3, dtype=">i8"), "step": 7, "raw": b"x",
                  "nested": ({{"k": [1.5, None]}},)}}
        info = sp.save(url, state, metadata={{"m": 1}})
        assert info.torch_version is None, info.torch_version
        assert sp.verify(url).ok
        loaded = sp.load(url)
        assert np.array_equal(loaded["w"], state["w"]) and loaded["w"].dtype == np.float32
        assert type(loaded["s"]) is np.int16 and loaded["s"] == -3
        assert loaded["be"].dtype == np.dtype(">i8") and list(loaded["be"]) == [0, 1, 2]
        assert loaded["step"] == 7 and loaded["raw"] == b"x"
        assert loaded["nested"] == ({{"k": [1.5, None]}},)
        target = {{"w": np.zeros((3, 4), dtype=np.float32), "s": np.int16(0),
                   "be": np.zeros(3, dtype="<i8"), "step": 0, "raw": b"",
                   "nested": ({{"k": [0.0, 1]}},)}}
        w = target["w"]
        sp.load(url, into=target)
        assert target["w"] is w and np.array_equal(w, state["w"])

        # A checkpoint with tensors: other entries load; the tensor asks for torch.
        other = {str(torch_checkpoint)!r}
        assert sp.load(other, keys=["a", "n"])["n"] == 1
        assert sp.verify(other).ok
        try:
            sp.load(other)
        except sp.SafepointError as exc:
            assert "install torch" in str(exc), exc
            assert f"cannot load 't' from {{other}}" in str(exc), exc
        else:
            raise AssertionError("loading a tensor without torch must fail")
        assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("OK")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"


def test_the_command_reads_a_checkpoint_of_tensors_with_torch_hidden(
    tmp_path: Path, torch_checkpoint: Path
) -> None:
    """On a login node without torch, `safepoint ls/info/verify` still describe and check a
    checkpoint of tensors, and `verify` still finds damage."""
    result = _run(
        f"""
        import sys
        sys.modules["torch"] = None  # `import torch` now raises ImportError
        from safepoint.cli import main

        ckpt = {str(torch_checkpoint)!r}
        assert main(["ls", {str(tmp_path)!r}]) == 0
        assert main(["info", ckpt]) == 0
        assert main(["verify", ckpt]) == 0
        print("DAMAGE")
        sys.stdout.flush()
        import glob
        data = glob.glob(ckpt + "/data/*")[0]
        with open(data, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 1]))
        assert main(["verify", ckpt]) == 1
        """
    )
    assert result.returncode == 0, result.stderr
    listing, damaged = result.stdout.split("DAMAGE\n")
    assert "with_tensor" in listing and "written by:     safepoint" in listing
    rows = [line.split() for line in listing.splitlines()]
    assert ["t", "tensor", "I64", "(3)", "24", "B"] in rows  # info's entry table
    assert ["a", "ndarray", "I64", "(4)", "32", "B"] in rows
    assert "checksum mismatch in 't'" in damaged and damaged.startswith("FAILED")


def test_what_needs_torch_or_lightning_says_so_where_they_are_missing(tmp_path: Path) -> None:
    """Where torch is not installed: a collective call said to call init_process_group(),
    ResumableSampler.generator raised a bare ModuleNotFoundError, and the Lightning
    integration named an internal module instead of what to install."""
    result = _run(
        f"""
        import sys
        for name in ("torch", "lightning", "lightning_fabric"):
            sys.modules[name] = None  # `import` of them now raises ImportError
        import numpy as np
        import safepoint as sp
        try:
            sp.save({str(tmp_path / "c")!r}, {{"w": np.ones(2)}}, dist=True)
        except sp.SafepointError as exc:
            print("DIST", exc)
        try:
            sp.ResumableSampler(range(4)).generator
        except sp.SafepointError as exc:
            print("SAMPLER", exc)
        try:
            import safepoint.integrations.lightning
        except ImportError as exc:
            print("LIGHTNING", exc)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert "torch is not installed: pip install torch" in lines["DIST"]
    assert "pip install torch" in lines["SAMPLER"]
    assert "pip install safepoint[lightning]" in lines["LIGHTNING"]
