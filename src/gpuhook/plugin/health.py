"""Device health: critical NVML XID events, device nodes, and lost GPUs, with recovery.

The incumbent marks a device unhealthy for good; here a device is healthy again once its device nodes exist,
its NVML handle answers and no critical XID arrived for `recovery_window` seconds. Where NVML events are not
supported (no library, no event set, a GPU that refuses registration) the rest of the checks still run.
All NVML use lives in this one thread: the RPC handlers never call NVML.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuhook.errors import DiscoveryError
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record, field
from gpuhook.plugin.devices import PluginDevice
from gpuhook.plugin.state import HealthBoard, Key

log = logging.getLogger("gpuhook.plugin.health")

# Application faults (illegal address, MMU fault from user code, ...): by convention not the device's fault.
DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
NO_INSTANCE = 0xFFFFFFFF
_LOST_ERRORS = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_GPU_NOT_FOUND", "NVML_ERROR_UNKNOWN", "NVML_ERROR_NOT_FOUND",
                "NVML_ERROR_UNINITIALIZED")


def parse_xids(value: str) -> frozenset[int]:
    """'13,31, 43' -> {13, 31, 43}; empty -> no XID ignored."""
    out: set[int] = set()
    for item in (i.strip() for i in value.split(",")):
        if item:
            if not item.isdigit():
                raise ValueError(f"not an XID number: {item!r}")
            out.add(int(item))
    return frozenset(out)


class HealthConfig(Record):
    enabled: bool = True
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    recovery_window: float = 60.0  # seconds without a critical XID before a device counts as healthy again
    interval: float = 1.0  # seconds between device-node / NVML-handle checks
    event_wait_ms: int = 100  # how long one nvmlEventSetWait may block (bounds stop latency)


class _Track(Record, frozen=False):
    """What is wrong with one underlying device right now."""

    gpu: Gpu
    mig: MigDevice | None
    node_paths: tuple[str, ...]
    xid: int = 0
    xid_at: float = -1.0
    node_missing: str = ""
    lost: str = ""

    def reason(self, now: float, window: float) -> str | None:
        if self.node_missing:
            return f"device node {self.node_missing} missing"
        if self.lost:
            return f"GPU {self.gpu.index} lost ({self.lost})"
        if self.xid_at >= 0 and now - self.xid_at < window:
            return f"critical XID {self.xid}"
        return None


class _Gpu(Record, frozen=False):
    gpu: Gpu
    handle: Any = None
    registered: bool = False
    tracks: list[_Track] = field(default_factory=list)


class HealthMonitor:
    """A daemon thread that owns NVML for the process lifetime and writes the HealthBoard."""

    def __init__(self, inv: Inventory, devices: Sequence[PluginDevice], board: HealthBoard, config: HealthConfig,
                 nvml_library: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.board = board
        self.config = config
        self.library = nvml_library
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.events_supported = False
        self.gpus: dict[int, _Gpu] = {}
        self.tracks: dict[Key, _Track] = {}
        for d in devices:
            if d.key in self.tracks:
                continue
            gpu = inv.gpus[d.gpu_index]
            track = _Track(gpu, d.target if isinstance(d.target, MigDevice) else None, d.node_paths)
            self.tracks[d.key] = track
            self.gpus.setdefault(gpu.index, _Gpu(gpu)).tracks.append(track)

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self.config.enabled or not self.tracks:
            return
        self._thread = threading.Thread(target=self._run, name="gpuhook-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            if self.library is None:
                log.warning("health: no NVML library; XID events and lost-GPU checks are off, node checks on")
            else:
                from gpuhook.discover.nvml import bound_nvml

                try:
                    with bound_nvml(self.library) as nv:
                        self._nvml_loop(nv)
                    return
                except DiscoveryError as exc:
                    log.warning("health: NVML unavailable (%s); only device nodes are checked", exc)
            self._loop(None, None)
        except Exception:
            log.exception("health: monitor crashed; health is no longer updated")

    # -- NVML ---------------------------------------------------------------------------------------------------
    def _nvml_loop(self, nv: Any) -> None:
        event_set = None
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("health: NVML events unsupported (%s); checking nodes and GPU handles only", exc)
        for g in self.gpus.values():
            self._acquire(nv, g, event_set)
        self.events_supported = any(g.registered for g in self.gpus.values())
        try:
            self._loop(nv, event_set if self.events_supported else None)
        finally:
            if event_set is not None:
                with contextlib.suppress(nv.NVMLError):
                    nv.nvmlEventSetFree(event_set)

    def _acquire(self, nv: Any, g: _Gpu, event_set: Any) -> None:
        """(Re)take the GPU's handle and (re)register its XID events; failures degrade, never raise."""
        try:
            g.handle = nv.nvmlDeviceGetHandleByUUID(g.gpu.uuid) if g.gpu.uuid else \
                nv.nvmlDeviceGetHandleByIndex(g.gpu.index)
        except nv.NVMLError as exc:
            g.handle = None
            self._set_lost(g, str(exc))
            return
        if event_set is None or g.registered:
            return
        try:
            nv.nvmlDeviceRegisterEvents(g.handle, nv.nvmlEventTypeXidCriticalError, event_set)
            g.registered = True
        except nv.NVMLError as exc:
            log.warning("health: XID events unsupported on GPU %d (%s)", g.gpu.index, exc)

    def _set_lost(self, g: _Gpu, why: str) -> None:
        for t in g.tracks:
            t.lost = why

    def _check_handle(self, nv: Any, g: _Gpu, event_set: Any) -> None:
        if g.handle is None:
            self._acquire(nv, g, event_set)
            if g.handle is None:
                return
        try:
            nv.nvmlDeviceGetUUID(g.handle)
            self._set_lost(g, "")
        except nv.NVMLError as exc:
            if _error_name(nv, exc) in _LOST_ERRORS:
                self._set_lost(g, str(exc))
                g.handle = None  # take a fresh one next time: a recovered GPU has a new handle
                g.registered = False

    def _on_event(self, nv: Any, data: Any) -> None:
        if int(data.eventType) != int(nv.nvmlEventTypeXidCriticalError):
            return
        xid = int(data.eventData)
        g = self._gpu_of(nv, data.device)
        if g is None:
            log.warning("health: XID %d from an unknown device", xid)
            return
        if xid in self.config.ignored_xids:
            log.info("health: ignoring XID %d on GPU %d (application fault)", xid, g.gpu.index)
            return
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        now = self.clock()
        for t in g.tracks:
            if t.mig is not None and gi != NO_INSTANCE and (t.mig.gi != gi or (ci != NO_INSTANCE and t.mig.ci != ci)):
                continue
            t.xid, t.xid_at = xid, now
        log.warning("health: critical XID %d on GPU %d (gi %s, ci %s)", xid, g.gpu.index,
                    "-" if gi == NO_INSTANCE else gi, "-" if ci == NO_INSTANCE else ci)

    def _gpu_of(self, nv: Any, handle: Any) -> _Gpu | None:
        for g in self.gpus.values():
            if g.handle is not None and _same_handle(g.handle, handle):
                return g
        try:
            uuid = nv.nvmlDeviceGetUUID(handle)
        except nv.NVMLError:
            return None
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        return next((g for g in self.gpus.values() if g.gpu.uuid == uuid), None)

    # -- the loop -----------------------------------------------------------------------------------------------
    def _loop(self, nv: Any, event_set: Any) -> None:
        next_check = 0.0
        wait_s = self.config.event_wait_ms / 1000
        while not self._stop.is_set():
            if event_set is not None:
                asked = time.monotonic()
                try:
                    self._on_event(nv, nv.nvmlEventSetWait_v2(event_set, self.config.event_wait_ms))
                except nv.NVMLError as exc:
                    if _error_name(nv, exc) != "NVML_ERROR_TIMEOUT":
                        log.debug("health: event wait: %s", exc)
                        self._stop.wait(wait_s)
                    elif (early := wait_s - (time.monotonic() - asked)) > wait_s / 2:
                        # A "timeout" at once (a driver that does not block): wait out the rest ourselves, or
                        # this loop would spin and take the GIL from Allocate and ListAndWatch.
                        self._stop.wait(early)
            else:
                self._stop.wait(min(wait_s, self.config.interval))
            now = self.clock()
            if now >= next_check:
                next_check = now + self.config.interval
                self._check_nodes()
                if nv is not None:
                    for g in self.gpus.values():
                        self._check_handle(nv, g, event_set)
            self._publish(now)

    def _check_nodes(self) -> None:
        for t in self.tracks.values():
            t.node_missing = next((p for p in t.node_paths if not os.path.exists(p)), "")

    def _publish(self, now: float) -> None:
        for key, t in self.tracks.items():
            self.board.set(key, t.reason(now, self.config.recovery_window))

    def check_once(self) -> None:
        """One node check and publish, without NVML (used when health checks run without the thread)."""
        self._check_nodes()
        self._publish(self.clock())


def _error_name(nv: Any, exc: Exception) -> str:
    value = getattr(exc, "value", None)
    for name in _LOST_ERRORS + ("NVML_ERROR_TIMEOUT", "NVML_ERROR_NOT_SUPPORTED"):
        if getattr(nv, name, object()) == value:
            return name
    return ""


def _same_handle(a: Any, b: Any) -> bool:
    import ctypes

    try:
        return ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return False
