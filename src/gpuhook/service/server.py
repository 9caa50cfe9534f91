"""The service's socket and its single-threaded accept loop.

Safety rules (README "The hook service"):
- the socket is 0600 in a 0700 directory owned by root, or handed over by systemd (LISTEN_FDS, fd 3);
- every connection's peer is checked with SO_PEERCRED: uid 0 only, anyone else gets one refusal line;
- a request is bounded (protocol.py) and must arrive within protocol.REQUEST_TIMEOUT_S;
- each request runs in a child forked for it, so nothing one container does reaches the next; the parent only
  accepts, warms (config, inventory) and reaps, and it has no threads, so forking it is safe;
- a child keeps running when the parent dies: an accepted request is answered (the client never retries it).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import socket
import stat
import struct
import sys
import time

from gpuhook.errors import GpuhookError, InjectionError, render
from gpuhook.hook import prestart
from gpuhook.hook.config import DEFAULT_PATH, Config, load_config
from gpuhook.oci.bundle import parse_state
from gpuhook.service import protocol

MAX_CHILDREN = 64  # requests in flight; one more waits for a child to end
STOP_WAIT_S = 10.0  # on SIGTERM, how long to let running children finish before exiting anyway
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# What every start needs, imported once here instead of in each forked child.
WARM_MODULES = ("json", "gpuhook.hook.plan", "gpuhook.inject.apply", "gpuhook.inject.devcgroup",
                "gpuhook.model.request", "gpuhook.model.selection", "gpuhook.model.edits", "gpuhook.discover.cache",
                "gpuhook.discover.roots", "gpuhook.discover.fingerprint", "gpuhook.model.requirements")


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


def bind_socket(path: str) -> socket.socket:
    """A listening socket at `path` (0600, its folder 0700). A socket file nothing listens on (a crashed
    service's) is replaced; anything else at the path, or a live service, is an error."""
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
            os.unlink(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ServiceError(f"cannot listen on {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def peer_uid(conn: socket.socket) -> int:
    return _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]


def check_pid_fd(state_text: bytes, pid_fd: int) -> None:
    """The /proc/<pid> the client opened is the process `pid` names here: the same mount namespace. Anything
    else (a runtime in another PID namespace, a pid reused since) fails the start rather than touch another
    process. Injecting through the fd itself is issue 21's next step."""
    pid = parse_state(state_text).pid
    if pid <= 0:
        return  # prestart.run words this one
    try:
        theirs = os.stat(f"/proc/self/fd/{pid_fd}/ns/mnt")
        ours = os.stat(f"/proc/{pid}/ns/mnt")
    except OSError as exc:
        raise InjectionError(f"cannot check container process {pid}: {exc.strerror}") from None
    if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
        raise InjectionError(f"container process {pid} of the state is another process here (a runtime in "
                             "another PID namespace?): the service does not inject through its fd yet")


class Service:
    """The warm state (configs by path, the inventory in discover/cache's memory) and the accept loop."""

    def __init__(self, config_path: str | None = None, socket_path: str | None = None) -> None:
        import importlib

        from gpuhook.discover import cache

        for name in WARM_MODULES:
            importlib.import_module(name)
        cache.keep_warm()
        self._configs: dict[str | None, tuple[tuple[int, ...], Config]] = {}
        self.socket_path = socket_path or self.load(config_path).service_socket
        self.children: set[int] = set()
        self.listener: socket.socket | None = None
        self.bound = False
        self.stopping = False

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

    def warm(self, path: str | None) -> None:
        """Before a fork: the config and the inventory current (the fingerprint check of discover/cache), so
        the child starts with both; any failure is left for the child to meet and word."""
        from gpuhook.discover import cache

        try:
            config = self.load(path)
            cache.inventory(config.roots(),
                            config.inventory_cache)
        except Exception:  # noqa: BLE001 - the child runs the same steps and reports in its one line
            pass

    def open(self) -> None:
        self.listener = systemd_socket()
        if self.listener is None:
            self.listener = bind_socket(self.socket_path)
            self.bound = True

    def serve(self) -> None:
        """Accept until SIGTERM/SIGINT, then let running children finish (STOP_WAIT_S at most)."""
        import select

        assert self.listener is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        poller = select.poll()
        poller.register(self.listener.fileno(), select.POLLIN)
        print(f"gpuhook service: listening on {self.socket_path}", file=sys.stderr, flush=True)
        while not self.stopping:
            ready = poller.poll(1000)
            self.reap()
            if not ready or self.stopping:
                continue
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            try:
                self.serve_one(conn)
            finally:
                conn.close()
        self.close()

    def _stop(self, _sig: int, _frame: object) -> None:
        self.stopping = True

    def close(self) -> None:
        if self.listener is not None:
            if self.bound:
                with contextlib.suppress(OSError):
                    os.unlink(self.socket_path)
            self.listener.close()
            self.listener = None
        deadline = time.monotonic() + STOP_WAIT_S
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)

    def reap(self, block: bool = False) -> None:
        """waitpid every child that ended (WNOHANG); with `block`, wait for one first."""
        flags = 0 if block else os.WNOHANG
        while self.children:
            try:
                pid, _status = os.waitpid(-1, flags)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            flags = os.WNOHANG

    def serve_one(self, conn: socket.socket) -> None:
        """One connection: the peer check and the request in the parent, the work in a forked child."""
        start = time.monotonic()
        try:
            uid = peer_uid(conn)
            if uid != 0:
                self._answer(conn, 1, f"gpuhook-hook: service: refused: peer uid {uid} is not root")
                print(f"gpuhook service: refused a connection from uid {uid}", file=sys.stderr, flush=True)
                return
            request = protocol.read_request(conn)
        except protocol.ProtocolError as exc:
            self._answer(conn, 1, f"gpuhook-hook: service: {render(exc)}")
            return
        except OSError:
            return
        try:
            try:
                config_path = prestart.config_path_for(request.argv, request.config_env)
            except SystemExit as exc:  # a bad argv: the in-process hook's own words and status
                code = exc.code if isinstance(exc.code, int) else 1
                self._answer(conn, code, "" if isinstance(exc.code, int) or exc.code is None else str(exc.code))
                return
            self.warm(config_path)
            if len(self.children) >= MAX_CHILDREN:
                self.reap(block=True)
            gc.freeze()  # the warm heap goes to the permanent generation: a child's collections never touch
            child = os.fork()  # (and so never copy) the parent's pages
            if child == 0:
                self._child(conn, request, config_path, start)
            self.children.add(child)
        finally:
            if request.pid_fd is not None:
                os.close(request.pid_fd)

    def _child(self, conn: socket.socket, request: protocol.Request, config_path: str | None, start: float) -> None:
        """In the forked child: what the in-process hook runs, its answer written back; never returns."""
        code = 1
        try:
            gc.disable()  # one request, then exit: nothing to collect that exit does not free
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            if self.listener is not None:
                self.listener.close()

            check = None if request.pid_fd is None else functools.partial(check_pid_fd, pid_fd=request.pid_fd)
            code, line = prestart.handle(config_path, lambda: request.state, start, load=self.load, check=check)
            self._answer(conn, code, line)
        except BaseException:  # noqa: BLE001 - a child must never return into the accept loop
            pass
        finally:
            os._exit(0 if code == 0 else 1)

    @staticmethod
    def _answer(conn: socket.socket, code: int, line: str) -> None:
        try:
            conn.settimeout(protocol.REQUEST_TIMEOUT_S)
            conn.sendall(protocol.encode_answer(code, line))
        except OSError:
            pass


def main(config_path: str | None, socket_path: str | None) -> int:
    """`gpuhook service`: exit 0 on SIGTERM, 1 with one line when it cannot start."""
    try:
        service = Service(config_path, socket_path)
        service.open()
    except (GpuhookError, OSError) as exc:
        print(f"gpuhook service: {render(exc)}", file=sys.stderr)
        return 1
    service.serve()
    return 0
