"""Datacenter devices end to end: IMEX channels and the gated families (NVSwitch, GDS, MOFED, gdrcopy) through
the three front doors that start containers: runc with gpuhook-hook in hooks.prestart, podman with the CDI specs
`generate-cdi --mode` writes, and gpuhook-runtime in front of runc. The simulated driver has channels 0 and 3
(support.fakefix.FAKE_DATACENTER); a node that reaches a container through the device cgroup opens with ENXIO
(no driver behind the fake's majors), one that does not with EPERM."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.e2e import need_root, need_tool
from support.podman import Podman, need_podman
from support.runc import busybox_rootfs, make_bundle, need_busybox, runc_delete, runc_run, unique_id
from test_hook_e2e import hook_binary, hooks, write_config
from test_shim import SHIM, hook_config, run_shim

from gpuhook.cli.generate import default_hook_path
from gpuhook.fakedriver import FakeDriver

pytestmark = pytest.mark.e2e

CHANNEL3 = "/dev/nvidia-caps-imex-channels/channel3"
NVSWITCH = ["/dev/nvidia-nvswitch0", "/dev/nvidia-nvswitch1", "/dev/nvidia-nvswitchctl"]
# Every datacenter node the container has ("NODE <path> <major hex>:<minor hex>"), then an open of each argument.
PROBE = (
    "for f in /dev/nvidia-caps-imex-channels/* /dev/nvidia-nvswitch* /dev/nvidia-fs* /dev/infiniband/* "
    "/dev/gdrdrv; do [ -c \"$f\" ] && echo \"NODE $f $(stat -c '%t:%T' \"$f\")\"; done; "
    "for f in \"$@\"; do echo \"OPEN $f $(cat \"$f\" 2>&1 | head -1)\"; done; "
    "for f in /etc/cufile.json /run/udev; do [ -e \"$f\" ] && echo \"FILE $f\"; done; "
    "grep -E ' (/etc/cufile.json|/run/udev) ' /proc/self/mountinfo | cut -d' ' -f5,6 | sed 's/^/MOUNT /'; true"
)


def probe_argv(*open_paths: str) -> list[str]:
    return ["sh", "-c", PROBE, "probe", *open_paths]


def node_paths(stdout: str) -> list[str]:
    return sorted(line.split()[1] for line in stdout.splitlines() if line.startswith("NODE "))


def opened(stdout: str, path: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(f"OPEN {path} "))


def assert_usable(stdout: str, path: str) -> None:
    """Past the device cgroup: the open reaches the (absent) driver, ENXIO, not the cgroup's EPERM."""
    line = opened(stdout, path)
    assert "No such device or address" in line and "Operation not permitted" not in line, stdout


# --- the prestart hook (runc) --------------------------------------------------------------------------------


@pytest.fixture()
def hook_e2e(tmp_path: Path) -> Path:
    need_root()
    need_tool("runc")
    need_busybox()
    assert hook_binary(), "gpuhook-hook is not installed next to the test interpreter"
    return tmp_path


def run_hook(tmp: Path, fake: FakeDriver, env: list[str], open_paths: tuple[str, ...] = (),
             mounts: list[dict[str, Any]] | None = None, **config: Any) -> subprocess.CompletedProcess[str]:
    cfg = write_config(tmp, Path(fake.root), **config)
    rootfs = busybox_rootfs(tmp / "bundle")
    bundle = make_bundle(tmp / "bundle", rootfs, probe_argv(*open_paths), env=env, hooks=hooks(cfg),
                         mounts=mounts or ())
    return runc_run(bundle, unique_id("dc"))


def test_hook_imex_channel_3(hook_e2e: Path, fake_driver_datacenter: FakeDriver) -> None:
    result = run_hook(hook_e2e, fake_driver_datacenter, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=3"],
                      (CHANNEL3,))
    assert result.returncode == 0, result.stderr
    assert node_paths(result.stdout) == [CHANNEL3]
    assert f"NODE {CHANNEL3} 1fd:3" in result.stdout  # major 509 from the fake's /proc/devices
    assert_usable(result.stdout, CHANNEL3)
    assert " imex=3 " in (hook_e2e / "gpuhook.log").read_text()


def test_hook_imex_channel_by_volume_mount(hook_e2e: Path, fake_driver_datacenter: FakeDriver) -> None:
    mount = {"destination": "/var/run/nvidia-container-devices/imex/channel3", "type": "bind",
             "source": "/dev/null", "options": ["rbind", "ro"]}
    result = run_hook(hook_e2e, fake_driver_datacenter, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=0"],
                      (CHANNEL3,), mounts=[mount], accept_volume_mounts=True)
    assert result.returncode == 0, result.stderr
    assert node_paths(result.stdout) == [CHANNEL3]  # the mount wins over the variable
    assert_usable(result.stdout, CHANNEL3)


def test_hook_missing_channel_fails_the_start(hook_e2e: Path, fake_driver_datacenter: FakeDriver) -> None:
    result = run_hook(hook_e2e, fake_driver_datacenter, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=1"])
    assert result.returncode != 0
    assert "IMEX channel 1 requested but /dev/nvidia-caps-imex-channels/channel1 does not exist" in result.stderr


def test_hook_nvswitch(hook_e2e: Path, fake_driver_datacenter: FakeDriver) -> None:
    result = run_hook(hook_e2e, fake_driver_datacenter, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_NVSWITCH=enabled"],
                      tuple(NVSWITCH))
    assert result.returncode == 0, result.stderr
    assert node_paths(result.stdout) == NVSWITCH
    for path in NVSWITCH:
        assert_usable(result.stdout, path)


def test_hook_gds_mofed_gdrcopy(hook_e2e: Path, fake_driver_datacenter: FakeDriver) -> None:
    env = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_GDS=enabled", "NVIDIA_MOFED=enabled", "NVIDIA_GDRCOPY=enabled"]
    result = run_hook(hook_e2e, fake_driver_datacenter, env, ("/dev/nvidia-fs0", "/dev/gdrdrv"))
    assert result.returncode == 0, result.stderr
    want = [f"/dev/nvidia-fs{i}" for i in range(16)] + ["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0",
                                                        "/dev/gdrdrv"]
    assert node_paths(result.stdout) == sorted(want)
    assert_usable(result.stdout, "/dev/nvidia-fs0")
    assert_usable(result.stdout, "/dev/gdrdrv")
    mounts = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("MOUNT ")]
    assert sorted(m[0] for m in mounts) == ["/etc/cufile.json", "/run/udev"]
    assert all(m[1].startswith("ro,") for m in mounts)


@pytest.mark.parametrize("env", [
    ["NVIDIA_VISIBLE_DEVICES=0"],
    ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_NVSWITCH=true", "NVIDIA_GDS=1", "NVIDIA_IMEX_CHANNELS="],  # not `enabled`
    ["NVIDIA_IMEX_CHANNELS=3", "NVIDIA_NVSWITCH=enabled", "NVIDIA_GDS=enabled"],  # no GPU request: untouched
])  # fmt: skip
def test_hook_without_the_variables_adds_none(hook_e2e: Path, fake_driver_datacenter: FakeDriver,
                                              env: list[str]) -> None:
    result = run_hook(hook_e2e, fake_driver_datacenter, env, (CHANNEL3,))
    assert result.returncode == 0, result.stderr
    assert node_paths(result.stdout) == []
    assert "FILE " not in result.stdout and "MOUNT " not in result.stdout


# --- CDI (podman) --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, fake_driver_factory: Any) -> Iterator[tuple[Podman, FakeDriver]]:
    from support.fakefix import FAKE_DATACENTER

    podman = need_podman()
    need_busybox()
    fake = fake_driver_factory(datacenter=FAKE_DATACENTER)
    world = Podman.create(tmp_path_factory.mktemp("podman-dc"), podman)
    base = [sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", str(fake.root),
            "--proc-root", str(fake.root / "proc")]
    for mode in ("gpu", "imex", "nvswitch", "gds", "mofed", "gdrcopy"):
        extra = ["--hook-path", default_hook_path()] if mode == "gpu" else []
        subprocess.run([*base, "--mode", mode, *extra, "--output", str(world.spec_dir / f"nvidia-{mode}.yaml")],
                       check=True, capture_output=True, text=True)
    yield world, fake
    world.close()


def podman_run(world: tuple[Podman, FakeDriver], tmp: Path, devices: list[str], *open_paths: str) -> str:
    podman, _fake = world
    result = podman.run(busybox_rootfs(tmp), devices, probe_argv(*open_paths))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_cdi_imex_channel_3(world: tuple[Podman, FakeDriver], tmp_path: Path) -> None:
    out = podman_run(world, tmp_path, ["nvidia.com/gpu=0", "nvidia.com/imex-channel=3"], CHANNEL3)
    assert node_paths(out) == [CHANNEL3]
    assert_usable(out, CHANNEL3)


def test_cdi_nvswitch(world: tuple[Podman, FakeDriver], tmp_path: Path) -> None:
    out = podman_run(world, tmp_path, ["nvidia.com/gpu=0", "nvidia.com/nvswitch=all"], *NVSWITCH)
    assert node_paths(out) == NVSWITCH
    for path in NVSWITCH:
        assert_usable(out, path)


def test_cdi_gds(world: tuple[Podman, FakeDriver], tmp_path: Path) -> None:
    out = podman_run(world, tmp_path, ["nvidia.com/gpu=0", "nvidia.com/gds=all", "nvidia.com/gdrcopy=all",
                                       "nvidia.com/mofed=all"], "/dev/nvidia-fs0")
    assert "/dev/nvidia-fs15" in node_paths(out) and "/dev/gdrdrv" in node_paths(out)
    assert "/dev/infiniband/uverbs0" in node_paths(out)
    assert_usable(out, "/dev/nvidia-fs0")
    assert "FILE /etc/cufile.json" in out


def test_cdi_gpu_alone_gets_none(world: tuple[Podman, FakeDriver], tmp_path: Path) -> None:
    out = podman_run(world, tmp_path, ["nvidia.com/gpu=0"], CHANNEL3)
    assert node_paths(out) == []
    assert "Operation not permitted" in opened(out, CHANNEL3) or "No such file" in opened(out, CHANNEL3)


# --- gpuhook-runtime (the shim) in front of runc -------------------------------------------------------------


@pytest.fixture()
def shim_e2e(tmp_path: Path) -> Path:
    need_root()
    need_tool("runc")
    need_busybox()
    assert Path(SHIM).exists(), "gpuhook-runtime is not installed next to the test interpreter"
    return tmp_path


def run_through_shim(tmp: Path, fake: FakeDriver, env: list[str], *open_paths: str) -> str:
    bundle = make_bundle(tmp / "bundle", busybox_rootfs(tmp / "bundle"), probe_argv(*open_paths), env=env)
    cid = unique_id("dcshim")
    try:
        result = run_shim(tmp, ["run", "--bundle", str(bundle), cid], hook_config(tmp, fake.root), runtime="runc",
                          stdin=subprocess.DEVNULL)
    finally:
        runc_delete(cid)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_shim_imex_channel_3_and_nvswitch(shim_e2e: Path, fake_driver_datacenter: FakeDriver) -> None:
    env = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=channel3", "NVIDIA_NVSWITCH=enabled"]
    out = run_through_shim(shim_e2e, fake_driver_datacenter, env, CHANNEL3, *NVSWITCH)
    assert node_paths(out) == sorted([CHANNEL3, *NVSWITCH])
    for path in [CHANNEL3, *NVSWITCH]:
        assert_usable(out, path)


def test_shim_without_the_variables_adds_none(shim_e2e: Path, fake_driver_datacenter: FakeDriver) -> None:
    out = run_through_shim(shim_e2e, fake_driver_datacenter, ["NVIDIA_VISIBLE_DEVICES=0"], CHANNEL3)
    assert node_paths(out) == []
