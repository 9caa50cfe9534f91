"""Doctor's words for the datacenter devices: IMEX channels and the gated families (NVIDIA_NVSWITCH & co).

Pure wording over what request.parse_request, selection.resolve and edits.gated_edits decided; each line says
what a container asking for one gets on this host, and why it gets less than it asked for.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuhook.model import catalogue
from gpuhook.model.contract import ENABLED, GATED_DEVICE_ENV, IMEX_CHANNELS
from gpuhook.model.edits import Selection, gated_edits
from gpuhook.model.inventory import Inventory
from gpuhook.model.request import Request


def asked_without_gpu(env: Mapping[str, str]) -> list[str]:
    """Datacenter variables set in a container that is no GPU container (they are then ignored, as by NVIDIA)."""
    names = [IMEX_CHANNELS] if env.get(IMEX_CHANNELS, "").strip() else []
    return names + [var for var in GATED_DEVICE_ENV.values() if env.get(var) == ENABLED]


def channel_names(inv: Inventory) -> str:
    return ", ".join(n.path.rsplit("/", 1)[-1] for n in inv.imex_channels) or "none"


def imex_fix(inv: Inventory) -> str:
    if inv.imex_major is None:
        return (f"this driver has no IMEX channels ({catalogue.IMEX_DEVICES_NAME} is not in /proc/devices): "
                f"drop {IMEX_CHANNELS} or use a driver with IMEX support (550 or later)")
    return (f"{IMEX_CHANNELS}=<channels this host has: {channel_names(inv)}>, or have the administrator create the "
            f"channel (NVreg_CreateImexChannel0, or mknod {catalogue.IMEX_CHANNEL_DIR}/channel<N> "
            f"c {inv.imex_major} <N>)")


def lines(inv: Inventory, request: Request, selection: Selection) -> list[tuple[bool, str, str]]:
    """(ok, message, fix) per datacenter request; not ok when the host lacks what was asked for."""
    out: list[tuple[bool, str, str]] = []
    if request.imex_channels:
        got = ", ".join(n.path for n in selection.imex_channels)
        if got:
            out.append((True, f"IMEX channels: {got}", ""))
        else:
            out.append((False, f"IMEX channels: {IMEX_CHANNELS}=all, but this host has none", imex_fix(inv)))
    for name in request.gated:
        family = next(f for f in catalogue.GATED if f.name == name)
        var = GATED_DEVICE_ENV[name]
        edits = gated_edits(inv, name)
        if edits.device_nodes:
            mounts = f" and {', '.join(m.container_path for m in edits.mounts)}" if edits.mounts else ""
            out.append((True, f"{var}=enabled: {len(edits.device_nodes)} node(s){mounts}", ""))
        else:
            out.append((False, f"{var}=enabled, but this host has no {' or '.join(family.node_globs)}: the container "
                               "starts without them (as with NVIDIA's toolkit)",
                        f"load the {name} kernel module on the host (its nodes appear under {inv.dev_root}/dev), "
                        f"or drop {var}"))
    return out
