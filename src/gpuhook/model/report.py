"""Human and JSON renderings of an Inventory and of ContainerEdits (for `info`, `list` and `doctor`)."""

from __future__ import annotations

from typing import Any

from gpuhook.model import catalogue, topology
from gpuhook.model.contract import GATED_DEVICE_ENV, IMEX_CHANNELS
from gpuhook.model.edits import ContainerEdits
from gpuhook.model.inventory import DeviceNode, Inventory
from gpuhook.model.record import as_dict


def _known(value: object, unit: str = "") -> str:
    """A value the host may not know (None): "unknown" in text, as null in JSON."""
    return "unknown" if value is None else f"{value}{unit}"


def _node(n: DeviceNode) -> str:
    return f"{n.path} ({n.type} {n.major}:{n.minor})"


def format_inventory(inv: Inventory) -> str:
    lines = [
        f"driver version: {inv.driver_version}",
        f"CUDA version:   {inv.cuda_version or 'unknown'}",
        f"source:         {inv.source}" + (f" ({'; '.join(inv.notes)})" if inv.notes else ""),
        f"roots:          driver={inv.driver_root} dev={inv.dev_root} proc={inv.proc_root}",
        f"GPUs ({len(inv.gpus)}):",
    ]
    for g in inv.gpus:
        mig = " MIG enabled" if g.mig_enabled else ""
        lines.append(
            f"  {g.index}: {g.uuid or '-'} {g.pci_bus_id or '-'} minor={g.minor} {g.name}"
            f" {_known(g.memory_mib, ' MiB')} cc={_known(g.compute_capability)} brand={_known(g.brand)}{mig}"
        )
        for m in g.mig_devices:
            caps = ", ".join(_node(n) for n in m.cap_nodes)
            lines.append(f"     {m.name}: {m.uuid or '-'} {m.profile or '-'} gi={m.gi} ci={m.ci} [{caps}]")
    lines += format_topology(inv)
    lines.append("control nodes:")
    for n in [*inv.control_nodes.values(), *inv.mig_control_nodes.values()]:
        lines.append(f"  {_node(n)}")
    lines += _datacenter_lines(inv)
    by_cap: dict[str, list[str]] = {}
    for f in inv.files:
        by_cap.setdefault(f"{f.capability} {f.kind}", []).append(f.path)
    lines.append("driver files:")
    for key in sorted(by_cap):
        lines.append(f"  {key} ({len(by_cap[key])}):")
        lines.extend(f"    {p}" for p in by_cap[key])
    return "\n".join(lines)


def format_topology(inv: Inventory) -> list[str]:
    """The GPU-to-GPU matrix as `nvidia-smi topo -m` prints it (NV# for NVLinks, else the common ancestor)."""
    if not inv.gpus:
        return []
    if not topology.known(inv):
        return ["topology: unknown (" + ("not read from NVML" if inv.source == "nvml" else "no NVML") + ")"]
    names = [f"GPU{g.index}" for g in inv.gpus]
    lines = ["topology:", "        " + "".join(f"{n:<6}" for n in names) + "NUMA"]
    for g, row in zip(inv.gpus, topology.matrix(inv)):  # one row per GPU (topology.matrix)
        numa = "N/A" if g.numa_node is None else str(g.numa_node)
        lines.append(f"  {names[g.index]:<6}" + "".join(f"{c:<6}" for c in row) + numa)
    lines.append("  legend: " + "; ".join(f"{k} = {v}" for k, v in topology.LEGEND.items()))
    return lines


def topology_to_dict(inv: Inventory) -> dict[str, Any]:
    """`gpuhook info --json`'s `topology`: the same matrix as the human output, and its legend."""
    return {"known": topology.known(inv), "matrix": topology.matrix(inv) if topology.known(inv) else [],
            "legend": dict(topology.LEGEND)}


def _datacenter_lines(inv: Inventory) -> list[str]:
    """IMEX channels and the gated families: what a container asking for each would get on this host."""
    lines = ["datacenter devices:"]
    if inv.imex_major is None:
        lines.append(f"  IMEX channels ({IMEX_CHANNELS}): none (no {catalogue.IMEX_DEVICES_NAME} in /proc/devices)")
    else:
        found = ", ".join(n.path.rsplit("/", 1)[-1] for n in inv.imex_channels) or "no channel nodes"
        lines.append(f"  IMEX channels ({IMEX_CHANNELS}, major {inv.imex_major}): {found}")
    for family in catalogue.GATED:
        nodes = inv.gated_nodes.get(family.name, [])
        mounts = [f.path for f in inv.gated_mounts.get(family.name, [])]
        what = ", ".join(_node(n) for n in nodes) or "none"
        extra = f"; mounts {', '.join(mounts)}" if mounts else ""
        lines.append(f"  {family.name} ({GATED_DEVICE_ENV[family.name]}=enabled): {what}{extra}")
    return lines


def edits_to_dict(edits: ContainerEdits) -> dict[str, Any]:
    """`list --json` and doctor's container summary: snake_case field names, as `info --json` (the CDI spec's
    camelCase is the spec's own format, not gpuhook's reports)."""
    return {
        "env": list(edits.env),
        "device_nodes": [as_dict(n) for n in edits.device_nodes],
        "mounts": [
            {"host_path": m.host_path, "container_path": m.container_path, "options": list(m.options)}
            for m in edits.mounts
        ],
        "symlinks": [{"link": s.link, "target": s.target} for s in edits.symlinks],
        "ld_dirs": list(edits.ld_dirs),
    }


def format_edits(edits: ContainerEdits) -> str:
    lines = ["device nodes:"]
    lines += [f"  {_node(n)}" for n in edits.device_nodes]
    lines.append("mounts:")
    lines += [f"  {m.host_path} -> {m.container_path} ({','.join(m.options)})" for m in edits.mounts]
    lines.append("links:")
    lines += [f"  {s.link} -> {s.target}" for s in edits.symlinks]
    lines.append("ld cache folders:")
    lines += [f"  {d}" for d in edits.ld_dirs]
    return "\n".join(lines)
