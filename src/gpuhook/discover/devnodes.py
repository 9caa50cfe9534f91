"""Device nodes as the host has them: major, minor and mode straight from stat."""

from __future__ import annotations

import os
import stat

from gpuhook.discover.roots import join
from gpuhook.model.inventory import DeviceNode


def node(dev_root: str, canonical: str) -> DeviceNode | None:
    """The node at canonical path `canonical` (/dev/...) under `dev_root`, or None if absent or not a device."""
    host_path = join(dev_root, canonical)
    try:
        st = os.stat(host_path)
    except OSError:
        return None
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        return None
    return DeviceNode(
        path=canonical,
        host_path=host_path,
        major=os.major(st.st_rdev),
        minor=os.minor(st.st_rdev),
        mode=stat.S_IMODE(st.st_mode),
        type=kind,
    )


def gpu_minors(dev_root: str) -> list[int]:
    """Minors of the /dev/nvidia<N> nodes: the GPU list when neither NVML nor procfs can say."""
    try:
        names = os.listdir(join(dev_root, "/dev"))
    except OSError:
        return []
    return sorted(int(n[6:]) for n in names if n.startswith("nvidia") and n[6:].isdigit())


def dri_nodes(dev_root: str, bus_id: str) -> tuple[DeviceNode, ...]:
    """The card/render nodes of one GPU, found through udev's /dev/dri/by-path links."""
    found: list[DeviceNode] = []
    by_path = join(dev_root, "/dev/dri/by-path")
    for suffix in ("card", "render"):
        link = os.path.join(by_path, f"pci-{bus_id}-{suffix}")
        try:
            target = os.readlink(link)
        except OSError:
            continue
        name = os.path.basename(target)
        dn = node(dev_root, f"/dev/dri/{name}")
        if dn is not None:
            found.append(dn)
    return tuple(found)


def devices_major(proc_root: str, name: str) -> int | None:
    """A dynamic major from /proc/devices (nvidia-caps has no fixed one)."""
    try:
        with open(os.path.join(proc_root, "devices"), encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == name and parts[0].isdigit():
                    return int(parts[0])
    except OSError:
        pass
    return None
