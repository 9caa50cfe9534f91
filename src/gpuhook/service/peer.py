"""Who is on the other end of a connection, pinned before a byte of it is read.

The service runs as root and acts in the namespaces of whoever asks, so it must know that process for sure:
- the kernel's SO_PEERPIDFD (Linux >= 6.5) gives a pidfd of the process that connected, which cannot come to
  name another process; older kernels give SO_PEERCRED's pid, opened at once with pidfd_open;
- /proc/<pid> is opened as a directory while that pidfd says the process still runs, and its status and
  namespaces are read through that descriptor; a process that is gone by then (one that connected and exited,
  leaving its socket to another: the "exit trick") is refused, never taken for the service's own namespace;
- only a process with CAP_SYS_ADMIN in the service's own user namespace is served: what the service does for it
  (mounts, nodes, a device cgroup) it could do itself. Everyone else (a process of a user-namespaced or rootless
  container, a container stripped of its capabilities, any uid but 0) is answered DECLINED and runs the call with
  its own rights, in-process.

A Peer keeps the /proc/<pid> descriptor and, when it is not ours, its mount namespace: the service's child joins
that namespace and nothing else.
"""

from __future__ import annotations

import os
import select
import socket

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # asm-generic/socket.h (x86, arm64); Python < 3.13 lacks it
CAP_SYS_ADMIN = 21
_STATUS_MAX = 1 << 14  # /proc/<pid>/status is ~1.5 KB


class Refused(Exception):  # noqa: N818 - a verdict, not a failure of the service
    """The peer cannot be pinned or may not be served: the reason, for the service's own log."""


class Peer:
    """A pinned peer: its pid and parent as this service sees them, uid, its /proc/<pid> directory descriptor,
    and its mount namespace's descriptor when that is not the service's own (else None)."""

    __slots__ = ("pid", "ppid", "uid", "proc_fd", "mnt_ns")

    def __init__(self, pid: int, ppid: int, uid: int, proc_fd: int, mnt_ns: int | None) -> None:
        self.pid, self.ppid, self.uid, self.proc_fd, self.mnt_ns = pid, ppid, uid, proc_fd, mnt_ns

    def take_mnt_ns(self) -> int | None:
        """The mount namespace descriptor, now the caller's to close (None: the service's own)."""
        fd, self.mnt_ns = self.mnt_ns, None
        return fd

    def close(self) -> None:
        for fd in (self.proc_fd, self.mnt_ns):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.proc_fd, self.mnt_ns = -1, None


def identity(path: str, dir_fd: int | None = None) -> tuple[int, int]:
    """What names the file at `path` (a namespace, a folder): its device and inode."""
    st = os.stat(path, dir_fd=dir_fd)
    return st.st_dev, st.st_ino


_OURS: dict[str, tuple[int, int]] = {}


def _our_ns(kind: str) -> tuple[int, int]:
    """This process's namespace of `kind` (it never changes: the service never calls setns itself)."""
    if kind not in _OURS:
        _OURS[kind] = identity(f"/proc/self/ns/{kind}")
    return _OURS[kind]


def _peer_pidfd(conn: socket.socket) -> int:
    """A pidfd of the connecting process: SO_PEERPIDFD, else pidfd_open of SO_PEERCRED's pid."""
    try:
        return int.from_bytes(conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4), "little", signed=True)
    except OSError:
        pass
    pid = int.from_bytes(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[:4], "little", signed=True)
    if pid <= 0:
        raise Refused("the peer is in a PID namespace this service cannot see")
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        raise Refused(f"peer pid {pid} is gone ({exc.strerror})") from None


def _pidfd_pid(pidfd: int) -> int:
    """The pid a pidfd names in this PID namespace: -1 once it exited, 0 outside what this namespace sees."""
    with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
        for line in f.read(4096).splitlines():
            if line.startswith(b"Pid:"):
                return int(line.split()[1])
    raise Refused("this kernel's pidfd shows no pid")


def _exited(pidfd: int) -> bool:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _status(proc_fd: int) -> dict[bytes, bytes]:
    fd = os.open("status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
    try:
        text = os.read(fd, _STATUS_MAX)
    finally:
        os.close(fd)
    return dict(line.split(b":\t", 1) for line in text.splitlines() if b":\t" in line)


def pin(conn: socket.socket) -> Peer:
    """The peer of `conn`, pinned and vetted (module docstring); Refused with the reason otherwise."""
    try:
        pidfd = _peer_pidfd(conn)
    except OSError as exc:
        raise Refused(f"the peer cannot be pinned ({exc.strerror})") from None
    proc_fd = mnt_ns = -1
    try:
        pid = _pidfd_pid(pidfd)
        if pid < 0:
            raise Refused("the peer exited before it was pinned")
        if pid == 0:
            raise Refused("the peer is in a PID namespace this service cannot see")
        proc_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        status = _status(proc_fd)
        uid = int(status.get(b"Uid", b"-1").split()[0])
        ppid = int(status.get(b"PPid", b"0").strip() or 0)
        if identity("ns/user", proc_fd) != _our_ns("user"):
            raise Refused(f"peer pid {pid} (uid {uid}) is in another user namespace")
        if not int(status.get(b"CapEff", b"0").strip() or b"0", 16) >> CAP_SYS_ADMIN & 1:
            raise Refused(f"peer pid {pid} (uid {uid}) lacks CAP_SYS_ADMIN")
        mnt_ns = os.open("ns/mnt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
        if _exited(pidfd):  # all of the above was read while the pidfd's process ran: its /proc/<pid> is its own
            raise Refused(f"peer pid {pid} exited while it was pinned")
        st = os.fstat(mnt_ns)
        if (st.st_dev, st.st_ino) == _our_ns("mnt"):
            os.close(mnt_ns)
            mnt_ns = -1
        return Peer(pid, ppid, uid, proc_fd, None if mnt_ns < 0 else mnt_ns)
    except (OSError, ValueError, IndexError) as exc:
        for fd in (proc_fd, mnt_ns):
            if fd >= 0:
                os.close(fd)
        raise Refused(f"the peer cannot be pinned ({getattr(exc, 'strerror', None) or exc})") from None
    except Refused:
        for fd in (proc_fd, mnt_ns):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(pidfd)
