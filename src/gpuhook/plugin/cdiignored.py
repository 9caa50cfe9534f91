"""Say once that the node's container runtime ignores CDI devices, as soon as a hook or shim has seen it.

The plugin cannot tell by itself: Allocate's answer goes to kubelet, and only the container that starts shows
whether the runtime applied the CDI names (containerd >= 1.7 with enable_cdi, CRI-O) or ignored them (containerd
1.6), its GPUs then coming through NVIDIA_VISIBLE_DEVICES and gpuhook's hook or shim. Those leave a record in the
node's state directory (hook/cdiignored.py, format in model/cdiignored.py); this thread watches the directory
(inotify through plugin/watch.DirWatcher, a poll where there is none or the directory does not exist yet), logs
one warning (model/cdiignored.message) for the first record it sees, one already there at start included, and
then ends: once per plugin process, not per container.
"""

from __future__ import annotations

import logging
import os
import threading

from gpuhook.errors import GpuhookError, clip
from gpuhook.fileio.atomic import read_regular
from gpuhook.model import cdiignored
from gpuhook.model.cdiignored import CdiIgnored, message
from gpuhook.model.contract import CDI_IGNORED_RECORD
from gpuhook.plugin.watch import DirWatcher

log = logging.getLogger("gpuhook.plugin.cdiignored")

TICK = 5.0  # seconds between looks when nothing wakes the watcher (a record written in place, no inotify)


class CdiIgnoredWatch:
    """Watches `<state_dir>/cdi-ignored` on its own thread until it has reported it (or stop())."""

    def __init__(self, state_dir: str, tick: float = TICK) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, CDI_IGNORED_RECORD)
        self.tick = tick
        self.reported: CdiIgnored | None = None
        self._watcher = DirWatcher(state_dir, poll=tick)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unreadable = ""

    def check(self) -> bool:
        """Log the record if it is there and nothing was reported yet; True once reported."""
        if self.reported is not None:
            return True
        try:
            data = read_regular(self.path, follow_links=False, limit=cdiignored.MAX_BYTES)
        except FileNotFoundError:
            return False
        except (OSError, GpuhookError) as exc:  # a link, a FIFO, a directory: not a record, said once at debug
            why = clip(f"{self.path}: {exc}", quote=False)
            if why != self._unreadable:
                log.debug("ignoring %s", why)
                self._unreadable = why
            return False
        rec = cdiignored.parse(data)
        if rec is None:
            return False
        self.reported = rec
        log.warning("%s", message(rec))
        return True

    def run(self) -> None:
        while not self._stop.is_set() and not self.check():
            self._watcher.wait(self.tick)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="gpuhook-cdi-ignored", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._watcher.wake()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self._watcher.close()
