"""`gpuhook generate-cdi --watch`: keep a CDI spec in step with the driver, without restarting any runtime.

CDI consumers read the spec directory when a container starts, so a spec that follows the driver version, the GPU
set and the MIG layout is all a runtime needs. Changes are noticed by `discover.fingerprint` (a few syscalls):
it is recomputed when inotify reports a change under the dev dir, dev/nvidia-caps or the driver's proc directories,
and on a slow poll besides (procfs sends no inotify events; a driver upgrade may touch nothing watched). The spec
is rewritten only when its text changes, always with `atomic.write_atomic` (rename over the old file), so a reader
sees the old spec or the new one and never none. A failed generation keeps the old spec and is retried.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType

from gpuhook.discover import Inventory, Roots, discover
from gpuhook.discover.fingerprint import fingerprint
from gpuhook.discover.roots import join
from gpuhook.errors import GpuhookError
from gpuhook.fileio.atomic import read_regular, write_atomic
from gpuhook.fileio.inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    Inotify,
)
from gpuhook.model.inventory import Gpu, MigDevice

MASK = (IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
        | IN_ONLYDIR)
DEFAULT_POLL_INTERVAL = 10.0
SETTLE = 0.2  # a module reload or MIG reconfiguration is a burst of events: let it finish first

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; the aliases are for type checkers only
if TYPE_CHECKING:  # (a runtime `A | B` of classes needs Python 3.10)
    Device = Gpu | MigDevice
    Render = Callable[[Inventory, list[Device]], str]
Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"gpuhook: {line}", file=sys.stderr, flush=True)


def watched_dirs(roots: Roots) -> list[str]:
    """Where a driver, GPU set or MIG change shows: the dev dir, nvidia-caps and the driver's proc tree
    (capabilities down to the GPU-instance directories, which is where a MIG layout lives)."""
    dev = join(roots.dev_root, "/dev")
    proc = os.path.join(roots.proc_root, "driver/nvidia")
    found = [dev, os.path.join(dev, "nvidia-caps"), proc, os.path.join(proc, "gpus")]
    caps = os.path.join(proc, "capabilities")
    found.append(caps)
    for depth_dirs in _walk(caps, 3):
        found.append(depth_dirs)
    return [p for p in found if os.path.isdir(p)]


def _walk(top: str, depth: int) -> Iterator[str]:
    if depth <= 0:
        return
    try:
        entries = [e for e in os.scandir(top) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for entry in entries:
        yield entry.path
        yield from _walk(entry.path, depth - 1)


def usable_devices(inv: Inventory) -> tuple[list[Device], list[str]]:
    """The spec's default devices that have their device node, and a note for each left out (a GPU whose node is
    gone cannot be used, and would make `generate-cdi` refuse the whole spec)."""
    from gpuhook.cdi.spec import default_devices

    keep: list[Device] = []
    left_out: list[str] = []
    for device in default_devices(inv):
        gap = inv.device_gap(device)
        if not gap:
            keep.append(device)
        else:
            left_out.append(f"{gap}: left out of the spec until it appears")
    return keep, left_out


def _current(path: str) -> bytes | None:
    """The spec now at `path`; None when absent or not a regular file (read_regular never blocks on a FIFO)."""
    try:
        return read_regular(path)
    except (OSError, GpuhookError):
        return None


class SpecWatcher:
    """Regenerates `output` when the fingerprint of `roots` changes; `run()` returns 0 after SIGTERM/SIGINT."""

    def __init__(self, roots: Roots, output: str, render: Render, *, method: str = "auto",
                 poll_interval: float = DEFAULT_POLL_INTERVAL, settle: float = SETTLE, log: Log = _stderr) -> None:
        self.roots = roots
        self.output = os.path.abspath(output)
        self.render = render
        self.method = method
        self.poll_interval = poll_interval
        self.settle = settle
        self.log = log
        self.done = False
        self._written: str | None = None  # fingerprint the spec on disk was made from
        self._last_error = ""
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def refresh(self, force: bool = False) -> bool:
        """Regenerate if the fingerprint moved (or `force`); True if the file was rewritten."""
        fp = fingerprint(self.roots)
        if fp == self._written and not force:
            return False
        try:
            inv = discover(self.roots, method=self.method)
            devices, notes = usable_devices(inv)
            data = self.render(inv, devices).encode()
            if _current(self.output) == data:
                self._written, self._last_error = fp, ""
                return False
            write_atomic(self.output, data, 0o644)
        except GpuhookError as exc:
            message = f"cannot regenerate {self.output} (kept the previous spec): {exc}"
            if message != self._last_error:
                self.log(message)
                self._last_error = message
            return False
        self._written, self._last_error = fp, ""
        for note in notes:
            self.log(note)
        self.log(f"wrote {self.output}: driver {inv.driver_version}, {len(devices)} device(s)")
        return True

    def stop(self, *_: object) -> None:
        """Signal-safe: ends `run()` at its next wake-up."""
        self.done = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _hup(self, _signum: int, _frame: FrameType | None) -> None:
        self._written = None
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def run(self) -> int:
        inotify = Inotify()
        previous = {s: signal.signal(s, self.stop) for s in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._hup)
        mode = "inotify + poll" if inotify.available else "poll only (no inotify)"
        self.log(f"watching {self.roots.driver_root} for driver changes ({mode}, every {self.poll_interval:g}s)")
        try:
            while not self.done:
                for path in watched_dirs(self.roots):  # re-adding is a no-op; a recreated dir gets a new watch
                    inotify.add_watch(path, MASK)
                self.refresh()
                fds = [self._wake_r] + ([inotify.fd] if inotify.available else [])
                ready, _, _ = select.select(fds, [], [], self.poll_interval)
                if inotify.fd in ready and not self.done:
                    time.sleep(self.settle)
                    inotify.read_masks()
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            inotify.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.log("stopped")
        return 0


def watch_spec(roots: Roots, output: str, render: Render, *, method: str = "auto",
               poll_interval: float = DEFAULT_POLL_INTERVAL) -> int:
    return SpecWatcher(roots, output, render, method=method, poll_interval=poll_interval).run()
