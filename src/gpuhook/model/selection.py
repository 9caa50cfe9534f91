"""Resolve a Request's device ids against an Inventory: which GPUs and MIG devices a container gets."""

from __future__ import annotations

from gpuhook.errors import RequestError, clip
from gpuhook.model import catalogue
from gpuhook.model.edits import Selection
from gpuhook.model.inventory import DeviceNode, Gpu, Inventory, MigDevice, normalize_bus_id
from gpuhook.model.request import CDI_KIND, Request

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; the aliases are for type checkers only
if TYPE_CHECKING:  # (a runtime `A | B` of classes needs Python 3.10)
    Device = Gpu | MigDevice


def all_devices(inv: Inventory) -> list[Device]:
    """`all`: every GPU, a MIG-enabled GPU contributing its MIG devices instead of itself."""
    out: list[Device] = []
    for gpu in inv.gpus:
        if gpu.mig_enabled and gpu.mig_devices:
            out.extend(gpu.mig_devices)
        else:
            out.append(gpu)
    return out


MAX_NAMES_SHOWN = 32  # a refusal's list of the host's device ids stays one readable line


def device_names(inv: Inventory) -> list[str]:
    """The ids a container may ask for on this host, as `all` orders its devices: each GPU's index (a MIG
    device's gpu:mig name) and UUID, then `all` and `none`."""
    out: list[str] = []
    for d in all_devices(inv):
        out += [d.name if isinstance(d, MigDevice) else str(d.index)] + ([d.uuid] if d.uuid else [])
    return out + ["all", "none"]


def names_line(inv: Inventory) -> str:
    """device_names as one comma list, at most MAX_NAMES_SHOWN of them."""
    names = device_names(inv)
    more = len(names) - MAX_NAMES_SHOWN
    return ", ".join(names[:MAX_NAMES_SHOWN]) + (f", … ({more} more: gpuhook info)" if more > 0 else "")


def _small_int(text: str) -> int | None:
    """An index as written in NVIDIA_VISIBLE_DEVICES: ASCII digits only ('²'.isdigit() is true), bounded."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None


def _by_pair(inv: Inventory, ident: str) -> Device | None:
    g, _, m = ident.partition(":")
    gi, mi = _small_int(g), _small_int(m)
    if gi is None or mi is None:
        return None
    if gi < len(inv.gpus):
        for mig in inv.gpus[gi].mig_devices:
            if mig.index == mi:
                return mig
    return None


def _by_bus_id(inv: Inventory, ident: str) -> Device | None:
    if ident.count(":") < 1 or "." not in ident:
        return None
    try:
        wanted = normalize_bus_id(ident if ident.count(":") == 2 else "0000:" + ident)
    except ValueError:
        return None
    for gpu in inv.gpus:
        if gpu.pci_bus_id == wanted:
            return gpu
    return None


def _by_legacy_mig_id(inv: Inventory, ident: str) -> Device | None:
    """`MIG-GPU-<uuid>/<gi>/<ci>`, the MIG name of drivers before R470 that device plugins and volume-mount
    requests still carry (the reason a volume-mount id may hold `/`)."""
    gpu_uuid, gi, ci = ident[len("MIG-"):].split("/")
    g, c = _small_int(gi), _small_int(ci)
    gpu = next((x for x in inv.gpus if x.uuid == gpu_uuid), None)
    if gpu is None or g is None or c is None:
        return None
    return next((m for m in gpu.mig_devices if m.gi == g and m.ci == c), None)


def find_device(inv: Inventory, ident: str) -> Device | None:
    """One id in any of the accepted forms: index, GPU-/MIG- UUID, MIG-GPU-<uuid>/<gi>/<ci>, gpu:mig, PCI bus id,
    nvidia.com/gpu=<name>. A CDI name of another kind is no device of ours."""
    kind, sep, name = ident.partition("=")
    if sep:
        if kind != CDI_KIND:
            return None
        ident = name
    index = _small_int(ident)
    if index is not None:
        return inv.gpus[index] if index < len(inv.gpus) else None
    if ident.startswith("GPU-"):
        return next((g for g in inv.gpus if g.uuid == ident), None)
    if ident.startswith("MIG-GPU-") and ident.count("/") == 2:
        return _by_legacy_mig_id(inv, ident)
    if ident.startswith("MIG-"):
        return next((m for m in inv.all_mig_devices() if m.uuid == ident), None)
    return _by_pair(inv, ident) or _by_bus_id(inv, ident)


def _key(device: Device) -> tuple[int, int]:
    return (device.index, -1) if isinstance(device, Gpu) else (device.gpu_index, device.index)


def resolve(inv: Inventory, request: Request) -> Selection:
    """The devices and capabilities for a request; an unknown device fails, naming it."""
    if request.kind == "all":
        devices = all_devices(inv)
    elif request.kind == "list":
        devices = []
        seen: set[tuple[int, int]] = set()
        for ident in request.devices:
            if ident.startswith("nvidia.com/gpu=") and ident.endswith("=all"):
                found_all = all_devices(inv)
            else:
                found = find_device(inv, ident)
                if found is None:
                    raise RequestError(f"unknown device {clip(ident)} requested ({request.source}); "
                                       f"this host has: {names_line(inv)}")
                found_all = [found]
            for dev in found_all:
                if _key(dev) not in seen:
                    seen.add(_key(dev))
                    devices.append(dev)
    else:
        devices = []
    return Selection(tuple(devices), request.capabilities, request.mig_config, request.mig_monitor,
                     imex_channels(inv, request), request.gated)


def imex_channels(inv: Inventory, request: Request) -> tuple[DeviceNode, ...]:
    """The host's nodes for the requested IMEX channels (`all`: every one present); a missing channel fails."""
    if request.imex_channels == ("all",):
        return tuple(inv.imex_channels)
    nodes = []
    for channel in request.imex_channels:
        node = inv.imex_channel(int(channel))
        if node is None:
            why = "the driver has no IMEX support" if inv.imex_major is None else "no such channel node"
            raise RequestError(f"IMEX channel {channel} requested but {catalogue.IMEX_CHANNEL_DIR}/"
                               f"{catalogue.IMEX_CHANNEL_PREFIX}{channel} does not exist on this host ({why})")
        nodes.append(node)
    return tuple(nodes)
