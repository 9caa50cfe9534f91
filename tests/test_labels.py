"""GPU feature labels (NVIDIA gpu-feature-discovery's names and values) from the inventory: `gpuhook labels`, and
the device plugin's `--feature-file` kept current through health changes and a driver upgrade."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.kubelet import TestKubelet
from support.processes import short_tempdir
from test_plugin import FAST_HEALTH, wait_nvml_events

from gpuhook.cli.app import main
from gpuhook.discover import Inventory, Roots, discover
from gpuhook.fakedriver.procfs import version_text
from gpuhook.model import record
from gpuhook.model.inventory import Gpu
from gpuhook.plugin.devices import Options
from gpuhook.plugin.health import HealthConfig
from gpuhook.plugin.labels import LabelError, arch_family, check, labels, render, sanitise
from gpuhook.plugin.lifecycle import Plugin, PluginConfig

H100 = "NVIDIA-H100-80GB-HBM3"


def inventory(fake: Any, method: str = "auto") -> Inventory:
    return discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")), method=method)


def read_features(path: Path) -> dict[str, str]:
    """Parse a features.d file as NFD's local source does, insisting on one well-formed `name=value` a line."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        assert sep, f"not name=value: {line!r}"
        assert name not in out, f"duplicate label {name}"
        check(name, value)
        out[name] = value
    return out


# -- label values ----------------------------------------------------------------------------------------------


def test_labels_of_a_bridged_h100_node(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=8, nvlink="bridge")
    inv = inventory(fake)
    assert labels(inv) == {
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "54",
        "nvidia.com/cuda.driver.rev": "15",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.nvlink": "12",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": H100,
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mps.capable": "false",
    }


def test_labels_match_the_inventory(fake_driver_factory: Any) -> None:
    for layout, links in (("nvswitch", "18"), ("none", "none")):
        inv = inventory(fake_driver_factory(gpus=8, nvlink=layout))
        got = labels(inv)
        assert got["nvidia.com/gpu.nvlink"] == links
        assert got["nvidia.com/gpu.count"] == str(len(inv.gpus))
        assert got["nvidia.com/gpu.memory"] == str(inv.gpus[0].memory_mib)
        assert got["nvidia.com/cuda.driver-version.full"] == inv.driver_version


def test_procfs_inventory_labels_what_it_knows(fake_driver_factory: Any) -> None:
    inv = inventory(fake_driver_factory(gpus=2, nvlink="bridge"), method="procfs")
    got = labels(inv)
    assert "nvidia.com/gpu.nvlink" not in got  # unknown topology: no label rather than a wrong one
    assert "nvidia.com/gpu.memory" not in got
    assert got["nvidia.com/gpu.count"] == "2" and got["nvidia.com/cuda.driver.major"] == "550"
    # The CUDA version comes from the driver's libcuda when NVML cannot say.
    assert (got["nvidia.com/cuda.runtime.major"], got["nvidia.com/cuda.runtime.minor"]) == ("12", "4")


def test_time_slicing_and_mig_strategies(fake_driver_mig: Any) -> None:
    inv = inventory(fake_driver_mig)  # 4 GPUs, MIG on GPU 1: 1g.10gb x2, 2g.20gb
    shared = labels(inv, Options(replicas=4))
    assert shared["nvidia.com/gpu.product"] == f"{H100}-SHARED"
    assert shared["nvidia.com/gpu.replicas"] == "4"
    assert shared["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert shared["nvidia.com/gpu.count"] == "4"  # under none the MIG-enabled GPU is served whole too
    assert "nvidia.com/mig.strategy" not in shared
    mixed = labels(inv, Options(mig_strategy="mixed"))
    assert mixed["nvidia.com/gpu.count"] == "3"  # the MIG-disabled ones
    assert mixed["nvidia.com/mig.strategy"] == "mixed"
    assert mixed["nvidia.com/mig-1g.10gb.count"] == "2"
    assert mixed["nvidia.com/mig-1g.10gb.product"] == f"{H100}-MIG-1g.10gb"
    assert mixed["nvidia.com/mig-1g.10gb.memory"] == "9984"
    assert mixed["nvidia.com/mig-2g.20gb.count"] == "1"
    assert mixed["nvidia.com/mig-1g.10gb.sharing-strategy"] == "none"
    single = labels(inv, Options(mig_strategy="single"))  # MIG on one GPU of four: GFD's INVALID labels
    assert single["nvidia.com/gpu.product"] == f"{H100}-MIG-INVALID"
    assert single["nvidia.com/gpu.count"] == "0" and single["nvidia.com/gpu.memory"] == "0"


def test_mixed_products_are_labelled_as_gfd_does() -> None:
    def gpu(i: int, name: str, mig: bool = False) -> Gpu:
        return Gpu(index=i, minor=i, uuid=f"GPU-{i}", pci_bus_id=f"0000:{0x10 + i:02x}:00.0", name=name,
                   memory_mib=1000 * (i + 1), compute_capability="8.0", mig_enabled=mig)

    inv = Inventory("550.54.15", "12.4", "nvml", "/", "/", "/proc",
                    gpus=[gpu(0, "NVIDIA A100-SXM4-40GB", mig=True), gpu(1, "NVIDIA A30"), gpu(2, "NVIDIA A30"),
                          gpu(3, "NVIDIA A100-SXM4-40GB")])
    got = labels(inv)
    # one product's labels, its own count (not the node's total); whole GPUs over the MIG-enabled one
    assert got["nvidia.com/gpu.product"] == "NVIDIA-A30"
    assert got["nvidia.com/gpu.count"] == "2" and got["nvidia.com/gpu.memory"] == "2000"
    assert got["nvidia.com/gpu.family"] == "ampere"
    # every GPU MIG-enabled, under mixed: the MIG-enabled product, without sharing, none allocatable whole
    all_mig = record.replace(inv, gpus=[record.replace(g, mig_enabled=True) for g in inv.gpus])
    got = labels(all_mig, Options(mig_strategy="mixed"))
    assert got["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB" and got["nvidia.com/gpu.replicas"] == "0"
    assert got["nvidia.com/gpu.count"] == "0"
    # ... under none they are served as whole GPUs, and labelled so
    got = labels(all_mig)
    assert (got["nvidia.com/gpu.product"], got["nvidia.com/gpu.count"], got["nvidia.com/gpu.replicas"]) == (
        "NVIDIA-A100-SXM4-40GB", "2", "1")


def test_unhealthy_devices_leave_the_count(fake_driver_factory: Any) -> None:
    inv = inventory(fake_driver_factory(gpus=8, nvlink="bridge"))
    assert labels(inv, unhealthy={(3, -1)})["nvidia.com/gpu.count"] == "7"


@pytest.mark.parametrize("name, product", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
    ("Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB"),
    ("NVIDIA GeForce RTX 4090 (Laptop)  GPU", "NVIDIA-GeForce-RTX-4090-Laptop-GPU"),
    ("Quadro RTX 6000/8000", "Quadro-RTX-60008000"),
])
def test_product_sanitised_as_gfd(name: str, product: str) -> None:
    assert sanitise(name) == product


def test_arch_families() -> None:
    assert [arch_family(*cc) for cc in ((6, 0), (7, 0), (7, 5), (8, 6), (8, 9), (9, 0), (4, 0))] == [
        "pascal", "volta", "turing", "ampere", "ada-lovelace", "hopper", "undefined"]


@pytest.mark.parametrize("name, value", [
    ("nvidia.com/gpu.product", "x" * 64),  # value over 63
    ("nvidia.com/" + "n" * 64, "1"),  # name over 63
    ("nvidia.com/-gpu", "1"),  # name must start alphanumeric
    ("nvidia.com/gpu.count", "8-"),  # value must end alphanumeric
    ("nvidia.com/gpu count", "1"),
    ("Nvidia.com/gpu", "1"),  # prefix is a lower-case DNS subdomain
    ("a" * 250 + ".com/gpu", "1"),  # prefix over 253
    ("/gpu", "1"),
])
def test_label_syntax_rejected(name: str, value: str) -> None:
    with pytest.raises(LabelError):
        check(name, value)


def test_label_syntax_accepted() -> None:
    for name, value in (("nvidia.com/gpu.sharing-strategy", "time-slicing"), ("nvidia.com/cuda.driver.rev", ""),
                        ("gpu_count", "A.b-c_9"), ("nvidia.com/" + "n" * 63, "v" * 63)):
        check(name, value)


# -- gpuhook labels -------------------------------------------------------------------------------------------


def test_cli_prints_and_writes_the_feature_file(fake_driver_factory: Any, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    fake = fake_driver_factory(gpus=8, nvlink="bridge")
    args = ["labels", "--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed == render(labels(inventory(fake)).items())
    out = tmp_path / "features.d" / "gpuhook"
    assert main([*args, "--replicas", "2", "-o", str(out)]) == 0
    written = read_features(out)
    assert written["nvidia.com/gpu.replicas"] == "2" and written["nvidia.com/gpu.product"] == f"{H100}-SHARED"
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert main([*args, "-o", str(tmp_path)]) == 1  # a directory: one line, nothing written
    assert "cannot write" in capsys.readouterr().err


# -- the plugin keeps it current --------------------------------------------------------------------------------


@contextlib.contextmanager
def plugin_with_features(fake: Any, feature_file: Path, health: HealthConfig,
                         load: Callable[[], Inventory]) -> Iterator[Plugin]:
    directory = short_tempdir()
    with TestKubelet(os.path.join(directory, "dp")) as kubelet:
        config = PluginConfig(kubelet_dir=kubelet.directory, cdi_spec_dir=os.path.join(directory, "cdi"),
                              hook_path="/bin/true", health=health, sys_root=str(fake.root / "sys"),
                              feature_file=str(feature_file), hook_state_dir=None)
        plugin = Plugin(config, load)
        plugin.start()
        thread = threading.Thread(target=plugin.run, daemon=True)
        thread.start()
        try:
            kubelet.wait_registrations(1)
            yield plugin
        finally:
            plugin.request_stop()
            thread.join(10)
            assert not thread.is_alive()


def wait_features(path: Path, predicate: Callable[[dict[str, str]], bool], timeout: float = 10.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        current = read_features(path) if path.exists() else {}
        if predicate(current):
            return current
        assert time.monotonic() < deadline, f"feature file never matched: {current}"
        time.sleep(0.05)


def test_plugin_feature_file_follows_health(fake_driver: Any, tmp_path: Path) -> None:
    out = tmp_path / "features.d" / "gpuhook"
    inv = inventory(fake_driver)
    with plugin_with_features(fake_driver, out, FAST_HEALTH, lambda: inv) as plugin:
        assert read_features(out) == labels(inv)  # written before the plugin registered
        wait_nvml_events(fake_driver, 2)
        fake_driver.inject_xid(1, 79)
        wait_features(out, lambda f: f.get("nvidia.com/gpu.count") == "1")
        wait_features(out, lambda f: f.get("nvidia.com/gpu.count") == "2")  # recovered after the window
        assert plugin.features is not None


def test_plugin_feature_file_follows_a_driver_upgrade(fake_driver_factory: Any, tmp_path: Path) -> None:
    fake = fake_driver_factory(gpus=4, nvlink="bridge", fresh=True)
    out = tmp_path / "gpuhook"
    load = lambda: inventory(fake)  # noqa: E731 - discovers again on every reload
    with plugin_with_features(fake, out, HealthConfig(enabled=False), load):
        before = read_features(out)
        assert before["nvidia.com/cuda.driver-version.full"] == "550.54.15"
        assert before["nvidia.com/gpu.nvlink"] == "12"
        # the kernel module is upgraded under the running plugin; the old NVML library no longer matches it
        (fake.root / "proc/driver/nvidia/version").write_text(version_text("560.35.03"))
        after = wait_features(out, lambda f: f.get("nvidia.com/cuda.driver-version.full") == "560.35.03")
    assert after == labels(inventory(fake))
    assert after["nvidia.com/cuda.driver.major"] == "560" and after["nvidia.com/gpu.count"] == "4"
    assert "nvidia.com/gpu.nvlink" not in after  # procfs fallback: topology unknown now


# -- the deployment --------------------------------------------------------------------------------------------


PLUGIN_DIR = Path(__file__).parent.parent / "plugin"
DEPLOY_DIR = Path(__file__).parent.parent / "deploy/base/device-plugin"


def test_daemonset_writes_the_feature_file_into_the_hosts_nfd_directory() -> None:
    import yaml

    from gpuhook.plugin.featurefile import NFD_FEATURES_DIR

    (ds,) = yaml.safe_load_all((DEPLOY_DIR / "daemonset.yaml").read_text(encoding="utf-8"))
    pod = ds["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == NFD_FEATURES_DIR)
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    flag = next(a for a in container["args"] if a.startswith("--feature-file="))
    assert os.path.dirname(flag.split("=", 1)[1].split("#")[0].strip()) == mount["mountPath"]
    assert not mount.get("readOnly")


def test_readme_pods_select_labels_the_plugin_writes(fake_driver_factory: Any) -> None:
    import yaml

    text = (PLUGIN_DIR.parent / "docs" / "device-plugin.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    pods = [yaml.safe_load(b) for b in blocks]
    got = labels(inventory(fake_driver_factory(gpus=8, nvlink="bridge")))
    selecting = next(p for p in pods if "nodeSelector" in p["spec"])
    for name, value in selecting["spec"]["nodeSelector"].items():
        assert got[name] == value
    two = next(p for p in pods if p["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 2})
    terms = two["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (expr,) = terms["nodeSelectorTerms"][0]["matchExpressions"]
    assert expr["key"] in got and got[expr["key"]] not in expr["values"]
