"""Safe operations inside a container's root filesystem.

The image is hostile: any path component may be a symlink aimed at the host. Every path here is resolved
by the kernel with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) from a descriptor of the rootfs, so a
symlink is followed as if the rootfs were `/` and can never lead out of it, and /proc magic links
(/proc/self/root, /proc/1/root) are refused. Creation happens through *at() calls on descriptors obtained
that way, never through a path string re-resolved later.

Resolving inside the rootfs is not enough when the runtime mounted a host directory into it (a writable volume
at /data): an image link /usr/lib/x86_64-linux-gnu -> /data/lib stays inside the rootfs and still leads onto
the host's directory. So whatever is created, written or removed here must sit in a folder on the rootfs's own
mount, or on the two mounts made for the container's devices (the runtime's /dev, gpuhook's tmpfs on
/proc/driver/nvidia); anything else fails the start with one line (the check openat2 RESOLVE_NO_XDEV would do
for the whole path, made on the folder's mount id, so the runtime's /dev can still be reached). With `owner`
(a container with its own user namespace), what is created belongs to the container's root.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Callable

from gpuhook import _native
from gpuhook.errors import InjectionError, clip
from gpuhook.inject.mountinfo import Mount, read_mounts

RESOLVE = _native.RESOLVE_IN_ROOT | _native.RESOLVE_NO_MAGICLINKS
O_PATH = os.O_PATH


def shown(path: str) -> str:
    """A container path for a message: every name in it may come from the image (newlines, escape sequences,
    megabytes), so it is clipped and its control characters escaped, here and only here (errors.clip)."""
    return clip(path, quote=False)


def _error(what: str, path: str, exc: OSError) -> InjectionError:
    """The one line for a failed system call on `path` in the container: `what` (a verb phrase or ""), the path
    as shown(), the reason."""
    return InjectionError(f"{what + ' ' if what else ''}{shown(path)} in container: {exc.strerror}")


def creation_error(path: str, exc: OSError) -> InjectionError:
    """The one line for a file that could not be created at `path`, as ensure_file says it."""
    return _error("cannot create", path, exc)


def _link_error(target: str, link: str, exc: OSError) -> InjectionError:
    return InjectionError(f"cannot create link {shown(link)} -> {shown(target)} in container: {exc.strerror}")


def _split(path: str) -> tuple[str, str]:
    """(parent, name) of a normalised absolute container path."""
    norm = posixpath.normpath("/" + path.lstrip("/"))
    if norm == "/":
        raise InjectionError(f"{clip(path)}: cannot operate on the container's root itself")
    return posixpath.split(norm)


def mount_id(fd: int) -> int:
    """The id of the mount `fd` lies on: statx's STATX_MNT_ID, or /proc/self/fdinfo's mnt_id before Linux 5.8."""
    found = _native.mount_id(fd)
    if found is not None:
        return found
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise InjectionError("cannot tell which mount a container folder is on (no mnt_id in fdinfo)")


MAX_HELD_DIRS = 64  # folders a RootFS keeps open for the next creation in them (mkdirs)
LINK_TRIES = 3  # symlink(): looks at a link that another start's ldconfig is replacing this often
DEVICE_MOUNTS = ("/dev", "/proc/driver/nvidia")  # mounts made for the container's devices, besides its own


class RootFS:
    """A container rootfs held open by descriptor; close() (or a with-block) releases it."""

    def __init__(self, path: str, owner: tuple[int, int] | None = None) -> None:
        self.path = path
        self.owner = owner
        try:
            self.fd = os.open(path, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise InjectionError(f"cannot open container rootfs {path}: {exc.strerror}") from None
        self._mounts: frozenset[int] | None = None
        self._table: list[Mount] | None = None  # mount_table(): the last mountinfo reading, while still current
        self._resolved: dict[str, str] = {}  # leads_to: link-free path -> where it is (the shim checks dozens
        # of paths under a few folders; each folder is looked at once)
        self._dirs: dict[str, int] = {}  # mkdirs: container folder -> a descriptor of it (dozens of libraries are
        # mounted into one folder; it is looked up once, until something could change what the path leads to)
        self.generation = 0  # counts forget_dirs(): a held folder taken before is closed, and may be stale

    def own_mounts(self) -> frozenset[int]:
        """Ids of the mounts gpuhook may create on: the rootfs's, and those mounted exactly at DEVICE_MOUNTS in
        it (read once they are needed: /proc/driver/nvidia's tmpfs is made during injection)."""
        top = os.readlink(f"/proc/self/fd/{self.fd}").rstrip("/")
        wanted = {top + p for p in DEVICE_MOUNTS}
        ids = {mount_id(self.fd)}
        self._table = read_mounts()
        # every mount exactly there (the last one mounted there is what a lookup sees, and it is among them)
        ids.update(m.mount_id for m in self._table if m.mountpoint in wanted)
        return frozenset(ids)

    def mount_table(self) -> list[Mount]:
        """This mount namespace's mounts: the last reading (own_mounts), unless a folder was mounted on since
        (mounted_folder: a recursive bind may bring submounts), else read now."""
        if self._table is None:
            self._table = read_mounts()
        return self._table

    def mounted_folder(self) -> None:
        """Whoever mounts over a folder in the rootfs calls this: held folders are forgotten (forget_dirs) and
        the mount table is read again when next asked for."""
        self.forget_dirs()
        self._table = None

    def is_own(self, pfd: int) -> bool:
        """Folder `pfd` is on one of own_mounts() (read again when it is not in the last reading)."""
        mnt = mount_id(pfd)
        if self._mounts is None or mnt not in self._mounts:
            self._mounts = self.own_mounts()
        return mnt in self._mounts

    def check_own(self, pfd: int, path: str) -> None:
        """Refuse to create, write or remove anything in folder `pfd` (where `path` goes) unless it is on one of
        own_mounts(): an image link must not lead gpuhook onto a volume, a host directory."""
        if not self.is_own(pfd):
            raise InjectionError(f"{shown(path)} in container: leads out of the container's own filesystem (onto "
                                 "a volume or another mount): refusing to create anything there")

    def _chown(self, pfd: int, name: str) -> None:
        """Give what was just created to the container's root (user namespace), never following a link."""
        if self.owner is not None:
            os.chown(name, *self.owner, dir_fd=pfd, follow_symlinks=False)

    def __enter__(self) -> RootFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.forget_dirs()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def forget_dirs(self) -> None:
        """Drop the folders mkdirs holds: whoever mounts over a folder, or replaces or removes a link, in the
        rootfs calls this, so a held descriptor never stands for a path that now leads elsewhere (a folder
        covered by a mount, a link aimed anew)."""
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        self.generation += 1

    def open(self, path: str, flags: int = O_PATH, mode: int = 0) -> int:
        """A descriptor for `path` resolved inside the rootfs (the caller closes it)."""
        try:
            return _native.openat2(self.fd, path.lstrip("/") or ".", flags | os.O_CLOEXEC, mode, RESOLVE)
        except OSError as exc:
            raise _error("", path, exc) from None

    def leads_to(self, path: str) -> str:
        """The container path that `path` names once every link on it is followed inside the rootfs, the parts
        that do not exist yet included (a dangling link is followed to where it points): where a runtime that
        creates missing mount targets (runc's securejoin) would create them. Lexical past what exists."""
        top = os.readlink(f"/proc/self/fd/{self.fd}").rstrip("/") or "/"
        todo = [p for p in posixpath.normpath("/" + path.lstrip("/")).split("/") if p]
        here = "/"
        for _ in range(255):  # link hops and components together, as the kernel bounds a lookup
            if not todo:
                return here
            part = todo.pop(0)
            nxt = posixpath.normpath(posixpath.join(here, part))
            if nxt in self._resolved:  # a component that is no link, already looked at: the same one step
                here = self._resolved[nxt]
                continue
            try:
                fd = _native.openat2(self.fd, nxt.lstrip("/") or ".", O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, 0, RESOLVE)
            except OSError:
                return posixpath.normpath(posixpath.join(nxt, *todo))  # missing from here on: lexical
            try:
                if stat.S_ISLNK(os.fstat(fd).st_mode):
                    target = os.readlink("", dir_fd=fd)
                    todo = [p for p in target.split("/") if p] + todo
                    here = "/" if target.startswith("/") else here
                    continue
                real = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            rel = posixpath.relpath(real, top)
            if rel.startswith(".."):
                raise InjectionError(f"{shown(path)} in container: leads out of the rootfs")
            here = self._resolved[nxt] = "/" if rel == "." else "/" + rel
        raise InjectionError(f"{shown(path)} in container: too many links")

    def exists(self, path: str) -> bool:
        try:
            fd = _native.openat2(self.fd, path.lstrip("/") or ".", O_PATH | os.O_CLOEXEC, 0, RESOLVE)
        except OSError:
            return False
        os.close(fd)
        return True

    def mkdirs(self, path: str, mode: int = 0o755) -> int:
        """O_PATH descriptor of directory `path`, creating missing components inside the rootfs.

        Each prefix is resolved from the rootfs's own descriptor, never from the previous component's: with
        RESOLVE_IN_ROOT the descriptor passed is "/", so resolving from a subdirectory would send an absolute
        or `..` link somewhere else than every other lookup of the same path (and than the container's).
        """
        norm = posixpath.normpath("/" + path.lstrip("/"))
        held = self._dirs.get(norm)
        if held is not None:
            return os.dup(held)
        try:  # the usual case, the whole folder already there: one lookup, from the rootfs's descriptor as below
            return self._hold(norm, _native.openat2(self.fd, norm.lstrip("/") or ".",
                                                    O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE))
        except OSError:
            pass  # missing, or not usable: the walk below creates what is missing or names the part that fails
        parts = [p for p in norm.split("/") if p]
        first, current = self._deepest_held(parts)
        made = False  # the folder above was made just now: what follows is missing, no lookup needed first
        try:
            for i in range(first, len(parts)):
                part, prefix = parts[i], "/".join(parts[: i + 1])
                nxt = -1
                if not made:
                    try:
                        nxt = _native.openat2(self.fd, prefix, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE)
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:
                            raise InjectionError(f"{shown(norm)} in container: {clip(part)} is {exc.strerror}") \
                                from None
                if nxt < 0:
                    self.check_own(current, norm)
                    made = self._mkdir_at(current, part, mode, norm)
                    try:
                        nxt = _native.openat2(self.fd, prefix, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE)
                    except OSError as again:  # a dangling link, a file, or replaced since
                        raise InjectionError(f"{shown(norm)} in container: {clip(part)} exists but is not a usable "
                                             f"directory ({again.strerror})") from None
                os.close(current)
                current = nxt if i == len(parts) - 1 else self._hold("/" + prefix, nxt)
            return self._hold(norm, current)
        except BaseException:
            os.close(current)
            raise

    def _deepest_held(self, parts: list[str]) -> tuple[int, int]:
        """Where mkdirs' walk of `parts` starts: (the index of the first part to look at, a descriptor of the
        folder above it, the caller's): the deepest folder above that is held (it was looked up from the rootfs's
        descriptor, as the walk does, and nothing changed where its path leads since), else the rootfs."""
        for k in range(len(parts) - 1, 0, -1):
            held = self._dirs.get("/" + "/".join(parts[:k]))
            if held is not None:
                return k, os.dup(held)
        return 0, os.dup(self.fd)

    def new_file_folder(self, parent: str) -> int | None:
        """A held descriptor of folder `parent` (made if missing, as ensure_file and symlink make it) when a new
        name may be created in it at once, as their usual case: it is on one of own_mounts(). None otherwise,
        and when making or looking it up fails (they then say why). Borrowed: valid while `generation` is."""
        try:
            pfd = self.mkdirs(parent)
        except InjectionError:
            return None
        try:
            return self._dirs.get(posixpath.normpath("/" + parent.lstrip("/"))) if self.is_own(pfd) else None
        finally:
            os.close(pfd)

    def in_runs(self, paths: list[str], start: Callable[[int, list[tuple[int, str]]], _native.Run],
                settle: Callable[[int, int, int], None]) -> None:
        """Create something new at each container path in `paths`, in order, mostly through the native helper.

        The usual item, a new name in a folder of the rootfs's own (nearly every one on a fresh image), goes in a
        run: `start(first, [(folder, name), ...])` is the native call for paths[first:first + len], whose
        system calls are the ones Python would make, without ~20 µs of Python around each (a few hundred files,
        links and folders for 8 GPUs). Every other item, and each one a run stops at, is `settle(i, step,
        errno)`'s (step 0: not tried there), which does it Python's way or raises its line. Folders are looked
        up again after anything that could change where a path leads (`generation`)."""
        i = 0
        while i < len(paths):
            generation = self.generation
            places: list[tuple[int, str]] = []
            folders: dict[str, int | None] = {}
            for path in paths[i:]:
                parent, name = posixpath.split(posixpath.normpath("/" + path.lstrip("/")))
                if not name:  # the rootfs itself: settle's to refuse
                    break
                if parent not in folders:
                    folders[parent] = self.new_file_folder(parent)
                pfd = folders[parent]
                if pfd is None:
                    break
                places.append((pfd, name))
            if not places:
                settle(i, 0, 0)
                i += 1
                continue
            run = start(i, places)
            at = 0
            while True:
                at, step, err = run.run(at)
                if step == 0:
                    i += at
                    break
                settle(i + at, step, err)
                at += 1
                if self.generation != generation:  # the folders the run holds are closed
                    i += at
                    break

    def _hold(self, norm: str, fd: int) -> int:
        """`fd` (folder `norm`), a copy of it kept for the next mkdirs of the same folder (forget_dirs)."""
        if len(self._dirs) < MAX_HELD_DIRS:
            self._dirs[norm] = os.dup(fd)
        return fd

    def _mkdir_at(self, dirfd: int, name: str, mode: int, full: str) -> bool:
        """mkdir; True when made. EEXIST is fine (False): another start on the same image made it between our
        lookup and now, or mkdirs made no lookup (what stands there is checked by the lookup that follows: a
        dangling link or a file fails it)."""
        try:
            os.mkdir(name, mode, dir_fd=dirfd)
        except FileExistsError:
            return False
        except OSError as exc:
            raise _error("cannot create", full, exc) from None
        try:
            self._chown(dirfd, name)
        except OSError as exc:
            raise _error("cannot create", full, exc) from None
        return True

    def ensure_file(self, path: str, mode: int = 0o644) -> int:
        """A descriptor of a regular file at `path` (an empty one is created if missing), to mount onto."""
        parent, name = _split(path)
        pfd = self.mkdirs(parent)
        try:
            fd = self._create_new(pfd, name, mode, path)  # the usual case (a fresh image): created at once
            if fd is not None:
                return fd
            try:  # something stands there (or the folder is not ours): from the rootfs's descriptor, like every
                fd = _native.openat2(self.fd, posixpath.join(parent, name).lstrip("/"), O_PATH | os.O_CLOEXEC, 0,
                                     RESOLVE)  # lookup (see mkdirs), a link followed inside the rootfs
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise _error("", path, exc) from None
                fd = self._create(pfd, name, mode, path)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise InjectionError(f"{shown(path)} in container: expected a regular file, found something else")
            return fd
        finally:
            os.close(pfd)

    def _create_new(self, pfd: int, name: str, mode: int, full: str) -> int | None:
        """A new empty file `name` in folder `pfd` (which is on one of own_mounts()), opened for writing (a mount
        target all the same); None when something already stands there or the folder is not ours, for
        ensure_file to look at as every other path."""
        if not self.is_own(pfd):
            return None
        try:
            fd = _native.openat2(pfd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode,
                                 RESOLVE)
        except FileExistsError:
            return None
        except OSError as exc:
            raise _error("cannot create", full, exc) from None
        try:
            self._chown(pfd, name)
        except OSError as exc:
            os.close(fd)
            raise _error("cannot create", full, exc) from None
        return fd

    def _create(self, pfd: int, name: str, mode: int, full: str) -> int:
        self.check_own(pfd, full)
        try:
            wfd = _native.openat2(
                pfd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode, RESOLVE
            )
            os.close(wfd)
            self._chown(pfd, name)
        except FileExistsError:
            pass  # another start on the same image made it since our lookup: checked as a regular file below
        except OSError as exc:
            raise _error("cannot create", full, exc) from None
        try:
            return _native.openat2(pfd, name, O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW, 0, RESOLVE)
        except OSError as exc:  # replaced between the create and this open
            raise _error("cannot open", full, exc) from None

    def ensure_dir(self, path: str) -> int:
        return self.mkdirs(path)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Replace `path`'s content; a symlink or non-regular file in the last component is refused."""
        parent, name = _split(path)
        pfd = self.mkdirs(parent)
        try:
            self.check_own(pfd, path)
            try:  # a file created here cannot be a FIFO or a device node
                fd = _native.openat2(pfd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     mode, RESOLVE | _native.RESOLVE_NO_SYMLINKS)
                self._chown(pfd, name)
            except FileExistsError:
                fd = _open_regular(pfd, name, os.O_WRONLY | os.O_TRUNC, os.O_NOFOLLOW,
                                   RESOLVE | _native.RESOLVE_NO_SYMLINKS, f"cannot write {shown(path)} in container")
            except OSError as exc:
                raise _error("cannot write", path, exc) from None
            try:
                if os.write(fd, data) != len(data):
                    raise InjectionError(f"cannot write {shown(path)} in container: short write (disk full?)")
            except OSError as exc:
                raise _error("cannot write", path, exc) from None
            finally:
                os.close(fd)
        finally:
            os.close(pfd)

    def read_file(self, path: str, limit: int, loop_is_missing: bool = False) -> bytes | None:
        """Up to `limit` bytes of regular file `path` (symlinks followed inside the rootfs); None if missing, and
        with `loop_is_missing` also when the path cannot be resolved (ELOOP: a link loop, or a /proc magic link,
        which dangles wherever the rootfs's procfs is not mounted or is hidden, as it is from ldconfig).

        Anything else standing there is refused (InjectionError) rather than opened: see _open_regular.
        """
        try:
            fd = _open_regular(self.fd, path.lstrip("/") or ".", os.O_RDONLY, 0, RESOLVE, f"{shown(path)} in container",
                               loop_is_missing)
        except _Missing:
            return None
        try:
            return os.read(fd, limit)
        except OSError as exc:
            raise _error("cannot read", path, exc) from None
        finally:
            os.close(fd)

    def symlinks(self, pairs: list[tuple[str, str]]) -> None:
        """symlink(target, link) for each pair, in order; the new ones in runs of the native helper (in_runs)."""

        def settle(i: int, step: int, err: int) -> None:
            target, link = pairs[i]
            if step == _native.LINK_OWNER:  # made, not given to the container's root: symlink() would keep it
                raise _link_error(target, link, OSError(err, os.strerror(err)))
            self.symlink(target, link)  # something stands there, or the folder is not ours: its own way

        self.in_runs([link for _, link in pairs],
                     lambda first, places: _native.NewLinks(
                         [(pfd, name, pairs[first + k][0]) for k, (pfd, name) in enumerate(places)], self.owner),
                     settle)

    def symlink(self, target: str, link: str) -> bool:
        """Create `link` -> `target`. An existing symlink is replaced; a file or directory is left alone.

        Returns False when something else already stands at `link`. Every failure (a read-only or immutable
        image) is one InjectionError line. A link that vanishes between our look and our change (another start
        of the same image directory, whose ldconfig replaces the soname links it manages) is looked at again.
        """
        parent, name = _split(link)
        pfd = self.mkdirs(parent)
        try:
            for _ in range(LINK_TRIES - 1):
                try:
                    return self._symlink_at(pfd, name, target, link)
                except FileNotFoundError:
                    continue
            return self._symlink_at(pfd, name, target, link)
        except OSError as exc:
            raise _link_error(target, link, exc) from None
        finally:
            os.close(pfd)

    def _symlink_at(self, pfd: int, name: str, target: str, link: str) -> bool:
        """One try of symlink(); FileNotFoundError when what it looked at went away meanwhile."""
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISLNK(st.st_mode):
                return False
            if os.readlink(name, dir_fd=pfd) == target:
                return True
        self.check_own(pfd, link)
        if st is not None:
            self.forget_dirs()  # the link may have been a folder on a held path
            os.unlink(name, dir_fd=pfd)
        try:
            os.symlink(target, name, dir_fd=pfd)
            self._chown(pfd, name)
        except FileExistsError:  # another start on the same image made it: fine if it is this very link
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode) or os.readlink(name, dir_fd=pfd) != target:
                raise
        return True

    def mknod(self, path: str, mode: int, major: int, minor: int, kind: str = "c") -> None:
        """A device node with the host's major:minor; an existing node with the same numbers is kept."""
        parent, name = _split(path)
        pfd = self.mkdirs(parent)
        fmt = stat.S_IFCHR if kind == "c" else stat.S_IFBLK
        try:
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None:
                if stat.S_IFMT(st.st_mode) == fmt and st.st_rdev == os.makedev(major, minor):
                    return
                if stat.S_ISDIR(st.st_mode):
                    raise InjectionError(f"cannot create device {shown(path)} in container: a directory stands there")
            self.check_own(pfd, path)
            if st is not None:
                self.forget_dirs()  # it may have been a link to a folder on a held path
                os.unlink(name, dir_fd=pfd)
            try:
                _native.mknodat(pfd, name, fmt | (mode & 0o7777), major, minor)
                self._chown(pfd, name)
            except FileExistsError:  # another start on the same image made it: fine if it is this very node
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if stat.S_IFMT(st.st_mode) != fmt or st.st_rdev != os.makedev(major, minor):
                    raise
        except OSError as exc:
            raise _error("cannot create device", path, exc) from None
        finally:
            os.close(pfd)


class _Missing(InjectionError):
    """The path does not exist (read_file turns this into None)."""


def _open_regular(dirfd: int, rel: str, flags: int, o_extra: int, resolve: int, what: str,
                  loop_is_missing: bool = False) -> int:
    """Open `rel` for I/O only if it is a regular file.

    The hook and the host's ldconfig run outside the container's device cgroup, so opening an image's device
    node opens the host's device (a watchdog, a disk), and opening a FIFO blocks the start forever. The type
    is checked on an O_PATH descriptor (which opens nothing), then the same inode is reopened through it.
    """
    try:
        opath = _native.openat2(dirfd, rel, O_PATH | os.O_CLOEXEC | o_extra, 0, resolve)
    except FileNotFoundError:
        raise _Missing(f"{what}: No such file or directory") from None
    except OSError as exc:
        if loop_is_missing and exc.errno == errno.ELOOP:
            raise _Missing(f"{what}: {exc.strerror}") from None
        raise InjectionError(f"{what}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(opath).st_mode):
            raise InjectionError(f"{what}: not a regular file")
        return os.open(f"/proc/self/fd/{opath}", flags | os.O_CLOEXEC)
    except OSError as exc:
        raise InjectionError(f"{what}: {exc.strerror}") from None
    finally:
        os.close(opath)
