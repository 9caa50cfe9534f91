"""Is `gpuhook service` there for the hook entry: does it answer, at which socket, and would the installed entry
reach it (the entry and the service follow one rule: $GPUHOOK_SERVICE_SOCKET, else /run/gpuhook/service.sock)."""

from __future__ import annotations

import os
import socket

from gpuhook.doctor.model import INFO, OK, PROBLEM, WARN, Finding
from gpuhook.model.contract import SERVICE_SOCKET, SERVICE_SOCKET_ENV
from gpuhook.service import protocol

ASK_TIMEOUT_S = 2.0


def _f(status: str, message: str, fix: str = "") -> Finding:
    return Finding("service", status, message, fix)


def ping(path: str, timeout: float = ASK_TIMEOUT_S) -> tuple[str, str]:
    """("answers", its line) / ("declined", "") / ("absent", why) / ("silent", why) for the service at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        try:
            conn.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            return "absent", exc.strerror or str(exc)
        except OSError as exc:
            return "silent", exc.strerror or str(exc)
        try:
            protocol.send_request(conn, [protocol.PING], b"")
            code, line, _ = protocol.recv_answer(conn, go=False)
        except (OSError, protocol.ProtocolError) as exc:
            return "silent", str(exc) or type(exc).__name__
    if code == protocol.DECLINED:
        return "declined", ""
    return ("answers", line) if code == 0 else ("silent", f"answered {code}")


def _running_elsewhere(path: str) -> list[tuple[int, str]]:
    """(pid, socket) of each running `gpuhook service` whose socket is not `path` (from its environment)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            argv = proc.info["cmdline"] or []
            if "service" not in argv[1:3] or not any(os.path.basename(a).startswith("gpuhook") for a in argv[:2]):
                continue
            theirs = (proc.info["environ"] or {}).get(SERVICE_SOCKET_ENV) or SERVICE_SOCKET
        except (psutil.Error, TypeError):
            continue
        if os.path.abspath(theirs) != os.path.abspath(path):
            found.append((proc.pid, theirs))
    return found


def check_service() -> list[Finding]:
    """Where the entry looks, whether a service answers there, and a service listening elsewhere."""
    path = os.environ.get(SERVICE_SOCKET_ENV) or SERVICE_SOCKET
    where = f"{path} (${SERVICE_SOCKET_ENV})" if os.environ.get(SERVICE_SOCKET_ENV) else path
    state, said = ping(path)
    out: list[Finding] = []
    if state == "answers":
        out.append(_f(OK, f"{said} answers at {where}: the native hook entry's starts go through it"))
    elif state == "declined":
        out.append(_f(INFO, f"a gpuhook service listens at {where}; it serves only root with CAP_SYS_ADMIN, "
                            "so it declined this doctor (run doctor as root to ask it)"))
    elif state == "absent":
        out.append(_f(INFO, f"no gpuhook service at {where} ({said}): every start runs the hook in-process "
                            "(about 25 ms more a GPU start)", "systemctl enable --now gpuhook.socket"))
    else:
        out.append(_f(PROBLEM, f"the gpuhook service at {where} does not answer ({said}): every start waits "
                               f"{protocol.TAKING_WAIT_MS} ms for it, then runs in-process",
                      "systemctl restart gpuhook.service"))
    for pid, theirs in (_running_elsewhere(path) if state != "answers" else []):
        out.append(_f(WARN, f"gpuhook service pid {pid} listens at {theirs}, but the hook entry looks at {where}: "
                            "it serves no start", f"set {SERVICE_SOCKET_ENV}={theirs} in the hook's environment "
                                                  "too, or start the service without it"))
    return out
