"""`docker run --device nvidia.com/gpu=...` on Docker >= 25 consuming the spec `gpuhook generate-cdi` writes.

Debian trixie's docker.io 26 (with its client and containerd 1.7), unpacked by .ci/fetch-docker-cdi and never
installed, runs as a private daemon (tests/support/dockercdi.py) with CDI on and the spec's directory as its only
CDI directory; the containers run with the host's runc, the spec's hooks call the installed gpuhook. The driver
is the simulated one with 2 GPUs. The image is imported from a directory (no registry is reachable).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dockercdi import CdiDockerd, DockerTree, need_docker_cdi, private_cdi_dockerd
from support.glibc import glibc_rootfs

from gpuhook.cli.generate import default_hook_path
from gpuhook.fakedriver import FakeDriver

pytestmark = pytest.mark.e2e
IMAGE = "gpuhook-test/glibc:1"
LIBDIR = "/usr/lib/x86_64-linux-gnu"
CONTROL = ["nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]
# One line each: the /dev/nvidia* nodes, the /dev/dri nodes, mounts of libnvidia-ml and libcuda, NVIDIA_* env,
# and what a CUDA program sees (gpuprobe: dlopen("libcuda.so.1") by the ld.so.cache the spec's hook builds).
PROBE = ("ls /dev | grep nvidia | sort | tr '\\n' ' '; echo; "
         "ls /dev/dri 2>/dev/null | sort | tr '\\n' ' '; echo; "
         f"grep -c ' {LIBDIR}/libnvidia-ml.so' /proc/self/mountinfo; "
         f"grep -c ' {LIBDIR}/libcuda.so' /proc/self/mountinfo; "
         "env | grep ^NVIDIA_ | sort | tr '\\n' ' '; echo; "
         "/usr/bin/gpuprobe 2>&1 || true")


class Probe:
    def __init__(self, stdout: str) -> None:
        lines = stdout.splitlines()
        assert len(lines) == 6, stdout
        self.nodes, self.dri = lines[0].split(), lines[1].split()
        self.ml, self.cuda = int(lines[2]), int(lines[3])
        self.env, self.cuda_program = lines[4].split(), lines[5].strip()


class World:
    def __init__(self, daemon: CdiDockerd, tree: DockerTree, fake: FakeDriver, spec: Path) -> None:
        self.daemon, self.tree, self.fake, self.spec = daemon, tree, fake, spec

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.daemon.docker("run", "--rm", "--network", "none", *args, IMAGE, "sh", "-c", PROBE)

    def probe(self, *args: str) -> Probe:
        result = self.run(*args)
        assert result.returncode == 0, result.stderr + result.stdout
        return Probe(result.stdout)

    def dri(self, *indexes: int) -> list[str]:
        gpus = [self.fake.gpus[i] for i in indexes]
        return sorted([*(f"card{g.dri_card}" for g in gpus), *(f"renderD{g.dri_render}" for g in gpus), "by-path"])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, fake_driver_factory) -> Iterator[World]:  # type: ignore[no-untyped-def]
    tree = need_docker_cdi()
    fake = fake_driver_factory(2)
    root = tmp_path_factory.mktemp("docker-cdi")
    spec = root / "cdi" / "nvidia.yaml"
    gpuhook = str(Path(sys.executable).with_name("gpuhook"))
    generated = subprocess.run(
        [gpuhook, "generate-cdi", "--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc"),
         "--hook-path", default_hook_path(), "--output", str(spec)],
        capture_output=True, text=True, check=False,
    )
    assert generated.returncode == 0, generated.stderr
    daemon_json = {"features": {"cdi": True}, "cdi-spec-dirs": [str(spec.parent)]}
    with private_cdi_dockerd(tree, root / "d", daemon_json) as daemon:
        daemon.import_rootfs(glibc_rootfs(root / "image", probe_cache=root / "probe"), IMAGE)
        yield World(daemon, tree, fake, spec)


def test_the_daemon_is_docker_25_or_later_with_cdi(world: World) -> None:
    result = world.daemon.docker("version", "--format", "{{.Client.Version}} {{.Server.Version}}")
    assert result.returncode == 0, result.stderr
    client, server = (int(v.split(".")[0]) for v in result.stdout.split())
    assert client >= 25 and server >= 25, result.stdout
    components = world.daemon.docker("version", "--format", "{{range .Server.Components}}{{.Name}}={{.Version}} "
                                     "{{end}}").stdout.split()
    versions = dict(c.split("=", 1) for c in components)
    assert versions["containerd"] == world.tree.versions["containerd"].split("-")[0], components  # trixie's


def test_one_gpu(world: World) -> None:
    got = world.probe("--device", "nvidia.com/gpu=0")
    assert got.nodes == sorted(["nvidia0", *CONTROL])  # not nvidia1
    assert got.dri == world.dri(0)
    assert (got.ml, got.cuda) == (1, 1)
    assert got.env == ["NVIDIA_VISIBLE_DEVICES=void"]  # the spec's: a runtime hook after this one injects nothing
    assert got.cuda_program == f"cuInit=0 count=1 version={world.fake.cuda_driver_version}"


def test_second_gpu_by_uuid(world: World) -> None:
    got = world.probe("--device", f"nvidia.com/gpu={world.fake.gpus[1].uuid}")
    assert got.nodes == sorted(["nvidia1", *CONTROL])
    assert got.dri == world.dri(1)
    assert got.cuda_program == f"cuInit=0 count=1 version={world.fake.cuda_driver_version}"


def test_all_gpus(world: World) -> None:
    got = world.probe("--device", "nvidia.com/gpu=all")
    assert got.nodes == sorted(["nvidia0", "nvidia1", *CONTROL])
    assert got.dri == world.dri(0, 1)
    assert (got.ml, got.cuda) == (1, 1)
    assert got.env == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert got.cuda_program == f"cuInit=0 count=2 version={world.fake.cuda_driver_version}"


def test_unknown_device_is_docker_s_cdi_error(world: World) -> None:
    result = world.run("--device", "nvidia.com/gpu=7")
    assert result.returncode != 0
    assert "CDI device injection failed" in result.stderr and "nvidia.com/gpu=7" in result.stderr, result.stderr


def test_without_device_is_untouched(world: World) -> None:
    got = world.probe()
    assert (got.nodes, got.dri, got.ml, got.cuda, got.env) == ([], [], 0, 0, [])
    assert got.cuda_program.startswith("dlopen-failed")
