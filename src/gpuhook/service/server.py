"""The service's socket and its single-threaded accept loop.

Safety rules (docs/service.md):
- the socket is 0600 in a 0700 directory owned by root, or handed over by systemd (LISTEN_FDS, fd 3); it is
  listening before its path appears (bind_socket), so a client that sees the path can connect;
- every connection's peer is pinned before a byte is read (peer.py: SO_PEERPIDFD, its /proc/<pid> and namespaces
  read while it provably runs) and served only with CAP_SYS_ADMIN in our user namespace; anyone else, and anyone
  over the bounds (MAX_PENDING in all, MAX_PENDING_PER_PEER), is answered DECLINED and runs the call in-process;
- requests are read as their bytes come (protocol.Incoming) from an epoll loop, each with its deadline
  (protocol.REQUEST_TIMEOUT_S): a slow or idle client delays nobody;
- nothing changes for a request before its client said GO to our TAKING (protocol.py): a client that waited
  too long runs the call itself, and our child then leaves without touching anything;
- the parent reads and decides (the state, config.json, the request, the plan: hook/prestart.run up to its
  before_inject), which only reads and is bounded, so a container without a GPU request costs one round trip;
- each start that touches a container runs in a child (none when MAX_CHILDREN run: DECLINED), which joins that
  container's mount namespace itself; the parent has no threads, so forking it is safe. A prestart start from a
  runtime in our mount namespace goes to a warm worker (up to MAX_WORKERS): a child forked once that runs one start
  at a time, handed over on its socket pair (the connection and descriptors over SCM_RIGHTS, the request and the
  decision made for it: prestart.Decided, whose edits go by number when the worker has them, _handed), then goes
  back to our mount namespace, checks that nothing of that start is left in it (_Home.back: its root, cwd, umask,
  descriptors, children, threads) and says READY; anything else, and a start that failed, ends the worker
  (WORKER_USES starts at most). A worker saves each start the fork and the copy-on-write faults of a fresh child,
  about half of what a start costs the service. Workers read nothing again (nothing before the plan has an effect:
  hook/prestart.run), so one forked before a change of config or driver does what the parent decided now. A CDI hook
  (a call run whole in the container's mount namespace, from its arguments alone) goes to a worker the same way; a
  prestart call whose client is in another mount namespace goes only to an idle worker, which ends after it: nothing
  that call read in its client's config and driver files stays for the next. With no worker to be had the parent
  forks a child for the start (one start, then it exits); a hand-off that fails leaves the request with the parent,
  which forks for it. While the service is idle one worker is forked ahead (and the oldest idle ones end after
  WORKER_IDLE_S);
- a child keeps running when the parent dies: an accepted request is answered (the client never retries it).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import pickle
import select
import signal
import socket
import stat
import sys
import time

from gpuhook.errors import GpuhookError, InjectionError, clip, render
from gpuhook.hook import prestart
from gpuhook.hook.config import DEFAULT_PATH, Config, load_config
from gpuhook.model.contract import SERVICE_SOCKET, SERVICE_SOCKET_ENV
from gpuhook.service import protocol
from gpuhook.service.peer import Peer, Refused, identity, pin

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import NoReturn

    from gpuhook.hook.plan import Decided, Planned
    from gpuhook.inject.containerhooks import HookArgs
    from gpuhook.model.edits import ContainerEdits
    from gpuhook.model.inventory import Inventory
    from gpuhook.model.request import Request

    # A command the service answers for the console script (service/client.py): (its arguments, the client's
    # cwd, take: called before its first effect) -> (exit status, stderr, stdout), or None, before take(), when
    # it must run in-process. The click layer above hands these in (cli/service.py), so this front door never
    # imports it.
    Command = Callable[[list[str], str, Callable[[], None]], "tuple[int, str, bytes] | None"]

MAX_PLANS = 256  # remembered plans (service.plan); then the memo starts over
MAX_CHILDREN = 64  # starts in flight in children; one more is DECLINED (its client runs it in-process)
MAX_LATE = 32  # children waiting on a cdi-hook's late state (the runtime's); counted apart, so that they can
# never take the children every other start needs; one more such request is DECLINED
MAX_PENDING = 4096  # connections whose request is still coming; one more is DECLINED
MAX_PENDING_PER_PEER = 32  # the same, from one pinned process
MAX_ACCEPTS = 64  # connections accepted per turn of the loop, so that reading the ones accepted keeps up
GO_WAIT_S = 2.0  # a child that sent TAKING waits this long for GO, then leaves untouched (the client gave up)
REFUSAL_LOG_S = 1.0  # at most one line a second about refused peers (a flood must not flood the journal)
MAX_WORKERS = 8  # warm workers at most; a start that finds none idle gets a worker forked for it while fewer run,
# else a child of its own
WORKER_USES = 1024  # starts a worker runs before it ends (whatever one start may leave in it stays bounded)
WORKER_KEPT_PLANS = 64  # plans a worker keeps of those sent to it whole, to have them by number next time
WORKER_IDLE_S = 60.0  # an idle worker other than the last one ends after this long without a start
WORKER_MESSAGE = 256 << 10  # the largest request handed to a worker (a bigger state: the parent forks for it)
WORKER_RETRY_S = 5.0  # after a worker died waiting, none is forked ahead for this long, never in a loop
WORKER_AHEAD_S = 0.02  # after a start's child ended, a worker is forked ahead this much later (Service.reap)
READY = b"R"  # a worker's word that it is back, clean, for the next start
STOP_WAIT_S = 10.0  # on SIGTERM, how long to let running children finish before exiting anyway
# What every start needs, imported once here instead of in each forked child.
WARM_MODULES = ("json", "fcntl", "gpuhook.hook.plan", "gpuhook.inject.apply", "gpuhook.inject.devcgroup",
                "gpuhook.model.request", "gpuhook.model.selection", "gpuhook.model.edits", "gpuhook.discover.cache",
                "gpuhook.discover.roots", "gpuhook.discover.fingerprint", "gpuhook.model.requirements")


class _ByNumber(pickle.Pickler):
    """Pickles `edits` as the persistent id `serial` (the worker's copy of that plan's edits: _Known)."""

    def __init__(self, out: io.BytesIO, edits: object, serial: int) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.edits, self.serial = edits, serial

    def persistent_id(self, obj: object) -> int | None:
        return self.serial if obj is self.edits else None


class _Known(pickle.Unpickler):
    """Unpickles _ByNumber's message with `edits`, the plans' edits this process has by number."""

    def __init__(self, message: bytes, edits: dict[int, ContainerEdits]) -> None:
        super().__init__(io.BytesIO(message))
        self.edits = edits

    def persistent_load(self, pid: object) -> ContainerEdits:
        found = self.edits.get(pid) if isinstance(pid, int) else None
        if found is None:
            raise ServiceError(f"the worker has no plan numbered {clip(repr(pid))}")
        return found


class _Forked(BaseException):  # noqa: N818 - not an error: the parent's word that a child took the start over
    """Raised in the parent right after the fork for an injection; handle() lets it through unlogged."""


class _NotTaken(BaseException):  # noqa: N818 - not an error: the client runs the start itself
    """Raised in a child whose client did not say GO (protocol.py): it leaves without an answer or a log line."""


class _Declined(BaseException):  # noqa: N818 - not an error: the service is at its bound
    """Raised where no child can be had for a start (MAX_CHILDREN): the client is answered DECLINED."""


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


class _Home:
    """A worker's own state, taken before its first start: its mount namespace, root, cwd, umask, descriptors.
    back() returns there after a start (which joined a container's mount namespace, or a private copy of it for
    ldconfig) and says whether nothing of that start is left: no other descriptor, child or thread."""

    def __init__(self) -> None:
        self.ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self.cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.root, self.ns_id = identity("/"), identity("/proc/thread-self/ns/mnt")
        self.fds = sorted(os.listdir("/proc/self/fd"))

    def back(self) -> bool:
        from gpuhook import _native

        try:
            _native.setns(self.ns, _native.CLONE_NEWNS)  # root and cwd become that namespace's root: ours again
            os.fchdir(self.cwd)
            os.umask(self.umask)
            if identity("/") != self.root or identity("/proc/thread-self/ns/mnt") != self.ns_id:
                return False
            if sorted(os.listdir("/proc/self/fd")) != self.fds or len(os.listdir("/proc/self/task")) != 1:
                return False
            os.waitpid(-1, os.WNOHANG)  # a child left, running or ended: not clean
        except ChildProcessError:
            return True
        except OSError:
            return False
        return False


class _Pending:
    """A connection whose request is still coming: its pinned peer, what came so far, when it must be whole."""

    __slots__ = ("conn", "peer", "incoming", "start", "deadline")

    def __init__(self, conn: socket.socket, peer: Peer, start: float) -> None:
        self.conn, self.peer, self.start = conn, peer, start
        self.incoming = protocol.Incoming()
        self.deadline = start + protocol.REQUEST_TIMEOUT_S


class ServiceError(GpuhookError):
    """The service cannot start (its socket, its config): one line, exit 1."""


def systemd_socket() -> socket.socket | None:
    """The listening socket systemd handed over (LISTEN_PID is us, LISTEN_FDS >= 1: fd 3), else None. The
    variables are removed so no child sees them."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid != str(os.getpid()) or not count.isdigit() or int(count) < 1:
        return None
    sock = socket.socket(fileno=3)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ServiceError("the socket systemd passed (fd 3) is not a unix stream socket")
    sock.set_inheritable(False)
    return sock


def _private_folder(folder: str) -> None:
    """`folder` exists as a directory owned by root (us), mode 0700; made so when missing or too open."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ServiceError(f"cannot create {folder}: {exc.strerror}") from None
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ServiceError(f"{folder} is not a directory owned by uid {os.geteuid()}: the socket is not put there")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)


def socket_path(given: str | None = None) -> str:
    """Where the service listens and every client connects: `given` (tests), else $GPUHOOK_SERVICE_SOCKET, else
    /run/gpuhook/service.sock; the one rule the native entry follows too (entry.c's service_socket)."""
    return given or os.environ.get(SERVICE_SOCKET_ENV) or SERVICE_SOCKET


def bind_socket(path: str) -> socket.socket:
    """A listening socket at `path` (0600, its folder 0700), published only once it listens: bound and listening
    under a temporary name in the same folder, then renamed to `path`, so a client never meets the path before a
    connect can succeed. A socket file nothing listens on (a crashed service's) is replaced; anything else at
    the path, or a live service, is an error."""
    path = os.path.abspath(path)
    _private_folder(os.path.dirname(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ServiceError(f"{path} exists and is not a socket: not replaced")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise ServiceError(f"a service already listens on {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # a dead service's: the new socket is renamed over it, so the path never goes missing
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temporary = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}")
    old = os.umask(0o177)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)  # a socket a service of this pid left (our folder: nobody else writes here)
        sock.bind(temporary)
        os.chmod(temporary, 0o600)
        sock.listen(1024)
        os.rename(temporary, path)
    except OSError as exc:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise ServiceError(f"cannot listen on {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    return sock


def _hung_up(conn: socket.socket) -> bool:
    """Whether the client closed its end already (POLLRDHUP: it sent its request and gave up on the answer)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP | select.POLLHUP)
    return bool(poller.poll(0))


def vetter(pid_fd: int | None) -> Callable[[Decided], int | None]:
    """prestart's before_inject for a client that sent `pid_fd`: check_pid_fd on the decided start's pid."""
    return lambda decided: check_pid_fd(decided.pid, pid_fd)


def check_pid_fd(pid: int, pid_fd: int | None) -> int | None:
    """The descriptor to reach the container's process through: the /proc/<pid> directory the client opened for
    the state's `pid`, where that pid means that process (the runtime's PID namespace), still that process (a
    descriptor of a /proc/<pid> directory never names another one: a process that died leaves it empty). The
    state's pid here may be another process or none (this service in a PID namespace of its own: a pod), so the
    start goes through the descriptor, /proc/self/fd/N. None (the state's pid, as the in-process hook uses it):
    the client sent none (no pid in its state: prestart.run words what is wrong), or this /proc cannot show it."""
    if pid_fd is None:
        return None
    if not os.path.exists("/proc/self"):  # a client's /proc, joined (_serve_in_child), of a PID namespace this
        return None  # process is not in: there the state's pid is the client's own word for the process
    try:
        os.stat(f"/proc/self/fd/{pid_fd}/ns/mnt")
    except OSError as exc:
        raise InjectionError(f"cannot reach container process {pid} through the runtime's /proc/{pid}: "
                             f"{exc.strerror}") from None
    return pid_fd


@contextlib.contextmanager
def _client_env(entries: list[str]) -> Iterator[None]:
    """os.environ with the client's values of protocol.SERVED_ENV (none it lacks) for one served command."""
    given = dict(e.split("=", 1) for e in entries if "=" in e)
    saved = {name: os.environ.get(name) for name in protocol.SERVED_ENV}
    try:
        for name in protocol.SERVED_ENV:
            if name in given:
                os.environ[name] = given[name]
            else:
                os.environ.pop(name, None)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Service:
    """The warm state (configs by path, the inventory in discover/cache's memory) and the accept loop."""

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
        self.workers: dict[int, _Worker] = {}  # pid -> a warm worker (a busy one is in children too)
        self._worker_fds: dict[int, int] = {}  # its socket's fd -> its pid, for the loop's events
        self.spent: set[int] = set()  # workers let go (their socket closed) and not reaped yet
        self.ahead_after = 0.0  # time.monotonic() before which no worker is forked ahead
        self._wakeup: tuple[int, int] | None = None  # SIGCHLD's self-pipe (signal.set_wakeup_fd)
        self.listener: socket.socket | None = None
        self.bound = False
        self.stopping = False
        self.pending: dict[int, _Pending] = {}  # fd -> a connection whose request is still coming
        self.per_peer: dict[int, int] = {}  # pinned pid -> its pending connections
        self._epoll: select.epoll | None = None
        self._refused_at, self._refused_quiet = 0.0, 0  # the last refusal line, and refusals not worded since

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
        for fd in list(self.pending):
            self._drop_pending(fd).conn.close()
        self.close()

    def _accept_ready(self) -> None:
        """Accept what is waiting (MAX_ACCEPTS at most this turn), pin each peer and start reading its request."""
        assert self.listener is not None
        for _ in range(MAX_ACCEPTS):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:  # EMFILE and the like: the client waits in the backlog, then runs in-process
                self._log_refusal(f"cannot accept ({exc.strerror})")
                return
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Pin `conn`'s peer (peer.pin) and read its request from the loop; DECLINED for a peer that cannot be
        pinned or served, or one over the bounds."""
        start = time.monotonic()
        try:
            peer = pin(conn)
        except Refused as exc:
            self._log_refusal(str(exc))
            self._decline(conn)
            return
        if len(self.pending) >= MAX_PENDING or self.per_peer.get(peer.pid, 0) >= MAX_PENDING_PER_PEER:
            self._log_refusal(f"peer pid {peer.pid}: over the bound of connections whose request is still coming")
            peer.close()
            self._decline(conn)
            return
        conn.setblocking(False)
        pending = _Pending(conn, peer, start)
        self.pending[conn.fileno()] = pending
        self.per_peer[peer.pid] = self.per_peer.get(peer.pid, 0) + 1
        assert self._epoll is not None
        self._epoll.register(conn.fileno(), select.EPOLLIN)
        self._readable(conn.fileno())  # the native entry sends its request at once: most often it is all there

    def _readable(self, fd: int) -> None:
        """Read what `fd`'s client sent; a whole request is dispatched, a bad one answered in one line."""
        pending = self.pending.get(fd)
        if pending is None:
            return
        try:
            while True:
                request = pending.incoming.feed(pending.conn)
                if request is not None:
                    break
        except BlockingIOError:
            return
        except protocol.OtherVersion:
            self._drop_pending(fd)
            self._decline(pending.conn, pending.peer)
            return
        except protocol.ProtocolError as exc:
            self._drop_pending(fd)
            self._finish(pending, 1, f"gpuhook-hook: service: {render(exc)}")
            return
        except OSError:
            self._drop_pending(fd)
            self._finish(pending)
            return
        self._drop_pending(fd)
        if _hung_up(pending.conn):  # its client gave up waiting (a service that was stopped): it runs the call
            if request.pid_fd is not None:  # itself, and nothing here may add a second log line for that start
                os.close(request.pid_fd)
            self._finish(pending)
            return
        pending.conn.setblocking(True)
        try:
            self.dispatch(pending.conn, pending.peer, request, pending.start)
        finally:
            self._finish(pending)

    def _expire(self) -> None:
        """DECLINED, then closed, for every connection whose request did not come whole in time: what it sent is
        read first (a busy loop may simply not have got to it), and nothing was done for it, so its client runs
        the call itself; a slow client never fails a start, nor holds a place."""
        now = time.monotonic()
        for fd in [fd for fd, p in self.pending.items() if p.deadline <= now]:
            self._readable(fd)
            pending = self.pending.get(fd)
            if pending is not None:
                self._drop_pending(fd)
                self._decline(pending.conn, pending.peer)

    def _drop_pending(self, fd: int) -> _Pending:
        pending = self.pending.pop(fd)
        left = self.per_peer.get(pending.peer.pid, 1) - 1
        if left > 0:
            self.per_peer[pending.peer.pid] = left
        else:
            self.per_peer.pop(pending.peer.pid, None)
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        return pending

    def _finish(self, pending: _Pending, code: int | None = None, line: str = "") -> None:
        """Close a connection taken off the loop (answered first when `code` is given) and its peer's descriptors."""
        if code is not None:
            with contextlib.suppress(OSError):
                pending.conn.setblocking(True)
            self._answer(pending.conn, code, line)
        pending.conn.close()
        pending.peer.close()

    def _decline(self, conn: socket.socket, peer: Peer | None = None) -> None:
        """DECLINED (the client runs the call in-process), then closed; never waits on the client. What it sent
        so far is read first (at most 64 KiB), so that the close does not reset the connection under the answer."""
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                conn.recv(1 << 16)
            conn.send(protocol.encode_answer(protocol.DECLINED, ""))
        conn.close()
        if peer is not None:
            peer.close()

    def _log_refusal(self, why: str) -> None:
        """One line about a refused peer, at most every REFUSAL_LOG_S (with how many went unsaid meanwhile)."""
        now = time.monotonic()
        if now - self._refused_at < REFUSAL_LOG_S:
            self._refused_quiet += 1
            return
        more = f" (and {self._refused_quiet} more since)" if self._refused_quiet else ""
        print(f"gpuhook service: declined: {clip(why, quote=False)}{more}", file=sys.stderr, flush=True)
        self._refused_at, self._refused_quiet = now, 0

    def _poll_ms(self) -> int:
        """How long the loop may wait: until a worker is due ahead (ahead_after) or the next request's deadline,
        else a second."""
        wait, now = 1000, time.monotonic()
        if not self.workers and not self.children and self.ahead_after > now:
            wait = min(wait, int((self.ahead_after - now) * 1000) + 1)
        if self.pending:
            first = min(p.deadline for p in self.pending.values())
            wait = min(wait, max(0, int((first - now) * 1000) + 1))
        return wait

    def _ahead_due(self) -> bool:
        """Whether to fork a worker ahead now: the service has no worker at all (a busy one is among the children:
        with none, any worker would be idle) and no start in a child, and ahead_after has passed."""
        return not self.children and not self.workers and time.monotonic() >= self.ahead_after

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
                    self._answer(conn, 1, f"gpuhook-hook: service: the child for this start (pid {pid}) died of "
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

    def _fork_worker(self) -> _Worker | None:
        """Fork a warm worker (self.workers), idle; it waits for _hand_over on its socket pair. None where the fork
        fails: the start forks a child for itself."""
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
        worker is let go). A start decided here goes with its decision (Decided: the edits, the pid, the rootfs)
        to an idle worker, or to one forked for it while fewer than MAX_WORKERS run: the worker reads nothing
        again, and planning, which may change what the next planning sees (a refused inventory cache replaced by
        a scan, noted once), is done once. Without one it is a whole call (_serve_in_child's: a CDI hook, `cdi`,
        which goes to a worker as a decided start does; or a client in another mount namespace, `client_ns`, only
        to an idle worker, which then ends), which goes as it came, to be run whole there. The descriptors go
        along: the connection, the /proc/<pid> fd, the client's namespace."""
        if request.later and len(self.late) >= MAX_LATE:
            return False
        worker = next((w for w in self.workers.values() if not w.busy), None)
        if worker is None:
            if (decided is None and cdi is None) or len(self.workers) >= MAX_WORKERS or self._full(request.later):
                return False
            worker = self._fork_worker()
            if worker is None:
                return False
        serial = self._serial_of(decided)
        by_number = serial is not None and worker.knows(serial)
        message = self._handed((decided is None, request.argv, request.config_env, request.state, start,
                                request.pid_fd is not None, client_ns is not None, decided, cdi, request.later,
                                serial), decided if by_number else None, serial)
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
            worker.sent.add(serial)  # the worker keeps it (_run_handed: the same rule, the same count)
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
        persistent id, _unpickled's), not whole: 25 KB for 8 GPUs with every capability, ~0.5 ms of pickling on
        the two sides of every such start."""
        if by_number is None or serial is None:
            return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        out = io.BytesIO()
        _ByNumber(out, by_number.edits, serial).dump(message)
        return out.getvalue()

    def _unpickled(self, message: bytes) -> tuple[object, ...]:
        """_handed's message, in a worker: edits given by number are this process's copy of that plan's (the
        parent's memo as it was at the fork, or a plan sent here whole)."""
        known = {n: planned.edits for _c, _i, planned, n in self._plans.values()}
        known.update(self._worker_plans)
        return _Known(message, known).load()

    def _serve_as_worker(self, sock: socket.socket) -> NoReturn:
        """In a worker: run each start handed over (_hand_over) as a child forked for it would, answer it, go back
        home (_Home.back) and say READY; end at the socket's end (the parent let it go, or is gone), after a
        prestart call run whole, a start that failed or went wrong, a state it cannot come back clean from, or
        WORKER_USES starts."""
        try:
            gc.enable()  # it lives on: its own garbage is collected (the parent's heap is frozen: never scanned)
            mine = sock.fileno()  # forked for a start, it has that start's connection and descriptors: it gets
            os.closerange(3, mine)  # them again over its socket, so no other one stays open for its lifetime
            os.closerange(mine + 1, max(mine + 1, os.sysconf("SC_OPEN_MAX")))
            home = _Home()
            for _ in range(WORKER_USES):
                message, fds, _flags, _addr = socket.recv_fds(sock, WORKER_MESSAGE, 3)
                if not message or not fds or not self._run_handed(message, fds) or not home.back():
                    break
                sock.send(READY)
        finally:  # never back into the accept loop: whatever stopped it, it ends
            os._exit(0)

    def _run_handed(self, message: bytes, fds: list[int]) -> bool:
        """In a worker: the start `message` (with `fds`: the connection, then the /proc/<pid> fd and the client's
        namespace it says it has) run and answered; whether the worker may take another (a decided start or a CDI
        hook that succeeded, or that its client took back: _NotTaken). A prestart call run whole (its client in
        another mount namespace) read that client's config and inventory: the worker ends after it."""
        conn = socket.socket(fileno=fds[0])
        again = False
        ours: list[int] = []  # the descriptors this start leaves to close (a client namespace is closed once joined)

        def start_handed_over() -> tuple[int, str]:
            nonlocal again
            whole, argv, config_env, state, start, with_pid_fd, with_ns, decided, cdi, later, serial = \
                self._unpickled(message)
            if serial is not None and not whole and serial not in self._worker_plans \
                    and len(self._worker_plans) < WORKER_KEPT_PLANS:  # kept as the parent counts (_hand_over)
                self._worker_plans[serial] = decided.edits
            if len(fds) != 1 + with_pid_fd + with_ns:  # never a start in a namespace other than the client's
                raise ServiceError(f"the worker got {len(fds)} descriptors for a start that has "
                                   f"{1 + with_pid_fd + with_ns}")
            pid_fd = fds[1] if with_pid_fd else None
            ours.extend(fds[1:2] if with_pid_fd else [])
            request = protocol.Request(argv, config_env, state, pid_fd, later=later)
            vet = self._taking(conn, vetter(pid_fd))
            again = not whole or cdi is not None  # a CDI hook reads nothing of the host's config or inventory
            if whole:
                return self._whole_call(conn, request, fds[-1] if with_ns else None, start, vet, cdi)
            config_path = prestart.config_path_for(argv, config_env)
            return prestart.handle(config_path, lambda: state, start, load=self.load, before_inject=vet,
                                   decided=decided, served="service")

        code = self._run_start(conn, start_handed_over)
        conn.close()
        if not again:
            return False
        for fd in ours:
            os.close(fd)
        return code == 0

    def _run_start(self, conn: socket.socket, call: Callable[[], tuple[int, str]]) -> int | None:
        """In a child: run `call` (one whole start: its exit status and line) and answer it on `conn`; a bad argv
        (SystemExit) and any failure are answered in one line too. The exit status (0 for a start its client
        took back: _NotTaken), None for a failure that is no start's outcome (a bug)."""
        try:
            code, line = call()
            self._answer(conn, code, line)
            return code
        except SystemExit as exc:
            return self._answer_exit(conn, exc)
        except _NotTaken:  # the client runs it: no answer, no line
            return 0
        except BaseException as exc:  # noqa: BLE001 - a child must never return into the accept loop
            self._answer(conn, 1, f"gpuhook-hook: service: {render(exc)}")
            return None

    def _finish_in_child(self, conn: socket.socket, call: Callable[[], tuple[int, str]]) -> NoReturn:
        """In a child forked for one start: _run_start, then exit with its status. A child never returns into the
        accept loop."""
        code: int | None = None
        try:
            code = self._run_start(conn, call)
        finally:
            os._exit(0 if code == 0 else 1)

    def _taking(self, conn: socket.socket, vet: Callable[[Decided], int | None]) -> Callable[[Decided], int | None]:
        """prestart's before_inject in a child: `vet` (which may still refuse the start: nothing changed yet),
        then TAKING and the client's GO (_take) before the first change."""
        def before_inject(decided: Decided) -> int | None:
            via_fd = vet(decided)
            self._take(conn)
            return via_fd
        return before_inject

    def serve_one(self, conn: socket.socket) -> None:
        """One connection read and served at once (tests; the loop reads as bytes come, then calls dispatch):
        its peer pinned first, DECLINED when that fails."""
        start = time.monotonic()
        try:
            peer = pin(conn)
        except Refused as exc:
            self._log_refusal(str(exc))
            self._answer(conn, protocol.DECLINED, "")
            return
        try:
            try:
                request = protocol.read_request(conn)
            except protocol.OtherVersion:
                self._answer(conn, protocol.DECLINED, "")
                return
            except protocol.ProtocolError as exc:
                self._answer(conn, 1, f"gpuhook-hook: service: {render(exc)}")
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
            self._answer(conn, protocol.DECLINED, "")
        finally:
            if request.pid_fd is not None and request.pid_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(request.pid_fd)

    def _dispatch(self, conn: socket.socket, peer: Peer, request: protocol.Request, start: float) -> None:
        if request.later and request.argv[:1] != ["cdi-hook"]:  # only a CDI hook's child can wait for its state
            self._answer(conn, 1, "gpuhook-hook: service: refused: only a cdi-hook request's state may follow it")
            return
        if request.argv[:1] and request.argv[0] in protocol.OUTPUT_COMMANDS:
            self._serve_command(conn, request, peer)
            return
        if request.argv == [protocol.PING]:
            self._answer(conn, 0, f"gpuhook service pid {os.getpid()}")
            return
        vet = vetter(request.pid_fd)  # before_inject, wherever the start runs
        if request.argv[:1] == ["cdi-hook"]:  # a CDI spec's createContainer hook: always a child (it mutates)
            from gpuhook.inject.containerhooks import parse_hook_args

            parsed = parse_hook_args(request.argv[1:])
            if parsed is None:  # help or a malformed option: click's words, so the client runs it in-process
                self._answer(conn, protocol.DECLINED, "")
                return
            self._serve_in_child(conn, request, peer, start, vet, parsed)
            return
        if peer.mnt_ns is not None:
            self._serve_in_child(conn, request, peer, start, vet)
            return
        child = False

        def fork_for_injection(decided: Decided) -> int | None:
            nonlocal child
            via_fd = vet(decided)
            if self._hand_over(conn, request, start, decided) or self._fork(conn):
                raise _Forked
            child = True  # a disposable process from here on: it joins the container's mount namespace itself
            self._take(conn)
            return via_fd

        try:
            try:
                config_path = prestart.config_path_for(request.argv, request.config_env)
            except SystemExit as exc:
                self._answer_exit(conn, exc)
                return
            code, line = prestart.handle(config_path, lambda: request.state, start, load=self.load,
                                         before_inject=fork_for_injection, plan=self.plan, served="service")
            self._answer(conn, code, line)
            if child:
                os._exit(0 if code == 0 else 1)
        except _Forked:
            return
        except BaseException:
            if child:  # a child must never return into the accept loop (a client that said no GO: _NotTaken)
                os._exit(1)
            raise

    def _serve_command(self, conn: socket.socket, request: protocol.Request, peer: Peer) -> None:
        """A console-script command (self.commands), run in a child as the client would run it in-process (its
        cwd, its SERVED_ENV values) once the client said GO, or declined: a client in another mount namespace (its
        files are not ours) or with an interpreter from another folder (a spec names the gpuhook beside it), a
        command not served."""
        command = self.commands.get(request.argv[0])
        same_bin = request.exe is not None and os.path.dirname(os.path.abspath(request.exe)) == os.path.dirname(
            os.path.abspath(sys.executable))
        if command is None or peer.mnt_ns is not None or not request.cwd or not same_bin:
            self._answer(conn, protocol.DECLINED, "")
            return
        if self._fork(conn):
            return

        taken = False

        def take() -> None:
            nonlocal taken
            self._take(conn)
            taken = True

        def run() -> tuple[int, str, bytes]:
            try:
                with _client_env(request.env or []):
                    result = command(request.argv[1:], request.cwd or "/", take)
            except _NotTaken:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug in a command is its one line
                result = 1, f"gpuhook: service: {render(exc)}\n", b""
            if result is None and not taken:  # click must word it: nothing was done, the client runs it
                return protocol.DECLINED, "", b""
            return result if result is not None else (1, "gpuhook: service: the command gave no answer\n", b"")

        code = 1
        try:
            code, err, out = run()
            self._answer(conn, code, err, None if code == protocol.DECLINED else out)
        except _NotTaken:
            code = 0
        finally:
            os._exit(0 if code == 0 else 1)

    def _serve_in_child(self, conn: socket.socket, request: protocol.Request, peer: Peer, start: float,
                        vet: Callable[[Decided], int | None], cdi: HookArgs | None = None) -> None:
        """The whole call in a child (an idle worker, else one forked for it), as the in-process entry
        would run it where the client is (_whole_call). `cdi`: a createContainer hook's parsed command line
        (inject/containerhooks.run_hook)."""
        client_ns = peer.take_mnt_ns()
        try:
            if not self._hand_over(conn, request, start, None, client_ns, cdi) and \
                    self._fork(conn, late=request.later) == 0:
                self._finish_in_child(conn, lambda: self._whole_call(conn, request, client_ns, start,
                                                                     self._taking(conn, vet), cdi))
        finally:
            if client_ns is not None:  # the parent: the descriptors are the child's (or the worker's) alone
                os.close(client_ns)

    @staticmethod
    def _whole_call(conn: socket.socket, request: protocol.Request, client_ns: int | None, start: float,
                    vet: Callable[[Decided], int | None], cdi: HookArgs | None) -> tuple[int, str]:
        """In a child: a client in another mount namespace (a runtime with its own /sys/fs/cgroup or /proc; a CDI
        createContainer hook, which runs in the container's) is joined first, so its config file, its cgroup
        mounts, its /proc and so the PID namespace the state's pid is in are what the start uses; nothing of the
        service's warm config or plans is. A request whose state follows (protocol's `later`) gets it from `conn`
        then, when everything that does not need it is done."""
        if client_ns is not None:
            from gpuhook import _native

            _native.setns(client_ns, _native.CLONE_NEWNS)
            os.close(client_ns)
        if request.later:
            request.state = protocol.read_late_state(conn)
        if cdi is not None:  # as `gpuhook cdi-hook …` in-process (cli/entry.run_lean): errors.outcome
            from gpuhook.errors import outcome
            from gpuhook.inject.containerhooks import run_hook

            Service._take(conn)  # all of run_hook may change the container: said GO for first
            return outcome(lambda: run_hook(cdi, request.state))
        config_path = prestart.config_path_for(request.argv, request.config_env)
        return prestart.handle(config_path, lambda: request.state, start, before_inject=vet, served="service")

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
        for pending in self.pending.values():  # requests still coming: the parent's to read
            pending.conn.close()
            pending.peer.close()
        self.pending.clear()
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        for worker in self.workers.values():  # the parent's ends of the workers' sockets: its to hand over on
            worker.sock.close()
        self.workers.clear()
        self._worker_fds.clear()
        self.spent.clear()

    @staticmethod
    def _take(conn: socket.socket) -> None:
        """In a child, right before its first change: TAKING to the client, then its GO (protocol.py), within
        GO_WAIT_S; _NotTaken when it does not come (the client gave up and runs the call itself)."""
        try:
            conn.settimeout(GO_WAIT_S)
            conn.sendall(protocol.encode_taking())
            if conn.recv(1) == protocol.GO:
                return
        except OSError:
            pass
        raise _NotTaken
    @classmethod
    def _answer_exit(cls, conn: socket.socket, exc: SystemExit) -> int:
        """A bad argv (config_path_for's SystemExit): the in-process hook's own words and status."""
        code = exc.code if isinstance(exc.code, int) else 1
        cls._answer(conn, code, "" if isinstance(exc.code, int) or exc.code is None else str(exc.code))
        return code

    @staticmethod
    def _answer(conn: socket.socket, code: int, line: str, output: bytes | None = None) -> None:
        """The answer, sent within REQUEST_TIMEOUT_S (a command's stdout, up to MAX_OUTPUT, gets ten times that)."""
        try:
            conn.settimeout(protocol.REQUEST_TIMEOUT_S * (1 if output is None else 10))
            conn.sendall(protocol.encode_answer(code, line, output))
        except OSError:
            pass


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
