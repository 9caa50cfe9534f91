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

HOST_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]  # a daemon's own PATH


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
               timeout: float, interval: float = 0.2) -> None:
    """Until `ready()`; AssertionError quoting the end of `log` when `proc` exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} did not start: " + log.read_text(errors="replace")[-3000:])
        time.sleep(interval)


@contextlib.contextmanager
def namespace_holder(argv: Sequence[str], env: Mapping[str, str], root: Path, namespace: str,
                     what: str) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` ending in `sleep`, run as a daemon that holds new namespaces; yields it once its `namespace`
    (mnt, net, ...) is not ours and it is the sleep (so nsenter finds the namespaces it made)."""
    with daemon_process(argv, env, root, "holder.log") as holder:
        def ready() -> bool:
            try:
                return (os.readlink(f"/proc/{holder.pid}/ns/{namespace}") != os.readlink(f"/proc/self/ns/{namespace}")
                        and Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep")
            except OSError:
                return False

        wait_ready(holder, ready, what, root / "holder.log", 20, 0.05)
        yield holder


def unmount_below(root: Path) -> None:
    """Whatever the daemon left mounted under its roots (it unmounts on a clean stop; a crash may not)."""
    from gpuhook.inject.mountinfo import read_mounts  # the one mountinfo reader (escaped paths decoded)

    prefix = str(root) + "/"
    points = [m.mountpoint for m in read_mounts() if m.mountpoint.startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
