"""Writing the files a user names, without ever harming what is already at that path.

What a path holds decides how it is written:
- a regular file or nothing: atomic replacement. A temp file in the target's directory is written, fsynced and
  renamed over the target, then the directory is fsynced so the rename survives a crash; readers (CDI loaders
  watching /etc/cdi) see the old file or the new one, never half. A symlink is replaced by the new file: its
  target is never written, truncated or chmodded.
- the process's own stream (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`): written to that
  descriptor as it is (terminal, pipe or redirected file), as `nvidia-ctk` writes to stdout without `--output`.
- a character device (`/dev/null`, a terminal): written in place, never replaced, truncated or chmodded.
- a FIFO, socket, directory or block device: refused with one line naming the path.
On any failure the temp file is removed and the old file is untouched; temp files a killed writer left behind
are removed by the next write to the same path.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import stat

from gpuhook.errors import GpuhookError

_LINK_HOPS = 8  # /dev/stdout -> /proc/self/fd/1 is one; no sane setup needs more
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISCHR, "a character device"))


class WriteError(GpuhookError):
    """A file could not be written (disk full, read-only file system, permission, not a file we may replace)."""


class FileKindError(GpuhookError):
    """A path that must hold a regular file holds something else (FIFO, socket, directory, device)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.path, self.kind = path, kind


def _why(exc: OSError) -> str:
    name = errno_mod.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def kind_of(mode: int) -> str:
    """'a FIFO', 'a directory', … for a non-regular st_mode; 'a regular file' otherwise."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file")


def read_regular(path: str, follow_links: bool = True, limit: int | None = None) -> bytes:
    """The content of the regular file at `path` (symlinks followed unless `follow_links` is false: then a link
    at `path` is OSError ELOOP), its first `limit` bytes when given. Opened non-blocking, so a FIFO planted at
    the path cannot hold the caller up, and checked with fstat; FileKindError for anything but a regular file,
    OSError (FileNotFoundError when absent) for the rest."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno_mod.ENXIO:  # a unix socket (or a device without its driver) cannot be opened
            raise FileKindError(path, kind_of(os.stat(path).st_mode)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileKindError(path, kind_of(mode))
        chunks, size = [], 0
        while limit is None or size < limit:
            chunk = os.read(fd, 1 << 20 if limit is None else min(limit - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _own_fd(path: str) -> int | None:
    """The descriptor N when `path` (possibly through symlinks, as /dev/stdout -> /proc/self/fd/1) names this
    process's own descriptor N; None otherwise."""
    own = ("dev", "proc/self", "proc/thread-self", f"proc/{os.getpid()}")
    for _ in range(_LINK_HOPS):
        folder, _, name = path.rpartition("/fd/")
        if name.isdigit() and folder.lstrip("/") in own and folder.startswith("/"):
            return int(name)
        try:
            link = os.readlink(path)
        except OSError:
            return None
        path = os.path.normpath(os.path.join(os.path.dirname(path), link))
    return None


def _write_device(target: str, data: bytes) -> None:
    """In place to a character device: no O_CREAT, no O_TRUNC; fstat again after opening, so a node swapped for
    something else in between is refused rather than written."""
    fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISCHR(mode):
            raise WriteError(f"cannot write {target}: it is {kind_of(mode)}")
        os.set_blocking(fd, True)
        _write_all(fd, data)
    finally:
        os.close(fd)


def _sweep(folder: str, name: str) -> None:
    """Remove `.<name>.<pid>.<hex>.tmp` files whose writer no longer runs (killed mid-write)."""
    prefix = f".{name}."
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        if not (entry.startswith(prefix) and entry.endswith(".tmp")):
            continue
        parts = entry[len(prefix):-4].split(".")
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        if pid != os.getpid() and not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, entry))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def write_atomic(path: str, data: bytes, mode: int = 0o644) -> bool:
    """Write `data` to `path` by the rules above (a new file gets mode `mode`, independent of the umask; parent
    directories are created). Returns True when a regular file now holds `data`, False when it went to a
    stream or a character device. WriteError for a refused path or a failed write."""
    target = os.path.abspath(path)
    folder, name = os.path.split(target)
    own = _own_fd(target)
    try:
        if own is not None:
            _write_all(own, data)
            return False
        try:
            st = os.stat(target)  # what the path leads to, symlinks followed
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISCHR(st.st_mode):
            _write_device(target, data)
            return False
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise WriteError(f"cannot write {target}: it is {kind_of(st.st_mode)}, not a regular file")
    except OSError as exc:
        raise WriteError(f"cannot write {target}: {_why(exc)}") from None
    _replace(folder, name, data, mode)
    return True


def write_regular(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically, only ever as a regular file: a link at `path` is not followed (and not
    replaced), a device, FIFO, socket or directory is refused; a missing folder is created (as every write here
    does: _replace). For files gpuhook keeps for itself (the inventory cache, the plugin's record), where nothing
    but its own regular file may stand. WriteError otherwise."""
    target = os.path.abspath(path)
    folder, name = os.path.split(target)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise WriteError(f"cannot write {target}: {_why(exc)}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a link" if stat.S_ISLNK(st.st_mode) else kind_of(st.st_mode)
        raise WriteError(f"cannot write {target}: it is {kind}, not a regular file")
    _replace(folder, name, data, mode)


def _replace(folder: str, name: str, data: bytes, mode: int) -> None:
    target = os.path.join(folder, name)
    tmp = ""
    try:
        os.makedirs(folder, exist_ok=True)
        _sweep(folder, name)
        # O_EXCL on an unguessable name, as mkstemp does (tempfile itself costs ~4 ms of imports)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            _write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        tmp = ""
        _fsync_dir(folder)
    except OSError as exc:
        raise WriteError(f"cannot write {target}: {_why(exc)}") from None
    finally:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
