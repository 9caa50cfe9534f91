"""The Python clients of `gpuhook service`: `gpuhook generate-cdi …` (the console script) and the shim's planning
of a create (`gpuhook-runtime`), answered from the service's warm modules and inventory in one round trip
(issue 21), or None so the caller runs it in-process.

Lean on purpose: it runs before anything else of the console script, so it loads `_socket` and protocol.py
(`_json`, `_struct`), never `socket`, `json`, `re` or `enum` (about 20 ms of imports, more than the round trip).
What the service does is what the in-process command does (service/server.py hands it to the command's own
function); the service declines (protocol.DECLINED) whatever it cannot run exactly so: a client in another mount
namespace or with another interpreter, a command line only click can word, a --watch.
"""

from __future__ import annotations

import os
import sys

from gpuhook.errors import GpuhookError
from gpuhook.model.contract import SERVICE_SOCKET, SERVICE_SOCKET_ENV
from gpuhook.service import protocol

CONNECT_TIMEOUT_S = 1.0  # a full backlog: give up and run in-process
ANSWER_TIMEOUT_S = 60.0  # a served command may discover (NVML, ELF reads) when the inventory changed


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
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(path)
        except OSError:
            return None
        sock.settimeout(ANSWER_TIMEOUT_S)
        try:
            sock.sendall(protocol.encode_request(argv, b"", cwd=cwd, exe=sys.executable,
                                                 env=protocol.served_env(os.environ)))
            code, err, out = protocol.recv_answer(sock, with_output=True)
        except (OSError, protocol.ProtocolError) as exc:
            from gpuhook.errors import render

            raise ServiceFailed(f"service {path}: {render(exc)}") from None
    finally:
        sock.close()
    return None if code == protocol.DECLINED else (code, err, out)


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
