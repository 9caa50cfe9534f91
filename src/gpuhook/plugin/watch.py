"""Wake up when the kubelet's device-plugin directory changes (inotify through libc), else poll.

Kubelet, when it restarts, deletes every socket in the directory and creates `kubelet.sock` anew; the plugin must
serve and register again within a second (the incumbent takes 3-7 ms). inotify makes that immediate; the poll
fallback (no inotify, or the directory itself gone) checks every `poll` seconds. A self-pipe lets a signal
handler cut a wait short.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import struct

log = logging.getLogger("gpuhook.plugin.watch")

IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000
MASK = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):
        return None


class DirWatcher:
    def __init__(self, path: str, poll: float = 0.05) -> None:
        self.path = path
        self.poll = poll
        self._libc = _libc()
        self._fd = -1
        self._watched: tuple[int, int] | None = None
        if self._libc is not None:
            fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0:
                self._fd = fd
            else:
                log.info("inotify unavailable (errno %d); polling %s", ctypes.get_errno(), path)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def _ensure_watch(self) -> bool:
        """Watch the directory that is at `path` now (a recreated directory needs a new watch)."""
        if self._fd < 0 or self._libc is None:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            self._watched = None
            return False
        ident = (st.st_dev, st.st_ino)
        if ident != self._watched:
            if self._libc.inotify_add_watch(self._fd, os.fsencode(self.path), MASK) < 0:
                self._watched = None
                return False
            self._watched = ident
        return True

    def wait(self, timeout: float) -> None:
        """Return after a change in the directory, a wake(), or `timeout` seconds."""
        fds = [self._wake_r]
        if self._ensure_watch():
            fds.append(self._fd)
        else:
            timeout = min(timeout, self.poll)
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            ready = []
        for fd in ready:
            if fd == self._fd:
                self._read_events()
            else:
                self._drain(fd)

    def _read_events(self) -> None:
        """Drain inotify; forget the watch when the directory itself went away (its inode may be reused)."""
        try:
            while True:
                data = os.read(self._fd, 65536)
                if not data:
                    return
                offset = 0
                while offset + 16 <= len(data):
                    _wd, mask, _cookie, size = struct.unpack_from("iIII", data, offset)
                    if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                        self._watched = None
                    offset += 16 + size
        except (BlockingIOError, OSError):
            pass

    def wake(self) -> None:
        """Async-signal-safe: called from a signal handler."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    @staticmethod
    def _drain(fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._wake_r = self._wake_w = -1
