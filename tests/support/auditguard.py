"""An audit hook for a `gpuhook service` under test: it reports every import, library load and program start the
process (or any process forked from it) makes while it is in a mount namespace other than its own.

`_native.setns` raises the audit event `gpuhook.setns` (fd, nstype) after each switch, and `spawn_confined`
`gpuhook.spawn` (the program's descriptor, argv) before ldconfig starts; CPython raises `import` (for a module not
yet loaded), `ctypes.dlopen`, `os.exec`, `os.posix_spawn`, `os.spawn`, `subprocess.Popen` and `os.system`. Reports
go as datagrams to an abstract unix socket (`address`), which names no file and so reaches the test from any mount
namespace, whatever descriptors the service closes: a line `away PID` per switch into a foreign namespace (so a
test can tell that the guard saw one), `spawn PID DEV INO` per ldconfig start away, and `VIOLATION PID EVENT ARGS`
for anything loaded or started from there.

Use: `python -c "import sys; sys.path.insert(0, TESTS); from support.auditguard import serve; serve(ADDRESS)"
service --config FILE`.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

FLAGGED = ("import", "ctypes.dlopen", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.system")


def install(address: str) -> None:
    home = os.stat("/proc/self/ns/mnt").st_ino
    state = {"away": False, "busy": False}

    def say(text: str) -> None:  # a socket per line: a worker closes every descriptor it was forked with
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
                out.sendto(text.encode(errors="replace")[:4000], "\0" + address)
        except OSError:
            pass

    def hook(event: str, args: tuple[object, ...]) -> None:
        if state["busy"]:
            return
        state["busy"] = True
        try:
            if event == "gpuhook.setns":
                state["away"] = os.fstat(int(args[0])).st_ino != home  # type: ignore[call-overload]
                if state["away"]:
                    say(f"away {os.getpid()}")
            elif state["away"] and event == "gpuhook.spawn":
                st = os.fstat(int(args[0]))  # type: ignore[call-overload]
                say(f"spawn {os.getpid()} {st.st_dev} {st.st_ino}")
            elif state["away"] and event in FLAGGED:
                say(f"VIOLATION {os.getpid()} {event} {args[:2]!r}")
        except Exception as exc:  # noqa: BLE001 - a hook must never change what it watches
            say(f"VIOLATION {os.getpid()} guard-error {exc!r}")
        finally:
            state["busy"] = False

    sys.addaudithook(hook)


def serve(address: str) -> None:
    """The guard installed, then `gpuhook` with this process's arguments (`service --config FILE`)."""
    install(address)
    from gpuhook.cli import run

    sys.argv[0] = "gpuhook"
    sys.exit(run())


class Listener:
    """The test's end: an abstract datagram socket bound to a fresh address, read by a thread as lines come (a
    full queue would block the guarded process: a datagram socket's queue holds a few); lines() returns them."""

    def __init__(self) -> None:
        self.address = f"gpuhook-auditguard-{os.getpid()}-{os.urandom(4).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address)
        self.sock.settimeout(0.1)
        self.seen: list[str] = []
        self.stopped = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while not self.stopped.is_set():
            try:
                self.seen.append(self.sock.recv(8192).decode(errors="replace"))
            except (TimeoutError, OSError):
                continue

    def lines(self) -> list[str]:
        return list(self.seen)

    def close(self) -> None:
        self.stopped.set()
        self.reader.join()
        self.sock.close()
