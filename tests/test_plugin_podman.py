"""End to end: the CDI names the device plugin's Allocate returns, given to podman against the spec it wrote.

The plugin runs as kubelet would see it (real gRPC, a test kubelet); podman 4.3.1 + runc start a busybox
container with `--device <name>` for each returned name, and the container must see exactly those GPUs.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fakefix import FAKE_MIG_LAYOUT
from support.kubelet import TestKubelet
from support.podman import LIST_NODES, Podman, need_podman, parse_nodes
from support.processes import short_tempdir
from support.runc import busybox_rootfs, need_busybox

from gpuhook.cli.plugin import default_hook_path
from gpuhook.discover import Roots, discover
from gpuhook.fakedriver import FakeDriver
from gpuhook.plugin.devices import Options
from gpuhook.plugin.health import HealthConfig
from gpuhook.plugin.lifecycle import Plugin, PluginConfig

pytestmark = pytest.mark.e2e
GPU_NODE = re.compile(r"^/dev/nvidia\d+$")
KIND = "k8s.device-plugin.nvidia.com/gpu"  # the plugin's CDI kind (NVIDIA's plugin's), not the host spec's


@pytest.fixture(scope="module")
def fake(fake_driver_factory) -> FakeDriver:  # type: ignore[no-untyped-def]
    return fake_driver_factory(gpus=4, mig=FAKE_MIG_LAYOUT)  # GPU 1 in MIG mode (shared with test_cdi_podman)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    podman = need_podman()
    need_busybox()
    hook = default_hook_path()
    if not os.access(hook, os.X_OK):
        pytest.fail(f"gpuhook must be installed (pip install -e .) for the spec's hooks: {hook}")
    world = Podman.create(tmp_path_factory.mktemp("podman"), podman)
    yield world
    world.close()


class Cluster:
    """A test kubelet and the plugin serving it, the plugin's spec in podman's private /etc/cdi."""

    def __init__(self, fake: FakeDriver, world: Podman, options: Options) -> None:
        self.dir = short_tempdir()
        self.kubelet = TestKubelet(os.path.join(self.dir, "dp")).start()
        inv = discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")))
        config = PluginConfig(options=options, kubelet_dir=self.kubelet.directory, cdi_spec_dir=str(world.spec_dir),
                              hook_path=default_hook_path(), health=HealthConfig(enabled=False),
                              sys_root=str(fake.root / "sys"), hook_state_dir=None)
        self.plugin = Plugin(config, lambda: inv)
        self.plugin.start()
        self.thread = threading.Thread(target=self.plugin.run, daemon=True)
        self.thread.start()
        self.kubelet.wait_registrations(len(self.plugin.resources))

    def ids(self, resource: str = "nvidia.com/gpu") -> list[str]:
        return [d.ID for d in self.kubelet.stream(resource).first().devices]

    def allocate(self, ids: list[str], resource: str = "nvidia.com/gpu") -> list[str]:
        resp = self.kubelet.client(resource).allocate(ids)
        return [d.name for d in resp.container_responses[0].cdi_devices]

    def close(self) -> None:
        self.plugin.request_stop()
        self.thread.join(10)
        self.kubelet.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def cluster_factory(fake: FakeDriver, world: Podman) -> Iterator[type]:
    made: list[Cluster] = []

    def make(**options: object) -> Cluster:
        cluster = Cluster(fake, world, Options(**options))  # type: ignore[arg-type]
        made.append(cluster)
        return cluster

    yield make  # type: ignore[misc]
    for cluster in made:
        cluster.close()
    for name in ("k8s.device-plugin.nvidia.com-gpu.json", "nvidia.yaml"):
        (world.spec_dir / name).unlink(missing_ok=True)


def container_nodes(world: Podman, tmp_path: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    result = world.sh(busybox_rootfs(tmp_path), names, LIST_NODES)
    assert result.returncode == 0, result.stderr
    return parse_nodes(result.stdout)


def gpu_nodes(nodes: dict[str, tuple[int, int]]) -> set[str]:
    return {p for p in nodes if GPU_NODE.match(p)}


def test_allocated_gpus_by_uuid_are_exactly_what_the_container_sees(
        cluster_factory, world: Podman, fake: FakeDriver, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(list_strategies=("cdi-cri",))
    ids = cluster.ids()
    assert ids == [fake.gpus[i].uuid for i in (0, 1, 2, 3)]  # mig-strategy none: whole GPUs
    names = cluster.allocate([ids[0], ids[2]])
    assert names == [f"{KIND}={ids[0]}", f"{KIND}={ids[2]}"]
    nodes = container_nodes(world, tmp_path, names)
    assert gpu_nodes(nodes) == {fake.gpus[0].node_path, fake.gpus[2].node_path}
    assert nodes[fake.gpus[2].node_path] == (195, fake.gpus[2].minor)
    assert "/dev/nvidiactl" in nodes


def test_index_strategy_one_gpu(cluster_factory, world: Podman, fake: FakeDriver,  # type: ignore[no-untyped-def]
                                tmp_path: Path) -> None:
    cluster = cluster_factory(id_strategy="index")
    names = cluster.allocate(["3"])
    assert names == [f"{KIND}=3"]
    assert gpu_nodes(container_nodes(world, tmp_path, names)) == {fake.gpus[3].node_path}


def test_mixed_mig_device(cluster_factory, world: Podman, fake: FakeDriver,  # type: ignore[no-untyped-def]
                          tmp_path: Path) -> None:
    cluster = cluster_factory(mig_strategy="mixed")
    resource = "nvidia.com/mig-2g.20gb"
    (mig_id,) = cluster.ids(resource)
    names = cluster.allocate([mig_id], resource)
    assert names == [f"{KIND}={mig_id}"]
    nodes = container_nodes(world, tmp_path, names)
    assert gpu_nodes(nodes) == {fake.gpus[1].node_path}  # the MIG device's parent GPU, nothing else
    (mig,) = [m for m in fake.mig_devices if m.uuid == mig_id]
    assert set(mig.cap_nodes) <= set(nodes)
    others = {c for m in fake.mig_devices if m.uuid != mig_id for c in m.cap_nodes} - set(mig.cap_nodes)
    assert not others & set(nodes)


def test_replicas_map_back_to_their_gpu(cluster_factory, world: Podman, fake: FakeDriver,  # type: ignore[no-untyped-def]
                                        tmp_path: Path) -> None:
    cluster = cluster_factory(replicas=2)
    ids = cluster.ids()
    names = cluster.allocate([ids[0], ids[1]])  # both replicas of GPU 0
    assert names == [f"{KIND}={fake.gpus[0].uuid}"]
    assert gpu_nodes(container_nodes(world, tmp_path, names)) == {fake.gpus[0].node_path}


def test_plugin_names_resolve_beside_a_host_spec(cluster_factory, world: Podman, fake: FakeDriver,  # type: ignore[no-untyped-def]
                                                 tmp_path: Path) -> None:
    """A node with `gpuhook generate-cdi`'s nvidia.com/gpu spec in the same directory as the plugin's: podman
    resolves the plugin's names and the host spec's alike (one kind each, no name defined twice)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", str(fake.root),
                    "--proc-root", str(fake.root / "proc"), "--hook-path", default_hook_path(),
                    "--output", str(world.spec_dir / "nvidia.yaml")], check=True, capture_output=True)
    cluster = cluster_factory(list_strategies=("cdi-cri",))
    names = cluster.allocate([cluster.ids()[2]])
    assert names == [f"{KIND}={fake.gpus[2].uuid}"]
    assert gpu_nodes(container_nodes(world, tmp_path, names)) == {fake.gpus[2].node_path}
    assert gpu_nodes(container_nodes(world, tmp_path, ["nvidia.com/gpu=3"])) == {fake.gpus[3].node_path}
