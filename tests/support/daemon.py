"""Running a test's private daemon (dockerd, containerd): started in its own session with its log under its
root, waited for, then stopped by its PID (SIGTERM, then its whole session), and whatever it left mounted under
its root unmounted. One way for every daemon the end-to-end tests start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path


@contextlib.contextmanager
def daemon_process(argv: Sequence[str], env: Mapping[str, str], root: Path, log_name: str
                   ) -> Iterator[subprocess.Popen[bytes]]:
    log = open(root / log_name, "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its session: a containerd it started, the shims
            proc.wait(timeout=10)
        log.close()
        unmount_below(root)


def wait_ready(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, log: Path,
               timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} did not start: " + log.read_text(errors="replace")[-3000:])
        time.sleep(0.2)


def unmount_below(root: Path) -> None:
    """Whatever the daemon left mounted under its roots (it unmounts on a clean stop; a crash may not)."""
    prefix = str(root) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
