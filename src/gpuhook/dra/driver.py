"""The DRA driver process: discover, publish the node's ResourceSlice, serve DRAPlugin, register, keep it so.

Order: the checkpoint is read and claim specs it does not list are removed; devices are discovered and the
health monitor (the device plugin's: XID events, device nodes, lost GPUs) started; the slice publisher starts;
the DRA socket is served, then the registration socket (the kubelet dials the DRA socket once it sees the
registration one). A health change republishes the slice (an unhealthy device is withdrawn, a recovered one
comes back); SIGHUP or a new driver version discovers again (devices that appeared or vanished); a socket that
vanished is served again. SIGTERM/SIGINT stop serving and remove our sockets; the slice and the checkpoint stay,
so a restarted driver carries on with the claims the kubelet prepared.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from gpuhook.dra import devices as dra_devices
from gpuhook.dra.checkpoint import FILE as CHECKPOINT_FILE
from gpuhook.dra.devices import DRIVER, DraDevice
from gpuhook.dra.kube import Api
from gpuhook.dra.prepare import PrepareConfig, Preparer
from gpuhook.dra.publish import Publisher
from gpuhook.dra.server import DraService, GrpcEndpoint, RegistrationService, dra_endpoint, registration_endpoint
from gpuhook.errors import GpuhookError
from gpuhook.model.inventory import Gpu, Inventory
from gpuhook.model.record import Record, field
from gpuhook.plugin.driverversion import VersionWatch, loaded_version
from gpuhook.plugin.health import HealthConfig, HealthMonitor
from gpuhook.plugin.state import HealthBoard

log = logging.getLogger("gpuhook.dra")

DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
WATCH_TICK = 0.5  # seconds between checks of the sockets, the health board and the driver version


class DriverConfig(Record):
    node: str
    kubelet_dir: str = DEFAULT_KUBELET_DIR
    cdi_dir: str = "/var/run/cdi"
    hook_path: str = "/usr/local/bin/gpuhook"
    host_driver_root: str | None = None
    host_dev_root: str | None = None  # the /dev root as the runtime sees it (None: where nodes are read)
    health: HealthConfig = field(default_factory=HealthConfig)
    sys_root: str = "/sys"
    nvml_library: str | None = None  # None: the driver root's libnvidia-ml.so.1
    driver: str = DRIVER
    daemonset: str | None = None  # this pod's DaemonSet: gone at exit (an uninstall), the driver's files go too

    @property
    def plugin_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "plugins", self.driver)

    @property
    def dra_socket(self) -> str:
        return os.path.join(self.plugin_dir, "dra.sock")

    @property
    def registration_socket(self) -> str:
        return os.path.join(self.kubelet_dir, "plugins_registry", f"{self.driver}-reg.sock")


class Driver:
    def __init__(self, config: DriverConfig, load_inventory: Callable[[], Inventory], api: Api) -> None:
        self.config = config
        self.load_inventory = load_inventory
        self.api = api
        self.board = HealthBoard()
        self.inventory: Inventory | None = None
        self.devices: list[DraDevice] = []
        self.monitor: HealthMonitor | None = None
        self.preparer = Preparer(
            PrepareConfig(node=config.node, cdi_dir=config.cdi_dir,
                          checkpoint_path=os.path.join(config.plugin_dir, CHECKPOINT_FILE),
                          hook_path=config.hook_path, host_driver_root=config.host_driver_root,
                          host_dev_root=config.host_dev_root, driver=config.driver),
            api.get_claim, self.board, self._apply_sharing)
        self.publisher = Publisher(api, config.node, self._published_devices, config.driver)
        self.registration = RegistrationService(config.driver, config.dra_socket)
        self.endpoints: list[GrpcEndpoint] = []
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._board_version = -1
        self.driver_version = ""
        self._version_watch = VersionWatch()

    # -- devices ----------------------------------------------------------------------------------------------
    def _published_devices(self) -> list[dict[str, Any]]:
        return dra_devices.published(self.devices, set(self.board.unhealthy))

    def _nvml_library(self, inv: Inventory) -> str | None:
        if self.config.nvml_library is not None:
            return self.config.nvml_library
        from gpuhook.discover import nvml_library

        return nvml_library(inv.driver_root)

    def _apply_sharing(self, gpus: list[Gpu]) -> list[str]:
        from gpuhook.dra import timeslice

        return timeslice.apply(self._nvml_library(self.inventory) if self.inventory else None, gpus)

    def discover(self) -> None:
        """(Re)discover: new devices, a new health monitor over them, a new slice. The old monitor stops first:
        it holds this process's NVML, which discovery's child needs (as the device plugin's reload does)."""
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        try:
            inv = self.load_inventory()
            from gpuhook.dra import placement

            found = dra_devices.build(inv, self.config.sys_root, placement.read(self._nvml_library(inv), inv))
        except GpuhookError:
            if self.inventory is not None:
                self._monitor(self.inventory, self.devices)  # the last devices stay watched
            raise
        self.board.unhealthy = {}  # the monitor of the new devices says again what is wrong
        self.inventory, self.devices = inv, found
        self.preparer.set_devices(inv, found)
        self._monitor(inv, found)
        self.driver_version = loaded_version(self.inventory)
        log.info("%d device(s): %s", len(found), ", ".join(d.name for d in found) or "none")
        self.publisher.changed()

    def _monitor(self, inv: Inventory, found: list[DraDevice]) -> None:
        library = self._nvml_library(inv) if self.config.health.enabled else None
        self.monitor = HealthMonitor(inv, found, self.board, self.config.health, library)  # type: ignore[arg-type]
        self.monitor.start()

    # -- start / stop -----------------------------------------------------------------------------------------
    def start(self) -> None:
        orphans = self.preparer.remove_orphans()
        if orphans:
            log.info("removed %d claim spec(s) no prepared claim owns: %s", len(orphans), ", ".join(orphans))
        if self.preparer.claims:
            log.info("checkpoint: %d prepared claim(s): %s", len(self.preparer.claims),
                     ", ".join(sorted(self.preparer.claims)))
        self.discover()
        self._board_version = self.board.version
        self.publisher.start()
        dra = dra_endpoint(DraService(self.preparer), self.config.dra_socket)
        dra.start()
        self.endpoints.append(dra)
        registration = registration_endpoint(self.registration, self.config.registration_socket)
        registration.start()
        self.endpoints.append(registration)

    def shutdown(self) -> None:
        for endpoint in reversed(self.endpoints):  # registration first: the kubelet stops using us
            endpoint.stop()
        self.endpoints = []
        self.publisher.stop()
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None

    # -- the watch loop ---------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        self._reload.set()

    def install_signal_handlers(self) -> None:
        def on_stop(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            self.request_stop()

        def on_hup(signum: int, frame: FrameType | None) -> None:
            self.request_reload()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                version = self.board.wait(self._board_version, WATCH_TICK)
                if self._stop.is_set():
                    break
                if version != self._board_version:
                    self._board_version = version
                    self.publisher.changed()
                if self._reload.is_set() or self._driver_changed():
                    self._reload.clear()
                    try:
                        self.discover()
                    except GpuhookError as exc:
                        log.error("discovering again failed (the last devices stay published): %s", exc)
                self.check_sockets()
        finally:
            self.shutdown()

    def check_sockets(self) -> None:
        """Serve again on a socket that vanished (the registration one is how the kubelet finds us)."""
        for endpoint in self.endpoints:
            if not endpoint.socket_intact():
                log.warning("socket %s gone: serving again", endpoint.path)
                endpoint.stop(grace=0)
                endpoint.start()

    def _driver_changed(self) -> bool:
        """A loaded driver whose version differs from the one discovered: an upgrade, so discover again."""
        return self._version_watch.changed(self.inventory, self.driver_version)


def serve_forever(config: DriverConfig, load_inventory: Callable[[], Inventory], api: Api) -> None:
    """The `gpuhook dra-plugin` body: start, then watch until SIGTERM/SIGINT; after an uninstall, take the
    driver's files off the node."""
    follower = None
    if config.daemonset:  # from the start: an uninstall deletes the DaemonSet, then the driver's account
        from gpuhook.system.daemonset import Watch

        follower = Watch(config.daemonset)
    driver = Driver(config, load_inventory, api)
    driver.install_signal_handlers()
    started = time.monotonic()
    try:
        driver.start()
    except BaseException:
        driver.shutdown()
        raise
    log.info("DRA driver %s ready in %.0f ms", config.driver, (time.monotonic() - started) * 1000)
    driver.run()
    if follower is not None:
        take_off(config, len(driver.preparer.claims), follower.state())


def take_off(config: DriverConfig, prepared: int, daemonset: tuple[str, str]) -> list[str]:
    """When the DaemonSet is gone (an uninstall) and no claim is prepared any more: remove the checkpoint and the
    driver's folder under the kubelet's plugins (the sockets went at shutdown). A prepared claim keeps both (its
    pod still runs; a driver installed again carries on with it); a DaemonSet still there (a rolling update, a
    restart) or an API that cannot be asked keeps everything for the next pod."""
    from gpuhook.system.daemonset import GONE

    state, why = daemonset
    if state != GONE:
        log.info("%s: the driver's files stay on the node", why)
        return []
    if prepared:
        log.warning("%s, but %d claim(s) are still prepared: the checkpoint and their CDI specs stay", why, prepared)
        return []
    removed = []
    checkpoint = os.path.join(config.plugin_dir, CHECKPOINT_FILE)
    if os.path.lexists(checkpoint):
        os.unlink(checkpoint)
        removed.append(checkpoint)
    try:
        os.rmdir(config.plugin_dir)  # only when empty: anything else there is not ours
        removed.append(config.plugin_dir)
    except OSError:
        pass
    log.info("%s: removed %s", why, ", ".join(removed) or "nothing (none left)")
    return removed
