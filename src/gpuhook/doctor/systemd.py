"""The systemd cgroup driver and /dev/char: whether a `systemctl daemon-reload` would take GPUs away from running
containers ("Failed to initialize NVML: Unknown Error"), and the one command that prevents it."""

from __future__ import annotations

import os

from gpuhook.doctor.model import OK, WARN, Finding
from gpuhook.doctor.runtimes import Paths, _json, _toml
from gpuhook.model.inventory import Inventory
from gpuhook.system.devchar import DEFAULT_DEV_CHAR, missing_links

RUN_SYSTEMD = "/run/systemd/system"  # present when systemd is PID 1 (sd_booted)


def _containerd_systemd(path: str) -> bool:
    """SystemdCgroup = true anywhere in containerd's config (a runtime's options, whatever the config version)."""
    data, _error = _toml(path)  # an unreadable file is check_containerd's finding, not this one's
    stack: list[object] = [data or {}]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("SystemdCgroup") is True:
                return True
            stack.extend(item.values())
    return False


def _docker_systemd(path: str) -> bool:
    data, _error = _json(path)
    opts = (data or {}).get("exec-opts")
    return isinstance(opts, list) and "native.cgroupdriver=systemd" in opts


def systemd_signals(paths: Paths, run_systemd: str = RUN_SYSTEMD) -> list[str]:
    """What says containers' cgroups are systemd's: the runtimes' cgroup driver, or systemd as init (where
    Docker ≥ 20.10 on cgroup v2 and containerd's CRI defaults pick the systemd driver)."""
    found = []
    if _containerd_systemd(paths.containerd_config):
        found.append(f"containerd SystemdCgroup = true ({paths.containerd_config})")
    if _docker_systemd(paths.docker_config):
        found.append(f"Docker native.cgroupdriver=systemd ({paths.docker_config})")
    if os.path.isdir(run_systemd):
        found.append(f"systemd is the init system ({run_systemd})")
    return found


def check_dev_char(inv: Inventory, paths: Paths = Paths(), run_systemd: str = RUN_SYSTEMD,
                   dev_char: str = DEFAULT_DEV_CHAR) -> list[Finding]:
    signals = systemd_signals(paths, run_systemd)
    if not signals:
        return []
    missing = missing_links(inv, dev_char)
    if not missing:
        return [Finding("host", OK, f"every NVIDIA node has its {dev_char} link (systemd: {signals[0]})")]
    return [Finding("host", WARN,
                    f"{len(missing)} NVIDIA node(s) lack a {dev_char}/<major>:<minor> link ({', '.join(missing[:3])}"
                    f"{'…' if len(missing) > 3 else ''}) under a systemd cgroup driver ({'; '.join(signals)}): "
                    "after `systemctl daemon-reload` containers lose those devices "
                    "(\"Failed to initialize NVML: Unknown Error\"); CDI and the shim keep them once the links "
                    "exist, the prestart hook's own cgroup edits never survive a reload",
                    "gpuhook system create-dev-char-symlinks")]
