"""Who runs a start (a part of server.Service): the parent itself up to the plan, a warm worker or a child forked
for it from the first change on, a child for a console-script command; or nobody here (DECLINED: the client runs it).

A prestart start of a runtime in the service's mount namespace is decided in the parent (hook/prestart.run up to its
before_inject: it only reads, and is bounded) and injected by a worker or a child; an answer the parent makes
itself (no GPU request, a refused one) is held until its client's GO (admission.py). A CDI hook goes whole to a
worker or child, which runs it in its container's mount namespace (calls.cdi_call). A prestart call from a runtime
in another mount namespace is DECLINED: its start needs that client's config, driver files, NVML and libcuda, so
its client runs it in-process, as itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from gpuhook.errors import render
from gpuhook.hook import prestart
from gpuhook.service import calls, protocol
from gpuhook.service.peer import Peer, Refused, pin

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

    from gpuhook.hook.config import Config
    from gpuhook.hook.plan import Decided, Planned
    from gpuhook.inject.containerhooks import HookArgs
    from gpuhook.model.request import Request
    from gpuhook.service.server import Command


class _Forked(BaseException):  # noqa: N818 - not an error: the parent's word that a child took the start over
    """Raised in the parent right after the fork for an injection; handle() lets it through unlogged."""


class Declined(BaseException):  # noqa: N818 - not an error: the service is at its bound
    """Raised where no child can be had for a start (MAX_CHILDREN): the client is answered DECLINED."""


def _back_to(ns_fd: int) -> None:
    """A child forked for one start, back in the service's mount namespace (to write its log line there)."""
    from gpuhook import _native

    _native.setns(ns_fd, _native.CLONE_NEWNS)
    os.close(ns_fd)


class Dispatch:
    """The Service's dispatch of a whole request (its other parts: server.py)."""

    commands: dict[str, Command]
    load: Callable[[str | None], Config]
    plan: Callable[[Config, Request], Planned]
    _hand_over: Callable[..., bool]
    _fork: Callable[..., int]
    _hold: Callable[[socket.socket, int, int, str, calls.Held], None]
    _log_refusal: Callable[[str], None]

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
        except Declined:
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
