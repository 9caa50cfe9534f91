"""`gpuhook node-setup install|uninstall|run|probe`: the node-setup DaemonSet's commands (docs/deploy.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import click

from gpuhook.errors import GpuhookError
from gpuhook.model.record import replace
from gpuhook.nodesetup import runtime as runtime_mod
from gpuhook.nodesetup.journal import host_path
from gpuhook.nodesetup.setup import (
    DEFAULT_PREFIX,
    RUNTIMES,
    Options,
    check_options,
    find_runtime,
    install,
    journal_path,
    real,
    uninstall,
)


def _options(f):  # type: ignore[no-untyped-def]
    for decorator in reversed((
        click.option("--host-root", envvar="GPUHOOK_HOST_ROOT", default="/", show_default=True,
                     help="Where the host's / is mounted (the DaemonSet mounts it at /host)."),
        click.option("--prefix", envvar="GPUHOOK_PREFIX", default=DEFAULT_PREFIX, show_default=True,
                     help="Host folder gpuhook is installed under (nothing else is written outside it but the "
                          "runtime's drop-in and the /dev/char links)."),
        click.option("--driver-root", envvar="GPUHOOK_DRIVER_ROOT", default="/", show_default=True,
                     help="Host path of the driver root (/run/nvidia/driver for a driver container)."),
        click.option("--runtime", "runtime_name", envvar="GPUHOOK_RUNTIME", type=click.Choice(RUNTIMES), default="auto",
                     show_default=True,
                     help="The node's container runtime; auto: the one whose daemon runs."),
        click.option("--runtime-config", envvar="GPUHOOK_RUNTIME_CONFIG", default=None, metavar="PATH",
                     help="Host path of the runtime's main config [default: /etc/containerd/config.toml, "
                          "/etc/crio/crio.conf]."),
        click.option("--restart", envvar="GPUHOOK_RESTART", type=click.Choice(runtime_mod.RESTART_MODES),
                     default="systemd", show_default=True,
                     help="How the runtime is made to read its config: systemctl restart in the host's mount "
                          "namespace, SIGTERM to the daemon (its supervisor restarts it), or not at all."),
        click.option("--unit", envvar="GPUHOOK_RUNTIME_UNIT", default=None,
                     help="systemd unit of the runtime [default: containerd, crio]."),
        click.option("--dev-root", envvar="GPUHOOK_DEV_ROOT", default="/", show_default=True,
                     help="Host folder holding the driver's /dev (the links point into it)."),
        click.option("--proc-root", envvar="GPUHOOK_PROC_ROOT", default="/proc", show_default=True,
                     help="Host path of the procfs with driver/nvidia (the links' discovery)."),
        click.option("--dev-char-path", envvar="GPUHOOK_DEV_CHAR_PATH", default="/dev/char", show_default=True,
                     help="Host folder of the /dev/char/<major>:<minor> links."),
    )):
        f = decorator(f)
    return f


def _make(host_root: str, prefix: str, driver_root: str, runtime_name: str, runtime_config: str | None,
          restart: str, unit: str | None, dev_root: str, proc_root: str, dev_char_path: str,
          links: bool = False) -> Options:
    opts = Options(os.path.abspath(host_root), prefix, driver_root, runtime_name, runtime_config, restart, unit,
                   dev_char_path, proc_root=proc_root)
    check_options(opts)
    return replace(opts, links=_links(opts, dev_root, proc_root)) if links else opts


def _links(opts: Options, dev_root: str, proc_root: str) -> list[tuple[str, str]]:
    """(link, target) for the NVIDIA nodes, in host paths; none (with a warning) when no driver answers."""
    from gpuhook.cli.inventory import load_inventory
    from gpuhook.system.devchar import wanted_links

    try:
        inv = load_inventory(real(opts, opts.driver_root), real(opts, dev_root), real(opts, proc_root), "auto")
    except GpuhookError as exc:
        click.echo(f"warning: no /dev/char links ({exc})", err=True)
        return []
    return [(link, host_path(opts.host_root, target)) for link, target in wanted_links(inv, opts.dev_char)]


def _install(opts: Options) -> None:
    from gpuhook.cli.entry import entry_script, native_entry
    from gpuhook.nodesetup.payload import Source

    report = install(opts, Source.this(native_entry()), entry_script)
    for line in report.lines:
        click.echo(line)
    click.echo(f"node ready in {report.seconds:.2f} s")


@click.group("node-setup")
def node_setup() -> None:
    """Install gpuhook onto a node from the node-setup image (through a host mount) and take it off again.

    Every option can also come from the environment (GPUHOOK_HOST_ROOT, GPUHOOK_PREFIX, GPUHOOK_DRIVER_ROOT,
    GPUHOOK_RUNTIME, GPUHOOK_RUNTIME_CONFIG, GPUHOOK_RESTART, GPUHOOK_RUNTIME_UNIT, GPUHOOK_DEV_ROOT,
    GPUHOOK_PROC_ROOT, GPUHOOK_DEV_CHAR_PATH), so the DaemonSet's probe runs with the container's own settings."""


@node_setup.command("install")
@_options
def install_cmd(**kw: str) -> None:
    """Install gpuhook under --prefix, configure and restart the runtime, make the /dev/char links."""
    _install(_make(**kw, links=True))  # type: ignore[arg-type]


@node_setup.command("uninstall")
@_options
def uninstall_cmd(**kw: str) -> None:
    """Put back everything install changed (from its journal under --prefix) and restart the runtime."""
    for line in uninstall(_make(**kw)).lines:  # type: ignore[arg-type]
        click.echo(line)


@node_setup.command("run")
@_options
@click.option("--on-stop", type=click.Choice(("auto", "keep", "uninstall")), envvar="GPUHOOK_ON_STOP",
              default="auto", show_default=True,
              help="When the pod stops: auto takes the install off only when its DaemonSet is gone (asked of the "
                   "API with the pod's service account; a rolling update or a restart keeps it for the next pod, "
                   "and so does an API that cannot be asked); keep or uninstall always.")
@click.option("--daemonset", envvar="GPUHOOK_DAEMONSET", default="gpuhook-node-setup", show_default=True,
              help="This pod's DaemonSet, for --on-stop auto (in the service account's namespace).")
def run_cmd(on_stop: str, daemonset: str, **kw: str) -> None:
    """The DaemonSet's container: install (or refresh an earlier install in place), wait for SIGTERM (the pod's
    termination), then take the install off if its DaemonSet is gone."""
    opts = _make(**kw, links=True)  # type: ignore[arg-type]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    from gpuhook.system import daemonset as owner

    watch = owner.Watch(daemonset) if on_stop == "auto" else None
    _install(opts)
    sys.stdout.flush()
    while not stop:
        signal.pause()
    if watch is not None:
        state, why = watch.state()
        click.echo(f"stopping: {why}")
        if state != owner.GONE:
            click.echo("the install stays for the next pod" if state == owner.PRESENT else
                       "cannot tell whether the DaemonSet is gone: the install stays (`gpuhook node-setup "
                       "uninstall` takes it off)")
            return
    elif on_stop == "keep":
        click.echo("stopping; the install stays (--on-stop keep)")
        return
    for line in uninstall(opts).lines:
        click.echo(line)


@node_setup.command("probe")
@_options
def probe_cmd(**kw: str) -> None:
    """Readiness: the install is complete and the installed gpuhook's `doctor` passes, run on the host by the
    host's copy in the runtime daemon's mount namespace (so it checks the configuration that daemon reads,
    and the payload itself). As a Kubernetes node's: CDI on is enough, the device plugin or the DRA driver
    writes the specs (a node with only the DRA driver has none until a claim is prepared)."""
    opts = _make(**kw)  # type: ignore[arg-type]
    if not os.path.isfile(real(opts, journal_path(opts))):
        raise GpuhookError(f"not installed: no journal at {journal_path(opts)}")
    name, _config, daemon = find_runtime(opts)
    argv = [os.path.join(opts.prefix, "bin", "gpuhook"), "doctor", "--driver-root", opts.driver_root,
            "--runtime", name, "--kubernetes-node"]
    if opts.host_root != "/":
        argv = ["nsenter", f"--target={daemon.pid if daemon else 1}", "--mount", "--", *argv]
    sys.exit(subprocess.run(argv, check=False).returncode)
