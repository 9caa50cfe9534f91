"""Safe operations inside a container's root filesystem.

The image is hostile: any path component may be a symlink aimed at the host. Every path here is resolved
by the kernel with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) from a descriptor of the rootfs, so a
symlink is followed as if the rootfs were `/` and can never lead out of it, and /proc magic links
(/proc/self/root, /proc/1/root) are refused. Creation happens through *at() calls on descriptors obtained
that way, never through a path string re-resolved later.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat

from .. import _native
from ..errors import InjectionError

RESOLVE = _native.RESOLVE_IN_ROOT | _native.RESOLVE_NO_MAGICLINKS
O_PATH = os.O_PATH


def _split(path: str) -> tuple[str, str]:
    """(parent, name) of a normalised absolute container path."""
    norm = posixpath.normpath("/" + path.lstrip("/"))
    if norm == "/":
        raise InjectionError(f"{path!r}: cannot operate on the container's root itself")
    return posixpath.split(norm)


class RootFS:
    """A container rootfs held open by descriptor; close() (or a with-block) releases it."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise InjectionError(f"cannot open container rootfs {path}: {exc.strerror}") from None

    def __enter__(self) -> RootFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def open(self, path: str, flags: int = O_PATH, mode: int = 0) -> int:
        """A descriptor for `path` resolved inside the rootfs (the caller closes it)."""
        try:
            return _native.openat2(self.fd, path.lstrip("/") or ".", flags | os.O_CLOEXEC, mode, RESOLVE)
        except OSError as exc:
            raise InjectionError(f"{path} in container: {exc.strerror}") from None

    def exists(self, path: str) -> bool:
        try:
            fd = _native.openat2(self.fd, path.lstrip("/") or ".", O_PATH | os.O_CLOEXEC, 0, RESOLVE)
        except OSError:
            return False
        os.close(fd)
        return True

    def mkdirs(self, path: str, mode: int = 0o755) -> int:
        """O_PATH descriptor of directory `path`, creating missing components inside the rootfs."""
        norm = posixpath.normpath("/" + path.lstrip("/"))
        current = os.dup(self.fd)
        try:
            for part in [p for p in norm.split("/") if p]:
                try:
                    nxt = _native.openat2(current, part, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        raise InjectionError(f"{norm} in container: {part!r} is {exc.strerror}") from None
                    self._mkdir_at(current, part, mode, norm)
                    nxt = _native.openat2(current, part, O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE)
                os.close(current)
                current = nxt
            return current
        except BaseException:
            os.close(current)
            raise

    @staticmethod
    def _mkdir_at(dirfd: int, name: str, mode: int, full: str) -> None:
        try:
            os.mkdir(name, mode, dir_fd=dirfd)
        except FileExistsError:
            # A dangling symlink stands there: resolve it inside the root by creating its target.
            raise InjectionError(f"{full} in container: {name!r} exists but is not a usable directory") from None
        except OSError as exc:
            raise InjectionError(f"cannot create {full} in container: {exc.strerror}") from None

    def ensure_file(self, path: str, mode: int = 0o644) -> int:
        """O_PATH descriptor of a regular file at `path` (an empty one is created if missing)."""
        parent, name = _split(path)
        pfd = self.mkdirs(parent)
        try:
            try:
                fd = _native.openat2(pfd, name, O_PATH | os.O_CLOEXEC, 0, RESOLVE)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise InjectionError(f"{path} in container: {exc.strerror}") from None
                fd = self._create(pfd, name, mode, path)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise InjectionError(f"{path} in container: expected a regular file, found something else")
            return fd
        finally:
            os.close(pfd)

    def _create(self, pfd: int, name: str, mode: int, full: str) -> int:
        try:
            wfd = _native.openat2(
                pfd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode, RESOLVE
            )
        except OSError as exc:
            raise InjectionError(f"cannot create {full} in container: {exc.strerror}") from None
        os.close(wfd)
        return _native.openat2(pfd, name, O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW, 0, RESOLVE)

    def ensure_dir(self, path: str) -> int:
        return self.mkdirs(path)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Replace `path`'s content; a symlink or non-regular file in the last component is refused."""
        parent, name = _split(path)
        pfd = self.mkdirs(parent)
        try:
            try:
                fd = _native.openat2(
                    pfd,
                    name,
                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                    mode,
                    RESOLVE | _native.RESOLVE_NO_SYMLINKS,
                )
            except OSError as exc:
                raise InjectionError(f"cannot write {path} in container: {exc.strerror}") from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise InjectionError(f"cannot write {path} in container: not a regular file")
                os.write(fd, data)
            finally:
                os.close(fd)
        finally:
            os.close(pfd)

    def symlink(self, target: str, link: str) -> bool:
        """Create `link` -> `target`. An existing symlink is replaced; a file or directory is left alone.

        Returns False when something else already stands at `link`.
        """
        parent, name = _split(link)
        pfd = self.mkdirs(parent)
        try:
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None:
                if not stat.S_ISLNK(st.st_mode):
                    return False
                if os.readlink(name, dir_fd=pfd) == target:
                    return True
                os.unlink(name, dir_fd=pfd)
            try:
                os.symlink(target, name, dir_fd=pfd)
            except OSError as exc:
                raise InjectionError(f"cannot create link {link} -> {target} in container: {exc.strerror}") from None
            return True
        finally:
            os.close(pfd)

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
                    raise InjectionError(f"cannot create device {path} in container: a directory stands there")
                os.unlink(name, dir_fd=pfd)
            try:
                _native.mknodat(pfd, name, fmt | (mode & 0o7777), major, minor)
            except OSError as exc:
                raise InjectionError(f"cannot create device {path} in container: {exc.strerror}") from None
        finally:
            os.close(pfd)
