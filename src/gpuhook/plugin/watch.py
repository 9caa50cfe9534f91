"""Wake up when the kubelet's device-plugin directory changes (inotify through libc), else poll.

Kubelet, when it restarts, deletes every socket in the directory and creates `kubelet.sock` anew; the plugin must
serve and register again within a second (the incumbent takes 3-7 ms). inotify makes that immediate; the poll
fallback (no inotify, or the directory itself gone) checks every `poll` seconds. A self-pipe lets a signal
handler cut a wait short.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select

from gpuhook.fileio.inotify import (
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    Inotify,
)

log = logging.getLogger("gpuhook.plugin.watch")

MASK = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF


class DirWatcher:
    def __init__(self, path: str, poll: float = 0.05) -> None:
        self.path = path
        self.poll = poll
        self._inotify = Inotify()
        self._watched: tuple[int, int] | None = None
        if not self._inotify.available:
            log.info("inotify unavailable (errno %d); polling %s", self._inotify.errno, path)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def _ensure_watch(self) -> bool:
        """Watch the directory that is at `path` now (a recreated directory needs a new watch)."""
        if not self._inotify.available:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            self._watched = None
            return False
        ident = (st.st_dev, st.st_ino)
        if ident != self._watched:
            if self._inotify.add_watch(self.path, MASK) < 0:
                self._watched = None
                return False
            self._watched = ident
        return True

    def wait(self, timeout: float) -> None:
        """Return after a change in the directory, a wake(), or `timeout` seconds."""
        fds = [self._wake_r]
        if self._ensure_watch():
            fds.append(self._inotify.fd)
        else:
            timeout = min(timeout, self.poll)
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            ready = []
        for fd in ready:
            if fd == self._inotify.fd:
                self._read_events()
            else:
                self._drain(fd)

    def _read_events(self) -> None:
        """Drain inotify; forget the watch when the directory itself went away (its inode may be reused)."""
        if any(mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF) for mask in self._inotify.read_masks()):
            self._watched = None

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
        self._inotify.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1
