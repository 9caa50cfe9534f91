"""`/dev/char/<major>:<minor>` links for the NVIDIA nodes (NVIDIA's `nvidia-ctk system create-dev-char-symlinks`).

Why: with the systemd cgroup driver, `systemctl daemon-reload` makes systemd rewrite every unit's device
allow-list from its DeviceAllow= entries, which it resolves through /dev/char. A node with no /dev/char link is
dropped from the container's cgroup and the container loses its GPU ("Failed to initialize NVML: Unknown Error",
NVIDIA's most reported issue). The links are what make the rules of CDI and the shim survive a reload; the
prestart hook's own cgroup edits are outside systemd's view and do not survive it.
"""

from __future__ import annotations

import os

from gpuhook.errors import GpuhookError
from gpuhook.fileio.links import CREATED, ensure_link
from gpuhook.model.inventory import DeviceNode, Inventory
from gpuhook.model.record import Record

DEFAULT_DEV_CHAR = "/dev/char"


class LinkResult(Record):
    created: tuple[str, ...] = ()
    present: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def nvidia_nodes(inv: Inventory) -> list[DeviceNode]:
    """Every character node gpuhook may give a container: GPUs, control nodes, MIG control and capability nodes,
    IMEX channels; once each by major:minor."""
    nodes = [g.node for g in inv.gpus if g.node is not None]
    nodes += list(inv.control_nodes.values()) + list(inv.mig_control_nodes.values())
    nodes += [n for m in inv.all_mig_devices() for n in m.cap_nodes]
    nodes += list(inv.imex_channels)
    unique: dict[tuple[int, int], DeviceNode] = {}
    for n in nodes:
        if n.type == "c":
            unique.setdefault((n.major, n.minor), n)
    return list(unique.values())


def wanted_links(inv: Inventory, dev_char: str = DEFAULT_DEV_CHAR) -> list[tuple[str, str]]:
    """(link path, target) per node: `<dev_char>/<major>:<minor>` -> the node's host path."""
    return [(os.path.join(dev_char, f"{n.major}:{n.minor}"), n.host_path) for n in nvidia_nodes(inv)]


def missing_links(inv: Inventory, dev_char: str = DEFAULT_DEV_CHAR) -> list[str]:
    """The links a systemd host lacks (a link elsewhere counts as present: systemd follows whatever is there)."""
    return [link for link, _ in wanted_links(inv, dev_char) if not os.path.lexists(link)]


def create_links(inv: Inventory, dev_char: str = DEFAULT_DEV_CHAR) -> LinkResult:
    """Create what is missing, idempotently; what is in the way is kept and warned about, never replaced."""
    if not os.path.isdir(dev_char):
        try:
            os.mkdir(dev_char, 0o755)
        except OSError as exc:
            raise GpuhookError(f"cannot create {dev_char}: {exc.strerror}") from None
    created, present, warnings = [], [], []
    for link, target in wanted_links(inv, dev_char):
        try:
            (created if ensure_link(link, target) == CREATED else present).append(link)
        except GpuhookError as exc:
            warnings.append(str(exc))
    return LinkResult(tuple(created), tuple(present), tuple(warnings))
