"""NUMA placement and GetPreferredAllocation, computed from the inventory once (and again on device change).

The incumbent re-initialises NVML on every GetPreferredAllocation and fails the RPC (and so the pod's admission)
when a topology query fails. Here topology is a table built at plan time; choosing is pure and deterministic,
and any failure falls back to index order with a log line instead of an error.

With the GPU-to-GPU topology discovery read from NVML (model/topology.py), the chooser scores every candidate
set by the links among its members, like NVIDIA's go-gpuallocator best-effort policy (which sums per-pair
weights: 100 per NVLink, 10-60 by PCIe distance, and maximises over partitions of all free GPUs) but in strict
order: the most NVLinks first, then the closest common PCI ancestors, then the fewest NUMA nodes, then the fewest
NVLinks cut from the devices left over (so a request of one leaves bridged pairs whole, as the partition search
does); remaining ties go to the NUMA/PCI choice below.
MIG devices and replicas are scored by their parent GPU (MIG devices of one GPU count as closest of all).
Without that topology (procfs discovery, an NVML that did not answer) the NUMA/PCI choice is the answer.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar, Union

from gpuhook.model import topology as topo
from gpuhook.model.inventory import Inventory
from gpuhook.model.record import Record
from gpuhook.plugin.devices import PluginDevice

log = logging.getLogger("gpuhook.plugin.topology")

Unit = TypeVar("Unit", bound=Hashable)  # what the topology choice picks: a device id, or a physical device key
Rank = tuple[int, Union[int, str]]  # noqa: UP007 - evaluated at import: Python 3.9 has no `int | str`


class Place(Record):
    numa: int  # -1 when unknown
    bus: tuple[int, int, int, int]  # (domain, bus, device, function); all -1 when unknown


def parse_bus_id(bus_id: str) -> tuple[int, int, int, int]:
    """0000:18:00.0 -> (0, 0x18, 0, 0); anything unparsable sorts last."""
    try:
        domain, bus, rest = bus_id.split(":")
        dev, fn = rest.split(".")
        return (int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16))
    except ValueError:
        return (-1, -1, -1, -1)


def sysfs_numa_node(sys_root: str, bus_id: str) -> int:
    """The PCI device's NUMA node from sysfs, -1 when absent (single-node hosts say -1 too)."""
    try:
        with open(os.path.join(sys_root, "bus/pci/devices", bus_id, "numa_node"), encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def build(inv: Inventory, devices: Iterable[PluginDevice], sys_root: str = "/sys") -> dict[str, Place]:
    """id -> Place. A MIG device (and a replica) sits where its GPU sits; NUMA from NVML first, sysfs second."""
    numa_by_gpu: dict[int, int] = {}
    table: dict[str, Place] = {}
    for d in devices:
        if d.gpu_index not in numa_by_gpu:
            gpu = inv.gpus[d.gpu_index]
            numa = gpu.numa_node
            if numa is None and gpu.pci_bus_id:
                numa = sysfs_numa_node(sys_root, gpu.pci_bus_id)
            numa_by_gpu[d.gpu_index] = -1 if numa is None else numa
        table[d.id] = Place(numa_by_gpu[d.gpu_index], parse_bus_id(d.pci_bus_id))
    return table


def _distance(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> tuple[int, int]:
    """PCI closeness: same domain first, then how far apart the bus numbers are."""
    return (0 if a[0] == b[0] else 1, abs(a[1] - b[1]))


SAME_GPU_LINKS = 1000  # two MIG devices (or replicas) of one GPU: closer than any NVLink pair
MAX_SETS = 2000  # candidate sets scored exhaustively (about 60 ms); beyond, grown greedily, then improved
MAX_SWAPS = 32  # improvement rounds after the greedy growth


class Links(Record):
    """GPU-to-GPU NVLink counts and PCI levels by GPU index, copied out of the inventory at plan time."""

    nvlinks: tuple[tuple[int, ...], ...]
    levels: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, inv: Inventory | None) -> Links | None:
        """None when the inventory holds no (or a partial) topology: the chooser then ignores it."""
        if inv is None or not topo.known(inv):
            return None
        n = range(len(inv.gpus))
        return cls(tuple(tuple(topo.nvlinks_between(inv, a, b) for b in n) for a in n),
                   tuple(tuple(topo.level_between(inv, a, b) for b in n) for a in n))

    def pair(self, a: int, b: int) -> tuple[int, int]:
        """(NVLinks, PCI level) of two parents; one parent (MIG siblings, replicas) is the closest there is."""
        if a == b:
            return SAME_GPU_LINKS, topo.LEVEL_INTERNAL
        return self.nvlinks[a][b], self.levels[a][b]


class Chooser:
    """GetPreferredAllocation for one resource: a pure function of (table, links, order, request)."""

    def __init__(self, devices: Sequence[PluginDevice], table: dict[str, Place], inv: Inventory | None = None
                 ) -> None:
        self.order = {d.id: i for i, d in enumerate(devices)}
        self.key = {d.id: d.key for d in devices}
        self.parent = {d.id: d.key[0] for d in devices}  # the GPU a device (MIG device, replica) lives on
        self.table = table
        self.replicated = any(d.replica > 0 for d in devices)
        self.links = Links.of(inv)
        self.numa = {d.key[0]: table[d.id].numa if d.id in table else -1 for d in devices}

    def choose(self, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        must_list = list(dict.fromkeys(must))
        if size <= len(must_list):
            return must_list  # kubelet never asks for fewer than it must include; answer what it insists on
        pool = sorted({a for a in available if a not in must_list}, key=self._rank)
        try:
            picked = self._pick(pool, must_list, size - len(must_list))
        except Exception as exc:  # a topology bug must never fail the pod's admission
            log.warning("preferred allocation: topology choice failed (%s); falling back to index order", exc)
            picked = pool[: size - len(must_list)]
        return must_list + picked

    def _rank(self, device_id: str) -> Rank:
        return (self.order.get(device_id, len(self.order)), device_id)

    def _place(self, device_id: str) -> Place:
        return self.table.get(device_id, Place(-1, (-1, -1, -1, -1)))

    def _pick(self, pool: list[str], must: list[str], need: int) -> list[str]:
        if need >= len(pool):
            return pool
        if self.links is None:
            return self._spread(pool, must, need) if self.replicated else self._numa_pci(pool, must, need)
        if self.replicated:
            return self._spread_linked(pool, must, need)
        legacy = set(self._numa_pci(pool, must, need))
        return sorted(self._best(pool, must, need, lambda d: self.parent[d], self._rank, legacy), key=self._rank)

    # -- the topology choice ------------------------------------------------------------------------------------
    def _best(self, units: Sequence[Unit], fixed: Sequence[Unit], need: int, parent: Callable[[Unit], int],
              rank: Callable[[Unit], Rank], prefer: set[Unit]) -> list[Unit]:
        """The `need` units (device ids, or physical keys for replicas) that with `fixed` score best; ties go to
        those the NUMA/PCI choice (`prefer`) also picked, then to the lowest ranks."""
        assert self.links is not None
        links = self.links
        fixed_parents = [parent(u) for u in fixed]

        def score(chosen: Sequence[Unit]) -> tuple[int, int, int, int, int, list[Rank]]:
            parents = fixed_parents + [parent(u) for u in chosen]
            nvl = lvl = 0
            for a, b in itertools.combinations(parents, 2):
                n, v = links.pair(a, b)
                nvl, lvl = nvl + n, lvl + v
            numa = len({self.numa.get(p, -1) for p in parents})
            rest = [parent(u) for u in units if u not in chosen]
            cut = sum(links.pair(a, b)[0] for a in parents[len(fixed_parents):] for b in rest)
            return (-nvl, lvl, numa, cut, -len(prefer.intersection(chosen)), sorted(rank(u) for u in chosen))

        ordered = sorted(units, key=rank)
        if math.comb(len(ordered), need) <= MAX_SETS:
            return list(min(itertools.combinations(ordered, need), key=score))
        chosen: list[Unit] = []
        while len(chosen) < need:  # greedy: add the unit that scores best with what is chosen so far
            best = min((u for u in ordered if u not in chosen),
                       key=lambda u: (*score([*chosen, u])[:4], rank(u)))
            chosen.append(best)
        for _ in range(MAX_SWAPS):  # then swap one in, one out while that scores better (greedy is myopic)
            current = score(chosen)
            swaps = ([u if u != out else into for u in chosen] for out in chosen for into in ordered
                     if into not in chosen)
            better = min(swaps, key=score, default=None)
            if better is None or score(better) >= current:
                break
            chosen = better
        return chosen

    def _spread_linked(self, pool: list[str], must: list[str], need: int) -> list[str]:
        """Replicas: one per physical device first as _spread does, the physical devices chosen by their links."""
        fixed = sorted({self.key[m] for m in must if m in self.key})
        keys = sorted({self.key[d] for d in pool} - set(fixed))
        if not keys:
            return self._spread(pool, must, need)
        legacy = {self.key[d] for d in self._spread(pool, must, need)}
        best = self._best(keys, fixed, min(need, len(keys)), lambda k: k[0], lambda k: k, legacy)
        return self._spread(pool, must, need, prefer=set(best))

    # -- the NUMA/PCI choice (no topology, and the tie-break) -----------------------------------------------------
    def _numa_pci(self, pool: list[str], must: list[str], need: int) -> list[str]:
        by_numa: dict[int, list[str]] = {}
        for d in pool:
            by_numa.setdefault(self._place(d).numa, []).append(d)
        picked: list[str] = []
        # 1. The must-include devices' nodes first: the whole allocation as close to them as it can be.
        for n in sorted({self._place(d).numa for d in must} & by_numa.keys()):
            picked += self._closest(by_numa.pop(n), self._on(n, must), need - len(picked))
            if len(picked) == need:
                return sorted(picked, key=self._rank)
        # 2. One node that holds the rest: the tightest fit (keeps bigger nodes whole), then the lowest id.
        rest = need - len(picked)
        fitting = [n for n, ds in by_numa.items() if len(ds) >= rest]
        if fitting:
            best = min(fitting, key=lambda n: (len(by_numa[n]), n))
            return sorted(picked + self._closest(by_numa[best], self._on(best, must), rest), key=self._rank)
        # 3. Spread over the fewest nodes: the fullest first.
        for n in sorted(by_numa, key=lambda n: (-len(by_numa[n]), n)):
            picked += self._closest(by_numa[n], self._on(n, must + picked), need - len(picked))
            if len(picked) == need:
                break
        return sorted(picked, key=self._rank)

    def _on(self, numa: int, ids: list[str]) -> list[str]:
        return [i for i in ids if self._place(i).numa == numa]

    def _closest(self, candidates: list[str], anchors: list[str], need: int) -> list[str]:
        """`need` of `candidates` closest on the PCI tree to the anchors, else the tightest run of bus ids."""
        if need <= 0:
            return []
        if need >= len(candidates):
            return list(candidates)
        buses = {d: self._place(d).bus for d in candidates}
        if anchors:
            anchor_buses = [self._place(a).bus for a in anchors]
            return sorted(candidates, key=lambda d: (min(_distance(buses[d], a) for a in anchor_buses),
                                                     self._rank(d)))[:need]
        ordered = sorted(candidates, key=lambda d: (buses[d], self._rank(d)))
        best = min(range(len(ordered) - need + 1),
                   key=lambda i: (_distance(buses[ordered[i]], buses[ordered[i + need - 1]]), i))
        return sorted(ordered[best:best + need], key=self._rank)

    def _spread(self, pool: list[str], must: list[str], need: int,
                prefer: set[tuple[int, int]] | None = None) -> list[str]:
        """Replicas: one per physical device first, least-shared devices first (time-slicing spreads load);
        `prefer`: physical devices to take before the others (the topology's choice)."""
        prefer = prefer or set()
        free: dict[tuple[int, int], list[str]] = {}
        for d in pool:
            free.setdefault(self.key[d], []).append(d)
        used = {self.key[m] for m in must if m in self.key}
        picked: list[str] = []
        while len(picked) < need:
            keys = sorted((k for k, ds in free.items() if ds),
                          key=lambda k: (k in used, k not in prefer, -len(free[k]), k))
            k = keys[0]
            picked.append(free[k].pop(0))
            used.add(k)
        return sorted(picked, key=self._rank)


def numa_of(table: dict[str, Place], device_id: str) -> int:
    place = table.get(device_id)
    return place.numa if place else -1
