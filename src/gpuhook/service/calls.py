"""What runs one start, in whichever of the service's processes runs it (the parent up to the plan, a warm worker,
a child forked for it): the client's TAKING and GO, the answer, the log line, and a CDI hook's call.

Two rules hold here for every start:
- **one line per start**: the start's log line is held (Held) until its client said GO (protocol.py). A client
  that gave up waiting ran the start itself and wrote its own line, so ours is then never written; a process
  that ran the start in a container's mount namespace writes it only once it is back in its own, so the log
  path is the host's;
- **nothing of a client's files runs here**: a CDI hook (the one call served in a namespace not the service's:
  its container's) has every module it needs loaded before the switch (the service imports WARM_MODULES at
  start) and its ldconfig opened by descriptor from the service's own namespace (cdi_call). A prestart call from
  a runtime in another mount namespace is DECLINED instead (server.py): it needs its client's config, driver
  root, NVML and libcuda, which would run client files here.
"""

from __future__ import annotations

import contextlib
import os

from gpuhook.errors import GpuhookError, InjectionError, render
from gpuhook.hook.log import append_log
from gpuhook.service import protocol

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Iterator

    from gpuhook.hook.plan import Decided
    from gpuhook.inject.containerhooks import HookArgs

GO_WAIT_S = 2.0  # a process that sent TAKING waits this long for GO, then leaves untouched (the client gave up)


class NotTaken(BaseException):  # noqa: N818 - not an error: the client runs the start itself
    """Raised where a client did not say GO (protocol.py): the start leaves without an answer or a log line."""


class ServiceError(GpuhookError):
    """The service cannot start (its socket, its config), or a hand-over went wrong: one line."""


class Held:
    """The log lines of one start, held (handed to prestart.handle as its `log`) until its client said GO: a
    client that gave up ran the start itself and logged it, so these are then dropped, never written twice."""

    __slots__ = ("lines",)

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __call__(self, path: str, text: str) -> None:
        self.lines.append((path, text))

    def write(self) -> None:
        for path, text in self.lines:
            append_log(path, text)
        self.lines.clear()


class Taker:
    """TAKING, then the client's GO, once per start (take): NotTaken when GO does not come within GO_WAIT_S."""

    __slots__ = ("conn", "taken")

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.taken = conn, False

    def __call__(self) -> None:
        if not self.taken:
            take(self.conn)
            self.taken = True


def take(conn: socket.socket) -> None:
    """Right before a start's first change (or its log line): TAKING to the client, then its GO, within
    GO_WAIT_S; NotTaken when it does not come (the client gave up and runs the call itself)."""
    try:
        conn.settimeout(GO_WAIT_S)
        conn.sendall(protocol.encode_taking())
        if conn.recv(1) == protocol.GO:
            return
    except OSError:
        pass
    raise NotTaken


def answer(conn: socket.socket, code: int, line: str, output: bytes | None = None) -> None:
    """The answer, sent within REQUEST_TIMEOUT_S (a command's stdout, up to MAX_OUTPUT, gets ten times that)."""
    try:
        conn.settimeout(protocol.REQUEST_TIMEOUT_S * (1 if output is None else 10))
        conn.sendall(protocol.encode_answer(code, line, output))
    except OSError:
        pass


def exit_answer(exc: SystemExit) -> tuple[int, str]:
    """A bad argv (prestart.config_path_for's SystemExit): the in-process hook's own words and status."""
    code = exc.code if isinstance(exc.code, int) else 1
    return code, "" if isinstance(exc.code, int) or exc.code is None else str(exc.code)


def run_start(conn: socket.socket, call: Callable[[], tuple[int, str]], taker: Taker, held: Held,
              home: Callable[[], bool]) -> tuple[int | None, bool]:
    """In a worker or a child: `call` (one whole start: its exit status and line; its log lines in `held`), then
    the client's GO if it was not said yet, `home()` (back in the process's own mount namespace: whether it is
    clean), the log line and the answer. (The exit status, None for a failure that is no start's outcome: a bug;
    whether home() found the process clean.) A client that took the start back (NotTaken) gets neither: (0, …)."""
    code: int | None
    try:
        try:
            code, line = call()
        except SystemExit as exc:
            code, line = exit_answer(exc)
        except NotTaken:
            raise
        except BaseException as exc:  # noqa: BLE001 - a child must never return into the accept loop
            code, line = None, f"gpuhook-hook: service: {render(exc)}"
        taker()
    except NotTaken:  # the client runs it: no answer, no line
        return 0, home()
    clean = home()
    held.write()
    answer(conn, 1 if code is None else code, line)
    return code, clean


def vetter(pid_fd: int | None, taker: Taker | None = None) -> Callable[[Decided], int | None]:
    """prestart's before_inject for a client that sent `pid_fd`: with `taker` (a worker's or child's), the
    client's GO first (a start it took back is left alone, whatever became of its container meanwhile), then
    check_pid_fd on the decided start's pid."""
    def before_inject(decided: Decided) -> int | None:
        if taker is not None:
            taker()
        return check_pid_fd(decided.pid, pid_fd)
    return before_inject


def check_pid_fd(pid: int, pid_fd: int | None) -> int | None:
    """The descriptor to reach the container's process through: the /proc/<pid> directory the client opened for
    the state's `pid`, where that pid means that process (the runtime's PID namespace), still that process (a
    descriptor of a /proc/<pid> directory never names another one: a process that died leaves it empty). The
    state's pid here may be another process or none (this service in a PID namespace of its own: a pod), so the
    start goes through the descriptor, /proc/self/fd/N. None (the state's pid, as the in-process hook uses it):
    the client sent none (no pid in its state: prestart.run words what is wrong)."""
    if pid_fd is None:
        return None
    try:
        os.stat(f"/proc/self/fd/{pid_fd}/ns/mnt")
    except OSError as exc:
        raise InjectionError(f"cannot reach container process {pid} through the runtime's /proc/{pid}: "
                             f"{exc.strerror}") from None
    return pid_fd


def cdi_call(conn: socket.socket, request: protocol.Request, client_ns: int | None, cdi: HookArgs,
             taker: Taker) -> tuple[int, str]:
    """A CDI spec's createContainer hook (`cdi-hook …`), as the in-process entry runs it where its client is (the
    container's mount namespace, `client_ns`): the host's ldconfig opened here first, by descriptor, then the
    namespace joined, the state read when it comes late (protocol's `later`), GO, and the links and ld cache made
    (containerhooks.run_hook). Nothing is imported, loaded or executed from the client's files: what run_hook
    needs is loaded (WARM_MODULES), ldconfig is this namespace's static binary."""
    from gpuhook.errors import outcome
    from gpuhook.inject.containerhooks import open_hook_ldconfig, run_hook

    fd = -1

    def work() -> None:
        nonlocal fd
        try:
            fd = open_hook_ldconfig(cdi)
            if client_ns is not None:
                from gpuhook import _native

                _native.setns(client_ns, _native.CLONE_NEWNS)
        finally:  # the state is read whatever failed: the client sends it before it reads the answer
            if request.later:
                request.state = protocol.read_late_state(conn)
        taker()  # all of run_hook may change the container: GO first
        run_hook(cdi, request.state, ldconfig_fd=fd)

    try:
        return outcome(work)
    finally:
        if fd >= 0:
            os.close(fd)
        if client_ns is not None:
            with contextlib.suppress(OSError):
                os.close(client_ns)


@contextlib.contextmanager
def client_env(entries: list[str]) -> Iterator[None]:
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
