"""Discovery takes the driver's files as the truth (simulated driver): unknown libraries, sonames read from
the ELF, the CUDA version from libcuda when NVML cannot answer, MIG devices without their capability nodes,
and the /dev/dri/by-path links of graphics devices."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from gpuhook.discover import Roots, discover
from gpuhook.errors import RequestError, RequirementError
from gpuhook.model.edits import Selection, common_edits, plan
from gpuhook.model.requirements import check
from gpuhook.plugin import devices as plugin_devices

HOOK = "/usr/local/bin/gpuhook"
LIB = "/usr/lib/x86_64-linux-gnu"


def gpuhook(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuhook.cli", *args], capture_output=True, text=True, check=False)


def roots_args(fake: Any) -> list[str]:
    return ["--driver-root", str(fake.root), "--proc-root", f"{fake.root}/proc"]


def roots(fake: Any) -> Roots:
    return Roots.make(str(fake.root), None, f"{fake.root}/proc")


def spec_of(fake: Any) -> dict[str, Any]:
    result = gpuhook("generate-cdi", *roots_args(fake), "--hook-path", HOOK, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def hook_links(edits: dict[str, Any], option: str = "--link") -> dict[str, str]:
    args = [a for h in edits.get("hooks", []) for a in h["args"]]
    return {v.split("::")[1]: v.split("::")[0] for k, v in zip(args, args[1:]) if k == option}


def test_unknown_driver_library_is_mounted_by_cdi_and_listed_unclassified(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=1, fresh=True)
    v = fake.driver_version
    # A library a newer driver might add: the driver's version in its name, nothing in the catalogue.
    source = fake.host_path(fake.library("libnvidia-vulkan-producer").path)
    shutil.copy2(source, fake.host_path(f"{LIB}/libnvidia-future.so.{v}"))
    data = json.loads(gpuhook("info", *roots_args(fake), "--json").stdout)
    (entry,) = [f for f in data["files"] if f["path"] == f"{LIB}/libnvidia-future.so.{v}"]
    assert entry["capability"] == "unclassified" and entry["kind"] == "lib"
    assert "unclassified lib (1):" in gpuhook("info", *roots_args(fake)).stdout
    mounts = {m["containerPath"] for m in spec_of(fake)["containerEdits"]["mounts"]}
    assert f"{LIB}/libnvidia-future.so.{v}" in mounts
    inv = discover(roots(fake))
    caps = frozenset({"compute", "utility", "video", "graphics", "display", "ngx"})  # NVIDIA_DRIVER_CAPABILITIES=all
    assert f"{LIB}/libnvidia-future.so.{v}" not in {m.container_path for m in common_edits(inv, caps).mounts}


def test_soname_links_come_from_the_elf_not_a_table(fake_driver_factory: Any) -> None:
    """A libnvidia-nvvm whose file has no DT_SONAME gets no libnvidia-nvvm.so.4 link (a table would make one)."""
    fake = fake_driver_factory(gpus=1, fresh=True)
    v = fake.driver_version
    nvvm = fake.host_path(f"{LIB}/libnvidia-nvvm.so.{v}")
    nvvm.unlink()
    shutil.copy2(fake.host_path(fake.library("libnvidia-vulkan-producer").path), nvvm)  # a library without soname
    made = hook_links(spec_of(fake)["containerEdits"])
    assert f"{LIB}/libnvidia-nvvm.so.4" not in made
    assert made[f"{LIB}/libnvidia-cfg.so.1"] == f"libnvidia-cfg.so.{v}"
    assert f"{LIB}/libnvidia-glcore.so.{v}" not in made  # soname = file name: no link
    assert "libnvidia-api.so.1" not in made.values()


def test_cuda_version_from_libcuda_without_nvml(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=1, cuda_version="12.3", fresh=True)
    fake.set_fail_init(True)
    data = json.loads(gpuhook("info", *roots_args(fake), "--json").stdout)
    assert data["source"] == "procfs" and data["cuda_version"] == "12.3"
    # Without libcuda the version is unknown, and a CUDA requirement refuses the container.
    for path in fake.host_path(LIB).glob("libcuda.so*"):
        path.unlink()
    data = json.loads(gpuhook("info", *roots_args(fake), "--json").stdout)
    assert data["cuda_version"] is None  # unknown
    inv = discover(roots(fake))
    with pytest.raises(RequirementError, match="cuda version is unknown"):
        check(inv, ("cuda>=11.0",), (inv.gpus[0],))


def _break_mig_caps(fake: Any) -> Any:
    mig = fake.mig_devices[0]
    fake.host_path(mig.ci_access).unlink()
    return mig


def test_mig_device_without_cap_nodes_is_an_error_everywhere(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=2, mig={1: ["1g.10gb", "1g.10gb"]}, fresh=True)
    mig = _break_mig_caps(fake)
    result = gpuhook("generate-cdi", *roots_args(fake), "--hook-path", HOOK)
    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "error getting MIG capability device paths" in line and f"MIG device {mig.gpu_index}:0" in line
    inv = discover(roots(fake))
    target = inv.gpus[1].mig_devices[0]
    with pytest.raises(RequestError, match="error getting MIG capability device paths"):  # the hook's plan
        plan(inv, Selection(devices=(target,)))
    plan(inv, Selection(devices=(inv.gpus[1].mig_devices[1],)))  # the other MIG device is whole
    with pytest.raises(RequestError, match="error getting MIG capability device paths"):  # the device plugin
        plugin_devices.plan(inv, plugin_devices.Options(mig_strategy="mixed"))


def test_graphics_devices_get_their_dri_by_path_links(fake_driver: Any) -> None:
    data = spec_of(fake_driver)
    gpu = fake_driver.gpus[0]
    device = next(d for d in data["devices"] if d["name"] == "0")["containerEdits"]
    assert "hooks" not in device  # the spec's one common hook makes them, for the nodes the runtime gave
    common = hook_links(data["containerEdits"], "--link-if-present")
    by_path = {k: v for k, v in common.items() if gpu.pci_bus_id in k}
    assert by_path == {
        f"/dev/dri/by-path/pci-{gpu.pci_bus_id}-card": f"../card{gpu.dri_card}",
        f"/dev/dri/by-path/pci-{gpu.pci_bus_id}-render": f"../renderD{gpu.dri_render}",
    }
    inv = discover(roots(fake_driver))
    graphics = plan(inv, Selection(devices=(inv.gpus[0],), capabilities=frozenset({"graphics"})))
    assert {s.link for s in graphics.symlinks} >= set(by_path)
    compute = plan(inv, Selection(devices=(inv.gpus[0],), capabilities=frozenset({"compute"})))
    assert not [s for s in compute.symlinks if s.link.startswith("/dev/")]


def test_no_by_path_links_where_the_host_has_none(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=1, fresh=True)
    shutil.rmtree(fake.host_path("/dev/dri/by-path"))
    spec = spec_of(fake)
    device = next(d for d in spec["devices"] if d["name"] == "0")["containerEdits"]
    assert "hooks" not in device
    assert not hook_links(spec["containerEdits"], "--link-if-present")


def test_ipc_sockets_under_run(fake_driver_factory: Any) -> None:
    """A host whose /var/run is not the link to /run it usually is: the sockets are found under /run."""
    import socket

    fake = fake_driver_factory(gpus=1, fresh=True)
    var_run = fake.host_path("/var/run")
    assert var_run.is_symlink()
    var_run.unlink()
    var_run.mkdir()
    path = fake.host_path("/run/nvidia-fabricmanager/socket")
    path.parent.mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(path))
        mounts = {m["containerPath"] for m in spec_of(fake)["containerEdits"]["mounts"]}
    finally:
        sock.close()
    assert {"/run/nvidia-fabricmanager/socket", "/run/nvidia-persistenced/socket"} <= mounts
