"""Which value wins: NVIDIA's precedence between the command line, the environment and the config file.

NVIDIA's NewConfig starts from the file, then lets every flag that urfave/cli reports as set override it, and a
flag is "set" when given on the command line or through its environment variable (the command line winning).
So: command line > environment > config file > the flag's default. The CLI (click, which also puts the command
line before the environment) passes the values it was given explicitly; everything else comes from the file or
the default. Booleans in the environment are read as Go's strconv.ParseBool, as urfave/cli reads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from gpuhook.model.record import Record
from gpuhook.model.request import TRUE_WORDS as GO_TRUE
from gpuhook.plugin.config import FileConfig

# gpuhook's names of the settings the config file can carry (FileConfig's fields), each also a flag.
SETTINGS = ("mig_strategy", "fail_on_init_error", "host_driver_root", "host_dev_root", "driver_root", "discovery",
            "pass_device_specs", "list_strategies", "id_strategy")
GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def parse_go_bool(text: str) -> bool:
    """strconv.ParseBool: anything but its twelve words is an error (ValueError), never a silent false."""
    if text in GO_TRUE:
        return True
    if text in GO_FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (expected one of {', '.join(GO_TRUE + GO_FALSE)})")


def resolve(explicit: Mapping[str, Any], file: FileConfig | None, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Each setting's value: given on the command line or in the environment (`explicit`), else set in the
    file, else the default. Settings absent from all three are absent from the result."""
    out: dict[str, Any] = {}
    for name in SETTINGS:
        from_file = getattr(file, name) if file is not None else None
        if name in explicit:
            out[name] = explicit[name]
        elif from_file is not None:
            out[name] = from_file
        elif name in defaults:
            out[name] = defaults[name]
    return out


# NVIDIA's default for --driver-root-ctr-path (api/config/v1 DefaultContainerDriverRoot), where its Helm chart
# mounts the host's driver root.
DEFAULT_CTR_DRIVER_ROOT = "/driver-root"


class PluginRoots(Record):
    """Where the plugin reads the driver (`read_*`) and where the container runtime finds it (`host_*`)."""

    read_driver: str | None  # None: the hook config's driver root, else / (the plugin runs on the host itself)
    read_dev: str | None  # None: the read driver root's own rule (cli/inventory.resolve_roots)
    host_driver: str | None  # None: the same as read (nothing to rebase)
    host_dev: str | None


def plugin_roots(host_driver: str | None, host_dev: str | None, ctr_path: str | None,
                 isdir: Callable[[str], bool] = os.path.isdir) -> PluginRoots:
    """NVIDIA's meaning of the roots (cmd/nvidia-device-plugin/plugin-manager.go and root.go of v0.20.0):
    `host_driver` (--driver-root, NVIDIA_DRIVER_ROOT) and `host_dev` (--dev-root, NVIDIA_DEV_ROOT; default: the
    driver root) are the host's, as the spec must name them; the plugin reads the driver at `ctr_path`
    (--driver-root-ctr-path, DRIVER_ROOT_CTR_PATH), by default /driver-root, the chart's mount, and, where that
    does not exist (the plugin runs on the host itself), at the host's driver root. Device nodes are read under
    the read root when it has a dev folder, else under / (NVIDIA's getDevRoot)."""
    if ctr_path is None:
        ctr_path = DEFAULT_CTR_DRIVER_ROOT if isdir(DEFAULT_CTR_DRIVER_ROOT) else None
    if ctr_path is None:  # on the host: read where the runtime finds it
        return PluginRoots(host_driver, host_dev, None, None)
    read_dev = ctr_path if isdir(os.path.join(ctr_path, "dev")) else "/"
    host = host_driver or "/"
    return PluginRoots(ctr_path, read_dev, host, host_dev or host)
