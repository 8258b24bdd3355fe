"""Benchmark safepoint against raw s3fs transfers on a local S3 server (moto).

Run (from the repository root; it imports safepoint from ``src/``)::

    .venv/bin/python bench/object_store.py                   # W1 and W3, ~5 min on 2 cores
    .venv/bin/python bench/object_store.py --quick           # small sizes, a smoke test
    .venv/bin/python bench/object_store.py --workloads W1 --repeat 5

moto's S3 server runs in its own process on 127.0.0.1, as a remote server would; every method
talks to it over HTTP through s3fs. For each workload:

- ``safepoint save``: ``sp.save(s3://..., state, overwrite=True)``, the state in memory.
- ``safepoint load``: ``sp.load(s3://..., into=state)``, into the existing tensors.
- ``s3fs put_file`` / ``get_file``: one local file (in /dev/shm when there is one) holding as
  many bytes as safepoint's data file, uploaded and downloaded by s3fs with its defaults
  (concurrent multipart parts): the raw transfer limit for this server and client.

Each is run ``--repeat`` times; the median seconds are shown, with MB/s of payload (10^6
bytes) and the ratio safepoint / raw (target: 1.3 or less, both ways).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(REPO / "src"))  # measure the working tree's safepoint

from workloads import WORKLOADS, build_state  # noqa: E402

import safepoint as sp  # noqa: E402

BUCKET = "bench"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto's server did not start")


def _timed(repeat: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(workloads: list[str], quick: bool, repeat: int) -> list[dict[str, Any]]:
    import s3fs

    server, endpoint = _start_moto()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    # moto assembles a completed multipart upload in Python: give it longer than botocore's
    # default 60 s read timeout, for both methods alike.
    options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "bench", "secret": "bench",
               "config_kwargs": {"read_timeout": 600}}
    rows = []
    try:
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir(BUCKET)
        scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        for workload in workloads:
            state = build_state(workload, quick=quick, source=True)
            into = build_state(workload, quick=quick, source=False)
            url = f"s3://{BUCKET}/{workload}/safepoint"
            info = sp.save(url, state, overwrite=True, storage_options=options)
            payload = info.nbytes
            save_s = _timed(repeat, lambda url=url, state=state: sp.save(
                url, state, overwrite=True, storage_options=options))
            load_s = _timed(repeat, lambda url=url, into=into: sp.load(
                url, into=into, storage_options=options))
            del state, into
            local = scratch / f"safepoint-bench-{os.getpid()}.bin"
            back = scratch / f"safepoint-bench-{os.getpid()}.back"
            try:
                with open(local, "wb") as f:
                    for _ in range(0, payload, 64 << 20):
                        f.write(os.urandom(min(64 << 20, payload - f.tell())))
                raw = f"{BUCKET}/{workload}/raw.bin"
                put_s = _timed(repeat, lambda local=local, raw=raw: fs.put_file(str(local), raw))
                get_s = _timed(repeat, lambda back=back, raw=raw: fs.get_file(raw, str(back)))
            finally:
                local.unlink(missing_ok=True)
                back.unlink(missing_ok=True)
            rows.append({"workload": workload, "nbytes": payload, "save_s": save_s,
                         "put_s": put_s, "load_s": load_s, "get_s": get_s})
            _print_row(rows[-1])
    finally:
        server.terminate()
        server.wait()
    return rows


def _print_row(row: dict[str, Any]) -> None:
    mb = row["nbytes"] / 1e6
    print(f"| {row['workload']} | {mb:,.0f} MB "
          f"| {row['save_s']:.2f} s ({mb / row['save_s']:.0f} MB/s) "
          f"| {row['put_s']:.2f} s ({mb / row['put_s']:.0f} MB/s) "
          f"| {row['save_s'] / row['put_s']:.2f}x "
          f"| {row['load_s']:.2f} s ({mb / row['load_s']:.0f} MB/s) "
          f"| {row['get_s']:.2f} s ({mb / row['get_s']:.0f} MB/s) "
          f"| {row['load_s'] / row['get_s']:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="W1,W3",
                        help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    print(f"safepoint {sp.__version__}, {os.cpu_count()} CPUs; moto S3 server on 127.0.0.1 "
          f"in its own process; median of {args.repeat}")
    print("| workload | payload | safepoint save | s3fs put_file | save/put "
          "| safepoint load | s3fs get_file | load/get |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    run(args.workloads.split(","), args.quick, args.repeat)


if __name__ == "__main__":
    main()
