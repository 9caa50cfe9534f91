"""Rebuild a container's ld cache with the host's ldconfig, never the image's binaries or environment.

The caller is already in the container's mount namespace. ldconfig runs in a forked child that first takes
a private copy of that namespace and hides the rootfs's /proc behind an empty tmpfs (so a hostile
/etc/ld.so.cache -> /proc/1/root/... link cannot reach the host), then execs the host binary by
descriptor with `-r <rootfs>` (it chroots itself after loading) and an empty environment.
"""

from __future__ import annotations

import os
import posixpath

from .. import _native
from ..errors import InjectionError
from .rootfs import RootFS

CONF_FILE = "/etc/ld.so.conf.d/00-gpuhook.conf"
TRUSTED_DIRS = frozenset({"/lib", "/usr/lib", "/lib64", "/usr/lib64"})


def _read_text(rootfs: RootFS, path: str) -> str:
    try:
        fd = rootfs.open(path, os.O_RDONLY)
    except InjectionError:
        return ""
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def configured_folders(rootfs: RootFS) -> set[str]:
    """Folders the image's ld.so.conf (one level of includes under /etc/ld.so.conf.d) already lists."""
    found = set(TRUSTED_DIRS)
    texts = [_read_text(rootfs, "/etc/ld.so.conf")]
    try:
        dfd = rootfs.open("/etc/ld.so.conf.d", os.O_RDONLY | os.O_DIRECTORY)
    except InjectionError:
        dfd = -1
    if dfd >= 0:
        try:
            names = sorted(n for n in os.listdir(dfd) if n.endswith(".conf"))
        finally:
            os.close(dfd)
        texts += [_read_text(rootfs, f"/etc/ld.so.conf.d/{n}") for n in names]
    for text in texts:
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("/"):
                found.add(posixpath.normpath(line))
    return found


def write_conf(rootfs: RootFS, folders: list[str]) -> None:
    """Register the folders the image does not know yet, so a later ldconfig in the container keeps them."""
    missing = [f for f in folders if posixpath.normpath(f) not in configured_folders(rootfs)]
    if missing:
        rootfs.write_file(CONF_FILE, ("".join(f"{f}\n" for f in missing)).encode())


def ldconfig_argv(rootfs_path: str, folders: list[str]) -> list[str]:
    return ["ldconfig", "-r", rootfs_path, "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *folders]


def _child(rootfs: RootFS, ldconfig_fd: int, argv: list[str], err_w: int) -> None:
    """Runs in the forked child: never returns."""
    try:
        _native.unshare(_native.CLONE_NEWNS)
        _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
        rootfs = RootFS(rootfs.path)  # a descriptor opened before unshare() is in the old namespace: mount() EINVAL
        if rootfs.exists("/proc"):
            pfd = rootfs.open("/proc", os.O_PATH | os.O_DIRECTORY)
            _native.mount("tmpfs", f"/proc/self/fd/{pfd}", "tmpfs", _native.MS_NOSUID | _native.MS_NODEV, "size=4k")
            os.close(pfd)
        os.dup2(err_w, 1)
        os.dup2(err_w, 2)
        os.execve(ldconfig_fd, argv, {})
    except BaseException as exc:  # noqa: BLE001 - report whatever stopped us, then die
        try:
            os.write(err_w, f"cannot run ldconfig: {exc}".encode())
        finally:
            os._exit(127)


def update_ldcache(rootfs: RootFS, folders: list[str], ldconfig_fd: int) -> None:
    """Write the conf entry and run the host ldconfig (opened as `ldconfig_fd`) over the rootfs."""
    rootfs.mkdirs("/etc")
    if folders:
        write_conf(rootfs, folders)
    argv = ldconfig_argv(rootfs.path, folders)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(rootfs, ldconfig_fd, argv, w)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        output = pipe.read(8192).decode(errors="replace").strip()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        last = output.splitlines()[-1] if output else f"exit status {code}"
        raise InjectionError(f"ldconfig failed in container: {last}")


def open_ldconfig(path: str) -> int:
    """The host's ldconfig by descriptor ('@/sbin/ldconfig' means the host path /sbin/ldconfig)."""
    path = path[1:] if path.startswith("@") else path
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InjectionError(f"cannot open ldconfig {path}: {exc.strerror}") from None
