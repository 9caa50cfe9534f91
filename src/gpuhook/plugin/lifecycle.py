"""The plugin process: start (discover, write the CDI spec, serve, register), watch kubelet, stop cleanly.

Order matters: kubelet's Register dials our socket before it answers, so every resource is served before it
registers. A recreated `kubelet.sock` (kubelet restarted) means register again; our socket gone (kubelet wiped
its directory) means serve again on a fresh socket, then register. SIGTERM/SIGINT stop serving and remove the
sockets; SIGHUP re-discovers (a device change: new topology, new spec, new lists), and so does a new driver version in
/proc/driver/nvidia/version (a driver upgrade). With a feature file, the GPU feature labels follow every
re-discovery and every health change. While it runs, the hooks' state directory is watched for their record of a
runtime that ignored the CDI devices (plugin/cdiignored.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from types import FrameType

from gpuhook.errors import GpuhookError
from gpuhook.model.contract import STATE_DIR
from gpuhook.model.inventory import Inventory
from gpuhook.model.record import Record, field
from gpuhook.plugin import cdispec, topology
from gpuhook.plugin.cdiignored import CdiIgnoredWatch
from gpuhook.plugin.devices import CDI_STRATEGIES, Options, Resource, plan
from gpuhook.plugin.devicespecs import DeviceSpecs
from gpuhook.plugin.driverversion import VersionWatch, loaded_version
from gpuhook.plugin.featurefile import FeatureFile
from gpuhook.plugin.health import HealthConfig, HealthMonitor
from gpuhook.plugin.nodeconfig import NodeConfigs
from gpuhook.plugin.registration import KUBELET_SOCKET, Registrar
from gpuhook.plugin.server import DevicePluginService, Endpoint, remove_dead_sockets
from gpuhook.plugin.state import HealthBoard
from gpuhook.plugin.watch import DirWatcher

log = logging.getLogger("gpuhook.plugin")

DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
WATCH_TICK = 0.5  # seconds between checks when nothing wakes the watcher


class PluginConfig(Record):
    options: Options = field(default_factory=Options)
    kubelet_dir: str = DEFAULT_KUBELET_DIR
    cdi_spec_dir: str | None = "/var/run/cdi"  # None: write no spec (the names must resolve some other way)
    hook_path: str = "/usr/local/bin/gpuhook"
    host_driver_root: str | None = None  # the driver root as the runtime sees it (None: where it is read)
    host_dev_root: str | None = None  # the /dev root as the runtime sees it (None: where nodes are read)
    health: HealthConfig = field(default_factory=HealthConfig)
    sys_root: str = "/sys"
    nvml_library: str | None = None  # None: the driver root's libnvidia-ml.so.1
    feature_file: str | None = None  # NFD features.d file kept current with the GPU feature labels
    fail_on_init_error: bool = True  # False: no usable GPU leaves the plugin running, serving nothing
    dev_char_path: str | None = None  # /dev/char links for every NVIDIA node (system/devchar.py); None: none
    hook_state_dir: str | None = STATE_DIR  # the hooks' state-dir, watched for a runtime ignoring CDI; None: not
    daemonset: str | None = None  # this pod's DaemonSet: gone at exit, the node's files go too (plugin/removal.py)
    socket_tag: str = ""  # this process's own socket names (devices.Resource.socket_for); "": the plain names
    ready_file: str | None = None  # exists while every resource is registered (a pod's readiness probe)


class Served(Record, frozen=False):
    """One resource being served: its service, socket and registrar."""

    resource: Resource
    service: DevicePluginService
    endpoint: Endpoint
    registrar: Registrar


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


class Plugin:
    def __init__(self, config: PluginConfig, load_inventory: Callable[[], Inventory]) -> None:
        self.config = config
        self.load_inventory = load_inventory
        self.board = HealthBoard()
        self.inventory: Inventory | None = None
        self.resources: list[Resource] = []
        self.served: list[Served] = []
        self.monitor: HealthMonitor | None = None
        self.spec_path = ""
        self.watcher = DirWatcher(config.kubelet_dir)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._pending: tuple[PluginConfig, Callable[[], Inventory]] | None = None  # a new node config to apply
        self.kubelet_socket = os.path.join(config.kubelet_dir, KUBELET_SOCKET)
        self.features = FeatureFile(config.feature_file, config.options) if config.feature_file else None
        self.driver_version = ""  # what /proc/driver/nvidia/version said at the last discovery
        self._version_watch = VersionWatch()
        self.cdi_ignored: CdiIgnoredWatch | None = None  # started by run()

    def _dev_char_links(self, inv: Inventory) -> None:
        """systemd daemon-reload keeps a container's GPU only when its node has a /dev/char link: made at every
        (re)discovery, so nodes that appear later (a driver reload, MIG reconfiguration) get theirs too."""
        from gpuhook.system.devchar import create_links

        try:
            result = create_links(inv, str(self.config.dev_char_path))
        except GpuhookError as exc:
            log.warning("/dev/char links: %s", exc)
            return
        for warning in result.warnings:
            log.warning("/dev/char links: %s", warning)
        if result.created:
            log.info("created %d link(s) in %s", len(result.created), self.config.dev_char_path)

    # -- start / stop -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Discover, plan, write the spec, start health, serve each resource, then ask to register.

        A node without a usable GPU (discovery failing, nothing to advertise) is an error, unless
        `fail_on_init_error` is off: then, as NVIDIA's plugin does on mixed clusters, the process stays up,
        says why, serves and registers nothing, and discovers again on SIGHUP. A configuration the devices
        cannot meet (a MIG layout `single` cannot serve) stays an error either way, as NVIDIA's does."""
        try:
            inv = self.load_inventory()
        except GpuhookError as exc:
            if self.config.fail_on_init_error:
                raise
            self._idle(f"discovery failed: {exc}")
            return
        if self.config.dev_char_path:
            self._dev_char_links(inv)
        resources = plan(inv, self.config.options)
        if not resources:
            why = (f"no device to advertise (driver root {inv.driver_root}, "
                   f"MIG strategy {self.config.options.mig_strategy})")
            if self.config.fail_on_init_error:
                from gpuhook.errors import ConfigError

                raise ConfigError(why)
            self._idle(why)
            return
        cdi_named = any(s in CDI_STRATEGIES for s in self.config.options.list_strategies)
        if self.config.cdi_spec_dir is not None and cdi_named:  # as NVIDIA's: a spec only when Allocate names one
            self.spec_path = cdispec.write(inv, resources, self.config.cdi_spec_dir, self.config.hook_path,
                                           self.config.host_driver_root, self.config.host_dev_root)
            log.info("wrote CDI spec %s", self.spec_path)
        self.inventory, self.resources = inv, resources
        self.driver_version = loaded_version(self.inventory)
        self.update_features()
        devices = [d for r in resources for d in r.devices]
        library = self.config.nvml_library
        if library is None and self.config.health.enabled:
            from gpuhook.discover import nvml_library

            library = nvml_library(inv.driver_root)
        self.monitor = HealthMonitor(inv, devices, self.board, self.config.health, library)
        self.monitor.start()
        if self.config.socket_tag:
            for path in remove_dead_sockets(self.config.kubelet_dir):
                log.info("removed %s: no plugin serves it", path)
        for resource in resources:
            table = topology.build(inv, resource.devices, self.config.sys_root)
            specs = (DeviceSpecs(inv, resource.devices, self.config.host_dev_root)
                     if self.config.options.pass_device_specs else None)
            service = DevicePluginService(resource, self.board, table, self.config.options, inv, specs,
                                          self._marker_key())
            service.on_drop = self.watcher.wake
            socket_name = resource.socket_for(self.config.socket_tag)
            endpoint = Endpoint(service, os.path.join(self.config.kubelet_dir, socket_name))
            endpoint.start()
            registrar = Registrar(self.kubelet_socket, socket_name, resource.name)
            self.served.append(Served(resource, service, endpoint, registrar))
            log.info("%s: %d device(s): %s", resource.name, len(resource.devices),
                     ", ".join(d.id for d in resource.devices))
        for s in self.served:
            s.registrar.request()

    def _idle(self, why: str) -> None:
        self.inventory, self.resources = None, []
        log.warning("%s; failOnInitError is false: serving no devices, not registering (SIGHUP: discover again)",
                    why)

    def shutdown(self) -> None:
        """Stop registering and serving, remove our sockets, stop the health thread."""
        for s in self.served:
            s.registrar.stop()
        for s in self.served:
            s.endpoint.stop()
        self.served = []
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None

    # -- the watch loop -----------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()
        self.watcher.wake()

    def request_reload(self) -> None:
        self._reload.set()
        self.watcher.wake()

    def request_reconfigure(self, config: PluginConfig, load_inventory: Callable[[], Inventory]) -> None:
        """A new configuration (the node's label chose another one): applied by the watch loop, in place."""
        self._pending = (config, load_inventory)
        self.request_reload()

    def install_signal_handlers(self) -> None:
        def on_stop(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            self.request_stop()

        def on_hup(signum: int, frame: FrameType | None) -> None:
            self.request_reload()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    def _marker_key(self) -> bytes:
        """The node's key Allocate seals its CDI marker with, made in the hooks' state directory when missing
        (b"" without one: an unsealed marker, which no hook records)."""
        if not self.config.hook_state_dir:
            return b""
        from gpuhook.fileio.secret import ensure_secret
        from gpuhook.model.contract import PLUGIN_KEY

        return ensure_secret(os.path.join(self.config.hook_state_dir, PLUGIN_KEY))

    def run(self) -> None:
        """Watch until stopped, then shut down. Returns normally (exit 0) after SIGTERM/SIGINT."""
        kubelet = _identity(self.kubelet_socket)
        if self.config.hook_state_dir:
            self.cdi_ignored = CdiIgnoredWatch(self.config.hook_state_dir)
            self.cdi_ignored.start()
        try:
            while not self._stop.is_set():
                self.watcher.wait(WATCH_TICK)
                if self._stop.is_set():
                    break
                if self._reload.is_set() or self._driver_changed():
                    self._reload.clear()
                    self.reload()
                self.update_features()
                now = _identity(self.kubelet_socket)
                restarted = now is not None and now != kubelet
                kubelet = now
                self.check(now[2] if restarted and now else None)
                self.update_ready()
        finally:
            self.update_ready(stopping=True)
            if self.cdi_ignored is not None:
                self.cdi_ignored.stop()
            self.shutdown()
            self.watcher.close()

    def check(self, kubelet_since_ns: int | None) -> None:
        """Serve again where our socket vanished; register again where we re-served or kubelet came back
        (`kubelet_since_ns`: the new kubelet.sock's ctime) unless a registration already reached the new one."""
        for s in self.served:
            if not s.endpoint.socket_intact():
                log.warning("%s: socket %s gone: serving again", s.resource.name, s.endpoint.path)
                s.endpoint.stop(grace=0)
                s.service.stopped.clear()
                s.service.forget_drop()
                s.endpoint.start()
                s.registrar.request()
            elif kubelet_since_ns is not None and not s.registrar.registered_since(kubelet_since_ns):
                log.warning("%s: kubelet.sock recreated: registering again", s.resource.name)
                s.service.forget_drop()
                s.registrar.request()
            elif s.service.dropped_for() > 0 and s.registrar.registered():
                # kubelets before 1.36 keep one client per resource: when the plugin this one replaced stops,
                # they disconnect ours and count the resource unhealthy until a plugin registers again
                log.warning("%s: kubelet ended our ListAndWatch stream: registering again", s.resource.name)
                s.service.forget_drop()
                s.registrar.request()

    def update_ready(self, stopping: bool = False) -> None:
        """The ready file exists while every served resource is registered (none served: idle, also ready), so
        a rolling update replaces the next pod only once this one is kubelet's."""
        path = self.config.ready_file
        if not path:
            return
        ready = not stopping and all(s.registrar.registered() for s in self.served)
        if ready and not os.path.exists(path):
            from gpuhook.fileio.atomic import write_atomic

            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write_atomic(path, b"registered\n")
        elif not ready:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def update_features(self) -> None:
        """Rewrite the feature file when the labels changed (inventory or health); cheap when they did not."""
        if self.features is not None and self.inventory is not None:
            self.features.update(self.inventory, self.board.unhealthy)

    def _driver_changed(self) -> bool:
        """A loaded driver whose version differs from the one discovered: an upgrade, so discover again."""
        return self._version_watch.changed(self.inventory, self.driver_version)

    def reload(self) -> None:
        """A device change or a new configuration: re-discover, recompute topology and the spec, serve and
        register the new lists. A new configuration that cannot start is logged and the previous one serves
        again (a node keeps its GPUs rather than losing them to a bad config)."""
        pending, self._pending = self._pending, None
        previous = (self.config, self.load_inventory)
        if pending is not None:
            self._configure(*pending)
        log.info("reloading: discovering devices again")
        self.shutdown()
        self.board = HealthBoard()
        try:
            self.start()
        except GpuhookError as exc:
            if pending is None:
                raise
            log.error("the new configuration cannot start (%s): serving the previous one again", exc)
            self.shutdown()
            self._configure(*previous)
            self.board = HealthBoard()
            self.start()

    def _configure(self, config: PluginConfig, load_inventory: Callable[[], Inventory]) -> None:
        self.config, self.load_inventory = config, load_inventory
        self.features = FeatureFile(config.feature_file, config.options) if config.feature_file else None


def serve_forever(config: PluginConfig, load_inventory: Callable[[], Inventory],
                  node_configs: NodeConfigs[tuple[PluginConfig, Callable[[], Inventory]]] | None = None) -> None:
    """The `gpuhook device-plugin` body: start, then watch until SIGTERM/SIGINT. With `node_configs`, the
    node's label is followed and each newly chosen configuration applied in place."""
    from gpuhook.plugin.removal import on_stop, watch

    follower = watch(config)  # from the start: an uninstall deletes the DaemonSet, then the plugin's account
    plugin = Plugin(config, load_inventory)
    plugin.install_signal_handlers()
    if node_configs is not None:
        node_configs.follow(lambda chosen: plugin.request_reconfigure(*chosen))
    started = time.monotonic()
    try:
        plugin.start()
    except BaseException:
        plugin.shutdown()
        raise
    log.info("device plugin ready in %.0f ms", (time.monotonic() - started) * 1000)
    plugin.run()
    on_stop(plugin.config, plugin.inventory, follower)
