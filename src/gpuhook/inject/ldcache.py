"""Rebuild a container's ld cache with the host's ldconfig, never the image's binaries or environment.

The caller is already in the container's mount namespace. ldconfig runs in a forked child that first takes
a private copy of that namespace, remounts everything in the rootfs `nodev` (ldconfig runs outside the
container's device cgroup: an image's device node, reached as a library or a config file, would be the
host's device) and hides the rootfs's /proc behind an empty tmpfs (so a hostile /etc/ld.so.cache ->
/proc/1/root/... link cannot reach the host), then execs the host binary by descriptor with `-r <rootfs>`
(it chroots itself after loading), an empty environment and an alarm (a FIFO in the image would block it).
The files ldconfig is known to open (ld.so.conf, ld.so.conf.d/*.conf, ld.so.cache~) must be regular files.
"""

from __future__ import annotations

import os
import posixpath
import re
import signal
import stat

from gpuhook import _native
from gpuhook.errors import InjectionError
from gpuhook.inject.rootfs import RootFS

CONF_FILE = "/etc/ld.so.conf.d/00-gpuhook.conf"
TRUSTED_DIRS = frozenset({"/lib", "/usr/lib", "/lib64", "/usr/lib64"})
LDCONFIG_TIMEOUT_S = 20
# Per-mount flags a bind remount must restate to keep them (statvfs ST_* bits equal the MS_* ones).
_KEPT_FLAGS = (_native.MS_RDONLY | _native.MS_NOSUID | _native.MS_NODEV | _native.MS_NOEXEC | _native.MS_NOATIME
               | _native.MS_RELATIME | 2048)  # 2048: MS_NODIRATIME


def _read_text(rootfs: RootFS, path: str) -> str:
    """A config file's text ("" when missing); InjectionError when something else than a file stands there."""
    data = rootfs.read_file(path, 1 << 16)
    return "" if data is None else data.decode(errors="replace")


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


def write_conf(rootfs: RootFS, folders: list[str], known: set[str] | None = None) -> None:
    """Register the folders the image does not know yet, so a later ldconfig in the container keeps them."""
    known = configured_folders(rootfs) if known is None else known
    missing = [f for f in folders if posixpath.normpath(f) not in known]
    if missing:
        rootfs.write_file(CONF_FILE, ("".join(f"{f}\n" for f in missing)).encode())


def ldconfig_argv(rootfs_path: str, folders: list[str]) -> list[str]:
    return ["ldconfig", "-r", rootfs_path, "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *folders]


def _check_cache_tmp(rootfs: RootFS) -> None:
    """ldconfig writes its cache to /etc/ld.so.cache~ (O_CREAT|O_TRUNC|O_NOFOLLOW): that must not be a
    FIFO (a hang) or a device node (the cache written onto a host device)."""
    pfd = rootfs.open("/etc")
    try:
        st = os.stat("ld.so.cache~", dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    finally:
        os.close(pfd)
    if not stat.S_ISREG(st.st_mode):
        raise InjectionError("/etc/ld.so.cache~ in container: not a regular file")


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _remount_nodev(root_path: str) -> None:
    """In the child's private namespace, add nodev to the rootfs mount and every mount below it."""
    prefix = root_path.rstrip("/") + "/"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = [_unescape(line.split()[4]) for line in f]
    for point in points:
        if point == root_path or point.startswith(prefix):
            kept = os.statvfs(point).f_flag & _KEPT_FLAGS
            _native.mount(None, point, None, _native.MS_REMOUNT | _native.MS_BIND | _native.MS_NODEV | kept, None)


def _child(rootfs: RootFS, ldconfig_fd: int, argv: list[str], err_w: int) -> None:
    """Runs in the forked child: never returns."""
    try:
        _native.unshare(_native.CLONE_NEWNS)
        _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
        _remount_nodev(rootfs.path)
        rootfs = RootFS(rootfs.path)  # a descriptor opened before unshare() is in the old namespace: mount() EINVAL
        if rootfs.exists("/proc"):
            pfd = rootfs.open("/proc", os.O_PATH | os.O_DIRECTORY)
            _native.mount("tmpfs", f"/proc/self/fd/{pfd}", "tmpfs", _native.MS_NOSUID | _native.MS_NODEV, "size=4k")
            os.close(pfd)
        os.dup2(err_w, 1)
        os.dup2(err_w, 2)
        signal.alarm(LDCONFIG_TIMEOUT_S)  # survives execve; SIGALRM's default action ends ldconfig
        os.execve(ldconfig_fd, argv, {})
    except BaseException as exc:  # noqa: BLE001 - report whatever stopped us, then die
        try:
            os.write(err_w, f"cannot run ldconfig: {exc}".encode())
        finally:
            os._exit(127)


def update_ldcache(rootfs: RootFS, folders: list[str], ldconfig_fd: int) -> None:
    """Write the conf entry and run the host ldconfig (opened as `ldconfig_fd`) over the rootfs."""
    os.close(rootfs.mkdirs("/etc"))
    known = configured_folders(rootfs)  # also refuses special files where ldconfig reads its configuration
    _check_cache_tmp(rootfs)
    if folders:
        write_conf(rootfs, folders, known)
    argv = ldconfig_argv(rootfs.path, folders)
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _native.die_with_parent(parent)
        _child(rootfs, ldconfig_fd, argv, w)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        output = pipe.read(8192).decode(errors="replace").strip()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == -signal.SIGALRM:
        raise InjectionError(f"ldconfig did not finish in {LDCONFIG_TIMEOUT_S}s in container (a FIFO in the image?)")
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
