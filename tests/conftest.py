"""Shared fixtures: a tmp checkpoint directory, a memory:// scheme, a small training state
(model, AdamW optimizer with a few steps taken, LR scheduler) and a moto S3 server."""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from safepoint import _manager as manager_module
from safepoint._storage_local import LocalStorage
from safepoint.errors import StorageError
from safepoint.storage import _REGISTERED as storage_registry
from safepoint.testing import MemoryBackend, memory_scheme

HANG_LIMIT_S = 600
_STDERR = pytest.StashKey[Any]()


def pytest_configure(config: pytest.Config) -> None:
    # Taken while pytest's output capture is suspended: the terminal's (or CI log's) stderr.
    config.stash[_STDERR] = os.fdopen(os.dup(2), "w")


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash[_STDERR].close()


@pytest.fixture(autouse=True)
def _no_test_hangs_the_suite(request: pytest.FixtureRequest) -> Iterator[None]:
    """End this process, every thread's stack written to stderr, when a test with its fixtures'
    set-up and teardown runs past HANG_LIMIT_S: pytest-timeout (and pytest's faulthandler)
    stop timing a test once it has failed, so a teardown that then waits forever (on a pipe a
    grandchild holds open) would hang the suite without a word. xdist reports the ended
    worker and goes on."""
    stderr = request.config.stash[_STDERR]

    def end() -> None:
        stderr.write(f"\n{request.node.nodeid} ran past {HANG_LIMIT_S} s with its fixtures\n")
        stderr.flush()
        faulthandler.dump_traceback(stderr)
        os._exit(1)

    timer = threading.Timer(HANG_LIMIT_S, end)
    timer.daemon = True
    if not request.config.getoption("usepdb"):
        timer.start()
    yield
    timer.cancel()


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A directory path for one checkpoint (not created yet)."""
    return tmp_path / "ckpt"


class _FailsAfterPublish(LocalStorage):
    """The real local storage whose publish commits, then reports a failure (a directory
    fsync that failed after the rename): the caller raises though the manifest is there."""

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        super().publish(path, data, overwrite=overwrite)
        raise StorageError(f"{self.url}/{path}: injected failure after the rename",
                           url=self.url)


@pytest.fixture
def late_scheme(monkeypatch: pytest.MonkeyPatch) -> str:
    """`late://PATH`: a local directory whose publish fails after it committed."""
    monkeypatch.setitem(storage_registry, "late",
                        lambda url, options: _FailsAfterPublish(url, options))
    return "late://"


@pytest.fixture
def memory_backend() -> Iterator[MemoryBackend]:
    """The scheme ``mem-test://`` backed by a fresh in-memory store for this test."""
    with memory_scheme("mem-test") as backend:
        yield backend


def _make_training_state(seed: int = 0, steps: int = 3) -> dict[str, Any]:
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(5, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return {"model": model, "optim": optimizer, "sched": scheduler, "step": steps}


@pytest.fixture
def make_training_state() -> Callable[..., dict[str, Any]]:
    """A factory: `make_training_state(seed=0, steps=3)` -> {"model", "optim", "sched", "step"},
    the optimizer and scheduler having taken `steps` AdamW steps."""
    return _make_training_state


@dataclass(frozen=True)
class S3Server:
    """A moto S3 server on loopback with one empty bucket.

    Attributes:
        endpoint: its ``http://127.0.0.1:PORT`` URL.
        bucket: the bucket the fixture created.
        storage_options: what s3fs needs to talk to it (`sp.save(..., storage_options=...)`).
    """

    endpoint: str
    bucket: str
    storage_options: dict[str, Any]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a free port) for the whole session, reached over HTTP
    through s3fs like AWS. Fake credentials are set only while it runs; stopped at the end."""
    import moto.server as moto_server
    with pytest.MonkeyPatch.context() as env:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            env.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = moto_server.ThreadedMotoServer(
            ip_address="127.0.0.1", port=_free_port(), verbose=False
        )
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing",
                       "secret": "testing"}
            import s3fs

            s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir("safepoint-test")
            yield S3Server(endpoint, "safepoint-test", options)
        finally:
            server.stop()


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    """A fresh, empty prefix in the moto bucket: ``s3://safepoint-test/<uuid>``."""
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"


@pytest.fixture
def held_back(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """An event that background writes wait for (set at the end of the test)."""
    release = threading.Event()
    write = manager_module.write_and_commit

    def held(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(manager_module, "write_and_commit", held)
    monkeypatch.setattr(manager_module, "save_collective",
                        held_collective(manager_module.save_collective, release))
    yield release
    release.set()


def held_collective(prepare: Callable[..., Any], release: threading.Event) -> Any:
    """`prepare` (the manager's `save_collective`), whose writes wait for `release` (a
    plain function: the multi-rank workers hold their writes back with it too)."""

    def held(*args: Any, **kwargs: Any) -> Any:
        write, stage = prepare(*args, **kwargs)

        def held_write() -> Any:
            release.wait(30)
            return write()

        return held_write, stage

    return held
