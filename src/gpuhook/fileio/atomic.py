"""Atomic file replacement: readers (CDI loaders watching /etc/cdi) see the old file or the new one, never half.

A temp file in the target's directory is written, fsynced and renamed over the target, then the directory is
fsynced so the rename survives a crash. On any failure the temp file is removed and the old file is untouched.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os

from gpuhook.errors import GpuhookError


class WriteError(GpuhookError):
    """A file could not be written (disk full, read-only file system, permission)."""


def _why(exc: OSError) -> str:
    name = errno_mod.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` (file mode `mode`, independent of the umask), creating parent directories."""
    target = os.path.abspath(path)
    folder, name = os.path.split(target)
    tmp = ""
    try:
        os.makedirs(folder, exist_ok=True)
        # O_EXCL on an unguessable name, as mkstemp does (tempfile itself costs ~4 ms of imports)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
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
