"""The Python clients of `gpuhook service`: `gpuhook generate-cdi …` (the console script) and the shim's planning
of a create (`gpuhook-runtime`), answered from the service's warm modules and inventory in one round trip, or
None so the caller runs it in-process.

Lean on purpose: it runs before anything else of the console script, so it loads `_socket` and protocol.py
(`_json`, `_struct`), never `socket`, `json`, `re` or `enum` (about 20 ms of imports, more than the round trip).
What the service does is what the in-process command does (service/server.py hands it to the command's own
function); the service declines (protocol.DECLINED) whatever it cannot run exactly so: a client in another mount
namespace or with another interpreter, a command line only click can word, a --watch. A service that does not
say TAKING in time (protocol.py; stopped, stuck, flooded) is left: the command runs here, never twice.
"""

from __future__ import annotations

import os
import sys

from gpuhook.errors import GpuhookError
from gpuhook.model.contract import SERVICE_SOCKET, SERVICE_SOCKET_ENV
from gpuhook.service import protocol

ANSWER_TIMEOUT_S = 60.0  # once taken, a served command may discover (NVML, ELF reads) when the inventory changed


class ServiceFailed(GpuhookError):
    """The service took a request and did not answer it: one line, never run again in-process."""


def ask(argv: list[str]) -> tuple[int, str, bytes] | None:
    """`gpuhook ARGV` asked of the service: (exit status, stderr, stdout); None when no service takes the connection
    (none runs, the socket is not ours to open) or it declined. ServiceFailed when it took the request and then
    failed: the caller must not run it again here (it may have written its files)."""
    import _socket

    path = os.environ.get(SERVICE_SOCKET_ENV) or SERVICE_SOCKET
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    wait = protocol.taking_wait_s(os.environ)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(wait)  # a full backlog, a stopped or stuck service: the command runs here
        try:
            sock.connect(path)
            sock.sendall(protocol.encode_request(argv, b"", cwd=cwd, exe=sys.executable,
                                                 env=protocol.served_env(os.environ)))
            first = _first_frame(sock)
        except OSError:
            return None
        if first is None:
            return None
        try:
            sock.settimeout(ANSWER_TIMEOUT_S)
            if first == protocol.encode_taking():
                sock.sendall(protocol.GO)  # from here on the service owns the command: never run again here
                first = b""
            code, err, out = protocol.recv_answer(sock, with_output=True, prefix=first)
        except (OSError, protocol.ProtocolError) as exc:
            from gpuhook.errors import render

            raise ServiceFailed(f"service {path}: {render(exc)}") from None
    finally:
        sock.close()
    return None if code == protocol.DECLINED else (code, err, out)


def _first_frame(sock: object) -> bytes | None:
    """The first 8 bytes of the service's answer (TAKING, or an answer's start) within the socket's timeout;
    None when they do not come whole (the service closed, or kept silent): nothing was done for the request."""
    first = b""
    while len(first) < 8:
        chunk = sock.recv(8 - len(first))  # type: ignore[attr-defined]
        if not chunk:
            return None
        first += chunk
    return first


def forward(argv: list[str]) -> int | None:
    """`gpuhook ARGV` through the service (ask): its stdout and stderr written here and its exit status returned;
    None when it must run in-process. A service that took the request and then failed is one `gpuhook: service …`
    line and exit 1."""
    try:
        answer = ask(argv)
    except ServiceFailed as exc:
        print(f"gpuhook: {exc}", file=sys.stderr)
        return 1
    if answer is None:
        return None
    code, err, out = answer
    if out:
        sys.stdout.buffer.write(out)
        sys.stdout.flush()
    if err:
        sys.stderr.write(err)
        sys.stderr.flush()
    return code
