"""Which container runtime daemons run on this host, and with which config file (psutil).

A daemon started with `--config /etc/containerd/custom.toml` (or Docker's `--config-file`, podman's
CONTAINERS_CONF) never reads the default path, so doctor must check the file the running daemon actually uses:
a default file that says "CDI on" proves nothing when the daemon reads another one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import psutil

from gpuhook.model.record import Record
from gpuhook.runtimeconfig.runtimes import CONFIG_OPTIONS, option_value

# runtime -> (process names, config options on its command line); containerd-shim* and friends are not daemons
DAEMONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "containerd": (("containerd",), CONFIG_OPTIONS["containerd"]),
    "docker": (("dockerd",), CONFIG_OPTIONS["docker"]),
    "crio": (("crio",), CONFIG_OPTIONS["crio"]),
    "podman": (("podman",), ()),  # only `podman system service`; its config comes from CONTAINERS_CONF
}
PODMAN_CONFIG_ENV = "CONTAINERS_CONF"


class Daemon(Record):
    runtime: str
    pid: int
    config: str | None  # the config file named on its command line (absolute), None: the default one
    uid: int = 0  # the user it runs as: another user's daemon (rootless) starts that user's containers
    managed_by: str = ""  # "docker": a containerd dockerd started for itself (Docker's checks cover it)

    def describe(self) -> str:
        where = f"with config {self.config}" if self.config else "with its default config"
        return f"{self.runtime} daemon running (pid {self.pid}) {where}"

    def not_ours(self, my_uid: int | None = None) -> str:
        """Why this daemon's own config is not the one that gives this host's containers their GPUs ("" if it
        is): Docker's managed containerd, or another user's daemon (a rootless one, or a test's)."""
        if self.managed_by == "docker":
            return (f"{self.runtime} (pid {self.pid}) is Docker's own, started by dockerd: Docker's containers get "
                    "their GPUs through Docker's configuration, checked under Docker")
        me = os.getuid() if my_uid is None else my_uid
        if self.uid not in (0, me):
            return (f"{self.runtime} (pid {self.pid}) runs as uid {self.uid}: another user's daemon, for that "
                    "user's containers; run gpuhook doctor as that user to check it")
        return ""


# dockerd starts its own containerd with a config under its exec root (/var/run/docker/containerd/containerd.toml)
DOCKER_MANAGED_CONFIG = "/containerd/containerd.toml"


def _runtime_of(name: str, args: Sequence[str]) -> str | None:
    for runtime, (names, _) in DAEMONS.items():
        if name in names:
            if runtime == "podman" and args[1:3] != ["system", "service"]:
                return None
            return runtime
    return None


def _daemon(proc: psutil.Process) -> Daemon | None:
    try:
        args = proc.cmdline()
        if not args:
            return None
        runtime = _runtime_of(os.path.basename(args[0]), args) or _runtime_of(proc.name(), args)
        if runtime is None:
            return None
        config = option_value(args[1:], DAEMONS[runtime][1])
        if runtime == "podman":
            config = proc.environ().get(PODMAN_CONFIG_ENV) or None
        if config and not os.path.isabs(config):
            config = os.path.join(proc.cwd(), config)
        managed = ""
        if runtime == "containerd":
            parent = proc.parent()
            by_dockerd = parent is not None and os.path.basename(parent.name()) == "dockerd"
            if by_dockerd or (config or "").endswith(DOCKER_MANAGED_CONFIG) and "/docker/" in (config or ""):
                managed = "docker"
        return Daemon(runtime, proc.pid, os.path.normpath(config) if config else None, proc.uids().real, managed)
    except (psutil.Error, OSError):
        return None


def running_daemons(processes: Iterable[psutil.Process] | None = None) -> list[Daemon]:
    """Every runtime daemon among `processes` (default: all of this host's), by pid."""
    found = (_daemon(p) for p in (psutil.process_iter() if processes is None else processes))
    return sorted((d for d in found if d is not None), key=lambda d: d.pid)
