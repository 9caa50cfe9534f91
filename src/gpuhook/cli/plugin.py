"""`gpuhook device-plugin`: parse flags, the environment and NVIDIA's config file, build a PluginConfig, run
until SIGTERM (exit 0).

NVIDIA's environment variables are the flags' `envvar`s (click reads the command line first, then the
environment, as urfave/cli does); plugin/settings.py puts both before the config file (plugin/config.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from gpuhook.cli.app import CACHE_OPTION
from gpuhook.cli.inventory import load_inventory
from gpuhook.errors import ConfigError, GpuhookError, clip
from gpuhook.model.contract import STATE_DIR
from gpuhook.model.inventory import Inventory
from gpuhook.plugin.devices import (
    DEFAULT_LIST_STRATEGIES,
    ID_STRATEGIES,
    LIST_STRATEGIES,
    MIG_STRATEGIES,
    Options,
    parse_list_strategies,
)
from gpuhook.plugin.health import DEFAULT_IGNORED_XIDS, HealthConfig, parse_xids
from gpuhook.plugin.lifecycle import DEFAULT_KUBELET_DIR, PluginConfig, serve_forever
from gpuhook.plugin.nodeconfig import DEFAULT_FALLBACKS, DEFAULT_LABEL
from gpuhook.plugin.nvidiaflags import FLAGS, GATED_FLAGS, NvidiaFlag, health_settings
from gpuhook.plugin.settings import GO_TRUE as GO_TRUE_WORDS
from gpuhook.plugin.settings import parse_go_bool, plugin_roots, resolve

log = logging.getLogger("gpuhook.plugin")


class GoBool(click.ParamType):
    """A boolean flag value as NVIDIA's (urfave/cli) reads it, from the command line or the environment."""

    name = "boolean"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool:
        if isinstance(value, bool):
            return value
        try:
            return parse_go_bool(str(value))
        except ValueError as exc:
            self.fail(clip(str(exc), quote=False), param, ctx)


# click parameter -> gpuhook setting (plugin/settings.SETTINGS) where the names differ: NVIDIA's --driver-root is
# the host's root (the file's nvidiaDriverRoot), --driver-root-ctr-path where this process reads it
PARAM_SETTING = {"device_list_strategy": "list_strategies", "device_id_strategy": "id_strategy",
                 "driver_root": "host_driver_root", "dev_root": "host_dev_root",
                 "driver_root_ctr_path": "driver_root"}


def _limited(flag: NvidiaFlag) -> Any:
    """The callback of an NVIDIA flag gpuhook takes for some values only: anything else is refused, naming
    what to use instead."""
    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None or flag.accepted is None:
            return value
        text = str(value)
        if flag.param == "imex_required":
            try:
                text = str(parse_go_bool(text)).lower()
            except ValueError as exc:
                raise click.BadParameter(clip(str(exc), quote=False)) from None
        if text in flag.accepted or (text == "" and not flag.accepted):
            return value
        raise click.BadParameter(f"{clip(value)} is not taken by gpuhook: {flag.instead}")
    return check


def nvidia_limited_options(f: Any) -> Any:
    """NVIDIA's flags gpuhook takes for some values only, or refuses (nvidiaflags.FLAGS with `accepted`), under
    NVIDIA's names and variables; discovery is the --discovery option's."""
    for flag in reversed([x for x in FLAGS if x.accepted is not None and x.param != "discovery"]):
        what = (f"only {', '.join(flag.accepted)}" if flag.accepted else "refused when set") + f": {flag.instead}"
        f = click.option(*(f"--{n}" for n in flag.names), flag.param, envvar=list(flag.env), show_envvar=True,
                         default=None, callback=_limited(flag), help=f"NVIDIA's flag; {what}.")(f)
    return f


def _discovery(ctx: click.Context, param: click.Parameter, value: str) -> str:
    (flag,) = [x for x in FLAGS if x.param == "discovery"]
    if value in ("auto", "nvml", "procfs"):
        return value
    raise click.BadParameter(f"{clip(value)} is not taken by gpuhook: {flag.instead}")


def _old_host_root(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.BadParameter("--host-driver-root is now --driver-root (the host's driver root, as NVIDIA's "
                                 "plugin means it); where this process reads it is --driver-root-ctr-path")


def default_hook_path() -> str:
    """The gpuhook the CDI spec's hooks call: the installed one (discover/executables.py), else the usual place."""
    from gpuhook.discover.executables import gpuhook_executable

    return gpuhook_executable() or "/usr/local/bin/gpuhook"


@click.command("device-plugin")
@click.option("--driver-root", "--nvidia-driver-root", "driver_root", envvar="NVIDIA_DRIVER_ROOT", show_envvar=True,
              default=None, help="The host's driver root, where the container runtime finds the driver (NVIDIA's "
                                 "meaning; typical: / or /run/nvidia/driver) [default: the hook config's, else /].")
@click.option("--dev-root", "--nvidia-dev-root", "dev_root", envvar="NVIDIA_DEV_ROOT", show_envvar=True, default=None,
              help="The host's root of /dev [default: the driver root].")
@click.option("--driver-root-ctr-path", "--container-driver-root", "driver_root_ctr_path",
              envvar=["DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"], show_envvar=True, default=None,
              help="Where this process reads the host's driver root when it runs in a container [default: "
                   "/driver-root where it exists (NVIDIA's chart mounts it there), else --driver-root]; the spec's "
                   "host paths are rebased from it to --driver-root.")
@click.option("--host-driver-root", "old_host_root", hidden=True, default=None, expose_value=False,
              callback=_old_host_root)
@click.option("--proc-root", envvar="GPUHOOK_PROC_ROOT", default=None,
              help="procfs to read /driver/nvidia from [default: /proc].")
@click.option("--discovery", "--device-discovery-strategy", "discovery", envvar="DEVICE_DISCOVERY_STRATEGY",
              show_envvar=True, default="auto", show_default=True, callback=_discovery,
              help="Where GPUs come from: auto, nvml or procfs (NVIDIA's tegra is not supported).")
@click.option("--kubelet-socket", envvar="KUBELET_SOCKET", show_envvar=True, default=None,
              help="kubelet's registration socket, NVIDIA's way to name it: <dir>/kubelet.sock sets --kubelet-dir.")
@click.option("--gdrcopy-enabled", envvar="GDRCOPY_ENABLED", show_envvar=True, type=GoBool(), default=None,
              is_flag=False, flag_value="true", help="Allocate sets NVIDIA_GDRCOPY=enabled (also: NVIDIA_GDRCOPY="
                                                      "enabled in this process's environment).")
@click.option("--gds-enabled", envvar="GDS_ENABLED", show_envvar=True, type=GoBool(), default=None, is_flag=False,
              flag_value="true", help="Allocate sets NVIDIA_GDS=enabled (also: NVIDIA_GDS=enabled here).")
@click.option("--mofed-enabled", envvar="MOFED_ENABLED", show_envvar=True, type=GoBool(), default=None,
              is_flag=False, flag_value="true", help="Allocate sets NVIDIA_MOFED=enabled (also: NVIDIA_MOFED="
                                                      "enabled here).")
@click.option("--mps-root", envvar="MPS_ROOT", show_envvar=True, default=None,
              help="NVIDIA's MPS root: taken and unused (MPS sharing is refused in the config file).")
@nvidia_limited_options
@click.option("--kubelet-dir", default=DEFAULT_KUBELET_DIR, show_default=True,
              help="Kubelet's device-plugin directory (kubelet.sock and our sockets).")
@click.option("--config-file", envvar="CONFIG_FILE", default=None, show_envvar=True,
              help="NVIDIA k8s-device-plugin's config file (v1 schema, e.g. its ConfigMap mounted): flags, "
                   "sharing.timeSlicing. Flags and environment variables win over it.")
@click.option("--config-file-srcdir", "config_dir", envvar="CONFIG_FILE_SRCDIR", default=None, show_envvar=True,
              metavar="DIR", help="Named configs, one file each (NVIDIA's chart's config.map mounted): the node label "
                                  "--node-label picks one, followed while the plugin runs (needs --node-name).")
@click.option("--default-config", envvar="DEFAULT_CONFIG", default="", show_envvar=True,
              help="The config a node without the label gets (with --config-file-srcdir).")
@click.option("--fallback-strategies", envvar="FALLBACK_STRATEGIES", default=",".join(DEFAULT_FALLBACKS),
              show_default=True, show_envvar=True,
              help="No label, no default: named (a config called default), single (the only one), empty (none).")
@click.option("--node-name", envvar="NODE_NAME", default=None, show_envvar=True, help="This node's name.")
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, show_envvar=True, metavar="FILE",
              help="Where to read the node label when not in a pod [default: the pod's service account].")
@click.option("--node-label", envvar="NODE_LABEL", default=DEFAULT_LABEL, show_default=True, show_envvar=True,
              help="The node label that names the config.")
@click.option("--resource-name", default="nvidia.com/gpu", show_default=True, help="Extended resource advertised.")
@click.option("--device-list-strategy", envvar="DEVICE_LIST_STRATEGY", show_envvar=True,
              default=",".join(DEFAULT_LIST_STRATEGIES), show_default=True,
              help=f"How Allocate names devices: comma list of {', '.join(LIST_STRATEGIES)}. The default gives "
                   "CDI names and NVIDIA_VISIBLE_DEVICES, so runtimes without CDI (containerd 1.6) get the GPU "
                   "through gpuhook's hook; the spec's NVIDIA_VISIBLE_DEVICES=void stops a second injection where "
                   "the runtime applies CDI. volume-mounts needs accept-volume-mounts = true in the nodes' gpuhook "
                   "config (off by default, as NVIDIA's).")
@click.option("--device-id-strategy", envvar="DEVICE_ID_STRATEGY", show_envvar=True, type=click.Choice(ID_STRATEGIES),
              default="uuid", show_default=True, help="Device ids kubelet sees (and CDI names Allocate returns).")
@click.option("--mig-strategy", envvar="MIG_STRATEGY", show_envvar=True, type=click.Choice(MIG_STRATEGIES),
              default="none", show_default=True,
              help="none: whole GPUs; single: MIG devices as the resource; mixed: nvidia.com/mig-<profile> too.")
@click.option("--fail-on-init-error", envvar="FAIL_ON_INIT_ERROR", show_envvar=True, type=GoBool(), default=True,
              is_flag=False, flag_value="true", show_default=True,
              help="false: a node without a usable GPU keeps the plugin running, serving nothing.")
@click.option("--pass-device-specs", envvar="PASS_DEVICE_SPECS", show_envvar=True, type=GoBool(), default=False,
              is_flag=False, flag_value="true", show_default=True,
              help="Allocate also returns the device nodes (DeviceSpecs), for the CPU manager's static policy "
                   "(with a non-CDI device list strategy, as NVIDIA's).")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Time-slicing: advertise each device N times as <id>::<n> (or sharing.timeSlicing in "
                   "--config-file).")
@click.option("--cdi-spec-dir", default="/var/run/cdi", show_default=True,
              help="Where the CDI spec for the advertised devices is written (nvidia.com-gpu.yaml).")
@click.option("--hook-path", default=None, help="Host path of gpuhook for the CDI spec's hooks [default: this one].")
@click.option("--health-checks", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="XID events, device nodes and lost GPUs mark devices unhealthy. NVIDIA's DP_DISABLE_HEALTHCHECKS "
                   "(all, or XIDs to ignore too) and DP_ENABLE_HEALTHCHECKS (all, or XIDs to count) apply on top.")
@click.option("--ignored-xids", default=",".join(str(x) for x in sorted(DEFAULT_IGNORED_XIDS)), show_default=True,
              help="XIDs that are application faults, not device faults (comma list; empty: none ignored).")
@click.option("--recovery-window", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds without a critical XID (node present, GPU answering) before a device is healthy again.")
@click.option("--health-interval", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Seconds between device-node and GPU-handle checks.")
@click.option("--sys-root", default="/sys", show_default=True, help="sysfs for NUMA nodes NVML does not give.")
@click.option("--dev-char-path", default=None, metavar="DIR",
              help="Make <DIR>/<major>:<minor> links to every NVIDIA node at start and at each rediscovery, so that "
                   "systemd keeps them in containers' cgroups across daemon-reload (the DaemonSet: /dev/char) "
                   "[default: none].")
@click.option("--hook-state-dir", default=STATE_DIR, show_default=True, metavar="DIR",
              help="The nodes' hook state-dir (the DaemonSet mounts the host's): a hook or shim records there a "
                   "container runtime that ignored Allocate's CDI devices, and the plugin logs it once "
                   "[empty: not watched].")
@click.option("--feature-file", default=None,
              help="Keep an NFD feature file of GPU labels current, e.g. "
                   "/etc/kubernetes/node-feature-discovery/features.d/gpuhook [default: none].")
@click.option("--daemonset", envvar="GPUHOOK_DAEMONSET", default=None, metavar="NAME",
              help="This pod's DaemonSet (in its service account's namespace): when the plugin stops and that "
                   "DaemonSet is gone, its CDI spec, feature file, /dev/char links and key are removed from the "
                   "node [default: everything stays].")
@click.option("--ready-file", default=None, metavar="PATH",
              help="A file that exists while every resource is registered with kubelet (the pod's readiness probe "
                   "tests it, so a rolling update replaces the next pod only once this one is serving) "
                   "[default: none].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@CACHE_OPTION
def device_plugin(driver_root: str | None, dev_root: str | None, driver_root_ctr_path: str | None,
                  proc_root: str | None, discovery: str, kubelet_socket: str | None, gdrcopy_enabled: bool | None,
                  gds_enabled: bool | None, mofed_enabled: bool | None, mps_root: str | None, kubelet_dir: str,
                  config_file: str | None, config_dir: str | None, default_config: str, fallback_strategies: str,
                  node_name: str | None, kubeconfig: str | None, node_label: str, resource_name: str,
                  device_list_strategy: str, device_id_strategy: str,
                  mig_strategy: str, fail_on_init_error: bool, pass_device_specs: bool, replicas: int,
                  cdi_spec_dir: str, hook_path: str | None, health_checks: str,
                  ignored_xids: str, recovery_window: float, health_interval: float, sys_root: str,
                  dev_char_path: str | None, hook_state_dir: str, feature_file: str | None, daemonset: str | None,
                  ready_file: str | None, log_level: str, inventory_cache: str | None, **nvidia_limited: Any) -> None:
    """Kubelet device plugin: advertise GPUs with health, answer Allocate with CDI device names."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        xids = parse_xids(ignored_xids)
    except ValueError as exc:
        raise ConfigError(f"--ignored-xids: {exc}") from None
    ctx = click.get_current_context()
    given = {name for name in ctx.params
             if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
    values = {**ctx.params, "device_list_strategy": parse_list_strategies(device_list_strategy)}
    explicit = {PARAM_SETTING.get(k, k): values[k] for k in given}
    defaults = {PARAM_SETTING.get(k, k): v for k, v in values.items() if k not in given and v is not None}
    health_on, xids = health_settings(xids)
    # each plugin process serves its own socket names: during a rolling update the new pod registers beside
    # the old one, so kubelet never has the resource without a plugin (GPU pods admitted meanwhile succeed)
    socket_tag = secrets.token_hex(4)

    def build(path: str | None) -> tuple[PluginConfig, Callable[[], Inventory]]:
        """The plugin's configuration and discovery with `path` as NVIDIA's config file (None: none)."""
        file = None
        if path:
            from gpuhook.plugin import config as nvidia_config

            file = nvidia_config.load(path)
            for warning in file.warnings:
                log.warning("%s: %s", clip(path, quote=False), warning)
            if file.sharing is not None and "replicas" in given:
                raise ConfigError(f"--replicas and sharing.timeSlicing in {clip(path, quote=False)}: "
                                  "give time-slicing once")
        settings = resolve(explicit, file, defaults)
        roots = plugin_roots(settings.get("host_driver_root"), settings.get("host_dev_root"),
                             settings.get("driver_root"))
        file_fields = file.options_fields() if file is not None else {}
        file_fields["gated_env"] = gated_env(ctx, file.gated_env if file is not None else ())
        options = Options(resource_name=resource_name, id_strategy=settings["id_strategy"],
                          mig_strategy=settings["mig_strategy"], replicas=replicas,
                          list_strategies=settings["list_strategies"],
                          pass_device_specs=settings["pass_device_specs"], **file_fields)
        options.check()
        config = PluginConfig(
            options=options,
            kubelet_dir=os.path.abspath(kubelet_directory(kubelet_socket, kubelet_dir, "kubelet_dir" in given)),
            cdi_spec_dir=os.path.abspath(cdi_spec_dir),
            hook_path=hook_path or default_hook_path(),
            host_driver_root=roots.host_driver,
            host_dev_root=roots.host_dev,
            health=HealthConfig(enabled=health_checks == "on" and health_on, ignored_xids=xids,
                                recovery_window=recovery_window, interval=health_interval),
            sys_root=sys_root,
            feature_file=os.path.abspath(feature_file) if feature_file else None,
            fail_on_init_error=settings["fail_on_init_error"],
            dev_char_path=os.path.abspath(dev_char_path) if dev_char_path else None,
            hook_state_dir=os.path.abspath(hook_state_dir) if hook_state_dir else None,
            daemonset=daemonset or None,
            socket_tag=socket_tag,
            ready_file=os.path.abspath(ready_file) if ready_file else None,
        )
        method = settings["discovery"]
        return config, lambda: load_inventory(roots.read_driver, roots.read_dev, proc_root, method, inventory_cache)

    node_configs = None
    if config_dir:
        if config_file:
            raise ConfigError("--config-file and --config-file-srcdir: give one (a single file, or named configs "
                              "picked by the node label)")
        if not node_name:
            raise ConfigError("--config-file-srcdir needs --node-name (NODE_NAME; in a pod: the downward API's "
                              "spec.nodeName)")
        from gpuhook.plugin.nodeconfig import NodeConfigs, parse_fallbacks
        from gpuhook.system.nodelabel import NodeLabel

        node_configs = NodeConfigs(os.path.abspath(config_dir), default_config, parse_fallbacks(fallback_strategies),
                                   NodeLabel(node_name, node_label, kubeconfig=kubeconfig), build)
        config, discover = node_configs.initial()
    else:
        config, discover = build(config_file)
    try:
        serve_forever(config, discover, node_configs)
    except OSError as exc:
        raise GpuhookError(f"device plugin: {exc}") from None


def gated_env(ctx: click.Context, from_file: tuple[str, ...]) -> tuple[str, ...]:
    """The gated variables Allocate sets to `enabled`: each *_ENABLED flag (command line or environment) wins;
    else NVIDIA_GDS=enabled & co in this process's environment; else the config file's gdsEnabled & co."""
    out = []
    for param, name in GATED_FLAGS.items():
        source = ctx.get_parameter_source(param)
        if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            wanted = bool(ctx.params[param])
        elif os.environ.get(name, "") != "":
            value = os.environ[name]
            wanted = value == "enabled" or value in GO_TRUE_WORDS
        else:
            wanted = name in from_file
        if wanted:
            out.append(name)
    return tuple(out)


def kubelet_directory(socket: str | None, kubelet_dir: str, dir_given: bool) -> str:
    """--kubelet-dir, or the folder of NVIDIA's --kubelet-socket (<dir>/kubelet.sock): the plugin's sockets go
    beside kubelet's, as kubelet expects them."""
    if socket is None:
        return kubelet_dir
    if os.path.basename(socket) != "kubelet.sock":
        raise ConfigError(f"--kubelet-socket {clip(socket)}: gpuhook registers through kubelet.sock in kubelet's "
                          "device-plugin folder: give that folder with --kubelet-dir")
    folder = os.path.dirname(socket) or "."
    if dir_given and os.path.abspath(folder) != os.path.abspath(kubelet_dir):
        raise ConfigError(f"--kubelet-socket {clip(socket)} and --kubelet-dir {clip(kubelet_dir)} name different "
                          "folders: give one")
    return folder
