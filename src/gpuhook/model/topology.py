"""GPU-to-GPU topology as read from the inventory (pure): NVLink counts, PCI common ancestors, the matrix.

Discovery reads NVML once (links, their far ends, common ancestors, P2P status) and stores it per GPU; the device
plugin's preferred allocation, `gpuhook info` and the feature labels all read it from here, so there is one
meaning of "how many NVLinks join GPU a and b" and "how far apart are they on PCIe".
"""

from __future__ import annotations

from gpuhook.model.inventory import Gpu, Inventory

# NVML's nvmlGpuTopologyLevel_t.
LEVEL_INTERNAL = 0
LEVEL_SINGLE = 10
LEVEL_MULTIPLE = 20
LEVEL_HOSTBRIDGE = 30
LEVEL_NODE = 40
LEVEL_SYSTEM = 50
LEVEL_UNKNOWN = 60  # worse than any level NVML gives: pairs whose ancestor could not be read

# How `nvidia-smi topo -m` names a common ancestor (NV# wins when NVLinks join the pair).
LEVEL_NAMES: dict[int, str] = {
    LEVEL_INTERNAL: "PIX",
    LEVEL_SINGLE: "PIX",
    LEVEL_MULTIPLE: "PXB",
    LEVEL_HOSTBRIDGE: "PHB",
    LEVEL_NODE: "NODE",
    LEVEL_SYSTEM: "SYS",
}
LEGEND: dict[str, str] = {
    "X": "Self",
    "SYS": "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes",
    "NODE": "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node",
    "PHB": "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
    "PXB": "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
    "PIX": "Connection traversing at most a single PCIe bridge",
    "NV#": "Connection traversing a bonded set of # NVLinks",
}


def known(inv: Inventory) -> bool:
    """Whether every GPU's topology was read (NVML answered for every pair)."""
    n = len(inv.gpus)
    return n > 0 and all(len(g.pci_levels) == n for g in inv.gpus)


def nvlink_count(gpu: Gpu) -> int:
    """Active NVLinks of one GPU (to peers or to NVSwitches)."""
    return len(gpu.nvlinks)


def nvlinks_between(inv: Inventory, a: int, b: int) -> int:
    """NVLinks joining GPUs `a` and `b` (indices): direct links to the other's bus id, plus, through NVSwitches
    both reach, as many links as the less connected of the two has to those switches (`nvidia-smi topo -m`
    shows NV18 between every pair of an 8-GPU H100 NVSwitch box)."""
    if a == b:
        return 0
    ga, gb = inv.gpus[a], inv.gpus[b]
    direct = sum(1 for link in ga.nvlinks if link.remote_type == "gpu" and link.remote_bus_id == gb.pci_bus_id)
    switches_a = {link.remote_bus_id for link in ga.nvlinks if link.remote_type == "switch"}
    switches_b = {link.remote_bus_id for link in gb.nvlinks if link.remote_type == "switch"}
    shared = switches_a & switches_b
    if not shared:
        return direct
    via_a = sum(1 for link in ga.nvlinks if link.remote_type == "switch" and link.remote_bus_id in shared)
    via_b = sum(1 for link in gb.nvlinks if link.remote_type == "switch" and link.remote_bus_id in shared)
    return direct + min(via_a, via_b)


def level_between(inv: Inventory, a: int, b: int) -> int:
    """NVML's common-ancestor level of GPUs `a` and `b` (indices); LEVEL_UNKNOWN when it was not read."""
    if a == b:
        return LEVEL_INTERNAL
    levels = inv.gpus[a].pci_levels
    return levels[b] if b < len(levels) else LEVEL_UNKNOWN


def cell(inv: Inventory, a: int, b: int) -> str:
    """One `nvidia-smi topo -m` cell: X, NV<n>, PIX/PXB/PHB/NODE/SYS, or ? when unknown."""
    if a == b:
        return "X"
    links = nvlinks_between(inv, a, b)
    if links:
        return f"NV{links}"
    return LEVEL_NAMES.get(level_between(inv, a, b), "?")


def matrix(inv: Inventory) -> list[list[str]]:
    """The GPU-by-GPU matrix of cells, in index order."""
    n = len(inv.gpus)
    return [[cell(inv, a, b) for b in range(n)] for a in range(n)]
