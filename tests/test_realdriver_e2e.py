"""NVIDIA's real 535 driver files through every front door, on both layouts: `info`, `doctor`, `generate-cdi`
+ podman, the prestart hook under runc, the runtime shim under runc. In each container the real libcuda loads
by soname (cuDriverGetVersion 12020, cuInit 100: no kernel driver here) and the real nvidia-smi runs and says
it cannot reach the driver. Then CUDA forward compatibility: an image's compat libcuda of a newer driver major
goes first in its ld cache, an older one is ignored, through the same three doors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.e2e import need_root, need_tool
from support.glibc import MULTIARCH, glibc_rootfs
from support.podman import Podman, need_podman
from support.realdriver import RealRoot
from support.runc import make_bundle, need_busybox, runc_delete, runc_run, unique_id

from gpuhook.cli.generate import default_hook_path

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_host_nodes")]
HOOK_BIN = Path(sys.executable).with_name("gpuhook-hook")
SHIM = Path(sys.executable).with_name("gpuhook-runtime")
# What NVIDIA's libcuda and nvidia-smi need from the image besides libc (glibc's compatibility stubs).
IMAGE_LIBS = ("libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
PROBE = "/usr/bin/gpuprobe; nvidia-smi; echo nvidia-smi-exit=$?"
ENV = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility", "NVIDIA_REQUIRE_CUDA=cuda>=12.2"]
COMPAT_SOURCE = r"""
/* A stand-in for NVIDIA's CUDA forward-compatibility libcuda: only what gpuprobe calls. */
int cuDriverGetVersion(int *v) { *v = COMPAT_CUDA; return 0; }
int cuInit(unsigned flags) { (void)flags; return 100; }
int cuDeviceGetCount(int *n) { *n = 0; return 100; }
"""


@pytest.fixture()
def e2e(tmp_path: Path) -> Path:
    need_root()
    need_tool("runc")
    need_tool("gcc")
    need_busybox()
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA kernel driver: the real libraries would talk to it")
    assert HOOK_BIN.exists() and SHIM.exists(), "gpuhook must be installed next to the test interpreter"
    return tmp_path


def image(tmp: Path, compat: tuple[str, int] | None = None) -> Path:
    """A glibc rootfs with gpuprobe; `compat` = (driver version, cuDriverGetVersion) adds a CUDA compat libcuda
    at /usr/local/cuda/compat/libcuda.so.<version> (+ its soname link, as NVIDIA's compat package has)."""
    rootfs = glibc_rootfs(tmp / "bundle", probe_cache=tmp.parent / "probe")
    for name in IMAGE_LIBS:
        shutil.copy2(os.path.realpath(f"/lib/x86_64-linux-gnu/{name}"), rootfs / MULTIARCH / name)
    if compat is not None:
        version, cuda = compat
        folder = rootfs / "usr/local/cuda/compat"
        folder.mkdir(parents=True)
        source = tmp / "compat.c"
        source.write_text(COMPAT_SOURCE)
        subprocess.run(["gcc", "-shared", "-fPIC", f"-DCOMPAT_CUDA={cuda}", "-Wl,-soname,libcuda.so.1", "-o",
                        str(folder / f"libcuda.so.{version}"), str(source)], check=True, capture_output=True)
        (folder / "libcuda.so.1").symlink_to(f"libcuda.so.{version}")
    return rootfs


def check_probe(output: str, cuda: int = 12020) -> None:
    assert f"cuInit=100 count=-1 version={cuda}" in output or f"cuInit=100 count=0 version={cuda}" in output, output
    assert "couldn't communicate with the NVIDIA driver" in output, output
    assert "nvidia-smi-exit=9" in output, output


def hook_config(tmp: Path, real: RealRoot) -> Path:
    path = tmp / "config.toml"
    path.write_text(f'driver-root = "{real.root}"\nproc-root = "{real.proc_root}"\n'
                    f'log-file = "{tmp}/gpuhook.log"\ninventory-cache = "{tmp}/inventory.json"\n')
    return path


def run_hook(tmp: Path, real: RealRoot, rootfs: Path, env: list[str] = ENV) -> subprocess.CompletedProcess[str]:
    args = ["gpuhook-hook", "--config", str(hook_config(tmp, real)), "prestart"]
    hooks = {"prestart": [{"path": str(HOOK_BIN), "args": args, "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}]}
    bundle = make_bundle(tmp / "bundle", rootfs, ["sh", "-c", PROBE], env=env, hooks=hooks)
    return runc_run(bundle, unique_id("real-hook"), timeout=60)


def run_shim(tmp: Path, real: RealRoot, rootfs: Path) -> subprocess.CompletedProcess[str]:
    bundle = make_bundle(tmp / "bundle", rootfs, ["sh", "-c", PROBE], env=ENV)
    cid = unique_id("real-shim")
    env = dict(os.environ, GPUHOOK_CONFIG=str(hook_config(tmp, real)), GPUHOOK_RUNTIME="runc")
    try:
        return subprocess.run([str(SHIM), "run", "--bundle", str(bundle), cid], env=env, capture_output=True,
                              text=True, timeout=90, check=False, stdin=subprocess.DEVNULL)
    finally:
        runc_delete(cid)


def generate(real: RealRoot, out: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", str(real.root), "--proc-root",
         str(real.proc_root), "--hook-path", default_hook_path(), "--output", str(out)],
        capture_output=True, text=True, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.fixture()
def podman_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    podman = need_podman()
    with Podman.create(tmp_path_factory.mktemp("podman"), podman) as world:
        yield world


def run_podman(world: Podman, real: RealRoot, rootfs: Path) -> subprocess.CompletedProcess[str]:
    generate(real, world.spec_dir / "nvidia.yaml")
    return world.sh(rootfs, ["nvidia.com/gpu=0"], PROBE)


# ---- the front doors, on both layouts ---------------------------------------------------------------------


def test_hook_under_runc(e2e: Path, real_root: RealRoot) -> None:
    result = run_hook(e2e, real_root, image(e2e))
    assert result.returncode == 0, result.stderr + result.stdout
    check_probe(result.stdout)
    cached = json.loads((e2e / "inventory.json").read_text())  # the CUDA version from libcuda is kept
    assert (cached["source"], cached["cuda_version"]) == ("procfs", "12.2")


def test_hook_refuses_a_cuda_requirement_the_driver_does_not_meet(e2e: Path, real_root: RealRoot) -> None:
    result = run_hook(e2e, real_root, image(e2e), env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=12.3"])
    assert result.returncode != 0
    assert "unsatisfied requirement 'cuda>=12.3'" in result.stderr and "cuda 12.2" in result.stderr, result.stderr


def test_shim_under_runc(e2e: Path, real_root: RealRoot) -> None:
    result = run_shim(e2e, real_root, image(e2e))
    assert result.returncode == 0, result.stderr + result.stdout
    check_probe(result.stdout)


def test_generate_cdi_with_podman(e2e: Path, real_root: RealRoot, podman_world: Podman) -> None:
    result = run_podman(podman_world, real_root, image(e2e))
    assert result.returncode == 0, result.stderr + result.stdout
    check_probe(result.stdout)


def test_doctor_finds_no_problem(e2e: Path, real_root: RealRoot) -> None:
    specs = e2e / "specs"
    specs.mkdir()
    generate(real_root, specs / "nvidia.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "gpuhook.cli", "doctor", "--driver-root", str(real_root.root), "--proc-root",
         str(real_root.proc_root), "--runtime", "none", "--spec-dir", str(specs), "--json"],
        capture_output=True, text=True, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    messages = [f["message"] for f in report["findings"]]
    assert any("driver 535.309.01 (CUDA 12.2)" in m for m in messages), messages
    assert not [f for f in report["findings"] if f["status"] == "PROBLEM"]


def test_device_plugin_registers_and_allocates(e2e: Path, real_root: RealRoot) -> None:
    """The plugin on NVIDIA's real files: the real NVML cannot initialise (no kernel driver), so the GPUs come from
    procfs; it registers with a kubelet (real gRPC), streams them healthy, and Allocate answers CDI names. Run
    without CAP_MKNOD/CAP_SYS_MODULE, as every NVIDIA code here (its NVML would make /dev/nvidiactl as root)."""
    from support.kubelet import TestKubelet
    from support.processes import gpuhook_command, short_tempdir
    from support.realdriver import without_device_powers

    work = short_tempdir()
    log = Path(work, "plugin.log")
    try:
        with TestKubelet(os.path.join(work, "dp")) as kubelet, open(log, "wb") as out:
            proc = subprocess.Popen(
                [*gpuhook_command(), "device-plugin", "--driver-root", str(real_root.root), "--proc-root",
                 str(real_root.proc_root), "--kubelet-dir", kubelet.directory, "--cdi-spec-dir",
                 os.path.join(work, "cdi"), "--hook-path", str(HOOK_BIN), "--sys-root", str(real_root.root / "sys"),
                 "--health-interval", "0.05"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=without_device_powers)  # fmt: skip
            try:
                (reg,) = kubelet.wait_registrations(1, timeout=30)
                assert reg.request.resource_name == "nvidia.com/gpu"
                devices = kubelet.stream().first().devices
                assert len(devices) == len(real_root.fake.gpus) and {d.health for d in devices} == {"Healthy"}
                ids = [d.ID for d in devices]
                answer = kubelet.client().allocate(ids[:1]).container_responses[0]
                assert [c.name for c in answer.cdi_devices] == [f"k8s.device-plugin.nvidia.com/gpu={ids[0]}"]
                spec = Path(work, "cdi").glob("*.json")
                assert any("libcuda.so.535.309.01" in s.read_text() for s in spec)
            finally:
                proc.terminate()
                proc.wait(20)
    finally:
        output = log.read_text() if log.exists() else ""
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode in (0, -15), output


# ---- CUDA forward compatibility (runfile layout) --------------------------------------------------------

NEWER = ("550.54.15", 12040)
OLDER = ("530.30.02", 12030)


@pytest.mark.parametrize(("compat", "seen"), [(NEWER, 12040), (OLDER, 12020)], ids=["newer", "older"])
@pytest.mark.parametrize("door", ["hook", "shim", "cdi"])
def test_cuda_compat(e2e: Path, real_driver_runfile: RealRoot, request: pytest.FixtureRequest, door: str,
                     compat: Any, seen: int) -> None:
    """One implementation behind all three doors: the newer compat libcuda wins, the older one is left out."""
    rootfs = image(e2e, compat)
    if door == "cdi":
        result = run_podman(request.getfixturevalue("podman_world"), real_driver_runfile, rootfs)
    else:
        result = (run_hook if door == "hook" else run_shim)(e2e, real_driver_runfile, rootfs)
    assert result.returncode == 0, result.stderr + result.stdout
    assert f"version={seen}" in result.stdout, result.stdout
