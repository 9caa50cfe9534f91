"""Every CDI spec a Kubernetes node can carry, side by side in one spec directory, resolves.

A node may have a host spec of kind nvidia.com/gpu (`gpuhook generate-cdi`, or nvidia-ctk's
/var/run/cdi/nvidia.yaml that the NVIDIA Container Toolkit >= 1.18 writes at install) and a device plugin's spec
(gpuhook's or NVIDIA's). The plugin's devices are of NVIDIA's plugin kind, k8s.device-plugin.nvidia.com/gpu
(k8s-device-plugin v0.20.0, cmd/nvidia-device-plugin/plugin-manager.go), in NVIDIA's file
(`k8s.device-plugin.nvidia.com-gpu.json`, internal/cdi/cdi.go): one name defined by two specs of one directory
is a conflict a runtime's CDI cache resolves to nothing (cdi/registry.py mirrors it). Checked here with the
registry and doctor; tests/test_plugin_podman.py has podman resolve the same names.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuhook.cdi.registry import scan
from gpuhook.discover import Roots, discover
from gpuhook.doctor.specs import check_specs
from gpuhook.plugin import cdispec
from gpuhook.plugin.devices import Options, plan

HOOK = "/usr/local/bin/gpuhook"


def inventory(fake: Any) -> Any:
    return discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")))


def gpuhook_host_spec(fake: Any, path: Path) -> None:
    subprocess.run([sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", str(fake.root),
                    "--proc-root", str(fake.root / "proc"), "--hook-path", HOOK, "--output", str(path)],
                   check=True, capture_output=True, text=True)


def nvidia_ctk_spec(fake: Any, path: Path) -> None:
    """The shape of nvidia-ctk's spec (`nvidia-ctk cdi generate`, toolkit 1.18): kind nvidia.com/gpu, each GPU
    by index and by UUID, `all`; the edits do not matter for name resolution, one node each."""
    devices = []
    for gpu in fake.gpus:
        edits = {"deviceNodes": [{"path": gpu.node_path}]}
        devices += [{"name": str(gpu.index), "containerEdits": edits}, {"name": gpu.uuid, "containerEdits": edits}]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": [{"path": g.node_path} for g in fake.gpus]}})
    path.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices,
                                "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}]}}))


def nvidia_plugin_spec(fake: Any, spec_dir: Path) -> list[str]:
    """What NVIDIA's plugin v0.20.0 writes under a CDI strategy (uuid ids): its kind, its file; returns the
    names its Allocate gives."""
    devices = [{"name": g.uuid, "containerEdits": {"deviceNodes": [{"path": g.node_path}]}} for g in fake.gpus]
    (spec_dir / "k8s.device-plugin.nvidia.com-gpu.json").write_text(json.dumps(
        {"cdiVersion": "0.5.0", "kind": "k8s.device-plugin.nvidia.com/gpu", "devices": devices}))
    return [f"k8s.device-plugin.nvidia.com/gpu={g.uuid}" for g in fake.gpus]


def gpuhook_plugin_spec(fake: Any, spec_dir: Path, **options: Any) -> list[str]:
    """gpuhook's plugin's spec in `spec_dir`; returns every CDI name its Allocate can give."""
    resources = plan(inventory(fake), Options(**options))
    cdispec.write(inventory(fake), resources, str(spec_dir), HOOK)
    return [d.cdi_name for r in resources for d in r.devices]


@pytest.mark.parametrize("host", ["gpuhook", "nvidia-ctk"])
@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
def test_a_host_spec_and_gpuhook_plugin_spec_both_resolve(fake_driver: Any, tmp_path: Path, host: str,
                                                           id_strategy: str) -> None:
    spec_dir = tmp_path / "run-cdi"
    spec_dir.mkdir()
    (gpuhook_host_spec if host == "gpuhook" else nvidia_ctk_spec)(fake_driver, spec_dir / "nvidia.yaml")
    names = gpuhook_plugin_spec(fake_driver, spec_dir, id_strategy=id_strategy)
    reg = scan([str(spec_dir)])
    assert reg.conflicts == {} and reg.errors == []
    assert names and all(reg.devices[n].spec_path.endswith("k8s.device-plugin.nvidia.com-gpu.json") for n in names)
    host_names = ["nvidia.com/gpu=0", f"nvidia.com/gpu={fake_driver.gpus[1].uuid}", "nvidia.com/gpu=all"]
    assert all(reg.devices[n].spec_path.endswith("nvidia.yaml") for n in host_names)  # the host's stay its own
    findings, _ = check_specs([str(spec_dir)], inventory(fake_driver))
    assert not [f for f in findings if f.message.startswith("CDI name clash")]


def test_gpuhook_host_spec_and_nvidia_plugin_spec_both_resolve(fake_driver: Any, tmp_path: Path) -> None:
    spec_dir = tmp_path / "run-cdi"
    spec_dir.mkdir()
    gpuhook_host_spec(fake_driver, spec_dir / "nvidia.yaml")
    names = nvidia_plugin_spec(fake_driver, spec_dir)
    reg = scan([str(spec_dir)])
    assert reg.conflicts == {} and set(names) <= set(reg.devices)


def test_gpuhook_plugin_replaces_nvidia_plugin_spec(fake_driver: Any, tmp_path: Path) -> None:
    """Swapping NVIDIA's plugin for gpuhook's: the same file is rewritten, never a second spec of that kind."""
    spec_dir = tmp_path / "run-cdi"
    spec_dir.mkdir()
    nvidia_plugin_spec(fake_driver, spec_dir)
    names = gpuhook_plugin_spec(fake_driver, spec_dir)
    assert sorted(p.name for p in spec_dir.iterdir()) == ["k8s.device-plugin.nvidia.com-gpu.json"]
    reg = scan([str(spec_dir)])
    assert reg.conflicts == {} and set(names) <= set(reg.devices)


def test_doctor_names_the_clash_an_older_plugin_spec_makes(fake_driver: Any, tmp_path: Path) -> None:
    """The clash this avoids, as doctor shows it: a plugin spec of kind nvidia.com/gpu (what gpuhook's plugin
    wrote before) beside a host spec in one directory: one PROBLEM naming both files, not one per name."""
    spec_dir = tmp_path / "run-cdi"
    spec_dir.mkdir()
    nvidia_ctk_spec(fake_driver, spec_dir / "nvidia.yaml")
    gpuhook_host_spec(fake_driver, spec_dir / cdispec.OLD_SPEC_FILE)  # a gpuhook-made nvidia.com/gpu spec
    findings, _ = check_specs([str(spec_dir)], inventory(fake_driver))
    (clash,) = [f for f in findings if f.message.startswith("CDI name clash")]
    assert str(spec_dir / "nvidia.yaml") in clash.message and cdispec.OLD_SPEC_FILE in clash.message
    assert "nvidia.com/gpu=0" in clash.message and clash.status == "problem"


def test_the_host_refresh_units_spec_is_left_alone(fake_driver: Any, tmp_path: Path) -> None:
    """runtime-config/systemd/gpuhook-cdi-refresh.service writes /var/run/cdi/nvidia.com-gpu.yaml, the name the
    plugin once used: the plugin writes its own file beside it and both resolve."""
    spec_dir = tmp_path / "run-cdi"
    spec_dir.mkdir()
    gpuhook_host_spec(fake_driver, spec_dir / "nvidia.com-gpu.yaml")
    names = gpuhook_plugin_spec(fake_driver, spec_dir)
    assert sorted(p.name for p in spec_dir.iterdir()) == ["k8s.device-plugin.nvidia.com-gpu.json",
                                                          "nvidia.com-gpu.yaml"]
    reg = scan([str(spec_dir)])
    assert reg.conflicts == {} and set(names) <= set(reg.devices) and "nvidia.com/gpu=all" in reg.devices


def test_doctor_counts_the_plugins_spec_as_the_runtimes_way_in(fake_driver: Any, tmp_path: Path) -> None:
    """A Kubernetes node whose containerd reads CDI and has only the device plugin's spec: its pods get GPUs,
    so doctor reports no PROBLEM for the runtime (the spec's kind is the plugin's, not nvidia.com/gpu)."""
    from gpuhook.doctor import runtimes as rt
    from gpuhook.doctor.model import PROBLEM

    spec_dir = tmp_path / "run-cdi"
    spec_dir.mkdir()
    gpuhook_plugin_spec(fake_driver, spec_dir)
    _, status = check_specs([str(spec_dir)], inventory(fake_driver))
    config = tmp_path / "containerd.toml"
    config.write_text(f'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = true\n'
                      f'cdi_spec_dirs = ["{spec_dir}"]\n')
    paths = rt.Paths(containerd_config=str(config), spec_dirs=(str(spec_dir),))
    found = rt.check_containerd((1, 7, 24), paths, status)
    assert [f for f in found if f.status == PROBLEM] == []
    assert any("k8s.device-plugin.nvidia.com/gpu=… from" in f.message for f in found)
