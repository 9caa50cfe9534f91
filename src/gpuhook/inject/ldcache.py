"""Rebuild a container's ld cache with the host's ldconfig, never the image's binaries or environment.

The caller is already in the container's mount namespace. A process that exists for that container alone
(disposable), or else a child forked for the purpose, takes a private copy of that namespace, makes everything
in the rootfs `nodev` (ldconfig runs outside the container's device cgroup: an image's device node, reached as
a library or a config file, would be the host's device) and hides every procfs in the rootfs behind an empty
tmpfs (so a hostile /etc/ld.so.cache -> /proc/1/root/... link cannot reach the host: magic links ignore a
chroot); a disposable caller then goes back to its namespace while ldconfig runs (running()). ldconfig's own
process (spawn_confined) makes the rootfs its root (chroot + chdir "/") and only then execs the host binary,
by descriptor, without `-r`, with an empty environment and an alarm (a FIFO in the image would block it).
From its first system call ldconfig sees nothing but the container's filesystem: `ldconfig -r ROOT DIR`
(glibc 2.36) opened DIR/glibc-hwcaps as a host path before chrooting itself, so an image's glibc-hwcaps link
reached and listed a host directory. Running in the container's root requires a static ldconfig (a dynamic
one would load the image's ld.so and libc): anything else is refused. The files ldconfig is known to open
(ld.so.conf, ld.so.conf.d/*.conf, ld.so.cache~) must be regular files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import signal
import stat
import struct
from collections.abc import Iterator

from gpuhook import _native
from gpuhook.errors import GpuhookError, InjectionError, clip, render
from gpuhook.inject.mountinfo import Mount, read_mounts
from gpuhook.inject.rootfs import RootFS, shown
from gpuhook.model.contract import LD_CONF_FILE

CONF_FILE = LD_CONF_FILE
TRUSTED_DIRS = frozenset({"/lib", "/usr/lib", "/lib64", "/usr/lib64"})
LDCONFIG_TIMEOUT_S = 20
# Per-mount flags a bind remount must restate to keep them (statvfs ST_* bits equal the MS_* ones).
_KEPT_FLAGS = (_native.MS_RDONLY | _native.MS_NOSUID | _native.MS_NODEV | _native.MS_NOEXEC | _native.MS_NOATIME
               | _native.MS_RELATIME | 2048)  # 2048: MS_NODIRATIME


# What gpuhook reads of an image's ld.so configuration (on the host's side, at every start): bounded in files,
# bytes and include depth, so that 30,000 hard links to one 64 KiB file cost what 256 files do. Beyond a bound
# reading stops: the result only spares writing a folder the image already lists (a duplicate is harmless),
# and ldconfig itself runs confined, nodev and under an alarm.
MAX_CONF_FILES = 256
MAX_CONF_BYTES = 1 << 16  # per file
MAX_CONF_TOTAL = 1 << 20  # all files together
MAX_INCLUDE_DEPTH = 4
MAX_FOLDERS = 4096
_GLOB = frozenset("*?[")


class _Budget:
    """Files and bytes left to read of the image's ld.so configuration."""

    def __init__(self) -> None:
        self.files, self.bytes = MAX_CONF_FILES, MAX_CONF_TOTAL
        self.seen: set[str] = set()  # at most MAX_CONF_FILES paths: each file is read once

    def take(self, path: str) -> int:
        """Bytes file `path` may have (0: already read, or stop reading)."""
        if self.files <= 0 or self.bytes <= 0 or path in self.seen:
            return 0
        self.files -= 1
        self.seen.add(path)
        return min(MAX_CONF_BYTES, self.bytes)


def _matches(rootfs: RootFS, pattern: str, budget: _Budget) -> list[str]:
    """Container paths an `include` pattern names: a glob in its last component only (what images use:
    `include /etc/ld.so.conf.d/*.conf`), the folder resolved inside the rootfs; at most the budget's files."""
    import fnmatch

    folder, _, glob = pattern.rpartition("/")
    folder = folder or "/"
    if any(c in _GLOB for c in folder):
        return []
    if not any(c in _GLOB for c in glob):
        return [posixpath.join(folder, glob)]
    try:
        dfd = rootfs.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except InjectionError:
        return []
    out: list[str] = []
    try:
        with os.scandir(dfd) as entries:  # streamed, never sorted: only membership matters
            for entry in entries:
                if len(out) >= budget.files:
                    break
                if fnmatch.fnmatchcase(entry.name, glob):
                    out.append(posixpath.join(folder, entry.name))
    except OSError as exc:
        raise InjectionError(f"cannot list {shown(folder)} in container: {exc.strerror}") from None
    finally:
        os.close(dfd)
    return out


def _read_conf(rootfs: RootFS, path: str, depth: int, budget: _Budget, found: set[str]) -> None:
    """Add the folders `path` lists (and, `depth` levels deep, those of the files it includes) to `found`.
    A missing file adds nothing; something else than a regular file is refused (InjectionError)."""
    limit = budget.take(posixpath.normpath(path))
    if limit == 0:
        return
    # One rule on every door: what cannot be resolved (a link loop, a /proc/self/root link, mounted at
    # createContainer and not at prestart) is no configuration, as ldconfig, with every procfs hidden, sees it.
    data = rootfs.read_file(path, limit, loop_is_missing=True)
    if data is None:
        return
    budget.bytes -= len(data)
    base = posixpath.dirname(path)
    for raw in data.decode(errors="replace").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("/") and len(found) < MAX_FOLDERS:
            found.add(posixpath.normpath(line))
        elif line.startswith("include") and line[7:8].isspace() and depth > 0:
            for pattern in line[8:].split():
                for match in _matches(rootfs, posixpath.join(base, pattern), budget):
                    _read_conf(rootfs, match, depth - 1, budget, found)


def configured_folders(rootfs: RootFS) -> set[str]:
    """Folders the image's ld.so.conf already lists: its lines, the files its `include` lines name (up to
    MAX_INCLUDE_DEPTH deep), and /etc/ld.so.conf.d/*.conf (where gpuhook writes its own entry) in any case;
    read within MAX_CONF_FILES, MAX_CONF_BYTES each and MAX_CONF_TOTAL, in constant memory."""
    found = set(TRUSTED_DIRS)
    budget = _Budget()
    _read_conf(rootfs, "/etc/ld.so.conf", MAX_INCLUDE_DEPTH, budget, found)
    for match in _matches(rootfs, "/etc/ld.so.conf.d/*.conf", budget):
        _read_conf(rootfs, match, MAX_INCLUDE_DEPTH - 1, budget, found)
    return found


def write_conf(rootfs: RootFS, folders: list[str], known: set[str] | None = None) -> None:
    """Register the folders the image does not know yet, so a later ldconfig in the container keeps them."""
    known = configured_folders(rootfs) if known is None else known
    missing = [f for f in folders if posixpath.normpath(f) not in known]
    if missing:
        rootfs.write_file(CONF_FILE, ("".join(f"{f}\n" for f in missing)).encode())


def read_by_ldconfig(path: str) -> bool:
    """Whether ldconfig could take the file at `path` for a library: glibc's ldconfig looks only at names that
    start with `lib` or `ld-` and hold `.so`. A bind or link of any other name (a program, firmware, a
    configuration file, a socket, a /dev link) may be made while ldconfig runs (inject/apply.py): the cache is
    the same either way."""
    name = path.rpartition("/")[2]
    return name.startswith(("lib", "ld-")) and ".so" in name


def ldconfig_argv(folders: list[str]) -> list[str]:
    """ldconfig's command line once the child's root is the container's: every path is the container's."""
    return ["ldconfig", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *folders]


_PT_INTERP = 3


def check_static(fd: int, what: str = "ldconfig") -> None:
    """Refuse an executable that would need anything from the filesystem to start: ldconfig is exec'd after
    chroot into the container, where a PT_INTERP (a dynamic binary) or a `#!` line (a script) would name the
    image's loader or interpreter, run with the hook's privileges. A static (or static-pie) ELF is what
    glibc builds and distributions ship (Debian: /sbin/ldconfig, static-pie)."""
    try:
        head = os.pread(fd, 64, 0)
        if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            raise InjectionError(f"{what} is not an ELF executable: refusing to run it in the container's root")
        end = "<" if head[5] == 1 else ">"
        if head[4] == 2:  # ELFCLASS64
            e_type, phoff, phentsize, phnum = (struct.unpack_from(end + "H", head, 16)[0],
                                               struct.unpack_from(end + "Q", head, 32)[0],
                                               *struct.unpack_from(end + "HH", head, 54))
        else:
            e_type, phoff, phentsize, phnum = (struct.unpack_from(end + "H", head, 16)[0],
                                               struct.unpack_from(end + "I", head, 28)[0],
                                               *struct.unpack_from(end + "HH", head, 42))
        if e_type not in (2, 3) or phnum in (0, 0xFFFF) or phentsize < 4 or phnum * phentsize > 1 << 16:
            raise InjectionError(f"{what}: unusable ELF header")
        table = os.pread(fd, phnum * phentsize, phoff)
    except OSError as exc:
        raise InjectionError(f"cannot read {what}: {exc.strerror}") from None
    if len(table) < phnum * phentsize:
        raise InjectionError(f"{what}: truncated ELF program headers")
    for i in range(phnum):
        if struct.unpack_from(end + "I", table, i * phentsize)[0] == _PT_INTERP:
            raise InjectionError(f"{what} is dynamically linked: it runs chrooted in the container, where it "
                                 "would load the image's loader and libc; a statically linked ldconfig is needed")


def _check_cache_tmp(rootfs: RootFS) -> None:
    """ldconfig writes its cache to /etc/ld.so.cache~ (O_CREAT|O_TRUNC|O_NOFOLLOW): that must not be a
    FIFO (a hang) or a device node (the cache written onto a host device)."""
    pfd = rootfs.open("/etc")
    try:
        st = os.stat("ld.so.cache~", dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InjectionError(f"/etc/ld.so.cache~ in container: {exc.strerror}") from None
    finally:
        os.close(pfd)
    if not stat.S_ISREG(st.st_mode):
        raise InjectionError("/etc/ld.so.cache~ in container: not a regular file")


def _mounts_under(root_path: str, table: list[Mount]) -> list[tuple[str, str]]:
    """(mount point, fs type) of the rootfs mount and every mount below it in `table`, in mountinfo order.

    `root_path` is the rootfs as the kernel names it (no symlink, no trailing slash), as mountinfo does."""
    prefix = root_path.rstrip("/") + "/"
    return [(m.mountpoint, m.fstype) for m in table if m.mountpoint == root_path or m.mountpoint.startswith(prefix)]


def _restrict_tree(view: RootFS) -> bool:
    """mount_setattr(2) (Linux 5.12) over the whole rootfs tree at once: nodev and read-only on every mount, then
    the rootfs's own mount writable again unless it was read-only already. False (nothing done) where the kernel
    lacks the call or the rootfs is no mount of its own (a test's folder: the recursive call would reach the
    mount that holds it); _remount_nodev, mount by mount, then does the same."""
    if _native.is_mount_root(view.fd) is not True:
        return False
    top_ro = os.fstatvfs(view.fd).f_flag & os.ST_RDONLY
    flags = _native.AT_EMPTY_PATH | _native.AT_RECURSIVE
    try:
        _native.mount_setattr(view.fd, "", flags, _native.MOUNT_ATTR_RDONLY | _native.MOUNT_ATTR_NODEV)
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            return False
        raise
    if not top_ro:
        _native.mount_setattr(view.fd, "", _native.AT_EMPTY_PATH, 0, _native.MOUNT_ATTR_RDONLY)
    return True


def _remount_nodev(top: str, points: list[str]) -> None:
    """In the child's private namespace, add nodev to the rootfs mount (`top`) and every mount below it, and make
    every mount below it read-only: ldconfig writes its cache and soname links, and an image folder that links
    onto a volume (a host directory) must not receive them (only the rootfs's own mount stays writable)."""
    for point in points:
        kept = os.statvfs(point).f_flag & _KEPT_FLAGS
        wanted = kept | _native.MS_NODEV | (_native.MS_RDONLY if point != top else 0)
        if wanted == kept:  # already so (every driver file gpuhook binds is): nothing to change
            continue
        _native.mount(None, point, None, _native.MS_REMOUNT | _native.MS_BIND | wanted, None)


def _hide(rootfs: RootFS, path: str) -> None:
    """An empty tmpfs over directory `path` (resolved inside the rootfs), never over the rootfs itself (an image's
    `/proc -> /`): the child chroots through the rootfs's descriptor, under such a tmpfs, and would see procfs."""
    pfd = rootfs.open(path, os.O_PATH | os.O_DIRECTORY)
    try:
        st, top = os.fstat(pfd), os.fstat(rootfs.fd)
        if (st.st_dev, st.st_ino) == (top.st_dev, top.st_ino):
            raise InjectionError(f"{path} in container: leads to the container's root")
        _native.mount("tmpfs", f"/proc/self/fd/{pfd}", "tmpfs", _native.MS_NOSUID | _native.MS_NODEV, "size=4k")
    finally:
        os.close(pfd)


def _hide_procfs(rootfs: RootFS, top: str, mounts: list[tuple[str, str]]) -> None:
    """Cover the rootfs's /proc and any other procfs mounted in it (a runtime's `-v /proc:/host/proc`):
    /proc/<pid>/root and /proc/<pid>/cwd are magic links that leave a chroot."""
    hidden: list[str] = []
    if rootfs.exists("/proc"):
        _hide(rootfs, "/proc")
        hidden.append("/proc")
    for point, fstype in mounts:
        rel = point[len(top.rstrip("/")):] or "/"
        if fstype != "proc" or any(rel == h or rel.startswith(h.rstrip("/") + "/") for h in hidden):
            continue
        fd = rootfs.open(rel)
        try:
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        if is_dir:  # else a single procfs file bound somewhere: not a directory of magic links
            _hide(rootfs, rel)
            hidden.append(rel)


# What ldconfig keeps of root's powers: reading and writing the image's files whoever owns them (an image owned by
# a user namespace's root, 0755 folders) - CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER - and nothing else
# (no CAP_SYS_ADMIN, CAP_SYS_CHROOT, CAP_MKNOD, CAP_SYS_PTRACE, CAP_SETUID, ...).
LDCONFIG_CAPABILITIES = (1 << 1) | (1 << 2) | (1 << 3)


def _private_view(rootfs: RootFS) -> RootFS:
    """Leave the container's mount namespace for a private copy of it, in which ldconfig may touch nothing it
    must not: every mount of the rootfs nodev (and read-only below the rootfs's own), every procfs in it under an
    empty tmpfs. Returns the rootfs opened again there (a descriptor opened before unshare() is in the old
    namespace: mount() on it is EINVAL). The calling process stays in that copy: it must be disposable."""
    # the rootfs's real path, as mountinfo spells it; read before unshare(): once the namespace the descriptor is
    # in has ended (nothing else held it), the kernel names its folder from the mount's root ("/")
    top = os.readlink(f"/proc/self/fd/{rootfs.fd}")
    _native.unshare(_native.CLONE_NEWNS)
    _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
    view = RootFS(rootfs.path)
    try:
        if _restrict_tree(view):  # only each procfs is left to name: the start's reading has them (the copy has
            mounts = _mounts_under(top, rootfs.mount_table())  # the same mount points)
        else:  # every mount is remounted, the file binds made since that reading included: read them all now
            mounts = _mounts_under(top, read_mounts())
            _remount_nodev(top, [point for point, _ in mounts])
        _hide_procfs(view, top, mounts)
    except BaseException:
        view.close()
        raise
    return view


def _start(rootfs: RootFS, ldconfig_fd: int, argv: list[str], out: int) -> int:
    """The pid of ldconfig started over `rootfs` from a private view of it (_private_view), output to `out`: as
    libnvidia-container confines its ldconfig (the capabilities it needs only, no_new_privs, a seccomp allow-list:
    gpuhook_native confine.c), so a memory bug in glibc's parsers of the image's ELF files and configuration
    cannot become a host escape. It is chrooted through the rootfs's descriptor before it runs at all (the path
    is not looked up again); it was opened on the host and is static (check_static), so its exec needs nothing
    from the container's filesystem; it inherits no descriptor but stdio (not runc's exec.fifo, not the mount
    sources) and no environment."""
    view = _private_view(rootfs)
    null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)  # the host's, opened before leaving it
    mask = os.umask(0o022)  # the cache and links as a default umask makes them, whatever the caller's
    try:
        return _native.spawn_confined(ldconfig_fd, view.fd, null, out, argv, LDCONFIG_CAPABILITIES,
                                      LDCONFIG_TIMEOUT_S)
    finally:
        os.umask(mask)
        os.close(null)
        view.close()


def _start_from_child(rootfs: RootFS, ldconfig_fd: int, argv: list[str], out: int) -> int:
    """_start from a forked child, for a caller that must stay in its namespace; the child ends as ldconfig did
    (the same exit status or signal), so the caller reads it as ldconfig's own."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        _native.die_with_parent(parent)
        _, status = os.waitpid(_start(rootfs, ldconfig_fd, argv, out), 0)
        if os.WIFSIGNALED(status):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    except BaseException as exc:  # noqa: BLE001 - report whatever stopped us, then die
        try:
            os.write(out, _start_failure(exc).encode())
        finally:
            os._exit(127)


def _start_failure(exc: BaseException) -> str:
    """One line for a start of ldconfig that failed (spawn_confined's OSError names its step)."""
    plain = isinstance(exc, OSError) and exc.strerror and exc.filename is None
    return f"cannot run ldconfig: {exc.strerror if plain else render(exc)}"


@contextlib.contextmanager
def image_lock(rootfs: RootFS, timeout: float = LDCONFIG_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive flock on the image's /etc while its ld configuration and cache are rewritten.

    Containers started at once from one shared image directory each run ldconfig over the same /etc: both write
    /etc/ld.so.cache~ and rename it, and the second rename fails (ENOENT), failing a start that did nothing
    wrong. One at a time, they all succeed. The lock lives on the image's own directory, so only starts of
    that image wait; one holding it forever (a container's own flock) costs at most `timeout`."""
    import fcntl
    import time

    os.close(rootfs.mkdirs("/etc"))
    fd = rootfs.open("/etc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise InjectionError(f"/etc in container: locked by another start for over {timeout:.0f}s") \
                        from None
                time.sleep(0.01)
            except OSError as exc:
                raise InjectionError(f"cannot lock /etc in container: {exc.strerror}") from None
        yield
    finally:
        os.close(fd)  # releases the lock


OUTPUT_KEPT = 8192  # the tail of ldconfig's output kept for the one line of a failure


@contextlib.contextmanager
def running(rootfs: RootFS, folders: list[str], ldconfig_fd: int, disposable: bool = False) -> Iterator[None]:
    """Write the conf entry, start the host ldconfig (opened as `ldconfig_fd`) over the rootfs, run the with-block
    while it works, then wait for it and fail in one line if it failed; a with-block that raises has ldconfig
    killed. `disposable`: the caller is in the container's mount namespace for this container alone (it joined it
    for this start, or is the container's own createContainer hook) and may leave that namespace for ldconfig's
    private view (_start): ldconfig then starts without a fork of the caller, which comes back to its namespace
    for the with-block; otherwise (or where /proc does not show that namespace) a forked child takes that step.
    The with-block must not touch what ldconfig writes: the ld configuration, the cache, its folders' links."""
    os.close(rootfs.mkdirs("/etc"))
    known = configured_folders(rootfs)  # also refuses special files where ldconfig reads its configuration
    _check_cache_tmp(rootfs)
    check_static(ldconfig_fd)
    if folders:
        write_conf(rootfs, folders, known)
    argv = ldconfig_argv(folders)
    back = _namespace() if disposable else -1
    r, w = os.pipe()
    try:
        try:
            pid = (_start if back >= 0 else _start_from_child)(rootfs, ldconfig_fd, argv, w)
        except (OSError, GpuhookError) as exc:
            os.close(r)
            raise InjectionError(f"ldconfig failed in container: {_start_failure(exc)}") from None
        finally:
            os.close(w)
        if back >= 0:
            _native.setns(back, _native.CLONE_NEWNS)  # the with-block's work is in the container's namespace
        try:
            yield
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            _finish(r, pid)
            raise
    finally:
        if back >= 0:
            os.close(back)
    output, code = _finish(r, pid)
    rootfs.forget_dirs()  # ldconfig replaced links in the image
    if code == -signal.SIGALRM:
        raise InjectionError(f"ldconfig did not finish in {LDCONFIG_TIMEOUT_S}s in container (a FIFO in the image?)")
    if code == 0 and rootfs.owner is not None:  # the cache ldconfig (as root) wrote goes to the container's root
        pfd = rootfs.open("/etc")
        try:
            rootfs.check_own(pfd, "/etc/ld.so.cache")
            if stat.S_ISREG(os.stat("ld.so.cache", dir_fd=pfd, follow_symlinks=False).st_mode):
                os.chown("ld.so.cache", *rootfs.owner, dir_fd=pfd, follow_symlinks=False)
        except OSError as exc:
            raise InjectionError(f"cannot give /etc/ld.so.cache to the container's root: {exc.strerror}") from None
        finally:
            os.close(pfd)
    if code != 0:
        last = output.splitlines()[-1] if output else f"exit status {code}"
        # ldconfig names the image's files in its warnings: clipped, control characters escaped
        raise InjectionError(f"ldconfig failed in container: {clip(last, quote=False)}")


def _namespace() -> int:
    """A descriptor of the caller's mount namespace, to come back to from ldconfig's view; -1 where /proc does
    not show it."""
    try:
        return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _finish(r: int, pid: int) -> tuple[str, int]:
    """ldconfig's output (read to its end, so a flood of warnings never blocks it; the last OUTPUT_KEPT bytes
    kept) and exit code, once it ended; `r` is closed."""
    tail = b""
    try:
        while chunk := os.read(r, 65536):
            tail = (tail + chunk)[-OUTPUT_KEPT:]
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    return tail.decode(errors="replace").strip(), os.waitstatus_to_exitcode(status)


def host_ldconfig(path: str) -> str:
    """The host path of the configured ldconfig ('@/sbin/ldconfig' means the host's /sbin/ldconfig). Ubuntu's
    /sbin/ldconfig is a shell script that execs /sbin/ldconfig.real: when the file is not an ELF and
    `<path>.real` exists beside it, that is the program (as nvidia-ctk does); otherwise the path itself, which
    open_ldconfig then refuses in one line if it is no static ELF."""
    path = path[1:] if path.startswith("@") else path
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return path
    if magic != b"\x7fELF" and os.path.isfile(path + ".real"):
        return path + ".real"
    return path


def open_ldconfig(path: str) -> int:
    """The host's ldconfig by descriptor (host_ldconfig: '@' prefix, Ubuntu's `.real`), checked static."""
    path = host_ldconfig(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InjectionError(f"cannot open ldconfig {path}: {exc.strerror}") from None
    try:
        check_static(fd, f"ldconfig {path}")  # refused before anything is done to the container
    except BaseException:
        os.close(fd)
        raise
    return fd
