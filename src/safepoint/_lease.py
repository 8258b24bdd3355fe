"""One writer per root: a lease that a crashed writer's successor can take over, not a lock
that needs a human (manager layer). Only the `Storage` protocol is used, so it works the same
on a local disk and on an object store.

A lease is a small JSON file `lease/<generation>.json` under the root; the highest generation
is the current lease. Taking a lease creates the next generation with
`publish(overwrite=False)`, a create that fails when the file exists, so of two writers
racing for it exactly one wins where the backend creates atomically (a local disk, an object
store with conditional puts); on an object store without them the create is a check, then a
put, and two writers starting at the same instant could both take it (README, S3).
The holder renews its own file (expiry moved forward) while it writes; a successor may take
over when the holder released it, when its expiry passed, or at once when the holder ran on
the same host, in the same process-id namespace, and its process is gone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

from .errors import LeaseHeld, SafepointError
from .storage import Storage

__all__ = ["LEASE_DIR", "Holder", "Lease", "check_seconds", "read_holder"]

logger = logging.getLogger(__name__)

LEASE_DIR = "lease"
_TRIES = 8


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (or held) a lease.

    Attributes:
        host: the holder's host name.
        pid: its process id.
        token: unique per lease object, so two managers in one process differ.
        expires: when the lease lapses unless renewed, seconds since the epoch.
        generation: the lease file's generation.
        released: the holder gave it up.
        pids: the process-id namespace its `pid` is in ("" where unknown).
    """

    host: str
    pid: int
    token: str
    expires: float
    generation: int
    released: bool = False
    pids: str = ""

    def describe(self) -> str:
        """The holder in words, for errors."""
        left = self.expires - time.time()
        when = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
        return f"pid {self.pid} on {self.host} ({when})"

    def is_free(self, now: float) -> bool:
        """Whether a successor may take the lease over now."""
        if self.released or self.expires <= now:
            return True
        # Containers that share the host's name (host networking) each number processes
        # from 1: a pid is only meaningful in the holder's own namespace.
        if self.host != socket.gethostname() or self.pids != _PIDS:
            return False
        if self.pid == os.getpid():  # a restarted container's process often has its pid
            return self.token not in _HELD
        return not _alive(self.pid)


#: The tokens of the leases this process holds.
_HELD: set[str] = set()


def _pid_namespace() -> str:
    """This process's process-id namespace (Linux), else ""."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_PIDS = _pid_namespace()


def _alive(pid: int) -> bool:
    """Whether process `pid` of this namespace still runs: a process killed but not yet
    reaped by its parent (a zombie, as a supervisor's `Popen.kill()` leaves it) has
    exited, though its pid still answers signals."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, unless /proc says it exited
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (macOS): running, as far as this can tell
        return True
    return state not in (b"Z", b"X")


def check_seconds(seconds: object, url: str) -> float:
    """`seconds` as a lease lifetime for the root at `url`.

    Raises:
        SafepointError: not a finite number of seconds above 0 (0 or less renews in a busy
            loop and is born expired, NaN never expires, inf cannot be waited for).
    """
    # The renewer waits a third of it: threading refuses waits beyond TIMEOUT_MAX.
    longest = threading.TIMEOUT_MAX
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds) or not 0 < seconds <= longest):
        raise SafepointError(
            f"lease_seconds={seconds!r} for {url}: pass a finite number of seconds above 0 "
            f"(at most {longest:.0f}), such as the default 60.0; the lease lapses that long "
            "after its holder stops renewing it",
            url=url,
        )
    return float(seconds)


def _forget(token: str, stop: threading.Event) -> None:
    """A lease object was garbage-collected without `release`: stop its renewer and count
    its lease as no longer held by this process (a successor here takes it over at once;
    elsewhere, once it expires)."""
    stop.set()
    _HELD.discard(token)


def _renew_loop(ref: weakref.ReferenceType[Lease], stop: threading.Event,
                seconds: float) -> None:
    """Renew the lease every third of `seconds` until `stop`, the lease object is collected
    (it holds the lease object only while renewing, so that a manager dropped without
    `close` does not keep its lease alive for the life of the process), or another writer
    took the lease over."""
    while not stop.wait(seconds / 3):
        lease = ref()
        if lease is None:
            return
        try:
            lease.check()
        except LeaseHeld as exc:
            if lease.generation is None:  # taken over: renewing again cannot help
                logger.warning("lost the lease on %s: %s", lease.storage.url, exc)
                return
        except Exception:
            logger.warning("could not renew the lease on %s", lease.storage.url,
                           exc_info=True)
        finally:
            del lease


def _name(generation: int) -> str:
    return f"{LEASE_DIR}/{generation:012d}.json"


def _generations(storage: Storage) -> list[int]:
    try:
        names = storage.list(LEASE_DIR)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        stem = name.removeprefix(f"{LEASE_DIR}/").removesuffix(".json")
        if stem.isdigit() and name.endswith(".json"):
            found.append(int(stem))
    return sorted(found)


def _read(storage: Storage, generation: int) -> Holder | None:
    try:
        data = json.loads(storage.read(_name(generation)))
        return Holder(str(data["host"]), int(data["pid"]), str(data["token"]),
                      float(data["expires"]), generation, bool(data.get("released", False)),
                      str(data.get("pids", "")))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise SafepointError(
            f"the lease file {storage.url.rstrip('/')}/{_name(generation)} is damaged ({exc}): "
            "make sure no job writes this root, then delete it",
            url=storage.url,
        ) from exc


def read_holder(storage: Storage) -> Holder | None:
    """The current lease of the root at `storage`, or None when no lease was ever taken.

    Raises:
        LeaseHeld: the lease kept changing hands while it was read.
    """
    for _ in range(_TRIES):
        generations = _generations(storage)
        if not generations:
            return None
        holder = _read(storage, generations[-1])
        if holder is not None:
            return holder
        # The top generation vanished after the listing: only a writer that took a later
        # one removes it. An earlier generation is no lease to take (taking the next of it
        # would make a second holder), so list again.
    raise LeaseHeld(
        f"could not read the lease on {storage.url}: other writers keep taking it; make sure "
        "one job writes this root",
        url=storage.url,
    )


class Lease:
    """The writer's lease on one root.

    Args:
        storage: the root.
        seconds: how long the lease lasts unless renewed; a background thread renews it
            every third of that while held (and while this object is referenced: a lease
            collected without `release` stops renewing, and this process no longer counts
            it as held).

    Raises:
        SafepointError: `seconds` is not a finite number above 0.
    """

    def __init__(self, storage: Storage, seconds: float = 60.0) -> None:
        self.storage = storage
        self.seconds = check_seconds(seconds, storage.url)
        self.token = uuid.uuid4().hex
        self.generation: int | None = None
        self._lost: str | None = None  # why the lease was lost (for good), once taken over
        # Re-entrant: a preemption handler's save runs its check of the lease in the thread
        # whose own check it may have interrupted.
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this object took the lease (and did not release it)."""
        return self.generation is not None

    def _payload(self, released: bool = False) -> bytes:
        return json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(), "pids": _PIDS,
            "token": self.token,
            "expires": time.time() + self.seconds, "released": released,
        }).encode()

    def acquire(self) -> None:
        """Take the lease, or renew it when held.

        Raises:
            LeaseHeld: another live writer holds it, or took it over from this one once:
                that is for good, since this writer's view of the root is out of date (its
                next steps would replace the successor's).
        """
        with self._lock:
            if self.generation is not None:
                self._renew()
                return
            if self._lost is not None:
                raise LeaseHeld(
                    f"this writer lost the lease on {self.storage.url} and does not take it "
                    f"back, as its view of the root is out of date ({self._lost}): make a new "
                    "checkpoint manager (restart the job) to write this root again",
                    url=self.storage.url,
                )
            # Counted as held from before the publish: another lease object of this process
            # that reads the new generation at once must find its holder alive.
            _HELD.add(self.token)
            try:
                for _ in range(_TRIES):
                    current = read_holder(self.storage)
                    if current is not None and not current.is_free(time.time()):
                        raise self._held_error(current)
                    generation = 1 if current is None else current.generation + 1
                    try:
                        self.storage.publish(_name(generation), self._payload(),
                                             overwrite=False)
                    except FileExistsError:
                        continue  # another writer won this generation; look again
                    self.generation = generation
                    break
                else:
                    raise LeaseHeld(
                        f"could not take the lease on {self.storage.url}: other writers keep "
                        "taking it; make sure one job writes this root",
                        url=self.storage.url,
                    )
            except BaseException:
                _HELD.discard(self.token)
                raise
            if current is not None and not current.released:
                logger.warning("took over the lease on %s from %s", self.storage.url,
                               current.describe())
            self._stop = threading.Event()
            weakref.finalize(self, _forget, self.token, self._stop)
            self._renewer = threading.Thread(
                target=_renew_loop, args=(weakref.ref(self), self._stop, self.seconds),
                name="safepoint-lease", daemon=True,
            )
            self._renewer.start()
            # Only tidying: the lease is held and renewed whether or not this works (the next
            # writer to take the lease removes what is left).
            try:
                stale = [_name(g) for g in _generations(self.storage) if g < generation]
                if stale:
                    self.storage.delete(stale)
            except Exception:
                logger.warning("could not remove the earlier lease files under %s; the next "
                               "writer to take the lease will", self.storage.url, exc_info=True)

    def _held_error(self, holder: Holder) -> LeaseHeld:
        return LeaseHeld(
            f"{self.storage.url} is being written by another checkpoint manager, "
            f"{holder.describe()}: use one writer per root (readers need no lease), or wait "
            "for that job to end; a crashed writer's lease is taken over once its process is "
            "gone (same host) or the lease has expired",
            url=self.storage.url,
        )

    def _renew(self) -> None:
        generations = _generations(self.storage)
        top = _read(self.storage, generations[-1]) if generations else None
        if top is None or top.token != self.token:
            self.generation = None
            self._lost = str(self._held_error(top)) if top is not None else (
                f"the lease on {self.storage.url} vanished: another process removed it; use "
                "one writer per root")
            raise LeaseHeld(self._lost, url=self.storage.url)
        self.storage.publish(_name(top.generation), self._payload(), overwrite=True)

    def check(self) -> None:
        """Renew the lease, making sure it is still ours (call before committing).

        Raises:
            LeaseHeld: it was taken over (it had expired) or never taken.
        """
        with self._lock:
            if self.generation is None:
                raise LeaseHeld(self._lost or f"no lease held on {self.storage.url}",
                                url=self.storage.url)
            self._renew()

    def release(self) -> None:
        """Give the lease up, so a successor may take it at once."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:
            if self.generation is None:
                return
            try:
                top = _generations(self.storage)
                if top and top[-1] == self.generation:
                    self.storage.publish(_name(self.generation), self._payload(released=True),
                                         overwrite=True)
            except Exception:
                logger.warning("could not release the lease on %s; it expires in %.0f s",
                               self.storage.url, self.seconds, exc_info=True)
            self.generation = None
            _HELD.discard(self.token)
