"""NVLink-aware preferred allocation: the fake NVML's layouts read once into the inventory, chosen over kubelet's
gRPC (tests/support/kubelet.py), and the pure chooser on hand-built topologies. Expected sets are hand-computed
from the layouts in fakedriver/model.py: bridge pairs 0-1, 2-3, 4-5, 6-7 (NV12), NVSwitch all-to-all (NV18),
NUMA node 0 = GPUs 0-3, node 1 = GPUs 4-7, common ancestor NODE within a node and SYS across."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from support.kubelet import TestKubelet
from test_plugin import running

from gpuhook.cli.app import main
from gpuhook.discover import Inventory, Roots, discover
from gpuhook.discover.cache import load_fresh, store
from gpuhook.model import record
from gpuhook.model import topology as topo
from gpuhook.model.inventory import Gpu, NvLink
from gpuhook.model.report import format_inventory
from gpuhook.plugin import topology
from gpuhook.plugin.devices import Options, plan
from gpuhook.plugin.health import HealthConfig

NO_HEALTH = HealthConfig(enabled=False)
EIGHT = [str(i) for i in range(8)]


@pytest.fixture
def kubelet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestKubelet]:
    from support.processes import short_tempdir

    path = short_tempdir()
    with TestKubelet(os.path.join(path, "dp")) as k:
        yield k


def inventory(fake: Any) -> Inventory:
    return discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")))


def free(*taken: int) -> list[str]:
    return [i for i in EIGHT if int(i) not in taken]


# -- discovery and the fake's NVML ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, row0", [
    ("bridge", ["X", "NV12", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]),
    ("nvswitch", ["X"] + ["NV18"] * 7),
    ("none", ["X", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]),
])
def test_nvml_topology_read_into_the_inventory(fake_driver_factory: Any, layout: str, row0: list[str]) -> None:
    inv = inventory(fake_driver_factory(gpus=8, nvlink=layout))
    assert inv.source == "nvml" and topo.known(inv)
    assert topo.matrix(inv)[0] == row0
    assert all(all(g.p2p_ok) for g in inv.gpus)
    expected_links = {"bridge": 12, "nvswitch": 18, "none": 0}[layout]
    assert [topo.nvlink_count(g) for g in inv.gpus] == [expected_links] * 8
    if layout == "nvswitch":
        assert {link.remote_type for g in inv.gpus for link in g.nvlinks} == {"switch"}


def test_topology_survives_the_inventory_cache(fake_driver_factory: Any, tmp_path: Any) -> None:
    fake = fake_driver_factory(gpus=8, nvlink="bridge")
    roots = Roots.make(str(fake.root), proc_root=str(fake.root / "proc"))
    inv = discover(roots)
    store(str(tmp_path / "inv.json"), inv)
    cached = load_fresh(str(tmp_path / "inv.json"), roots)
    assert cached == inv
    assert cached is not None and topo.matrix(cached) == topo.matrix(inv)


def test_procfs_discovery_has_no_topology(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=4, nvlink="bridge")
    inv = discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")), method="procfs")
    assert not topo.known(inv)
    assert all(g.nvlinks == () and g.pci_levels == () for g in inv.gpus)


def test_info_shows_the_topology_matrix(fake_driver_factory: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fake = fake_driver_factory(gpus=4, nvlink="bridge")
    args = ["info", "--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc")]
    assert main(args) == 0
    human = capsys.readouterr().out
    assert "topology:" in human
    assert any(line.split()[:5] == ["GPU0", "X", "NV12", "NODE", "NODE"] for line in human.splitlines())
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["topology"]["matrix"][2] == ["NODE", "NODE", "X", "NV12"]
    assert data["gpus"][0]["nvlinks"][0]["remote_bus_id"] == data["gpus"][1]["pci_bus_id"]


def test_fake_driver_create_nvlink_option(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "nvswitch"
    assert main(["fake-driver", "create", str(root), "--gpus", "3", "--nvlink", "nvswitch", "--no-compat32"]) == 0
    capsys.readouterr()
    assert main(["info", "--driver-root", str(root), "--proc-root", str(root / "proc"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topology"]["matrix"][1] == ["NV18", "X", "NV18"]


def test_fake_driver_create_rejects_an_unknown_layout(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fake-driver", "create", str(tmp_path / "x"), "--nvlink", "ring"]) == 2
    assert "ring" in capsys.readouterr().err


# -- preferred allocation over kubelet's gRPC --------------------------------------------------------------------


BRIDGE_CASES = [
    # (available, must, size, expected): hand-computed best sets
    (EIGHT, [], 2, ["0", "1"]),
    (free(0), [], 2, ["2", "3"]),  # 1 is orphaned; the free pair on the tighter NUMA node
    (free(0, 2), [], 2, ["4", "5"]),  # node 0 holds only orphans: a whole pair on node 1
    (free(0, 2, 4, 6), [], 2, ["1", "3"]),  # no pair left: same NUMA node (NODE beats SYS)
    (EIGHT, [], 4, ["0", "1", "2", "3"]),  # two pairs on one node
    (free(1), [], 4, ["4", "5", "6", "7"]),
    (free(1, 5), [], 4, ["2", "3", "6", "7"]),  # the two whole pairs left, across nodes
    (EIGHT, ["1"], 2, ["1", "0"]),  # must-include first, then its bridge partner
    (["0", "1", "2"], [], 1, ["2"]),  # one GPU: the orphan, leaving the pair 0-1 whole
]
NVSWITCH_CASES = [
    (EIGHT, [], 2, ["1", "2"]),  # NV18 everywhere: one NUMA node, then the NUMA/PCI choice
    (free(0, 1, 2), [], 2, ["5", "6"]),
    (free(0), [], 4, ["4", "5", "6", "7"]),
    (free(4), [], 4, ["0", "1", "2", "3"]),
    (free(0, 3), ["7"], 2, ["7", "6"]),  # must-include's node, the closest bus id to it
]
NONE_CASES = [
    (EIGHT, [], 2, ["1", "2"]),
    (free(1, 2), [], 2, ["0", "3"]),
    (free(0), [], 4, ["4", "5", "6", "7"]),
]


@pytest.mark.parametrize("layout, cases", [("bridge", BRIDGE_CASES), ("nvswitch", NVSWITCH_CASES),
                                           ("none", NONE_CASES)])
def test_preferred_allocation_per_layout(fake_driver_factory: Any, kubelet: TestKubelet, layout: str,
                                         cases: list[tuple[list[str], list[str], int, list[str]]]) -> None:
    fake = fake_driver_factory(gpus=8, nvlink=layout)
    with running(fake, kubelet, Options(id_strategy="index"), NO_HEALTH):
        kubelet.wait_registrations(1)
        client = kubelet.client()
        for available, must, size, expected in cases:
            assert client.preferred(available, must, size) == expected, (available, must, size)
            assert client.preferred(list(reversed(available)), must, size) == expected  # order-independent


def test_two_gpu_request_gets_a_bridged_pair_whenever_one_is_free(fake_driver_factory: Any,
                                                                   kubelet: TestKubelet) -> None:
    """Every subset of taken GPUs: kubelet's 2-GPU request gets an NVLink pair if one is free, and Allocate
    accepts what GetPreferredAllocation answered (device ids are UUIDs, as by default)."""
    fake = fake_driver_factory(gpus=8, nvlink="bridge")
    with running(fake, kubelet, Options(), NO_HEALTH) as plugin:
        kubelet.wait_registrations(1)
        client = kubelet.client()
        assert plugin.inventory is not None
        ids = [g.uuid for g in plugin.inventory.gpus]
        pairs = [{ids[i], ids[i + 1]} for i in range(0, 8, 2)]
        for taken_count in range(7):
            for taken in itertools.combinations(range(8), taken_count):
                available = [u for i, u in enumerate(ids) if i not in taken]
                chosen = client.preferred(available, size=2)
                assert len(chosen) == 2 and set(chosen) <= set(available)
                if any(p <= set(available) for p in pairs):
                    assert set(chosen) in pairs, (taken, chosen)
        chosen = client.preferred(ids[1:], size=2)
        response = client.allocate(chosen)
        assert [d.name for d in response.container_responses[0].cdi_devices] == [f"k8s.device-plugin.nvidia.com/gpu={u}"
                                                                                  for u in chosen]


def test_replicas_choose_whole_parents_by_links(fake_driver_factory: Any, kubelet: TestKubelet) -> None:
    fake = fake_driver_factory(gpus=4, nvlink="bridge")
    with running(fake, kubelet, Options(id_strategy="index", replicas=2), NO_HEALTH):
        kubelet.wait_registrations(1)
        client = kubelet.client()
        every = [f"{g}::{r}" for g in range(4) for r in range(2)]
        assert client.preferred(every, size=2) == ["0::0", "1::0"]  # one replica on each GPU of a pair
        # GPU 0 busy: 1 is alone, the pair 2-3 is whole (least shared would have said 1 and 2)
        assert client.preferred([d for d in every if not d.startswith("0::")], size=2) == ["2::0", "3::0"]
        assert client.preferred(every, must=["2::1"], size=2) == ["2::1", "3::0"]


def test_mig_devices_choose_by_parent(fake_driver_factory: Any, kubelet: TestKubelet) -> None:
    layout = {0: ["1g.10gb", "1g.10gb"], 2: ["1g.10gb", "1g.10gb"], 3: ["1g.10gb", "1g.10gb"]}
    fake = fake_driver_factory(gpus=4, mig=layout, nvlink="bridge")
    with running(fake, kubelet, Options(id_strategy="index", mig_strategy="mixed"), NO_HEALTH):
        kubelet.wait_registrations(2)
        client = kubelet.client("nvidia.com/mig-1g.10gb")
        every = ["0:0", "0:1", "2:0", "2:1", "3:0", "3:1"]
        assert client.preferred(every, size=2) == ["0:0", "0:1"]  # one GPU
        # one MIG device: the lone one on GPU 0, keeping GPU 2 and its NVLink partner 3 whole
        assert client.preferred(every[1:], size=1) == ["0:1"]
        # three: a whole GPU plus its NVLink partner's
        assert client.preferred(every[1:], size=3) == ["2:0", "2:1", "3:0"]


# -- the pure chooser ---------------------------------------------------------------------------------------------


def hand_inventory(levels: list[list[int]], links: dict[tuple[int, int], int], numa: list[int]) -> Inventory:
    n = len(levels)
    bus = [f"0000:{0x10 + i:02x}:00.0" for i in range(n)]
    gpus = []
    for i in range(n):
        nvl: list[NvLink] = []
        for (a, b), count in sorted(links.items()):
            if i in (a, b):
                nvl += [NvLink(bus[b if i == a else a])] * count
        gpus.append(Gpu(index=i, minor=i, uuid=f"GPU-{i}", pci_bus_id=bus[i], numa_node=numa[i],
                        nvlinks=tuple(nvl), pci_levels=tuple(levels[i]), p2p_ok=(True,) * n))
    return Inventory("550.54.15", "12.4", "nvml", "/", "/", "/proc", gpus=gpus)


def chooser(inv: Inventory, **options: Any) -> topology.Chooser:
    devices = plan(inv, Options(id_strategy="index", **options))[0].devices
    return topology.Chooser(devices, topology.build(inv, devices, "/nonexistent"), inv)


def test_common_ancestor_decides_without_nvlinks() -> None:
    # one NUMA node; 0-1 behind one PCIe switch (PIX), 2-3 behind another, pairs across meet at the host bridge
    levels = [[0, 10, 30, 30], [10, 0, 30, 30], [30, 30, 0, 10], [30, 30, 10, 0]]
    c = chooser(hand_inventory(levels, {}, [0, 0, 0, 0]))
    assert c.choose(["0", "1", "2", "3"], [], 2) == ["0", "1"]
    assert c.choose(["1", "2", "3"], [], 2) == ["2", "3"]
    assert c.choose(["1", "2", "3"], ["1"], 2) == ["1", "2"]  # must-include honoured even when it costs
    # NVLinks win over a closer ancestor
    c = chooser(hand_inventory(levels, {(1, 2): 4}, [0, 0, 0, 0]))
    assert c.choose(["0", "1", "2", "3"], [], 2) == ["1", "2"]


def test_unknown_topology_falls_back_to_numa_and_pci() -> None:
    levels = [[0, 10, 30, 30], [10, 0, 30, 30], [30, 30, 0, 10], [30, 30, 10, 0]]
    inv = hand_inventory(levels, {(2, 3): 12}, [0, 0, 0, 0])
    assert chooser(inv).choose(["0", "1", "2", "3"], [], 2) == ["2", "3"]
    inv.gpus[3] = record.replace(inv.gpus[3], pci_levels=())  # one GPU's topology unread: none is used
    c = chooser(inv)
    assert c.links is None
    assert c.choose(["0", "1", "2", "3"], [], 2) == ["0", "1"]  # bus ids 10 11 12 13: the tightest run first


def test_large_pools_are_chosen_greedily_and_deterministically() -> None:
    n = 16
    levels = [[0 if a == b else (40 if a // 8 == b // 8 else 50) for b in range(n)] for a in range(n)]
    links = {(a, a + 1): 12 for a in range(0, n, 2)}
    c = chooser(hand_inventory(levels, links, [i // 8 for i in range(n)]))
    everything = [str(i) for i in range(n)]
    assert c.choose(everything, [], 8) == [str(i) for i in range(8)]  # C(16, 8) sets: the greedy path
    assert c.choose(list(reversed(everything)), [], 8) == [str(i) for i in range(8)]
    chosen = c.choose(everything[1:], [], 6)
    assert {"2", "3", "4", "5", "6", "7"} == set(chosen)


def test_format_inventory_without_topology_says_so() -> None:
    inv = hand_inventory([[0, 10], [10, 0]], {}, [0, 0])
    assert "GPU0  X     PIX" in format_inventory(inv)
    inv.gpus[0] = record.replace(inv.gpus[0], pci_levels=())
    assert "topology: unknown" in format_inventory(inv)
