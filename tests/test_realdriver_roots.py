"""The real-driver test roots (tests/support/realdriver.py) are what they claim to be.

NVIDIA's own 535 user-space files, laid out as the .run installer and as Debian's packages do, over the
simulated kernel side: the root's ld.so.cache finds the real libraries, and the real libcuda, libnvidia-ml
and nvidia-smi, run on this machine without a kernel driver, fail exactly as they do on a host whose
driver is not loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.realdriver import (
    DEBIAN_LIB_DIR,
    LAYOUTS,
    LIB_DIR,
    RealRoot,
    elf_dynamic,
    parse_alternatives,
    resolve_in_root,
    run_nvidia,
)

# What 535 reports from cuDriverGetVersion: CUDA 12.2.
CUDA_12_2 = 12020
CUDA_ERROR_NO_DEVICE = 100
NVML_ERROR_DRIVER_NOT_LOADED = 9


@pytest.fixture(params=LAYOUTS)
def real_root(request: pytest.FixtureRequest) -> RealRoot:
    return request.getfixturevalue(f"real_driver_{request.param}")


def _no_host_driver() -> None:
    """The child-process checks expect no NVIDIA kernel driver loaded on this machine."""
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA kernel driver loaded: the real libraries would talk to it")


def ldconfig_cache(root: RealRoot) -> dict[str, list[tuple[str, str]]]:
    """soname -> [(flags, path)] from `ldconfig -p -C <root>/etc/ld.so.cache` (glibc's own reader)."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    out = subprocess.run(
        [ldconfig, "-p", "-C", str(root.host_path("/etc/ld.so.cache"))], capture_output=True, text=True, check=True
    ).stdout
    entries: dict[str, list[tuple[str, str]]] = {}
    for m in re.finditer(r"^\s+(\S+) \(([^)]*)\) => (\S+)$", out, re.M):
        entries.setdefault(m[1], []).append((m[2], m[3]))
    return entries


def _child(code: str, *args: str) -> dict:
    """Run NVIDIA's code in a child that cannot make device nodes on the host (run_nvidia checks)."""
    proc = run_nvidia([sys.executable, "-c", code, *args])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("soname", ["libcuda.so.1", "libnvidia-ml.so.1"])
def test_ld_cache_resolves_driver_library_to_real_file(real_root: RealRoot, soname: str) -> None:
    entries = ldconfig_cache(real_root)
    assert soname in entries, f"{soname} not in {real_root.root}/etc/ld.so.cache"
    [(flags, path)] = entries[soname]
    assert "x86-64" in flags
    real = real_root.resolve(path)
    assert real.is_file() and not real.is_symlink()
    stem = soname.split(".so")[0]
    assert real.name == f"{stem}.so.{real_root.driver_version}"
    assert str(real.parent).endswith(real_root.lib_dir)
    assert elf_dynamic(real) == elf_dynamic(real_root.package_files()[f"{real_root.lib_dir}/{real.name}"])
    info = elf_dynamic(real)
    assert info is not None and info.soname == soname


def test_native_ld_cache_reader_agrees_with_ldconfig(real_root: RealRoot) -> None:
    native = pytest.importorskip("gpuhook._native")
    ours = {(e.key, e.value) for e in native.read_ldcache(real_root.host_path("/etc/ld.so.cache"))}
    glibc = {(key, path) for key, rows in ldconfig_cache(real_root).items() for _, path in rows}
    assert ours == glibc


def test_only_nvidia_user_space_files(real_root: RealRoot) -> None:
    """No simulated library, tool, firmware or config is left: every such file is one NVIDIA's packages ship."""
    expected = set(real_root.package_files())
    ours = {"/etc/ld.so.cache", "/etc/ld.so.conf", f"/etc/ld.so.conf.d/{LIB_DIR.rsplit('/', 1)[1]}.conf"}
    stray = []
    for top in ("usr", "lib", "etc", "opt"):
        base = real_root.host_path(f"/{top}")
        if base.is_symlink() or not base.is_dir():
            continue
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                path = Path(dirpath) / name
                if path.is_symlink():
                    continue
                canonical = "/" + path.relative_to(real_root.root).as_posix()
                alias = "/" + canonical.removeprefix("/usr/") if canonical.startswith("/usr/lib/") else canonical
                if canonical not in expected | ours and alias not in expected:
                    stray.append(canonical)
    assert stray == []
    # And everything the packages ship is there.
    missing = [c for c in expected if not real_root.resolve(c).is_file()]
    assert missing == []


def test_kernel_side_is_simulated_with_the_same_version(real_root: RealRoot) -> None:
    ctl = real_root.dev_root / "dev/nvidiactl"
    assert stat.S_ISCHR(ctl.lstat().st_mode) and os.major(ctl.lstat().st_rdev) == 195
    assert os.minor(ctl.lstat().st_rdev) == 255
    assert stat.S_ISCHR((real_root.dev_root / "dev/nvidia0").lstat().st_mode)
    version = (real_root.proc_root / "driver/nvidia/version").read_text()
    assert f"Kernel Module  {real_root.driver_version}" in version
    assert real_root.driver_version.startswith("535.")
    assert real_root.host_path("/var/run/nvidia-persistenced/socket").is_socket()


def test_firmware_and_configs_in_place(real_root: RealRoot) -> None:
    v = real_root.driver_version
    for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        assert real_root.resolve(f"/lib/firmware/nvidia/{v}/{name}").stat().st_size > 1 << 20
    configs = {
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": "libEGL_nvidia.so.0",
        "/usr/share/vulkan/icd.d/nvidia_icd.json": "libGLX_nvidia.so.0",
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json": "libGLX_nvidia.so.0",
        "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json": "libnvidia-egl-wayland.so.1",
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json": "libnvidia-egl-gbm.so.1",
    }
    cache = ldconfig_cache(real_root)
    for path, library in configs.items():
        data = json.loads(real_root.resolve(path).read_text())
        assert (data.get("ICD") or data.get("layer"))["library_path"] == library
        assert library in cache, f"{path} names {library}, which the root's loader cannot find"
    assert real_root.resolve("/etc/OpenCL/vendors/nvidia.icd").read_text().strip() == "libnvidia-opencl.so.1"
    assert real_root.resolve("/usr/share/nvidia/nvoptix.bin").stat().st_size > 1 << 20
    assert real_root.resolve("/usr/lib/xorg/modules/drivers/nvidia_drv.so").is_file()


# ---- the two layouts ----------------------------------------------------------------------------------


def test_runfile_layout_is_flat_with_soname_links(real_driver_runfile: RealRoot) -> None:
    real = real_driver_runfile
    v = real.driver_version
    assert not real.host_path(DEBIAN_LIB_DIR).exists()
    libs = real.libraries()
    assert f"{LIB_DIR}/libcuda.so.{v}" in libs and f"{LIB_DIR}/libnvidia-ml.so.{v}" in libs
    for canonical, soname in libs.items():
        folder, name = canonical.rsplit("/", 1)
        if soname and soname != name:
            link = real.host_path(f"{folder}/{soname}")
            assert link.is_symlink() and os.readlink(link) == name, canonical
    assert os.readlink(real.host_path(f"{LIB_DIR}/gbm/nvidia-drm_gbm.so")) == "../libnvidia-allocator.so.1"
    assert real.resolve(f"{LIB_DIR}/gbm/nvidia-drm_gbm.so").name == f"libnvidia-allocator.so.{v}"
    glxserver = real.host_path(f"/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.{v}")
    assert glxserver.is_file() and not glxserver.is_symlink()
    assert real.host_path(f"{LIB_DIR}/vdpau/libvdpau_nvidia.so.1").is_symlink()
    for tool in (
        "nvidia-smi",
        "nvidia-debugdump",
        "nvidia-persistenced",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
    ):
        path = real.host_path(f"/usr/bin/{tool}")
        assert path.is_file() and not path.is_symlink() and os.access(path, os.X_OK), tool
    assert not real.host_path("/etc/alternatives").exists()


def test_debian_layout_finds_libraries_through_alternatives(real_driver_debian: RealRoot) -> None:
    real = real_driver_debian
    v = real.driver_version
    assert not real.host_path("/etc/ld.so.conf.d/nvidia.conf").exists()  # Debian adds no loader path
    link = real.host_path(f"{LIB_DIR}/libcuda.so.1")
    assert os.readlink(link) == "/etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu"
    assert os.readlink(real.host_path("/etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu")) == (
        f"{DEBIAN_LIB_DIR}/libcuda.so.1"
    )
    assert resolve_in_root(real.root, f"{LIB_DIR}/libnvidia-ml.so.1") == f"{DEBIAN_LIB_DIR}/libnvidia-ml.so.{v}"
    assert resolve_in_root(real.root, "/usr/bin/nvidia-smi") == "/usr/lib/nvidia/current/nvidia-smi"
    assert resolve_in_root(real.root, "/usr/share/nvidia/nvoptix.bin") == f"{DEBIAN_LIB_DIR}/nvoptix.bin"
    assert resolve_in_root(real.root, "/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so") == (
        f"/usr/lib/nvidia/current/libglxserver_nvidia.so.{v}"
    )
    # The GL core libraries are not in nvidia/current and have no alternative: their soname is their name.
    assert real.host_path(f"{LIB_DIR}/libnvidia-glcore.so.{v}").is_file()
    # bookworm ships no gbm/ folder, so the alternative for the GBM backend is not made.
    assert not real.host_path(f"{LIB_DIR}/gbm/nvidia-drm_gbm.so").exists()
    assert real.host_path("/usr/sbin/nvidia-cuda-mps-server").is_file()


def test_debian_alternatives_come_from_the_postinst(real_driver_debian: RealRoot) -> None:
    real = real_driver_debian
    postinst = (real.unpacked["nvidia-alternative"] / "control/postinst").read_text()
    alt = parse_alternatives(real.root, postinst)
    assert (alt.link, alt.name, alt.path) == ("/usr/lib/nvidia/nvidia", "nvidia", "/usr/lib/nvidia/current")
    links = {link: path for link, _, path in alt.slaves}
    assert links[f"{LIB_DIR}/libcuda.so.1"] == f"{DEBIAN_LIB_DIR}/libcuda.so.1"
    assert links["/usr/bin/nvidia-smi"] == "/usr/lib/nvidia/current/nvidia-smi"
    assert not any(link.startswith("/usr/lib/i386-linux-gnu/") for link in links)  # no 32-bit packages here


def test_elf_reader_matches_readelf(real_driver_runfile: RealRoot) -> None:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils)")
    path = real_driver_runfile.host_path(f"{LIB_DIR}/libnvidia-encode.so.{real_driver_runfile.driver_version}")
    out = subprocess.run([readelf, "-d", str(path)], capture_output=True, text=True, check=True).stdout
    info = elf_dynamic(path)
    assert info is not None
    assert info.soname == re.search(r"\(SONAME\).*\[(.*)\]", out)[1]
    assert list(info.needed) == re.findall(r"\(NEEDED\).*\[(.*)\]", out)


# ---- NVIDIA's code, run here without a kernel driver ----------------------------------------------------

_CUDA = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
version = ctypes.c_int(-1)
rc_version = lib.cuDriverGetVersion(ctypes.byref(version))
rc_init = lib.cuInit(0)
name = ctypes.c_char_p()
lib.cuGetErrorName(rc_init, ctypes.byref(name))
print(json.dumps({"rc_version": rc_version, "version": version.value, "rc_init": rc_init,
                  "name": (name.value or b"").decode()}))
"""

_NVML = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.nvmlErrorString.restype = ctypes.c_char_p
rc = lib.nvmlInit_v2()
print(json.dumps({"rc": rc, "error": lib.nvmlErrorString(rc).decode()}))
"""


def test_real_libcuda_reports_cuda_12_2_and_no_device(real_root: RealRoot) -> None:
    _no_host_driver()
    [(_, path)] = ldconfig_cache(real_root)["libcuda.so.1"]
    result = _child(_CUDA, str(real_root.resolve(path)))
    assert (result["rc_version"], result["version"]) == (0, CUDA_12_2)
    assert real_root.cuda_driver_version == CUDA_12_2 and real_root.cuda_version == "12.2"
    assert (result["rc_init"], result["name"]) == (CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE")


def test_real_nvml_init_says_driver_not_loaded(real_root: RealRoot) -> None:
    _no_host_driver()
    [(_, path)] = ldconfig_cache(real_root)["libnvidia-ml.so.1"]
    result = _child(_NVML, str(real_root.resolve(path)))
    assert result == {"rc": NVML_ERROR_DRIVER_NOT_LOADED, "error": "Driver Not Loaded"}


def test_real_nvidia_smi_cannot_communicate_with_the_driver(real_root: RealRoot) -> None:
    _no_host_driver()
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": real_root.ld_library_path, "LC_ALL": "C"}
    proc = run_nvidia([str(real_root.nvidia_smi)], env=env, timeout=60)
    assert proc.returncode == NVML_ERROR_DRIVER_NOT_LOADED, proc.stdout + proc.stderr
    assert "couldn't communicate with the NVIDIA driver" in proc.stdout + proc.stderr
