"""The hook's and the shim's log file: one line per container start, best effort.

Logging must never fail or hold up a start: a full disk, a read-only or missing log directory, a FIFO or a device
at the path are all silently skipped. A line goes out in one O_APPEND write, so concurrent hooks never interleave,
and a write the disk cuts short is taken back, so the file never holds half a line. A line is one line: every
control character in it (an OCI state's id is the client's string) is written as an escape, never as itself.
The file is opened without following a link at its name: the resident service writes it as root, for whoever
names the config.
"""

from __future__ import annotations

import os
import stat

_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}


def one_line(text: str) -> str:
    """`text` with every control character (newlines included) written as a \\xNN escape."""
    return text.translate(_ESCAPES)


def append_log(path: str, line: str, mode: int = 0o640) -> None:
    """Append `line` (one_line) to the log at `path`, whole or not at all; never raises. Never through a link
    at the name."""
    if not path:
        return
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, mode)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        data = (one_line(line) + "\n").encode(errors="replace")
        written = os.write(fd, data)
        if written < len(data):  # ENOSPC part-way: take the partial line back unless another writer followed
            end = os.lseek(fd, 0, os.SEEK_CUR)
            if os.fstat(fd).st_size == end:
                os.ftruncate(fd, end - written)
    except OSError:
        pass
    finally:
        os.close(fd)
