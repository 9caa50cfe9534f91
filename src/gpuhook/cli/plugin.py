"""`gpuhook device-plugin`: parse flags, build a PluginConfig, run until SIGTERM (exit 0)."""

from __future__ import annotations

import logging
import os
import sys

import click

from gpuhook.cli.app import CACHE_OPTION, root_options
from gpuhook.cli.inventory import load_inventory
from gpuhook.errors import ConfigError, GpuhookError
from gpuhook.plugin.devices import ID_STRATEGIES, LIST_STRATEGIES, MIG_STRATEGIES, Options, parse_list_strategies
from gpuhook.plugin.health import DEFAULT_IGNORED_XIDS, HealthConfig, parse_xids
from gpuhook.plugin.lifecycle import DEFAULT_KUBELET_DIR, PluginConfig, serve_forever


def default_hook_path() -> str:
    """The gpuhook the CDI spec's hooks call: the installed one (discover/executables.py), else the usual place."""
    from gpuhook.discover.executables import gpuhook_executable

    return gpuhook_executable() or "/usr/local/bin/gpuhook"


@click.command("device-plugin")
@root_options
@click.option("--kubelet-dir", default=DEFAULT_KUBELET_DIR, show_default=True,
              help="Kubelet's device-plugin directory (kubelet.sock and our sockets).")
@click.option("--resource-name", default="nvidia.com/gpu", show_default=True, help="Extended resource advertised.")
@click.option("--device-list-strategy", default="cdi-cri", show_default=True,
              help=f"How Allocate names devices: comma list of {', '.join(LIST_STRATEGIES)}. volume-mounts "
                   "needs accept-volume-mounts = true in the nodes' gpuhook config (off by default, as NVIDIA's).")
@click.option("--device-id-strategy", type=click.Choice(ID_STRATEGIES), default="uuid", show_default=True,
              help="Device ids kubelet sees (and CDI names Allocate returns).")
@click.option("--mig-strategy", type=click.Choice(MIG_STRATEGIES), default="none", show_default=True,
              help="none: whole GPUs; single: MIG devices as the resource; mixed: nvidia.com/mig-<profile> too.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Time-slicing: advertise each device N times as <id>::<n>.")
@click.option("--cdi-spec-dir", default="/var/run/cdi", show_default=True,
              help="Where the CDI spec for the advertised devices is written (nvidia.com-gpu.yaml).")
@click.option("--host-driver-root", default=None,
              help="The driver root as the container runtime sees it, when it differs from --driver-root "
                   "(the plugin runs in a container) [default: --driver-root].")
@click.option("--hook-path", default=None, help="Host path of gpuhook for the CDI spec's hooks [default: this one].")
@click.option("--health-checks", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="XID events, device nodes and lost GPUs mark devices unhealthy.")
@click.option("--ignored-xids", default=",".join(str(x) for x in sorted(DEFAULT_IGNORED_XIDS)), show_default=True,
              help="XIDs that are application faults, not device faults (comma list; empty: none ignored).")
@click.option("--recovery-window", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds without a critical XID (node present, GPU answering) before a device is healthy again.")
@click.option("--health-interval", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Seconds between device-node and GPU-handle checks.")
@click.option("--sys-root", default="/sys", show_default=True, help="sysfs for NUMA nodes NVML does not give.")
@click.option("--feature-file", default=None,
              help="Keep an NFD feature file of GPU labels current, e.g. "
                   "/etc/kubernetes/node-feature-discovery/features.d/gpuhook [default: none].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@CACHE_OPTION
def device_plugin(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str, kubelet_dir: str,
                  resource_name: str, device_list_strategy: str, device_id_strategy: str, mig_strategy: str,
                  replicas: int, cdi_spec_dir: str, host_driver_root: str | None, hook_path: str | None,
                  health_checks: str, ignored_xids: str, recovery_window: float, health_interval: float,
                  sys_root: str, feature_file: str | None, log_level: str, inventory_cache: str | None) -> None:
    """Kubelet device plugin: advertise GPUs with health, answer Allocate with CDI device names."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        xids = parse_xids(ignored_xids)
    except ValueError as exc:
        raise ConfigError(f"--ignored-xids: {exc}") from None
    options = Options(resource_name=resource_name, id_strategy=device_id_strategy, mig_strategy=mig_strategy,
                      replicas=replicas, list_strategies=parse_list_strategies(device_list_strategy))
    options.check()
    config = PluginConfig(
        options=options,
        kubelet_dir=os.path.abspath(kubelet_dir),
        cdi_spec_dir=os.path.abspath(cdi_spec_dir),
        hook_path=hook_path or default_hook_path(),
        host_driver_root=host_driver_root,
        health=HealthConfig(enabled=health_checks == "on", ignored_xids=xids, recovery_window=recovery_window,
                            interval=health_interval),
        sys_root=sys_root,
        feature_file=os.path.abspath(feature_file) if feature_file else None,
    )
    try:
        serve_forever(config, lambda: load_inventory(driver_root, dev_root, proc_root, discovery,
                                                            inventory_cache))
    except OSError as exc:
        raise GpuhookError(f"device plugin: {exc}") from None
