"""Which connections the service reads, and the answers its parent holds until their client says GO.

Every connection's peer is pinned before a byte is read (peer.pin) and served only with CAP_SYS_ADMIN in our user
namespace; anyone else, and anyone over the bounds (MAX_PENDING in all, MAX_PENDING_PER_PEER), is answered
DECLINED and runs the call in-process. Requests are read as their bytes come (protocol.Incoming), each with its
deadline (protocol.REQUEST_TIMEOUT_S): a slow or idle client delays nobody.

An answer the parent made itself (a container without a GPU request, a refused one) carries a log line, so it
is held: the parent sends TAKING and waits, in its loop (never blocking it), for the client's GO, then writes
the line and answers; a client that gave up meanwhile (it ran the start itself and logged it) closes or says
nothing within calls.GO_WAIT_S, and the held answer is dropped. So each start has one line, whatever the timing.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time

from gpuhook.errors import clip, render
from gpuhook.service import calls, protocol
from gpuhook.service.peer import Peer, Refused, pin

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

MAX_PENDING = 4096  # connections whose request is still coming, or whose held answer waits for GO; then DECLINED
MAX_PENDING_PER_PEER = 32  # the same, from one pinned process
MAX_ACCEPTS = 64  # connections accepted per turn of the loop, so that reading the ones accepted keeps up
REFUSAL_LOG_S = 1.0  # at most one line a second about refused peers (a flood must not flood the journal)


class _Pending:
    """A connection whose request is still coming: its pinned peer, what came so far, when it must be whole."""

    __slots__ = ("conn", "peer", "incoming", "start", "deadline")

    def __init__(self, conn: socket.socket, peer: Peer, start: float) -> None:
        self.conn, self.peer, self.start = conn, peer, start
        self.incoming = protocol.Incoming()
        self.deadline = start + protocol.REQUEST_TIMEOUT_S


class _Held:
    """An answer made in the parent, sent once its client says GO to our TAKING, with its log lines."""

    __slots__ = ("conn", "pid", "code", "line", "held", "deadline")

    def __init__(self, conn: socket.socket, pid: int, code: int, line: str, held: calls.Held) -> None:
        self.conn, self.pid, self.code, self.line, self.held = conn, pid, code, line, held
        self.deadline = time.monotonic() + calls.GO_WAIT_S


class Admission:
    """The Service's connections up to dispatch, and its held answers (a part of server.Service)."""

    listener: socket.socket | None
    _epoll: select.epoll | None
    dispatch: Callable[[socket.socket, Peer, protocol.Request, float], None]  # server.Service's

    def _init_admission(self) -> None:
        self.pending: dict[int, _Pending] = {}  # fd -> a connection whose request is still coming
        self.holding: dict[int, _Held] = {}  # fd -> an answer held until its client's GO
        self.per_peer: dict[int, int] = {}  # pinned pid -> its pending and held connections
        self._refused_at, self._refused_quiet = 0.0, 0  # the last refusal line, and refusals not worded since

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

    def _over_bounds(self, pid: int) -> bool:
        return len(self.pending) + len(self.holding) >= MAX_PENDING or self.per_peer.get(pid, 0) >= \
            MAX_PENDING_PER_PEER

    def _count(self, pid: int, by: int) -> None:
        left = self.per_peer.get(pid, 0) + by
        if left > 0:
            self.per_peer[pid] = left
        else:
            self.per_peer.pop(pid, None)

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
        if self._over_bounds(peer.pid):
            self._log_refusal(f"peer pid {peer.pid}: over the bound of connections whose request is still coming")
            peer.close()
            self._decline(conn)
            return
        conn.setblocking(False)
        self.pending[conn.fileno()] = _Pending(conn, peer, start)
        self._count(peer.pid, 1)
        assert self._epoll is not None
        self._epoll.register(conn.fileno(), select.EPOLLIN)
        self._readable(conn.fileno())  # the native entry sends its request at once: most often it is all there

    def _readable(self, fd: int) -> None:
        """Read what `fd`'s client sent; a whole request is dispatched, a bad one answered in one line; a held
        answer's GO (or the client's end) is taken."""
        if fd in self.holding:
            self._go_or_gone(fd)
            return
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
        if _polled(pending.conn, select.POLLRDHUP | select.POLLHUP):  # its client gave up waiting (a service
            # that was stopped): it runs the call itself, and nothing here may add a second log line for that start
            if request.pid_fd is not None:
                os.close(request.pid_fd)
            self._finish(pending)
            return
        pending.conn.setblocking(True)
        try:
            self.dispatch(pending.conn, pending.peer, request, pending.start)
        finally:
            self._finish(pending)

    def _hold(self, conn: socket.socket, pid: int, code: int, line: str, held: calls.Held) -> None:
        """Send TAKING for an answer made here, and keep it (and its log lines) until the client's GO. Outside
        the loop (serve_one) the GO is waited for here."""
        if self._epoll is None:
            with contextlib.suppress(calls.NotTaken):
                calls.take(conn)
                held.write()
                calls.answer(conn, code, line)
            return
        try:
            conn.setblocking(False)
            if conn.send(protocol.encode_taking()) != len(protocol.encode_taking()):
                return
        except OSError:
            return
        kept = conn.dup()
        self.holding[kept.fileno()] = _Held(kept, pid, code, line, held)
        self._count(pid, 1)
        self._epoll.register(kept.fileno(), select.EPOLLIN)

    def _go_or_gone(self, fd: int) -> None:
        """A held answer's client wrote, or closed: GO writes the log line and sends the answer; anything else
        drops both (the client runs the start itself)."""
        held = self._drop_held(fd)
        try:
            said = held.conn.recv(1)
        except OSError:
            said = b""
        if said == protocol.GO:
            held.held.write()
            held.conn.setblocking(True)
            calls.answer(held.conn, held.code, held.line)
        held.conn.close()

    def _drop_held(self, fd: int) -> _Held:
        held = self.holding.pop(fd)
        self._count(held.pid, -1)
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        return held

    def _expire(self) -> None:
        """DECLINED, then closed, for every connection whose request did not come whole in time: what it sent is
        read first (a busy loop may simply not have got to it), and nothing was done for it, so its client runs
        the call itself; a slow client never fails a start, nor holds a place. A held answer whose GO did not
        come in time is dropped unsaid."""
        now = time.monotonic()
        for fd in [fd for fd, p in self.pending.items() if p.deadline <= now]:
            self._readable(fd)
            pending = self.pending.get(fd)
            if pending is not None:
                self._drop_pending(fd)
                self._decline(pending.conn, pending.peer)
        for fd in [fd for fd, h in self.holding.items() if h.deadline <= now]:
            if _polled(self.holding[fd].conn, select.POLLIN):  # its GO came: a busy loop had not got to it yet
                self._go_or_gone(fd)
            else:
                self._drop_held(fd).conn.close()

    def _next_deadline(self) -> float | None:
        """The earliest deadline of a pending request or a held answer (None: there is none)."""
        deadlines = [p.deadline for p in self.pending.values()] + [h.deadline for h in self.holding.values()]
        return min(deadlines) if deadlines else None

    def _drop_pending(self, fd: int) -> _Pending:
        pending = self.pending.pop(fd)
        self._count(pending.peer.pid, -1)
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        return pending

    def _close_connections(self) -> None:
        """Every connection still coming, and every held answer, closed (the loop's end; a child's start)."""
        for pending in self.pending.values():
            pending.conn.close()
            pending.peer.close()
        for held in self.holding.values():
            held.conn.close()
        self.pending.clear()
        self.holding.clear()
        self.per_peer.clear()

    def _finish(self, pending: _Pending, code: int | None = None, line: str = "") -> None:
        """Close a connection taken off the loop (answered first when `code` is given) and its peer's descriptors."""
        if code is not None:
            with contextlib.suppress(OSError):
                pending.conn.setblocking(True)
            calls.answer(pending.conn, code, line)
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


def _polled(conn: socket.socket, events: int) -> bool:
    """Whether `conn` has `events` now (POLLRDHUP: its client sent its request and gave up on the answer;
    POLLIN: it wrote)."""
    poller = select.poll()
    poller.register(conn.fileno(), events)
    return bool(poller.poll(0))
