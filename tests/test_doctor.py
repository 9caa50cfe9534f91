"""`gpuhook doctor` on simulated drivers: a healthy host, stale specs (driver version, GPU set, MIG layout),
missing and mis-moded nodes, runtime configurations, and every reason a container gets nothing."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from support.fakefix import FAKE_MIG_LAYOUT

from gpuhook.cdi.registry import scan
from gpuhook.cli.app import cli
from gpuhook.doctor import runtimes as rt
from gpuhook.doctor.model import INFO, OK, PROBLEM, WARN
from gpuhook.doctor.specs import SpecStatus

HOOK = str(Path(sys.executable).with_name("gpuhook"))


def roots(fake: Any) -> list[str]:
    return ["--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc")]


def doctor(*args: str) -> tuple[Result, dict[str, Any]]:
    """Run `gpuhook doctor … --json` (no runtime unless asked) and return the result and the parsed report."""
    argv = ["doctor", *args, "--json"]
    if "--runtime" not in args:
        argv += ["--runtime", "none"]
    result = CliRunner().invoke(cli, argv, catch_exceptions=False)
    return result, json.loads(result.output)


def messages(report: dict[str, Any], status: str | None = None, section: str | None = None) -> list[str]:
    return [f["message"] for f in report["findings"]
            if (status is None or f["status"] == status) and (section is None or f["section"] == section)]


def problems(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["status"] == PROBLEM]


def generate(fake: Any, out: Path, *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "gpuhook.cli", "generate-cdi", *roots(fake), "--hook-path", HOOK,
                    "--output", str(out), *extra], check=True, capture_output=True, text=True)


def config_file(tmp: Path, **values: Any) -> Path:
    path = tmp / "config.toml"
    path.write_text("".join(f"{k.replace('_', '-')} = {json.dumps(v)}\n" for k, v in values.items()))
    return path


# --- the host --------------------------------------------------------------------------------------------------


def test_healthy_host(fake_driver: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A healthy set-up is judged healthy whatever else runs on the machine: the test points the service check at
    its own socket (none listens there), and a `gpuhook service` of somebody else's, named as one listening
    elsewhere, is the only warning it may see."""
    own_socket = tmp_path / "service.sock"
    monkeypatch.setenv("GPUHOOK_SERVICE_SOCKET", str(own_socket))
    generate(fake_driver, tmp_path / "cdi" / "nvidia.yaml")
    result, report = doctor(*roots(fake_driver), "--spec-dir", str(tmp_path / "cdi"), "--runtime", "podman")
    assert result.exit_code == 0, result.output
    ours = [f for f in report["findings"] if f["section"] != "service"]
    assert [f for f in ours if f["status"] in (PROBLEM, WARN)] == [] and report["problems"] == 0
    service = [f for f in report["findings"] if f["section"] == "service"]
    assert service[0]["status"] == INFO and f"no gpuhook service at {own_socket}" in service[0]["message"]
    elsewhere = service[1:]
    assert all(f["status"] == WARN and "listens at" in f["message"] and str(own_socket) not in
               f["message"].split(" but ")[0] for f in elsewhere), elsewhere
    assert report["warnings"] == len(elsewhere)
    assert any("driver 550.54.15 (CUDA 12.4) found through NVML: 2 GPU(s)" in m for m in messages(report, OK))
    assert any("device nodes present" in m for m in messages(report, OK))
    assert any("current" in m for m in messages(report, OK, "cdi"))
    assert any(m.startswith("podman") and "nvidia.com/gpu" in m for m in messages(report, OK, "runtimes"))
    text = CliRunner().invoke(cli, ["doctor", *roots(fake_driver), "--spec-dir", str(tmp_path / "cdi"),
                                    "--runtime", "none"])
    assert text.exit_code == 0
    assert text.output.splitlines()[-1] == (f"0 problem(s), {len(elsewhere)} warning(s)" if elsewhere else
                                            "no problems found")


def test_docker_managed_and_other_users_daemons_are_not_judged(fake_daemon: Any, tmp_path: Path) -> None:
    """Docker's own containerd (its config under dockerd's exec root) and another user's daemon start no
    container of this host's runtime set-up: named, never a PROBLEM; a daemon of our own still is checked."""
    from gpuhook.doctor.daemons import Daemon, running_daemons

    managed = fake_daemon("containerd", "--config", "/var/run/docker/containerd/containerd.toml")
    (found,) = [d for d in running_daemons() if d.pid == managed.pid]
    assert found.managed_by == "docker"
    p = paths(tmp_path)
    status = spec_status(tmp_path / "cdi")
    other = Daemon("containerd", 4242, "/home/u/.config/containerd/config.toml", uid=1000)
    for daemons in ([found], [other], [found, other]):
        out = rt.check_runtimes(["containerd"], status, p, {"containerd": (1, 6, 20)}, daemons)
        assert statuses(out) == [INFO] * len(daemons), out
    assert "Docker's own, started by dockerd" in rt.check_runtimes(
        ["containerd"], status, p, {"containerd": (1, 6, 20)}, [found])[0].message
    assert "runs as uid 1000: another user's daemon" in rt.check_runtimes(
        ["containerd"], status, p, {"containerd": (1, 6, 20)}, [other])[0].message
    ours = Daemon("containerd", 4343, p.containerd_config)
    out = rt.check_runtimes(["containerd"], status, p, {"containerd": (1, 6, 20)}, [found, ours])
    assert statuses(out) == [INFO, INFO, PROBLEM]


def test_hook_config_gives_the_roots(fake_driver: Any, tmp_path: Path) -> None:
    config = config_file(tmp_path, driver_root=str(fake_driver.root), proc_root=str(fake_driver.root / "proc"))
    result, report = doctor("--config", str(config), "--spec-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert any("found through NVML: 2 GPU(s)" in m for m in messages(report, OK))


def test_no_driver(tmp_path: Path) -> None:
    result, report = doctor("--driver-root", str(tmp_path / "nowhere"), "--proc-root", str(tmp_path),
                            "--spec-dir", str(tmp_path))
    assert result.exit_code == 1
    (problem,) = problems(report)
    assert "no usable NVIDIA driver" in problem["message"] and "--driver-root" in problem["fix"]


def test_no_driver_installed_is_said_so(tmp_path: Path) -> None:
    """Without libraries, a loaded module or one on disk, no modprobe can help: doctor says nothing is installed;
    with the module on disk for the running kernel, loading it is the fix."""
    (tmp_path / "proc").mkdir()
    args = ("--driver-root", str(tmp_path), "--proc-root", str(tmp_path / "proc"), "--spec-dir", str(tmp_path))
    result, report = doctor(*args)
    (problem,) = problems(report)
    assert problem["message"].startswith("no NVIDIA driver is installed on this host"), problem
    assert "modprobe" not in problem["fix"] and problem["fix"].startswith("install the NVIDIA driver")
    module = tmp_path / "lib/modules" / os.uname().release / "updates/dkms/nvidia.ko.xz"
    module.parent.mkdir(parents=True)
    module.write_bytes(b"")
    result, report = doctor(*args)
    (problem,) = problems(report)
    assert "no usable NVIDIA driver" in problem["message"] and problem["fix"] == "modprobe nvidia"


def test_missing_node_then_the_fix(fake_driver_factory: Any, tmp_path: Path) -> None:
    fake = fake_driver_factory(gpus=2, fresh=True)
    node = fake.host_path("/dev/nvidia1")
    os.unlink(node)
    result, report = doctor(*roots(fake), "--spec-dir", str(tmp_path))
    assert result.exit_code == 1
    (problem,) = problems(report)
    assert problem["message"].startswith(f"{node} is missing (GPU 0000:2a:00.0, {fake.gpus[1].uuid})")
    assert problem["fix"] == f"mknod -m 666 {node} c 195 1"
    subprocess.run(shlex.split(problem["fix"]), check=True)
    result, report = doctor(*roots(fake), "--spec-dir", str(tmp_path))
    assert result.exit_code == 0, result.output


def test_node_permissions_and_missing_uvm(fake_driver_factory: Any, tmp_path: Path) -> None:
    fake = fake_driver_factory(gpus=1, fresh=True)
    os.chmod(fake.host_path("/dev/nvidia0"), 0o600)
    os.unlink(fake.host_path("/dev/nvidia-uvm"))
    result, report = doctor(*roots(fake), "--spec-dir", str(tmp_path))
    assert result.exit_code == 1
    warn = next(f for f in report["findings"] if f["status"] == WARN)
    assert "has mode 0600" in warn["message"] and warn["fix"] == f"chmod 0666 {fake.host_path('/dev/nvidia0')}"
    (problem,) = problems(report)
    assert "nvidia-uvm is missing" in problem["message"]
    assert problem["fix"] == f"mknod -m 666 {fake.host_path('/dev/nvidia-uvm')} c 508 0"  # major from /proc/devices


def test_missing_mig_cap_node(fake_driver_factory: Any, tmp_path: Path) -> None:
    fake = fake_driver_factory(gpus=2, mig={1: ["1g.10gb"]}, fresh=True)
    cap = fake.mig_devices[0].cap_nodes[1]
    os.unlink(fake.host_path(cap))
    result, report = doctor(*roots(fake), "--spec-dir", str(tmp_path))
    assert result.exit_code == 1
    (problem,) = problems(report)
    assert "MIG device 1:0" in problem["message"] and problem["fix"].startswith(f"mknod -m 444 {fake.host_path(cap)}")


def test_nvml_failing_is_a_warning(fake_driver: Any, tmp_path: Path) -> None:
    fake_driver.set_fail_init()
    result, report = doctor(*roots(fake_driver), "--spec-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert any("NVML unavailable" in m for m in messages(report, WARN))
    assert any("found through /proc/driver/nvidia: 2 GPU(s)" in m for m in messages(report, OK))


def test_modify_device_files_is_reported(fake_driver: Any, tmp_path: Path) -> None:
    _, report = doctor(*roots(fake_driver), "--spec-dir", str(tmp_path))
    assert any(m.startswith("ModifyDeviceFiles: 1") for m in messages(report, section="host"))


# --- CDI specs ---------------------------------------------------------------------------------------------------


def test_stale_spec_after_a_driver_upgrade(fake_driver: Any, fake_driver_factory: Any, tmp_path: Path) -> None:
    """The spec was made for 550.54.15; the host now runs 535.129.03 (a second fake, same GPUs)."""
    spec = tmp_path / "cdi" / "nvidia.yaml"
    generate(fake_driver, spec)
    upgraded = fake_driver_factory(gpus=2, driver_version="535.129.03", cuda_version="12.2")
    result, report = doctor(*roots(upgraded), "--spec-dir", str(spec.parent), "--runtime", "podman")
    assert result.exit_code == 1
    stale = next(f for f in problems(report) if f["section"] == "cdi")
    assert "made for driver 550.54.15, the driver is 535.129.03" in stale["message"]
    assert stale["fix"] == f"gpuhook generate-cdi {' '.join(roots(upgraded))} --output {spec}"
    assert any(m.startswith("podman") and "stale" in m for m in messages(report, WARN, "runtimes"))
    subprocess.run([sys.executable, "-m", "gpuhook.cli", *shlex.split(stale["fix"])[1:], "--hook-path", HOOK],
                   check=True, capture_output=True)
    result, report = doctor(*roots(upgraded), "--spec-dir", str(spec.parent), "--runtime", "podman")
    assert result.exit_code == 0, result.output


def test_stale_spec_after_a_gpu_left(fake_driver: Any, fake_driver_factory: Any, tmp_path: Path) -> None:
    generate(fake_driver, tmp_path / "nvidia.yaml")
    one = fake_driver_factory(gpus=1)
    result, report = doctor(*roots(one), "--spec-dir", str(tmp_path))
    assert result.exit_code == 1
    (stale,) = problems(report)
    assert "names device '1', which this host does not have" in stale["message"]
    assert f"names device {fake_driver.gpus[1].uuid!r}" in stale["message"]


def test_stale_spec_after_a_mig_change(fake_driver_factory: Any, tmp_path: Path) -> None:
    before = fake_driver_factory(gpus=4, mig=FAKE_MIG_LAYOUT)
    generate(before, tmp_path / "nvidia.json")
    after = fake_driver_factory(gpus=4, mig={1: ["3g.40gb"], 2: ["1g.10gb"]})
    result, report = doctor(*roots(after), "--spec-dir", str(tmp_path))
    assert result.exit_code == 1
    (stale,) = problems(report)
    message = stale["message"]
    assert "names device '1:1', which this host does not have" in message
    assert "device '1:0': nodes" in message and "differ from the host's" in message
    assert "in MIG mode now" in message  # GPU 2 was named as a whole GPU
    assert "does not name MIG device 2:0" in message
    assert stale["fix"].endswith(f"--output {tmp_path / 'nvidia.json'}")


def test_spec_that_does_not_load_and_conflicts(fake_driver: Any, tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\nbogus: 1\n")
    generate(fake_driver, tmp_path / "a.yaml")
    generate(fake_driver, tmp_path / "b.yaml")
    result, report = doctor(*roots(fake_driver), "--spec-dir", str(tmp_path))
    assert result.exit_code == 1
    found = [f["message"] for f in problems(report)]
    assert any(m.startswith(f"{tmp_path / 'broken.yaml'} does not load") for m in found)
    (clash,) = [m for m in found if m.startswith("CDI name clash: ")]  # one line for the pair, not per name
    assert "nvidia.com/gpu=0" in clash and "resolves none of these" in clash


def test_shadowed_stale_spec_is_a_warning(fake_driver: Any, fake_driver_factory: Any, tmp_path: Path) -> None:
    old, new = tmp_path / "etc", tmp_path / "run"
    generate(fake_driver_factory(gpus=2, driver_version="535.129.03", cuda_version="12.2"), old / "nvidia.yaml")
    generate(fake_driver, new / "nvidia.com-gpu.yaml")
    result, report = doctor(*roots(fake_driver), "--spec-dir", str(old), "--spec-dir", str(new))
    assert result.exit_code == 0, result.output
    assert any("shadowed" in m for m in messages(report, WARN, "cdi"))


# --- one container: what it gets, or why nothing -------------------------------------------------------------------


def explain(fake: Any, tmp: Path, *args: str) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
    result, report = doctor(*roots(fake), "--spec-dir", str(tmp), *args)
    steps = [f for f in report["findings"] if f["section"] == "container"]
    return result.exit_code, report["container"], steps


def test_explains_an_injection(fake_driver: Any, tmp_path: Path) -> None:
    code, summary, steps = explain(fake_driver, tmp_path, "--env", "NVIDIA_VISIBLE_DEVICES=1",
                                   "--env", "NVIDIA_REQUIRE_CUDA=cuda>=12.0")
    assert code == 0
    assert summary["outcome"] == "inject"
    assert [n["path"] for n in summary["edits"]["device_nodes"]] == [
        "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    text = [s["message"] for s in steps]
    assert text[1] == "2. request: 1 (from NVIDIA_VISIBLE_DEVICES)"
    assert text[2].startswith(f"3. devices: GPU 1 ({fake_driver.gpus[1].uuid}")
    assert text[3] == "4. capabilities: compute, utility (default)"
    assert text[4].startswith("5. requirement 'cuda>=12.0' is met")
    assert text[5].startswith("6. gpuhook would inject 4 device node(s)")


@pytest.mark.parametrize(("args", "config", "status", "words", "fix"), [
    ([], {}, PROBLEM, "no GPU: NVIDIA_VISIBLE_DEVICES is unset", "NVIDIA_VISIBLE_DEVICES=all"),
    (["--env", "NVIDIA_VISIBLE_DEVICES=void"], {}, PROBLEM, "is void, which means 'leave this container untouched'",
     "NVIDIA_VISIBLE_DEVICES=all"),
    (["--env", "NVIDIA_VISIBLE_DEVICES="], {}, PROBLEM, "is empty", "NVIDIA_VISIBLE_DEVICES=all"),
    (["--env", "NVIDIA_VISIBLE_DEVICES=all"], {"accept_envvar_unprivileged": False}, PROBLEM,
     "ignored: unprivileged container and accept-envvar-unprivileged is false", "set accept-envvar-unprivileged"),
    (["--env", "NVIDIA_VISIBLE_DEVICES=7"], {}, PROBLEM, "the start would fail: unknown device '7' requested",
     "NVIDIA_VISIBLE_DEVICES=<comma list of: 0, GPU-"),
    (["--env", "NVIDIA_VISIBLE_DEVICES=0", "--env", "NVIDIA_REQUIRE_ARCH=arch>=10.0"], {}, PROBLEM,
     "unsatisfied requirement 'arch>=10.0': no term holds with cuda 12.4, driver 550.54.15, arch 9.0, brand nvidia",
     "NVIDIA_DISABLE_REQUIRE=true"),
    (["--env", "NVIDIA_VISIBLE_DEVICES=0", "--env", "NVIDIA_DRIVER_CAPABILITIES=compute,warp"], {}, PROBLEM,
     "unknown driver capability 'warp'", "NVIDIA_DRIVER_CAPABILITIES"),
    (["--env", "NVIDIA_VISIBLE_DEVICES=0", "--env", "NVIDIA_MIG_CONFIG_DEVICES=all"], {}, PROBLEM,
     "requires a privileged container", "CAP_SYS_ADMIN"),
])  # fmt: skip
def test_why_nothing(fake_driver: Any, tmp_path: Path, args: list[str], config: dict[str, Any], status: str,
                     words: str, fix: str) -> None:
    if not args:
        args = ["--env", "PATH=/bin"]
    path = config_file(tmp_path, **config)
    code, summary, steps = explain(fake_driver, tmp_path, "--config", str(path), *args)
    assert code == 1
    last = steps[-1]
    assert last["status"] == status and words in last["message"], last
    assert fix in last["fix"]
    assert summary["outcome"] in ("nothing", "fail")


def test_policy_still_honours_a_device_mount(fake_driver: Any, tmp_path: Path) -> None:
    path = config_file(tmp_path, accept_envvar_unprivileged=False, accept_volume_mounts=True)
    code, summary, steps = explain(fake_driver, tmp_path, "--config", str(path), "--env",
                                   "NVIDIA_VISIBLE_DEVICES=all", "--device-mount", "1")
    assert code == 0
    assert "device volume mounts" in steps[1]["message"]
    assert summary["devices"] == [f"GPU 1 ({fake_driver.gpus[1].uuid}, {fake_driver.gpus[1].pci_bus_id})"]


def test_legacy_cuda_image_and_disabled_requirements(fake_driver: Any, tmp_path: Path) -> None:
    code, summary, steps = explain(fake_driver, tmp_path, "--env", "CUDA_VERSION=12.2.0")
    assert code == 0 and summary["request"]["kind"] == "all"
    assert "legacy CUDA image" in steps[1]["message"]
    assert any("requirement 'cuda>=12.2' is met" in s["message"] for s in steps)
    code, _, steps = explain(fake_driver, tmp_path, "--env", "NVIDIA_VISIBLE_DEVICES=0",
                             "--env", "NVIDIA_REQUIRE_CUDA=cuda>=99", "--env", "NVIDIA_DISABLE_REQUIRE=1")
    assert code == 0 and any("not checked (NVIDIA_DISABLE_REQUIRE)" in s["message"] for s in steps)


def test_doctor_says_which_term_decided(fake_driver: Any, tmp_path: Path) -> None:
    """A CUDA image's forward-compatibility term (brand=nvidia,driver>=550,...) is what lets it start on a CUDA
    12.4 host: doctor names that term, the host values, and the rule itself."""
    req = "cuda>=12.6 brand=tesla,driver>=550,driver<551 brand=nvidia,driver>=550,driver<551"
    code, _, steps = explain(fake_driver, tmp_path, "--env", "NVIDIA_VISIBLE_DEVICES=0",
                             "--env", f"NVIDIA_REQUIRE_CUDA={req}")
    assert code == 0
    met = next(s for s in steps if "is met" in s["message"])
    assert "term 3 of 3 'brand=nvidia,driver>=550,driver<551' holds on GPU 0 (cuda 12.4, driver 550.54.15" in (
        met["message"])
    assert "space-separated terms are alternatives (OR)" in met["detail"][0]


def test_mig_all_is_explained(fake_driver_mig: Any, tmp_path: Path) -> None:
    code, summary, steps = explain(fake_driver_mig, tmp_path, "--env", "NVIDIA_VISIBLE_DEVICES=all")
    assert code == 0
    assert "GPU 1 is in MIG mode, so it contributes its MIG devices 1:0, 1:1, 1:2" in steps[2]["detail"][0]
    assert len(summary["devices"]) == 6


def write_bundle(tmp: Path, env: list[str], devices: list[dict[str, Any]] | None = None) -> Path:
    bundle = tmp / "bundle"
    bundle.mkdir()
    config = {"process": {"env": env, "capabilities": {"bounding": ["CAP_KILL"]}}, "root": {"path": "rootfs"},
              "linux": {"devices": devices or []}}
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def test_bundle(fake_driver: Any, tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility"])
    code, summary, steps = explain(fake_driver, tmp_path, "--bundle", str(bundle))
    assert code == 0 and summary["origin"] == f"bundle {bundle}"
    assert steps[0]["message"].endswith("; unprivileged")
    assert [n["path"] for n in summary["edits"]["device_nodes"]] == ["/dev/nvidia0", "/dev/nvidiactl"]


def test_bundle_already_edited_by_cdi(fake_driver: Any, tmp_path: Path) -> None:
    node = {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}
    bundle = write_bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=void"], [node])
    code, summary, steps = explain(fake_driver, tmp_path, "--bundle", str(bundle))
    assert code == 0 and summary["outcome"] == "applied"
    assert "already has /dev/nvidia0" in steps[-1]["message"]


def test_bundle_and_env_are_exclusive(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["doctor", "--bundle", str(tmp_path), "--env", "A=1"])
    assert result.exit_code == 2 and "exclusive" in result.output


# --- runtime configurations (no runtime needs to be installed: paths and versions are given) -----------------------

SPEC = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]}


def spec_status(folder: Path, cdi_version: str = "0.5.0", current: bool = True) -> SpecStatus:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nvidia.json"
    path.write_text(json.dumps({**SPEC, "cdiVersion": cdi_version}))
    status = SpecStatus(scan([str(folder)]))
    status.loaded[str(path)] = {**SPEC, "cdiVersion": cdi_version}
    if current:
        status.current.add(str(path))
    return status


def paths(tmp: Path, **kw: Any) -> rt.Paths:
    kw.setdefault("docker_path", (str(tmp / "bin"),))
    return rt.Paths(containerd_config=str(tmp / "containerd/config.toml"), crio_config=str(tmp / "crio/crio.conf"),
                    docker_config=str(tmp / "docker/daemon.json"),
                    podman_configs=(str(tmp / "podman/vendor.conf"), str(tmp / "podman/containers.conf")),
                    hooks_dirs=(str(tmp / "hooks.d"),), spec_dirs=(str(tmp / "cdi"),), **kw)


def statuses(findings: list[Any]) -> list[str]:
    return [f.status for f in findings]


def configure(runtime: str, mode: str, config: Path, *extra: str) -> None:
    result = CliRunner().invoke(cli, ["runtime", "configure", "--runtime", runtime, "--mode", mode,
                                      "--config", str(config), *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_docker_without_anything_then_configured(tmp_path: Path) -> None:
    p = paths(tmp_path)
    status = spec_status(tmp_path / "cdi")
    (problem,) = rt.check_docker((24, 0, 5), p, status)
    # the fix names the config checked (here not the default one), and runs as it is
    assert problem.status == PROBLEM
    assert problem.fix == f"gpuhook runtime configure --runtime docker --config {p.docker_config} --mode hook"
    result = CliRunner().invoke(cli, shlex.split(problem.fix)[1:], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    found = rt.check_docker((24, 0, 5), p, status)
    assert statuses(found) == [OK] and "runtime 'gpuhook'" in found[0].message
    other = paths(tmp_path / "other")
    (problem,) = rt.check_docker((25, 0), other, status)
    assert problem.fix == f"gpuhook runtime configure --runtime docker --config {other.docker_config} --mode cdi"
    assert rt.Paths().configure("docker", "cdi") == "gpuhook runtime configure --runtime docker --mode cdi"
    configure("docker", "cdi", Path(paths(tmp_path / "other").docker_config))
    found = rt.check_docker((25, 0), paths(tmp_path / "other"), spec_status(tmp_path / "other" / "cdi"))
    assert statuses(found) == [OK] and "CDI devices" in found[0].message


def test_docker_gpus_route_and_nvidias_toolkit(tmp_path: Path) -> None:
    """gpuhook's nvidia-container-runtime-hook on dockerd's PATH is a configured --gpus route (no false
    PROBLEM); NVIDIA's own hook, runtime or default-runtime is named, so doctor says which one a container gets."""
    from gpuhook.cli.entry import install

    p = paths(tmp_path)
    status = spec_status(tmp_path / "cdi")
    install(str(tmp_path / "bin" / "gpuhook-hook"), docker_gpus=True)
    found = rt.check_docker((20, 10, 24), p, status)
    assert statuses(found) == [OK] and "`docker run --gpus` runs gpuhook" in found[0].message
    nvidia = tmp_path / "nvbin" / "nvidia-container-runtime-hook"
    nvidia.parent.mkdir()
    nvidia.write_text("#!/bin/sh\nexit 0\n")
    nvidia.chmod(0o755)
    daemon = Path(p.docker_config)
    daemon.parent.mkdir(parents=True)
    daemon.write_text(json.dumps({"default-runtime": "nvidia",
                                  "runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}}}))
    found = rt.check_docker((20, 10, 24), paths(tmp_path, docker_path=(str(nvidia.parent), str(tmp_path / "bin"))),
                            status)
    assert statuses(found) == [INFO, WARN, PROBLEM]
    assert "runs NVIDIA's " + str(nvidia) in found[0].message
    assert "every container runs NVIDIA's nvidia-container-runtime (default-runtime 'nvidia')" in found[1].message


def test_containerd_1_6_and_1_7(tmp_path: Path) -> None:
    p = paths(tmp_path)
    status = spec_status(tmp_path / "cdi")
    (problem,) = rt.check_containerd((1, 6, 20), p, status)
    assert problem.fix == f"gpuhook runtime configure --runtime containerd --config {p.containerd_config} --mode hook"
    config = Path(p.containerd_config)
    config.parent.mkdir(parents=True)
    config.write_text("version = 2\n")
    (config.parent / "gpuhook-base-spec.json").write_text("{}")  # what `ctr oci spec` would have made
    configure("containerd", "hook", config)
    assert statuses(rt.check_containerd((1, 6, 20), p, status)) == [OK]
    other = paths(tmp_path / "b")
    (problem,) = [f for f in rt.check_containerd((1, 7, 2), other, status) if f.status == PROBLEM]
    assert problem.fix == (f"gpuhook runtime configure --runtime containerd --config {other.containerd_config} "
                           "--mode cdi")
    configure("containerd", "cdi", Path(other.containerd_config))
    text = Path(other.containerd_config).read_text()  # it lists /etc/cdi and /var/run/cdi: point it at ours
    Path(other.containerd_config).write_text(text.replace('"/etc/cdi"', f'"{tmp_path / "b" / "cdi"}"'))
    found = rt.check_containerd((1, 7, 2), other, spec_status(tmp_path / "b" / "cdi"))
    assert statuses(found) == [OK]


def test_a_recorded_runtime_that_ignored_cdi_devices_is_one_warning(tmp_path: Path, fake_driver: Any) -> None:
    """The hook's or shim's record (hook/cdiignored.py), as the device plugin says it; none without one."""
    from gpuhook.fileio.secret import ensure_secret
    from gpuhook.hook.cdiignored import record as hook_record
    from gpuhook.model.cdiignored import seal
    from gpuhook.model.contract import PLUGIN_KEY

    def record(state: str, container: str, names: tuple[str, ...]) -> None:  # as the plugin seals its marker
        os.makedirs(state, exist_ok=True)  # the plugin's folder, where its key is made
        hook_record(state, container, names, seal(ensure_secret(os.path.join(state, PLUGIN_KEY)), ",".join(names)))

    state = tmp_path / "state"
    config = config_file(tmp_path, state_dir=str(state))
    _, report = doctor(*roots(fake_driver), "--spec-dir", str(tmp_path / "cdi"), "--config", str(config))
    assert not [m for m in messages(report, WARN) if "ignored the CDI devices" in m]
    record(str(state), "c-ctr", ("nvidia.com/gpu=1",))
    _, report = doctor(*roots(fake_driver), "--spec-dir", str(tmp_path / "cdi"), "--config", str(config))
    (finding,) = [f for f in report["findings"] if "ignored the CDI devices" in f["message"]]
    assert (finding["section"], finding["status"]) == ("runtimes", WARN)
    assert finding["message"].startswith("the container runtime ignored the CDI devices of container c-ctr "
                                         "(nvidia.com/gpu=1) at ")
    assert finding["fix"] == f"once the runtime applies CDI devices: rm {state / 'cdi-ignored'}"
    (state / "cdi-ignored").rename(tmp_path / "moved")
    (state / "cdi-ignored").symlink_to(tmp_path / "moved")  # not read through a link
    assert rt.check_cdi_ignored(str(state)) == [] and rt.check_cdi_ignored("") == []


def test_containerd_binary_name_shim(tmp_path: Path) -> None:
    p = paths(tmp_path)
    config = Path(p.containerd_config)
    config.parent.mkdir(parents=True)
    shim = Path(sys.executable).with_name("gpuhook-runtime")
    table = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
    config.write_text(f'version = 2\n{table}BinaryName = "{shim}"\n')
    found = rt.check_containerd((1, 6, 20), p, spec_status(tmp_path / "cdi"))
    assert statuses(found) == [OK] and "the shim applies the edits" in found[0].message
    config.write_text(f'version = 2\n{table}BinaryName = "/nope/gpuhook-runtime"\n')
    found = rt.check_containerd((1, 6, 20), p, spec_status(tmp_path / "cdi"))
    assert statuses(found) == [PROBLEM, PROBLEM] and "every container fails" in found[0].message


def test_podman_cdi_version_limit_and_hooks(tmp_path: Path) -> None:
    p = paths(tmp_path)
    found = rt.check_podman((4, 3, 1), p, spec_status(tmp_path / "cdi", "0.6.0"))
    assert statuses(found) == [PROBLEM, PROBLEM]
    assert "claims cdiVersion 0.6.0, podman 4.3.1 reads at most 0.5.0" in found[0].message
    assert statuses(rt.check_podman((4, 9, 0), p, spec_status(tmp_path / "cdi", "0.6.0"))) == [OK]
    hooks = tmp_path / "hooks.d"
    hooks.mkdir()
    (hooks / "gpuhook.json").write_text(json.dumps({"version": "1.0.0", "hook": {"path": "/nope/gpuhook-hook"},
                                                    "when": {"always": True}, "stages": ["prestart"]}))
    empty = spec_status(tmp_path / "none", current=False)
    found = rt.check_podman((4, 3, 1), paths(tmp_path, generate_flags=" --driver-root /x"), empty)
    assert "runs /nope/gpuhook-hook, which does not exist" in found[0].message
    assert found[-1].fix == f"gpuhook generate-cdi --driver-root /x --output {tmp_path / 'cdi'}/nvidia.yaml"


def test_crio_hooks_dir(tmp_path: Path) -> None:
    p = paths(tmp_path)
    hooks = tmp_path / "myhooks"
    hooks.mkdir()
    hook = Path(sys.executable).with_name("gpuhook-hook")
    (hooks / "gpuhook.json").write_text(json.dumps({"hook": {"path": str(hook)}}))
    conf = Path(p.crio_config)
    (conf.parent / "crio.conf.d").mkdir(parents=True)
    (conf.parent / "crio.conf.d" / "99-gpuhook.conf").write_text(f'[crio.runtime]\nhooks_dir = ["{hooks}"]\n')
    found = rt.check_crio((1, 28, 0), p, spec_status(tmp_path / "nothing", current=False))
    assert OK in statuses(found) and PROBLEM not in statuses(found)


def test_parse_version() -> None:
    assert rt.parse_version("containerd github.com/containerd/containerd v1.7.2 abc") == (1, 7, 2)
    assert rt.parse_version("Docker version 24.0.5, build ced0996") == (24, 0, 5)
    assert rt.parse_version("podman version 4.3.1") == (4, 3, 1)
    assert rt.parse_version("crio version 1.28.0\nGitCommit: x") == (1, 28, 0)
    assert rt.parse_version("nothing") is None


@pytest.mark.parametrize(("snippet", "runtime"), [("containerd-1.6-shim.toml", "containerd"),
                                                  ("docker-daemon-runtimes.json", "docker")])
def test_runtime_config_snippets_for_the_shim_pass(tmp_path: Path, snippet: str, runtime: str) -> None:
    """runtime-config/'s shim snippets, with the shim's path on this machine, are what doctor accepts."""
    source = Path(__file__).parents[1] / "runtime-config" / snippet
    text = source.read_text().replace("/usr/local/bin/gpuhook-runtime",
                                      str(Path(sys.executable).with_name("gpuhook-runtime")))
    p = paths(tmp_path)
    target = Path(p.containerd_config if runtime == "containerd" else p.docker_config)
    target.parent.mkdir(parents=True)
    target.write_text(text)
    check = rt.check_containerd if runtime == "containerd" else rt.check_docker
    found = check((1, 6, 20) if runtime == "containerd" else (20, 10), p, spec_status(tmp_path / "cdi", current=False))
    assert statuses(found) == [OK], found


@pytest.mark.parametrize("args", [
    ["--env", f"NVIDIA_VISIBLE_DEVICES=GPU-{'a' * 200_000}"],
    ["--env", f"NVIDIA_VISIBLE_DEVICES=0,{','.join(['1'] * 4000)}", "--env", f"NVIDIA_FOO={'f' * 200_000}"],
    ["--env", "NVIDIA_VISIBLE_DEVICES=0", "--env", f"NVIDIA_REQUIRE_CUDA={','.join(['cuda>=99.0'] * 20_000)}"],
    ["--env", "NVIDIA_VISIBLE_DEVICES=0", "--env", "NVIDIA_DISABLE_REQUIRE=1",
     "--env", f"NVIDIA_REQUIRE_{'K' * 200_000}=cuda>=1.0"],
    ["--annotation", f"cdi.k8s.io/x=nvidia.com/gpu={'b' * 200_000}"],
    ["--env", "NVIDIA_VISIBLE_DEVICES=0", "--device-mount", "z" * 200_000],
], ids=["device", "many-ids", "unmet-requirement", "requirement-names", "annotation", "device-mount"])  # fmt: skip
def test_image_values_are_clipped_in_every_finding(fake_driver: Any, tmp_path: Path, args: list[str]) -> None:
    """doctor echoes the container's values (its input line, ids, constraints): each is clipped."""
    path = config_file(tmp_path, accept_volume_mounts=True)
    _, _, steps = explain(fake_driver, tmp_path, "--config", str(path), *args)
    for step in steps:
        assert len(step["message"]) < 3000, step["message"][:3000]
        assert all(len(line) < 3000 for line in step["detail"]), step["detail"][:3]


# --- the running daemons and their config files -----------------------------------


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Any:
    """Start a real process named like a daemon, with a --config on its command line: the real Python interpreter
    run through a symlink called `containerd` (its process name), sleeping. Never a real daemon."""
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        link = tmp_path / "daemonbin" / name
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(os.path.realpath(sys.executable))
        proc = subprocess.Popen([str(link), "-c", "import os, time; os.close(1); time.sleep(600)", *args],
                                stdout=subprocess.PIPE, cwd=tmp_path)
        assert proc.stdout is not None
        proc.stdout.read()  # EOF once the interpreter runs the sleep: its command line is final
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_running_daemons_are_found_with_their_config(fake_daemon: Any, tmp_path: Path) -> None:
    from gpuhook.doctor.daemons import Daemon, running_daemons

    containerd = fake_daemon("containerd", "--config", "custom/config.toml", "--log-level", "debug")
    dockerd = fake_daemon("dockerd", f"--config-file={tmp_path}/daemon.json")
    found = {d.pid: d for d in running_daemons()}
    assert found[containerd.pid] == Daemon("containerd", containerd.pid, str(tmp_path / "custom/config.toml"))
    assert found[dockerd.pid] == Daemon("docker", dockerd.pid, str(tmp_path / "daemon.json"))


def test_doctor_checks_the_config_the_running_daemon_uses(fake_daemon: Any, tmp_path: Path) -> None:
    """The default file has nothing; the file the daemon was started with has the hook: that one counts."""
    from gpuhook.doctor.daemons import running_daemons

    custom = tmp_path / "custom/config.toml"
    custom.parent.mkdir()
    custom.write_text("version = 2\n")
    (custom.parent / "gpuhook-base-spec.json").write_text("{}")
    configure("containerd", "hook", custom)
    proc = fake_daemon("containerd", "--config", str(custom))
    daemons = [d for d in running_daemons() if d.pid == proc.pid]
    p = paths(tmp_path / "defaults")
    found = rt.check_runtimes(["containerd"], spec_status(tmp_path / "cdi"), p, {"containerd": (1, 6, 20)},
                              daemons)
    assert [f.message for f in found if f.status == "info"] == [
        f"containerd daemon running (pid {proc.pid}) with config {custom}"]
    assert statuses(found)[1:] == [OK] and "has gpuhook's prestart hook" in found[1].message
    idle = rt.check_runtimes(["containerd"], spec_status(tmp_path / "cdi"), p, {"containerd": (1, 6, 20)}, [])
    assert "no containerd daemon running" in idle[0].message and statuses(idle)[1:] == [PROBLEM]


def test_containerd_cdi_through_an_imported_drop_in(tmp_path: Path) -> None:
    """node-setup turns CDI on in a drop-in the main config imports (containerd replaces a plugin's whole table
    with an imported file's): doctor reads the config as containerd does, imports included."""
    from gpuhook.nodesetup.runtime import containerd_dropin

    p = paths(tmp_path)
    config = Path(p.containerd_config)
    config.parent.mkdir(parents=True)
    config.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "pause:3.9"\n')
    status = spec_status(tmp_path / "cdi")
    assert PROBLEM in statuses(rt.check_containerd((1, 7, 2), p, status))  # CDI off: no way to give a GPU
    for change in containerd_dropin("/", str(config)):
        text = change.new.replace('"/etc/cdi"', f'"{tmp_path / "cdi"}"')  # the drop-in lists /etc/cdi: ours
        Path(change.path).parent.mkdir(parents=True, exist_ok=True)
        Path(change.path).write_text(text)
    assert statuses(rt.check_containerd((1, 7, 2), p, status)) == [OK]
    config.write_text(config.read_text().replace("99-gpuhook.toml", "*.toml"))  # a glob, as distributions write it
    assert statuses(rt.check_containerd((1, 7, 2), p, status)) == [OK]
    (config.parent / "conf.d/99-gpuhook.toml").write_text("version = [\n")
    (problem,) = rt.check_containerd((1, 7, 2), p, status)
    assert problem.status == PROBLEM and "99-gpuhook.toml" in problem.message


def test_a_running_daemons_version_is_its_own_binarys(tmp_path: Path) -> None:
    """The version checked is the running daemon's (node-setup's probe on a node whose containerd is not the
    one on PATH, or not on PATH at all), through /proc/<pid>/exe."""
    import shutil
    import subprocess

    from gpuhook.doctor.daemons import Daemon

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    source = tmp_path / "fake.c"
    source.write_text('#include <stdio.h>\n#include <string.h>\n#include <unistd.h>\n'
                      'int main(int c, char **v) { if (c > 1 && !strcmp(v[1], "--version")) '
                      '{ puts("containerd github.com/containerd/containerd v9.8.7 abc"); return 0; } pause(); }\n')
    binary = tmp_path / "containerd"
    subprocess.run(["gcc", "-o", str(binary), str(source)], check=True)
    proc = subprocess.Popen([str(binary)])
    try:
        assert rt._daemon_version("containerd", [Daemon("containerd", proc.pid, None)]) == (9, 8, 7)
        assert rt._daemon_version("containerd", [Daemon("crio", proc.pid, None)]) != (9, 8, 7)
    finally:
        proc.kill()
        proc.wait()


def test_the_text_report_prints_every_finding_it_counts() -> None:
    """Each section's findings are printed, the service's among them, so the count on the last line is of what
    the reader sees (a service that listens but never answers is a printed PROBLEM)."""
    from gpuhook.cli.doctor import render
    from gpuhook.doctor.model import PROBLEM, SECTIONS, Finding, Report

    report = Report()
    report.add([Finding(section, PROBLEM, f"{section} is broken") for section in (*SECTIONS, "elsewhere")])
    text = render(report)
    assert text.count("PROBLEM") == len(SECTIONS) + 1
    assert "service is broken" in text and "elsewhere is broken" in text
    assert text.splitlines()[-1] == f"{len(SECTIONS) + 1} problem(s), 0 warning(s)"


def test_on_a_kubernetes_node_cdi_on_is_enough_without_a_spec(tmp_path: Path) -> None:
    """node-setup's readiness probe: with only the DRA driver there is no spec until a claim is prepared, and the
    device plugin's comes and goes with it; containerd with CDI on is what node-setup is answerable for."""
    plain, node = paths(tmp_path), paths(tmp_path, kubernetes_node=True)
    config = Path(plain.containerd_config)
    config.parent.mkdir(parents=True)
    config.write_text('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\nenable_cdi = true\n')
    (tmp_path / "cdi").mkdir()
    status = SpecStatus(scan([str(tmp_path / "cdi")]))  # no spec at all
    assert PROBLEM in statuses(rt.check_containerd((2, 2, 9), plain, status))
    found = rt.check_containerd((2, 2, 9), node, status)
    assert statuses(found) == [OK] and "the DRA driver write the specs" in found[0].message
    config.write_text('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\nenable_cdi = false\n')
    assert PROBLEM in statuses(rt.check_containerd((2, 2, 9), node, status))  # CDI off: still a problem
