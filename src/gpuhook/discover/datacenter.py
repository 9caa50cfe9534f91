"""Datacenter devices as the host has them: IMEX channels and the gated families of catalogue.GATED.

As NVIDIA's internal/discover (char_devices.go, nvswitch.go, gds.go, mofed.go, gdrcopy.go): nodes are whatever
character devices match the globs under the dev root; a family's extra files (GDS: /run/udev, /etc/cufile.json)
count only when at least one of its nodes exists.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath

from gpuhook.discover import devnodes
from gpuhook.discover.roots import join, resolve_in_root
from gpuhook.model import catalogue
from gpuhook.model.inventory import DeviceNode, DriverFile


def _names(dev_root: str, folder: str) -> list[str]:
    try:
        return sorted(os.listdir(join(dev_root, folder)))
    except OSError:
        return []


def glob_nodes(dev_root: str, pattern: str) -> list[DeviceNode]:
    """Character devices matching a canonical glob (wildcards only in the last component), by minor
    (nvidia-fs2 before nvidia-fs10)."""
    folder, name = posixpath.split(pattern)
    names = [n for n in _names(dev_root, folder) if fnmatch.fnmatchcase(n, name)] if "*" in name else [name]
    found = (devnodes.node(dev_root, posixpath.join(folder, n)) for n in names)
    return sorted((n for n in found if n is not None and n.type == "c"), key=lambda n: (n.major, n.minor))


def imex_channels(dev_root: str) -> list[DeviceNode]:
    """The channel<N> nodes present, by channel number (names that are not channel<digits> are not channels)."""
    prefix = catalogue.IMEX_CHANNEL_PREFIX
    numbers = []
    for name in _names(dev_root, catalogue.IMEX_CHANNEL_DIR):
        digits = name[len(prefix):]
        if name.startswith(prefix) and digits.isascii() and digits.isdigit():
            numbers.append(int(digits))
    found = (devnodes.node(dev_root, f"{catalogue.IMEX_CHANNEL_DIR}/{prefix}{n}") for n in sorted(set(numbers)))
    return [n for n in found if n is not None and n.type == "c"]


def gated_nodes(dev_root: str) -> dict[str, list[DeviceNode]]:
    """Each gated family's nodes, families without any left out."""
    out: dict[str, list[DeviceNode]] = {}
    for family in catalogue.GATED:
        nodes: list[DeviceNode] = []
        for pattern in family.node_globs:
            nodes += [n for n in glob_nodes(dev_root, pattern) if all(n.path != m.path for m in nodes)]
        if nodes:
            out[family.name] = nodes
    return out


def gated_mounts(driver_root: str, nodes: dict[str, list[DeviceNode]]) -> dict[str, list[DriverFile]]:
    """The files mounted with a family (read-only), only for families whose nodes exist."""
    out: dict[str, list[DriverFile]] = {}
    for family in catalogue.GATED:
        if family.name not in nodes:
            continue
        files = []
        for canonical in family.mounts:
            host = join(driver_root, resolve_in_root(driver_root, canonical))
            if os.path.isdir(host) or os.path.isfile(host):
                kind = "dir" if os.path.isdir(host) else "config"
                files.append(DriverFile(kind, family.name, canonical, host))
        if files:
            out[family.name] = files
    return out
