"""inotify through libc, for the long-running watchers (`generate-cdi --watch`, the device plugin's kubelet dir).

Python has no inotify; these processes start once, so ctypes (not the native helper) is cheap enough. A failure
to initialise leaves `available` false and the callers poll.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import struct

IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)


class Inotify:
    """One inotify instance: add watches, select() on `fd`, read the event masks."""

    def __init__(self) -> None:
        self.fd = -1
        self.errno = 0
        self._libc: ctypes.CDLL | None = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.inotify_init1.argtypes = [ctypes.c_int]
            libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        except (OSError, AttributeError):
            return
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        self.errno = ctypes.get_errno() if self.fd < 0 else 0
        self._libc = libc if self.fd >= 0 else None

    @property
    def available(self) -> bool:
        return self._libc is not None

    def add_watch(self, path: str, mask: int) -> int:
        """The watch descriptor, or -1 (no inotify, or the path is gone: the caller's poll covers it)."""
        if self._libc is None:
            return -1
        return int(self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask))

    def read_masks(self) -> list[int]:
        """Every pending event's mask, read without blocking."""
        masks: list[int] = []
        with contextlib.suppress(BlockingIOError, OSError):
            while self.fd >= 0:
                data = os.read(self.fd, 65536)
                if not data:
                    break
                offset = 0
                while offset + _EVENT.size <= len(data):
                    _wd, mask, _cookie, size = _EVENT.unpack_from(data, offset)
                    masks.append(mask)
                    offset += _EVENT.size + size
        return masks

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
            self._libc = None
