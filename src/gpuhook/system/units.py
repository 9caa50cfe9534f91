"""gpuhook's systemd units (runtime-config/systemd; the .deb installs them and enables gpuhook.socket and
gpuhook-cdi-refresh.service, as NVIDIA's toolkit enables its CDI refresh): which are enabled, and turning them
off for `gpuhook uninstall`."""

from __future__ import annotations

import os
import shutil
import subprocess

UNITS = ("gpuhook-cdi-refresh.service", "gpuhook.socket", "gpuhook.service")
SYSTEMD_RUNNING = "/run/systemd/system"  # present when systemd is PID 1 (sd_booted)


def _systemctl() -> str | None:
    return shutil.which("systemctl") if os.path.isdir(SYSTEMD_RUNNING) else None


def enabled() -> list[str]:
    """The units of UNITS systemd has enabled (none where systemd does not run)."""
    systemctl = _systemctl()
    if systemctl is None:
        return []
    found = []
    for unit in UNITS:
        state = subprocess.run([systemctl, "is-enabled", unit], capture_output=True, text=True, check=False)
        if state.stdout.strip() in ("enabled", "enabled-runtime"):
            found.append(unit)
    return found


def disable(units: list[str]) -> list[str]:
    """`systemctl disable --now` each of `units`; the ones systemctl refused, with its line."""
    systemctl = _systemctl()
    failed = []
    for unit in units if systemctl else ():
        done = subprocess.run([systemctl, "disable", "--now", unit], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            failed.append(f"{unit}: {done.stderr.strip() or done.returncode}")
    return failed
