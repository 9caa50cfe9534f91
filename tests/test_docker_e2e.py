"""`docker run --gpus` and `--runtime gpuhook` on a private Docker daemon (Debian's docker.io 20.10), the simulated
driver, and gpuhook installed as the `nvidia-container-runtime-hook` Docker looks for."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.dockerd import Dockerd, private_dockerd
from support.glibc import glibc_rootfs
from support.service import service_env

from gpuhook.cli import entry as hook_entry

pytestmark = pytest.mark.e2e
SHIM = str(Path(sys.executable).with_name("gpuhook-runtime"))
IMAGE = "gpuhook-test/glibc:1"
PROBE = ("ls /dev | grep nvidia | sort | tr '\\n' ' '; echo; "
         "grep -c ' /usr/lib/x86_64-linux-gnu/libnvidia-ml.so' /proc/self/mountinfo; "
         "grep -c ' /usr/lib/x86_64-linux-gnu/libcuda.so' /proc/self/mountinfo; "
         "env | grep ^NVIDIA_ | sort | tr '\\n' ' '")


class World:
    def __init__(self, daemon: Dockerd, log: Path) -> None:
        self.daemon, self.log = daemon, log

    def run(self, *args: str, env: tuple[str, ...] = ()) -> tuple[int, str, str]:
        envs = [a for e in env for a in ("-e", e)]
        result = self.daemon.docker("run", "--rm", "--network", "none", *envs, *args, IMAGE, "sh", "-c", PROBE)
        return result.returncode, result.stdout, result.stderr

    @staticmethod
    def parse(stdout: str) -> tuple[list[str], int, int, str]:
        lines = stdout.splitlines()
        return lines[0].split(), int(lines[1]), int(lines[2]), lines[3] if len(lines) > 3 else ""


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory, fake_driver_factory: Any) -> Iterator[World]:
    fake = fake_driver_factory(2)
    root = tmp_path_factory.mktemp("docker")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    hook_entry.install(str(bin_dir / "gpuhook-hook"), docker_gpus=True)
    config = root / "config.toml"
    log = root / "gpuhook.log"
    config.write_text(f'driver-root = "{fake.root}"\nproc-root = "{fake.root}/proc"\nlog-file = "{log}"\n'
                      f'inventory-cache = "{root}/inventory.json"\n')
    daemon_json = {"runtimes": {"gpuhook": {"path": SHIM}}}
    env = {"GPUHOOK_CONFIG": str(config), **service_env()}  # --gpus hooks get dockerd's environment
    with private_dockerd(root / "d", [str(bin_dir)], daemon_json, env) as daemon:
        daemon.import_rootfs(glibc_rootfs(root / "image", probe_cache=root / "probe"), IMAGE)
        yield World(daemon, log)


@pytest.mark.parametrize(("gpus", "nodes", "cuda"), [
    ("all", ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1", "nvidiactl"], 1),
    ("1", ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"], 1),  # a count: the first GPU
    ('"device=1"', ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"], 1),
    ("all,capabilities=utility", ["nvidia0", "nvidia1", "nvidiactl"], 0),
])  # fmt: skip
def test_docker_run_gpus(docker: World, gpus: str, nodes: list[str], cuda: int) -> None:
    code, out, err = docker.run("--gpus", gpus)
    assert code == 0, err
    got, ml, libcuda, _ = docker.parse(out)
    assert got == nodes and ml == 1 and libcuda == cuda


def test_docker_run_gpus_bad_id_is_a_clear_error(docker: World) -> None:
    code, _, err = docker.run("--gpus", '"device=7"')
    assert code != 0 and "unknown device '7'" in err


def test_docker_run_without_gpus_is_untouched(docker: World) -> None:
    code, out, err = docker.run()
    assert code == 0, err
    assert docker.parse(out)[:3] == ([], 0, 0)


@pytest.mark.parametrize("args", [(), ("--gpus", "all")], ids=["env", "env+gpus"])
def test_runtime_gpuhook_injects_once(docker: World, args: tuple[str, ...]) -> None:
    """`--runtime gpuhook` (the shim) with or without --gpus: one injection (one mount of each library)."""
    code, out, err = docker.run("--runtime", "gpuhook", *args, env=("NVIDIA_VISIBLE_DEVICES=0",))
    assert code == 0, err
    got, ml, libcuda, _ = docker.parse(out)
    assert "nvidia0" in got and ml == 1 and libcuda == 1


def test_runtime_gpuhook_error_reaches_docker_run(docker: World) -> None:
    code, _, err = docker.run("--runtime", "gpuhook", env=("NVIDIA_VISIBLE_DEVICES=7",))
    assert code != 0
    assert "unknown device '7'" in err and "unable to retrieve OCI runtime error" not in err


def test_runtime_gpuhook_without_gpu_request(docker: World) -> None:
    code, out, err = docker.run("--runtime", "gpuhook")
    assert code == 0, err
    assert docker.parse(out)[:3] == ([], 0, 0)
    assert " runtime skip request=unset" in docker.log.read_text()
