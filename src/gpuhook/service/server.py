"""`gpuhook service`: the resident, single-threaded process that answers the native hook entry.

Where a start goes, by file:
- listener.py: the socket, published once it listens (or systemd's);
- admission.py: each peer pinned before a byte is read, the bounds, requests read as their bytes come, and the
  answers the parent makes itself, held until their client's GO (one log line per start);
- here: the accept loop and the decision of who runs a start. The parent reads and decides (the state,
  config.json, the request, the plan: hook/prestart.run up to its before_inject), which only reads and is bounded;
  whatever changes a container goes on in a warm worker or a child forked for it (none when MAX_CHILDREN run:
  DECLINED); a console-script command runs in a child; a prestart call from a runtime in another mount namespace
  is DECLINED (its start needs that client's config, driver files, NVML and libcuda: its client runs it);
- pool.py: the warm workers as the parent sees them, and the hand-over;
- worker.py: a worker's own loop, and its check that it came back clean;
- calls.py: what runs a start in any of these processes (TAKING and GO, the answer, the held log line, a CDI
  hook's call in its container's namespace with nothing loaded there).

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
from gpuhook.hook import prestart
from gpuhook.hook.config import DEFAULT_PATH, Config, load_config
from gpuhook.service import calls, protocol
from gpuhook.service.admission import MAX_PENDING, Admission
from gpuhook.service.calls import ServiceError
from gpuhook.service.listener import bind_socket, socket_path, systemd_socket
from gpuhook.service.peer import Peer, Refused, pin
from gpuhook.service.pool import MAX_LATE, WORKER_AHEAD_S, WORKER_RETRY_S, Pool
from gpuhook.service.worker import WorkerLoop

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuhook.hook.plan import Decided, Planned
    from gpuhook.inject.containerhooks import HookArgs
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


class _Forked(BaseException):  # noqa: N818 - not an error: the parent's word that a child took the start over
    """Raised in the parent right after the fork for an injection; handle() lets it through unlogged."""


class _Declined(BaseException):  # noqa: N818 - not an error: the service is at its bound
    """Raised where no child can be had for a start (MAX_CHILDREN): the client is answered DECLINED."""


def _back_to(ns_fd: int) -> None:
    """A child forked for one start, back in the service's mount namespace (to write its log line there)."""
    from gpuhook import _native

    _native.setns(ns_fd, _native.CLONE_NEWNS)
    os.close(ns_fd)


class Service(Admission, Pool, WorkerLoop):
    """The warm state (configs by path, the inventory in discover/cache's memory, remembered plans) and the accept
    loop; its parts: Admission (connections up to dispatch), Pool (warm workers), WorkerLoop (a worker's side)."""

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
        the child (0) nothing of the accept loop is left. _Declined at MAX_CHILDREN (MAX_LATE for a child that
        will wait on a late state; never a wait here: the loop must go on), or when the fork fails: nothing was
        done, the client runs the start itself."""
        if self._full(late):
            self.reap()
            if self._full(late):
                raise _Declined
        try:
            pid = self._fork_child()
        except OSError:
            raise _Declined from None
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

    def serve_one(self, conn: socket.socket) -> None:
        """One connection read and served at once (tests; the loop reads as bytes come, then calls dispatch):
        its peer pinned first, DECLINED when that fails."""
        start = time.monotonic()
        try:
            peer = pin(conn)
        except Refused as exc:
            self._log_refusal(str(exc))
            calls.answer(conn, protocol.DECLINED, "")
            return
        try:
            try:
                request = protocol.read_request(conn)
            except protocol.OtherVersion:
                calls.answer(conn, protocol.DECLINED, "")
                return
            except protocol.ProtocolError as exc:
                calls.answer(conn, 1, f"gpuhook-hook: service: {render(exc)}")
                return
            except OSError:
                return
            self.dispatch(conn, peer, request, start)
        finally:
            peer.close()

    def dispatch(self, conn: socket.socket, peer: Peer, request: protocol.Request, start: float) -> None:
        """A whole request of a pinned peer, answered here up to the plan (a container without a GPU request costs
        this round trip and nothing else); whatever changes something goes on in a child (forked for it, or the
        worker), which says TAKING first; DECLINED where no child can be had."""
        try:
            self._dispatch(conn, peer, request, start)
        except _Declined:
            calls.answer(conn, protocol.DECLINED, "")
        finally:
            if request.pid_fd is not None and request.pid_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(request.pid_fd)

    def _dispatch(self, conn: socket.socket, peer: Peer, request: protocol.Request, start: float) -> None:
        if request.later and request.argv[:1] != ["cdi-hook"]:  # only a CDI hook's child can wait for its state
            calls.answer(conn, 1, "gpuhook-hook: service: refused: only a cdi-hook request's state may follow it")
            return
        if request.argv[:1] and request.argv[0] in protocol.OUTPUT_COMMANDS:
            self._serve_command(conn, request, peer)
            return
        if request.argv == [protocol.PING]:
            calls.answer(conn, 0, f"gpuhook service pid {os.getpid()}")
            return
        if request.argv[:1] == ["cdi-hook"]:  # a CDI spec's createContainer hook: always a child (it mutates)
            from gpuhook.inject.containerhooks import parse_hook_args

            parsed = parse_hook_args(request.argv[1:])
            if parsed is None:  # help or a malformed option: click's words, so the client runs it in-process
                calls.answer(conn, protocol.DECLINED, "")
                return
            self._serve_in_child(conn, request, peer, start, parsed)
            return
        if peer.mnt_ns is not None:  # its config, driver files, NVML and libcuda are its own: it runs them itself
            self._log_refusal(f"peer pid {peer.pid}: a prestart call from another mount namespace runs in-process")
            calls.answer(conn, protocol.DECLINED, "")
            return
        self._prestart(conn, peer, request, start)

    def _prestart(self, conn: socket.socket, peer: Peer, request: protocol.Request, start: float) -> None:
        """A prestart start of a runtime in our mount namespace: decided here (the plan remembered), injected by a
        worker or a child forked for it; an answer made here is held until the client's GO (Admission._hold)."""
        vet = calls.vetter(request.pid_fd)
        held = calls.Held()
        child: calls.Taker | None = None
        home_ns = -1

        def fork_for_injection(decided: Decided) -> int | None:
            nonlocal child, home_ns
            via_fd = vet(decided)
            if self._hand_over(conn, request, start, decided) or self._fork(conn):
                raise _Forked
            # a disposable process from here on: it joins the container's mount namespace itself, and comes back
            # to ours (home_ns) only to write its log line
            home_ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            child = calls.Taker(conn)
            child()
            return via_fd

        try:
            try:
                config_path = prestart.config_path_for(request.argv, request.config_env)
            except SystemExit as exc:
                calls.answer(conn, *calls.exit_answer(exc))
                return
            code, line = prestart.handle(config_path, lambda: request.state, start, load=self.load,
                                         before_inject=fork_for_injection, plan=self.plan, served="service",
                                         log=held)
        except _Forked:
            return
        except BaseException:
            if child is not None:  # a child must never return into the accept loop
                os._exit(1)
            raise
        if child is None:
            self._hold(conn, peer.pid, code, line, held)
            return
        with contextlib.suppress(OSError):
            _back_to(home_ns)
            held.write()
        calls.answer(conn, code, line)
        os._exit(0 if code == 0 else 1)

    def _serve_command(self, conn: socket.socket, request: protocol.Request, peer: Peer) -> None:
        """A console-script command (self.commands), run in a child as the client would run it in-process (its
        cwd, its SERVED_ENV values) once the client said GO, or declined: a client in another mount namespace (its
        files are not ours) or with an interpreter from another folder (a spec names the gpuhook beside it), a
        command not served."""
        command = self.commands.get(request.argv[0])
        same_bin = request.exe is not None and os.path.dirname(os.path.abspath(request.exe)) == os.path.dirname(
            os.path.abspath(sys.executable))
        if command is None or peer.mnt_ns is not None or not request.cwd or not same_bin:
            calls.answer(conn, protocol.DECLINED, "")
            return
        if self._fork(conn):
            return
        taker = calls.Taker(conn)

        def run() -> tuple[int, str, bytes]:
            try:
                with calls.client_env(request.env or []):
                    result = command(request.argv[1:], request.cwd or "/", taker)
            except calls.NotTaken:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug in a command is its one line
                result = 1, f"gpuhook: service: {render(exc)}\n", b""
            if result is None and not taker.taken:  # click must word it: nothing was done, the client runs it
                return protocol.DECLINED, "", b""
            return result if result is not None else (1, "gpuhook: service: the command gave no answer\n", b"")

        code = 1
        try:
            code, err, out = run()
            calls.answer(conn, code, err, None if code == protocol.DECLINED else out)
        except calls.NotTaken:
            code = 0
        finally:
            os._exit(0 if code == 0 else 1)

    def _serve_in_child(self, conn: socket.socket, request: protocol.Request, peer: Peer, start: float,
                        cdi: HookArgs) -> None:
        """A CDI hook's whole call (calls.cdi_call, in its client's mount namespace) in an idle worker, else a
        child forked for it."""
        client_ns = peer.take_mnt_ns()
        try:
            if not self._hand_over(conn, request, start, None, client_ns, cdi) and \
                    self._fork(conn, late=request.later) == 0:
                taker, code = calls.Taker(conn), None
                try:
                    code, _clean = calls.run_start(
                        conn, lambda: calls.cdi_call(conn, request, client_ns, cdi, taker), taker, calls.Held(),
                        lambda: True)
                finally:
                    os._exit(0 if code == 0 else 1)
        finally:
            if client_ns is not None:  # the parent: the descriptors are the child's (or the worker's) alone
                with contextlib.suppress(OSError):
                    os.close(client_ns)

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
