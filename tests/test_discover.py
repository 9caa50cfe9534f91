"""Discovery against simulated drivers: NVML and procfs paths, several layouts, and every bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuhook.cli.app import main as cli_main
from gpuhook.discover import Roots, discover
from gpuhook.errors import DiscoveryError
from gpuhook.model import catalogue
from gpuhook.model.report import topology_to_dict


def roots(fake: Any) -> Roots:
    return Roots.make(str(fake.root), None, str(Path(fake.root) / "proc"))


def info_json(fake: Any, *extra: str) -> dict[str, Any]:
    """`gpuhook info --json` as a user runs it (a subprocess: pynvml state never leaks between tests)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuhook.cli",
            "info",
            "--driver-root",
            str(fake.root),
            "--proc-root",
            f"{fake.root}/proc",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def check_matches_fake(data: dict[str, Any], fake: Any) -> None:
    assert data["driver_version"] == fake.driver_version
    assert [g["uuid"] for g in data["gpus"]] == [g.uuid for g in fake.gpus]
    for got, want in zip(data["gpus"], fake.gpus):
        assert (got["index"], got["minor"], got["pci_bus_id"]) == (want.index, want.minor, want.pci_bus_id)
        assert got["node"]["path"] == f"/dev/nvidia{want.minor}"
        assert (got["node"]["major"], got["node"]["minor"]) == (195, want.minor)
        assert got["mig_enabled"] == want.mig_enabled
        assert [(m["uuid"], m["gi"], m["ci"], m["profile"]) for m in got["mig_devices"]] == [
            (m.uuid, m.gi, m.ci, m.profile) for m in want.mig_devices
        ]
        for gm, wm in zip(got["mig_devices"], want.mig_devices):
            assert sorted(n["minor"] for n in gm["cap_nodes"]) == sorted([wm.gi_cap_minor, wm.ci_cap_minor])
    libs = {f["path"].rsplit("/", 1)[1] for f in data["files"] if f["kind"] == "lib"}
    others = {lib.path.rsplit("/", 1)[1] for lib in fake.others if lib.path.startswith(catalogue.LIB_DIR)}
    assert libs == {spec.file_name(fake.driver_version) for spec in catalogue.LIBRARIES} | others
    assert all(f["host_path"].startswith(str(fake.root)) for f in data["files"] if f["kind"] != "link")
    names = set(data["control_nodes"])
    assert {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"} <= names


def test_info_json_reports_exactly_the_default_fake(fake_driver: Any) -> None:
    data = info_json(fake_driver)
    assert data["source"] == "nvml" and data["cuda_version"] == "12.4"
    check_matches_fake(data, fake_driver)


def test_info_json_other_version_count_and_mig_layout(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(
        gpus=5, driver_version="535.161.08", cuda_version="12.2", mig={0: ["3g.40gb", "1g.10gb"], 3: ["7g.80gb"]}
    )
    data = info_json(fake)
    check_matches_fake(data, fake)
    assert data["cuda_version"] == "12.2"
    assert [len(g["mig_devices"]) for g in data["gpus"]] == [2, 0, 0, 1, 0]
    assert set(data["mig_control_nodes"]) == {"config", "monitor"}


def test_files_per_capability_and_compat32(fake_driver: Any) -> None:
    inv = _discover_in_subprocess(fake_driver)
    by_kind: dict[str, set[str]] = {}
    for f in inv["files"]:
        by_kind.setdefault(f["kind"], set()).add(f["path"])
    assert "/usr/bin/nvidia-smi" in by_kind["bin"]
    assert f"/lib/firmware/nvidia/{fake_driver.driver_version}/gsp_ga10x.bin" in by_kind["firmware"]
    assert "/var/run/nvidia-persistenced/socket" in by_kind["ipc"]
    assert "/usr/share/glvnd/egl_vendor.d/10_nvidia.json" in by_kind["config"]
    if fake_driver.compat32:
        assert f"/usr/lib/i386-linux-gnu/libcuda.so.{fake_driver.driver_version}" in by_kind["lib32"]
    vdpau = [f for f in inv["files"] if "vdpau" in f["path"] and f["kind"] == "lib"]
    assert vdpau and vdpau[0]["capability"] == "video" and vdpau[0]["soname"] == "libvdpau_nvidia.so.1"


def _discover_in_subprocess(fake: Any, method: str = "auto") -> dict[str, Any]:
    return info_json(fake, "--discovery", method)


def test_procfs_fallback_when_nvml_fails(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=3, mig={2: ["1g.10gb"]}, fresh=True)
    fake.set_fail_init(True)
    try:
        data = info_json(fake)
        assert data["source"] == "procfs"
        assert any("nvmlInit failed" in n for n in data["notes"])
        assert [g["uuid"] for g in data["gpus"]] == [g.uuid for g in fake.gpus]
        assert [g["pci_bus_id"] for g in data["gpus"]] == [g.pci_bus_id for g in fake.gpus]
        assert [(m["gi"], m["ci"]) for m in data["gpus"][2]["mig_devices"]] == [
            (m.gi, m.ci) for m in fake.gpus[2].mig_devices
        ]
        err = _run_cli(
            ["info", "--driver-root", str(fake.root), "--proc-root", f"{fake.root}/proc", "--discovery", "nvml"]
        )
        assert err[0] == 1 and "nvmlInit failed" in err[2]
    finally:
        fake.set_fail_init(False)


def test_unknown_values_are_null_in_json_and_unknown_in_text(fake_driver: Any) -> None:
    """Under the procfs fallback the memory size, compute capability, brand and NUMA node are unknown: null in
    JSON, "unknown" in text, never a 0 or -1 that reads like a value."""
    data = info_json(fake_driver, "--discovery", "procfs")
    for gpu in data["gpus"]:
        assert (gpu["memory_mib"], gpu["compute_capability"], gpu["brand"], gpu["numa_node"]) == (None,) * 4
    code, out, err = _run_cli(["info", "--driver-root", str(fake_driver.root), "--proc-root",
                               f"{fake_driver.root}/proc", "--discovery", "procfs"])
    assert code == 0, err
    gpu_lines = [line for line in out.splitlines() if line.startswith("  0: ")]
    assert gpu_lines and "unknown cc=unknown brand=unknown" in gpu_lines[0] and " 0 MiB" not in out
    known = info_json(fake_driver, "--discovery", "nvml")["gpus"][0]
    assert known["memory_mib"] and known["compute_capability"]  # NVML knows them


def test_procfs_fallback_without_nvml_library(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=2, fresh=True)
    for path in Path(fake.root).glob("usr/lib/x86_64-linux-gnu/libnvidia-ml.so*"):
        path.unlink()
    data = info_json(fake)
    assert data["source"] == "procfs" and "no libnvidia-ml.so.1" in data["notes"][0]
    assert len(data["gpus"]) == 2


def test_dev_only_fallback(fake_driver_factory: Any, tmp_path: Path) -> None:
    fake = fake_driver_factory(gpus=3, fresh=True)
    shutil.rmtree(Path(fake.root) / "proc/driver/nvidia/gpus")
    for path in Path(fake.root).glob("usr/lib/x86_64-linux-gnu/libnvidia-ml.so*"):
        path.unlink()
    data = info_json(fake)
    assert [g["minor"] for g in data["gpus"]] == [0, 1, 2]


def _run_cli(args: list[str]) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "gpuhook.cli", *args], capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def test_missing_driver_root_is_one_line_exit_1(tmp_path: Path) -> None:
    code, out, err = _run_cli(["info", "--driver-root", str(tmp_path / "nope")])
    assert code == 1 and err.count("\n") == 1 and "nope" in err and "Traceback" not in err


def test_root_without_driver(tmp_path: Path) -> None:
    code, _, err = _run_cli(["info", "--driver-root", str(tmp_path), "--proc-root", str(tmp_path / "proc")])
    assert code == 1 and err.startswith("gpuhook: no NVIDIA driver found under") and err.count("\n") == 1


def test_corrupt_ld_cache_names_the_file(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=1, fresh=True)
    cache = Path(fake.root) / "etc/ld.so.cache"
    cache.write_bytes(b"glibc-ld.so.cache1.1" + b"\xff" * 40)
    code, _, err = _run_cli(["info", "--driver-root", str(fake.root), "--proc-root", f"{fake.root}/proc"])
    assert code == 1 and str(cache) in err and err.count("\n") == 1


def test_library_that_is_not_elf(fake_driver_factory: Any) -> None:
    fake = fake_driver_factory(gpus=1, fresh=True)
    lib = Path(fake.root) / f"usr/lib/x86_64-linux-gnu/libnvidia-cfg.so.{fake.driver_version}"
    lib.write_text("not an ELF file\n")
    code, _, err = _run_cli(["info", "--driver-root", str(fake.root), "--proc-root", f"{fake.root}/proc"])
    assert code == 1 and str(lib) in err and "ELF" in err and err.count("\n") == 1


def test_usage_error_exit_2() -> None:
    code, _, err = _run_cli(["info", "--discovery", "magic"])
    assert code == 2 and "magic" in err


def test_list_shows_what_a_container_gets(fake_driver: Any) -> None:
    args = [
        "list",
        "--driver-root",
        str(fake_driver.root),
        "--proc-root",
        f"{fake_driver.root}/proc",
        "--devices",
        "1",
        "--capabilities",
        "utility",
        "--json",
    ]
    code, out, err = _run_cli(args)
    assert code == 0, err
    data = json.loads(out)
    assert [(n["path"], n["major"], n["minor"]) for n in data["device_nodes"]] == [
        ("/dev/nvidia1", 195, 1),
        ("/dev/nvidiactl", 195, 255),
    ]
    mounted = {m["container_path"] for m in data["mounts"]}
    assert f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{fake_driver.driver_version}" in mounted
    assert not any("libcuda" in p for p in mounted)
    assert {
        "link": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "target": f"libnvidia-ml.so.{fake_driver.driver_version}",
    } in data["symlinks"]
    code, _, err = _run_cli(args[:-1] + ["--devices", "GPU-nope"])
    assert code == 1 and "unknown device 'GPU-nope' requested (--devices)" in err
    assert "(env)" not in err  # the ids came from the flag


@pytest.mark.parametrize("devices", ["void", "", " , ", "all,void", "none,void"])
def test_list_agrees_with_the_hook_on_void(fake_driver: Any, devices: str) -> None:
    """The hook leaves a void (or empty) request untouched: `list` must show nothing, not none's driver files."""
    base = ["list", "--driver-root", str(fake_driver.root), "--proc-root", f"{fake_driver.root}/proc",
            "--devices", devices]
    code, out, err = _run_cli([*base, "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert not any(data.values()), data
    code, out, err = _run_cli(base)
    assert code == 0, err
    assert out.startswith("nothing: a container with NVIDIA_VISIBLE_DEVICES=") and "untouched" in out


@pytest.mark.parametrize("devices", ["none", "none,all", "0,none"])  # the first special word decides
def test_list_none_gets_driver_files_and_control_nodes_only(fake_driver: Any, devices: str) -> None:
    code, out, err = _run_cli(["list", "--driver-root", str(fake_driver.root), "--proc-root",
                               f"{fake_driver.root}/proc", "--devices", devices, "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert "/dev/nvidiactl" in [n["path"] for n in data["device_nodes"]]
    assert not any(n["path"].startswith("/dev/nvidia") and n["path"][11:].isdigit() for n in data["device_nodes"])
    assert data["mounts"]


def test_in_process_discovery_matches_cli(fake_driver_mig: Any) -> None:
    inv = discover(roots(fake_driver_mig))
    cli = info_json(fake_driver_mig)
    assert cli.pop("topology") == json.loads(json.dumps(topology_to_dict(inv)))  # the derived matrix
    assert json.loads(json.dumps(inv.to_dict())) == cli
    assert inv.fingerprint and len(inv.fingerprint) == 32


def test_unknown_method_is_a_discovery_error(fake_driver: Any) -> None:
    with pytest.raises(DiscoveryError, match="unknown discovery method"):
        discover(roots(fake_driver), method="magic")


def test_cli_main_returns_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["info", "--driver-root", str(tmp_path / "missing")]) == 1
    assert "missing" in capsys.readouterr().err
    assert os.path.exists(str(tmp_path))


def test_pynvml_is_imported_without_ctypes_util_until_find_library_is_called() -> None:
    """discover/nvml.import_pynvml: pynvml's unused `ctypes.util` import (subprocess, tempfile, shutil) is not
    paid at import; its `find_library`, when called, is the real one's answer, and the real module is what any
    later import gets."""
    code = (
        "import sys\n"
        "from gpuhook.discover.nvml import import_pynvml\n"
        "pynvml = import_pynvml()\n"
        "left = sorted(m for m in ('ctypes.util', 'subprocess', 'tempfile', 'shutil') if m in sys.modules)\n"
        "found = pynvml.find_library('c')\n"
        "import ctypes.util\n"
        "print(left, found == ctypes.util.find_library('c') and found is not None, hasattr(ctypes.util, 'test'),\n"
        "      import_pynvml() is pynvml)\n"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "True", "True", "True"]


def test_nvml_queried_in_a_child_brings_back_its_error_or_says_it_died(tmp_path: Path) -> None:
    """discover/nvml.Child's query: the child's DiscoveryError comes back as one, with its words; a child that
    exits without answering (a library whose constructor ends the process) is one line naming the library."""
    from gpuhook.discover import nvml

    missing = tmp_path / "libnvidia-ml.so.1"
    with pytest.raises(DiscoveryError) as failed:
        nvml.Child().query(str(missing))()
    assert str(missing) in str(failed.value)
    source = tmp_path / "exits.c"
    source.write_text("#include <unistd.h>\n__attribute__((constructor)) static void end(void) { _exit(0); }\n")
    library = tmp_path / "libexits.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    with pytest.raises(DiscoveryError, match=f"^NVML query of {library} died without an answer$"):
        nvml.Child().query(str(library))()


def test_a_cold_generate_forks_nvml_s_child_before_the_scan_and_the_spec_modules_load(fake_driver: Any,
                                                                                         tmp_path: Path) -> None:
    """A cold `generate-cdi` (no inventory cache) forks NVML's child before the scan's modules, the spec's and
    `re` load, so pynvml's import there overlaps them (cli/inventory.load_inventory, its `meanwhile`); the nvml
    module itself loads neither ctypes nor threading. The child forked ahead is the one asked: one fork, and
    the spec's GPUs come from NVML."""
    out = tmp_path / "spec.yaml"
    argv = ["generate-cdi", "--driver-root", str(fake_driver.root), "--proc-root",
            str(Path(fake_driver.root) / "proc"), "--hook-path", "/usr/local/bin/gpuhook-hook", "--output", str(out),
            "--inventory-cache", ""]
    code = (
        "import os, sys\n"
        "import gpuhook.discover.nvml\n"
        "light = [m for m in ('ctypes', 'threading') if m in sys.modules]\n"
        "seen = []\n"
        "fork = os.fork\n"
        "def recording():\n"
        "    seen.append([m for m in ('gpuhook.discover.scan', 'gpuhook.cdi.spec', 're') if m in sys.modules])\n"
        "    return fork()\n"
        "os.fork = recording\n"
        "import gpuhook.cli.generate as generate\n"
        "make, sources = generate.renderer, []\n"
        "def recording_renderer(*args):\n"
        "    render = make(*args)\n"
        "    return lambda inv, devices=None: sources.append(inv.source) or render(inv, devices)\n"
        "generate.renderer = recording_renderer\n"
        "from gpuhook.cli import main\n"
        f"code = main({argv!r})\n"
        "print(code, light, seen, sources)\n"
    )
    env = {**os.environ, "GPUHOOK_CONFIG": "/nonexistent/config.toml",
           "GPUHOOK_SERVICE_SOCKET": str(tmp_path / "none" / "service.sock")}
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=False, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0 [] [[]] ['nvml']", result.stdout
    spec = out.read_text()
    assert all(f"- name: {gpu.uuid}" in spec for gpu in fake_driver.gpus), spec[:2000]


def test_a_forked_ahead_nvml_child_not_needed_is_ended(fake_driver: Any) -> None:
    """NVML's child forked ahead and not asked (a procfs discovery; a discovery that fails on its way) is
    ended and reaped by discover: no process of it is left."""
    from gpuhook.discover import nvml

    for method, raises in (("procfs", False), ("magic", True)):
        child = nvml.Child()
        if raises:
            with pytest.raises(DiscoveryError):
                discover(roots(fake_driver), method=method, nvml_child=child)
        else:
            assert discover(roots(fake_driver), method=method, nvml_child=child).source == "procfs"
        with pytest.raises(ChildProcessError):
            os.waitpid(child.pid, os.WNOHANG)


def test_files_scanned_beside_nvml_for_another_version_are_scanned_again(fake_driver_factory: Any) -> None:
    """The driver's files are scanned for the version libnvidia-ml.so.1's file name carries while NVML is asked
    (scan._files_beside); where NVML reports another version, they are scanned again for that one: here the
    library's file says 999.9.9, NVML the fake's version, and the inventory holds the fake's version's files."""
    fake = fake_driver_factory(gpus=1, fresh=True)
    lib_dir = Path(fake.root) / catalogue.LIB_DIR.lstrip("/")
    real = lib_dir / f"libnvidia-ml.so.{fake.driver_version}"
    real.rename(lib_dir / "libnvidia-ml.so.999.9.9")
    (lib_dir / "libnvidia-ml.so.1").unlink()
    (lib_dir / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.999.9.9")
    data = info_json(fake)
    assert data["source"] == "nvml" and data["driver_version"] == fake.driver_version
    libs = {f["path"].rsplit("/", 1)[1] for f in data["files"] if f["kind"] == "lib"}
    others = {lib.path.rsplit("/", 1)[1] for lib in fake.others if lib.path.startswith(catalogue.LIB_DIR)}
    wanted = {spec.file_name(fake.driver_version) for spec in catalogue.LIBRARIES} | others
    assert libs == wanted - {real.name} and f"libcuda.so.{fake.driver_version}" in libs  # 999.9.9's file: not its


def test_version_in_a_library_name() -> None:
    from gpuhook.discover.nvml import version_in_name

    assert version_in_name("/r/usr/lib/libnvidia-ml.so.550.54.15") == "550.54.15"
    assert [version_in_name(p) for p in ("/libnvidia-ml.so.1", "libnvidia-ml.so.5x.1", "libcuda.so.550.54",
                                         "libnvidia-ml.so.", "libnvidia-ml.so.550.")] == [None] * 5


def test_mig_access_file_read_ahead_changes_no_outcome(fake_driver_factory: Any) -> None:
    """The MIG capability nodes are read while NVML's child answers (scan._mig_cap_nodes): a cap file of a MIG
    device that is no longer reported is never asked for, and one that does not parse still fails the
    discovery in one line naming it, as when it was read after the report."""
    fake = fake_driver_factory(gpus=2, mig={0: ["1g.10gb", "2g.20gb"], 1: ["7g.80gb"]}, fresh=True)
    stray = Path(fake.host_path("/proc/driver/nvidia/capabilities/gpu9/mig/gi3/ci0"))
    stray.mkdir(parents=True)  # a GPU NVML does not report: its unreadable files are no one's business
    (stray / "access").write_text("garbage\n")
    (stray.parent / "access").write_text("garbage\n")
    inv = discover(roots(fake))
    assert [sorted(n.minor for n in m.cap_nodes) for g in inv.gpus for m in g.mig_devices] == [
        sorted([m.gi_cap_minor, m.ci_cap_minor]) for g in fake.gpus for m in g.mig_devices]
    bad = fake.gpus[1].mig_devices[0].ci_access
    Path(fake.host_path(bad)).write_text("DeviceFileMinor: nine\n")
    with pytest.raises(DiscoveryError, match="no valid 'DeviceFileMinor'") as caught:
        discover(roots(fake))
    assert bad.removeprefix("/proc/") in str(caught.value)
