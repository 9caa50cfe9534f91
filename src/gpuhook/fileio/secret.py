"""A node's secret in a root-only file: read only when it is a regular file of root's that nobody else may read,
made (random, 0600) when missing. The device plugin seals its CDI marker with it and the hook checks the seal
(hook/cdiignored.py), so the file must never be readable from a container: it lives in the state directory."""

from __future__ import annotations

import os
import stat

from gpuhook.errors import GpuhookError

MAX_BYTES = 256


def read_secret(path: str) -> bytes:
    """The secret at `path`; b"" when there is none, or it is not a root-only regular file (never through a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            return b""
        return os.read(fd, MAX_BYTES).strip()
    finally:
        os.close(fd)


def ensure_secret(path: str) -> bytes:
    """The secret at `path`, made first when missing (32 random bytes, hex, mode 0600) in its folder, which must
    exist (whoever owns the folder makes it: on a node, the DaemonSet's hostPath); b"" when it cannot be had (no
    such folder, not root): then nothing is sealed and no record is written."""
    found = read_secret(path)
    if found or not os.path.isdir(os.path.dirname(path)):
        return found
    from gpuhook.fileio.atomic import write_regular

    try:
        write_regular(path, os.urandom(32).hex().encode() + b"\n", 0o600)
    except (OSError, GpuhookError):
        return b""
    return read_secret(path)
