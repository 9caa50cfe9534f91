"""Typed wrappers over the cffi helper `_gpuhook_native` (ld.so.cache and ELF reading, syscalls, bpf).

Imported on the OCI hook's hot path: it loads the extension and defines names, nothing more.
Syscall failures raise OSError(errno, strerror, path); malformed input raises ValueError naming its origin.
"""

from __future__ import annotations

import errno
import os
import sys
from collections import namedtuple

from gpuhook._native._gpuhook_native import ffi, lib

__all__ = [
    "LdCacheEntry", "ElfInfo", "BpfProgInfo",
    "parse_ldcache", "read_ldcache", "is_64bit_x86_64", "is_32bit_i386", "flags_label",
    "elf_info", "elf_info_bytes",
    "setns", "unshare", "mount_id", "die_with_parent", "no_new_privs", "keep_capabilities", "seccomp_ldconfig",
    "confine_ldconfig", "spawn_confined",
    "mount", "umount2", "openat2", "mknodat", "open_tree", "open_trees", "move_mount",
    "Run", "FileBinds", "NewLinks",
    "bpf_prog_query", "bpf_prog_query_flags", "bpf_prog_get_fd_by_id", "bpf_prog_info",
    "bpf_prog_xlated_insns", "bpf_prog_load", "bpf_prog_attach", "bpf_prog_detach",
]  # fmt: skip

# mount(2) / umount2(2) / namespaces / open(2)
MS_RDONLY: int = lib.MS_RDONLY
MS_NOSUID: int = lib.MS_NOSUID
MS_NODEV: int = lib.MS_NODEV
MS_NOEXEC: int = lib.MS_NOEXEC
MS_REMOUNT: int = lib.MS_REMOUNT
MS_BIND: int = lib.MS_BIND
MS_MOVE: int = lib.MS_MOVE
MS_REC: int = lib.MS_REC
MS_PRIVATE: int = lib.MS_PRIVATE
MS_SLAVE: int = lib.MS_SLAVE
MS_SHARED: int = lib.MS_SHARED
MS_UNBINDABLE: int = lib.MS_UNBINDABLE
MS_RELATIME: int = lib.MS_RELATIME
MS_NOATIME: int = lib.MS_NOATIME
MS_STRICTATIME: int = lib.MS_STRICTATIME
MNT_FORCE: int = lib.MNT_FORCE
MNT_DETACH: int = lib.MNT_DETACH
MNT_EXPIRE: int = lib.MNT_EXPIRE
UMOUNT_NOFOLLOW: int = lib.UMOUNT_NOFOLLOW
CLONE_NEWNS: int = lib.CLONE_NEWNS
CLONE_NEWCGROUP: int = lib.CLONE_NEWCGROUP
CLONE_NEWUTS: int = lib.CLONE_NEWUTS
CLONE_NEWIPC: int = lib.CLONE_NEWIPC
CLONE_NEWUSER: int = lib.CLONE_NEWUSER
CLONE_NEWPID: int = lib.CLONE_NEWPID
CLONE_NEWNET: int = lib.CLONE_NEWNET
O_PATH: int = lib.O_PATH
O_CLOEXEC: int = lib.O_CLOEXEC
O_DIRECTORY: int = lib.O_DIRECTORY
O_NOFOLLOW: int = lib.O_NOFOLLOW
AT_FDCWD: int = lib.AT_FDCWD
RESOLVE_NO_XDEV: int = lib.RESOLVE_NO_XDEV
RESOLVE_NO_MAGICLINKS: int = lib.RESOLVE_NO_MAGICLINKS
RESOLVE_NO_SYMLINKS: int = lib.RESOLVE_NO_SYMLINKS
RESOLVE_BENEATH: int = lib.RESOLVE_BENEATH
RESOLVE_IN_ROOT: int = lib.RESOLVE_IN_ROOT
RESOLVE_CACHED: int = lib.RESOLVE_CACHED
OPEN_TREE_CLONE: int = lib.OPEN_TREE_CLONE
OPEN_TREE_CLOEXEC: int = lib.OPEN_TREE_CLOEXEC
AT_RECURSIVE: int = lib.AT_RECURSIVE
AT_EMPTY_PATH: int = lib.AT_EMPTY_PATH
MOVE_MOUNT_F_EMPTY_PATH: int = lib.MOVE_MOUNT_F_EMPTY_PATH
# mount_setattr(2)'s MOUNT_ATTR_* that gpuhook sets or clears (<linux/mount.h>, fixed ABI)
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
MOUNT_ATTR_NOSYMFOLLOW = 0x00200000

# bpf(2)
BPF_CGROUP_DEVICE: int = lib.BPF_CGROUP_DEVICE
BPF_PROG_TYPE_CGROUP_DEVICE: int = lib.BPF_PROG_TYPE_CGROUP_DEVICE
BPF_F_ALLOW_OVERRIDE: int = lib.BPF_F_ALLOW_OVERRIDE
BPF_F_ALLOW_MULTI: int = lib.BPF_F_ALLOW_MULTI
BPF_F_REPLACE: int = lib.BPF_F_REPLACE

# glibc ldconfig entry flags (sysdeps/generic/ldconfig.h): ELF type in the low byte, required ABI above it.
FLAG_TYPE_MASK = 0x00FF
FLAG_ELF = 0x0001
FLAG_ELF_LIBC5 = 0x0002
FLAG_ELF_LIBC6 = 0x0003
FLAG_REQUIRED_MASK = 0xFF00
FLAG_SPARC_LIB64 = 0x0100
FLAG_IA64_LIB64 = 0x0200
FLAG_X8664_LIB64 = 0x0300
FLAG_S390_LIB64 = 0x0400
FLAG_POWERPC_LIB64 = 0x0500
FLAG_MIPS64_LIBN32 = 0x0600
FLAG_MIPS64_LIBN64 = 0x0700
FLAG_X8664_LIBX32 = 0x0800
FLAG_ARM_LIBHF = 0x0900
FLAG_AARCH64_LIB64 = 0x0A00
FLAG_ARM_LIBSF = 0x0B00

_ERRLEN = 256
_VERIFIER_LOG_SIZE = 1 << 20


# collections.namedtuple rather than typing.NamedTuple: importing typing costs ~4 ms on every hook start.
LdCacheEntry = namedtuple("LdCacheEntry", "key value flags hwcap")
LdCacheEntry.__doc__ = """One ld.so.cache entry: `key` is the soname (or link name) the loader looks up, `value`
its path. `hwcap` is raw: 0 for ordinary entries; with bit 62 set (glibc >= 2.33) its low 32 bits index the
glibc-hwcaps subdirectory the library was found in."""

ElfInfo = namedtuple("ElfInfo", "elf_class machine soname")  # elf_class 32|64; machine: 62 x86-64, 3 i386
ElfInfo.__doc__ = "What gpuhook needs of an ELF file: class, e_machine and DT_SONAME (None without one)."

BpfProgInfo = namedtuple("BpfProgInfo", "id type name xlated_len gpl_compatible")


# --- errors -------------------------------------------------------------------------------------------


def _oserror(path: str | bytes | None = None, path2: str | bytes | None = None) -> OSError:
    err = ffi.errno
    if path is None:
        return OSError(err, os.strerror(err))
    return OSError(err, os.strerror(err), path, None, path2)


def _check(rc: int, path: str | bytes | None = None, path2: str | bytes | None = None) -> int:
    if rc < 0:
        raise _oserror(path, path2)
    return rc


def _errstr(buf: object) -> str:
    return ffi.string(buf).decode("utf-8", "replace")


def _cstr(value: str | bytes | os.PathLike[str] | None) -> object:
    return ffi.NULL if value is None else os.fsencode(value)


# --- ld.so.cache --------------------------------------------------------------------------------------


def parse_ldcache(data: bytes, origin: str = "<bytes>") -> list[LdCacheEntry]:
    """Entries of a glibc ld.so.cache image (new format, alone or after an old-format table, or old only)."""
    data = bytes(data)
    buf = ffi.from_buffer("uint8_t[]", data)
    err = ffi.new("char[]", _ERRLEN)
    count = lib.gh_ldcache_parse(buf, len(data), ffi.NULL, 0, err, _ERRLEN)
    if count < 0:
        raise ValueError(f"{origin}: {_errstr(err)}")
    out = ffi.new("struct gh_ldentry[]", max(count, 1))
    if lib.gh_ldcache_parse(buf, len(data), out, count, err, _ERRLEN) < 0:
        raise ValueError(f"{origin}: {_errstr(err)}")
    fsdecode = os.fsdecode
    entries = []
    for i in range(count):
        e = out[i]
        key, value = e.key, e.value
        entries.append(
            LdCacheEntry(
                fsdecode(data[key : key + e.key_len]),
                fsdecode(data[value : value + e.value_len]),
                e.flags,
                e.hwcap,
            )
        )
    return entries


def read_ldcache(path: str | os.PathLike[str] = "/etc/ld.so.cache") -> list[LdCacheEntry]:
    with open(path, "rb") as f:
        data = f.read()
    return parse_ldcache(data, os.fspath(path))


def _is_glibc_elf(flags: int, required: int) -> bool:
    """ELF (no libc dependency) or libc6 library built for the `required` ABI; libnvidia-container's test."""
    return flags & FLAG_TYPE_MASK in (FLAG_ELF, FLAG_ELF_LIBC6) and flags & FLAG_REQUIRED_MASK == required


def is_64bit_x86_64(flags: int) -> bool:
    """A 64-bit x86-64 library ("libc6,x86-64" in ldconfig -p)."""
    return _is_glibc_elf(flags, FLAG_X8664_LIB64)


def is_32bit_i386(flags: int) -> bool:
    """A 32-bit library without an ABI tag ("libc6" or "ELF" in ldconfig -p): i386 in an x86 host's cache."""
    return _is_glibc_elf(flags, 0)


_TYPE_LABELS = {FLAG_ELF: "ELF", FLAG_ELF_LIBC5: "libc5", FLAG_ELF_LIBC6: "libc6"}
_ABI_LABELS = {
    0: "", FLAG_SPARC_LIB64: ",64bit", FLAG_IA64_LIB64: ",IA-64", FLAG_X8664_LIB64: ",x86-64",
    FLAG_S390_LIB64: ",64bit", FLAG_POWERPC_LIB64: ",64bit", FLAG_MIPS64_LIBN32: ",N32",
    FLAG_MIPS64_LIBN64: ",64bit", FLAG_X8664_LIBX32: ",x32", FLAG_ARM_LIBHF: ",hard-float",
    FLAG_AARCH64_LIB64: ",AArch64", FLAG_ARM_LIBSF: ",soft-float",
}  # fmt: skip


def flags_label(flags: int) -> str:
    """The flags as `ldconfig -p` prints them inside the parentheses, e.g. "libc6,x86-64" (no hwcap part)."""
    required = flags & FLAG_REQUIRED_MASK
    abi = _ABI_LABELS.get(required, f",{required}")
    return _TYPE_LABELS.get(flags & FLAG_TYPE_MASK, "unknown") + abi


# --- ELF ----------------------------------------------------------------------------------------------


def _elf_result(rc: int, out: object, err: object, origin: str) -> ElfInfo:
    if rc < 0:
        raise _oserror(origin)
    if rc > 0:
        raise ValueError(f"{origin}: {_errstr(err)}")
    soname = os.fsdecode(ffi.string(out.soname)) if out.has_soname else None
    return ElfInfo(out.elf_class, out.machine, soname)


def elf_info(path: str | os.PathLike[str]) -> ElfInfo:
    """Class, machine and DT_SONAME of an ELF file (read with pread: only the headers and one string)."""
    origin = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = ffi.new("struct gh_elfinfo *")
        err = ffi.new("char[]", _ERRLEN)
        rc = lib.gh_elf_info_fd(fd, out, err, _ERRLEN)
        return _elf_result(rc, out, err, origin)
    finally:
        os.close(fd)


def elf_info_bytes(data: bytes, origin: str = "<bytes>") -> ElfInfo:
    buf = ffi.from_buffer("uint8_t[]", data)
    out = ffi.new("struct gh_elfinfo *")
    err = ffi.new("char[]", _ERRLEN)
    return _elf_result(lib.gh_elf_info_buf(buf, len(buf), out, err, _ERRLEN), out, err, origin)


# --- syscalls Python lacks ----------------------------------------------------------------------------


def setns(fd: int, nstype: int = 0) -> None:
    """setns(2), then the audit event `gpuhook.setns` (fd, nstype): a test's audit hook knows from it when a
    process is in another namespace than its own, where nothing may be imported, loaded or executed."""
    _check(lib.gh_setns(fd, nstype))
    sys.audit("gpuhook.setns", fd, nstype)


def die_with_parent(parent_pid: int, sig: int = 9) -> None:
    """prctl(PR_SET_PDEATHSIG) in a forked helper (injection child, ldconfig): it must not outlive a hook that
    runc killed at its timeout; the signal survives execve. `parent_pid` is os.getpid() taken before the fork."""
    _check(lib.gh_set_pdeathsig(sig))
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def no_new_privs() -> None:
    """prctl(PR_SET_NO_NEW_PRIVS): nothing exec'd from here on gains privileges (setuid bits, file caps)."""
    _check(lib.gh_no_new_privs())


def keep_capabilities(keep: int) -> None:
    """Drop every capability whose bit is not set in `keep`, from every set, the bounding set included (so an
    exec as root does not get them back)."""
    _check(lib.gh_keep_capabilities(keep))


def seccomp_ldconfig() -> bool:
    """Install the ldconfig system call allow-list (confine.c); False on an architecture it has none for."""
    if lib.gh_seccomp_ldconfig() == 0:
        return True
    if ffi.errno == errno.ENOSYS:
        return False
    raise _oserror()


def mount_id(fd: int) -> int | None:
    """The id of the mount `fd` lies on (statx STATX_MNT_ID); None from a kernel that does not say (before 5.8)."""
    out = ffi.new("uint64_t *")
    return out[0] if _check(lib.gh_mount_id(fd, out)) == 0 else None


def confine_ldconfig(keep: int) -> None:
    """keep_capabilities(keep), no_new_privs, seccomp_ldconfig: what spawn_confined's child runs under."""
    _check(lib.gh_confine_ldconfig(keep))


_SPAWN_STEPS = {lib.GH_SPAWN_PDEATHSIG: "prctl(PR_SET_PDEATHSIG)", lib.GH_SPAWN_FDS: "its descriptors",
                lib.GH_SPAWN_ROOT: "chroot into the container", lib.GH_SPAWN_CONFINE: "confinement",
                lib.GH_SPAWN_EXEC: "execve"}


def spawn_confined(exe_fd: int, root_fd: int, in_fd: int, out_fd: int, argv: list[str], keep: int,
                   timeout_s: int) -> int:
    """gh_spawn_confined (confine.c): the static program `exe_fd`, chrooted to `root_fd`, confined; its pid. A
    child that could not execve has exited (127): OSError naming the step, after it is waited for."""
    sys.audit("gpuhook.spawn", exe_fd, argv)  # the audit hook of a test sees which descriptor runs
    args = [ffi.new("char[]", os.fsencode(a)) for a in argv]
    step, err = ffi.new("int *"), ffi.new("int *")
    pid = lib.gh_spawn_confined(exe_fd, root_fd, in_fd, out_fd, ffi.new("char *[]", [*args, ffi.NULL]), keep,
                                timeout_s, step, err)
    if pid < 0:
        raise _oserror()
    if step[0]:
        os.waitpid(pid, 0)
        raise OSError(err[0], f"{_SPAWN_STEPS.get(step[0], 'setup')}: {os.strerror(err[0])}")
    return pid


def unshare(flags: int) -> None:
    """unshare(2); os.unshare only exists from Python 3.12."""
    _check(lib.gh_unshare(flags))


def mount(
    source: str | None,
    target: str | os.PathLike[str],
    fstype: str | None = None,
    flags: int = 0,
    data: str | None = None,
) -> None:
    """mount(2); errors name the source and target (just the target when there is no source)."""
    rc = lib.gh_mount(_cstr(source), os.fsencode(target), _cstr(fstype), flags, _cstr(data))
    if source is None:
        _check(rc, os.fspath(target))
    else:
        _check(rc, source, os.fspath(target))


def umount2(target: str | os.PathLike[str], flags: int = 0) -> None:
    _check(lib.gh_umount2(os.fsencode(target), flags), os.fspath(target))


OPENAT2_ATTEMPTS = 64


def openat2(
    dirfd: int,
    path: str | os.PathLike[str],
    flags: int,
    mode: int = 0,
    resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
) -> int:
    """openat2(2); the fd is always close-on-exec. With RESOLVE_IN_ROOT, `dirfd` acts as "/" for `path`,
    for absolute symlinks and for "..", so an image's symlinks can't lead out of its rootfs.

    With RESOLVE_IN_ROOT the kernel answers EAGAIN when a rename or mount anywhere raced the lookup (it cannot
    prove ".." stayed inside); openat2(2) says to retry. Bounded: a rootfs that keeps racing fails with EAGAIN."""
    raw = os.fsencode(path)
    for _ in range(OPENAT2_ATTEMPTS - 1):
        fd = lib.gh_openat2(dirfd, raw, flags | O_CLOEXEC, mode, resolve)
        if fd >= 0 or ffi.errno != errno.EAGAIN:
            return _check(fd, os.fspath(path))
    return _check(lib.gh_openat2(dirfd, raw, flags | O_CLOEXEC, mode, resolve), os.fspath(path))


def mknodat(dirfd: int, path: str | os.PathLike[str], mode: int, major: int, minor: int) -> None:
    """mknodat(2); `mode` includes the file type (stat.S_IFCHR / S_IFBLK)."""
    _check(lib.gh_mknodat(dirfd, os.fsencode(path), mode, major, minor), os.fspath(path))


def open_tree(dirfd: int, path: str | os.PathLike[str], flags: int = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC) -> int:
    """open_tree(2). With OPEN_TREE_CLONE: an fd holding a detached copy of the mount at `path` (its
    submounts too with AT_RECURSIVE; AT_EMPTY_PATH with path "" clones `dirfd` itself). Unlike
    mount(MS_BIND), whose source must be in the caller's mount namespace (else EINVAL), the copy can be
    attached with move_mount() after setns() into another namespace."""
    return _check(lib.gh_open_tree(dirfd, os.fsencode(path), flags), os.fspath(path))


def mount_setattr(dirfd: int, path: str | os.PathLike[str], flags: int, attr_set: int, attr_clr: int = 0,
                  propagation: int = 0) -> None:
    """mount_setattr(2) (Linux 5.12): MOUNT_ATTR_* flags set and cleared on one mount, or with AT_RECURSIVE on a
    whole tree, and its propagation (MS_PRIVATE, ...; 0: as it is), in one call; OSError ENOSYS from an older
    kernel."""
    _check(lib.gh_mount_setattr(dirfd, os.fsencode(path), flags, attr_set, attr_clr, propagation),
           os.fspath(path) or f"fd {dirfd}")


def is_mount_root(fd: int) -> bool | None:
    """`fd` is the root of a mount (statx STATX_ATTR_MOUNT_ROOT); None from a kernel that does not say (5.8)."""
    found = _check(lib.gh_is_mount_root(fd))
    return None if found == 2 else bool(found)


def open_trees(paths: list[str], flags: int) -> list[int]:
    """open_tree(AT_FDCWD, path, flags) for each of `paths`, in one native call (98 for 8 GPUs with every
    capability); OSError for the first that fails, naming it, with the ones opened before it closed."""
    keep = [ffi.new("char[]", os.fsencode(p)) for p in paths]
    fds = ffi.new("int[]", len(paths))
    done = lib.gh_open_trees(len(paths), ffi.new("char *[]", keep), flags, fds)
    if done < len(paths):
        failed = _oserror(paths[done])
        for k in range(done):
            os.close(fds[k])
        raise failed
    return list(fds)


def move_mount(
    from_dirfd: int,
    from_path: str | os.PathLike[str],
    to_dirfd: int,
    to_path: str | os.PathLike[str],
    flags: int = 0,
) -> None:
    """move_mount(2); move_mount(tree_fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) attaches an
    open_tree() clone at `target`."""
    _check(lib.gh_move_mount(from_dirfd, os.fsencode(from_path), to_dirfd, os.fsencode(to_path), flags),
           os.fspath(to_path))  # fmt: skip


# --- runs of new files in a rootfs (inject/rootfs.RootFS.in_runs): the same system calls as Python's, one call

# where gh_bind_files stopped
BIND_TREE: int = lib.GH_BIND_TREE  # the tree is not a regular file (errno ENOTSUP), or fstat failed
BIND_CREATE: int = lib.GH_BIND_CREATE  # the new file could not be created (EEXIST: something stands there)
BIND_OWNER: int = lib.GH_BIND_OWNER  # created, but not given to the container's root
BIND_MOVE: int = lib.GH_BIND_MOVE  # move_mount refused
BIND_SETATTR: int = lib.GH_BIND_SETATTR  # attached, but mount_setattr refused (ENOSYS: a kernel before 5.12)
# where gh_symlinks stopped
LINK_CREATE: int = lib.GH_LINK_CREATE  # symlinkat refused (EEXIST: something stands there)
LINK_OWNER: int = lib.GH_LINK_OWNER  # made, but not given to the container's root


class Run:
    """A run of items for one native call, its arrays built once: run(at) goes on past an item that stopped it
    without building them again. Each item starts with (folder descriptor, the new name in it); the caller
    keeps every descriptor open while the run lasts."""

    def __init__(self, items: list[tuple[int, str]], owner: tuple[int, int] | None) -> None:
        self.count = len(items)
        self._keep = [ffi.new("char[]", os.fsencode(item[1])) for item in items]  # alive with the arrays
        self._dirfds = ffi.new("int[]", [item[0] for item in items])
        self._names = ffi.new("char *[]", self._keep)
        self._uid, self._gid = owner if owner is not None else (-1, -1)
        self._step, self._err = ffi.new("int *"), ffi.new("int *")

    def _strings(self, values: list[str]) -> object:
        """A char *[] of `values`, kept alive with the run."""
        strings = [ffi.new("char[]", os.fsencode(v)) for v in values]
        self._keep.extend(strings)
        return ffi.new("char *[]", strings)

    def run(self, at: int) -> tuple[int, int, int]:
        """Make items `at`, `at + 1`, ... until one fails: (the index it stopped at, `count` when every item was
        made; that item's step, 0 when none failed; its errno)."""
        if at >= self.count:
            return self.count, 0, 0
        done = self._call(at)
        return at + done, self._step[0], self._err[0]

    def _call(self, at: int) -> int:
        raise NotImplementedError


class FileBinds(Run):
    """gh_bind_files: item (folder, name, detached tree, MOUNT_ATTR_* to set, to clear), `mode` for the new
    file, `resolve` for its openat2."""

    def __init__(self, items: list[tuple[int, str, int, int, int]], mode: int, resolve: int,
                 owner: tuple[int, int] | None) -> None:
        super().__init__([(item[0], item[1]) for item in items], owner)
        self._trees = ffi.new("int[]", [item[2] for item in items])
        self._set = ffi.new("uint64_t[]", [item[3] for item in items])
        self._clr = ffi.new("uint64_t[]", [item[4] for item in items])
        self._mode, self._resolve = mode, resolve

    def _call(self, at: int) -> int:
        return lib.gh_bind_files(self.count - at, self._dirfds + at, self._names + at, self._trees + at,
                                 self._set + at, self._clr + at, self._mode, self._resolve, self._uid, self._gid,
                                 self._step, self._err)


class NewLinks(Run):
    """gh_symlinks: item (folder, name, the link's target)."""

    def __init__(self, items: list[tuple[int, str, str]], owner: tuple[int, int] | None) -> None:
        super().__init__([(item[0], item[1]) for item in items], owner)
        self._targets = self._strings([item[2] for item in items])

    def _call(self, at: int) -> int:
        return lib.gh_symlinks(self.count - at, self._dirfds + at, self._names + at, self._targets + at,
                               self._uid, self._gid, self._step, self._err)


# --- bpf(2) for cgroup v2 device filters --------------------------------------------------------------


def bpf_prog_query_flags(target_fd: int, attach_type: int) -> tuple[list[int], int]:
    """Ids of the programs attached directly to `target_fd` (a cgroup) and the cgroup's attach flags."""
    cap = 8
    while True:
        ids = ffi.new("uint32_t[]", cap)
        count = ffi.new("uint32_t *", cap)
        flags = ffi.new("uint32_t *")
        if lib.gh_bpf_prog_query(target_fd, attach_type, flags, ids, count) < 0:
            if ffi.errno == errno.ENOSPC and count[0] > cap:  # more were attached than we had room for
                cap = count[0]
                continue
            raise _oserror()
        return [ids[i] for i in range(min(count[0], cap))], flags[0]


def bpf_prog_query(target_fd: int, attach_type: int) -> list[int]:
    return bpf_prog_query_flags(target_fd, attach_type)[0]


def bpf_prog_get_fd_by_id(prog_id: int) -> int:
    return _check(lib.gh_bpf_prog_get_fd_by_id(prog_id))


def bpf_prog_info(prog_fd: int) -> BpfProgInfo:
    out = ffi.new("struct gh_bpf_prog_info *")
    _check(lib.gh_bpf_prog_info(prog_fd, out, ffi.NULL, 0))
    name = ffi.string(out.name).decode("ascii", "replace")
    return BpfProgInfo(out.id, out.type, name, out.xlated_len, bool(out.gpl_compatible))


def bpf_prog_xlated_insns(prog_fd: int) -> bytes:
    """The program's instructions as the kernel holds them after verification (8 bytes each)."""
    size = bpf_prog_info(prog_fd).xlated_len
    if size == 0:
        raise OSError(errno.EPERM, "the kernel reports no translated instructions for this program (needs CAP_BPF)")
    buf = ffi.new("uint8_t[]", size)
    out = ffi.new("struct gh_bpf_prog_info *")
    _check(lib.gh_bpf_prog_info(prog_fd, out, buf, size))
    if out.xlated_withheld:
        raise OSError(errno.EPERM, "the kernel withheld the program's instructions (kernel.kptr_restrict?)")
    return ffi.buffer(buf, min(size, out.xlated_len))[:]


def bpf_prog_load(prog_type: int, insns: bytes, license: str = "GPL", name: str = "") -> int:
    """Load a program; a rejected one raises OSError whose message ends with the verifier's last words."""
    code = ffi.from_buffer("uint8_t[]", insns)
    lic = license.encode()
    cname = name.encode()[:15]
    fd = lib.gh_bpf_prog_load(prog_type, code, len(code), lic, cname, 0, ffi.NULL, 0)
    if fd >= 0:
        return fd
    first = ffi.errno
    log = ffi.new("char[]", _VERIFIER_LOG_SIZE)
    fd = lib.gh_bpf_prog_load(prog_type, code, len(code), lic, cname, 1, log, _VERIFIER_LOG_SIZE)
    if fd >= 0:  # a transient failure (EAGAIN): the retry worked
        return fd
    lines = [line for line in _errstr(log).splitlines() if line.strip()]
    tail = " | ".join(lines[-6:]) or "no verifier log"
    raise OSError(first, f"BPF_PROG_LOAD: {os.strerror(first)}; verifier: {tail}")


def bpf_prog_attach(target_fd: int, prog_fd: int, attach_type: int, flags: int = 0, replace_fd: int = -1) -> None:
    """BPF_PROG_ATTACH; with BPF_F_REPLACE, `replace_fd` names the program to swap out atomically."""
    _check(lib.gh_bpf_prog_attach(target_fd, prog_fd, attach_type, flags, replace_fd))


def bpf_prog_detach(target_fd: int, prog_fd: int, attach_type: int) -> None:
    _check(lib.gh_bpf_prog_detach(target_fd, prog_fd, attach_type))
