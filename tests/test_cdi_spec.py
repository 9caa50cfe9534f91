"""CDI spec generation on hand-built inventories: names, strategies, MIG, `all`, versions, determinism."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from support.cdi_inventory import gpu_uuid, mig_uuid, synthetic_inventory
from support.inv import sample_inventory

from gpuhook.cdi import codec, names, version
from gpuhook.cdi.errors import CdiError, InvalidName
from gpuhook.cdi.spec import COMMON_ENV, HOOK_ENV, build_spec, default_devices, device_names
from gpuhook.cdi.validate import validate_spec
from gpuhook.model.edits import CDI_CAPABILITIES, common_edits, device_edits, plan
from gpuhook.model.inventory import Gpu
from gpuhook.model.request import parse_request
from gpuhook.model.selection import resolve

HOOK = "/opt/gpuhook/bin/gpuhook"


def spec_for(inv, **kw):  # type: ignore[no-untyped-def]
    return build_spec(inv, hook_path=HOOK, **kw)


def by_name(spec: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    return {d["name"]: d["containerEdits"] for d in spec["devices"]}


def node_paths(edits: dict) -> list[str]:  # type: ignore[type-arg]
    return [n["path"] for n in edits.get("deviceNodes", [])]


# --- cdiVersion rules -------------------------------------------------------------------------------------------

BASE = {"cdiVersion": "0.3.0", "kind": "nvidia.com/gpu", "devices": [{"name": "gpu0", "containerEdits": {
    "deviceNodes": [{"path": "/dev/nvidia0"}]}}]}


def with_(**changes):  # type: ignore[no-untyped-def]
    spec = json.loads(json.dumps(BASE))
    for dotted, value in changes.items():
        target = spec
        parts = dotted.split("__")
        for part in parts[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        target[parts[-1]] = value
    return spec


@pytest.mark.parametrize(("spec", "expected"), [
    (BASE, "0.3.0"),
    (with_(devices__0__containerEdits__mounts=[{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]), "0.4.0"),
    (with_(devices__0__containerEdits__mounts=[{"hostPath": "/a", "containerPath": "/a"}]), "0.3.0"),
    (with_(devices__0__name="0"), "0.5.0"),
    (with_(devices__0__containerEdits__deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}]), "0.5.0"),
    (with_(containerEdits={"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]}), "0.5.0"),
    (with_(annotations={"a": "b"}), "0.6.0"),
    (with_(devices__0__annotations={"a": "b"}), "0.6.0"),
    (with_(kind="nvidia.com/gpu.x"), "0.6.0"),
    (with_(kind="nvidia.com/gpu"), "0.3.0"),  # a dot in the vendor needs nothing
    (with_(containerEdits={"intelRdt": {"closID": "x"}}), "0.7.0"),
    (with_(devices__0__containerEdits__additionalGids=[44]), "0.7.0"),
    (with_(containerEdits={"netDevices": [{"hostInterfaceName": "eth1", "name": "net1"}]}), "1.1.0"),
    (with_(devices__0__name="0", containerEdits={"netDevices": [{"hostInterfaceName": "e", "name": "n"}]},
           annotations={"a": "b"}), "1.1.0"),  # the highest rule wins
])
def test_minimum_version_rules(spec: dict, expected: str) -> None:  # type: ignore[type-arg]
    assert version.minimum_version(spec) == expected


def test_version_order_is_numeric() -> None:
    assert version.key("0.10.0") > version.key("0.9.0")
    assert version.is_known("0.5.0") and not version.is_known("0.9.0") and not version.is_known("v0.5.0")


# --- names ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vendor", ["nvidia.com", "a", "a-b_c.d", "Vendor9"])
def test_valid_vendor_and_class(vendor: str) -> None:
    assert names.vendor_problem(vendor) is None
    assert names.class_problem(vendor) is None


@pytest.mark.parametrize("vendor", ["", "9nvidia", "-a", "a-", "a.", "a/b", "a=b", "ä"])
def test_invalid_vendor_and_class(vendor: str) -> None:
    assert names.vendor_problem(vendor)
    assert names.class_problem(vendor)


@pytest.mark.parametrize("name", ["0", "all", "0:1", "GPU-1234-abcd", "mig0:1", "a.b_c-d"])
def test_valid_device_names(name: str) -> None:
    assert names.device_name_problem(name) is None


@pytest.mark.parametrize("name", ["", ":0", "0:", "a b", "a/b", "a=b", "-x", "x_"])
def test_invalid_device_names(name: str) -> None:
    assert names.device_name_problem(name)


def test_qualified_names_round_trip() -> None:
    text = names.qualified_name("nvidia.com", "gpu", "0:1")
    assert text == "nvidia.com/gpu=0:1"
    assert names.parse_qualified_name(text) == ("nvidia.com", "gpu", "0:1")
    assert names.is_qualified_name("nvidia.com/gpu=all")
    for bad in ["nvidia.com/gpu", "gpu=0", "/gpu=0", "nvidia.com/=0", "nvidia.com/gpu=", "nvidia.com/gpu=-0"]:
        assert not names.is_qualified_name(bad), bad
    with pytest.raises(InvalidName):
        names.qualified_name("nvidia.com", "gpu", "a b")
    with pytest.raises(InvalidName):
        names.parse_kind("nvidia.com")


# --- strategies and devices -------------------------------------------------------------------------------------

def test_default_names_are_index_uuid_and_all() -> None:
    spec = spec_for(synthetic_inventory(2))
    assert [d["name"] for d in spec["devices"]] == ["0", gpu_uuid(0), "1", gpu_uuid(1), "all"]
    assert spec["kind"] == "nvidia.com/gpu"


def test_strategies() -> None:
    inv = synthetic_inventory(2, mig_per_gpu=2)
    gpu, mig = inv.gpus[0], inv.gpus[1].mig_devices[1]
    assert device_names(inv, gpu, ["index", "uuid", "type-index"]) == ["0", gpu_uuid(0), "gpu0"]
    assert device_names(inv, mig, ["index", "uuid", "type-index"]) == ["1:1", mig_uuid(1, 1), "mig1:1"]
    assert device_names(inv, mig, ["type-index"]) == ["mig1:1"]
    with pytest.raises(CdiError, match="unknown device name strategy"):
        device_names(inv, gpu, ["bus-id"])


def test_type_index_only() -> None:
    spec = spec_for(synthetic_inventory(2), name_strategies=("type-index",))
    assert [d["name"] for d in spec["devices"]] == ["gpu0", "gpu1", "all"]
    assert spec["cdiVersion"] == "0.5.0"  # device node hostPath
    assert validate_spec(spec, "t") == []


def test_uuid_strategy_without_uuids_gives_index_names_only() -> None:
    spec = spec_for(synthetic_inventory(2, uuids=False))
    assert [d["name"] for d in spec["devices"]] == ["0", "1", "all"]


def test_mig_enabled_gpu_gets_only_its_mig_devices() -> None:
    inv = synthetic_inventory(2, mig_per_gpu=2)
    inv.gpus[0] = Gpu(**{**inv.gpus[0].__dict__, "mig_enabled": False, "mig_devices": ()})
    spec = spec_for(inv)
    devices = by_name(spec)
    assert list(devices) == ["0", gpu_uuid(0), "1:0", mig_uuid(1, 0), "1:1", mig_uuid(1, 1), "all"]
    mig = inv.gpus[1].mig_devices[1]
    assert node_paths(devices["1:1"]) == ["/dev/nvidia1", *(n.path for n in mig.cap_nodes)]
    assert devices["1:1"] == devices[mig_uuid(1, 1)]


def test_device_edits_come_from_the_planning_model() -> None:
    inv = synthetic_inventory(3, mig_per_gpu=0)
    devices = by_name(spec_for(inv))
    for gpu in inv.gpus:
        assert node_paths(devices[str(gpu.index)]) == [n.path for n in device_edits(inv, gpu, CDI_CAPABILITIES)
                                                      .device_nodes]
    node = devices["0"]["deviceNodes"][0]
    assert node == {"path": "/dev/nvidia0", "hostPath": "/host/dev/nvidia0", "type": "c", "major": 195,
                    "minor": 0, "fileMode": 0o666, "permissions": "rw"}


def test_all_is_the_union() -> None:
    inv = synthetic_inventory(2, mig_per_gpu=2)
    devices = by_name(spec_for(inv))
    union: list[str] = []
    for name, edits in devices.items():
        if name != "all":
            union += [p for p in node_paths(edits) if p not in union]
    assert node_paths(devices["all"]) == union
    assert len(set(union)) == len(union)


def test_common_edits_come_from_the_planning_model() -> None:
    inv = synthetic_inventory(1)
    spec = spec_for(inv)
    common = common_edits(inv, CDI_CAPABILITIES)
    edits = spec["containerEdits"]
    assert edits["env"] == list(COMMON_ENV)
    assert node_paths(edits) == [n.path for n in common.device_nodes]
    assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
        (m.host_path, m.container_path) for m in common.mounts]
    for mount, planned in zip(edits["mounts"], common.mounts):
        assert mount["options"] == list(planned.options)
        assert mount["type"] == "bind"
    socket = next(m for m in edits["mounts"] if m["containerPath"].endswith("/socket"))
    assert socket["options"] == ["ro", "nosuid", "nodev", "noexec", "rbind", "rprivate"]  # read-only
    lib = next(m for m in edits["mounts"] if m["containerPath"].endswith("libcuda.so.550.54.15"))
    assert lib["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"]


def test_hooks() -> None:
    inv = synthetic_inventory(1)
    common = common_edits(inv, CDI_CAPABILITIES)
    hooks = spec_for(inv)["containerEdits"]["hooks"]
    assert [h["hookName"] for h in hooks] == ["createContainer"]  # one process per start for links + ld cache
    (hook,) = hooks
    args = hook["args"]
    assert hook["path"] == HOOK and args[:3] == [HOOK, "cdi-hook", "update-container"]
    n = len(common.symlinks)
    assert args[3 : 3 + 2 * n : 2] == ["--link"] * n
    assert args[4 : 4 + 2 * n : 2] == [f"{s.target}::{s.link}" for s in common.symlinks]
    assert "libcuda.so.550.54.15::/usr/lib/x86_64-linux-gnu/libcuda.so.1" in args
    assert "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so" in args
    # every GPU's /dev/dri/by-path links, made only where the runtime gave the node: no hook per device
    dri = device_edits(inv, inv.gpus[0], CDI_CAPABILITIES).symlinks
    assert dri and args[3 + 2 * n : 3 + 2 * (n + len(dri))] == [
        x for s in dri for x in ("--link-if-present", f"{s.target}::{s.link}")]
    assert args[3 + 2 * (n + len(dri)) :] == ["--folder", "/usr/lib/x86_64-linux-gnu", "--folder",
                                              "/usr/lib/x86_64-linux-gnu/vdpau", "--host-driver-version",
                                              "550.54.15"]  # for the image's CUDA compat libcuda
    assert hook["env"] == list(HOOK_ENV)  # never inherit the runtime's environment


def test_no_32bit_library_in_a_spec() -> None:
    """nvidia-ctk v1.20.0 finds the driver's libraries through 64-bit search paths and the ld cache's 64-bit
    entries only (pkg/lookup/library.go NewLibraryLocator; pkg/lookup/ldcache.go newLdcacheLocator keeps
    `libs64` of `cache.List()`), so its spec holds no 32-bit library: neither mount, link, nor ld cache folder.
    The hook, for NVIDIA_DRIVER_CAPABILITIES=all (compat32 included), still gives them, as libnvidia-container."""
    inv = sample_inventory(gpus=2, mig_on=None)
    lib32 = next(f for f in inv.files if f.kind == "lib32")
    text = codec.dumps(spec_for(inv))
    assert "i386" not in text
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15" in text  # its 64-bit twin is there
    hooked = plan(inv, resolve(inv, parse_request(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all"])))
    assert lib32.path in {m.container_path for m in hooked.mounts}
    assert "/usr/lib/i386-linux-gnu" in hooked.ld_dirs


def test_one_container_hook_per_start_whatever_the_devices() -> None:
    spec = spec_for(synthetic_inventory(3, mig_per_gpu=1))
    assert all("hooks" not in d["containerEdits"] for d in spec["devices"])
    assert len(spec["containerEdits"]["hooks"]) == 1


def test_no_proc_paths_are_rendered() -> None:
    text = codec.dumps(spec_for(synthetic_inventory(2, mig_per_gpu=2)))
    assert "/proc" not in text


def test_devices_subset() -> None:
    inv = synthetic_inventory(4, mig_per_gpu=0)
    spec = spec_for(inv, devices=[inv.gpus[2]])
    assert [d["name"] for d in spec["devices"]] == ["2", gpu_uuid(2), "all"]
    assert node_paths(by_name(spec)["all"])[0] == "/dev/nvidia2"
    mig_inv = synthetic_inventory(1, mig_per_gpu=3)
    spec = spec_for(mig_inv, devices=[mig_inv.gpus[0].mig_devices[2]])
    assert [d["name"] for d in spec["devices"]] == ["0:2", mig_uuid(0, 2), "all"]


def test_default_devices() -> None:
    inv = synthetic_inventory(2, mig_per_gpu=3)
    assert [getattr(d, "name", None) for d in default_devices(inv)] == ["0:0", "0:1", "0:2", "1:0", "1:1", "1:2"]


# --- versions, errors --------------------------------------------------------------------------------------------

def test_default_version_is_0_5_0_for_podman() -> None:
    spec = spec_for(synthetic_inventory(2))
    assert spec["cdiVersion"] == "0.5.0"
    assert "annotations" not in json.dumps(spec)


def test_cdi_version_may_raise_never_lower() -> None:
    inv = synthetic_inventory(1)
    assert spec_for(inv, cdi_version="0.6.0")["cdiVersion"] == "0.6.0"
    with pytest.raises(CdiError, match=r"0\.4\.0 is below 0\.5\.0"):
        spec_for(inv, cdi_version="0.4.0")
    with pytest.raises(CdiError, match="unknown cdiVersion"):
        spec_for(inv, cdi_version="0.9.1")


def test_errors() -> None:
    with pytest.raises(CdiError, match="no GPUs"):
        spec_for(synthetic_inventory(0))
    inv = synthetic_inventory(2)
    inv.gpus[1] = Gpu(**{**inv.gpus[1].__dict__, "node": None, "dri_nodes": ()})
    with pytest.raises(CdiError, match="GPU 1 .*no device node"):
        spec_for(inv)
    with pytest.raises(CdiError, match="absolute"):
        build_spec(synthetic_inventory(1), hook_path="gpuhook")
    with pytest.raises(InvalidName):
        spec_for(synthetic_inventory(1), vendor="-bad")
    with pytest.raises(CdiError, match="no device name strategy"):
        spec_for(synthetic_inventory(1), name_strategies=())


def test_duplicate_names_refused() -> None:
    inv = synthetic_inventory(2)
    inv.gpus[1] = Gpu(**{**inv.gpus[1].__dict__, "uuid": inv.gpus[0].uuid})
    with pytest.raises(CdiError, match="given to both"):
        spec_for(inv)


# --- output -----------------------------------------------------------------------------------------------------

def test_deterministic_and_alias_free() -> None:
    a = codec.dumps(spec_for(synthetic_inventory(2, mig_per_gpu=2)))
    b = codec.dumps(spec_for(synthetic_inventory(2, mig_per_gpu=2)))
    assert a == b
    assert "&id" not in a and "*id" not in a
    assert yaml.safe_load(a) == spec_for(synthetic_inventory(2, mig_per_gpu=2))
    assert json.loads(codec.dumps(spec_for(synthetic_inventory(1)), "json")) == spec_for(synthetic_inventory(1))


@pytest.mark.parametrize(("gpus", "migs", "count"), [(1, 0, 3), (8, 0, 17), (8, 7, 8 * 7 * 2 + 1)])
def test_fleet_sizes_validate(gpus: int, migs: int, count: int) -> None:
    spec = spec_for(synthetic_inventory(gpus, mig_per_gpu=migs))
    assert len(spec["devices"]) == count
    assert spec["cdiVersion"] == "0.5.0"
    assert validate_spec(spec, "generated") == []
    assert validate_spec(codec.loads(codec.dumps(spec, "yaml")), "yaml") == []


# --- the simulated driver: discovery -> spec -> validation ------------------------------------------------------

@pytest.mark.parametrize(("gpus", "mig_per_gpu"), [(1, 0), (8, 0), (8, 7)])
def test_fake_driver_fleets_validate(fake_driver_factory: Any, gpus: int, mig_per_gpu: int) -> None:
    from gpuhook.discover import Roots, discover

    mig = {i: ["1g.10gb"] * mig_per_gpu for i in range(gpus)} if mig_per_gpu else None
    fake = fake_driver_factory(gpus=gpus, mig=mig)
    inv = discover(Roots.make(str(fake.root), None, str(fake.root / "proc")))
    spec = spec_for(inv)
    expected: list[str] = []
    for g in fake.gpus:
        if g.mig_enabled:
            expected += [name for m in g.mig_devices for name in (f"{g.index}:{m.index}", m.uuid)]
        else:
            expected += [str(g.index), g.uuid]
    assert [d["name"] for d in spec["devices"]] == [*expected, "all"]
    assert spec["cdiVersion"] == "0.5.0"
    assert validate_spec(spec, "fake") == []
    assert validate_spec(codec.loads(codec.dumps(spec)), "fake.yaml") == []
    all_nodes = node_paths(by_name(spec)["all"])
    assert len(all_nodes) == len(set(all_nodes))
    assert sum(p.startswith("/dev/nvidia-caps/") for p in all_nodes) == 2 * gpus * mig_per_gpu
