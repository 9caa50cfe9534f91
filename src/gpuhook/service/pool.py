"""The warm workers as the service's parent sees them: forked ahead or for a start, handed starts, let go.

A start that changes a container goes to an idle worker (worker.py), or one forked for it while fewer than
MAX_WORKERS run; without one the parent forks a child for that start alone (server.py). A decided prestart start
goes with its decision (prestart.Decided: the edits, the pid, the rootfs), whose edits go by number when the worker
has them (_handed); a CDI hook goes as it came, to be run whole there. The descriptors go along over SCM_RIGHTS:
the connection, the /proc/<pid> fd, the client's namespace. While the service is idle one worker is forked ahead,
and the oldest idle ones end after WORKER_IDLE_S.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import select
import socket
import time

from gpuhook.service.worker import READY, WORKER_KEPT_PLANS, WORKER_MESSAGE

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuhook.hook.config import Config
    from gpuhook.hook.plan import Decided, Planned
    from gpuhook.inject.containerhooks import HookArgs
    from gpuhook.model.inventory import Inventory
    from gpuhook.model.request import Request
    from gpuhook.service import protocol

MAX_WORKERS = 8  # warm workers at most; a start that finds none idle gets a worker forked for it while fewer run,
# else a child of its own
WORKER_IDLE_S = 60.0  # an idle worker other than the last one ends after this long without a start
WORKER_RETRY_S = 5.0  # after a worker died waiting, none is forked ahead for this long, never in a loop
MAX_LATE = 32  # children waiting on a cdi-hook's late state (the runtime's); counted apart, so that they can
# never take the children every other start needs; one more such request is DECLINED
WORKER_AHEAD_S = 0.02  # after a start's child ended, a worker is forked ahead this much later (Service.reap)


class _ByNumber(pickle.Pickler):
    """Pickles `edits` as the persistent id `serial` (the worker's copy of that plan's edits: worker._Known)."""

    def __init__(self, out: io.BytesIO, edits: object, serial: int) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.edits, self.serial = edits, serial

    def persistent_id(self, obj: object) -> int | None:
        return self.serial if obj is self.edits else None


class _Worker:
    """A warm worker as the parent sees it: its pid, our end of its socket pair, the plans it has by number (those
    remembered before its fork, numbered below `forked_at`, and those sent to it whole: `sent`), whether it runs a
    start now, and since when it is idle."""

    __slots__ = ("pid", "sock", "forked_at", "sent", "busy", "idle_since")

    def __init__(self, pid: int, sock: socket.socket, forked_at: int) -> None:
        self.pid, self.sock, self.forked_at = pid, sock, forked_at
        self.sent: set[int] = set()
        self.busy = False
        self.idle_since = time.monotonic()

    def knows(self, serial: int) -> bool:
        return serial < self.forked_at or serial in self.sent


class Pool:
    """The Service's workers (a part of server.Service: it shares the children it records and its fork)."""

    children: dict[int, socket.socket]
    late: set[int]
    _plans: dict[tuple[int, str, Request], tuple[Config, Inventory, Planned, int]]
    _next_serial: int
    _epoll: select.epoll | None
    _fork_child: Callable[[], int]  # the Service's (server.py), and the worker's loop (worker.WorkerLoop)
    _serve_as_worker: Callable[[socket.socket], None]
    _full: Callable[[bool], bool]

    def _init_pool(self) -> None:
        self.workers: dict[int, _Worker] = {}  # pid -> a warm worker (a busy one is in children too)
        self._worker_fds: dict[int, int] = {}  # its socket's fd -> its pid, for the loop's events
        self.spent: set[int] = set()  # workers let go (their socket closed) and not reaped yet
        self.ahead_after = 0.0  # time.monotonic() before which no worker is forked ahead

    def _ahead_due(self) -> bool:
        """Whether to fork a worker ahead now: the service has no worker at all (a busy one is among the children:
        with none, any worker would be idle) and no start in a child, and ahead_after has passed."""
        return not self.children and not self.workers and time.monotonic() >= self.ahead_after

    def _fork_worker(self) -> _Worker | None:
        """Fork a warm worker, idle; it waits for _hand_over on its socket pair. None where the fork fails: the
        start forks a child for itself."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = self._fork_child()
        except OSError:
            parent_end.close()
            child_end.close()
            return None
        if pid == 0:
            parent_end.close()
            self._serve_as_worker(child_end)
        child_end.close()
        worker = self.workers[pid] = _Worker(pid, parent_end, self._next_serial)
        self._worker_fds[parent_end.fileno()] = pid
        if self._epoll is not None:
            self._epoll.register(parent_end.fileno(), select.EPOLLIN)
        return worker

    def _let_go(self, worker: _Worker) -> None:
        """Forget `worker` and close our end of its socket pair: an idle one reads its end and exits, a busy one
        does once its start is answered; reaped as spent."""
        if self.workers.pop(worker.pid, None) is None:
            return
        fd = worker.sock.fileno()
        self._worker_fds.pop(fd, None)
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        worker.sock.close()
        self.spent.add(worker.pid)

    def _worker_said(self, pid: int) -> None:
        """A worker's socket is readable: READY (its start is over and it is clean: idle again, its client's
        connection here closed), or its end (it is ending: let go)."""
        worker = self.workers[pid]
        try:
            said = worker.sock.recv(16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if said != READY or not worker.busy:
            self._let_go(worker)
            return
        worker.busy, worker.idle_since = False, time.monotonic()
        self.late.discard(pid)
        conn = self.children.pop(pid, None)
        if conn is not None:
            conn.close()

    def _retire_idle(self) -> None:
        """Let go the workers idle for WORKER_IDLE_S, all but one (a node at rest keeps one worker's memory)."""
        now = time.monotonic()
        idle = sorted((w for w in self.workers.values() if not w.busy), key=lambda w: w.idle_since)
        for worker in idle[:-1]:
            if now - worker.idle_since >= WORKER_IDLE_S:
                self._let_go(worker)

    def _hand_over(self, conn: socket.socket, request: protocol.Request, start: float,
                   decided: Decided | None, client_ns: int | None = None, cdi: HookArgs | None = None) -> bool:
        """Give this start to a worker (True: it answers `conn` from here on, recorded as a child), or leave it
        here (False: no worker to be had, or the message could not go, whole or not at all: a SOCK_SEQPACKET; that
        worker is let go). A decided start (`decided`) goes with its decision: the worker reads nothing again,
        and planning, which may change what the next planning sees (a refused inventory cache replaced by a scan,
        noted once), is done once. A CDI hook (`cdi`, with its client's namespace `client_ns`) goes as it came."""
        if request.later and len(self.late) >= MAX_LATE:
            return False
        worker = next((w for w in self.workers.values() if not w.busy), None)
        if worker is None:
            if len(self.workers) >= MAX_WORKERS or self._full(request.later):
                return False
            worker = self._fork_worker()
            if worker is None:
                return False
        serial = self._serial_of(decided)
        by_number = serial is not None and worker.knows(serial)
        message = self._handed((cdi, request.argv, request.config_env, request.state, start,
                                request.pid_fd is not None, client_ns is not None, decided, request.later, serial),
                               decided if by_number else None, serial)
        fds = [conn.fileno()] + [fd for fd in (request.pid_fd, client_ns) if fd is not None]
        sent = False
        if len(message) <= WORKER_MESSAGE:
            try:
                sent = socket.send_fds(worker.sock, [message], fds) == len(message)
            except OSError:
                sent = False
        if not sent:
            self._let_go(worker)
            return False
        if serial is not None and not by_number and len(worker.sent) < WORKER_KEPT_PLANS:
            worker.sent.add(serial)  # the worker keeps it (worker._run_handed: the same rule, the same count)
        worker.busy = True
        self.children[worker.pid] = conn.dup()
        if request.later:
            self.late.add(worker.pid)
        return True

    def _serial_of(self, decided: Decided | None) -> int | None:
        """The number of the remembered plan whose edits `decided` carries (None: not remembered, or no decision)."""
        if decided is None:
            return None
        return next((n for _c, _i, planned, n in self._plans.values() if planned.edits is decided.edits), None)

    @staticmethod
    def _handed(message: tuple[object, ...], by_number: Decided | None, serial: int | None) -> bytes:
        """`message` pickled for a worker; with `by_number` (a decision whose edits the worker has: a plan
        remembered before it was forked, or sent to it whole before), those edits go as `serial` (a pickle
        persistent id, worker._unpickled's), not whole: 25 KB for 8 GPUs with every capability, ~0.5 ms of
        pickling on the two sides of every such start."""
        if by_number is None or serial is None:
            return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        out = io.BytesIO()
        _ByNumber(out, by_number.edits, serial).dump(message)
        return out.getvalue()
