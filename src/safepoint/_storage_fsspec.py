"""Every URL scheme other than local paths, through fsspec: S3 (s3fs), GCS (gcsfs), Azure
(adlfs), memory:// and anything else fsspec knows (storage layer).

Object stores have no rename, so nothing here renames: `write` puts a data object whole (a
multipart upload becomes visible only when it completes), and `publish` puts the manifest
object last, which is the commit. On S3, `publish(..., overwrite=False)` is a conditional put
(``If-None-Match: *``, botocore 1.35.20+), so two writers cannot both commit the same
checkpoint; other stores, older botocore, and an S3-compatible store that answers the
conditional put 501 NotImplemented (from then on, with a warning) check, then put (a
concurrent writer of the same checkpoint could race; one writer per checkpoint is the rule
anyway).

Speed comes from parallelism, with threads only (fsspec's own event loop stays inside fsspec):
a large file on S3 uploads as a multipart upload with several parts in flight, each part
copied out of the caller's chunks into a part buffer of a bounded pool; `readinto` splits a
range into sub-ranges fetched in parallel, each copied into its slice of the destination
buffers as it arrives.

Transient failures (throttling, 5xx, dropped or reset connections, timeouts) are retried per
request with exponential backoff and full jitter, a bounded number of times; what still fails
raises `StorageError` naming the URL.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import io
import itertools
import logging
import queue
import random
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import SafepointError, StorageError
from .storage import Buffer, split_url

__all__ = ["FsspecStorage", "RetryPolicy", "is_transient", "jitter"]

logger = logging.getLogger(__name__)

#: Jitter for retry waits, apart from `random`'s global stream: that one is the training's
#: (augmentation, `sp.RNGState`), which a retry must not advance; per process, as ranks
#: forked from one parent would otherwise wait in step.
jitter = random.SystemRandom()

T = TypeVar("T")

#: fsspec driver package -> the safepoint extra that installs it.
_EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure"}
#: HTTP statuses worth another try: throttling and server-side failures.
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Error codes object stores send with throttling or a failure on their side.
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "ServerBusy", "OperationTimedOut",
    # 409 to one of two conditional puts of a key at the same moment; S3 says to retry it
    "ConditionalRequestConflict",
})
#: Exception class names (botocore, aiohttp, urllib3, fsspec, azure-core) meaning the
#: connection failed or dropped, matched by name so that no driver has to be importable.
_TRANSIENT_TYPES = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "HTTPClientError",
    "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError",
    "ClientConnectorError", "ServerTimeoutError", "IncompleteRead", "ProtocolError",
    "FSTimeoutError", "ServiceRequestError", "ServiceResponseError",
})
#: Exception class names meaning no connection could be made at all (a wrong endpoint, a
#: server that is down): the driver retried them already, and a filesystem that never
#: answered in this process is not retried again (a typo would cost a minute of retries).
_UNREACHABLE_TYPES = frozenset({"EndpointConnectionError", "ConnectionRefusedError",
                                "ClientConnectorError", "ConnectTimeoutError",
                                "ConnectionTimeoutError"})
#: Error codes of a store that does not implement a request's feature (an S3-compatible
#: store given ``If-None-Match``): "501" is botocore's code for a 501 answer without a body.
_NOT_IMPLEMENTED = frozenset({"NotImplemented", "501"})
#: The filesystems that answered a request in this process.
_ANSWERED: weakref.WeakSet[Any] = weakref.WeakSet()
#: The S3 endpoints that answered a conditional put with NotImplemented in this process:
#: every storage on them (each save, lease and step opens its own) checks, then puts.
_NO_CONDITIONAL_PUTS: set[str] = set()
#: Signals callers act on, raised as they are (the seam's contract).
_PASS = (FileNotFoundError, FileExistsError, EOFError, SafepointError)
#: Never retried: the answer will not change.
_FINAL = (*_PASS, PermissionError)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a request that failed transiently is retried.

    Attempt n (from 1) that fails waits a random time up to
    ``min(max_delay_s, first_delay_s * 2 ** (n - 1))`` ("full jitter") before the next one.

    Attributes:
        attempts: the most tries per request, the first included.
        first_delay_s: the cap of the first wait.
        max_delay_s: the cap of every wait.
    """

    attempts: int = 6
    first_delay_s: float = 0.2
    max_delay_s: float = 8.0

    def delay_s(self, attempt: int) -> float:
        """The wait after failed attempt `attempt` (1-based)."""
        return jitter.uniform(0, min(self.max_delay_s, self.first_delay_s * 2 ** (attempt - 1)))


def _copies_on_server(fs: Any) -> bool:
    """Whether the fsspec filesystem `fs` implements `cp_file` (directly, or as an async
    filesystem's `_cp_file`) rather than inheriting fsspec's NotImplementedError."""
    from fsspec import AbstractFileSystem
    from fsspec.asyn import AsyncFileSystem

    kind = type(fs)
    if kind.cp_file is not AbstractFileSystem.cp_file:
        return True
    return isinstance(fs, AsyncFileSystem) and kind._cp_file is not AsyncFileSystem._cp_file


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or an error it was raised from) is throttling, a server-side failure,
    a dropped connection or a timeout: worth another try."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _FINAL) and current is exc:
            return False
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if any(cls.__name__ in _TRANSIENT_TYPES for cls in type(current).__mro__):
            return True
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            if status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES:
                return True
        for attribute in ("status_code", "status", "code"):
            if getattr(current, attribute, None) in _TRANSIENT_STATUS:
                return True
        current = current.__cause__ or current.__context__
    return False


def _error_code(exc: BaseException) -> str | None:
    """The object store's error code (``InvalidRange``, ...) somewhere in `exc`'s chain."""
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return None
        response = getattr(current, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
        current = current.__cause__ or current.__context__
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module that failed to import, or has no spec
        return False


def _filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """(fsspec filesystem, its path for `url`).

    Raises:
        SafepointError: fsspec does not know the scheme, its driver is not installed, or the
            filesystem's constructor refused `storage_options` (a TypeError: an option it
            does not take, a required one missing, a key that is not a string).
    """
    import fsspec
    from fsspec.core import url_to_fs
    from fsspec.registry import known_implementations

    scheme, _ = split_url(url)
    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        spec = known_implementations.get(scheme, {})
        # The package that is missing: of those fsspec names in quotes (paramiko for sftp://,
        # whose class is fsspec's own; "requests" and "aiohttp" for http://), the first not
        # installed; else the module Python could not find; else the driver class's package.
        missing = [name for name in re.findall(r'"([A-Za-z0-9_.-]+)"', str(exc))
                   if not _installed(name.split(".")[0])]
        package = (missing[0] if missing else None) or getattr(exc, "name", None) or str(
            spec.get("class", scheme))
        package = package.split(".")[0]
        extra = _EXTRAS.get(package)
        hint = f"`pip install {package}`" + (
            f" (or `pip install 'safepoint[{extra}]'`)" if extra else ""
        )
        raise SafepointError(
            f"cannot open {url}: the {scheme}:// driver is not installed ({exc}); install "
            f"it with {hint}",
            url=url,
        ) from exc
    except TypeError as exc:
        raise SafepointError(
            f"cannot open {url}: the {scheme}:// filesystem refused its storage_options "
            f"({exc}); check the options' names and types against the driver's documentation",
            url=url,
        ) from exc
    except ValueError as exc:
        if scheme in fsspec.available_protocols():
            raise SafepointError(f"cannot open {url}: {exc}", url=url) from exc
        raise SafepointError(
            f"no storage backend for {url!r}: scheme {scheme!r} is known neither to safepoint "
            f"nor to fsspec; use a local path, or install a package that registers {scheme!r} "
            "under the 'safepoint.storage' entry points (or as an fsspec filesystem)",
            url=url,
        ) from exc
    return fs, str(path).rstrip("/")


class FsspecStorage:
    """The `Storage` protocol over an fsspec filesystem, rooted at a URL.

    Args:
        url: the base URL (``s3://bucket/run1/step_100``, ``memory://x``, ...).
        storage_options: passed to fsspec as they are (credentials, ``client_kwargs``, ...).
        retry: how transient failures are retried.
        part_bytes: size of each part of a multipart upload (S3: at least 5 MiB); smaller
            files go up in one request. S3 takes at most 10,000 parts per object, so every
            1,000 parts the part size doubles (up to S3's 5 GiB): 16 MiB parts reach files
            of over 5 TiB, S3's largest object.
        parts_in_flight: parts uploading at once per file; a write holds
            ``part_bytes * (parts_in_flight + 1)`` bytes of part buffers (twice that from a
            file's 1,001st part, four times from its 2,001st...).
        read_bytes: the longest ranged read. Loads are planned in reads of this size (each
            request to an object store has a high fixed cost; on moto it costs a read of the
            whole object), and `readinto` splits a longer range into parallel reads of it.
        read_threads: ranged reads in flight at once across all of this storage's calls.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        part_bytes: int = 16 << 20,
        parts_in_flight: int = 4,
        read_bytes: int = 64 << 20,
        read_threads: int = 8,
    ) -> None:
        self.url = url
        self.fs, self.root = _filesystem(url, storage_options)
        self.retry = retry or RetryPolicy()
        self.part_bytes = part_bytes
        self.parts_in_flight = max(1, parts_in_flight)
        self.read_bytes = read_bytes
        self.read_threads = max(1, read_threads)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._s3 = "s3" in protocols
        self._readers: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _where(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}" if path else self.url

    def _call(self, action: str, path: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        """`fn()`, retried while it fails transiently (unless `retry` is False: `fn` cannot
        run twice); errors mapped to the seam's."""
        attempt = 1
        attempts = self.retry.attempts if retry else 1
        while True:
            try:
                result = fn()
            except _PASS:
                self._answered()
                raise
            except Exception as exc:
                if attempt < attempts and is_transient(exc) and not self._unreachable(exc):
                    delay = self.retry.delay_s(attempt)
                    logger.info("%s %s failed (%s: %s), attempt %d of %d; retrying in %.2f s",
                                action, self._where(path), type(exc).__name__, exc, attempt,
                                attempts, delay)
                    time.sleep(delay)
                    attempt += 1
                    continue
                tries = f" after {attempt} attempts" if attempt > 1 else ""
                raise StorageError(
                    f"{action} {self._where(path)} failed{tries}: {type(exc).__name__}: {exc}; "
                    "check the URL, credentials and network, then retry (a committed "
                    "checkpoint there is unchanged)",
                    url=self._where(path),
                ) from exc
            self._answered()
            return result

    def _answered(self) -> None:
        with contextlib.suppress(TypeError):  # a filesystem that takes no weak reference
            _ANSWERED.add(self.fs)

    def _unreachable(self, exc: BaseException) -> bool:
        """Whether `exc` says no connection could be made, to a filesystem that never
        answered in this process."""
        with contextlib.suppress(TypeError):
            if self.fs in _ANSWERED:
                return False
        current: BaseException | None = exc
        for _ in range(8):
            if current is None:
                return False
            if any(cls.__name__ in _UNREACHABLE_TYPES for cls in type(current).__mro__):
                return True
            current = current.__cause__ or current.__context__
        return False

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(
                    self.read_threads, thread_name_prefix="safepoint-fsspec-read"
                )
            return self._readers

    def _fresh(self, path: str) -> None:
        """Forget fsspec's cached listings of `path`, which another writer may have changed."""
        self.fs.invalidate_cache(self._full(path))

    # -- writing ----------------------------------------------------------------------------

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        failed: list[BaseException] = []  # what the caller's chunks raised

        def source() -> Iterator[Buffer]:
            try:
                yield from chunks
            except BaseException as exc:
                failed.append(exc)
                raise

        with self._writable(path, failed):
            return self._write(path, source())

    @contextlib.contextmanager
    def _writable(self, path: str, failed: Sequence[BaseException] = ()) -> Iterator[None]:
        """Writing a key never meets a missing file, only a missing bucket (or container):
        s3fs and gcsfs raise FileNotFoundError for that, which callers would take for a
        missing checkpoint. One that the chunks to write raised (`failed`: the source of a
        copy is missing) is the caller's own, and left as it is."""
        try:
            yield
        except FileNotFoundError as exc:
            if exc in failed:
                raise
            raise StorageError(
                f"cannot write {self._where(path)}: {exc}: create the bucket, or check the URL",
                url=self._where(path),
            ) from exc

    def _write(self, path: str, chunks: Iterable[Buffer]) -> int:
        parts = _Parts(chunks, self.part_bytes, self.parts_in_flight + 1)
        first = parts.next()
        if first is None or parts.done:
            data = b"" if first is None else bytes(first.view)
            self._call("writing", path, lambda: self._put(path, data))
            return len(data)
        if self._s3:
            return self._multipart(path, parts, first)
        return self._stream(path, parts, first)

    @functools.cached_property
    def _knows_if_none_match(self) -> bool:
        """Whether botocore can send ``If-None-Match`` (1.35.20 or later), on S3."""
        if not self._s3:
            return False
        try:
            model = self.fs.s3.meta.service_model.operation_model("PutObject")
        except Exception:
            return False
        return "IfNoneMatch" in model.input_shape.members

    @property
    def conditional_puts(self) -> bool:
        """Whether `publish(..., overwrite=False)` is one conditional put (S3 with botocore
        1.35.20 or later, until the store answers one with NotImplemented, for every storage
        on that filesystem); else it checks, then puts."""
        return self._knows_if_none_match and self._endpoint not in _NO_CONDITIONAL_PUTS

    @property
    def _endpoint(self) -> str:
        """The S3 endpoint's URL ("(default)" for AWS's own)."""
        return str(getattr(self.fs.s3.meta, "endpoint_url", None) or "(default)")

    def _put(self, path: str, data: bytes, *, create: bool = False) -> None:
        """Put `data` at `path` whole; with `create`, refuse (FileExistsError) a `path` that
        exists: by a conditional put where the store takes one, else by a check, then a
        put."""
        full = self._full(path)
        if create and self.conditional_puts:
            try:
                self._put_object(full, data, {"IfNoneMatch": "*"})
            except Exception as exc:
                if _error_code(exc) not in _NOT_IMPLEMENTED:
                    raise
                self._stop_conditional_puts(exc)
            else:
                self._fresh(path)
                return
        # A writer putting the same path between the check and the put would be overwritten;
        # one writer per checkpoint is the rule (the manager's lease).
        if create and self.fs.exists(full):
            raise FileExistsError(errno.EEXIST, "exists", self._where(path))
        if self._s3:
            self._put_object(full, data, {})
        else:
            self.fs.pipe_file(full, data)
        self._fresh(path)

    def _put_object(self, full: str, data: bytes, condition: dict[str, str]) -> None:
        """S3: one PutObject of `data` at filesystem path `full`, with `condition`."""
        bucket, key, _ = self.fs.split_path(full)
        self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=io.BytesIO(data),
                        **condition)

    def _stop_conditional_puts(self, exc: BaseException) -> None:
        """Check, then put, from now on: the store refused a conditional put as not
        implemented (`exc`), as S3-compatible stores without ``If-None-Match`` do, though
        botocore offers it."""
        if self._endpoint not in _NO_CONDITIONAL_PUTS:
            logger.warning(
                "the S3 endpoint %s does not implement conditional puts (If-None-Match: *; "
                "%s): %s checks, then puts from now on, so two writers committing the same "
                "checkpoint (or taking the same lease) at the same instant could both succeed",
                self._endpoint, _error_code(exc), self.url)
        _NO_CONDITIONAL_PUTS.add(self._endpoint)

    def _stream(self, path: str, parts: _Parts, first: _Part) -> int:
        """Any fsspec filesystem: a streamed write through the driver's own file object, not
        retried here (the stream cannot be replayed; the driver retries its own requests).
        A write that fails (the driver's, or the caller's chunks, whose error passes as it
        is) leaves nothing under `path`: a buffered upload (gcsfs, adlfs) is discarded, not
        finished, and a file written in place (memory://) is removed."""
        full = self._full(path)
        f = self._call("writing", path, lambda: self.fs.open(full, "wb"), retry=False)
        total = 0
        try:
            part: _Part | None = first
            while part is not None:
                view = part.view
                self._call("writing", path, functools.partial(f.write, view), retry=False)
                total += len(view)
                parts.release(part)
                part = parts.next()
            self._call("writing", path, f.close, retry=False)
        except BaseException:
            self._discard(path, f)
            raise
        self._fresh(path)
        return total

    def _discard(self, path: str, f: Any) -> None:
        """Leave nothing of the failed streamed write `f` of `path`."""
        from fsspec.spec import AbstractBufferedFile

        try:
            if isinstance(f, AbstractBufferedFile):
                f.discard()  # the upload is made on close only: never made (nor on
                f.closed = True  # collection: fsspec's __del__ would close, and upload)
            else:
                f.close()
                self.fs.rm_file(self._full(path))
        except FileNotFoundError:
            pass
        except Exception:
            logger.warning("could not remove what a failed write left at %s",
                           self._where(path), exc_info=True)

    def _multipart(self, path: str, parts: _Parts, first: _Part) -> int:
        """S3: a multipart upload with `parts_in_flight` parts uploading at once."""
        full = self._full(path)
        bucket, key, _ = self.fs.split_path(full)
        upload_id = self._call("starting the upload of", path, lambda: self.fs.call_s3(
            "create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
        etags: dict[int, str] = {}
        failures: list[BaseException] = []
        total = 0

        def send(part: _Part) -> None:
            try:
                result = self._call(f"uploading part {part.number} of", path, lambda: (
                    self.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                    PartNumber=part.number, Body=io.BytesIO(part.view))))
                etags[part.number] = result["ETag"]
            except BaseException as exc:
                failures.append(exc)
            finally:
                parts.release(part)

        try:
            with ThreadPoolExecutor(self.parts_in_flight,
                                    thread_name_prefix="safepoint-fsspec-part") as pool:
                part: _Part | None = first
                while part is not None and not failures:
                    total += len(part.view)
                    pool.submit(send, part)
                    part = parts.next()
                if part is not None:
                    parts.release(part)
            if failures:
                raise failures[0]
            self._call("completing the upload of", path, lambda: self.fs.call_s3(
                "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": [
                    {"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)
                ]}))
        except BaseException:
            self._abort(path, bucket, key, upload_id)
            raise
        # A request to start the upload whose answer was lost, and which the driver or this
        # storage tried again, started an upload of this key that nothing else knows of.
        for other in self._uploads_if_allowed(full).get(full, []):
            self._abort(path, bucket, key, other)
        self._fresh(path)
        return total

    def _uploads(self, top: str) -> dict[str, list[str]]:
        """S3: the multipart uploads in progress at or under `top` (full path -> upload ids).
        A save or copy killed during an upload leaves one, which the store keeps (and bills)
        until it is aborted, and which no listing of objects shows."""
        if not self._s3:
            return {}
        bucket, key, _ = self.fs.split_path(top)
        found: dict[str, list[str]] = {}
        markers: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key,
                                   **markers)
            for upload in page.get("Uploads", []):
                name = f"{bucket}/{upload['Key']}"
                if name == top or name.startswith(f"{top}/"):
                    found.setdefault(name, []).append(upload["UploadId"])
            if not page.get("IsTruncated"):
                return found
            markers = {"KeyMarker": page["NextKeyMarker"],
                       "UploadIdMarker": page["NextUploadIdMarker"]}

    def _uploads_if_allowed(self, top: str) -> dict[str, list[str]]:
        """`_uploads(top)`, or none when the store refuses to list them (credentials without
        `s3:ListBucketMultipartUploads`, such as a read-only evaluation job's, or a store
        that does not implement it): they are only cleaned up, never read."""
        try:
            return self._call("listing the uploads under", "", lambda: self._uploads(top))
        except (PermissionError, StorageError):
            logger.debug("cannot list the multipart uploads under %s", top, exc_info=True)
            return {}

    def _abort(self, path: str, bucket: str, key: str, upload_id: str) -> None:
        """Drop the parts of a failed upload (the store would keep and bill them)."""
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:
            logger.warning("could not abort the multipart upload of %s; a lifecycle rule for "
                           "incomplete uploads removes its parts", self._where(path),
                           exc_info=True)

    def publish(self, path: str, data: bytes, *, overwrite: bool) -> None:
        payload = bytes(data)

        def put() -> None:
            try:
                self._put(path, payload, create=not overwrite)
            except FileExistsError:
                # A conditional put retried after its answer was lost (by this loop or by the
                # driver itself, as botocore does) finds its own bytes: a success. A manifest
                # or lease names a unique save id or token, so no other writer's are equal.
                self._fresh(path)
                with contextlib.suppress(FileNotFoundError):
                    if self.fs.cat_file(self._full(path)) == payload:
                        return
                raise

        with self._writable(path):
            self._call("publishing", path, put)

    @property
    def link(self) -> Callable[[str, str], None] | None:
        """The Storage protocol's optional `link` (`_copy_on_server`), or None where the
        filesystem leaves fsspec's `cp_file` unimplemented (ftp://, http://, dbfs://...): a
        manager then refuses `incremental=True` up front rather than fail every later
        save."""
        return self._copy_on_server if _copies_on_server(self.fs) else None

    def _copy_on_server(self, source_url: str, path: str) -> None:
        """Make `path` an object with the bytes of the object at `source_url` (a URL of this
        filesystem, or a path in it, usually a sibling checkpoint's data file) by a copy on
        the server (S3: CopyObject, multipart for objects over 5 GB), so no byte passes
        through this process; the copy is whole or absent, and durable when this returns.

        An existing `path` of the source's size is left as it is (data file names are unique
        per save, so it is the same file, copied before); this costs a metadata request per
        call, since a copy would silently replace it.

        Raises:
            FileNotFoundError: the source is missing.
            StorageError: `source_url` is another filesystem's, `path` exists with another
                size (a foreign file in the checkpoint directory; not FileExistsError, which
                callers read as "the checkpoint is committed"), or the store failed.
        """
        scheme, _ = split_url(source_url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if scheme and scheme not in protocols:
            raise StorageError(
                f"cannot link {source_url} into {self._where(path)}: the source is not on "
                f"this {protocols[0]}:// filesystem (link takes a file of the same storage "
                "backend)",
                url=self._where(path),
            )
        source = str(self.fs._strip_protocol(source_url)).rstrip("/")
        full = self._full(path)

        def copy() -> None:
            self.fs.invalidate_cache(source)
            self._fresh(path)
            have = self._size_or_none(full)
            if have is not None:
                want = self._size_or_none(source)
                if want is None:
                    raise FileNotFoundError(errno.ENOENT, "no such file", source_url)
                if have != want:
                    raise StorageError(
                        f"cannot link {source_url} into {self._where(path)}: an object of "
                        f"{have} bytes is there, not the source's {want}; the checkpoint "
                        "directory holds a foreign file (remove the incomplete checkpoint, "
                        "then save again)",
                        url=self._where(path),
                    )
                return
            try:
                # cp_file, not copy: one object, no glob expansion of the paths.
                self.fs.cp_file(source, full)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such file", source_url) from None
            finally:
                self._fresh(path)

        self._call(f"linking {source_url} as", path, copy)

    def _size_or_none(self, full: str) -> int | None:
        """The size of the file at filesystem path `full`, None when there is none."""
        try:
            if self._s3:
                # One HEAD: s3fs's info lists the prefix too when the key is missing.
                bucket, key, _ = self.fs.split_path(full)
                head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
                return int(head["ContentLength"])
            info = self.fs.info(full)
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    # -- reading ----------------------------------------------------------------------------

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        full = self._full(path)
        if end is not None and end <= start:
            self.size(path)  # a missing file is still an error
            return b""
        data: bytes = self._call("reading", path, lambda: self._cat(full, start, end))
        return data

    def _cat(self, full: str, start: int, end: int | None) -> bytes:
        try:
            try:
                data: bytes = self.fs.cat_file(full, start=start or None, end=end)
            except FileNotFoundError:
                # fsspec may answer from a listing it cached before another process wrote the
                # file (a reader that listed a step while it was being saved): ask the store.
                self.fs.invalidate_cache(full)
                data = self.fs.cat_file(full, start=start or None, end=end)
        except Exception as exc:
            if _error_code(exc) == "InvalidRange":  # S3: the range starts past the end
                return b""
            raise
        return data

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        total = sum(len(v) for v in views)
        if not total:
            if not self.exists(path):
                raise FileNotFoundError(errno.ENOENT, "no such file", self._where(path))
            return
        full = self._full(path)

        def fetch(start: int, nbytes: int) -> None:
            data = self._call("reading", path, lambda: self._cat(full, start, start + nbytes))
            if len(data) < nbytes:
                raise EOFError(f"{self._where(path)} ends at byte {start + len(data)}, before "
                               "the data the manifest records")
            _scatter(memoryview(data), views, start - offset)

        spans = [(s, min(self.read_bytes, offset + total - s))
                 for s in range(offset, offset + total, self.read_bytes)]
        if len(spans) == 1:
            fetch(*spans[0])
            return
        futures = [self._pool().submit(fetch, s, n) for s, n in spans]
        _first_error(futures)

    def size(self, path: str) -> int:
        self._fresh(path)
        size = self._call("reading the size of", path,
                          lambda: self._size_or_none(self._full(path)))
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", self._where(path))
        return size

    def exists(self, path: str) -> bool:
        # Not fs.isfile: it answers False when the request fails.
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True

    def children(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """The files and the directories directly under `prefix` (the protocol's optional
        `children`): one delimited listing (on S3, a LIST with the "/" delimiter) however deep
        the tree below, and the uploads that never completed, as `list` names them."""
        top = self._full(prefix.rstrip("/"))
        self._fresh(prefix)
        try:
            found = [(str(item["name"]).rstrip("/"), item["type"] == "directory") for item
                     in self._listing(prefix, lambda: self.fs.ls(top, detail=True))]
        except FileNotFoundError:
            found = []
        found += [(name, False) for name in self._uploads_if_allowed(top)]
        kinds: dict[str, bool] = {}  # name -> whether it is a directory
        for name, is_dir in found:
            if name.startswith(f"{top}/"):
                child, deeper, _ = name[len(top) + 1:].partition("/")
                kinds[child] = kinds.get(child, False) or is_dir or bool(deeper)
        if not kinds:  # nothing there, or an object: no directory
            raise FileNotFoundError(errno.ENOENT, "nothing there", self._where(prefix))
        return (sorted(name for name, is_dir in kinds.items() if not is_dir),
                sorted(name for name, is_dir in kinds.items() if is_dir))

    def _listing(self, prefix: str, listing: Callable[[], Any]) -> Any:
        """`listing()` of `prefix`, retried; a missing bucket is a StorageError, not an empty
        listing: a manager would take it for a fresh run and train from the start, with the
        error only at its first save."""
        try:
            return self._call("listing", prefix, listing)
        except FileNotFoundError as exc:
            if _error_code(exc) != "NoSuchBucket":
                raise
            raise StorageError(
                f"cannot list {self._where(prefix)}: its bucket does not exist: create the "
                "bucket, or check the URL", url=self._where(prefix),
            ) from exc

    def list(self, prefix: str = "") -> list[str]:
        top = self._full(prefix.rstrip("/"))
        self._fresh(prefix)
        found = self._listing(prefix, lambda: self.fs.find(top, withdirs=False))
        # An upload that never completed is listed as the file it was to be: what a killed
        # save left, which `delete` aborts.
        uploading = self._uploads_if_allowed(top)
        base = f"{self.root}/"
        return sorted({
            name[len(base):] for name in itertools.chain(map(str, found), uploading)
            if (name == top or name.startswith(f"{top}/")) and name.startswith(base)
        })

    def delete(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        for path in paths:
            self._call("deleting", path, lambda path=path: self._remove(path))  # type: ignore[misc]
        if not paths or not self._s3:
            return
        uploading = self._uploads_if_allowed(self.root)
        for path in paths:
            full = self._full(path)
            bucket, key, _ = self.fs.split_path(full)
            for upload_id in uploading.get(full, []):
                self._abort(path, bucket, key, upload_id)

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(path))
        self._fresh(path)

    def close(self) -> None:
        """Stop this storage's reader threads. The fsspec filesystem stays open: fsspec
        shares one instance between all users of the same options."""
        with self._lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)


def _scatter(data: memoryview, views: Sequence[memoryview], skip: int) -> None:
    """Copy `data` into the concatenation of `views`, starting `skip` bytes into it."""
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        n = min(len(view) - skip, len(data))
        view[skip : skip + n] = data[:n]
        data = data[n:]
        skip = 0
        if not data:
            return


def _first_error(futures: Sequence[Future[None]]) -> None:
    """Wait for all `futures`, then raise the first one's error, if any."""
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


@dataclass(slots=True)
class _Part:
    number: int  # 1-based, as S3 counts parts
    buffer: bytearray
    nbytes: int

    @property
    def view(self) -> memoryview:
        return memoryview(self.buffer)[: self.nbytes]


#: Parts of one size before the size doubles: S3 refuses a part number over 10,000, so at a
#: fixed 16 MiB a data file could not pass 156 GiB (one rank's share of a large FSDP job).
_PARTS_PER_SIZE = 1000
#: S3's largest part.
_MAX_PART_BYTES = 5 << 30


class _Parts:
    """The caller's chunks regrouped into parts of `part_bytes` (doubling every
    `_PARTS_PER_SIZE` parts), in a pool of `buffers` part buffers: `next` blocks while every
    buffer is still being uploaded, and copies each chunk before asking for the next one (the
    caller may reuse it then)."""

    def __init__(self, chunks: Iterable[Buffer], part_bytes: int, buffers: int) -> None:
        self._chunks: Iterator[Buffer] = iter(chunks)
        self._part_bytes = part_bytes
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._allocated = 0
        self._limit = buffers
        self._pending = memoryview(b"")  # the rest of the current chunk
        self._number = 0
        self.done = False

    def _buffer(self) -> bytearray:
        """A buffer for the next part, of that part's size: a freed buffer of a smaller size
        is dropped and a buffer of the new size takes its place in the pool."""
        size = min(self._part_bytes << (self._number // _PARTS_PER_SIZE), _MAX_PART_BYTES)
        try:
            buffer = self._free.get_nowait()
        except queue.Empty:
            if self._allocated < self._limit:
                self._allocated += 1
                return bytearray(size)
            buffer = self._free.get()
        return buffer if len(buffer) == size else bytearray(size)

    def next(self) -> _Part | None:
        """The next part, or None when the chunks are exhausted."""
        if self.done and not self._pending:
            return None
        buffer = self._buffer()
        fill = 0
        while fill < len(buffer):
            if not self._pending:
                try:
                    self._pending = memoryview(next(self._chunks)).cast("B")
                except StopIteration:
                    self.done = True
                    break
            n = min(len(buffer) - fill, len(self._pending))
            buffer[fill : fill + n] = self._pending[:n]
            self._pending = self._pending[n:]
            fill += n
        if fill == 0:
            self._free.put(buffer)
            return None
        if self._number == 0 and not self._pending and not self.done:
            self._peek()  # a first part that is also the last goes up in one request
        self._number += 1
        return _Part(self._number, buffer, fill)

    def _peek(self) -> None:
        """Learn whether the chunks are exhausted."""
        try:
            self._pending = memoryview(next(self._chunks)).cast("B")
        except StopIteration:
            self.done = True

    def release(self, part: _Part) -> None:
        """Return `part`'s buffer to the pool once its bytes are no longer needed."""
        self._free.put(part.buffer)
