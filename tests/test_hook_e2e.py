"""The prestart hook end to end: real runc, a glibc rootfs, the simulated driver, gpuhook-hook in hooks.prestart."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import need_root, need_tool
from support.glibc import glibc_rootfs
from support.hostile import content, hook_binary, hook_env
from support.runc import cgroup2_namespace, make_bundle, need_busybox, runc_run, unique_id

from gpuhook import _native

pytestmark = pytest.mark.e2e
LIBDIR = "usr/lib/x86_64-linux-gnu"
DATA = Path(__file__).parent / "data"


@pytest.fixture()
def e2e(tmp_path: Path) -> Path:
    need_root()
    need_tool("runc")
    need_busybox()
    assert hook_binary(), "gpuhook-hook is not installed next to the test interpreter"
    return tmp_path


def write_config(tmp: Path, root: Path, **extra: Any) -> Path:
    lines = [
        f'driver-root = "{root}"',
        f'proc-root = "{root}/proc"',
        f'log-file = "{tmp}/gpuhook.log"',
        f'inventory-cache = "{tmp}/inventory.json"',
    ]
    for key, value in extra.items():
        lines.append(f"{key.replace('_', '-')} = {json.dumps(value)}")
    path = tmp / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def hooks(config: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        "prestart": [
            {
                "path": hook_binary(),
                "args": ["gpuhook-hook", "--config", str(config), "prestart"],
                "env": hook_env(),
            }
        ]
    }


PROBE = (
    "ls /dev | grep nvidia | sort | tr '\\n' ' '; echo; "
    "for n in /dev/nvidia[0-9]*; do stat -c 'NODE %n %t:%T' $n; cat $n 2>&1 | head -1; done; "
    "grep ' /usr/lib/x86_64-linux-gnu/lib' /proc/self/mountinfo | cut -d' ' -f5,6 | sort; "
    "readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1; "
    "test -x /usr/bin/gpuprobe && /usr/bin/gpuprobe; true"
)


def run(
    tmp: Path,
    fake: Any,
    env: list[str],
    config_extra: dict[str, Any] | None = None,
    capabilities: list[str] | None = None,
    mounts: list[dict[str, Any]] | None = None,
    rootfs: Path | None = None,
) -> tuple[Any, Path]:
    config = write_config(tmp, Path(fake.root), **(config_extra or {}))
    rootfs = rootfs or glibc_rootfs(tmp / "bundle", probe_cache=tmp.parent / "probe")
    bundle = make_bundle(tmp / "bundle", rootfs, ["sh", "-c", PROBE], env=env, hooks=hooks(config), mounts=mounts or ())
    if capabilities:
        spec = json.loads((bundle / "config.json").read_text())
        spec["process"]["capabilities"] = {k: list(capabilities) for k in ("bounding", "effective", "permitted")}
        (bundle / "config.json").write_text(json.dumps(spec))
    return runc_run(bundle, unique_id("hook")), rootfs


def nodes(stdout: str) -> list[str]:
    return stdout.splitlines()[0].split()


def test_one_gpu_by_index(e2e: Path, fake_driver: Any) -> None:
    result, rootfs = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=1"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert nodes(out) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
    assert "NODE /dev/nvidia1 c3:1" in out  # 195 = 0xc3
    assert "No such device or address" in out and "Operation not permitted" not in out
    # the driver libraries are read-only bind mounts
    mounts = [line for line in out.splitlines() if line.startswith("/usr/lib/x86_64-linux-gnu/lib")]
    assert any(line.startswith("/usr/lib/x86_64-linux-gnu/libcuda.so.550") for line in mounts)
    assert all(line.split()[1].startswith("ro,") and "nosuid" in line and "nodev" in line for line in mounts)
    assert "libcuda.so.550.54.15" in out
    assert "cuInit=0 count=1 version=12040" in out
    # the container's ld cache was rebuilt by the host's ldconfig and knows the driver
    entries = {e.key for e in _native.read_ldcache(str(rootfs / "etc/ld.so.cache"))}
    assert {"libcuda.so.1", "libnvidia-ml.so.1"} <= entries
    log = (e2e / "gpuhook.log").read_text().splitlines()
    assert len(log) == 1 and " inject devices=" in log[0] and "took=" in log[0]
    assert log[0].split()[1].startswith("hook-")  # the container id


def test_graphics_gets_dri_nodes_and_by_path_links(e2e: Path, fake_driver: Any) -> None:
    gpu = fake_driver.gpus[0]
    base = f"/dev/dri/by-path/pci-{gpu.pci_bus_id}"
    config = write_config(e2e, Path(fake_driver.root))
    rootfs = glibc_rootfs(e2e / "bundle", probe_cache=e2e.parent / "probe")
    script = f"readlink {base}-card; readlink {base}-render; ls /dev/dri"
    bundle = make_bundle(e2e / "bundle", rootfs, ["sh", "-c", script],
                         env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=graphics"], hooks=hooks(config))
    result = runc_run(bundle, unique_id("hook"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"../card{gpu.dri_card}", f"../renderD{gpu.dri_render}", "by-path",
                                     f"card{gpu.dri_card}", f"renderD{gpu.dri_render}"]


def test_all_gpus(e2e: Path, fake_driver: Any) -> None:
    result, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=all"])
    assert result.returncode == 0, result.stderr
    assert nodes(result.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1", "nvidiactl"]
    assert "count=2" in result.stdout


def test_by_uuid(e2e: Path, fake_driver: Any) -> None:
    uuid = fake_driver.gpus[0].uuid
    result, _ = run(e2e, fake_driver, [f"NVIDIA_VISIBLE_DEVICES={uuid}"])
    assert result.returncode == 0, result.stderr
    assert nodes(result.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"]


def test_mig_device(e2e: Path, fake_driver_mig: Any) -> None:
    gpu = next(g for g in fake_driver_mig.gpus if g.mig_devices)
    mig = gpu.mig_devices[0]
    result, _ = run(e2e, fake_driver_mig, [f"NVIDIA_VISIBLE_DEVICES={mig.uuid}"])
    assert result.returncode == 0, result.stderr
    assert f"nvidia{gpu.minor}" in nodes(result.stdout)
    assert len([n for n in nodes(result.stdout) if n.startswith("nvidia") and n[6:].isdigit()]) == 1


def test_mig_device_without_cap_nodes_fails_the_start(e2e: Path, fake_driver_factory: Any) -> None:
    """No silently smaller container: a MIG device whose nvidia-caps nodes cannot be found is refused."""
    fake = fake_driver_factory(gpus=2, mig={1: ["1g.10gb"]}, fresh=True)
    mig = fake.mig_devices[0]
    Path(fake.host_path(mig.gi_access)).unlink()
    result, _ = run(e2e, fake, [f"NVIDIA_VISIBLE_DEVICES={mig.uuid}"])
    assert result.returncode != 0
    assert "error getting MIG capability device paths" in result.stderr, result.stderr


def test_none_gets_driver_files_but_no_gpu(e2e: Path, fake_driver: Any) -> None:
    result, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=none"])
    assert result.returncode == 0, result.stderr
    assert nodes(result.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]
    assert "cuInit=100 " in result.stdout  # CUDA_ERROR_NO_DEVICE, as a real driver says with no GPU


@pytest.mark.parametrize("env", [["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="], []])
def test_untouched_containers(e2e: Path, fake_driver: Any, env: list[str]) -> None:
    result, rootfs = run(e2e, fake_driver, env)
    assert result.returncode == 0, result.stderr
    assert nodes(result.stdout) == []
    assert "dlopen-failed" in result.stdout
    assert not (rootfs / "etc/ld.so.cache").exists()
    assert " skip request=" in (e2e / "gpuhook.log").read_text()


def test_a_runtime_that_ignored_cdi_devices_is_recorded_for_the_plugin(e2e: Path, fake_driver: Any) -> None:
    """Allocate's marker (sealed with the node's key, as the plugin seals it) beside a variable no CDI spec turned
    to void: the GPU as always, and the record."""
    from gpuhook.fileio.secret import ensure_secret
    from gpuhook.model import cdiignored
    from gpuhook.model.contract import PLUGIN_KEY

    state = e2e / "state"
    state.mkdir()  # the plugin's, where its key is made
    marker = "GPUHOOK_CDI_DEVICES=" + cdiignored.seal(ensure_secret(str(state / PLUGIN_KEY)), "nvidia.com/gpu=1")
    result, rootfs = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=1", marker], {"state_dir": str(state)})
    assert result.returncode == 0, result.stderr
    assert nodes(result.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
    rec = cdiignored.parse((state / "cdi-ignored").read_bytes())
    assert rec is not None and rec.devices == "nvidia.com/gpu=1" and rec.container.startswith("hook-")
    assert "(runtime ignored CDI devices nvidia.com/gpu=1: recorded in " in (e2e / "gpuhook.log").read_text()
    (state / "cdi-ignored").unlink()
    applied, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=void", marker], {"state_dir": str(state)},
                     rootfs=rootfs)
    assert applied.returncode == 0 and nodes(applied.stdout) == []  # the CDI runtime's void: untouched
    assert [p.name for p in state.iterdir()] == [PLUGIN_KEY]


def test_utility_only(e2e: Path, fake_driver: Any) -> None:
    result, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility"])
    assert result.returncode == 0, result.stderr
    assert nodes(result.stdout) == ["nvidia0", "nvidiactl"]
    assert "libnvidia-ml.so.550" in result.stdout and "/libcuda.so.550" not in result.stdout


def test_failed_requirement_fails_the_start(e2e: Path, fake_driver: Any) -> None:
    result, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"])
    assert result.returncode != 0
    assert "unsatisfied requirement 'cuda>=99.0'" in result.stderr and "with cuda 12.4" in result.stderr


def _image_env(name: str) -> list[str]:
    image = next(i for i in yaml.safe_load((DATA / "cuda_images.yaml").read_text())["images"] if i["image"] == name)
    return [f"{k}={v}" for k, v in image["env"].items()]


@pytest.mark.parametrize(("driver", "cuda", "starts"), [
    ("525.147.05", "12.0", True),  # CUDA forward compatibility: brand=nvidia,driver>=525,driver<526
    ("510.108.03", "11.6", False),  # no term holds: 11.6 < 12.2 and 510 is no listed branch
])  # fmt: skip
def test_published_cuda_image_on_driver_branches(e2e: Path, fake_driver_factory: Any, driver: str, cuda: str,
                                                 starts: bool) -> None:
    """tests/data/cuda_images.yaml's nvidia/cuda:12.2.2 environment through runc and the real hook."""
    fake = fake_driver_factory(1, driver_version=driver, cuda_version=cuda)
    env = [*_image_env("nvidia/cuda:12.2.2-base-ubuntu22.04"), "NVIDIA_VISIBLE_DEVICES=all"]
    result, _ = run(e2e, fake, env)
    if starts:
        assert result.returncode == 0, result.stderr
        assert "nvidia0" in nodes(result.stdout)
        return
    assert result.returncode != 0
    line = result.stderr.strip().splitlines()[-1]
    assert "unsatisfied requirement 'cuda>=12.2 brand=tesla,driver>=450,driver<451" in line
    assert f"no term holds with cuda {cuda}, driver {driver}" in line


@pytest.mark.parametrize("destination", [
    "/var/run/nvidia-container-devices/cdi/nvidia.com/gpu/1",  # the kind-style form
    "/var/run/nvidia-container-devices/cdi/nvidia.com/gpu=1",
    "/var/run/nvidia-container-devices/nvidia.com/gpu=1",
])  # fmt: skip
def test_volume_mount_cdi_forms(e2e: Path, fake_driver: Any, destination: str) -> None:
    """NVIDIA's cuda_image.go mount forms: the id is the whole path below the folder; a CDI name is resolved."""
    mount = {"destination": destination, "source": "/dev/null", "type": "bind", "options": ["bind", "ro"]}
    result, _ = run(e2e, fake_driver, [], {"accept_volume_mounts": True}, mounts=[mount])
    assert result.returncode == 0, result.stderr
    assert nodes(result.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]


def test_cdi_annotation_without_kind_and_unknown_name(e2e: Path, fake_driver: Any) -> None:
    """NVIDIA's cdi_test.go: a bare name is nvidia.com/gpu=<name>; one that names no device fails the start."""
    config = write_config(e2e, Path(fake_driver.root))
    for value, ok in (("1", True), ("example.com/device", False)):
        rootfs = glibc_rootfs(e2e / "bundle", probe_cache=e2e.parent / "probe")
        bundle = make_bundle(e2e / "bundle", rootfs, ["sh", "-c", PROBE], env=[], hooks=hooks(config))
        spec = json.loads((bundle / "config.json").read_text())
        spec["annotations"] = {"cdi.k8s.io/gpuhook_gpu": value}
        (bundle / "config.json").write_text(json.dumps(spec))
        result = runc_run(bundle, unique_id("ann"))
        if ok:
            assert result.returncode == 0, result.stderr
            assert "nvidia1" in nodes(result.stdout) and "nvidia0" not in nodes(result.stdout)
        else:
            assert result.returncode != 0
            assert "unknown device 'example.com/device' requested (cdi-annotations)" in result.stderr
        shutil.rmtree(e2e / "bundle")


def test_unknown_device_fails_naming_it(e2e: Path, fake_driver: Any) -> None:
    result, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=7"])
    assert result.returncode != 0
    assert "unknown device '7'" in result.stderr


def test_unprivileged_policy(e2e: Path, fake_driver: Any) -> None:
    extra = {"accept_envvar_unprivileged": False}
    result, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=all"], extra)
    assert result.returncode == 0, result.stderr
    assert "nvidia0" not in result.stdout
    assert "accept-envvar-unprivileged is false" in (e2e / "gpuhook.log").read_text()
    shutil.rmtree(e2e / "bundle")
    privileged, _ = run(
        e2e,
        fake_driver,
        ["NVIDIA_VISIBLE_DEVICES=all"],
        extra,
        capabilities=["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_SYS_ADMIN"],
    )
    assert privileged.returncode == 0, privileged.stderr
    assert "nvidia0" in nodes(privileged.stdout)
    shutil.rmtree(e2e / "bundle")
    mount = {
        "destination": "/var/run/nvidia-container-devices/1",
        "source": "/dev/null",
        "type": "bind",
        "options": ["bind", "ro"],
    }
    # volume-mount requests are off by default (NVIDIA's accept-nvidia-visible-devices-as-volume-mounts)
    ignored, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=all"], extra, mounts=[mount])
    assert ignored.returncode == 0, ignored.stderr
    assert "nvidia1" not in ignored.stdout
    shutil.rmtree(e2e / "bundle")
    by_mount, _ = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=all"], {**extra, "accept_volume_mounts": True},
                      mounts=[mount])
    assert by_mount.returncode == 0, by_mount.stderr
    assert nodes(by_mount.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]


HOSTILE_LINKS = [
    "usr/lib/x86_64-linux-gnu",
    "etc/ld.so.conf.d",
    "dev",
    "etc/ld.so.cache",
    "usr/bin",
    "lib/firmware",
    "var/run",
]


@pytest.mark.parametrize("hostile", HOSTILE_LINKS)
def test_hostile_symlink_to_host_dir(
    e2e: Path, fake_driver: Any, tmp_path_factory: pytest.TempPathFactory, hostile: str
) -> None:
    """An image path that is an absolute symlink to a host dir: the hook adds nothing there.

    runc itself writes through some such links (e.g. /dev's fd/ptmx links), so the host dir after a start
    with a GPU must equal the host dir after the same start without one.
    """
    views = []
    for env in ([], ["NVIDIA_VISIBLE_DEVICES=0"]):
        run_dir = tmp_path_factory.mktemp("hostile-run")
        victim = tmp_path_factory.mktemp("host-victim")
        (victim / "keep.txt").write_text("host data")
        rootfs = glibc_rootfs(run_dir / "bundle", probe_cache=e2e.parent / "probe")
        target = rootfs / hostile
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        target.symlink_to(victim)  # absolute: the host directory when seen from the host
        result, _ = run(run_dir, fake_driver, env, rootfs=rootfs)
        views.append(content(victim))
        if env and result.returncode != 0:
            assert "gpuhook-hook:" in result.stderr  # a clear refusal, not a crash
    assert views[1] == views[0]


def test_cgroup_v2_device_filter(e2e: Path, fake_driver: Any) -> None:
    """runc on cgroup v2 (its eBPF device filter): the hook widens the filter for the GPU node only. That runc
    runs in a mount namespace of its own, so in the suite's service mode the service declines its start and the
    native entry's own fallback runs it (the session's entry has a fallback that fails: a copy with the real one)."""
    from support.service import install_native_entry, service_mode

    config = write_config(e2e, Path(fake_driver.root))
    entry_hooks = hooks(config)
    if service_mode() == "running":
        entry = install_native_entry(e2e / "bin" / "gpuhook-hook")[0]
        entry_hooks = {"prestart": [{"path": entry, "args": ["gpuhook-hook", "--config", str(config), "prestart"],
                                     "env": hook_env()}]}
    rootfs = glibc_rootfs(e2e / "bundle", probe_cache=e2e.parent / "probe")
    # nvidia0 is injected by the hook; a second 195:0 node made by the image itself must stay denied
    script = (
        "cat /dev/nvidia0 2>&1 | head -1; mknod /dev/sneaky c 195 1 2>&1 | head -1; "
        "cat /dev/sneaky 2>&1 | head -1; cat /dev/null && echo null-ok; "
        "cat /sys/fs/cgroup/cgroup.controllers >/dev/null 2>&1 && echo on-v2"
    )
    bundle = make_bundle(
        e2e / "bundle",
        rootfs,
        ["sh", "-c", script],
        env=["NVIDIA_VISIBLE_DEVICES=0"],
        hooks=entry_hooks,
        capabilities=["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_MKNOD"],
    )
    with cgroup2_namespace() as prefix:
        result = runc_run(bundle, unique_id("v2"), prefix=prefix)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "No such device or address" in lines[0]  # allowed by the widened filter
    assert "Operation not permitted" in result.stdout  # 195:1 was never allowed
    assert "null-ok" in result.stdout and "on-v2" in result.stdout
    log = (e2e / "gpuhook.log").read_text()
    assert "cgroup=v2" in log
    if service_mode() == "running":
        assert log.rstrip().endswith(" declined the call)"), log


USERNS_HOST_ID = 100000  # container root in a user namespace, as rootless or userns-remap setups map it


def test_user_namespace_gets_the_host_node_by_bind_mount(e2e: Path, fake_driver: Any) -> None:
    """A container with a user namespace: mknod in its /dev (a tmpfs that belongs to the container's user
    namespace) fails with EOVERFLOW ("Value too large for defined data type") and a node there could not be
    opened anyway; the hook binds the host's node onto an empty file, as runc and libnvidia-container do.
    Opening it gives ENXIO: the simulated driver's node, reached through the device cgroup."""
    work = Path(tempfile.mkdtemp(prefix="gpuhook-userns-", dir="/tmp"))  # every folder above the rootfs must be
    try:  # searchable by the container's root (host uid 100000); pytest's tmp_path is 0700
        work.chmod(0o755)
        rootfs = glibc_rootfs(work / "bundle", probe_cache=e2e.parent / "probe")
        for path in [rootfs, *rootfs.rglob("*")]:
            os.lchown(path, USERNS_HOST_ID, USERNS_HOST_ID)
        config = write_config(e2e, Path(fake_driver.root))
        probe = ("ls /dev | grep nvidia | sort | tr '\\n' ' '; echo; cat /proc/self/uid_map; "
                 "for n in /dev/nvidia0 /dev/nvidiactl; do cat $n 2>&1 | head -1; done; "
                 "readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1")
        bundle = make_bundle(work / "bundle", rootfs, ["sh", "-c", probe], env=["NVIDIA_VISIBLE_DEVICES=0"],
                             hooks=hooks(config))
        spec = json.loads((bundle / "config.json").read_text())
        spec["linux"]["namespaces"].append({"type": "user"})
        mapping = [{"containerID": 0, "hostID": USERNS_HOST_ID, "size": 65536}]
        spec["linux"]["uidMappings"] = mapping
        spec["linux"]["gidMappings"] = mapping
        # cgroupfs cannot be mounted from a user namespace without a cgroup namespace; the probe needs none
        spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/sys/fs/cgroup"]
        (bundle / "config.json").write_text(json.dumps(spec))
        result = runc_run(bundle, unique_id("userns"))
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"], result.stdout
        assert lines[1].split() == ["0", str(USERNS_HOST_ID), "65536"]  # it did run in the user namespace
        assert lines[2].endswith("No such device or address") and lines[3].endswith("No such device or address"), \
            result.stdout
        assert lines[4].startswith("libcuda.so."), result.stdout
        assert " inject " in (e2e / "gpuhook.log").read_text()
        # what the hook created (mount targets, links, folders, its ld.so.conf.d entry and the
        # ld cache) belongs to the container's root, not the host's
        hosts = sorted(str(p.relative_to(rootfs)) for p in rootfs.rglob("*") if p.lstat().st_uid != USERNS_HOST_ID)
        assert hosts == [], f"owned by another uid than the container's root: {hosts[:10]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
