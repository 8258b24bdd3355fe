"""The writer lease over the Storage protocol: one holder, release, takeover after expiry or
when a same-host holder's process is gone, no takeover from a live holder, a holder noticing
it was replaced, and racing writers of which exactly one wins."""

from __future__ import annotations

import gc
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import safepoint as sp
from safepoint._lease import _PIDS, Lease, read_holder
from safepoint._storage_local import LocalStorage
from safepoint.storage import Storage
from safepoint.testing import FaultyStorage, MemoryStorage


@pytest.fixture(params=["memory", "local"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "memory":
        return MemoryStorage("memory://root")
    return LocalStorage(str(tmp_path / "root"))


def plant(storage: Storage, generation: int, *, host: str, pid: int, expires: float,
          pids: str | None = _PIDS) -> None:
    """A lease file written by some other process (in this process's pid namespace unless
    `pids` says otherwise; None: written before leases named one)."""
    payload = {"host": host, "pid": pid, "token": "other", "expires": expires}
    if pids is not None:
        payload["pids"] = pids
    storage.publish(f"lease/{generation:012d}.json", json.dumps(payload).encode(),
                    overwrite=False)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_one_holder_at_a_time(storage: Storage) -> None:
    first, second = Lease(storage), Lease(storage)
    first.acquire()
    try:
        with pytest.raises(sp.LeaseHeld, match="another checkpoint manager"):
            second.acquire()
        first.acquire()  # renewing is fine
        holder = read_holder(storage)
        assert holder is not None and holder.token == first.token
    finally:
        first.release()
    second.acquire()
    second.release()
    second.acquire()  # taken again after a release: renewed in the background again
    assert second._renewer is not None and second._renewer.is_alive()
    second.release()


def test_expired_lease_of_another_host_is_taken_over(storage: Storage) -> None:
    plant(storage, 1, host="elsewhere", pid=1, expires=time.time() - 1)
    lease = Lease(storage)
    lease.acquire()
    assert lease.generation == 2
    assert storage.list("lease") == ["lease/000000000002.json"]  # the stale one is gone
    lease.release()


def test_live_lease_of_another_host_is_respected(storage: Storage) -> None:
    plant(storage, 1, host="elsewhere", pid=1, expires=time.time() + 60)
    with pytest.raises(sp.LeaseHeld, match="elsewhere"):
        Lease(storage).acquire()


def test_same_host_dead_process_is_taken_over_at_once(storage: Storage) -> None:
    plant(storage, 3, host=socket.gethostname(), pid=dead_pid(), expires=time.time() + 600)
    lease = Lease(storage)
    lease.acquire()
    assert lease.generation == 4
    lease.release()


def test_same_host_killed_process_not_yet_reaped_is_taken_over_at_once(
    storage: Storage,
) -> None:
    """A supervisor kills a hung job (`Popen.kill()`) and starts another before reaping it:
    the holder is a zombie, whose pid still answers signals. Its lease was held until it
    expired; it is taken over at once, as a dead holder's."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        child.kill()  # not reaped: no wait() until the end
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        plant(storage, 3, host=socket.gethostname(), pid=child.pid, expires=time.time() + 600)
        lease = Lease(storage)
        lease.acquire()
        assert lease.generation == 4
        lease.release()
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("pids", ["pid:[1]", None], ids=["another", "unnamed"])
def test_same_host_holder_in_another_pid_namespace_keeps_the_lease(
    storage: Storage, pids: str | None
) -> None:
    """Containers that share the node's host name (Kubernetes hostNetwork pods, docker
    --network host) number their processes apart: a pid that is not alive here may be a live
    writer there (a replacement pod started while the old one still saves). The lease was
    taken over at once, and the live writer's next commit failed."""
    plant(storage, 3, host=socket.gethostname(), pid=dead_pid(), expires=time.time() + 600,
          pids=pids)
    with pytest.raises(sp.LeaseHeld, match="another checkpoint manager"):
        Lease(storage).acquire()
    plant(storage, 4, host=socket.gethostname(), pid=os.getpid(), expires=time.time() + 600,
          pids=pids)  # a container's process numbered as this one is not this one
    with pytest.raises(sp.LeaseHeld):
        Lease(storage).acquire()


def test_holder_notices_a_takeover(storage: Storage) -> None:
    lease = Lease(storage)
    lease.acquire()
    try:
        plant(storage, 2, host="elsewhere", pid=1, expires=time.time() + 60)
        with pytest.raises(sp.LeaseHeld):
            lease.check()
    finally:
        lease.release()


def test_a_holder_that_lost_the_lease_never_takes_it_again(storage: Storage) -> None:
    """A writer paused past its lease (SIGSTOP, a stalled host) whose successor took the root
    over, wrote and released it, took the lease again when it woke, and its next saves
    replaced the successor's steps: losing the lease is for good; a new writer is needed."""
    lease = Lease(storage)
    lease.acquire()
    try:
        plant(storage, 2, host="elsewhere", pid=1, expires=time.time() - 1)  # it ended since
        with pytest.raises(sp.LeaseHeld):
            lease.check()
        successor = Lease(storage)
        successor.acquire()
        successor.release()
        with pytest.raises(sp.LeaseHeld, match=r"does not take it back.*elsewhere.*new "
                           r"checkpoint manager"):
            lease.acquire()
        with pytest.raises(sp.LeaseHeld):
            lease.check()
        assert not lease.held
        assert read_holder(storage).released  # type: ignore[union-attr]
    finally:
        lease.release()


def test_lease_is_renewed_while_held(storage: Storage) -> None:
    lease = Lease(storage, seconds=0.3)
    lease.acquire()
    try:
        time.sleep(0.6)
        holder = read_holder(storage)
        assert holder is not None and holder.expires > time.time()
        with pytest.raises(sp.LeaseHeld):
            Lease(storage).acquire()
    finally:
        lease.release()


def test_a_lease_whose_stale_files_cannot_be_removed_is_held_and_renewed(
    storage: Storage, caplog: pytest.LogCaptureFixture,
) -> None:
    """Removing the earlier generations after taking the lease is only tidying: when it fails
    (a transient error, a bucket policy without s3:DeleteObject) the lease is still held and
    renewed. It used to raise before the renewer started, and the lease, never renewed,
    expired under a live writer."""
    plant(storage, 1, host="elsewhere", pid=1, expires=time.time() - 1)
    refusing = FaultyStorage(storage, lambda op, path, n: op == "delete")
    lease = Lease(refusing, seconds=0.3)
    lease.acquire()
    try:
        assert lease.generation == 2
        assert "could not remove the earlier lease files" in caplog.text
        time.sleep(0.6)
        holder = read_holder(storage)
        assert holder is not None and holder.token == lease.token
        assert holder.expires > time.time()
        with pytest.raises(sp.LeaseHeld):
            Lease(storage).acquire()
    finally:
        lease.release()


def test_racing_writers_one_wins(storage: Storage) -> None:
    leases = [Lease(storage) for _ in range(6)]
    barrier = threading.Barrier(len(leases))
    outcomes: list[str] = []

    def run(lease: Lease) -> None:
        barrier.wait()
        try:
            lease.acquire()
            outcomes.append("won")
        except sp.LeaseHeld:
            outcomes.append("held")

    threads = [threading.Thread(target=run, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("won") == 1
    for lease in leases:
        lease.release()


class _TakenOverWhileRead:
    """`storage` on which another writer takes the lease just before this one's first read
    of a lease file (after its listing): the race of two writers taking over a released
    lease."""

    def __init__(self, storage: Storage, other: Lease) -> None:
        self.inner, self.other = storage, other

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read(self, path: str) -> bytes:
        if path.startswith("lease/") and not self.other.held:
            self.other.acquire()  # takes the next generation and removes the one listed
        return self.inner.read(path)


def test_a_writer_whose_listed_lease_vanished_does_not_take_it_again(storage: Storage) -> None:
    """The generation a writer listed was removed before it read it, by a writer that took
    the next one: that is no free lease. Taking the next of an earlier generation made a
    second holder (generation 1 again, beside the other's 2), which then removed the other's
    save in progress as a crashed save's leftovers."""
    finished = Lease(storage)
    finished.acquire()
    finished.release()
    other = Lease(storage)
    late = Lease(_TakenOverWhileRead(storage, other))  # type: ignore[arg-type]
    try:
        with pytest.raises(sp.LeaseHeld, match="another checkpoint manager"):
            late.acquire()
        assert other.held and not late.held
        holder = read_holder(storage)
        assert holder is not None and holder.token == other.token
        assert storage.list("lease") == ["lease/000000000002.json"]
    finally:
        other.release()
        late.release()


def test_a_dead_holder_with_this_process_id_is_taken_over(storage: Storage) -> None:
    """A container restarted in its pod often gets the pid its dead predecessor had: a lease
    of this host and pid that no lease object of this process holds is taken over at once;
    one that another manager of this process holds is not."""
    plant(storage, 1, host=socket.gethostname(), pid=os.getpid(), expires=time.time() + 60)
    first = Lease(storage)
    first.acquire()
    try:
        with pytest.raises(sp.LeaseHeld):
            Lease(storage).acquire()
    finally:
        first.release()


@pytest.mark.parametrize("seconds", [0, -5, math.nan, math.inf, True, "60"])
def test_lease_seconds_must_be_finite_and_positive(storage: Storage, seconds: object) -> None:
    """0 or less renewed in a busy loop and was born expired, NaN never expired, inf killed
    the renewer with OverflowError: all refused when the lease is made."""
    with pytest.raises(sp.SafepointError, match=r"lease_seconds=.*pass a finite number"):
        Lease(storage, seconds=seconds)  # type: ignore[arg-type]


def test_a_collected_lease_stops_renewing_and_is_free_in_this_process(
    storage: Storage,
) -> None:
    """A lease object dropped without `release` (its manager was never closed) does not
    renew forever from its background thread: this process takes its lease over at once."""
    lease = Lease(storage, seconds=0.3)
    lease.acquire()
    renewer = lease._renewer
    assert renewer is not None
    del lease
    gc.collect()
    renewer.join(5)
    assert not renewer.is_alive()
    successor = Lease(storage)
    successor.acquire()  # before the dropped one's expiry (pid alive, same host)
    successor.release()


def test_renewing_stops_once_taken_over(storage: Storage) -> None:
    """A holder whose lease another writer took over stops renewing (it cannot get it back
    by renewing) instead of logging a failure every third of `seconds` forever."""
    lease = Lease(storage, seconds=0.3)
    lease.acquire()
    try:
        plant(storage, 2, host="elsewhere", pid=1, expires=time.time() + 60)
        assert lease._renewer is not None
        lease._renewer.join(5)
        assert not lease._renewer.is_alive() and not lease.held
    finally:
        lease.release()
