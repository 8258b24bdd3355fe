"""Run a few lines of Python in a child process capped at 1 GiB of address space (tests of
hostile sizes in a manifest): a refusal that comes too late ends there in a MemoryError,
never by growing the test run's own memory."""

from __future__ import annotations

import subprocess
import sys

_CAP = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"


def run_capped(code: str, *args: str) -> str:
    """What `code` prints to stdout, run with `args` as `sys.argv[1:]`; its stderr (a
    traceback) is appended, so a failing assertion on the output shows it."""
    done = subprocess.run([sys.executable, "-c", _CAP + code, *args], capture_output=True,
                          text=True, check=False, timeout=120)
    return done.stdout + done.stderr[-2000:]
