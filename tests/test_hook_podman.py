"""The prestart hook through podman's hooks dir gives the same container view as the CDI spec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import hostile
from support.glibc import glibc_rootfs
from support.podman import LIST_NODES, RUN_FLAGS, Podman, need_podman, parse_nodes

from gpuhook import _native
from gpuhook.model.catalogue import LIB32_DIR

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
GPUHOOK = str(Path(sys.executable).with_name("gpuhook"))
HOOK = str(Path(sys.executable).with_name("gpuhook-hook"))
LIB32 = LIB32_DIR + "/"

VIEW = (
    LIST_NODES + "; echo MOUNTS; grep -E ' /(usr|lib|etc|var)/' /proc/self/mountinfo | cut -d' ' -f5,6 | sort; "
    "echo LINKS; for l in /usr/lib/x86_64-linux-gnu/*.so*; do [ -L $l ] && echo $l $(readlink $l); done | sort; "
    "echo PROBE; /usr/bin/gpuprobe"
)


@pytest.fixture()
def podman(tmp_path: Path) -> Any:
    need_podman()
    world = Podman.create(tmp_path / "podman")
    yield world
    world.close()


def hooks_dir(tmp: Path, fake: Any) -> Path:
    """The repo's oci-hooks.d/gpuhook.json, pointed at the installed hook and a config for the fake."""
    config = hostile.write_config(tmp, fake.root, inventory_cache="")
    spec = json.loads((REPO / "oci-hooks.d/gpuhook.json").read_text())
    spec["hook"]["path"] = HOOK
    spec["hook"]["args"] = ["gpuhook-hook", "--config", str(config), "prestart"]
    out = tmp / "hooks.d"
    out.mkdir()
    (out / "gpuhook.json").write_text(json.dumps(spec))
    return out


def hooked_sh(podman: Podman, hooks: Path, rootfs: Path, script: str, env: list[str] | None = None,
              ) -> subprocess.CompletedProcess[str]:
    """`sh -c script` in `rootfs`, no CDI device, podman running the OCI hooks in `hooks`."""
    return podman.sh(rootfs, [], script, env=env or [], global_flags=["--hooks-dir", str(hooks)])


def driver_cache(rootfs: Path) -> set[str]:
    """The names in `rootfs`'s ld.so.cache that are the driver's (a path with nvidia, or a name with cuda)."""
    entries = _native.read_ldcache(str(rootfs / "etc/ld.so.cache"))
    return {e.key for e in entries if "nvidia" in e.value or "cuda" in e.key}


def view(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    text = result.stdout
    nodes_part, rest = text.split("MOUNTS", 1)
    mounts_part, rest = rest.split("LINKS", 1)
    links_part, probe = rest.split("PROBE", 1)
    return {
        "nodes": parse_nodes(nodes_part),
        "mounts": sorted(
            line
            for line in mounts_part.split("\n")
            if "nvidia" in line or "libcuda" in line or "libnv" in line or "lib" in line and ".so." in line
        ),
        "links": sorted(line for line in links_part.split("\n") if line.strip()),
        "probe": probe.strip(),
    }


def test_hook_via_podman_equals_cdi(podman: Podman, fake_driver: Any, tmp_path: Path) -> None:
    spec = podman.spec_dir / "nvidia.yaml"
    gen = subprocess.run(
        [
            GPUHOOK,
            "generate-cdi",
            "--driver-root",
            str(fake_driver.root),
            "--proc-root",
            f"{fake_driver.root}/proc",
            "--hook-path",
            GPUHOOK,
            "--output",
            str(spec),
        ],
        capture_output=True,
        text=True,
    )
    assert gen.returncode == 0, gen.stderr
    cdi_rootfs = glibc_rootfs(tmp_path / "cdi", probe_cache=tmp_path / "probe")
    cdi_view = view(podman.sh(cdi_rootfs, ["nvidia.com/gpu=0"], VIEW))

    hook_rootfs = glibc_rootfs(tmp_path / "hook", probe_cache=tmp_path / "probe")
    hook_view = view(hooked_sh(podman, hooks_dir(tmp_path, fake_driver), hook_rootfs, VIEW,
                               env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"]))

    assert "/dev/nvidia0" in hook_view["nodes"] and "/dev/nvidia1" not in hook_view["nodes"]
    assert hook_view["nodes"] == cdi_view["nodes"]
    # `all` holds compat32, so the hook also mounts the 32-bit libraries; a CDI spec holds none, as nvidia-ctk's
    # (v1.20.0 pkg/lookup/ldcache.go keeps the ld cache's 64-bit entries only): the rest is the same
    hook_64bit = [line for line in hook_view["mounts"] if not line.startswith(LIB32)]
    assert hook_64bit == cdi_view["mounts"] and hook_64bit
    assert (hook_64bit != hook_view["mounts"]) == fake_driver.compat32
    assert hook_view["links"] == cdi_view["links"] and hook_view["links"]
    assert hook_view["probe"] == cdi_view["probe"] == "cuInit=0 count=1 version=12040"
    hook_cache, cdi_cache = driver_cache(hook_rootfs), driver_cache(cdi_rootfs)
    assert hook_cache == cdi_cache and "libcuda.so.1" in hook_cache
    assert " inject devices=" in (tmp_path / "gpuhook.log").read_text()


def test_hook_via_podman_skips_non_gpu_container(podman: Podman, fake_driver: Any, tmp_path: Path) -> None:
    rootfs = glibc_rootfs(tmp_path / "plain", probe_cache=tmp_path / "probe")
    result = hooked_sh(podman, hooks_dir(tmp_path, fake_driver), rootfs, LIST_NODES)
    assert result.returncode == 0, result.stderr
    assert parse_nodes(result.stdout) == {}
    assert " skip request=unset" in (tmp_path / "gpuhook.log").read_text()


def test_hook_via_podman_refuses_oversized_cdi_annotations(podman: Podman, fake_driver: Any, tmp_path: Path) -> None:
    """Hostile sizes through podman: `--annotation`s reach config.json, the hook bounds them before any per-name work
    and refuses in one short line. (podman splits an --annotation value at commas and one argument is at most
    128 KiB, so the 200,000-name value of the runc and shim tests cannot pass here: 5,000 annotations of one
    name each are over the 4,096 bound.)"""
    rootfs = glibc_rootfs(tmp_path / "plain", probe_cache=tmp_path / "probe")
    annotations = [arg for i in range(5000) for arg in ("--annotation", f"cdi.k8s.io/gpuhook_{i}=nvidia.com/gpu=x{i}")]
    cmd = podman.command("--hooks-dir", str(hooks_dir(tmp_path, fake_driver)), "run", *RUN_FLAGS, *annotations,
                         "--rootfs", str(rootfs), "true")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "gpuhook-hook:" in line]
    assert lines and "cdi.k8s.io/ annotations name more than 4096 devices" in lines[0], result.stderr[:2000]
    assert len(result.stderr) < 3000
    log = (tmp_path / "gpuhook.log").read_text().splitlines()
    assert len(log) == 1 and "more than 4096" in log[0] and len(log[0]) < 1000
