"""The hook's and the shim's log file: one line per container start, best effort.

Logging must never fail or hold up a start: a full disk, a read-only or missing log directory, a FIFO or a device
at the path are all silently skipped. A line goes out in one O_APPEND write, so concurrent hooks never interleave,
and a write the disk cuts short is taken back, so the file never holds half a line.
"""

from __future__ import annotations

import os
import stat


def append_log(path: str, line: str, follow_links: bool = True, mode: int = 0o640) -> None:
    """Append `line` to the log at `path`, whole or not at all; never raises. `follow_links=False`: never
    through a link (the shim's runc `--log` file, a path the runtime's caller names)."""
    if not path:
        return
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags | (0 if follow_links else os.O_NOFOLLOW), mode)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        data = (line + "\n").encode(errors="replace")
        written = os.write(fd, data)
        if written < len(data):  # ENOSPC part-way: take the partial line back unless another writer followed
            end = os.lseek(fd, 0, os.SEEK_CUR)
            if os.fstat(fd).st_size == end:
                os.ftruncate(fd, end - written)
    except OSError:
        pass
    finally:
        os.close(fd)
