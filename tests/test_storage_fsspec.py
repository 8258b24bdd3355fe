"""FsspecStorage: the conformance suite on S3 (a real moto server over HTTP, through s3fs) and
on fsspec's memory://; save/load/info/verify on s3://; multipart uploads and parallel ranged
reads; transient-error classification; retries through a fault-injecting HTTP proxy in front of
moto. The scheme registry is tested in test_storage.py."""

from __future__ import annotations

import contextlib
import errno
import gc
import http.client
import http.server
import json
import os
import random
import socket
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import safepoint as sp
from conftest import S3Server
from safepoint import _storage_fsspec
from safepoint import storage as storage_module
from safepoint._storage_fsspec import FsspecStorage, RetryPolicy, is_transient
from safepoint.errors import StorageError
from safepoint.testing import StorageSuite

pytestmark = pytest.mark.filterwarnings(
    # aiobotocore/botocore on Python 3.11 still call datetime.utcnow().
    "ignore:datetime.datetime.utcnow:DeprecationWarning",
)

FAST = RetryPolicy(attempts=6, first_delay_s=0.01, max_delay_s=0.05)


class TestS3Storage(StorageSuite):
    @pytest.fixture
    def storage(self, s3_server: S3Server, s3_url: str) -> Iterator[FsspecStorage]:
        store = FsspecStorage(s3_url, s3_server.storage_options)
        yield store
        store.close()


class TestMemoryStorage(StorageSuite):
    @pytest.fixture
    def storage(self) -> Iterator[FsspecStorage]:
        url = f"memory://safepoint-{uuid.uuid4().hex}"
        store = FsspecStorage(url)
        yield store
        store.close()
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm(store.root, recursive=True)


# -- the API on s3:// ----------------------------------------------------------------------------


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 << 19, generator=generator),  # 6 MiB: two 5 MiB parts
        "small": [torch.arange(i + 1, dtype=torch.int64) * seed for i in range(20)],
        "step": seed,
    }


def _assert_state(loaded: dict[str, Any], seed: int) -> None:
    expected = _state(seed)
    assert torch.equal(loaded["big"], expected["big"])
    assert all(torch.equal(a, b) for a, b in zip(loaded["small"], expected["small"], strict=True))
    assert loaded["step"] == seed


@pytest.fixture
def small_parts(s3_server: S3Server) -> Iterator[None]:
    """s3:// with 5 MiB parts (S3's minimum), so a test-sized file is a multipart upload."""
    storage_module.register(
        "s3", lambda url, options: FsspecStorage(url, options, part_bytes=5 << 20)
    )
    try:
        yield
    finally:
        storage_module._REGISTERED.pop("s3", None)


def test_save_load_info_verify_on_s3(s3_server: S3Server, s3_url: str, small_parts: None) -> None:
    options = s3_server.storage_options
    url = f"{s3_url}/final"
    saved = sp.save(url, _state(1), metadata={"loss": 0.5}, storage_options=options)
    _assert_state(sp.load(url, storage_options=options), 1)
    info = sp.info(url, storage_options=options)
    assert info.save_id == saved.save_id
    assert info.metadata == {"loss": 0.5}
    report = sp.verify(url, storage_options=options)
    assert report.ok, report.problems
    assert report.nbytes == saved.nbytes

    into = _state(0)
    sp.load(url, into=into, storage_options=options)
    _assert_state(into, 1)


def test_overwrite_on_s3(s3_server: S3Server, s3_url: str) -> None:
    options = s3_server.storage_options
    sp.save(s3_url, _state(1), storage_options=options)
    with pytest.raises(sp.CheckpointExists, match=s3_url):
        sp.save(s3_url, _state(2), storage_options=options)
    _assert_state(sp.load(s3_url, storage_options=options), 1)
    sp.save(s3_url, _state(2), overwrite=True, storage_options=options)
    _assert_state(sp.load(s3_url, storage_options=options), 2)
    store = FsspecStorage(s3_url, options)
    data_files = [p for p in store.list() if p.startswith("data/")]
    assert len(data_files) == 1, "the overwritten checkpoint's data is removed"


def test_checkpoint_without_manifest_is_invisible(s3_server: S3Server, s3_url: str) -> None:
    options = s3_server.storage_options
    store = FsspecStorage(s3_url, options)
    store.write(f"data/{uuid.uuid4().hex}-r00000-0000.bin", [b"x" * 100])
    with pytest.raises(sp.CheckpointNotFound, match="uncommitted"):
        sp.load(s3_url, storage_options=options)


def test_publish_is_a_conditional_put_on_s3(s3_server: S3Server, s3_url: str) -> None:
    """Two writers racing to commit the same checkpoint: exactly one wins."""
    stores = [FsspecStorage(s3_url, s3_server.storage_options) for _ in range(8)]
    outcomes: list[str] = []

    def commit(index: int) -> None:
        try:
            stores[index].publish("manifest.json", f"writer {index}".encode(), overwrite=False)
            outcomes.append(f"won {index}")
        except FileExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1, outcomes
    assert stores[0].read("manifest.json") == f"writer {winners[0].split()[1]}".encode()


def test_publish_checks_then_puts_without_conditional_puts(
    s3_server: S3Server, s3_url: str
) -> None:
    """With a botocore too old for If-None-Match, publish still refuses an existing file."""
    store = FsspecStorage(s3_url, s3_server.storage_options)
    assert store.conditional_puts
    store._knows_if_none_match = False  # type: ignore[misc]
    assert not store.conditional_puts
    store.publish("manifest.json", b"first", overwrite=False)
    with pytest.raises(FileExistsError):
        store.publish("manifest.json", b"second", overwrite=False)
    assert store.read("manifest.json") == b"first"


def test_multipart_upload_with_parts_in_flight(s3_server: S3Server, s3_url: str) -> None:
    store = FsspecStorage(s3_url, s3_server.storage_options, part_bytes=5 << 20,
                          parts_in_flight=3)
    data = bytes(range(256)) * ((23 << 20) // 256) + b"tail"
    buffer = bytearray(1 << 20)

    def chunks() -> Iterator[memoryview]:  # one reused buffer, as the engine does
        for start in range(0, len(data), len(buffer)):
            piece = data[start : start + len(buffer)]
            buffer[: len(piece)] = piece
            yield memoryview(buffer)[: len(piece)]

    assert store.write("big.bin", chunks()) == len(data)
    assert store.size("big.bin") == len(data)
    head = store.fs.call_s3("head_object", Bucket=s3_server.bucket,
                            Key=store.root.split("/", 1)[1] + "/big.bin")
    assert head["ETag"].endswith('-5"'), "five parts (a multipart upload's ETag)"
    target = bytearray(len(data) - 1000)
    store.read_bytes = 3 << 20  # eight ranged reads in parallel
    store.readinto("big.bin", 1000, [memoryview(target)[:7], memoryview(target)[7:]])
    assert target == data[1000:]
    store.close()


def test_part_sizes_double_so_a_large_file_stays_within_s3_s_part_limit(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 refuses part 10,001; the part size doubles every `_PARTS_PER_SIZE` parts (1,000; 2
    here), so 16 MiB parts reach S3's largest object instead of stopping at 156 GiB."""
    monkeypatch.setattr(_storage_fsspec, "_PARTS_PER_SIZE", 2)
    store = FsspecStorage(s3_url, s3_server.storage_options, part_bytes=5 << 20,
                          parts_in_flight=2)
    data = os.urandom(33 << 20)  # 5 + 5 + 10 + 10 + 3 MiB: five parts (seven at a fixed size)
    assert store.write("big.bin", (data[i : i + (3 << 20)]
                                   for i in range(0, len(data), 3 << 20))) == len(data)
    head = store.fs.call_s3("head_object", Bucket=s3_server.bucket,
                            Key=store.root.split("/", 1)[1] + "/big.bin")
    assert head["ETag"].endswith('-5"')
    assert store.read("big.bin") == data
    store.close()

    parts = _storage_fsspec._Parts(iter([bytes(100)]), part_bytes=10, buffers=2)
    sizes = []
    while (part := parts.next()) is not None:
        sizes.append(part.nbytes)
        parts.release(part)
    assert sizes == [10, 10, 20, 20, 40]


def test_a_save_to_a_bucket_that_does_not_exist_names_it(s3_server: S3Server) -> None:
    """s3fs reports a missing bucket as FileNotFoundError, which callers take for a missing
    checkpoint: a write says what is missing instead."""
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run1/final"
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-.*/run1/final: its bucket "
                       r"does not exist: create the bucket, or check the URL"):
        sp.save(url, {"w": torch.ones(4)}, storage_options=s3_server.storage_options)
    store = FsspecStorage(url, s3_server.storage_options)
    with pytest.raises(StorageError, match=r"cannot write s3://no-such-bucket-.*/run1/final/"
                       r"data/x.*create the bucket, or check the URL"):
        store.write("data/x", [bytes(10)])
    with pytest.raises(StorageError, match=r"manifest\.json.*create the bucket"):
        store.publish("manifest.json", b"{}", overwrite=False)
    store.close()


def test_a_failed_multipart_upload_is_aborted(s3_server: S3Server, s3_url: str) -> None:
    store = FsspecStorage(s3_url, s3_server.storage_options, part_bytes=5 << 20)

    def chunks() -> Iterator[bytes]:
        yield bytes(6 << 20)
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="producer"):
        store.write("big.bin", chunks())
    assert not store.exists("big.bin")
    bucket, key, _ = store.fs.split_path(store.root)
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    assert not uploads.get("Uploads"), "no multipart upload is left open"


def _buffered_scheme() -> str:
    """A memory filesystem whose files upload as gcsfs's and adlfs's do (buffered, the object
    made when the file is closed), registered as ``spbuffered://``: no GCS or Azure server
    here."""
    import fsspec
    from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
    from fsspec.spec import AbstractBufferedFile

    class UploadFile(AbstractBufferedFile):  # type: ignore[misc]
        def _initiate_upload(self) -> None:
            self.uploaded = bytearray()

        def _upload_chunk(self, final: bool = False) -> bool:
            self.uploaded += self.buffer.getvalue()
            if final:  # the object appears when the upload is finished
                self.fs.store[self.path] = MemoryFile(self.fs, self.path, bytes(self.uploaded))
            return True

    class BufferedFileSystem(MemoryFileSystem):  # type: ignore[misc]
        protocol = "spbuffered"
        store: ClassVar[dict[str, Any]] = {}
        pseudo_dirs: ClassVar[list[str]] = [""]

        def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            if "w" not in mode:
                return super()._open(path, mode, *args, **kwargs)
            return UploadFile(self, self._strip_protocol(path), mode, block_size=1 << 20)

    fsspec.register_implementation("spbuffered", BufferedFileSystem, clobber=True)
    return "spbuffered"


@pytest.mark.parametrize("driver", ["memory", "buffered"])
def test_a_failed_streamed_write_leaves_nothing_and_passes_the_callers_error(
    driver: str,
) -> None:
    """Off S3 a write goes through the driver's file object. One whose chunks failed left
    the bytes written so far under the name: memory:// stores a file when it is opened, and
    gcsfs's and adlfs's files, discarded but left open, were closed by fsspec's `__del__`
    once collected, which finished the upload. The caller's own error came back as a
    StorageError saying to check the URL and credentials."""
    scheme = "memory" if driver == "memory" else _buffered_scheme()
    store = FsspecStorage(f"{scheme}://sp-{uuid.uuid4().hex}", part_bytes=1024)

    def chunks() -> Iterator[bytes]:
        yield bytes(3000)  # more than a part: streamed
        raise RuntimeError("the producer failed")

    try:
        with pytest.raises(RuntimeError, match="producer"):
            store.write("big.bin", chunks())
        gc.collect()  # the traceback that held the driver's file is gone
        assert not store.exists("big.bin")
        assert store.write("big.bin", iter([bytes(3000)])) == 3000  # a later write works
        assert store.size("big.bin") == 3000
    finally:
        store.close()


# -- transient errors and retries ---------------------------------------------------------------


def _client_error(status: int, code: str) -> Exception:
    import botocore.exceptions as botocore

    response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return botocore.ClientError(response, "PutObject")  # type: ignore[no-any-return]


@pytest.mark.parametrize(("status", "code", "transient"), [
    (503, "SlowDown", True),
    (500, "InternalError", True),
    (400, "RequestTimeout", True),
    (429, "TooManyRequests", True),
    (403, "AccessDenied", False),
    (400, "InvalidArgument", False),
])
def test_transient_client_errors(status: int, code: str, transient: bool) -> None:
    assert is_transient(_client_error(status, code)) is transient
    wrapped = OSError(errno.EIO, "translated")  # what s3fs raises, with the ClientError as cause
    wrapped.__cause__ = _client_error(status, code)
    assert is_transient(wrapped) is transient


def test_retry_jitter_leaves_the_training_s_random_stream_alone() -> None:
    """Python's global `random` is augmentation's stream, which `sp.RNGState` saves; a retry
    of a save in the background must not advance it (botocore's own retries do: README)."""
    random.seed(1234)
    training_stream = random.getstate()
    delays = [RetryPolicy().delay_s(attempt) for attempt in range(1, 7)]
    assert random.getstate() == training_stream
    assert all(0 <= d <= RetryPolicy().max_delay_s for d in delays) and len(set(delays)) > 1


def test_transient_connection_errors() -> None:
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError())
    assert not is_transient(PermissionError())
    assert not is_transient(ValueError("a bug"))


#: Error answers a FaultProxy fate injects: (HTTP status, S3 error code).
_ANSWERS = {"503": (503, "ServiceUnavailable"), "409": (409, "ConditionalRequestConflict"),
            "501": (501, "NotImplemented")}


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of moto. `fault(method, path)` decides each
    request's fate: None forwards it, "503" answers ServiceUnavailable, "drop" closes the
    connection without an answer, "cut" forwards it and closes halfway through the answer.

    Attributes:
        endpoint: the proxy's URL, to use in place of moto's.
        seen: (method, path, fate) of every request.
        no_conditional_puts: answer every PUT with ``If-None-Match`` 501 NotImplemented
            (fate "501"), as an S3-compatible store without conditional puts does.
    """

    def __init__(self, upstream: str) -> None:
        self.fault: Callable[[str, str], str | None] = lambda method, path: None
        self.seen: list[tuple[str, str, str]] = []
        self.no_conditional_puts = False
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(parts)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _handle(self) -> None:
                body = self._body()
                conditional = self.command == "PUT" and "If-None-Match" in self.headers
                fate = ("501" if proxy.no_conditional_puts and conditional
                        else proxy.fault(self.command, self.path))
                proxy.seen.append((self.command, self.path, fate or "ok"))
                if fate == "drop":
                    self.close_connection = True
                    return
                if fate in _ANSWERS:
                    status, code = _ANSWERS[fate]
                    error = (f"<Error><Code>{code}</Code><Message>injected</Message>"
                             "</Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection")}
                headers["Content-Length"] = str(len(body))
                upstream_connection = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    upstream_connection.request(self.command, self.path, body, headers)
                    response = upstream_connection.getresponse()
                    payload = response.read()
                finally:
                    upstream_connection.close()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if fate == "cut" and payload:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    server = FaultProxy(s3_server.endpoint)
    yield server
    server.close()


@pytest.fixture
def fast_retries() -> Iterator[None]:
    """s3:// with quick retries and 5 MiB parts."""
    storage_module.register(
        "s3", lambda url, options: FsspecStorage(url, options, retry=FAST, part_bytes=5 << 20)
    )
    try:
        yield
    finally:
        storage_module._REGISTERED.pop("s3", None)


def _through(proxy: FaultProxy) -> dict[str, Any]:
    """storage_options reaching moto through `proxy`, with the driver's own retries off so
    that safepoint's are the ones tested."""
    return {"client_kwargs": {"endpoint_url": proxy.endpoint}, "key": "testing",
            "secret": "testing", "config_kwargs": {"retries": {"max_attempts": 1}}}


def _every(n: int, fate: str, methods: tuple[str, ...]) -> Callable[[str, str], str | None]:
    count = 0
    lock = threading.Lock()

    def fault(method: str, path: str) -> str | None:
        nonlocal count
        if method not in methods:
            return None
        with lock:
            count += 1
            return fate if count % n == 0 else None

    return fault


@pytest.mark.parametrize("fate", ["503", "drop"])
def test_save_succeeds_through_transient_failures(
    s3_server: S3Server, s3_url: str, proxy: FaultProxy, fast_retries: None, fate: str
) -> None:
    options = _through(proxy)
    sp.save(s3_url, _state(1), storage_options=options)
    proxy.fault = _every(3, fate, ("PUT", "POST"))
    sp.save(s3_url, _state(2), overwrite=True, storage_options=options)
    assert any(f == fate for _, _, f in proxy.seen), "faults were injected"
    proxy.fault = _every(2, "cut" if fate == "drop" else fate, ("GET",))
    _assert_state(sp.load(s3_url, storage_options=options), 2)
    proxy.fault = lambda method, path: None
    assert sp.verify(s3_url, storage_options=s3_server.storage_options).ok


def test_a_commit_that_meets_a_409_conflict_is_retried(
    s3_server: S3Server, s3_url: str, proxy: FaultProxy, fast_retries: None
) -> None:
    """S3 answers one of two conditional puts of a key at the same moment (a commit's
    manifest, a lease) with 409 ConditionalRequestConflict, and says to retry: the commit is
    retried and lands, rather than failing the save (found by a review)."""
    manifest_puts = []

    def fault(method: str, path: str) -> str | None:
        if method == "PUT" and path.split("?")[0].endswith("/manifest.json"):
            manifest_puts.append(path)
            return "409" if len(manifest_puts) == 1 else None
        return None

    proxy.fault = fault
    sp.save(s3_url, _state(1), storage_options=_through(proxy))
    assert len(manifest_puts) == 2
    _assert_state(sp.load(s3_url, storage_options=s3_server.storage_options), 1)


def test_a_store_without_conditional_puts_commits_by_check_then_put(
    s3_server: S3Server, s3_url: str, proxy: FaultProxy, fast_retries: None,
    caplog: pytest.LogCaptureFixture
) -> None:
    """An S3-compatible store that answers the commit's conditional put (If-None-Match: *)
    with 501 NotImplemented made every commit and every lease fail, advising to check the
    network (found by a review). The storage turns conditional puts off at the first such
    answer, with a warning naming the endpoint, and checks, then puts, as README promises:
    an existing manifest is still refused, and the store is not asked again, by any storage
    on that endpoint (each save, lease and step opens its own)."""
    proxy.no_conditional_puts = True
    options = _through(proxy)
    with caplog.at_level("WARNING", logger="safepoint._storage_fsspec"):
        sp.save(s3_url, _state(1), storage_options=options)
    assert [f for _, _, f in proxy.seen].count("501") == 1
    assert proxy.endpoint in caplog.text and "does not implement conditional puts" in caplog.text
    _assert_state(sp.load(s3_url, storage_options=s3_server.storage_options), 1)
    with sp.CheckpointManager(f"{s3_url}/run", storage_options=options) as mgr:  # lease too
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    with sp.CheckpointManager(f"{s3_url}/run", storage_options=options) as mgr:
        assert mgr.steps() == [1, 2]
        restored = _state(0)
        assert mgr.restore(restored) == 2
    _assert_state(restored, 2)
    store = FsspecStorage(f"{s3_url}/one", options, retry=FAST)
    store.publish("manifest.json", b"first", overwrite=False)
    assert [f for _, _, f in proxy.seen].count("501") == 1
    assert caplog.text.count("does not implement conditional puts") == 1
    proxy.seen.clear()
    with pytest.raises(FileExistsError):
        store.publish("manifest.json", b"second", overwrite=False)
    assert store.read("manifest.json") == b"first"
    assert not store.conditional_puts and "501" not in [f for _, _, f in proxy.seen]


def test_children_lists_one_level_and_says_what_is_not_a_directory(
    s3_server: S3Server, s3_url: str
) -> None:
    """`children` (what `safepoint ls` lists) names the files and directories directly
    under a prefix; a missing bucket is the bucket error `list` gives, not an empty listing
    ("no checkpoint"), and an object is no directory (found by a review)."""
    store = FsspecStorage(s3_url, s3_server.storage_options)
    store.write("run/step-1/manifest.json", [b"{}"])
    store.write("run/notes.txt", [b"x"])
    assert store.children("run") == (["notes.txt"], ["step-1"])
    with pytest.raises(FileNotFoundError):
        store.children("run/notes.txt")
    with pytest.raises(FileNotFoundError):
        store.children("nothing")
    missing = FsspecStorage(f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/run",
                            s3_server.storage_options)
    with pytest.raises(StorageError, match="bucket does not exist: create the bucket"):
        missing.children("")


def test_a_manager_on_a_missing_bucket_says_so(s3_server: S3Server) -> None:
    """A listing of a bucket that does not exist is no empty listing: a manager would take
    it for a fresh run and train from the start, with the error only at its first save
    (found by a review)."""
    root = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/run1"
    with sp.CheckpointManager(root, storage_options=s3_server.storage_options) as manager:
        with pytest.raises(StorageError, match=r"no-such-bucket-\w+/run1.*bucket does not "
                           r"exist: create the bucket"):
            manager.restore(_state(0))
        with pytest.raises(StorageError, match="create the bucket"):
            manager.steps()


def test_a_load_from_a_missing_bucket_says_so(s3_server: S3Server) -> None:
    """load, info and verify of a checkpoint in a bucket that does not exist said only "no
    committed checkpoint at ...: check the path", while a save or a manager said the bucket
    is missing (found by a review)."""
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/ckpt"
    for call in (sp.load, sp.info, sp.verify):
        with pytest.raises(sp.CheckpointNotFound, match=r"no committed checkpoint at "
                           r"s3://no-such-bucket-\w+/ckpt \(cannot list .* its bucket does "
                           r"not exist: create the bucket"):
            call(url, storage_options=s3_server.storage_options)


def test_an_endpoint_that_never_answered_is_not_retried_on_top_of_the_driver() -> None:
    """A wrong endpoint (nothing listens there): the driver's own retries are all it gets,
    so `safepoint ls` with a typo answers in seconds, not after a minute of retries; an
    endpoint that answered before is retried as any transient failure (found by a review)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed once the block ends: nothing listens there
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}, "key": "testing",
               "secret": "testing", "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(StorageError, match=r"reading s3://safepoint-test/x/manifest.json "
                       r"failed: .*check the URL") as raised:
        sp.info("s3://safepoint-test/x", storage_options=options)
    assert "attempts" not in str(raised.value)


def test_a_persistent_failure_leaves_the_previous_checkpoint(
    s3_server: S3Server, s3_url: str, proxy: FaultProxy, fast_retries: None
) -> None:
    options = _through(proxy)
    sp.save(s3_url, _state(1), storage_options=options)
    proxy.fault = lambda method, path: "503" if method in ("PUT", "POST") else None
    with pytest.raises(StorageError, match=s3_url) as raised:
        sp.save(s3_url, _state(2), overwrite=True, storage_options=options)
    assert "after 6 attempts" in str(raised.value)
    proxy.fault = lambda method, path: None
    _assert_state(sp.load(s3_url, storage_options=s3_server.storage_options), 1)


def test_a_large_file_streams_to_any_fsspec_filesystem() -> None:
    """Without S3's multipart API, a file of several parts goes through the driver's own
    stream, each part copied before the next chunk is asked for."""
    store = FsspecStorage(f"memory://safepoint-{uuid.uuid4().hex}", part_bytes=1 << 20)
    buffer = bytearray(300_000)
    expected = b""

    def chunks() -> Iterator[memoryview]:
        nonlocal expected
        for value in range(12):
            buffer[:] = bytes([value]) * len(buffer)
            expected += bytes(buffer)
            yield memoryview(buffer)

    assert store.write("big.bin", chunks()) == 12 * 300_000
    assert store.read("big.bin") == expected
    store.fs.rm(store.root, recursive=True)


def test_a_manager_on_s3_lists_restores_and_retains(s3_server: S3Server, s3_url: str) -> None:
    """Latest-step discovery, retention deletes and restore on an object store."""
    options = s3_server.storage_options
    with sp.CheckpointManager(s3_url, keep_last=2, async_save=False,
                              storage_options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((100,), float(step)), "step": step})
        assert mgr.steps() == [2, 3]
        target = {"w": torch.zeros(100), "step": 0}
        assert mgr.restore(target) == 3
        assert target["step"] == 3 and float(target["w"][0]) == 3.0
    store = FsspecStorage(s3_url, options)
    assert not [p for p in store.list() if p.startswith("step-1/")], "step 1 is fully deleted"


def test_loads_are_planned_in_reads_of_the_storages_read_bytes(
    s3_server: S3Server, s3_url: str, proxy: FaultProxy
) -> None:
    """An object store asks the engine for long reads: one GET per 64 MiB by default."""
    options = _through(proxy)
    sp.save(s3_url, _state(1), storage_options=options)
    gets = {}
    try:
        for read_bytes in (64 << 20, 1 << 20):
            storage_module.register("s3", lambda url, opts, n=read_bytes: FsspecStorage(
                url, opts, read_bytes=n))
            proxy.seen.clear()
            _assert_state(sp.load(s3_url, storage_options=options), 1)
            gets[read_bytes] = sum(m == "GET" and "/data/" in p for m, p, _ in proxy.seen)
    finally:
        storage_module._REGISTERED.pop("s3", None)
    assert gets[64 << 20] == 1
    assert gets[1 << 20] >= 6


def test_link_is_a_copy_on_the_server_and_retried(
    s3_server: S3Server, s3_url: str, proxy: FaultProxy
) -> None:
    """A sibling checkpoint's object joins the new one by CopyObject (a PUT the proxy sees;
    the source's bytes never GET), after HEADs of the two keys, retried through a transient
    failure."""
    data = bytes(range(256)) * 4000
    step1 = FsspecStorage(f"{s3_url}/step1", s3_server.storage_options)
    step1.write("data/a.bin", [data])
    step2 = FsspecStorage(f"{s3_url}/step2", _through(proxy), retry=FAST)
    failed = threading.Event()

    def first_put_fails(method: str, path: str) -> str | None:
        if method == "PUT" and not failed.is_set():
            failed.set()
            return "503"
        return None

    proxy.fault = first_put_fails
    step2.link(f"{s3_url}/step1/data/a.bin", "data/a.bin")
    proxy.fault = lambda method, path: None
    puts = [(path, fate) for method, path, fate in proxy.seen if method == "PUT"]
    assert [fate for _, fate in puts] == ["503", "ok"]
    assert all("/step2/data/a.bin" in path for path, _ in puts)
    assert {method for method, _, _ in proxy.seen} == {"HEAD", "PUT"}, "no GET, no listing"
    assert step2.read("data/a.bin") == data
    assert step1.read("data/a.bin") == data
    step1.close()
    step2.close()


def test_link_from_another_filesystem_is_refused() -> None:
    store = FsspecStorage(f"memory://safepoint-{uuid.uuid4().hex}")
    with pytest.raises(StorageError, match="not on this memory:// filesystem"):
        store.link("gcs://b/a.bin", "b.bin")


@pytest.fixture
def no_copy_url() -> str:
    """A memory filesystem whose `cp_file` is fsspec's unimplemented default, as ftp://,
    http:// and dbfs:// leave it: ``spnocopy://<uuid>``."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class NoCopyFileSystem(MemoryFileSystem):
        protocol = "spnocopy"
        store: ClassVar[dict[str, Any]] = {}
        pseudo_dirs: ClassVar[list[str]] = [""]
        cp_file = fsspec.AbstractFileSystem.cp_file

    fsspec.register_implementation("spnocopy", NoCopyFileSystem, clobber=True)
    return f"spnocopy://b{uuid.uuid4().hex}/run"


@pytest.mark.parametrize("filesystem", ["sync", "async"])
def test_a_filesystem_that_cannot_copy_has_no_link(
    request: pytest.FixtureRequest, filesystem: str
) -> None:
    """A filesystem without a copy of its own (sync: `cp_file`; async, such as http://:
    `_cp_file`) was offered `link` all the same: a manager took `incremental=True`, and every
    save after the first failed with a NotImplementedError. It has no link now, so the
    manager refuses incremental saves when it is made, as docs/manager.md says."""
    if filesystem == "async":
        url = "http://127.0.0.1:9/run"  # nothing is asked of the server
    else:
        url = request.getfixturevalue("no_copy_url")
    store = FsspecStorage(url)
    assert store.link is None
    store.close()
    with pytest.raises(sp.SafepointError, match=r"incremental=True.*incremental=False"):
        sp.CheckpointManager(url, incremental=True)
    assert callable(FsspecStorage(f"memory://safepoint-{uuid.uuid4().hex}").link)


def test_a_url_that_is_an_object_is_named_a_file(s3_server: S3Server, s3_url: str) -> None:
    """sp.info of a torch.save file on S3 says it is a file and names sp.import_checkpoint,
    as it does on a local disk (it said only that no checkpoint was there)."""
    options = s3_server.storage_options
    FsspecStorage(s3_url, options).write("model.pt", [b"not a checkpoint"])
    with pytest.raises(sp.CheckpointNotFound, match=r"it is a file.*import_checkpoint"):
        sp.info(f"{s3_url}/model.pt", storage_options=options)
    with pytest.raises(sp.CheckpointNotFound) as caught:
        sp.info(f"{s3_url}/nothing", storage_options=options)
    assert "is a file" not in str(caught.value)


_ANOTHER_PROCESS_SAVES = """
import json, sys, numpy as np, safepoint as sp
root, step, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
with sp.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
    mgr.save(step, {"w": np.full(3, float(step))})
"""


def test_a_reader_sees_a_step_committed_after_it_listed_it_half_written(
    s3_server: S3Server, s3_url: str,
) -> None:
    """A process watching a run on S3 (an evaluator polling `latest_step()`) lists the root
    while the job's save of step 2 is half written, then the job commits it: the step
    verifies and restores. fsspec answered the reads from the listing it had cached without
    the manifest: verify said CheckpointNotFound, and restore fell back to step 1."""
    options = s3_server.storage_options

    def job_saves(step: int) -> None:
        subprocess.run([sys.executable, "-c", _ANOTHER_PROCESS_SAVES, s3_url, str(step),
                        json.dumps(options)], check=True, timeout=120)

    job_saves(1)
    half = FsspecStorage(f"{s3_url}/step-2", options)
    half.write(f"data/{uuid.uuid4().hex}-r00000-0000.bin", [bytes(64)])  # no manifest yet
    reader = sp.CheckpointManager(s3_url, storage_options=options)
    try:
        assert reader.steps() == [1]
        job_saves(2)
        assert reader.steps() == [1, 2]
        assert sp.verify(reader.step_url(2), storage_options=options).ok
        target = {"w": np.zeros(3)}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "step 2 cannot be restored ... trying step 1"
            assert reader.restore(target) == 2
        assert target["w"].tolist() == [2.0, 2.0, 2.0]
    finally:
        reader.close()


def _open_uploads(store: FsspecStorage, under: str = "") -> list[str]:
    bucket, key, _ = store.fs.split_path(store._full(under))
    found = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    return sorted(upload["Key"] for upload in found.get("Uploads", []))


def test_a_killed_saves_incomplete_upload_is_a_leftover_that_the_next_writer_aborts(
    s3_server: S3Server, s3_url: str, small_parts: None
) -> None:
    """A save killed during a multipart upload leaves the upload open: the store keeps its
    parts (and bills them) until it is aborted, and no listing of objects shows it, so
    neither `safepoint ls` nor the next writer (gc, a commit) ever removed it."""
    options = s3_server.storage_options
    root = f"{s3_url}/run"
    store = FsspecStorage(root, options, part_bytes=5 << 20)
    bucket, _, _ = store.fs.split_path(store.root)

    def killed_upload(name: str) -> None:  # what a SIGKILL in the middle of a part leaves
        _, key, _ = store.fs.split_path(store._full(name))
        upload = store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        store.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"],
                         PartNumber=1, Body=bytes(5 << 20))

    with sp.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
        mgr.save(1, _state(1))
    killed_upload(f"step-1/data/{'1' * 32}-r00000-0000.bin")  # a killed overwrite of step 1
    killed_upload(f"step-2/data/{'2' * 32}-r00000-0000.bin")  # a killed first save of step 2
    assert "step-2" in subprocess.run(
        [sys.executable, "-m", "safepoint", "ls", root, "--storage-options",
         json.dumps(options)], capture_output=True, text=True, check=True).stdout
    with sp.CheckpointManager(root, async_save=False, storage_options=options) as mgr:
        mgr.save(1, _state(3))  # taking the lease and the commit remove the leftovers
    assert _open_uploads(store) == []
    _assert_state(sp.load(f"{root}/step-1", storage_options=options), 3)


def test_an_upload_started_twice_after_a_lost_answer_leaves_none_open(
    s3_server: S3Server, s3_url: str
) -> None:
    """The answer to the request that starts a multipart upload was lost (a dropped
    connection): the request, tried again, started a second upload, and the first stayed
    open for good, though the save succeeded."""

    class LostAnswer(FsspecStorage):
        lost: ClassVar[list[str]] = []

        def _call(self, action: str, path: str, fn: Any, *, retry: bool = True) -> Any:
            if action.startswith("starting the upload") and not self.lost:
                start = fn

                def answer_lost() -> Any:
                    if self.lost:
                        return start()
                    self.lost.append(start()["UploadId"])  # it reached the server
                    raise ConnectionResetError("the connection dropped before the answer")

                fn = answer_lost
            return super()._call(action, path, fn, retry=retry)

    store = LostAnswer(f"{s3_url}/lost", s3_server.storage_options, part_bytes=5 << 20,
                       retry=RetryPolicy(first_delay_s=0.01, max_delay_s=0.02))
    assert store.write("big.bin", [bytes(6 << 20)]) == 6 << 20
    assert LostAnswer.lost and _open_uploads(store) == []


def test_an_endpoint_whose_connections_time_out_is_not_retried_on_top_of_the_driver(
    s3_server: S3Server
) -> None:
    """A firewalled endpoint drops connection attempts, which time out: like a refused one,
    it gets the driver's retries only (safepoint's came on top of a minute of the driver's)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        held = []
        for _ in range(3):  # a full accept queue: further connection attempts are dropped
            client = socket.socket()
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                client.connect(("127.0.0.1", port))
            held.append(client)
        options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
                   "key": "testing", "secret": "testing", "skip_instance_cache": True,
                   "config_kwargs": {"connect_timeout": 1, "read_timeout": 1,
                                     "retries": {"max_attempts": 1}}}
        try:
            with pytest.raises(StorageError, match="check the URL") as raised:
                sp.info("s3://safepoint-test/x", storage_options=options)
        finally:
            for client in held:
                client.close()
    assert "attempts" not in str(raised.value)


def test_a_reader_denied_the_listing_of_uploads_still_lists_and_restores(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uploads in progress are listed only to be aborted: credentials without
    s3:ListBucketMultipartUploads (a read-only evaluation job's), or a store that does not
    implement the call, made every listing fail, and with it steps() and restore()."""
    import s3fs

    options = s3_server.storage_options
    root = f"{s3_url}/run"
    with sp.CheckpointManager(root, async_save=False, storage_options=options) as writer:
        writer.save(1, _state(1))
    call = s3fs.S3FileSystem.call_s3
    denied: list[str] = []

    def denying(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "list_multipart_uploads":
            denied.append(method)
            raise PermissionError(errno.EACCES, "Access Denied")
        return call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", denying)
    with sp.CheckpointManager(root, storage_options=options) as reader:
        assert reader.steps() == [1]
        target = _state(0)
        assert reader.restore(target) == 1
    assert denied
    _assert_state(target, 1)


def test_a_conditional_put_whose_answer_the_driver_lost_is_a_success(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest's conditional put landed, its answer was lost, and botocore's own retry
    met 412: safepoint compared the bytes only after a retry of its own, so a save that had
    committed raised CheckpointExists (and a manager's first lease LeaseHeld, naming itself)."""
    real_put = FsspecStorage._put

    def answer_lost(self: FsspecStorage, path: str, data: bytes, *, create: bool = False) -> None:
        real_put(self, path, data, create=create)
        if create:  # the driver's retry of a put that landed
            raise FileExistsError(errno.EEXIST, "PreconditionFailed", path)

    monkeypatch.setattr(FsspecStorage, "_put", answer_lost)
    options = s3_server.storage_options
    sp.save(s3_url, {"w": np.arange(3.0)}, storage_options=options)
    assert np.array_equal(sp.load(s3_url, storage_options=options)["w"], np.arange(3.0))
    with sp.CheckpointManager(f"{s3_url}-run", storage_options=options, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(2)})
        assert mgr.steps() == [1]
    with pytest.raises(sp.CheckpointExists):  # another save's manifest is still refused
        sp.save(s3_url, {"w": np.zeros(3)}, storage_options=options)
