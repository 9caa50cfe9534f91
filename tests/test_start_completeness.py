"""A GPU start that would inject less than it asked for fails with one line.

`inject devices=GPU-… nodes=0 mounts=0 links=0` used to exit 0: the container started without its GPU. The rule
lives once, in model/edits.plan (and Inventory.device_gap, which the CDI generator uses too), so the hook, the
shim and the CDI spec all refuse the same things.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.inv import sample_inventory

from gpuhook.errors import RequestError
from gpuhook.model import record
from gpuhook.model.edits import ALL_CAPABILITIES, Selection, plan
from gpuhook.model.inventory import Inventory

SHIM = str(Path(sys.executable).with_name("gpuhook-runtime"))


def without_gpu_node(inv: Inventory, index: int) -> Inventory:
    gpus = list(inv.gpus)
    gpus[index] = record.replace(gpus[index], node=None)
    return record.replace(inv, gpus=gpus)


# --- the plan ------------------------------------------------------------------------------------------------

def test_a_selected_gpu_without_its_node_fails() -> None:
    inv = without_gpu_node(sample_inventory(), 1)
    with pytest.raises(RequestError, match=r"^GPU 1 has no device node /dev/nvidia1 under "):
        plan(inv, Selection(devices=(inv.gpus[1],)))
    plan(inv, Selection(devices=(inv.gpus[0],)))  # another GPU is still fine


def test_a_mig_device_without_its_caps_nodes_fails() -> None:
    inv = sample_inventory()
    gpu = next(g for g in inv.gpus if g.mig_devices)
    mig = record.replace(gpu.mig_devices[0], cap_nodes=())
    gpus = [record.replace(g, mig_devices=(mig, *g.mig_devices[1:])) if g is gpu else g for g in inv.gpus]
    inv = record.replace(inv, gpus=gpus)
    with pytest.raises(RequestError, match="has no nvidia-caps device nodes .*error getting MIG capability"):
        plan(inv, Selection(devices=(mig,)))


def test_no_control_node_fails() -> None:
    inv = sample_inventory()
    inv = record.replace(inv, control_nodes={k: v for k, v in inv.control_nodes.items() if k != "nvidiactl"})
    with pytest.raises(RequestError, match="no device node /dev/nvidiactl"):
        plan(inv, Selection(devices=(inv.gpus[0],)))


@pytest.mark.parametrize("capability", ["compute", "utility", "video", "graphics"])
def test_a_named_capability_without_libraries_fails(capability: str) -> None:
    inv = sample_inventory()
    inv = record.replace(inv, files=[f for f in inv.files if f.capability != capability])
    with pytest.raises(RequestError, match=rf"no driver library for capability '{capability}'"):
        plan(inv, Selection(devices=(inv.gpus[0],), capabilities=frozenset({capability, "utility", "compute"})))


def test_all_capabilities_take_what_the_driver_has() -> None:
    """`all` is whatever the driver offers: a headless driver without graphics libraries still serves it."""
    inv = sample_inventory()
    inv = record.replace(inv, files=[f for f in inv.files if f.capability not in ("graphics", "video")])
    edits = plan(inv, Selection(devices=(inv.gpus[0],), capabilities=ALL_CAPABILITIES))
    assert edits.device_nodes and edits.mounts


# --- the front doors, on a fake driver whose /dev/nvidia0 is gone -----------------------------------------------

@pytest.fixture
def fake_without_node0(fake_driver_factory: Any) -> Any:
    """procfs still lists GPU 0 (NVML is failing: the fake's NVML would follow its nodes), /dev/nvidia0 is gone:
    a driver whose nodes were never created, or were removed."""
    fake = fake_driver_factory(gpus=2, fresh=True)
    fake.set_fail_init()
    (fake.root / "dev/nvidia0").unlink()
    return fake


def config_for(tmp: Path, fake: Any) -> Path:
    path = tmp / "config.toml"
    path.write_text(f'driver-root = "{fake.root}"\nproc-root = "{fake.root}/proc"\nlog-file = "{tmp}/gpuhook.log"\n'
                    f'inventory-cache = "{tmp}/inventory.json"\n')
    return path


def bundle(tmp: Path, env: list[str]) -> Path:
    folder = tmp / "bundle"
    folder.mkdir()
    (folder / "rootfs").mkdir()
    config = {"ociVersion": "1.0.2", "process": {"args": ["true"], "env": env}, "root": {"path": "rootfs"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_hook_refuses_a_gpu_without_its_node(fake_without_node0: Any, tmp_path: Path) -> None:
    """pid 0: planning comes before anything touches a process, and it must be what refuses."""
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 0,
                        "bundle": str(bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"]))})
    result = subprocess.run([sys.executable, "-m", "gpuhook.hook.prestart", "--config",
                             str(config_for(tmp_path, fake_without_node0))],
                            input=state, capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"gpuhook-hook: GPU 0 has no device node /dev/nvidia0 under {fake_without_node0.root}"]
    assert "c1 error: GPU 0 has no device node" in (tmp_path / "gpuhook.log").read_text()


def test_the_shim_refuses_a_gpu_without_its_node(fake_without_node0: Any, tmp_path: Path) -> None:
    folder = bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    before = (folder / "config.json").read_bytes()
    runtime = tmp_path / "runc"
    runtime.write_text("#!/bin/sh\necho ran > \"$(dirname \"$0\")/ran\"\n")
    runtime.chmod(0o755)
    env = dict(os.environ, GPUHOOK_CONFIG=str(config_for(tmp_path, fake_without_node0)), GPUHOOK_RUNTIME=str(runtime))
    result = subprocess.run([SHIM, "create", "--bundle", str(folder), "c1"], capture_output=True, text=True,
                            env=env, timeout=60, check=False)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"gpuhook-runtime: GPU 0 has no device node /dev/nvidia0 under {fake_without_node0.root}"]
    assert (folder / "config.json").read_bytes() == before and not (tmp_path / "ran").exists()


def test_generate_cdi_refuses_a_mig_device_without_caps_nodes(fake_driver_factory: Any) -> None:
    """The gi/ci access files that name the caps nodes are gone (a MIG instance half torn down)."""
    fake = fake_driver_factory(gpus=2, mig={1: ["1g.10gb"]}, fresh=True)
    for access in (fake.root / "proc/driver/nvidia/capabilities").glob("gpu*/mig/gi*/**/access"):
        access.unlink()
    result = subprocess.run([sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", str(fake.root),
                             "--proc-root", str(fake.root / "proc"), "--hook-path", "/usr/local/bin/gpuhook-hook"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "has no nvidia-caps device nodes" in lines[0], result.stderr
