"""The CDI command line as users and runtimes call it: `gpuhook generate-cdi`, `cdi validate|list`, `cdi-hook`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import need_root, need_tool

from gpuhook.cdi import codec
from gpuhook.fakedriver import FakeDriver
from gpuhook.fileio.atomic import WriteError, write_atomic

HOOK = "/usr/local/bin/gpuhook"


def gpuhook(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuhook.cli", *args], input=stdin, capture_output=True, text=True,
                          check=False)


def generate(fake: FakeDriver, *args: str) -> subprocess.CompletedProcess[str]:
    return gpuhook("generate-cdi", "--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc"),
                   "--hook-path", HOOK, *args)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuhook: "), result.stderr
    return lines[0]


def names(spec: dict) -> list[str]:  # type: ignore[type-arg]
    return [d["name"] for d in spec["devices"]]


# --- generate-cdi ------------------------------------------------------------------------------------------------

def test_stdout_yaml(fake_driver: FakeDriver) -> None:
    result = generate(fake_driver)
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load(result.stdout)
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "nvidia.com/gpu"
    assert names(spec) == ["0", fake_driver.gpus[0].uuid, "1", fake_driver.gpus[1].uuid, "all"]
    assert spec["containerEdits"]["hooks"][0]["path"] == HOOK
    assert result.stderr == ""


def test_options(fake_driver_mig: FakeDriver) -> None:
    result = generate(fake_driver_mig, "--vendor", "example.com", "--class", "accel", "--device-name-strategy",
                      "type-index", "--format", "json", "--cdi-version", "0.6.0")
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)
    assert spec["kind"] == "example.com/accel" and spec["cdiVersion"] == "0.6.0"
    assert names(spec) == ["gpu0", "mig1:0", "mig1:1", "mig1:2", "gpu2", "gpu3", "all"]


def test_output_file_is_atomic_and_0644(fake_driver: FakeDriver, tmp_path: Path) -> None:
    out = tmp_path / "new" / "dir" / "nvidia.yaml"
    old_umask = os.umask(0o077)
    try:
        result = generate(fake_driver, "--output", str(out))
    finally:
        os.umask(old_umask)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert out.read_text() == generate(fake_driver).stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["nvidia.yaml"]  # no temp file left behind
    assert gpuhook("cdi", "validate", str(out)).returncode == 0


def test_json_by_extension(fake_driver: FakeDriver, tmp_path: Path) -> None:
    out = tmp_path / "nvidia.json"
    assert generate(fake_driver, "-o", str(out)).returncode == 0
    assert json.loads(out.read_text())["cdiVersion"] == "0.5.0"


def test_yml_gets_a_note(fake_driver: FakeDriver, tmp_path: Path) -> None:
    result = generate(fake_driver, "-o", str(tmp_path / "nvidia.yml"))
    assert result.returncode == 0
    assert "will be ignored" in result.stderr


def test_cdi_version_too_low(fake_driver: FakeDriver) -> None:
    line = one_error_line(generate(fake_driver, "--cdi-version", "0.4.0"))
    assert "0.4.0" in line and "0.5.0" in line
    assert "unknown cdiVersion" in one_error_line(generate(fake_driver, "--cdi-version", "2.0"))


def test_usage_errors_exit_2(fake_driver: FakeDriver) -> None:
    assert generate(fake_driver, "--device-name-strategy", "bus").returncode == 2
    assert generate(fake_driver, "--format", "toml").returncode == 2


def test_no_driver(tmp_path: Path) -> None:
    result = gpuhook("generate-cdi", "--driver-root", str(tmp_path), "--proc-root", str(tmp_path / "proc"),
                     "--hook-path", HOOK)
    assert "no NVIDIA driver found" in one_error_line(result)
    assert result.stdout == ""


def test_bad_vendor_is_one_line(fake_driver: FakeDriver) -> None:
    assert "invalid vendor name" in one_error_line(generate(fake_driver, "--vendor", "-x"))


def test_procfs_fallback_when_nvml_fails(fake_driver_mig: FakeDriver) -> None:
    nvml = yaml.safe_load(generate(fake_driver_mig).stdout)
    fake_driver_mig.set_fail_init()
    try:
        result = generate(fake_driver_mig)
        strict = generate(fake_driver_mig, "--discovery", "nvml")
    finally:
        fake_driver_mig.set_fail_init(False)
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load(result.stdout)
    migs = [f"1:{m.index}" for m in fake_driver_mig.gpus[1].mig_devices]
    # procfs knows GPU UUIDs but not MIG UUIDs: MIG devices keep their index names only
    assert names(spec) == ["0", fake_driver_mig.gpus[0].uuid, *migs, "2", fake_driver_mig.gpus[2].uuid, "3",
                           fake_driver_mig.gpus[3].uuid, "all"]
    assert by_name(spec)["all"] == by_name(nvml)["all"]
    assert spec["containerEdits"] == nvml["containerEdits"]
    one_error_line(strict)


def by_name(spec: dict) -> dict:  # type: ignore[type-arg]
    return {d["name"]: d["containerEdits"] for d in spec["devices"]}


def test_disk_full_keeps_the_previous_spec(fake_driver: FakeDriver, tmp_path: Path) -> None:
    need_root()
    need_tool("unshare")
    mnt = tmp_path / "cdi"
    mnt.mkdir()
    script = f"""
set -e
mount -t tmpfs -o size=16k tmpfs {mnt}
printf 'previous spec\\n' > {mnt}/nvidia.yaml
set +e
{sys.executable} -m gpuhook.cli generate-cdi --driver-root {fake_driver.root} --proc-root {fake_driver.root}/proc \
    --hook-path {HOOK} --output {mnt}/nvidia.yaml 2>{tmp_path}/stderr
echo "rc=$?"
cat {mnt}/nvidia.yaml
ls -a {mnt}
"""
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "rc=1"
    assert lines[1] == "previous spec"
    assert sorted(lines[2:]) == [".", "..", "nvidia.yaml"]  # the temp file is gone
    stderr = (tmp_path / "stderr").read_text().splitlines()
    assert len(stderr) == 1 and f"cannot write {mnt}/nvidia.yaml" in stderr[0] and "ENOSPC" in stderr[0], stderr


# --- write_atomic ------------------------------------------------------------------------------------------------

def test_write_atomic_failure_leaves_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "spec.yaml"
    write_atomic(str(target), b"old\n", 0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600

    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriteError, match=r"cannot write .*spec\.yaml: No space left on device \(ENOSPC\)"):
        write_atomic(str(target), b"new\n")
    assert target.read_bytes() == b"old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["spec.yaml"]


def test_write_atomic_parent_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(WriteError, match="ENOTDIR|EEXIST"):
        write_atomic(str(tmp_path / "file" / "spec.yaml"), b"x")


# --- cdi validate / list -----------------------------------------------------------------------------------------

def spec_text(*device_names: str, kind: str = "nvidia.com/gpu") -> str:
    devices = [{"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}} for n in device_names]
    return codec.dumps({"cdiVersion": "0.5.0", "kind": kind, "devices": devices})


def test_validate(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(spec_text("0", "all"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec_text("0", "0", "-x").replace("0.5.0", "0.3.0"))
    result = gpuhook("cdi", "validate", str(good))
    assert result.returncode == 0 and result.stdout == f"{good}: ok\n"
    result = gpuhook("cdi", "validate", str(good), str(bad))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == f"{good}: ok"
    assert f"{bad}: $.devices[1].name: duplicate device name '0' (also $.devices[0])" in lines
    assert any(line.startswith(f"{bad}: $.devices[2].name: invalid device name") for line in lines)
    assert any(line.startswith(f"{bad}: $.cdiVersion: cdiVersion 0.3.0 is below 0.5.0") for line in lines)
    assert result.stderr == "gpuhook: 3 problem(s) in 1 of 2 spec file(s)\n"
    assert gpuhook("cdi", "validate").returncode == 2


def test_list(tmp_path: Path) -> None:
    low, high = tmp_path / "etc", tmp_path / "run"
    low.mkdir()
    high.mkdir()
    (low / "a.yaml").write_text(spec_text("0", "1", "all"))
    (low / "b.json").write_text(spec_text("x", kind="example.com/net"))
    (low / "c.yml").write_text(spec_text("ignored"))  # loaders read only .yaml and .json
    (high / "a.yaml").write_text(spec_text("1", "2"))  # the later directory wins for "1"
    result = gpuhook("cdi", "list", "--spec-dir", str(low), "--spec-dir", str(high))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["example.com/net=x", "nvidia.com/gpu=0", "nvidia.com/gpu=1",
                                          "nvidia.com/gpu=2", "nvidia.com/gpu=all"]
    (high / "b.yaml").write_text(spec_text("2", "3"))  # same priority as high/a.yaml: "2" becomes unresolvable
    (high / "broken.yaml").write_text("cdiVersion: [")
    result = gpuhook("cdi", "list", "--spec-dir", str(low), "--spec-dir", str(high))
    assert result.returncode == 1
    assert "nvidia.com/gpu=2" not in result.stdout.splitlines()
    assert "nvidia.com/gpu=3" in result.stdout.splitlines()
    err = result.stderr.splitlines()
    assert f"gpuhook: conflict: nvidia.com/gpu=2 defined at one priority by {high}/a.yaml, {high}/b.yaml " \
           "(unresolvable)" in err
    assert any(line.startswith(f"gpuhook: invalid spec: {high}/broken.yaml: not valid YAML/JSON") for line in err)


def test_list_default_dirs_missing_is_empty(tmp_path: Path) -> None:
    result = gpuhook("cdi", "list", "--spec-dir", str(tmp_path / "none"))
    assert result.returncode == 0 and result.stdout == ""


# --- cdi-hook ----------------------------------------------------------------------------------------------------

def bundle(tmp_path: Path, root_path: str = "rootfs") -> tuple[Path, str]:
    b = tmp_path / "bundle"
    (b / "rootfs").mkdir(parents=True)
    (b / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": root_path}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                        "bundle": str(b)})
    return b, state


def test_create_symlinks(tmp_path: Path) -> None:
    b, state = bundle(tmp_path)
    rootfs = b / "rootfs"
    (rootfs / "real").mkdir()
    (rootfs / "usr").symlink_to("/real")  # an image's absolute link: followed as if the rootfs were /
    (rootfs / "opt").mkdir()
    (rootfs / "opt/file").write_text("x")
    result = gpuhook("cdi-hook", "create-symlinks", "--link", "libcuda.so.1::/usr/lib/libcuda.so",
                     "--link", "y::/opt/file", stdin=state)
    assert result.returncode == 0, result.stderr
    assert os.readlink(rootfs / "real/lib/libcuda.so") == "libcuda.so.1"
    assert (rootfs / "opt/file").read_text() == "x"  # an existing file is left alone


def test_create_symlinks_never_leaves_the_rootfs(tmp_path: Path) -> None:
    b, state = bundle(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (b / "rootfs/usr").symlink_to(outside)  # a hostile image aiming at a host directory
    result = gpuhook("cdi-hook", "create-symlinks", "--link", "libcuda.so.1::/usr/lib/libcuda.so", stdin=state)
    if result.returncode:
        one_error_line(result)
    assert list(outside.iterdir()) == []


def test_create_symlinks_absolute_root(tmp_path: Path) -> None:
    b, state = bundle(tmp_path)
    (b / "config.json").write_text(json.dumps({"root": {"path": str(b / "rootfs")}}))
    result = gpuhook("cdi-hook", "create-symlinks", "--link", "a::/b", stdin=state)
    assert result.returncode == 0, result.stderr
    assert os.readlink(b / "rootfs/b") == "a"


def test_hook_bad_input(tmp_path: Path) -> None:
    assert "not JSON" in one_error_line(gpuhook("cdi-hook", "create-symlinks", "--link", "a::/b", stdin="{"))
    missing = json.dumps({"id": "c", "pid": 1, "bundle": str(tmp_path / "nowhere")})
    assert "config.json" in one_error_line(gpuhook("cdi-hook", "create-symlinks", "--link", "a::/b", stdin=missing))
    assert gpuhook("cdi-hook", "create-symlinks", "--link", "a:/b", stdin="{}").returncode == 2
    assert gpuhook("cdi-hook", "create-symlinks", "--link", "a::b", stdin="{}").returncode == 2
    assert gpuhook("cdi-hook", "update-ldcache", "--folder", "lib", stdin="{}").returncode == 2


def test_update_ldcache(tmp_path: Path) -> None:
    need_root()
    from support.glibc import MULTIARCH, glibc_rootfs

    rootfs = glibc_rootfs(tmp_path / "b", probe_cache=tmp_path / "probe")
    b = tmp_path / "b"
    (b / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}}))
    state = json.dumps({"id": "c1", "pid": os.getpid(), "bundle": str(b)})
    (rootfs / "opt/gpu").mkdir(parents=True)
    libc = rootfs / MULTIARCH / "libc.so.6"
    (rootfs / "opt/gpu/libc.so.6").write_bytes(libc.read_bytes())
    result = gpuhook("cdi-hook", "update-ldcache", "--folder", "/opt/gpu", stdin=state)
    assert result.returncode == 0, result.stderr
    assert "/opt/gpu" in (rootfs / "etc/ld.so.conf.d/00-gpuhook.conf").read_text().split()
    assert b"/opt/gpu/libc.so.6" in (rootfs / "etc/ld.so.cache").read_bytes()
    bad = gpuhook("cdi-hook", "update-ldcache", "--folder", "/opt/gpu", "--ldconfig-path", "/nonexistent",
                  stdin=state)
    assert "/nonexistent" in one_error_line(bad)


# --- import weight -----------------------------------------------------------------------------------------------

def test_hook_path_imports_stay_light() -> None:
    code = ("import sys, gpuhook.cli.cdi, gpuhook.cdi.names; "
            "print(sorted(m for m in ('yaml', 'jsonschema', 'referencing', 'gpuhook.discover') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_generate_cdi_serves_a_fresh_inventory_cache(fake_driver_factory: Any, tmp_path: Path) -> None:
    """--inventory-cache: the first run discovers and keeps the inventory; while the driver's fingerprint holds,
    later runs are served from it (no NVML, no scan); '' turns the cache off."""
    fake = fake_driver_factory(gpus=2, fresh=True)
    cache = tmp_path / "inventory.json"
    first = generate(fake, "--inventory-cache", str(cache))
    assert first.returncode == 0, first.stderr
    data = json.loads(cache.read_text())
    marked = "GPU-cac4ed00-1111-2222-3333-444444444444"
    original = data["gpus"][1]["uuid"]
    data["gpus"][1]["uuid"] = marked
    cache.write_text(json.dumps(data))
    fake.set_fail_init(True)  # a rediscovery would have to fall back to procfs
    try:
        cached = generate(fake, "--inventory-cache", str(cache))
        assert cached.returncode == 0, cached.stderr
        assert f"name: {marked}" in cached.stdout and original not in cached.stdout
        off = generate(fake, "--inventory-cache", "")
        assert off.returncode == 0, off.stderr
        assert marked not in off.stdout and f"name: {original}" in off.stdout
    finally:
        fake.set_fail_init(False)
