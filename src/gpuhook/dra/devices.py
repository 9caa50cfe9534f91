"""What the DRA driver publishes: an Inventory turned into ResourceSlice devices (pure: no API, no NVML).

Names, attributes and capacities are those of NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu,
cmd/gpu-kubelet-plugin/deviceinfo.go `GpuInfo.Attributes`, mig.go `CommonAttributesMig`/`ToCanonicalName`,
partitions.go `fullGpuCapacity`), so DeviceClasses and claims written for it select the same devices here:
a GPU is `gpu-<minor>`, its attributes `type`, `uuid`, `productName`, `brand`, `architecture`,
`cudaComputeCapability`, `driverVersion`, `cudaDriverVersion`, the standard `resource.kubernetes.io/pciBusID`,
`resource.kubernetes.io/pcieRoot` and `resource.kubernetes.io/numaNode`, its capacity `memory`; a MIG device
`gpu-<minor>-mig-<profile>-<profile id>-<placement>` with `type` mig, `parentUUID`, `profile`, its parent's
attributes, `memory` and a `memorySlice<i>` per memory slice it sits on. What NVIDIA's
lacks is added: `nvlinkDomain`, one value shared by the GPUs that NVLink joins all to all, for `matchAttribute`.

Which devices exist and which host nodes each one needs come from the device plugin's planning
(`plugin/devices.plan`, MIG strategy mixed: whole GPUs, and MIG devices where MIG is on), so health is tracked by
the same keys and the same node paths as there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhook.dra.placement import Placement
from gpuhook.model import topology
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record
from gpuhook.plugin.devices import Options, PluginDevice, plan

DRIVER = "gpu.nvidia.com"
NVLINK_DOMAIN = "nvlinkDomain"  # qualified: gpu.nvidia.com/nvlinkDomain
STANDARD = "resource.kubernetes.io/"
MAX_DEVICES_PER_SLICE = 128  # resource.k8s.io/v1 ResourceSliceMaxDevices

# go-nvlib's GetArchitectureAsString / GetBrandAsString spellings (vendor/github.com/NVIDIA/go-nvlib/pkg/nvlib/
# device/device.go), keyed by what gpuhook's discovery records (compute capability major, NVML brand names).
_ARCH_BY_MAJOR = {3: "Kepler", 5: "Maxwell", 6: "Pascal", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}
_BRANDS = {b.lower(): b for b in ("Unknown", "Quadro", "Tesla", "NVS", "Grid", "GeForce", "Titan", "NvidiaVApps",
                                  "NvidiaVPC", "NvidiaVCS", "NvidiaVWS", "NvidiaCloudGaming", "QuadroRTX",
                                  "NvidiaRTX", "Nvidia", "GeForceRTX", "NvidiaRTXB")}
_RFC1123_BAD = re.compile(r"[^a-z0-9-]")


class DraDevice(Record):
    """One published device: its slice entry and what prepare needs to find it again."""

    name: str  # gpu-0, gpu-1-mig-1g10gb-3-0
    target: Any  # Gpu | MigDevice
    key: tuple[int, int]  # the health board's key (gpu index, mig index or -1)
    node_paths: tuple[str, ...]  # host nodes whose disappearance makes it vanish
    entry: dict[str, Any]  # the ResourceSlice `devices[]` item

    @property
    def gpu_index(self) -> int:
        """The GPU it is or is on (what the device plugin's health monitor tracks it by, with `key`)."""
        return self.key[0]


def architecture(compute_capability: str | None) -> str | None:
    """go-nvlib's architecture name from a compute capability ("8.9" -> "Ada Lovelace"); None when unknown."""
    if not compute_capability:
        return None
    try:
        major, minor = (int(p) for p in compute_capability.split(".")[:2])
    except ValueError:
        return None
    if major == 7:
        return "Volta" if minor < 5 else "Turing"
    if major == 8:
        return "Ampere" if minor < 9 else "Ada Lovelace"
    return _ARCH_BY_MAJOR.get(major)


def semver(version: str | None) -> str | None:
    """A DRA version attribute (semver 2.0): "9.0" -> "9.0.0", "535.309.01" -> "535.309.1"; None if not numeric."""
    if not version:
        return None
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    return ".".join(str(int(p)) for p in [*parts, "0", "0"][:3])


def pcie_root(sys_root: str, bus_id: str) -> str | None:
    """`pci<domain>:<bus>` of the root complex above `bus_id` (the standard pcieRoot's format), from sysfs."""
    try:
        real = os.path.realpath(os.path.join(sys_root, "bus", "pci", "devices", bus_id), strict=True)
    except (OSError, TypeError):
        return None
    return next((part for part in real.split("/") if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", part)), None)


def nvlink_domains(inv: Inventory) -> dict[int, str]:
    """GPU index -> domain value for GPUs NVLink joins all to all (a clique of at least two; greedy by index,
    so a ring of four gives two pairs). The value is the lowest PCI bus id of the domain; a GPU in none has none."""
    n = len(inv.gpus)
    joined = {(a, b) for a in range(n) for b in range(n) if a != b and topology.nvlinks_between(inv, a, b) > 0}
    out: dict[int, str] = {}
    for a in range(n):
        if a in out:
            continue
        members = [a]
        for b in range(a + 1, n):
            if b not in out and all((m, b) in joined for m in members):
                members.append(b)
        if len(members) > 1:
            value = min(inv.gpus[m].pci_bus_id for m in members)
            out.update({m: value for m in members})
    return out


def _string(value: str) -> dict[str, Any]:
    return {"string": value}


def _common(gpu: Gpu, inv: Inventory, sys_root: str) -> dict[str, dict[str, Any]]:
    """Attributes a GPU and its MIG devices share (CommonAttributesMig takes them from the parent)."""
    attrs: dict[str, dict[str, Any]] = {}
    if gpu.name:
        attrs["productName"] = _string(gpu.name)
    if gpu.brand:
        attrs["brand"] = _string(_BRANDS.get(gpu.brand.replace("-", "").lower(), gpu.brand))
    arch = architecture(gpu.compute_capability)
    if arch:
        attrs["architecture"] = _string(arch)
    for name, value in (("cudaComputeCapability", gpu.compute_capability), ("driverVersion", inv.driver_version),
                        ("cudaDriverVersion", inv.cuda_version)):
        version = semver(value)
        if version:
            attrs[name] = {"version": version}
    if gpu.pci_bus_id:
        attrs[STANDARD + "pciBusID"] = _string(gpu.pci_bus_id)
        root = pcie_root(sys_root, gpu.pci_bus_id)
        if root:
            attrs[STANDARD + "pcieRoot"] = _string(root)
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attrs[STANDARD + "numaNode"] = {"int": gpu.numa_node}
    return attrs


def _memory(mib: int | None) -> dict[str, Any]:
    return {"memory": {"value": f"{mib}Mi"}} if mib else {}


def gpu_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor}"


def mig_name(parent: Gpu, mig: MigDevice, where: Placement | None) -> str:
    """NVIDIA's `gpu-<minor>-mig-<profile>-<profile id>-<placement start>` (profile without dots, RFC 1123; mig.go
    `ToCanonicalName`); where NVML did not give the GPU instance's profile id and placement,
    `gpu-<minor>-mig-<profile>-gi<gi>-ci<ci>`, which cannot be mistaken for it."""
    profile = _RFC1123_BAD.sub("-", mig.profile.replace(".", "").lower()).strip("-") or "unknown"
    if where is not None:
        return f"{gpu_name(parent)}-mig-{profile}-{where.profile_id}-{where.start}"[:63]
    return f"{gpu_name(parent)}-mig-{profile}-gi{mig.gi}-ci{mig.ci}"[:63]


def mig_capacity(mig: MigDevice, where: Placement | None) -> dict[str, Any]:
    """`memory`, and one `memorySlice<i>` per memory slice the instance takes (NVIDIA's deviceinfo.go
    `MigDeviceInfo.GetDevice`: where on the GPU it sits)."""
    out = _memory(mig.memory_mib)
    if where is not None:
        for i in range(where.start, where.start + where.size):
            out[f"memorySlice{i}"] = {"value": "1"}
    return out


def build(inv: Inventory, sys_root: str = "/sys", placements: Mapping[str, Placement] | None = None
          ) -> list[DraDevice]:
    """Every device of the node, in the plugin's order (GPU index, then MIG index); `placements`: MIG device
    UUID -> where it sits (placement.read)."""
    domains = nvlink_domains(inv)
    out: list[DraDevice] = []
    for resource in plan(inv, Options(mig_strategy="mixed", id_strategy="uuid")):
        for dev in resource.devices:
            out.append(_device(inv, dev, domains, sys_root, placements or {}))
    out.sort(key=lambda d: d.key)
    return out


def _device(inv: Inventory, dev: PluginDevice, domains: dict[int, str], sys_root: str,
            placements: Mapping[str, Placement]) -> DraDevice:
    gpu = inv.gpus[dev.gpu_index]
    attrs = _common(gpu, inv, sys_root)
    target = dev.target
    if isinstance(target, MigDevice):
        where = placements.get(target.uuid)
        name = mig_name(gpu, target, where)
        attrs.update({"type": _string("mig"), "parentUUID": _string(gpu.uuid), "profile": _string(target.profile)})
        if target.uuid:
            attrs["uuid"] = _string(target.uuid)
        capacity = mig_capacity(target, where)
    else:
        name = gpu_name(gpu)
        attrs.update({"type": _string("gpu"), "uuid": _string(gpu.uuid)})
        if gpu.index in domains:
            attrs[NVLINK_DOMAIN] = _string(domains[gpu.index])
        capacity = _memory(gpu.memory_mib)
    entry: dict[str, Any] = {"name": name, "attributes": dict(sorted(attrs.items()))}
    if capacity:
        entry["capacity"] = capacity
    return DraDevice(name, target, dev.key, dev.node_paths, entry)


def published(devices: Sequence[DraDevice], unhealthy: Sequence[tuple[int, int]] | set[tuple[int, int]]
              ) -> list[dict[str, Any]]:
    """The slice's device list: the healthy devices (an unhealthy one is withdrawn until it recovers)."""
    bad = set(unhealthy)
    return [d.entry for d in devices if d.key not in bad][:MAX_DEVICES_PER_SLICE]
