"""`gpuhook service`: the resident, single-threaded process that answers the native hook entry.

Where a start goes, by file:
- listener.py: the socket, published once it listens (or systemd's);
- admission.py: each peer pinned before a byte is read, the bounds, requests read as their bytes come, and the
  answers the parent makes itself, held until their client's GO (one log line per start);
- dispatch.py: who runs a start: the parent up to the plan; a warm worker or a child forked for it from the first
  change on; a child for a console-script command; nobody here for a prestart call from another mount namespace
  (DECLINED: its client runs it);
- pool.py: the warm workers as the parent sees them, and the hand-over;
- worker.py: a worker's own loop, and its check that it came back clean;
- calls.py: what runs a start in any of these processes (TAKING and GO, the answer, the held log line, a CDI
  hook's call in its container's namespace with nothing loaded there);
- here: the warm state, the accept loop, forks and reaping.

The parent has no threads, so forking it is safe; a child keeps running when the parent dies: an accepted request
is answered (the client never retries it). docs/service.md and docs/security.md say what a peer can and cannot do.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import sys
import time

from gpuhook.errors import GpuhookError, render
from gpuhook.hook.config import DEFAULT_PATH, Config, load_config
from gpuhook.service import calls
from gpuhook.service.admission import MAX_PENDING, Admission
from gpuhook.service.calls import ServiceError
from gpuhook.service.dispatch import Declined, Dispatch
from gpuhook.service.listener import bind_socket, socket_path, systemd_socket
from gpuhook.service.pool import MAX_LATE, WORKER_AHEAD_S, WORKER_RETRY_S, Pool
from gpuhook.service.worker import WorkerLoop

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuhook.hook.plan import Planned
    from gpuhook.model.edits import ContainerEdits
    from gpuhook.model.inventory import Inventory
    from gpuhook.model.request import Request

    # A command the service answers for the console script (service/client.py): (its arguments, the client's
    # cwd, take: called before its first effect) -> (exit status, stderr, stdout), or None, before take(), when
    # it must run in-process. The click layer above hands these in (cli/serve.py), so this front door never
    # imports it.
    Command = Callable[[list[str], str, Callable[[], None]], "tuple[int, str, bytes] | None"]

__all__ = ["MAX_LATE", "Service", "ServiceError", "bind_socket", "main"]

MAX_PLANS = 256  # remembered plans (service.plan); then the memo starts over
MAX_CHILDREN = 64  # starts in flight in children; one more is DECLINED (its client runs it in-process)
STOP_WAIT_S = 10.0  # on SIGTERM, how long to let running children finish before exiting anyway
# What every start needs, imported once here instead of in each forked child, and so that nothing is imported
# after a start joined a container's mount namespace (tests/test_service_audit.py proves the list complete).
WARM_MODULES = ("json", "fcntl", "gpuhook.hook.plan", "gpuhook.inject.apply", "gpuhook.inject.devcgroup",
                "gpuhook.model.request", "gpuhook.model.selection", "gpuhook.model.edits", "gpuhook.discover.cache",
                "gpuhook.discover.roots", "gpuhook.discover.fingerprint", "gpuhook.model.requirements",
                "gpuhook.inject.containerhooks", "gpuhook.inject.cudacompat", "gpuhook.inject.ldcache",
                "gpuhook.inject.rootfs", "gpuhook.oci.bundle", "gpuhook.hook.unreadconfig")


class Service(Admission, Dispatch, Pool, WorkerLoop):
    """The warm state (configs by path, the inventory in discover/cache's memory, remembered plans) and the accept
    loop; its parts: Admission (connections up to dispatch), Dispatch (who runs a start), Pool (warm workers),
    WorkerLoop (a worker's side)."""

    def __init__(self, config_path: str | None = None, given_socket: str | None = None,
                 commands: dict[str, Command] | None = None) -> None:
        import importlib

        from gpuhook.discover import cache

        for name in WARM_MODULES:
            importlib.import_module(name)
        cache.keep_warm()
        self._configs: dict[str | None, tuple[tuple[int, ...], Config]] = {}
        # each remembered plan with its serial number: a worker forked after a plan was remembered has its own
        # copy of it, so a start with that plan hands its edits over by number (_handed)
        self._plans: dict[tuple[int, str, Request], tuple[Config, Inventory, Planned, int]] = {}
        self._next_serial = 0
        self._worker_plans: dict[int, ContainerEdits] = {}  # in a worker: the plans sent to it whole, by number
        config = self.load(config_path)
        self.socket_path = os.path.abspath(socket_path(given_socket))
        with contextlib.suppress(Exception):  # the inventory of its own config, scanned before the first start
            cache.inventory(config.roots(), config.inventory_cache)  # (a failure is the first start's to word)
        self.commands = dict(commands or {})
        self.children: dict[int, socket.socket] = {}  # pid -> its client's connection, kept to word a death
        self.late: set[int] = set()  # the children that wait on a late state (MAX_LATE)
        self._wakeup: tuple[int, int] | None = None  # SIGCHLD's self-pipe (signal.set_wakeup_fd)
        self.listener: socket.socket | None = None
        self.bound = False
        self.stopping = False
        self._epoll: select.epoll | None = None
        self._init_admission()
        self._init_pool()

    def load(self, path: str | None) -> Config:
        """load_config(path), reused while the file's identity, size and mtime stay the same."""
        try:
            st = os.stat(path or DEFAULT_PATH)
            key: tuple[int, ...] | None = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        hit = self._configs.get(path)
        if key is not None and hit is not None and hit[0] == key:
            return hit[1]
        config = load_config(path)
        if key is not None:
            self._configs[path] = (key, config)
        return config

    def plan(self, config: Config, request: Request) -> Planned:
        """plan_request, remembered per (config, request) while the inventory's fingerprint holds: a warm start
        of a request seen before plans nothing. The inventory call is the fingerprint check (discover/cache);
        the memo is bounded (MAX_PLANS, then it starts over)."""
        from gpuhook.discover import cache
        from gpuhook.hook.plan import plan_request

        notes: list[str] = []
        inv = cache.inventory(config.roots(), config.inventory_cache, notes)
        key = (id(config), inv.fingerprint, request)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is config and hit[1] is inv and not notes:
            return hit[2]
        planned = plan_request(config, request, inv, notes)
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        if not planned.notes:  # a plan with a note (a refused cache file) is made again, its note said again
            self._plans[key] = (config, inv, planned, self._next_serial)
            self._next_serial += 1
        return planned

    def open(self) -> None:
        self.listener = systemd_socket()
        if self.listener is None:
            self.listener = bind_socket(self.socket_path)
            self.bound = True

    def serve(self) -> None:
        """Accept until SIGTERM/SIGINT, then let running children finish (STOP_WAIT_S at most). One epoll loop:
        the listener, SIGCHLD's self-pipe and every connection whose request is still coming."""
        import resource

        assert self.listener is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # MAX_PENDING connections, each with its peer's
        want = min(hard, 4 * MAX_PENDING + 256) if hard != resource.RLIM_INFINITY else 4 * MAX_PENDING + 256
        if soft != resource.RLIM_INFINITY and soft < want:  # /proc/<pid> and namespace descriptors
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        self._wakeup = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._wakeup[1])  # a child's end wakes the poll at once, so it is reaped (and a
        signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)  # death answered) without waiting for a timeout
        self.listener.setblocking(False)
        self._epoll = select.epoll()
        self._epoll.register(self.listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wakeup[0], select.EPOLLIN)
        print(f"gpuhook service: listening on {self.socket_path}", file=sys.stderr, flush=True)
        while not self.stopping:
            if self._ahead_due():
                self._fork_worker()  # idle: the next start's worker, forked ahead
            try:
                events = self._epoll.poll(self._poll_ms() / 1000)
            except InterruptedError:
                events = []
            for fd, _mask in events:
                if fd == self._wakeup[0]:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wakeup[0], 512):
                            pass
                elif fd == self.listener.fileno():
                    if not self.stopping:
                        self._accept_ready()
                elif fd in self._worker_fds:
                    self._worker_said(self._worker_fds[fd])
                else:
                    self._readable(fd)
            self.reap()
            self._expire()
            self._retire_idle()
        self._close_connections()
        self.close()

    def _poll_ms(self) -> int:
        """How long the loop may wait: until a worker is due ahead (ahead_after) or the next request's deadline,
        else a second."""
        wait, now = 1000, time.monotonic()
        if not self.workers and not self.children and self.ahead_after > now:
            wait = min(wait, int((self.ahead_after - now) * 1000) + 1)
        first = self._next_deadline()
        if first is not None:
            wait = min(wait, max(0, int((first - now) * 1000) + 1))
        return wait

    def _stop(self, _sig: int, _frame: object) -> None:
        self.stopping = True

    def close(self) -> None:
        if self.listener is not None:
            if self.bound:
                with contextlib.suppress(OSError):
                    os.unlink(self.socket_path)
            self.listener.close()
            self.listener = None
        for worker in list(self.workers.values()):  # an idle one holds no start: ended now, not once it reads
            if not worker.busy:  # its socket's end (the service gone by then)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)
            self._let_go(worker)  # a busy one ends once its start is answered
        deadline = time.monotonic() + STOP_WAIT_S
        while (self.children or self.spent) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)
        for conn in self.children.values():
            conn.close()

    def reap(self, block: bool = False) -> None:
        """waitpid every child that ended (WNOHANG); with `block`, wait for one first. A child killed before it
        answered (a signal: it answers, then exits) gets its start answered here, in one line."""
        flags = 0 if block else os.WNOHANG
        while self.children or self.workers or self.spent:
            try:
                pid, status = os.waitpid(-1, flags)
            except ChildProcessError:  # none left at all: nothing of theirs is kept
                for conn in self.children.values():
                    conn.close()
                self.children.clear()
                self.late.clear()
                for worker in list(self.workers.values()):
                    self._let_go(worker)
                self.spent.clear()
                return
            if pid == 0:
                return
            self.spent.discard(pid)
            self.late.discard(pid)
            worker = self.workers.get(pid)
            if worker is not None:
                if not worker.busy and status != 0:  # died waiting: none forked ahead for a while, never a loop
                    self.ahead_after = time.monotonic() + WORKER_RETRY_S
                self._let_go(worker)
                self.spent.discard(pid)
            conn = self.children.pop(pid, None)
            if conn is not None:  # a start ended: its runtime is likely still starting that container, on the
                # same CPUs; a worker forked ahead now (its fork, a few ms of CPU) waits WORKER_AHEAD_S
                self.ahead_after = max(self.ahead_after, time.monotonic() + WORKER_AHEAD_S)
                if os.WIFSIGNALED(status):
                    name = signal.Signals(os.WTERMSIG(status)).name
                    calls.answer(conn, 1, f"gpuhook-hook: service: the child for this start (pid {pid}) died of "
                                          f"{name} before it answered: the start fails")
                conn.close()
            flags = os.WNOHANG

    def _fork(self, conn: socket.socket, late: bool = False) -> int:
        """os.fork for one start: in the parent the child is recorded with a copy of its client's connection; in
        the child (0) nothing of the accept loop is left. Declined at MAX_CHILDREN (MAX_LATE for a child that
        will wait on a late state; never a wait here: the loop must go on), or when the fork fails: nothing was
        done, the client runs the start itself."""
        if self._full(late):
            self.reap()
            if self._full(late):
                raise Declined
        try:
            pid = self._fork_child()
        except OSError:
            raise Declined from None
        if pid:
            self.children[pid] = conn.dup()
            if late:
                self.late.add(pid)
        return pid

    def _full(self, late: bool) -> bool:
        return len(self.late) >= MAX_LATE if late else len(self.children) - len(self.late) >= MAX_CHILDREN

    def _fork_child(self) -> int:
        """os.fork; in the child (0) nothing of the accept loop is left (_enter_child)."""
        gc.freeze()  # the warm heap goes to the permanent generation: a child's collections never touch (and so
        pid = os.fork()  # never copy) the parent's pages
        if pid == 0:
            self._enter_child()
        return pid

    def _enter_child(self) -> None:
        """In the forked child: one start, then exit, so no collector, no signal handlers, no listener."""
        gc.disable()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                os.close(fd)
        if self.listener is not None:
            self.listener.close()
        for conn in self.children.values():  # other starts' connections: theirs to answer
            conn.close()
        self._close_connections()  # requests still coming and held answers: the parent's to read and send
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        for worker in self.workers.values():  # the parent's ends of the workers' sockets: its to hand over on
            worker.sock.close()
        self.workers.clear()
        self._worker_fds.clear()
        self.spent.clear()



def main(config_path: str | None, commands: dict[str, Command] | None = None) -> int:
    """`gpuhook service`: exit 0 on SIGTERM, 1 with one line when it cannot start."""
    try:
        service = Service(config_path, None, commands)
        service.open()
    except (GpuhookError, OSError) as exc:
        print(f"gpuhook service: {render(exc)}", file=sys.stderr)
        return 1
    service.serve()
    return 0
