"""`gpuhook dra-plugin`, the kubelet DRA driver gpu.nvidia.com, without a control plane: its ResourceSlice devices
from simulated drivers, its opaque config and claim parsing, and the whole driver over real gRPC (a test kubelet's
registration and DRAPlugin calls, tests/support/drakubelet.py) against a recorded API server (responses recorded
from a real kube-apiserver v1.34, tests/support/apireplay.py): prepare, its CDI spec (checked with the CDI
schema), idempotence, the checkpoint across a restart, unprepare, refusals, and ResourceSlice publication.
The end-to-end test with a real kubelet, scheduler and containerd is tests/test_dra_e2e.py."""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.apireplay import ApiReplay, recorded
from support.drakubelet import DraKubelet
from support.processes import short_tempdir

from gpuhook.cdi.validate import validate_spec
from gpuhook.discover import Roots, discover
from gpuhook.dra import checkpoint, claimspec, devices, publish
from gpuhook.dra.claim import ClaimError, results
from gpuhook.dra.config import ConfigError, DeviceConfig, parse
from gpuhook.dra.driver import Driver, DriverConfig
from gpuhook.dra.kube import Api
from gpuhook.model.inventory import Inventory
from gpuhook.plugin.health import HealthConfig

NODE = "node1"  # the node the recordings were made on
FAST_HEALTH = HealthConfig(recovery_window=0.5, interval=0.05, event_wait_ms=20)
CLAIM = recorded("claim-allocated")["body"]
CLAIM_UID = CLAIM["metadata"]["uid"]
CLAIM_PATH = recorded("claim-allocated")["request"]["path"]
GPU_CONFIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}


def inventory(fake: Any) -> Inventory:
    return discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")))


# -- devices --------------------------------------------------------------------------------------------------
def test_slice_devices_carry_nvidias_names_and_an_nvlink_domain_per_bridged_pair(fake_driver_factory: Any) -> None:
    inv = inventory(fake_driver_factory(gpus=4, nvlink="bridge"))
    built = devices.build(inv)
    assert [d.name for d in built] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    first = built[0].entry
    attrs = first["attributes"]
    assert attrs["type"] == {"string": "gpu"}
    assert attrs["uuid"] == {"string": inv.gpus[0].uuid}
    assert attrs["productName"] == {"string": inv.gpus[0].name}
    assert attrs["architecture"] == {"string": "Hopper"}  # compute capability 9.0, go-nvlib's spelling
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attrs["driverVersion"] == {"version": inv.driver_version}
    assert attrs["cudaDriverVersion"] == {"version": devices.semver(inv.cuda_version)}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": inv.gpus[0].pci_bus_id}
    assert first["capacity"] == {"memory": {"value": f"{inv.gpus[0].memory_mib}Mi"}}
    domains = [d.entry["attributes"][devices.NVLINK_DOMAIN]["string"] for d in built]
    assert domains[0] == domains[1] != domains[2] == domains[3]  # pairs 0-1 and 2-3, never mixed


@pytest.mark.parametrize(("layout", "groups"), [("none", 0), ("nvswitch", 1)])
def test_nvlink_domain_follows_the_layout(fake_driver_factory: Any, layout: str, groups: int) -> None:
    built = devices.build(inventory(fake_driver_factory(gpus=4, nvlink=layout)))
    values = {d.entry["attributes"].get(devices.NVLINK_DOMAIN, {}).get("string") for d in built} - {None}
    assert len(values) == groups  # PCIe only: no GPU has one; NVSwitch: all four share one


def test_mig_devices_are_published_with_their_parent_and_profile(fake_driver_factory: Any) -> None:
    inv = inventory(fake_driver_factory(gpus=2, mig={1: ["1g.10gb", "2g.20gb"]}))
    built = devices.build(inv)
    migs = [d for d in built if d.entry["attributes"]["type"] == {"string": "mig"}]
    assert [d.name for d in built if d not in migs] == ["gpu-0"]  # a MIG-enabled GPU is not published whole
    assert sorted(d.entry["attributes"]["profile"]["string"] for d in migs) == ["1g.10gb", "2g.20gb"]
    for d in migs:
        assert d.entry["attributes"]["parentUUID"] == {"string": inv.gpus[1].uuid}
        assert d.entry["attributes"]["uuid"]["string"].startswith("MIG-")
        assert d.entry["capacity"]["memory"]["value"].endswith("Mi")
    # without NVML's GPU-instance info: names of their own, no memory slices
    assert sorted(d.name for d in migs) == ["gpu-1-mig-1g10gb-gi9-ci0", "gpu-1-mig-2g20gb-gi3-ci0"]
    assert all(set(d.entry["capacity"]) == {"memory"} for d in migs)
    # with it: NVIDIA's names (profile, GI profile id, placement start) and one memorySlice per slice taken; the
    # fake's H100 places 2g.20gb first, at slices 0-1, then 1g.10gb at slice 2 (largest first, first free slot)
    from gpuhook.discover import nvml_library
    from gpuhook.dra import placement

    placed = devices.build(inv, placements=placement.read(nvml_library(inv.driver_root), inv))
    assert {d.name: sorted(k for k in d.entry["capacity"] if k.startswith("memorySlice")) for d in placed
            if d.entry["attributes"]["type"] == {"string": "mig"}} == {
        "gpu-1-mig-2g20gb-14-0": ["memorySlice0", "memorySlice1"],
        "gpu-1-mig-1g10gb-19-2": ["memorySlice2"],
    }


@pytest.mark.parametrize(("given", "expected"), [("9.0", "9.0.0"), ("535.309.01", "535.309.1"), ("12.4", "12.4.0"),
                                                 ("550.54.15", "550.54.15"), ("", None), ("12.x", None)])
def test_versions_become_semver(given: str, expected: str | None) -> None:
    assert devices.semver(given) == expected


@pytest.mark.parametrize(("cc", "arch"), [("7.0", "Volta"), ("7.5", "Turing"), ("8.0", "Ampere"), ("8.6", "Ampere"),
                                          ("8.9", "Ada Lovelace"), ("9.0", "Hopper"), ("10.0", "Blackwell"),
                                          ("12.0", "Blackwell"), (None, None)])
def test_architecture_names_are_go_nvlibs(cc: str | None, arch: str | None) -> None:
    assert devices.architecture(cc) == arch


def test_unhealthy_devices_are_withdrawn_from_the_slice(fake_driver_factory: Any) -> None:
    built = devices.build(inventory(fake_driver_factory(gpus=4, nvlink="bridge")))
    assert [d["name"] for d in devices.published(built, {(1, -1)})] == ["gpu-0", "gpu-2", "gpu-3"]


# -- opaque config and claims -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("parameters", "expected"), [
    (GPU_CONFIG, DeviceConfig("GpuConfig")),
    ({**GPU_CONFIG, "sharing": {"strategy": "TimeSlicing"}}, DeviceConfig("GpuConfig", True, "Default")),
    ({**GPU_CONFIG, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}}},
     DeviceConfig("GpuConfig", True, "Default")),
    ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}},
     DeviceConfig("MigDeviceConfig", True, "Default")),
])
def test_nvidias_config_kinds_are_accepted(parameters: dict[str, Any], expected: DeviceConfig) -> None:
    assert parse(parameters, "config[0]") == expected


@pytest.mark.parametrize(("parameters", "says"), [
    ({"apiVersion": "example.com/v1", "kind": "GpuConfig"}, "unknown opaque config kind"),
    ({**GPU_CONFIG, "kind": "ComputeDomainChannelConfig"}, "unknown opaque config kind"),
    ({**GPU_CONFIG, "shareing": {}}, "unknown field 'shareing'"),
    ({**GPU_CONFIG, "sharing": {"strategy": "MPS"}}, "MPS is not supported"),
    ({**GPU_CONFIG, "sharing": {"strategy": "Spatial"}}, "unknown strategy 'Spatial'"),
    ({**GPU_CONFIG, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}},
     "interval Long is not supported"),
    ({**GPU_CONFIG, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}},
     "unknown interval 'Forever'"),
    # NVIDIA's GetTimeSlicingConfig: an MpsConfig with the TimeSlicing strategy is an error
    ({**GPU_CONFIG, "sharing": {"strategy": "TimeSlicing", "mpsConfig": {}}}, "mpsConfig cannot be used"),
    ("GpuConfig", "parameters must be an object"),
])
def test_bad_configs_are_refused_with_one_line(parameters: Any, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(parameters, "config[0]")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_recorded_allocation_is_read() -> None:
    got = results(CLAIM, CLAIM_UID, "gpu.nvidia.com", NODE)
    assert [(r.request, r.pool, r.device) for r in got] == [("gpus", NODE, "gpu-0"), ("gpus", NODE, "gpu-1")]
    assert all(r.config == DeviceConfig("GpuConfig", True, "Default") for r in got)


def _edited(edit: Any) -> dict[str, Any]:
    claim = copy.deepcopy(CLAIM)
    edit(claim)
    return claim


def _other_pool(c: dict[str, Any]) -> None:
    c["status"]["allocation"]["devices"]["results"][1]["pool"] = "node2"


def _other_node(c: dict[str, Any]) -> None:
    c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] = ["node2"]


def _unknown_kind(c: dict[str, Any]) -> None:
    c["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]["kind"] = "FpgaConfig"


@pytest.mark.parametrize(("edit", "says"), [
    (_other_pool, "allocated from pool 'node2', another node than 'node1'"),
    (_other_node, "allocated to another node than 'node1'"),
    (_unknown_kind, "unknown opaque config kind resource.nvidia.com/v1beta1/FpgaConfig"),
    (lambda c: c["status"].pop("allocation"), "is not allocated"),
    (lambda c: c["metadata"].update(uid="0000"), "has UID '0000'"),
    (lambda c: c["status"]["allocation"]["devices"].update(results=[]), "has no device of driver gpu.nvidia.com"),
])
def test_claims_this_node_cannot_prepare_are_refused(edit: Any, says: str) -> None:
    with pytest.raises(ClaimError) as err:
        results(_edited(edit), CLAIM_UID, "gpu.nvidia.com", NODE)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_class_configs_yield_to_the_claims() -> None:
    def both(c: dict[str, Any]) -> None:
        config = c["status"]["allocation"]["devices"]["config"]
        config.insert(0, {"source": "FromClass", "requests": [],
                          "opaque": {"driver": "gpu.nvidia.com", "parameters": GPU_CONFIG}})
        config.append({"source": "FromClass", "requests": ["gpus"],
                       "opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}})

    got = results(_edited(both), CLAIM_UID, "gpu.nvidia.com", NODE)
    assert all(r.config is not None and r.config.time_slicing for r in got)  # the claim's TimeSlicing wins


# -- the driver over gRPC against the recorded API server ----------------------------------------------------------
class Rig:
    def __init__(self, root: Path, fake: Any, replay: ApiReplay) -> None:
        self.root, self.fake, self.replay = root, fake, replay
        self.config = DriverConfig(node=NODE, kubelet_dir=str(root / "kubelet"), cdi_dir=str(root / "cdi"),
                                   hook_path="/usr/local/bin/gpuhook", health=FAST_HEALTH)
        self.driver: Driver | None = None
        self.kubelet: DraKubelet | None = None

    def start(self, versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> DraKubelet:
        self.driver = Driver(self.config, lambda: inventory(self.fake), Api(server=self.replay.url))
        self.driver.start()
        self.kubelet = DraKubelet(self.config.kubelet_dir)
        self.kubelet.register(versions=versions)
        return self.kubelet

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.close()
        if self.driver is not None:
            self.driver.shutdown()
            self.driver.api.close()
        self.kubelet = self.driver = None

    def spec_files(self) -> list[str]:
        return sorted(os.listdir(self.config.cdi_dir)) if os.path.isdir(self.config.cdi_dir) else []

    def checkpoint(self) -> dict[str, Any]:
        return checkpoint.load(os.path.join(self.config.plugin_dir, checkpoint.FILE))


@pytest.fixture
def replay() -> Iterator[ApiReplay]:
    with ApiReplay().serve() as server:
        server.add("node")
        server.add("slices-none", path="/apis/resource.k8s.io/v1/resourceslices")
        created = recorded("slice-created")["body"]
        server.add("slice-created", body=created)
        yield server


@pytest.fixture
def rig(fake_driver_factory: Any, replay: ApiReplay) -> Iterator[Rig]:
    root = Path(short_tempdir("dra"))
    r = Rig(root, fake_driver_factory(gpus=4, nvlink="bridge"), replay)
    try:
        yield r
    finally:
        r.stop()
        shutil.rmtree(root, ignore_errors=True)


def _ids(response: Any, uid: str) -> list[str]:
    result = response.claims[uid]
    assert result.error == ""
    return [i for d in result.devices for i in d.cdi_device_ids]


def test_registration_answers_as_the_kubelet_expects(rig: Rig) -> None:
    info = rig.start().info
    assert info is not None
    assert (info.type, info.name) == ("DRAPlugin", "gpu.nvidia.com")
    assert info.endpoint == os.path.join(rig.config.kubelet_dir, "plugins", "gpu.nvidia.com", "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert rig.driver is not None and rig.driver.registration.registered.wait(5)


def test_prepare_writes_a_valid_spec_for_exactly_the_claims_devices(rig: Rig) -> None:
    rig.replay.add("claim-allocated")
    kubelet = rig.start()
    response = kubelet.prepare(("default", CLAIM_UID, "pair"))
    result = response.claims[CLAIM_UID]
    assert result.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name) for d in result.devices] == \
        [(["gpus"], NODE, "gpu-0"), (["gpus"], NODE, "gpu-1")]
    ids = _ids(response, CLAIM_UID)
    assert ids == [f"k8s.gpu.nvidia.com/claim={CLAIM_UID}-gpu-0", f"k8s.gpu.nvidia.com/claim={CLAIM_UID}-gpu-1"]
    assert rig.spec_files() == [f"k8s.gpu.nvidia.com-claim_{CLAIM_UID}.yaml"]
    import yaml

    path = os.path.join(rig.config.cdi_dir, rig.spec_files()[0])
    spec = yaml.safe_load(Path(path).read_text())
    assert validate_spec(spec, path) == []
    nodes = {n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])}
    assert {n for n in nodes if n[len("/dev/nvidia"):].isdigit()} == {"/dev/nvidia0", "/dev/nvidia1"}  # its two
    assert [d["name"] for d in spec["devices"]] == [f"{CLAIM_UID}-gpu-0", f"{CLAIM_UID}-gpu-1"]
    mounts = {m["containerPath"] for m in spec["containerEdits"]["mounts"]}
    assert any(p.endswith("libcuda.so.550.54.15") for p in mounts)
    assert list(rig.checkpoint()) == [CLAIM_UID]


def test_prepare_is_idempotent_and_survives_a_restart(rig: Rig) -> None:
    rig.replay.add("claim-allocated")
    first = _ids(rig.start().prepare(("default", CLAIM_UID, "pair")), CLAIM_UID)
    again = _ids(rig.kubelet.prepare(("default", CLAIM_UID, "pair")), CLAIM_UID)  # type: ignore[union-attr]
    assert again == first
    reads = len(rig.replay.requests("GET", CLAIM_PATH))
    assert reads == 1  # the repeat came from the checkpoint
    rig.stop()
    rig.replay.clear()  # after the restart the API server knows nothing: only the checkpoint can answer
    rig.replay.add("node")
    rig.replay.add("slices-one", path="/apis/resource.k8s.io/v1/resourceslices")
    kubelet = rig.start()
    assert _ids(kubelet.prepare(("default", CLAIM_UID, "pair")), CLAIM_UID) == first
    assert rig.replay.requests("GET", CLAIM_PATH) == []
    assert len(rig.spec_files()) == 1
    assert kubelet.unprepare(("default", CLAIM_UID, "pair")).claims[CLAIM_UID].error == ""
    assert rig.spec_files() == [] and rig.checkpoint() == {}
    # unprepare again (the kubelet retries): still fine
    assert kubelet.unprepare(("default", CLAIM_UID, "pair")).claims[CLAIM_UID].error == ""


def test_time_slicing_puts_the_claims_gpus_in_compute_mode_default(rig: Rig) -> None:
    rig.replay.add("claim-allocated")  # its config: GpuConfig, sharing.strategy TimeSlicing
    for gpu in range(4):
        rig.fake.set_compute_mode(gpu, 3)  # EXCLUSIVE_PROCESS: a second pod's process would be refused
    assert len(_ids(rig.start().prepare(("default", CLAIM_UID, "pair")), CLAIM_UID)) == 2
    assert [rig.fake.compute_mode(g) for g in range(4)] == [0, 0, 3, 3]  # the claim's two, through NVML


def test_a_compute_mode_nvml_refuses_is_the_claims_error(rig: Rig) -> None:
    rig.replay.add("claim-allocated")
    rig.fake.set_compute_mode(0, 3)
    rig.fake.set_compute_mode_denied()
    error = rig.start().prepare(("default", CLAIM_UID, "pair")).claims[CLAIM_UID].error
    assert "time-slicing:" in error and "NVML refused the compute mode" in error and "\n" not in error
    assert rig.spec_files() == [] and rig.checkpoint() == {}


def test_a_v1beta1_kubelet_is_served_too(rig: Rig) -> None:
    rig.replay.add("claim-allocated")
    kubelet = rig.start(versions=("v1beta1.DRAPlugin",))
    assert kubelet.service == "v1beta1.DRAPlugin"
    assert len(_ids(kubelet.prepare(("default", CLAIM_UID, "pair")), CLAIM_UID)) == 2


@pytest.mark.parametrize(("edit", "says"), [
    (_other_pool, "another node than 'node1'"),
    (_unknown_kind, "unknown opaque config kind"),
    (lambda c: c["status"]["allocation"]["devices"]["results"][1].update(device="gpu-7"),
     "device 'gpu-7' is not on this node (any more): it vanished"),
    (lambda c: c["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"].update(
        kind="MigDeviceConfig"), "device gpu-0 is a gpu: it takes a GpuConfig, not a MigDeviceConfig"),
])
def test_a_refused_claim_gets_one_error_and_nothing_is_left_prepared(rig: Rig, edit: Any, says: str) -> None:
    bad = _edited(edit)
    bad["metadata"]["uid"] = "11111111-2222-3333-4444-555555555555"
    rig.replay.add("claim-allocated", body=bad, path=CLAIM_PATH.replace("/pair", "/bad"))
    rig.replay.add("claim-allocated")
    kubelet = rig.start()
    response = kubelet.prepare(("default", bad["metadata"]["uid"], "bad"), ("default", CLAIM_UID, "pair"))
    error = response.claims[bad["metadata"]["uid"]].error
    assert says in error and "\n" not in error and "default/bad" in error
    assert not response.claims[bad["metadata"]["uid"]].devices
    assert len(_ids(response, CLAIM_UID)) == 2  # the good claim in the same call is prepared
    assert rig.spec_files() == [f"k8s.gpu.nvidia.com-claim_{CLAIM_UID}.yaml"]
    assert list(rig.checkpoint()) == [CLAIM_UID]


def test_api_errors_are_the_claims_error(rig: Rig) -> None:
    kubelet = rig.start()  # no route for the claim: the recorded 404
    error = kubelet.prepare(("default", CLAIM_UID, "pair")).claims[CLAIM_UID].error
    assert "ResourceClaim 'default'/'pair': 404" in error and "not found" in error
    assert rig.spec_files() == [] and rig.checkpoint() == {}


def test_a_device_that_vanishes_is_withdrawn_refused_and_back_when_it_returns(fake_driver_factory: Any,
                                                                              replay: ApiReplay) -> None:
    import threading

    root = Path(short_tempdir("dra"))
    fake = fake_driver_factory(gpus=4, nvlink="bridge", fresh=True)
    r = Rig(root, fake, replay)
    node = fake.root / "dev" / "nvidia1"
    saved = os.stat(node)
    thread = None
    try:
        replay.add("slice-created", method="PUT", path="/apis/resource.k8s.io/v1/resourceslices/node1-gpu.nvidia.com")
        replay.add("claim-allocated")
        kubelet = r.start()
        assert r.driver is not None
        thread = threading.Thread(target=r.driver.run, daemon=True)  # the loop that republishes on health changes
        thread.start()

        def written() -> list[list[str]]:
            return [[d["name"] for d in s.body["spec"]["devices"]] for s in replay.requests()
                    if s.method in ("POST", "PUT") and "resourceslices" in s.path]

        def wait_for(names: list[str]) -> None:
            deadline = time.monotonic() + 10
            while (not written() or written()[-1] != names) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert written()[-1] == names, written()

        wait_for(["gpu-0", "gpu-1", "gpu-2", "gpu-3"])
        os.unlink(node)
        wait_for(["gpu-0", "gpu-2", "gpu-3"])  # withdrawn from the slice
        error = kubelet.prepare(("default", CLAIM_UID, "pair")).claims[CLAIM_UID].error
        assert "device gpu-1 is unhealthy (device node" in error and "missing" in error
        assert r.spec_files() == [] and r.checkpoint() == {}
        os.mknod(node, saved.st_mode, saved.st_rdev)
        wait_for(["gpu-0", "gpu-1", "gpu-2", "gpu-3"])  # back once its node is
        generations = [s.body["spec"]["pool"]["generation"] for s in replay.requests()
                       if s.method in ("POST", "PUT") and "resourceslices" in s.path]
        assert len(generations) >= 3 and generations == sorted(set(generations))  # one new generation per change
    finally:
        if not node.exists():
            os.mknod(node, saved.st_mode, saved.st_rdev)
        if r.driver is not None:
            r.driver.request_stop()
        if thread is not None:
            thread.join(5)
        r.driver = None if thread is not None else r.driver  # run() shut it down
        r.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_devices_that_appear_are_published_after_rediscovery(fake_driver_factory: Any, replay: ApiReplay) -> None:
    """SIGHUP (or a new driver version) discovers again: the slice follows, with a new generation."""
    import threading

    root = Path(short_tempdir("dra"))
    fakes = {"now": fake_driver_factory(gpus=2, nvlink="bridge")}
    r = Rig(root, fakes["now"], replay)
    thread = None
    try:
        r.driver = Driver(r.config, lambda: inventory(fakes["now"]), Api(server=replay.url))
        r.driver.start()
        assert r.driver.publisher.wait_published(10)
        thread = threading.Thread(target=r.driver.run, daemon=True)
        thread.start()
        fakes["now"] = fake_driver_factory(gpus=4, nvlink="bridge")  # two GPUs more
        r.driver.request_reload()
        deadline = time.monotonic() + 10
        posts: list[Any] = []
        while len(posts) < 2 and time.monotonic() < deadline:
            posts = replay.requests("POST", "/apis/resource.k8s.io/v1/resourceslices")
            time.sleep(0.05)
        assert [len(p.body["spec"]["devices"]) for p in posts] == [2, 4]
        assert [p.body["spec"]["pool"]["generation"] for p in posts] == [1, 2]
    finally:
        if r.driver is not None:
            r.driver.request_stop()
        if thread is not None:
            thread.join(5)
        r.stop()
        shutil.rmtree(root, ignore_errors=True)


# -- ResourceSlice publication -------------------------------------------------------------------------------
def _publisher(replay: ApiReplay, entries: list[dict[str, Any]]) -> publish.Publisher:
    return publish.Publisher(Api(server=replay.url), NODE, lambda: entries)


def test_first_publication_creates_generation_one_owned_by_the_node(fake_driver_factory: Any,
                                                                    replay: ApiReplay) -> None:
    entries = devices.published(devices.build(inventory(fake_driver_factory(gpus=4, nvlink="bridge"))), set())
    pub = _publisher(replay, entries)
    assert pub.publish_once()
    (post,) = replay.requests("POST")
    assert post.body["metadata"]["name"] == "node1-gpu.nvidia.com"
    assert post.body["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert post.body["spec"]["nodeName"] == NODE and post.body["spec"]["driver"] == "gpu.nvidia.com"
    node = recorded("node")["body"]
    assert post.body["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": NODE,
                                                         "uid": node["metadata"]["uid"], "controller": True}]
    assert post.body["spec"]["devices"] == entries
    (listing,) = replay.requests("GET", "/apis/resource.k8s.io/v1/resourceslices")
    assert listing.query["fieldSelector"] == ["spec.nodeName=node1,spec.driver=gpu.nvidia.com"]


def test_an_unchanged_slice_is_not_written_and_a_changed_one_gets_the_next_generation() -> None:
    on_server = recorded("slices-one")["body"]["items"][0]
    with ApiReplay().serve() as replay:
        replay.add("node")
        replay.add("slices-one")
        pub = _publisher(replay, on_server["spec"]["devices"])
        assert not pub.publish_once() and pub.generation == on_server["spec"]["pool"]["generation"]
        assert replay.requests("PUT") == [] and replay.requests("POST") == []
        replay.add("slice-updated")
        fewer = _publisher(replay, on_server["spec"]["devices"][:2])
        assert fewer.publish_once()
        (put,) = replay.requests("PUT")
        assert put.body["spec"]["pool"]["generation"] == on_server["spec"]["pool"]["generation"] + 1
        assert put.body["metadata"]["resourceVersion"] == on_server["metadata"]["resourceVersion"]
        assert [d["name"] for d in put.body["spec"]["devices"]] == ["gpu-0", "gpu-1"]


def test_a_conflict_is_retried_and_a_stale_slice_deleted() -> None:
    on_server = recorded("slices-one")["body"]
    stale = copy.deepcopy(on_server["items"][0])
    stale["metadata"]["name"] = "node1-old"
    stale["spec"]["pool"]["generation"] = 7
    listing = {**on_server, "items": [on_server["items"][0], stale]}
    with ApiReplay().serve() as replay:
        replay.add("node")
        replay.add("slices-one", body=listing)
        replay.add("slice-deleted", path="/apis/resource.k8s.io/v1/resourceslices/node1-old")
        replay.add("slice-conflict")
        replay.add("slice-updated")
        pub = _publisher(replay, on_server["items"][0]["spec"]["devices"][:1])
        pub.start()
        try:
            assert pub.wait_published(10)
        finally:
            pub.stop()
        assert [s.path for s in replay.requests("DELETE")][:1] == ["/apis/resource.k8s.io/v1/resourceslices/node1-old"]
        puts = replay.requests("PUT")
        assert len(puts) == 2  # 409 Conflict, then again
        assert puts[-1].body["spec"]["pool"]["generation"] == 8  # above every generation the pool had


def test_an_api_server_refusal_is_one_line(fake_driver_factory: Any) -> None:
    from gpuhook.dra.kube import KubeError

    with ApiReplay().serve() as replay:
        replay.add("slices-none", path="/apis/resource.k8s.io/v1/resourceslices")
        replay.add("slice-invalid", path="/apis/resource.k8s.io/v1/resourceslices", method="POST")
        pub = _publisher(replay, [])
        with pytest.raises(KubeError) as err:
            pub.publish_once()
    assert "creating ResourceSlice 'node1-gpu.nvidia.com': 422" in str(err.value)
    assert "\n" not in str(err.value)


# -- checkpoint and CDI names --------------------------------------------------------------------------------
def test_an_unreadable_checkpoint_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / checkpoint.FILE
    path.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(str(path))
    assert "unreadable" in str(err.value) and "move it away" in str(err.value)


def test_a_claim_uid_that_cannot_name_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        claimspec.spec_path(str(tmp_path), "../../etc/passwd")


def test_orphaned_claim_specs_are_removed_at_start(rig: Rig) -> None:
    os.makedirs(rig.config.cdi_dir)
    orphan = claimspec.spec_path(rig.config.cdi_dir, "99999999-0000-0000-0000-000000000000")
    Path(orphan).write_text("cdiVersion: 0.5.0\n")
    unrelated = Path(rig.config.cdi_dir) / "nvidia.com-gpu.yaml"
    unrelated.write_text("cdiVersion: 0.5.0\n")
    rig.start()
    assert not os.path.exists(orphan) and unrelated.exists()


@pytest.mark.parametrize(("args", "says"), [
    (["--node-name", " "], "--node-name is empty"),
    (["--node-name", "n1", "--kubeconfig", "{bad}"], "cannot configure the Kubernetes client from"),
    (["--node-name", "n1"], "no Kubernetes API to talk to"),
])
def test_the_command_refuses_bad_settings_with_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    import subprocess
    import sys

    bad = tmp_path / "kubeconfig"
    bad.write_text("clusters: [\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    out = subprocess.run([sys.executable, "-m", "gpuhook.cli", "dra-plugin", *(a.format(bad=bad) for a in args),
                          "--kubelet-dir", str(tmp_path / "k"), "--cdi-dir", str(tmp_path / "c")], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0
    assert says in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("state,prepared,removed", [("gone", 0, True), ("gone", 1, False), ("present", 0, False),
                                                    ("unknown", 0, False)])
def test_after_an_uninstall_the_driver_takes_its_checkpoint_off_the_node(tmp_path: Path, state: str, prepared: int,
                                                                        removed: bool) -> None:
    from gpuhook.dra.checkpoint import FILE
    from gpuhook.dra.driver import DriverConfig, take_off

    config = DriverConfig(node="n", kubelet_dir=str(tmp_path))
    os.makedirs(config.plugin_dir)
    checkpoint = Path(config.plugin_dir) / FILE
    checkpoint.write_text("{}")
    gone = take_off(config, prepared, (state, "DaemonSet gpuhook/gpuhook-dra: " + state))
    assert (gone == [str(checkpoint), config.plugin_dir]) == removed
    assert checkpoint.exists() != removed and os.path.isdir(config.plugin_dir) != removed
    if removed:  # the kubelet's plugins folder itself stays
        assert os.path.isdir(tmp_path / "plugins")


def test_the_uninstall_clean_up_leaves_what_is_not_the_drivers(tmp_path: Path) -> None:
    from gpuhook.dra.driver import DriverConfig, take_off

    config = DriverConfig(node="n", kubelet_dir=str(tmp_path))
    os.makedirs(config.plugin_dir)
    (Path(config.plugin_dir) / "someone-elses").write_text("keep")
    assert take_off(config, 0, ("gone", "gone")) == []
    assert (Path(config.plugin_dir) / "someone-elses").read_text() == "keep"
