"""A warm worker's own loop: a child of the service that runs one start at a time, handed over by the parent
(pool.py), and goes back home, clean, for the next.

A worker takes a start as a child forked for it would (the decision made in the parent, or a CDI hook's whole
call), answers it, goes back to the service's mount namespace (Home.back) and says READY only when nothing of
that start is left in it: its root, cwd and umask, its descriptors, no child and no thread, no module imported
and no file mapped since (sys.modules, /proc/self/maps). Anything else, and a start that failed, ends it.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import socket
import sys

from gpuhook.hook import prestart
from gpuhook.service import calls, protocol
from gpuhook.service.peer import identity

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn

    from gpuhook.hook.config import Config
    from gpuhook.hook.plan import Planned
    from gpuhook.model.edits import ContainerEdits
    from gpuhook.model.inventory import Inventory
    from gpuhook.model.request import Request

WORKER_USES = 1024  # starts a worker runs before it ends (whatever one start may leave in it stays bounded)
WORKER_KEPT_PLANS = 64  # plans a worker keeps of those sent to it whole, to have them by number next time
WORKER_MESSAGE = 256 << 10  # the largest request handed to a worker (a bigger state: the parent forks for it)
READY = b"R"  # a worker's word that it is back, clean, for the next start


def mapped_files() -> frozenset[str]:
    """The address ranges of every file this process maps (/proc/self/map_files, root's to read): a library or
    extension loaded since, or any file mapped, shows as one more. A third of reading /proc/self/maps."""
    return frozenset(os.listdir("/proc/self/map_files"))


def open_fds(besides: int = -1) -> list[int]:
    """This process's open descriptors but `besides` (and the listing's own, closed again by the time it is
    checked)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == besides:
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue
        out.append(fd)
    return sorted(out)


class Home:
    """A process's own state, taken before its first start: its mount namespace, root, cwd, umask, descriptors,
    modules and mapped files. back() returns there after a start (which joined a container's mount namespace, or
    a private copy of it for ldconfig) and says whether nothing of that start is left."""

    def __init__(self) -> None:
        self.ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self.cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.root, self.ns_id = identity("/"), identity("/proc/thread-self/ns/mnt")
        self.fds = open_fds()
        self.modules = frozenset(sys.modules)
        self.mapped = mapped_files()

    def back(self, open_now: int = -1) -> bool:
        """Back home; whether clean. `open_now`: the start's connection, still to be answered (the one descriptor
        that may be open beyond those at home)."""
        from gpuhook import _native

        try:
            _native.setns(self.ns, _native.CLONE_NEWNS)  # root and cwd become that namespace's root: ours again
            os.fchdir(self.cwd)
            os.umask(self.umask)
            if identity("/") != self.root or identity("/proc/thread-self/ns/mnt") != self.ns_id:
                return False
            if open_fds(open_now) != self.fds or len(os.listdir("/proc/self/task")) != 1:
                return False
            if sys.modules.keys() != self.modules or mapped_files() != self.mapped:
                return False  # something was imported or loaded: it stays with this process, which ends
            os.waitpid(-1, os.WNOHANG)  # a child left, running or ended: not clean
        except ChildProcessError:
            return True
        except OSError:
            return False
        return False


class _Known(pickle.Unpickler):
    """Unpickles pool._ByNumber's message with `edits`, the plans' edits this process has by number."""

    def __init__(self, message: bytes, edits: dict[int, ContainerEdits]) -> None:
        super().__init__(io.BytesIO(message))
        self.edits = edits

    def persistent_load(self, pid: object) -> ContainerEdits:
        from gpuhook.errors import clip

        found = self.edits.get(pid) if isinstance(pid, int) else None
        if found is None:
            raise calls.ServiceError(f"the worker has no plan numbered {clip(repr(pid))}")
        return found


class WorkerLoop:
    """The Service's worker side: what a forked worker runs until it ends (never back into the accept loop)."""

    _plans: dict[tuple[int, str, Request], tuple[Config, Inventory, Planned, int]]
    _worker_plans: dict[int, ContainerEdits]
    load: Callable[[str | None], Config]

    def _serve_as_worker(self, sock: socket.socket) -> NoReturn:
        """Run each start handed over, answer it, go back home and say READY; end at the socket's end (the parent
        let it go, or is gone), after a start that failed or went wrong, a state it cannot come back clean from,
        or WORKER_USES starts."""
        try:
            gc.enable()  # it lives on: its own garbage is collected (the parent's heap is frozen: never scanned)
            mine = sock.fileno()  # forked for a start, it has that start's connection and descriptors: it gets
            os.closerange(3, mine)  # them again over its socket, so no other one stays open for its lifetime
            os.closerange(mine + 1, max(mine + 1, os.sysconf("SC_OPEN_MAX")))
            home = Home()
            for _ in range(WORKER_USES):
                message, fds, _flags, _addr = socket.recv_fds(sock, WORKER_MESSAGE, 3)
                if not message or not fds or not self._run_handed(message, fds, home):
                    break
                sock.send(READY)
        finally:  # never back into the accept loop: whatever stopped it, it ends
            os._exit(0)

    def _unpickled(self, message: bytes) -> tuple[object, ...]:
        """pool._handed's message, in a worker: edits given by number are this process's copy of that plan's
        (the parent's memo as it was at the fork, or a plan sent here whole)."""
        known = {n: planned.edits for _c, _i, planned, n in self._plans.values()}
        known.update(self._worker_plans)
        return _Known(message, known).load()

    def _run_handed(self, message: bytes, fds: list[int], home: Home) -> bool:
        """The start `message` (with `fds`: the connection, then the /proc/<pid> fd and the client's namespace it
        says it has) run and answered; whether the worker may take another: it succeeded, or its client took it
        back, and home() found nothing of it left."""
        conn = socket.socket(fileno=fds[0])
        taker, held = calls.Taker(conn), calls.Held()
        try:
            cdi, argv, config_env, state, start, with_pid_fd, with_ns, decided, later, serial = \
                self._unpickled(message)
            if serial is not None and cdi is None and serial not in self._worker_plans \
                    and len(self._worker_plans) < WORKER_KEPT_PLANS:  # kept as the parent counts (_hand_over)
                self._worker_plans[serial] = decided.edits
            if len(fds) != 1 + with_pid_fd + with_ns:  # never a start in a namespace other than the client's
                raise calls.ServiceError(f"the worker got {len(fds)} descriptors for a start that has "
                                         f"{1 + with_pid_fd + with_ns}")
        except BaseException as exc:  # noqa: BLE001 - a message it cannot take: it ends, its client is answered
            from gpuhook.errors import render

            calls.answer(conn, 1, f"gpuhook-hook: service: {render(exc)}")
            conn.close()
            return False
        pid_fd = fds[1] if with_pid_fd else None
        request = protocol.Request(argv, config_env, state, pid_fd, later=later)

        def start_handed_over() -> tuple[int, str]:
            if cdi is not None:
                return calls.cdi_call(conn, request, fds[-1] if with_ns else None, cdi, taker)
            config_path = prestart.config_path_for(argv, config_env)
            return prestart.handle(config_path, lambda: state, start, load=self.load,
                                   before_inject=calls.vetter(pid_fd, taker), decided=decided, served="service",
                                   log=held)

        def back() -> bool:  # the start's descriptors closed (a client namespace was, once joined), but its
            if pid_fd is not None:  # connection: it is answered from home
                os.close(pid_fd)
            return home.back(conn.fileno())

        code, clean = calls.run_start(conn, start_handed_over, taker, held, back)
        conn.close()
        return code == 0 and clean
