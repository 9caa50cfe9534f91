"""`gpuhook dra-plugin`: the kubelet DRA driver gpu.nvidia.com; runs until SIGTERM (exit 0)."""

from __future__ import annotations

import logging
import os
import sys

import click

from gpuhook.cli.app import CACHE_OPTION, root_options
from gpuhook.cli.inventory import load_inventory
from gpuhook.cli.plugin import default_hook_path
from gpuhook.errors import ConfigError, GpuhookError, clip
from gpuhook.plugin.health import DEFAULT_IGNORED_XIDS, HealthConfig, parse_xids


@click.command("dra-plugin")
@root_options
@click.option("--node-name", envvar="NODE_NAME", show_envvar=True, required=True,
              help="This node's name: the pool of its ResourceSlice; claims allocated elsewhere are refused "
                   "(the DaemonSet sets it from spec.nodeName).")
@click.option("--kubelet-dir", default="/var/lib/kubelet", show_default=True,
              help="The kubelet's root: plugins_registry/ and plugins/gpu.nvidia.com/ are under it.")
@click.option("--cdi-dir", envvar="CDI_DIR", show_envvar=True, default="/var/run/cdi", show_default=True,
              help="Where the runtime reads CDI specs: each prepared claim's spec is written there.")
@click.option("--kubeconfig", envvar="KUBECONFIG", show_envvar=True, default=None,
              help="Kubeconfig file [default: the in-cluster service account].")
@click.option("--api-server", default=None, metavar="URL",
              help="Talk to this API server URL without credentials (tests) [default: from the kubeconfig].")
@click.option("--host-driver-root", "--nvidia-driver-root", envvar="NVIDIA_DRIVER_ROOT", show_envvar=True,
              default=None,
              help="The driver root as the container runtime sees it, when it differs from --driver-root.")
@click.option("--host-dev-root", envvar="NVIDIA_DEV_ROOT", show_envvar=True, default=None,
              help="The root of /dev as the container runtime sees it, when it differs from --dev-root "
                   "[default: --host-driver-root when the driver and /dev were read from one root].")
@click.option("--hook-path", default=None, help="Host path of gpuhook for the CDI spec's hooks [default: this one].")
@click.option("--health-checks", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="XID events, device nodes and lost GPUs withdraw a device from the ResourceSlice.")
@click.option("--ignored-xids", default=",".join(str(x) for x in sorted(DEFAULT_IGNORED_XIDS)), show_default=True,
              help="XIDs that are application faults, not device faults (comma list; empty: none ignored).")
@click.option("--recovery-window", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds without a critical XID before a device is published again.")
@click.option("--health-interval", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Seconds between device-node and GPU-handle checks.")
@click.option("--sys-root", default="/sys", show_default=True, help="sysfs, for each GPU's PCIe root.")
@click.option("--daemonset", envvar="GPUHOOK_DAEMONSET", default=None, metavar="NAME",
              help="This pod's DaemonSet (in its service account's namespace): when the driver stops, that DaemonSet "
                   "is gone and no claim is prepared, its checkpoint and folder are removed from the node "
                   "[default: everything stays].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@CACHE_OPTION
def dra_plugin(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str, node_name: str,
               kubelet_dir: str, cdi_dir: str, kubeconfig: str | None, api_server: str | None,
               host_driver_root: str | None, host_dev_root: str | None, hook_path: str | None, health_checks: str,
               ignored_xids: str, recovery_window: float, health_interval: float, sys_root: str,
               daemonset: str | None, log_level: str, inventory_cache: str | None) -> None:
    """Kubelet DRA driver gpu.nvidia.com: publish GPUs in a ResourceSlice, prepare claims as CDI devices."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":
        for noisy in ("httpx", "httpcore", "httpx2"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        xids = parse_xids(ignored_xids)
    except ValueError as exc:
        raise ConfigError(f"--ignored-xids: {exc}") from None
    if not node_name.strip():
        raise ConfigError("--node-name is empty: give this node's name (NODE_NAME)")
    try:
        from gpuhook.dra.driver import DriverConfig, serve_forever
        from gpuhook.dra.kube import Api
    except ImportError as exc:
        raise GpuhookError(f"dra-plugin needs the `dra` extra (pip install 'gpuhook[dra]'): "
                           f"{clip(str(exc), quote=False)}") from None
    config = DriverConfig(
        node=node_name,
        kubelet_dir=os.path.abspath(kubelet_dir),
        cdi_dir=os.path.abspath(cdi_dir),
        hook_path=hook_path or default_hook_path(),
        host_driver_root=host_driver_root,
        host_dev_root=host_dev_root,
        health=HealthConfig(enabled=health_checks == "on", ignored_xids=xids, recovery_window=recovery_window,
                            interval=health_interval),
        sys_root=sys_root,
        daemonset=daemonset or None,
    )
    api = Api(kubeconfig=kubeconfig, server=api_server)
    read_root = driver_root
    # as the device plugin and node-setup: the DaemonSet may name the driver's procfs in its environment
    proc_root = proc_root or os.environ.get("GPUHOOK_PROC_ROOT") or None
    try:
        serve_forever(config, lambda: load_inventory(read_root, dev_root, proc_root, discovery, inventory_cache), api)
    except OSError as exc:
        raise GpuhookError(f"dra-plugin: {exc}") from None
    finally:
        api.close()
