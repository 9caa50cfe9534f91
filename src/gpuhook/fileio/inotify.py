"""inotify for the long-running watchers (`generate-cdi --watch`, the device plugin's kubelet dir), through
`inotify_simple`. A failure to initialise leaves `available` false and the callers poll."""

from __future__ import annotations

import contextlib
import os

from inotify_simple import INotify, flags

IN_CLOSE_WRITE = int(flags.CLOSE_WRITE)
IN_MOVED_FROM = int(flags.MOVED_FROM)
IN_MOVED_TO = int(flags.MOVED_TO)
IN_CREATE = int(flags.CREATE)
IN_DELETE = int(flags.DELETE)
IN_DELETE_SELF = int(flags.DELETE_SELF)
IN_MOVE_SELF = int(flags.MOVE_SELF)
IN_IGNORED = int(flags.IGNORED)
IN_ONLYDIR = int(flags.ONLYDIR)


class Inotify:
    """One inotify instance: add watches, select() on `fd`, read the event masks."""

    def __init__(self) -> None:
        self.fd = -1
        self.errno = 0
        self._inotify: INotify | None = None
        try:
            self._inotify = INotify(nonblocking=True)
        except OSError as exc:
            self.errno = exc.errno or 0
            return
        self.fd = self._inotify.fileno()

    @property
    def available(self) -> bool:
        return self._inotify is not None

    def add_watch(self, path: str, mask: int) -> int:
        """The watch descriptor, or -1 (no inotify, or the path is gone: the caller's poll covers it)."""
        if self._inotify is None:
            return -1
        try:
            return int(self._inotify.add_watch(os.fsencode(path), mask))
        except OSError:
            return -1

    def read_masks(self) -> list[int]:
        """Every pending event's mask, read without blocking."""
        if self._inotify is None:
            return []
        masks: list[int] = []
        with contextlib.suppress(BlockingIOError, OSError):
            while True:
                events = self._inotify.read(timeout=0)
                if not events:
                    break
                masks += [event.mask for event in events]
        return masks

    def close(self) -> None:
        if self._inotify is not None:
            with contextlib.suppress(OSError):
                self._inotify.close()
            self._inotify = None
            self.fd = -1
