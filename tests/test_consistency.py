"""The three front doors agree: for one request, the container sees the same thing whether the prestart hook
(runc), the CDI spec (podman) or the runtime shim (runc through gpuhook-runtime) put the GPU in.

The container view compared:
- device nodes under /dev/nvidia*, /dev/nvidia-caps/*, /dev/dri/*: path, major:minor, mode;
- mounts other than the runtime's own (/, /proc, /sys, /dev, podman's /etc/hosts & co): mount point, the
  ro/nosuid/nodev/noexec flags, and the content hash of the mounted file (or its file type);
- symlinks in the library folders and their targets;
- the container's ld cache (/etc/ld.so.cache, read from the host after the run with `_native.read_ldcache`) and
  the ld.so.conf.d entry that registers the driver's folder.

CDI has no capability gating: a spec device carries every capability's nodes and the spec's common edits every
driver file, so the hook and the shim are asked for `NVIDIA_DRIVER_CAPABILITIES=all` whenever CDI takes part.
CDI has no counterpart of `none` (driver files without a GPU) or of a capability subset, so those two requests are
compared between the hook and the shim only. Things that legitimately differ are not part of the view: the env
(a CDI spec sets NVIDIA_VISIBLE_DEVICES=void), and /proc/driver/nvidia (only the hook can mount inside /proc; the
simulated driver has no kernel module, so the container's procfs has no driver directory in any case).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.fakefix import FAKE_MIG_LAYOUT
from support.glibc import glibc_rootfs
from support.hostile import hook_binary, hook_env
from support.podman import Podman, need_podman
from support.runc import make_bundle, need_busybox, runc_delete, runc_run, unique_id

from gpuhook import _native
from gpuhook.cli.generate import default_hook_path
from gpuhook.fakedriver import FakeDriver
from gpuhook.model.catalogue import LIB32_DIR, LIB_DIR

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
LIB_DIRS = (LIB_DIR, LIB32_DIR)
RUNTIME_MOUNTS = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv")

PROBE = "; ".join([
    "echo '== nodes'",
    "for f in /dev/nvidia* /dev/nvidia-caps/* /dev/dri/*; do "
    "[ -c \"$f\" ] && echo \"$f $(stat -c '%t:%T %a' \"$f\")\"; done",
    "echo '== mounts'",
    "while read -r _id _parent _dev _root mp opts _rest; do echo \"$mp $opts\"; done < /proc/self/mountinfo",
    "echo '== hashes'",
    "while read -r _id _parent _dev _root mp _rest; do "
    "if [ -S \"$mp\" ]; then echo \"socket $mp\"; elif [ -f \"$mp\" ]; then sha256sum \"$mp\"; fi; "
    "done < /proc/self/mountinfo",
    "echo '== links'",
    f"for d in {' '.join(LIB_DIRS)}; do [ -d $d ] && find $d -type l | while read -r l; do "
    "echo \"$l $(readlink \"$l\")\"; done; done",
    "echo '== end'",
])  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    visible: str  # NVIDIA_VISIBLE_DEVICES for the hook and the shim
    capabilities: str  # NVIDIA_DRIVER_CAPABILITIES
    cdi: str | None  # the CDI device asking for the same, None where CDI has no counterpart


CASES = [
    Case("one GPU", "0", "all", "nvidia.com/gpu=0"),
    Case("all", "all", "all", "nvidia.com/gpu=all"),
    Case("MIG device", "1:1", "all", "nvidia.com/gpu=1:1"),
    Case("none", "none", "all", None),
    Case("utility only", "2", "utility", None),
]


def _sections(stdout: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = ""
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = line[3:]
            out[current] = []
        elif current:
            out[current].append(line)
    assert "end" in out, f"probe did not finish:\n{stdout}"
    return out


def _runtime_mount(mount_point: str) -> bool:
    return (mount_point == "/" or mount_point in RUNTIME_MOUNTS
            or any(mount_point == p or mount_point.startswith(p + "/") for p in ("/proc", "/sys", "/dev")))


FLAGS = ("ro", "rw", "nosuid", "nodev", "noexec")


def view(stdout: str, rootfs: Path) -> dict[str, Any]:
    """The comparable view of one container, from the probe's output and its rootfs after the run."""
    s = _sections(stdout)
    mounts = {}
    for line in s["mounts"]:
        mount_point, opts = line.rsplit(" ", 1)
        if not _runtime_mount(mount_point):
            mounts[mount_point] = ",".join(o for o in opts.split(",") if o in FLAGS)
    hashes = {}
    for line in s["hashes"]:
        kind, path = line.split(None, 1)
        if path in mounts:
            hashes[path] = kind  # the sha256, or "socket"
    cache = rootfs / "etc/ld.so.cache"
    entries = sorted((e.key, e.value, e.flags) for e in _native.read_ldcache(str(cache))) if cache.exists() else []
    conf = rootfs / "etc/ld.so.conf.d/00-gpuhook.conf"
    return {
        "nodes": sorted(s["nodes"]),
        "mounts": dict(sorted(mounts.items())),
        "hashes": dict(sorted(hashes.items())),
        "links": sorted(s["links"]),
        "ldcache": entries,
        "ldconf": conf.read_text() if conf.exists() else None,
    }


@pytest.fixture(scope="module")
def fake(fake_driver_factory: Any) -> FakeDriver:
    return fake_driver_factory(gpus=4, mig=FAKE_MIG_LAYOUT)  # GPU 1 in MIG mode


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, fake: FakeDriver) -> Iterator[Podman]:
    podman = need_podman()
    need_busybox()
    for tool in ("gpuhook", "gpuhook-hook", "gpuhook-runtime"):
        assert (BIN / tool).exists(), f"{tool} is not installed next to the test interpreter"
    world = Podman.create(tmp_path_factory.mktemp("podman"), podman)
    subprocess.run(
        [sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", str(fake.root),
         "--proc-root", str(fake.root / "proc"), "--hook-path", default_hook_path(),
         "--output", str(world.spec_dir / "nvidia.yaml")],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    yield world
    world.close()


def hook_config(tmp: Path, fake: FakeDriver) -> Path:
    path = tmp / "config.toml"
    path.write_text(f'driver-root = "{fake.root}"\nproc-root = "{fake.root}/proc"\nlog-file = "{tmp}/gpuhook.log"\n'
                    f'inventory-cache = "{tmp}/inventory.json"\n')
    return path


def rootfs_for(tmp: Path, door: str) -> tuple[Path, Path]:
    bundle = tmp / door
    rootfs = glibc_rootfs(bundle, probe_cache=tmp.parent / "probe")
    (rootfs / "bin/sha256sum").symlink_to("busybox")
    return bundle, rootfs


def through_hook(tmp: Path, fake: FakeDriver, case: Case) -> dict[str, Any]:
    bundle, rootfs = rootfs_for(tmp, "hook")
    config = hook_config(tmp, fake)
    hooks = {"prestart": [{"path": hook_binary(), "args": ["gpuhook-hook", "--config", str(config)],
                           "env": hook_env()}]}
    make_bundle(bundle, rootfs, ["sh", "-c", PROBE], env=env(case), hooks=hooks)
    result = runc_run(bundle, unique_id("cons-hook"))
    assert result.returncode == 0, result.stderr
    return view(result.stdout, rootfs)


def through_shim(tmp: Path, fake: FakeDriver, case: Case) -> dict[str, Any]:
    bundle, rootfs = rootfs_for(tmp, "shim")
    make_bundle(bundle, rootfs, ["sh", "-c", PROBE], env=env(case))
    cid = unique_id("cons-shim")
    run_env = dict(os.environ, GPUHOOK_CONFIG=str(hook_config(tmp, fake)), GPUHOOK_RUNTIME="runc")
    try:
        result = subprocess.run([str(BIN / "gpuhook-runtime"), "run", "--bundle", str(bundle), cid],
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, env=run_env, timeout=60,
                                check=False)  # fmt: skip
    finally:
        runc_delete(cid)
    assert result.returncode == 0, result.stderr
    return view(result.stdout, rootfs)


def through_cdi(tmp: Path, world: Podman, case: Case) -> dict[str, Any]:
    assert case.cdi is not None
    _, rootfs = rootfs_for(tmp, "cdi")
    result = world.sh(rootfs, [case.cdi], PROBE)
    assert result.returncode == 0, result.stderr
    return view(result.stdout, rootfs)


def env(case: Case) -> list[str]:
    return [f"NVIDIA_VISIBLE_DEVICES={case.visible}", f"NVIDIA_DRIVER_CAPABILITIES={case.capabilities}"]


def assert_same(views: dict[str, dict[str, Any]]) -> None:
    (first, reference), *others = views.items()
    for door, seen in others:
        for key in reference:
            assert seen[key] == reference[key], f"{key}: {door} differs from {first}"


def without_32bit(seen: dict[str, Any]) -> dict[str, Any]:
    """The view less what `compat32` adds (the 32-bit libraries, their links, cache entries and folder): a CDI
    spec holds none, as nvidia-ctk's (v1.20.0 pkg/lookup/ldcache.go: only the cache's 64-bit entries), while the
    hook and the shim give them for NVIDIA_DRIVER_CAPABILITIES=all, as libnvidia-container does."""
    lib32 = LIB32_DIR + "/"
    conf = seen["ldconf"]
    folders = conf if conf is None else "".join(f"{d}\n" for d in conf.split() if not (d + "/").startswith(lib32))
    return {**seen,
            "mounts": {k: v for k, v in seen["mounts"].items() if not k.startswith(lib32)},
            "hashes": {k: v for k, v in seen["hashes"].items() if not k.startswith(lib32)},
            "links": [line for line in seen["links"] if not line.startswith(lib32)],
            "ldcache": [e for e in seen["ldcache"] if not e[1].startswith(lib32)],
            "ldconf": folders}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_front_doors_agree(world: Podman, fake: FakeDriver, tmp_path: Path, case: Case) -> None:
    views = {"hook": through_hook(tmp_path, fake, case), "shim": through_shim(tmp_path, fake, case)}
    assert_same(views)
    seen = views["hook"]
    if case.cdi is not None:
        assert_same({"hook less compat32": without_32bit(seen), "cdi": through_cdi(tmp_path, world, case)})
        if fake.compat32 and case.capabilities == "all":  # the hook's 32-bit part exists, so the CDI door lacks it
            assert any(path.startswith(LIB32_DIR + "/") for path in seen["mounts"])
    # and the view is not trivially empty: the request's nodes, libraries, links and cache are there
    nodes = {line.split()[0] for line in seen["nodes"]}
    assert "/dev/nvidiactl" in nodes
    gpu_nodes = {n for n in nodes if n[len("/dev/nvidia"):].isdigit()}
    expected = {"one GPU": {"/dev/nvidia0"}, "all": {f"/dev/nvidia{g.minor}" for g in fake.gpus},
                "MIG device": {f"/dev/nvidia{fake.gpus[1].minor}"}, "none": set(),
                "utility only": {f"/dev/nvidia{fake.gpus[2].minor}"}}[case.name]
    assert gpu_nodes == expected
    if case.name == "MIG device":
        assert set(fake.gpus[1].mig_devices[1].cap_nodes) <= nodes
    assert "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + fake.driver_version in seen["mounts"]
    assert all(flags.startswith("ro,") for path, flags in seen["mounts"].items() if "/lib" in path)
    assert any(line.endswith(" libnvidia-ml.so.1") for line in seen["links"])
    keys = {key for key, _, _ in seen["ldcache"]}
    assert "libnvidia-ml.so.1" in keys
    assert ("libcuda.so.1" in keys) == (case.capabilities == "all")
