"""Where the service listens: the socket systemd hands over, or one it publishes itself only once it listens.

The socket is 0600 in a 0700 directory owned by root, or handed over by systemd (LISTEN_FDS, fd 3); every client
finds it by one rule (socket_path), the native entry too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

from gpuhook.model.contract import SERVICE_SOCKET, SERVICE_SOCKET_ENV
from gpuhook.service.calls import ServiceError


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


def private_folder(folder: str) -> None:
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
    private_folder(os.path.dirname(path))
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
