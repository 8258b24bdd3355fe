"""The storage seam (storage.py): URLs split into scheme and path, the registry that picks a
backend per scheme (registered in-process, built in, entry points, fsspec), and the mapping of
backend I/O failures to `StorageError`."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

import safepoint as sp
from safepoint import storage as storage_module
from safepoint._storage_fsspec import FsspecStorage
from safepoint._storage_local import LocalStorage
from safepoint.errors import StorageError
from safepoint.testing import MemoryBackend, MemoryStorage


@pytest.mark.parametrize(("url", "split"), [
    ("/ckpt/a", ("", "/ckpt/a")),
    ("relative/dir", ("", "relative/dir")),
    ("file:///ckpt/a", ("file", "/ckpt/a")),
    ("S3://Bucket/run", ("s3", "Bucket/run")),
    ("memory://x/y://z", ("memory", "x/y://z")),
])
def test_split_url(url: str, split: tuple[str, str]) -> None:
    assert storage_module.split_url(url) == split


def test_plain_paths_and_file_urls_are_local(tmp_path: Path) -> None:
    for url in (str(tmp_path / "a"), f"file://{tmp_path / 'b'}"):
        store = storage_module.open_storage(url)
        assert isinstance(store, LocalStorage)
        assert store.url == url


def test_a_registered_scheme_wins_over_fsspec(monkeypatch: pytest.MonkeyPatch) -> None:
    """`memory://` is fsspec's until a factory is registered for it in this process."""
    monkeypatch.setattr(storage_module, "_REGISTERED", {})
    assert isinstance(storage_module.open_storage("memory://reg/x"), FsspecStorage)
    backend = MemoryBackend()
    seen: list[tuple[str, Any]] = []

    def factory(url: str, options: dict[str, Any] | None) -> MemoryStorage:
        seen.append((url, options))
        return backend(url, options)

    storage_module.register("memory", factory)
    store = storage_module.open_storage("memory://reg/x", {"k": 1})
    assert isinstance(store, MemoryStorage) and seen == [("memory://reg/x", {"k": 1})]
    sp.save("memory://reg/ckpt", {"w": 3})
    assert "reg/ckpt/manifest.json" in backend.files()
    assert sp.load("memory://reg/ckpt") == {"w": 3}


# -- the registry -------------------------------------------------------------------------------

def test_fsspec_handles_schemes_with_no_other_backend() -> None:
    store = storage_module.open_storage(f"memory://safepoint-{uuid.uuid4().hex}")
    assert isinstance(store, FsspecStorage)


@pytest.mark.parametrize(("url", "package", "extra"), [
    ("gs://bucket/run", "gcsfs", "gcs"),
    ("az://container/run", "adlfs", "azure"),
    # fsspec's own filesystems, which need another package (the hint said fsspec)
    ("sftp://host/run", "paramiko", None),
    ("hdfs://host/run", "pyarrow", None),
    ("smb://host/run", "smbprotocol", None),
])
def test_a_missing_driver_names_the_package(
    url: str, package: str, extra: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not installed, even where it is: no cached driver class or module, and its import fails.
    from fsspec.registry import _registry, known_implementations

    scheme = url.split("://")[0]
    monkeypatch.delitem(_registry, scheme, raising=False)
    driver = known_implementations[scheme]["class"].rsplit(".", 1)[0]
    monkeypatch.delitem(sys.modules, driver, raising=False)
    monkeypatch.setitem(sys.modules, package, None)
    hint = f"pip install {package}`" + (f".*safepoint\\[{extra}\\]" if extra else "")
    with pytest.raises(sp.SafepointError, match=hint):
        sp.save(url, {"w": 1})


def test_a_driver_hint_names_the_package_missing_among_those_fsspec_names() -> None:
    """fsspec says http:// needs "requests" and "aiohttp": with requests installed and
    aiohttp not, the hint names aiohttp (it named the first, installed one)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["aiohttp"] = None  # not installed
        import safepoint as sp
        try:
            sp.info("http://example.invalid/run")
        except sp.SafepointError as exc:
            print(exc)
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert "install it with `pip install aiohttp`" in child.stdout, child.stdout + child.stderr


def test_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(sp.SafepointError, match="nosuchscheme"):
        storage_module.open_storage("nosuchscheme://x/y")


def test_an_entry_point_adds_a_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed distribution declaring `ep-test = safepoint.testing:MemoryStorage` in the
    `safepoint.storage` entry point group handles ep-test:// URLs."""
    dist = tmp_path / "safepoint_ep_test-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: safepoint-ep-test\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[safepoint.storage]\nep-test = safepoint.testing:MemoryStorage\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    store = storage_module.open_storage("ep-test://a/b")
    assert isinstance(store, MemoryStorage)
    assert store.url == "ep-test://a/b"




# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    json.dumps({"key": "k", "secret": "s"}),  # read from a flag or an environment variable
    [("key", "k"), ("secret", "s")],
])
@pytest.mark.parametrize("where", ["local", "memory", "s3"])
@pytest.mark.parametrize("call", ["save", "load", "manager"])
def test_storage_options_that_are_not_a_dict_are_refused(
    tmp_path: Path, options: Any, where: str, call: str
) -> None:
    """storage_options given as a JSON string or a list of pairs crashed with fsspec's raw
    TypeError (s3://: "argument after ** must be a mapping") or an AttributeError (local
    disk) (found by a review): a SafepointError names the URL and says to pass a dict,
    without echoing the options (they may hold credentials)."""
    url = {"local": str(tmp_path / "ckpt"), "memory": f"memory://sp-{uuid.uuid4().hex}",
           "s3": "s3://bucket/run"}[where]
    with pytest.raises(sp.SafepointError, match="storage_options must be a dict") as refused:
        if call == "save":
            sp.save(url, {"w": 1}, storage_options=options)
        elif call == "load":
            sp.load(url, storage_options=options)
        else:
            sp.CheckpointManager(url, storage_options=options).steps()
    assert url in str(refused.value) and "pass a dict" in str(refused.value)
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize(("url", "options"), [
    ("dbfs://x/run", None),  # its constructor needs an instance and a token
    (f"memory://sp-{uuid.uuid4().hex}", {1: "a key that is not a string"}),
], ids=["dbfs-missing-options", "memory-int-key"])
def test_options_the_filesystem_refuses_are_a_configuration_error(
    url: str, options: dict[Any, Any] | None
) -> None:
    """A TypeError from the fsspec filesystem's constructor (an option missing, a key that is
    not a string) is a SafepointError naming the URL and saying what to check, not a raw
    TypeError."""
    with pytest.raises(sp.SafepointError, match="refused its storage_options") as refused:
        storage_module.open_storage(url, options)
    assert url in str(refused.value) and isinstance(refused.value.__cause__, TypeError)



def test_an_io_failure_becomes_a_storage_error_naming_the_url() -> None:
    failure = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(StorageError) as caught, storage_module.mapped_errors("s3://b/c", "writing"):
        raise failure
    message = str(caught.value)
    assert message.startswith("writing s3://b/c failed") and "free space" in message
    assert caught.value.url == "s3://b/c" and caught.value.__cause__ is failure


@pytest.mark.parametrize("signal", [FileNotFoundError("gone"), FileExistsError("there"),
                                    EOFError("short"), sp.CheckpointNotFound("none", url="u")])
def test_the_signals_callers_act_on_pass_through(signal: BaseException) -> None:
    with pytest.raises(type(signal)) as caught, storage_module.mapped_errors("u", "reading"):
        raise signal
    assert caught.value is signal


@pytest.mark.parametrize("root", [None, b"/tmp/ckpt"])
def test_root_that_is_not_a_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: Any,
) -> None:
    """CheckpointManager(cfg.ckpt_dir) with the setting unset (None), or a bytes path, and
    sp.save(None, ...) or sp.Run(None, ...) wrote under the working directory's 'None' or
    "b'/tmp/ckpt'": a place nobody asked for, which a restart from another directory never
    finds. Refused, saying to pass a path or URL string; a pathlib.Path still works."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sp.SafepointError, match="pass a path"):
        sp.CheckpointManager(root, async_save=False)
    with pytest.raises(sp.SafepointError, match="pass a path"):
        sp.save(root, {"w": 1})
    with pytest.raises(sp.SafepointError, match="pass a path"):
        sp.Run(root, {"w": 1})
    with pytest.raises(sp.SafepointError, match="pass a path"):
        storage_module.split_url(root)
    assert list(tmp_path.iterdir()) == []
    assert storage_module.split_url(tmp_path / "a") == ("", str(tmp_path / "a"))
