"""Writing a fake driver root: device nodes, ELF libraries and binaries, config, IPC, /proc, /sys, ld cache."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuhook.fakedriver import procfs
from gpuhook.fakedriver.compile import Artifact, c_string, ensure_built, gcc_supports_m32, link_nvml
from gpuhook.fakedriver.datacenter import Datacenter
from gpuhook.fakedriver.model import (
    BMC_BUS_ID,
    CAP_MODE,
    CAPS_MAJOR,
    CTL_MINOR,
    DEFAULT_CUDA_VERSION,
    DEFAULT_DRIVER_VERSION,
    DEFAULT_UUID_SALT,
    DRI_MAJOR,
    EGL_PLATFORM_LIBRARIES,
    MIG_CONFIG_MINOR,
    MIG_CONFIG_MODE,
    MIG_MONITOR_MINOR,
    MODESET_MINOR,
    NVIDIA_MAJOR,
    PCI_DEVICE_ID,
    PCI_SUBSYSTEM_ID,
    UVM_MAJOR,
    XORG_DRIVER,
    XORG_EXTENSIONS,
    FakeDriver,
    FakeGpu,
    FakeLibrary,
    FakeNode,
    plan_gpus,
    validate,
)
from gpuhook.fakedriver.nvmltable import table_source
from gpuhook.model import catalogue, record

PERSISTENCED_SOCKET = "/var/run/nvidia-persistenced/socket"
FIRMWARE_FILES = ("gsp_ga10x.bin", "gsp_tu10x.bin")
EGL_PLATFORM_DIR = "/usr/share/egl/egl_external_platform.d"
_LIB_DIRS = {64: catalogue.LIB_DIR, 32: catalogue.LIB32_DIR}
_MULTIARCH = {64: "x86_64-linux-gnu", 32: "i386-linux-gnu"}
# DT_NEEDED between driver libraries, as the real ones link (same capability, so never split up).
_LIB_DEPS: dict[str, tuple[str, ...]] = {
    "libGLX_nvidia": ("libnvidia-glcore", "libnvidia-tls"),
    "libEGL_nvidia": ("libnvidia-eglcore", "libnvidia-glsi"),
    "libGLESv2_nvidia": ("libnvidia-eglcore", "libnvidia-glsi"),
    "libGLESv1_CM_nvidia": ("libnvidia-eglcore", "libnvidia-glsi"),
    "libnvidia-encode": ("libnvcuvid",),
}


def build_fake_driver(
    root: str | Path,
    gpus: int = 2,
    driver_version: str = DEFAULT_DRIVER_VERSION,
    cuda_version: str = DEFAULT_CUDA_VERSION,
    mig: Mapping[int, Sequence[str]] | None = None,
    compat32: bool | None = None,
    *,
    minors: Sequence[int] | None = None,
    uuid_salt: str = DEFAULT_UUID_SALT,
    merged_usr: bool = False,
    nvlink: str = "none",
    datacenter: Datacenter = Datacenter(),
) -> FakeDriver:
    """Build a simulated NVIDIA driver install under `root` (absent or empty) and describe it.

    compat32 None builds the 32-bit libraries when `gcc -m32` works. `minors` gives GPU i the device minor
    minors[i] (default i). `merged_usr` makes /lib, /bin, /sbin links into /usr, as on Debian 12. `nvlink` is the
    NVLink layout NVML reports (model.NVLINK_LAYOUTS: none, bridge pairs 0-1, 2-3, ..., or an NVSwitch box).
    `datacenter` adds IMEX channels, NVSwitches, GDS, RDMA and gdrcopy nodes (with their /proc/devices lines).
    """
    validate(gpus, driver_version, cuda_version, mig, minors, nvlink)
    datacenter.validate()
    planned = plan_gpus(gpus, mig, minors, uuid_salt, nvlink)  # raises ValueError when MIG devices do not fit
    root = Path(root).absolute()
    _check_target(root)
    with_32 = gcc_supports_m32() if compat32 is None else compat32
    if with_32 and not gcc_supports_m32():
        raise ValueError("compat32=True needs `gcc -m32` (install gcc-multilib)")
    fake = _describe(root, planned, driver_version, cuda_version, with_32, uuid_salt)
    fake = record.replace(fake, nodes=fake.nodes + datacenter.nodes(), char_devices=datacenter.char_devices(),
                               extra_files=tuple(datacenter.files().items()))
    artifacts = _artifacts(fake)
    ensure_built([*artifacts.values(), *(_nvml_core(b) for b in _bits(fake))])
    _write_tree(fake, artifacts, merged_usr)
    return fake


def _check_target(root: Path) -> None:
    if os.geteuid() != 0:
        raise PermissionError("building a fake driver needs root: it makes device nodes and runs ldconfig -r")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"fake driver root {root} must be absent or an empty directory")


def _bits(fake: FakeDriver) -> tuple[int, ...]:
    return (64, 32) if fake.compat32 else (64,)


# ---- what gets built -----------------------------------------------------------------------------------


def _describe(
    root: Path, gpus: tuple[FakeGpu, ...], driver_version: str, cuda_version: str, compat32: bool, salt: str
) -> FakeDriver:
    bits = (64, 32) if compat32 else (64,)
    return FakeDriver(
        root=root,
        driver_version=driver_version,
        cuda_version=cuda_version,
        gpus=gpus,
        compat32=compat32,
        libraries=tuple(_library(spec, driver_version, b) for b in bits for spec in catalogue.LIBRARIES),
        others=_others(driver_version),
        dev_links=tuple(
            (f"{_LIB_DIRS[b]}/{link}", target) for b in bits for link, target in catalogue.DEV_LINKS.items()
        )
        + _other_links(driver_version),
        binaries=tuple(f"/usr/bin/{b.name}" for b in catalogue.BINARIES),
        firmware=tuple(f"{catalogue.FIRMWARE_DIR}/{driver_version}/{name}" for name in FIRMWARE_FILES),
        configs=tuple(_configs(driver_version)),
        ipc=(PERSISTENCED_SOCKET,),
        nodes=_nodes(gpus),
        proc_files=_proc_files(gpus),
        uuid_salt=salt,
    )


def _library(spec: catalogue.LibrarySpec, version: str, bits: int) -> FakeLibrary:
    directory = _LIB_DIRS[bits] + (f"/{spec.subdir}" if spec.subdir else "")
    return FakeLibrary(spec.name, spec.capability, f"{directory}/{spec.file_name(version)}", spec.soname(version), bits)


def _others(version: str) -> tuple[FakeLibrary, ...]:
    """The files of other versions or places the real packages ship (fact sheet: docs of realdriver)."""
    lib = _LIB_DIRS[64]
    graphics = catalogue.EGL_PLATFORM_CAPABILITY
    egl = [FakeLibrary(name, graphics, f"{lib}/{name}.so.{v}", f"{name}.so.{v.split('.')[0]}", 64)
           for name, v in EGL_PLATFORM_LIBRARIES]
    glxserver = f"{XORG_EXTENSIONS}/libglxserver_nvidia.so.{version}"
    xorg = [FakeLibrary("nvidia_drv", "display", XORG_DRIVER, "", 64),
            FakeLibrary("libglxserver_nvidia", "display", glxserver, "", 64)]
    return (*egl, *xorg)


def _other_links(version: str) -> tuple[tuple[str, str], ...]:
    """The GBM backend beside the allocator and the unversioned GLX server module, as the .run installer makes."""
    allocator = next(lib for lib in catalogue.LIBRARIES if lib.name == catalogue.GBM_ALLOCATOR)
    return (
        (f"{_LIB_DIRS[64]}/{catalogue.GBM_BACKEND_LINK}", f"../{allocator.soname(version)}"),
        (f"{XORG_EXTENSIONS}/libglxserver_nvidia.so", f"libglxserver_nvidia.so.{version}"),
    )


def _nodes(gpus: tuple[FakeGpu, ...]) -> tuple[FakeNode, ...]:
    nodes = [FakeNode(g.node_path, NVIDIA_MAJOR, g.minor) for g in gpus]
    nodes += [
        FakeNode(f"/dev/{catalogue.CTL_NODE}", NVIDIA_MAJOR, CTL_MINOR),
        FakeNode(f"/dev/{catalogue.MODESET_NODE}", NVIDIA_MAJOR, MODESET_MINOR),
        FakeNode(f"/dev/{catalogue.UVM_NODES[0]}", UVM_MAJOR, 0),
        FakeNode(f"/dev/{catalogue.UVM_NODES[1]}", UVM_MAJOR, 1),
        FakeNode("/dev/dri/card0", DRI_MAJOR, 0, 0o660),  # the BMC's VGA, not an NVIDIA GPU
    ]
    for g in gpus:
        nodes += [
            FakeNode(f"/dev/dri/card{g.dri_card}", DRI_MAJOR, g.dri_card, 0o660),
            FakeNode(f"/dev/dri/renderD{g.dri_render}", DRI_MAJOR, g.dri_render, 0o666),
        ]
    migs = [m for g in gpus for m in g.mig_devices]
    if any(g.mig_enabled for g in gpus):
        caps = f"/dev/{catalogue.CAPS_DIR}/nvidia-cap"
        nodes += [
            FakeNode(f"{caps}{MIG_CONFIG_MINOR}", CAPS_MAJOR, MIG_CONFIG_MINOR, MIG_CONFIG_MODE),
            FakeNode(f"{caps}{MIG_MONITOR_MINOR}", CAPS_MAJOR, MIG_MONITOR_MINOR, CAP_MODE),
        ]
        nodes += [
            FakeNode(f"{caps}{n}", CAPS_MAJOR, n, CAP_MODE) for m in migs for n in (m.gi_cap_minor, m.ci_cap_minor)
        ]
    return tuple(nodes)


def _proc_files(gpus: tuple[FakeGpu, ...]) -> tuple[str, ...]:
    base = "/proc/driver/nvidia"
    files = [f"{base}/version", f"{base}/params", "/proc/devices", "/proc/driver/nvidia-caps/mig-minors"]
    files += [f"{base}/capabilities/mig/config", f"{base}/capabilities/mig/monitor"]
    for g in gpus:
        files += [f"{g.proc_dir}/information", f"{g.proc_dir}/power", f"{g.proc_dir}/registry"]
        files += [f for m in g.mig_devices for f in (m.gi_access, m.ci_access)]
    return tuple(files)


def _vulkan_api_version(driver_version: str) -> str:
    major = int(driver_version.split(".")[0])
    return "1.3.277" if major >= 550 else "1.3.242" if major >= 535 else "1.3.205"


def _configs(driver_version: str) -> dict[str, bytes]:
    def js(data: object) -> bytes:
        return (json.dumps(data, indent=4) + "\n").encode()

    api = _vulkan_api_version(driver_version)
    return {
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": js(
            {"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}
        ),
        "/usr/share/vulkan/icd.d/nvidia_icd.json": js(
            {"file_format_version": "1.0.0", "ICD": {"library_path": "libGLX_nvidia.so.0", "api_version": api}}
        ),
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json": js(
            {
                "file_format_version": "1.0.0",
                "layer": {
                    "name": "VK_LAYER_NV_optimus",
                    "type": "INSTANCE",
                    "library_path": "libGLX_nvidia.so.0",
                    "api_version": api,
                    "implementation_version": "1",
                    "description": "NVIDIA Optimus layer",
                    "functions": {
                        "vkGetInstanceProcAddr": "vk_optimusGetInstanceProcAddr",
                        "vkGetDeviceProcAddr": "vk_optimusGetDeviceProcAddr",
                    },
                    "enable_environment": {"__NV_PRIME_RENDER_OFFLOAD": "1"},
                    "disable_environment": {"DISABLE_LAYER_NV_OPTIMUS_1": ""},
                },
            }
        ),
        f"{EGL_PLATFORM_DIR}/15_nvidia_gbm.json": js(
            {"file_format_version": "1.0.0", "ICD": {"library_path": "libnvidia-egl-gbm.so.1"}}
        ),
        f"{EGL_PLATFORM_DIR}/10_nvidia_wayland.json": js(
            {"file_format_version": "1.0.0", "ICD": {"library_path": "libnvidia-egl-wayland.so.1"}}
        ),
        "/etc/OpenCL/vendors/nvidia.icd": b"libnvidia-opencl.so.1\n",
        "/usr/share/nvidia/nvoptix.bin": b"NVOPTIX\0" + driver_version.encode() + bytes(4096),
    }


def _artifacts(fake: FakeDriver) -> dict[str, Artifact]:
    """Canonical path -> cached artifact, for everything but the NVML mock (linked per build)."""
    result: dict[str, Artifact] = {}
    version = fake.driver_version
    for bits in _bits(fake):
        stubs = {spec.name: _stub(spec, version, bits) for spec in catalogue.LIBRARIES}
        for lib in fake.libraries:
            if lib.bits != bits or lib.name == "libnvidia-ml":
                continue
            if lib.name == "libcuda":
                result[lib.path] = _cuda(lib, fake.cuda_driver_version)
            else:
                deps = tuple(stubs[d] for d in _LIB_DEPS.get(lib.name, ()))
                result[lib.path] = record.replace(stubs[lib.name], deps=deps)
    for lib in fake.others:
        defines = (("FAKE_LIBRARY", c_string(f"{lib.name} {version}")),)
        result[lib.path] = Artifact("stub", lib.path.rsplit("/", 1)[1], lib.bits, lib.soname, defines)
    for path in fake.binaries:
        name = path.rsplit("/", 1)[1]
        defines = (("FAKE_TOOL", c_string(name)), ("FAKE_DRIVER_VERSION", c_string(version)))
        result[path] = Artifact("smi" if name == "nvidia-smi" else "tool", name, defines=defines)
    return result


def _stub(spec: catalogue.LibrarySpec, version: str, bits: int) -> Artifact:
    defines: tuple[tuple[str, str], ...] = (("FAKE_LIBRARY", c_string(f"{spec.name} {version}")),)
    if spec.name == "libnvidia-tls":  # NVIDIA's carries the GNU ABI tag; libnvidia-container requires it
        defines += (("FAKE_ABI_NOTE", "1"),)
    return Artifact("stub", spec.file_name(version), bits, spec.soname(version), defines)


def _cuda(lib: FakeLibrary, cuda_int: int) -> Artifact:
    defines = (("FAKE_CUDA_VERSION", str(cuda_int)),)
    return Artifact("cuda", lib.path.rsplit("/", 1)[1], lib.bits, lib.soname, defines)


def _nvml_core(bits: int) -> Artifact:
    return Artifact("nvml-core", "nvml.o", bits)


# ---- writing -------------------------------------------------------------------------------------------


def _write_tree(fake: FakeDriver, artifacts: dict[str, Artifact], merged_usr: bool) -> None:
    fake.root.mkdir(parents=True, exist_ok=True)
    _write_fhs_skeleton(fake.root, merged_usr)
    with ThreadPoolExecutor(max_workers=2) as pool:
        linking = [pool.submit(_write_nvml, fake, b) for b in _bits(fake)]
        _write_libraries(fake, artifacts)
        _write_binaries(fake, artifacts)
        _write_data_files(fake)
        _write_nodes(fake)
        _write_proc(fake)
        _write_sys(fake)
        _write_ipc(fake)
        _write_controls(fake)
        for job in linking:
            job.result()
    _write_ld_cache(fake)


def _write_fhs_skeleton(root: Path, merged_usr: bool) -> None:
    for d in ("usr/bin", "usr/sbin", "usr/lib", "etc", "run", "var", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.symlink("../run", root / "var/run")
    if merged_usr:
        for d in ("bin", "sbin", "lib"):
            os.symlink(f"usr/{d}", root / d)


def _put(fake: FakeDriver, canonical: str, data: bytes | str, mode: int = 0o644) -> Path:
    path = fake.host_path(canonical)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)
    return path


def _copy(fake: FakeDriver, canonical: str, source: Path, mode: int) -> None:
    path = fake.host_path(canonical)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, path)
    os.chmod(path, mode)


def _link(fake: FakeDriver, canonical: str, target: str) -> None:
    path = fake.host_path(canonical)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)


def _write_libraries(fake: FakeDriver, artifacts: dict[str, Artifact]) -> None:
    for lib in (*fake.libraries, *fake.others):
        if lib.path in artifacts:
            _copy(fake, lib.path, artifacts[lib.path].path, 0o644)
        if lib.soname_path != lib.path:  # libnvidia-glcore & co: the soname is the file name
            _link(fake, lib.soname_path, lib.path.rsplit("/", 1)[1])
    for link, target in fake.dev_links:
        _link(fake, link, target)


def _write_nvml(fake: FakeDriver, bits: int) -> None:
    lib = fake.library("libnvidia-ml", bits)
    path = fake.host_path(lib.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = table_source(fake.root, fake.driver_version, fake.cuda_version, fake.cuda_driver_version, fake.gpus)
    link_nvml(_nvml_core(bits), source, path)
    os.chmod(path, 0o644)


def _write_binaries(fake: FakeDriver, artifacts: dict[str, Artifact]) -> None:
    for path in fake.binaries:
        _copy(fake, path, artifacts[path].path, 0o755)


def _write_data_files(fake: FakeDriver) -> None:
    for path in fake.firmware:
        _put(fake, path, b"\x7fELF\x02\x01\x01" + bytes(4089))
    for path, content in _configs(fake.driver_version).items():
        _put(fake, path, content)
    for path, text in fake.extra_files:
        _put(fake, path, text)


def _write_nodes(fake: FakeDriver) -> None:
    for node in fake.nodes:
        path = fake.host_path(node.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, stat.S_IFCHR | node.mode, os.makedev(node.major, node.minor))
        os.chmod(path, node.mode)  # mknod honours the umask
    _link(fake, f"/dev/dri/by-path/pci-{BMC_BUS_ID}-card", "../card0")
    for g in fake.gpus:
        _link(fake, f"/dev/dri/by-path/pci-{g.pci_bus_id}-card", f"../card{g.dri_card}")
        _link(fake, f"/dev/dri/by-path/pci-{g.pci_bus_id}-render", f"../renderD{g.dri_render}")


def _write_proc(fake: FakeDriver) -> None:
    base = "/proc/driver/nvidia"
    _put(fake, f"{base}/version", procfs.version_text(fake.driver_version), 0o444)
    _put(fake, f"{base}/params", procfs.params_text(), 0o444)
    _put(fake, "/proc/devices", procfs.devices_text(fake.char_devices), 0o444)
    _put(fake, "/proc/driver/nvidia-caps/mig-minors", procfs.mig_minors_text(), 0o444)
    _put(fake, f"{base}/capabilities/mig/config", procfs.cap_text(MIG_CONFIG_MINOR, MIG_CONFIG_MODE), 0o444)
    _put(fake, f"{base}/capabilities/mig/monitor", procfs.cap_text(MIG_MONITOR_MINOR, CAP_MODE), 0o444)
    for g in fake.gpus:
        _put(fake, f"{g.proc_dir}/information", procfs.gpu_information_text(g, fake.driver_version), 0o444)
        _put(fake, f"{g.proc_dir}/power", procfs.gpu_power_text(), 0o444)
        _put(fake, f"{g.proc_dir}/registry", 'Binary: ""\n', 0o644)
        for m in g.mig_devices:
            _put(fake, m.gi_access, procfs.cap_text(m.gi_cap_minor, CAP_MODE), 0o444)
            _put(fake, m.ci_access, procfs.cap_text(m.ci_cap_minor, CAP_MODE), 0o444)


def _write_sys(fake: FakeDriver) -> None:
    """/sys/bus/pci/devices/<bus id>: where a GPU's CPU-side NUMA node and DRM nodes are found."""
    devices = "/sys/bus/pci/devices"
    gpu_ids = f"0x{PCI_DEVICE_ID >> 16:04x}", f"0x{PCI_SUBSYSTEM_ID >> 16:04x}"
    rows = [(BMC_BUS_ID, "0x1a03", "0x2000", "0x030000", 0, ("card0",))]
    rows += [
        (g.pci_bus_id, "0x10de", gpu_ids[0], "0x030200", g.numa_node, (f"card{g.dri_card}", f"renderD{g.dri_render}"))
        for g in fake.gpus
    ]
    for bus, vendor, device, klass, numa, drm in rows:
        for name, value in (("vendor", vendor), ("device", device), ("class", klass), ("numa_node", numa)):
            _put(fake, f"{devices}/{bus}/{name}", f"{value}\n", 0o444)
        if vendor == "0x10de":
            _put(fake, f"{devices}/{bus}/subsystem_device", f"{gpu_ids[1]}\n", 0o444)
        for entry in drm:
            fake.host_path(f"{devices}/{bus}/drm/{entry}").mkdir(parents=True, exist_ok=True)


def _write_ipc(fake: FakeDriver) -> None:
    for canonical in fake.ipc:
        path = fake.host_path(canonical)
        path.parent.mkdir(parents=True, exist_ok=True)
        _bind_socket(path)


def _bind_socket(path: Path) -> None:
    """A real (closed) unix socket; long paths are bound through /proc/self/fd to fit sun_path."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        if len(os.fsencode(path)) < 100:
            sock.bind(str(path))
            return
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{fd}/{path.name}")
        finally:
            os.close(fd)


def _write_controls(fake: FakeDriver) -> None:
    fake.control_dir.mkdir(parents=True, exist_ok=True)
    (fake.control_dir / "xid").touch()


def _write_ld_cache(fake: FakeDriver) -> None:
    _put(fake, "/etc/ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n\n")
    for bits in _bits(fake):
        arch = _MULTIARCH[bits]
        _put(
            fake,
            f"/etc/ld.so.conf.d/{arch}.conf",
            f"# Multiarch support\n/usr/local/lib/{arch}\n/lib/{arch}\n/usr/lib/{arch}\n",
        )
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    proc = subprocess.run([ldconfig, "-r", str(fake.root)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not fake.host_path("/etc/ld.so.cache").exists():
        raise RuntimeError(f"ldconfig -r {fake.root} failed: {proc.stderr.strip()}")
