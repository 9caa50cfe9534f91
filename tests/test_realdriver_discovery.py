"""Discovery from NVIDIA's real 535 files, on both layouts: what `info` lists and what the CDI spec mounts.

The expected lists come from the fact sheet of the real packages (docs: /work/notes/realdriver.md, section 5:
what `nvidia-ctk cdi generate --mode=management` mounts on the same root), written out here as data, not
taken from gpuhook's own catalogue.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.realdriver import DEBIAN_LIB_DIR, LIB_DIR, RealRoot, elf_dynamic

HOOK = "/usr/local/bin/gpuhook"

# Every lib*.so.<V> the runfile layout has in LIB_DIR (26), and the debian layout in nvidia/current (20, with
# libvdpau_nvidia there instead of in vdpau/): nvidia-ctk mounts every *.so.<V> in libcuda's folder.
RUNFILE_LIBS = (
    "libcuda", "libcudadebugger", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libnvidia-opencl",
    "libnvidia-allocator", "libnvidia-cfg", "libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow",
    "libnvidia-fbc", "libnvidia-ngx", "libnvoptix", "libGLX_nvidia", "libEGL_nvidia", "libnvidia-vulkan-producer",
    "libGLESv1_CM_nvidia", "libGLESv2_nvidia", "libnvidia-glcore", "libnvidia-tls", "libnvidia-eglcore",
    "libnvidia-glsi", "libnvidia-glvkspirv", "libnvidia-rtcore", "libnvidia-pkcs11-openssl3",
)  # fmt: skip
DEBIAN_OUTSIDE = ("libnvidia-glcore", "libnvidia-tls", "libnvidia-eglcore", "libnvidia-glsi", "libnvidia-glvkspirv",
                  "libnvidia-rtcore", "libnvidia-pkcs11-openssl3")
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control")
NODES = ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
         "/dev/nvidia-modeset")

pytestmark = pytest.mark.usefixtures("no_host_nodes")


def gpuhook(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuhook.cli", *args], capture_output=True, text=True, check=False)


def roots(real: RealRoot) -> list[str]:
    return ["--driver-root", str(real.root), "--proc-root", str(real.proc_root)]


def info(real: RealRoot) -> dict[str, Any]:
    result = gpuhook("info", *roots(real), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def spec(real: RealRoot) -> dict[str, Any]:
    result = gpuhook("generate-cdi", *roots(real), "--hook-path", HOOK, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def all_edits(data: dict[str, Any]) -> tuple[dict[str, str], set[str], list[str]]:
    """What a container asking for `all` gets: container path -> host path, node paths, hook arguments."""
    device = next(d for d in data["devices"] if d["name"] == "all")["containerEdits"]
    common = data["containerEdits"]
    mounts = {m["containerPath"]: m["hostPath"] for e in (device, common) for m in e.get("mounts", [])}
    nodes = {n["path"] for e in (device, common) for n in e.get("deviceNodes", [])}
    args = [a for e in (device, common) for h in e.get("hooks", []) for a in h["args"]]
    return mounts, nodes, args


def links(args: list[str]) -> dict[str, str]:
    return {v.split("::")[1]: v.split("::")[0] for k, v in zip(args, args[1:]) if k == "--link"}


def expected_paths(real: RealRoot) -> set[str]:
    """nvidia-ctk's management-mode mounts on this root (fact sheet section 5), plus the graphics and display
    files of DESIGN.md's list that management mode leaves out."""
    v = real.driver_version
    if real.layout == "runfile":
        libs = {f"{LIB_DIR}/{name}.so.{v}" for name in RUNFILE_LIBS} | {f"{LIB_DIR}/vdpau/libvdpau_nvidia.so.{v}"}
        assert len(libs) == 27
        mps_server = "/usr/bin/nvidia-cuda-mps-server"
    else:
        inside = [n for n in RUNFILE_LIBS if n not in DEBIAN_OUTSIDE]
        libs = {f"{DEBIAN_LIB_DIR}/{name}.so.{v}" for name in inside} | {f"{DEBIAN_LIB_DIR}/libvdpau_nvidia.so.{v}"}
        assert len(libs) == 20
        libs |= {f"{LIB_DIR}/{name}.so.{v}" for name in DEBIAN_OUTSIDE}  # nvidia-ctk misses these: we do not
        mps_server = "/usr/sbin/nvidia-cuda-mps-server"
    management = libs | {
        "/var/run/nvidia-persistenced/socket",
        f"/lib/firmware/nvidia/{v}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{v}/gsp_tu10x.bin",
        mps_server,
        *(f"/usr/bin/{b}" for b in BINARIES),
    }
    graphics = {
        f"{LIB_DIR}/libnvidia-egl-gbm.so.1.1.0",
        f"{LIB_DIR}/libnvidia-egl-wayland.so.1.1.10",
        f"{real.lib_dir}/libnvidia-api.so.1",
        "/usr/lib/xorg/modules/drivers/nvidia_drv.so",
        f"/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.{v}",
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
        "/usr/share/nvidia/nvoptix.bin",
        "/usr/share/vulkan/icd.d/nvidia_icd.json",
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
    }
    return management | graphics


def test_cdi_all_has_every_path_nvidia_ctk_mounts(real_root: RealRoot) -> None:
    mounts, nodes, _ = all_edits(spec(real_root))
    missing = sorted(expected_paths(real_root) - set(mounts))
    assert missing == []
    assert set(NODES) <= nodes
    for container_path, host_path in mounts.items():
        # Followed inside the root: an absolute alternatives link never leads to the host's /etc/alternatives.
        host = Path(host_path)
        assert host.is_relative_to(real_root.root), (container_path, host_path)
        assert not host.is_symlink() and (host.is_file() or host.is_socket()), (container_path, host_path)


def test_libraries_come_from_their_files_with_sonames_from_the_elf(real_root: RealRoot) -> None:
    v = real_root.driver_version
    mounts, _, args = all_edits(spec(real_root))
    made = links(args)
    lib = real_root.lib_dir
    assert made[f"{lib}/libnvidia-nvvm.so.4"] == f"libnvidia-nvvm.so.{v}"  # the soname the file carries
    assert made[f"{lib}/libcuda.so.1"] == f"libcuda.so.{v}"
    assert made[f"{lib}/libGLX_nvidia.so.0"] == f"libGLX_nvidia.so.{v}"
    # No soname, or the soname is the file name: no link.
    for name in (f"libnvidia-vulkan-producer.so.{v}", f"libnvidia-glcore.so.{v}", "libnvidia-api.so.1"):
        assert name not in made.values(), name
    # Every soname link (not the development or module links) is the DT_SONAME of the file it names.
    for link, target in made.items():
        folder, name = link.rsplit("/", 1)
        if re.search(r"\.so\.\d+$", name) and name != "libGLX_indirect.so.0":
            info = elf_dynamic(mounts[f"{folder}/{target}"])
            assert info is not None and info.soname == name, (link, target)
    # The graphics discoverer's links: GBM backend and the unversioned GLX server module.
    assert made[f"{lib}/gbm/nvidia-drm_gbm.so"] == "../libnvidia-allocator.so.1"
    assert made["/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so"] == f"libglxserver_nvidia.so.{v}"


def test_info_lists_every_real_file_classified(real_root: RealRoot) -> None:
    data = info(real_root)
    assert data["cuda_version"] == real_root.cuda_version == "12.2"
    by_host = {f["host_path"]: f for f in data["files"] if f["host_path"]}
    missing = [c for c in real_root.libraries() if str(real_root.resolve(c)) not in by_host]
    assert missing == []
    v = real_root.driver_version
    others = [f"/usr/bin/{b}" for b in BINARIES] + [
        f"/lib/firmware/nvidia/{v}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{v}/gsp_tu10x.bin",
        "/usr/share/nvidia/nvoptix.bin",
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
        "/usr/share/vulkan/icd.d/nvidia_icd.json",
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
        "/etc/OpenCL/vendors/nvidia.icd",
    ]
    assert [c for c in others if str(real_root.resolve(c)) not in by_host] == []
    assert [f["path"] for f in data["files"] if f["capability"] == "unclassified"] == []
    text = gpuhook("info", *roots(real_root)).stdout
    assert "CUDA version:   12.2" in text and "missing" not in text


def test_graphics_capabilities(real_root: RealRoot) -> None:
    data = info(real_root)
    caps = {f["path"].rsplit("/", 1)[1]: f["capability"] for f in data["files"]}
    v = real_root.driver_version
    assert caps["libnvidia-egl-gbm.so.1.1.0"] == caps["libnvidia-egl-wayland.so.1.1.10"] == "graphics"
    assert caps[f"libnvidia-vulkan-producer.so.{v}"] == caps["libnvidia-api.so.1"] == "graphics"
    assert caps["nvidia_drv.so"] == caps[f"libglxserver_nvidia.so.{v}"] == "display"
    kinds = {f["path"].rsplit("/", 1)[1]: f["kind"] for f in data["files"]}
    assert kinds["nvidia_drv.so"] == "xorg"  # mounted, but its folder is no loader folder


def test_cuda_version_from_the_real_libcuda_in_a_child(real_root: RealRoot, tmp_path: Path) -> None:
    """cuDriverGetVersion of NVIDIA's libcuda, with no kernel driver and no NVML: 12020 (CUDA 12.2); the
    autouse fixture checks that no /dev/nvidia* appeared on the host meanwhile."""
    from gpuhook.discover.cudaversion import cuda_version, driver_version_int

    libcuda = str(real_root.resolve(f"{real_root.lib_dir}/libcuda.so.{real_root.driver_version}"))
    assert driver_version_int(libcuda) == 12020 and cuda_version(libcuda) == "12.2"
    bogus = tmp_path / "libcuda.so.1"
    bogus.write_text("not a library\n")
    with pytest.raises(ValueError, match=r"cuDriverGetVersion from .* failed: ") as err:
        driver_version_int(str(bogus))
    assert "\n" not in str(err.value)
