"""The simulated driver must look like a real install wherever gpuhook looks."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.e2e import need
from support.fakefix import FakeDriverFactory  # fixtures come from conftest.py

from gpuhook.cli.fakedriver import fake_driver as fake_driver_cli
from gpuhook.fakedriver import FakeDriver, build_fake_driver, pynvml_bound
from gpuhook.fakedriver.model import gpu_uuid
from gpuhook.model import catalogue as driverfiles

NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
XID_EVENT = 0x8


def _readelf(path: Path) -> str:
    return subprocess.run(["readelf", "-h", "-d", str(path)], capture_output=True, text=True, check=True).stdout


def _soname(path: Path) -> str:
    """The DT_SONAME readelf shows; "" when there is none (libnvidia-vulkan-producer, as NVIDIA ships it)."""
    match = re.search(r"\(SONAME\)\s+Library soname: \[(.+)\]", _readelf(path))
    return match.group(1) if match else ""


def _text(value: bytes | str) -> str:
    """pynvml structs hand out char arrays as str (newer releases) or bytes (older)."""
    return value.decode() if isinstance(value, bytes) else value


def _run_python(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ---- parameters --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": -1}, "gpus must be"),
        ({"gpus": 17}, "gpus must be"),
        ({"gpus": 2, "mig": {2: ["1g.10gb"]}}, "MIG GPU index 2 out of range"),
        ({"gpus": 2, "mig": {0: ["9g.99gb"]}}, "unknown MIG profile '9g.99gb'"),
        ({"gpus": 1, "mig": {0: ["4g.40gb", "4g.40gb"]}}, "do not fit on GPU 0"),
        ({"gpus": 1, "mig": {0: ["1g.10gb"] * 8}}, "do not fit on GPU 0"),
        ({"driver_version": "550"}, "driver version '550'"),
        ({"cuda_version": "12"}, "CUDA version '12'"),
        ({"gpus": 2, "minors": [0, 0]}, "distinct"),
    ],
)
def test_bad_parameters_raise_value_error(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_fake_driver(tmp_path / "root", **kwargs)
    assert not (tmp_path / "root").exists()


def test_root_must_be_empty(fake_driver_factory: FakeDriverFactory, tmp_path: Path) -> None:
    (tmp_path / "junk").touch()
    with pytest.raises(ValueError, match="absent or an empty directory"):
        build_fake_driver(tmp_path)


def test_expected_values(fake_driver_mig: FakeDriver) -> None:
    gpus = fake_driver_mig.gpus
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert [g.pci_bus_id for g in gpus] == ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"]
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", g.uuid) for g in gpus)
    assert len({g.uuid for g in gpus}) == 4
    assert [g.mig_enabled for g in gpus] == [False, True, False, False]
    migs = gpus[1].mig_devices
    assert sorted(m.profile for m in migs) == ["1g.10gb", "1g.10gb", "2g.20gb"]
    assert [m.index for m in migs] == [0, 1, 2]
    assert [m.gi for m in migs] == sorted(m.gi for m in migs)  # NVML orders MIG devices by GI id
    assert all(m.uuid.startswith("MIG-") and m.ci == 0 for m in migs)
    assert all(m.gi_access == f"/proc/driver/nvidia/capabilities/gpu1/mig/gi{m.gi}/access" for m in migs)
    assert all(m.gi_cap_minor == 3 + 135 + 9 * m.gi and m.ci_cap_minor == m.gi_cap_minor + 1 for m in migs)
    # Same index, same salt: same identity in every layout.
    assert gpus[0].uuid == gpu_uuid(0) != gpu_uuid(0, salt="other")


# ---- device nodes ------------------------------------------------------------------------------------


def test_device_nodes_are_char_devices(fake_driver_mig: FakeDriver) -> None:
    fake = fake_driver_mig
    expected = {f"/dev/nvidia{g.minor}": (195, g.minor) for g in fake.gpus}
    expected |= {
        "/dev/nvidiactl": (195, 255),
        "/dev/nvidia-modeset": (195, 254),
        "/dev/nvidia-uvm": (508, 0),
        "/dev/nvidia-uvm-tools": (508, 1),
        "/dev/nvidia-caps/nvidia-cap1": (237, 1),
        "/dev/nvidia-caps/nvidia-cap2": (237, 2),
    }
    for g in fake.gpus:
        expected[f"/dev/dri/card{g.dri_card}"] = (226, g.dri_card)
        expected[f"/dev/dri/renderD{g.dri_render}"] = (226, g.dri_render)
    for m in fake.mig_devices:
        expected[m.cap_nodes[0]] = (237, m.gi_cap_minor)
        expected[m.cap_nodes[1]] = (237, m.ci_cap_minor)
    assert {n.path for n in fake.nodes} >= set(expected)
    for node in fake.nodes:
        st = os.lstat(fake.host_path(node.path))
        assert stat.S_ISCHR(st.st_mode), node.path
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (node.major, node.minor), node.path
        assert stat.S_IMODE(st.st_mode) == node.mode, node.path
    for path, numbers in expected.items():
        st = os.lstat(fake.host_path(path))
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == numbers, path
    assert stat.S_IMODE(os.lstat(fake.host_path("/dev/nvidia0")).st_mode) == 0o666
    assert stat.S_IMODE(os.lstat(fake.host_path("/dev/nvidia-caps/nvidia-cap1")).st_mode) == 0o400
    assert stat.S_IMODE(os.lstat(fake.host_path(fake.mig_devices[0].cap_nodes[0])).st_mode) == 0o444


def test_dri_by_path_links_as_udev_makes_them(fake_driver: FakeDriver) -> None:
    for g in fake_driver.gpus:
        card = fake_driver.host_path(f"/dev/dri/by-path/pci-{g.pci_bus_id}-card")
        render = fake_driver.host_path(f"/dev/dri/by-path/pci-{g.pci_bus_id}-render")
        assert os.readlink(card) == f"../card{g.dri_card}"
        assert os.readlink(render) == f"../renderD{g.dri_render}"
        assert card.resolve() == fake_driver.host_path(f"/dev/dri/card{g.dri_card}")
    # The BMC's card0 exists too and is no NVIDIA GPU's.
    assert "/dev/dri/card0" not in {f"/dev/dri/card{g.dri_card}" for g in fake_driver.gpus}
    assert stat.S_ISCHR(os.lstat(fake_driver.host_path("/dev/dri/card0")).st_mode)


def test_no_caps_nodes_without_mig(fake_driver: FakeDriver) -> None:
    assert not fake_driver.host_path("/dev/nvidia-caps").exists()
    assert fake_driver.mig_devices == ()


def test_custom_minors(fake_driver_factory: FakeDriverFactory) -> None:
    fake = fake_driver_factory(gpus=2, minors=[3, 1], mig={0: ["7g.80gb"]})
    assert [g.minor for g in fake.gpus] == [3, 1]
    assert stat.S_ISCHR(os.lstat(fake.host_path("/dev/nvidia3")).st_mode)
    assert not fake.host_path("/dev/nvidia0").exists()
    assert fake.mig_devices[0].gi_access == "/proc/driver/nvidia/capabilities/gpu3/mig/gi0/access"
    info = fake.host_path(f"{fake.gpus[0].proc_dir}/information").read_text()
    assert "Device Minor: \t 3\n" in info
    with pynvml_bound(fake) as nvml:
        nvml.nvmlInit()
        minors = [nvml.nvmlDeviceGetMinorNumber(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    assert minors == [3, 1]


# ---- libraries ---------------------------------------------------------------------------------------


def test_every_catalogue_library_is_a_real_elf_with_its_soname(fake_driver: FakeDriver) -> None:
    fake = fake_driver
    version = fake.driver_version
    bits = (64, 32) if fake.compat32 else (64,)
    assert len(fake.libraries) == len(driverfiles.LIBRARIES) * len(bits)
    for spec in driverfiles.LIBRARIES:
        for b in bits:
            lib = fake.library(spec.name, b)
            base = driverfiles.LIB_DIR if b == 64 else driverfiles.LIB32_DIR
            subdir = f"/{spec.subdir}" if spec.subdir else ""
            assert lib.path == f"{base}{subdir}/{spec.file_name(version)}"
            path = fake.host_path(lib.path)
            assert path.is_file() and not path.is_symlink()
            assert stat.S_IMODE(path.stat().st_mode) == 0o644
            header = _readelf(path)
            assert ("ELF64" if b == 64 else "ELF32") in header
            assert _soname(path) == spec.soname(version) == lib.soname
            link = fake.host_path(lib.soname_path)
            assert link.resolve() == path.resolve()
            if lib.soname_path != lib.path:
                assert os.readlink(link) == path.name  # relative, next to the file


def test_files_as_nvidia_ships_them(fake_driver: FakeDriver) -> None:
    """What NVIDIA's real 535 packages showed: libraries without soname, libnvidia-api under its soname, the EGL
    platform libraries with their own versions, the X modules, the GBM backend link."""
    fake = fake_driver
    v = fake.driver_version
    lib = driverfiles.LIB_DIR
    producer = fake.host_path(f"{lib}/libnvidia-vulkan-producer.so.{v}")
    assert producer.is_file() and _soname(producer) == ""
    api = fake.host_path(f"{lib}/libnvidia-api.so.1")
    assert api.is_file() and not api.is_symlink() and _soname(api) == "libnvidia-api.so.1"
    for name, version in (("libnvidia-egl-gbm", "1.1.0"), ("libnvidia-egl-wayland", "1.1.10")):
        path = fake.host_path(f"{lib}/{name}.so.{version}")
        assert _soname(path) == f"{name}.so.1"
        assert os.readlink(fake.host_path(f"{lib}/{name}.so.1")) == path.name
    drv = fake.host_path("/usr/lib/xorg/modules/drivers/nvidia_drv.so")
    glxserver = fake.host_path(f"/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.{v}")
    assert _soname(drv) == _soname(glxserver) == ""
    assert os.readlink(glxserver.with_name("libglxserver_nvidia.so")) == glxserver.name
    assert os.readlink(fake.host_path(f"{lib}/gbm/nvidia-drm_gbm.so")) == "../libnvidia-allocator.so.1"
    assert fake.host_path(f"{lib}/gbm/nvidia-drm_gbm.so").resolve().name == f"libnvidia-allocator.so.{v}"


def test_graphics_libraries_need_their_cores(fake_driver: FakeDriver) -> None:
    glx = _readelf(fake_driver.host_path(fake_driver.library("libGLX_nvidia").path))
    assert f"[libnvidia-glcore.so.{fake_driver.driver_version}]" in glx


def test_tls_library_carries_the_gnu_abi_tag(fake_driver: FakeDriver) -> None:
    """NVIDIA's libnvidia-tls has the GNU ABI tag for Linux 2.3.99, and libnvidia-container's driver lookup
    requires it (libnvidia-container src/nvc_info.c, select_libraries: elftool_has_abi {2, 3, 99}; without it
    the lookup of every library fails, "elf section 0x7 missing"). Other libraries have none."""
    for b in (64, 32) if fake_driver.compat32 else (64,):
        tls = fake_driver.host_path(fake_driver.library("libnvidia-tls", b).path)
        notes = subprocess.run(["readelf", "-n", str(tls)], capture_output=True, text=True, check=True).stdout
        assert ".note.ABI-tag" in notes and "OS: Linux, ABI: 2.3.99" in notes, notes
    cuda = fake_driver.host_path(fake_driver.library("libcuda").path)
    assert "ABI-tag" not in subprocess.run(["readelf", "-n", str(cuda)], capture_output=True, text=True).stdout


def test_dev_links(fake_driver: FakeDriver) -> None:
    for link, target in driverfiles.DEV_LINKS.items():
        path = fake_driver.host_path(f"{driverfiles.LIB_DIR}/{link}")
        assert os.readlink(path) == target
        assert path.resolve().is_file()


def test_ld_cache_lists_libraries_at_canonical_paths(fake_driver: FakeDriver) -> None:
    fake = fake_driver
    out = subprocess.run(
        ["ldconfig", "-p", "-C", str(fake.host_path("/etc/ld.so.cache"))], capture_output=True, text=True, check=True
    ).stdout
    entries = set(re.findall(r"^\s+(\S+) \(([^)]*)\) => (\S+)$", out, re.M))
    for lib in fake.libraries:
        if "/vdpau/" in lib.path:
            continue  # not in an ld.so.conf directory, as on a real host
        flags = "libc6,x86-64" if lib.bits == 64 else "libc6"
        key = lib.soname or lib.path.rsplit("/", 1)[1]  # ldconfig caches a library without soname by its name
        assert (key, flags, lib.soname_path) in entries, lib.soname_path
    assert not any(str(fake.root) in path for _, _, path in entries)
    conf = fake.host_path("/etc/ld.so.conf").read_text()
    assert "include /etc/ld.so.conf.d/*.conf" in conf


def test_32bit_libraries(fake_driver: FakeDriver) -> None:
    if not fake_driver.compat32:
        pytest.skip("gcc -m32 is not available here")
    lib = fake_driver.library("libnvidia-ml", 32)
    assert lib.path.startswith(driverfiles.LIB32_DIR)
    assert "ELF32" in _readelf(fake_driver.host_path(lib.path))
    assert fake_driver.host_path("/etc/ld.so.conf.d/i386-linux-gnu.conf").is_file()


def test_merged_usr_layout(fake_driver_factory: FakeDriverFactory) -> None:
    fake = fake_driver_factory(gpus=1, merged_usr=True)
    assert os.readlink(fake.host_path("/lib")) == "usr/lib"
    assert fake.host_path(fake.firmware[0]).is_file()
    out = subprocess.run(
        ["ldconfig", "-p", "-C", str(fake.host_path("/etc/ld.so.cache"))], capture_output=True, text=True, check=True
    ).stdout
    # As on Debian 12: the cache names the first configured directory, /lib/<arch>.
    assert "=> /lib/x86_64-linux-gnu/libcuda.so.1" in out


# ---- NVML mock through pynvml ------------------------------------------------------------------------


def test_pynvml_reports_exactly_the_table(fake_driver_mig: FakeDriver) -> None:
    fake = fake_driver_mig
    with pynvml_bound(fake) as nvml:
        nvml.nvmlInit()
        assert nvml.nvmlSystemGetDriverVersion() == fake.driver_version
        assert nvml.nvmlSystemGetCudaDriverVersion() == fake.cuda_driver_version == 12040
        assert nvml.nvmlSystemGetCudaDriverVersion_v2() == 12040
        assert nvml.nvmlSystemGetNVMLVersion() == f"12.{fake.driver_version}"
        assert nvml.nvmlDeviceGetCount() == len(fake.gpus)
        for gpu in fake.gpus:
            h = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            assert nvml.nvmlDeviceGetUUID(h) == gpu.uuid
            assert nvml.nvmlDeviceGetName(h) == gpu.name
            assert nvml.nvmlDeviceGetMinorNumber(h) == gpu.minor
            assert nvml.nvmlDeviceGetIndex(h) == gpu.index
            pci = nvml.nvmlDeviceGetPciInfo(h)
            assert _text(pci.busId) == gpu.nvml_bus_id == f"0000{gpu.pci_bus_id.upper()}"
            assert _text(pci.busIdLegacy) == gpu.pci_bus_id.upper()
            assert nvml.nvmlDeviceGetMemoryInfo(h).total == gpu.memory_mib << 20
            mem2 = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
            assert mem2.total == gpu.memory_mib << 20 and mem2.free + mem2.reserved + mem2.used == mem2.total
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            assert f"{major}.{minor}" == gpu.compute_capability
            assert nvml.nvmlDeviceGetBrand(h) == nvml.NVML_BRAND_NVIDIA
            assert nvml.nvmlDeviceGetMemoryAffinity(h, 1, nvml.NVML_AFFINITY_SCOPE_NODE)[0] == 1 << gpu.numa_node
            assert nvml.nvmlDeviceGetMigMode(h) == [int(gpu.mig_enabled)] * 2
            assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)) == gpu.uuid
            for form in (gpu.nvml_bus_id, gpu.pci_bus_id, gpu.pci_bus_id[5:]):
                assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByPciBusId(form)) == gpu.uuid
            assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == (7 if gpu.mig_enabled else 0)
            _check_mig_devices(nvml, h, gpu)


def _check_mig_devices(nvml, h, gpu) -> None:  # type: ignore[no-untyped-def]
    if not gpu.mig_enabled:
        with pytest.raises(nvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
        return
    for mig in gpu.mig_devices:
        m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, mig.index)
        assert nvml.nvmlDeviceIsMigDeviceHandle(m).value == 1
        assert nvml.nvmlDeviceGetUUID(m) == mig.uuid
        assert nvml.nvmlDeviceGetName(m) == mig.name == f"{gpu.name} MIG {mig.profile}"
        assert nvml.nvmlDeviceGetGpuInstanceId(m) == mig.gi
        assert nvml.nvmlDeviceGetComputeInstanceId(m) == mig.ci
        assert nvml.nvmlDeviceGetMemoryInfo(m).total == mig.memory_mib << 20
        assert nvml.nvmlDeviceGetAttributes(m).memorySizeMB == mig.memory_mib
        parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        assert nvml.nvmlDeviceGetUUID(parent) == gpu.uuid
        assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByUUID(mig.uuid)) == mig.uuid
        with pytest.raises(nvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetMinorNumber(m)  # callers must go through the parent
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, len(gpu.mig_devices))
    with pytest.raises(nvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 7)
    assert nvml.nvmlDeviceIsMigDeviceHandle(h).value == 0
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceId(h)
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes(h)


def test_nvml_error_semantics(fake_driver: FakeDriver) -> None:
    with pynvml_bound(fake_driver) as nvml:
        lib = nvml.nvmlLib
        with pytest.raises(nvml.NVMLError_Uninitialized):
            nvml.nvmlDeviceGetCount()
        with pytest.raises(nvml.NVMLError_Uninitialized):
            nvml.nvmlShutdown()
        nvml.nvmlInit()
        nvml.nvmlInit()  # refcounted
        nvml.nvmlShutdown()
        assert nvml.nvmlDeviceGetCount() == 2

        small = ctypes.create_string_buffer(4)
        assert lib.nvmlSystemGetDriverVersion(small, ctypes.c_uint(4)) == NVML_ERROR_INSUFFICIENT_SIZE
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        assert lib.nvmlDeviceGetUUID(h, small, ctypes.c_uint(4)) == NVML_ERROR_INSUFFICIENT_SIZE
        exact = len(fake_driver.gpus[0].uuid) + 1
        assert lib.nvmlDeviceGetUUID(h, ctypes.create_string_buffer(exact), ctypes.c_uint(exact)) == 0
        mem = nvml.c_nvmlMemory_v2_t()
        mem.version = 1
        assert lib.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(mem)) == NVML_ERROR_ARGUMENT_VERSION_MISMATCH

        with pytest.raises(nvml.NVMLError_NotFound):
            nvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(nvml.NVMLError_NotFound):
            nvml.nvmlDeviceGetHandleByPciBusId("0000:99:00.0")
        with pytest.raises(nvml.NVMLError_InvalidArgument):
            nvml.nvmlDeviceGetHandleByIndex(2)
        with pytest.raises(nvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetNumaNodeId(h)  # only where GPU memory is a NUMA node
        assert str(nvml.NVMLError(nvml.NVML_ERROR_GPU_IS_LOST)) == "GPU is lost"
        nvml.nvmlShutdown()
        with pytest.raises(nvml.NVMLError_Uninitialized):
            nvml.nvmlDeviceGetCount()


def test_nvml_unversioned_pci_info_fills_the_v1_struct(fake_driver: FakeDriver) -> None:
    """The unversioned nvmlDeviceGetPciInfo, which libnvidia-container calls (src/driver.c,
    driver_get_device_busid_1_svc), fills NVML's v1 struct: v3's first 36 bytes (legacy bus id, domain, bus,
    device, ids), four reserved words zeroed, and nothing past its 52 bytes (a v1 caller's buffer ends there)."""
    with pynvml_bound(fake_driver) as nvml:
        nvml.nvmlInit()
        lib = nvml.nvmlLib
        for index in range(len(fake_driver.gpus)):
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            v3 = ctypes.create_string_buffer(68)
            assert lib.nvmlDeviceGetPciInfo_v3(h, v3) == 0
            v1 = ctypes.create_string_buffer(b"\xaa" * 68, 68)
            assert lib.nvmlDeviceGetPciInfo(h, v1) == 0
            assert v1.raw[:36] == v3.raw[:36]
            assert v1.raw[:16].rstrip(b"\0").decode() == nvml.nvmlDeviceGetPciInfo(h).busIdLegacy
            assert v1.raw[36:52] == bytes(16) and v1.raw[52:] == b"\xaa" * 16
        assert lib.nvmlDeviceGetPciInfo(h, None) == nvml.NVML_ERROR_INVALID_ARGUMENT
        nvml.nvmlShutdown()


def test_fail_init_control(fake_driver: FakeDriver) -> None:
    fake_driver.set_fail_init()
    with pynvml_bound(fake_driver) as nvml:
        with pytest.raises(nvml.NVMLError_DriverNotLoaded):
            nvml.nvmlInit()
        fake_driver.set_fail_init(False)
        nvml.nvmlInit()
        assert nvml.nvmlDeviceGetCount() == 2


def test_lost_gpu_control(fake_driver: FakeDriver) -> None:
    with pynvml_bound(fake_driver) as nvml:
        nvml.nvmlInit()
        h1 = nvml.nvmlDeviceGetHandleByIndex(1)
        events = nvml.nvmlEventSetCreate()
        nvml.nvmlDeviceRegisterEvents(h1, nvml.nvmlEventTypeXidCriticalError, events)
        fake_driver.set_gpu_lost(1)
        with pytest.raises(nvml.NVMLError_GpuIsLost):
            nvml.nvmlDeviceGetUUID(h1)
        with pytest.raises(nvml.NVMLError_GpuIsLost):
            nvml.nvmlDeviceGetHandleByIndex(1)
        with pytest.raises(nvml.NVMLError_GpuIsLost):
            nvml.nvmlEventSetWait_v2(events, 50)
        assert nvml.nvmlDeviceGetCount() == 2  # still counted, as NVML does
        assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0)) == fake_driver.gpus[0].uuid
        fake_driver.set_gpu_lost(1, False)
        assert nvml.nvmlDeviceGetUUID(h1) == fake_driver.gpus[1].uuid
        nvml.nvmlEventSetFree(events)


def test_xid_events_are_delivered_once_per_event_set(fake_driver: FakeDriver) -> None:
    fake = fake_driver
    with pynvml_bound(fake) as nvml:
        nvml.nvmlInit()
        h0 = nvml.nvmlDeviceGetHandleByIndex(0)
        supported = nvml.nvmlDeviceGetSupportedEventTypes(h0)
        assert supported & nvml.nvmlEventTypeXidCriticalError
        fake.inject_xid(0, 13)  # before registration: lost, as with a real driver
        events = nvml.nvmlEventSetCreate()
        nvml.nvmlDeviceRegisterEvents(h0, nvml.nvmlEventTypeXidCriticalError & supported, events)
        assert (os.getpid(), 0, XID_EVENT) in fake.registrations()
        with pytest.raises(nvml.NVMLError_Timeout):
            nvml.nvmlEventSetWait_v2(events, 50)

        fake.inject_xid(1, 48)  # GPU 1 is not registered with this set
        fake.inject_xid(0, 79)
        fake.inject_xid(0, 94, gi=3, ci=0)
        data = nvml.nvmlEventSetWait_v2(events, 5000)  # an event, not NVML_ERROR_TIMEOUT
        assert data.eventType == XID_EVENT and data.eventData == 79
        assert nvml.nvmlDeviceGetUUID(data.device) == fake.gpus[0].uuid
        assert (data.gpuInstanceId, data.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
        data = nvml.nvmlEventSetWait(events, 1000)
        assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (94, 3, 0)
        with pytest.raises(nvml.NVMLError_Timeout):
            nvml.nvmlEventSetWait_v2(events, 0)

        second = nvml.nvmlEventSetCreate()  # a second listener sees only what comes after it registers
        nvml.nvmlDeviceRegisterEvents(h0, nvml.nvmlEventTypeXidCriticalError, second)
        fake.inject_xid(0, 31)
        assert nvml.nvmlEventSetWait_v2(events, 1000).eventData == 31
        assert nvml.nvmlEventSetWait_v2(second, 1000).eventData == 31
        with pytest.raises(nvml.NVMLError_NotSupported):
            nvml.nvmlDeviceRegisterEvents(h0, 1 << 40, events)
        nvml.nvmlEventSetFree(events)
        nvml.nvmlEventSetFree(second)


def test_control_helpers_validate_gpu_index(fake_driver: FakeDriver) -> None:
    with pytest.raises(ValueError, match="out of range"):
        fake_driver.inject_xid(5, 79)


def test_pynvml_preloaded_rtld_global(fake_driver_mig: FakeDriver) -> None:
    """pynvml's own CDLL("libnvidia-ml.so.1") finds the preloaded mock by soname."""
    code = textwrap.dedent(
        """
        import ctypes, json, sys
        pre = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
        import pynvml
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        print(json.dumps({
            "same": pynvml.nvmlLib._handle == pre._handle,
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "uuids": [pynvml.nvmlDeviceGetUUID(h) for h in handles],
            "mig": [pynvml.nvmlDeviceGetMigMode(h)[0] for h in handles],
        }))
        """
    )
    out = _run_python(code, str(fake_driver_mig.nvml_library))
    assert out["same"] is True
    assert out["driver"] == fake_driver_mig.driver_version
    assert out["uuids"] == [g.uuid for g in fake_driver_mig.gpus]
    assert out["mig"] == [int(g.mig_enabled) for g in fake_driver_mig.gpus]


def test_nvml_sees_only_present_nodes(fake_driver_factory: FakeDriverFactory) -> None:
    fake = fake_driver_factory(gpus=4, fresh=True)
    fake.host_path("/dev/nvidia1").unlink()
    with pynvml_bound(fake) as nvml:
        nvml.nvmlInit()
        uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
        assert uuids == [fake.gpus[i].uuid for i in (0, 2, 3)]  # re-indexed densely, as in a container
        nvml.nvmlShutdown()
        fake.host_path("/proc/driver/nvidia/version").write_text(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  1.2.3\n"
        )
        with pytest.raises(nvml.NVMLError_LibRmVersionMismatch):
            nvml.nvmlInit()


def test_two_layouts_side_by_side(fake_driver_factory: FakeDriverFactory, fake_driver_mig: FakeDriver) -> None:
    old = fake_driver_factory(gpus=1, driver_version="535.161.08", cuda_version="12.2")
    assert old.root != fake_driver_mig.root
    assert old.host_path("/usr/lib/x86_64-linux-gnu/libcuda.so.535.161.08").is_file()
    assert _soname(old.host_path(old.library("libnvidia-glcore").path)) == "libnvidia-glcore.so.535.161.08"
    assert old.host_path("/lib/firmware/nvidia/535.161.08/gsp_ga10x.bin").is_file()
    assert "Kernel Module  535.161.08  " in old.host_path("/proc/driver/nvidia/version").read_text()
    assert not old.host_path("/dev/nvidia-caps").exists()
    assert fake_driver_mig.host_path("/dev/nvidia-caps/nvidia-cap1").exists()
    for fake, count, version in ((old, 1, "535.161.08"), (fake_driver_mig, 4, "550.54.15"), (old, 1, "535.161.08")):
        with pynvml_bound(fake) as nvml:
            nvml.nvmlInit()
            assert nvml.nvmlSystemGetDriverVersion() == version
            assert nvml.nvmlDeviceGetCount() == count
            assert nvml.nvmlSystemGetCudaDriverVersion() == fake.cuda_driver_version
    assert old.cuda_driver_version == 12020


def test_container_view_in_private_mount_namespace(fake_driver_factory: FakeDriverFactory) -> None:
    """With the fake's /dev out of sight the mocks use the real /dev, as inside a container."""
    unshare = shutil.which("unshare")
    need(unshare is not None, "needs unshare(1)")
    fake = fake_driver_factory(gpus=3)
    code = textwrap.dedent(
        """
        import ctypes, json, sys
        cuda = ctypes.CDLL(sys.argv[1])
        nvml = ctypes.CDLL(sys.argv[2])
        init = cuda.cuInit(0)
        count = ctypes.c_int(-1)
        cuda.cuDeviceGetCount(ctypes.byref(count))
        n = ctypes.c_uint(0)
        r = nvml.nvmlInit_v2()
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(n))
        h = ctypes.c_void_p()
        nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
        buf = ctypes.create_string_buffer(96)
        nvml.nvmlDeviceGetUUID(h, buf, 96)
        out = {"cuInit": init, "cuda": count.value, "nvmlInit": r, "nvml": n.value}
        print(json.dumps({**out, "uuid": buf.value.decode()}))
        """
    )
    script = (
        "set -e; mount -t tmpfs -o mode=755 none /dev; "
        "mknod -m 666 /dev/nvidiactl c 195 255; mknod -m 666 /dev/nvidia2 c 195 2; "
        "mknod -m 666 /dev/nvidia-uvm c 508 0; mknod -m 666 /dev/nvidia-uvm-tools c 508 1; "
        f'mount -t tmpfs none "{fake.host_path("/dev")}"; exec "$0" -c "$1" "$2" "$3"'
    )
    probe = subprocess.run([unshare, "--mount", "true"], capture_output=True, check=False)
    need(probe.returncode == 0, "needs unshare --mount (CAP_SYS_ADMIN)")
    proc = subprocess.run(
        [unshare, "--mount", "sh", "-c", script, sys.executable, code, str(fake.cuda_library), str(fake.nvml_library)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"cuInit": 0, "cuda": 1, "nvmlInit": 0, "nvml": 1, "uuid": fake.gpus[2].uuid}


# ---- libcuda mock ------------------------------------------------------------------------------------


def _host_gpu_nodes() -> int:
    names = [n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)]
    return sum(1 for n in names if stat.S_ISCHR(os.stat(f"/dev/{n}").st_mode))


def test_libcuda_mock_on_this_host(fake_driver_factory: FakeDriverFactory) -> None:
    fake = fake_driver_factory(gpus=1, driver_version="535.161.08", cuda_version="12.2")
    cuda = ctypes.CDLL(str(fake.cuda_library))
    version, count = ctypes.c_int(0), ctypes.c_int(-1)
    assert cuda.cuDriverGetVersion(ctypes.byref(version)) == 0
    assert version.value == 12020
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == CUDA_ERROR_NOT_INITIALIZED
    result = cuda.cuInit(0)
    if not os.path.exists("/dev/nvidiactl") or _host_gpu_nodes() == 0:
        assert result == CUDA_ERROR_NO_DEVICE  # the fake root is not where CUDA looks
        assert cuda.cuDeviceGetCount(ctypes.byref(count)) == CUDA_ERROR_NOT_INITIALIZED
    else:
        assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
        assert count.value == _host_gpu_nodes()


# ---- binaries, data files, IPC, /proc, /sys -------------------------------------------------------------


def test_binaries(fake_driver_mig: FakeDriver) -> None:
    fake = fake_driver_mig
    assert {p.rsplit("/", 1)[1] for p in fake.binaries} == {b.name for b in driverfiles.BINARIES}
    for path in fake.binaries:
        host = fake.host_path(path)
        assert stat.S_IMODE(host.stat().st_mode) == 0o755
        assert host.read_bytes()[:4] == b"\x7fELF"
    tool = subprocess.run([fake.host_path("/usr/bin/nvidia-persistenced"), "--version"], capture_output=True, text=True)
    assert tool.returncode == 0 and fake.driver_version in tool.stdout
    env = {"LD_LIBRARY_PATH": str(fake.host_path(driverfiles.LIB_DIR)), "PATH": os.environ.get("PATH", "")}
    smi = fake.host_path("/usr/bin/nvidia-smi")
    version = subprocess.run([smi, "--version"], capture_output=True, text=True, env=env)
    assert version.returncode == 0, version.stdout
    assert f"DRIVER version      : {fake.driver_version}" in version.stdout
    listing = subprocess.run([smi, "-L"], capture_output=True, text=True, env=env).stdout
    for g in fake.gpus:
        assert f"GPU {g.index}: {g.name} (UUID: {g.uuid})" in listing
    for m in fake.mig_devices:
        assert re.search(rf"MIG {re.escape(m.profile)}\s+Device\s+{m.index}: \(UUID: {m.uuid}\)", listing)


def test_nvidia_smi_without_library_on_the_search_path(fake_driver: FakeDriver) -> None:
    import ctypes.util

    need(ctypes.util.find_library("nvidia-ml") is None, "this host has a real libnvidia-ml")
    proc = subprocess.run([fake_driver.host_path("/usr/bin/nvidia-smi")], capture_output=True, text=True)
    assert proc.returncode == 12 and "couldn't find libnvidia-ml.so" in proc.stdout


def test_config_files(fake_driver: FakeDriver) -> None:
    fake = fake_driver

    def load(path: str) -> dict:
        return json.loads(fake.host_path(path).read_text())

    assert load("/usr/share/glvnd/egl_vendor.d/10_nvidia.json")["ICD"]["library_path"] == "libEGL_nvidia.so.0"
    icd = load("/usr/share/vulkan/icd.d/nvidia_icd.json")["ICD"]
    assert icd["library_path"] == "libGLX_nvidia.so.0" and re.fullmatch(r"1\.\d+\.\d+", icd["api_version"])
    platform = "/usr/share/egl/egl_external_platform.d"
    assert load(f"{platform}/15_nvidia_gbm.json")["ICD"]["library_path"] == "libnvidia-egl-gbm.so.1"
    assert load(f"{platform}/10_nvidia_wayland.json")["ICD"]["library_path"] == "libnvidia-egl-wayland.so.1"
    assert "libnvidia-opencl.so.1" in fake.host_path("/etc/OpenCL/vendors/nvidia.icd").read_text()
    assert fake.host_path("/usr/share/nvidia/nvoptix.bin").stat().st_size > 0
    # Every catalogue pattern matches at least one file.
    for pattern in driverfiles.GRAPHICS_CONFIGS:
        directory, name = pattern.rsplit("/", 1)
        assert list(fake.host_path(directory).glob(name)), pattern


def test_ipc_firmware_and_var_run(fake_driver: FakeDriver) -> None:
    fake = fake_driver
    assert os.readlink(fake.host_path("/var/run")) == "../run"
    socket_path = fake.host_path("/var/run/nvidia-persistenced/socket")
    assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
    assert fake.ipc == ("/var/run/nvidia-persistenced/socket",)
    for path in fake.firmware:
        assert re.fullmatch(rf"/lib/firmware/nvidia/{re.escape(fake.driver_version)}/gsp_\w+\.bin", path)
        assert fake.host_path(path).read_bytes()[:4] == b"\x7fELF"


def test_proc_formats(fake_driver_mig: FakeDriver) -> None:
    fake = fake_driver_mig
    version = fake.host_path("/proc/driver/nvidia/version").read_text()
    assert re.match(
        rf"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {re.escape(fake.driver_version)}  \w{{3}} \w{{3}} [ \d]\d "
        r"[\d:]{8} UTC \d{4}\nGCC version:  gcc version ",
        version,
    )
    params = fake.host_path("/proc/driver/nvidia/params").read_text().splitlines()
    for line in ("ModifyDeviceFiles: 1", "DeviceFileUID: 0", "DeviceFileGID: 0", "DeviceFileMode: 438"):
        assert line in params
    assert all(re.fullmatch(r'\w+: (\d+|".*")', line) for line in params)

    for g in fake.gpus:
        info = fake.host_path(f"{g.proc_dir}/information").read_text()
        lines = info.splitlines()
        assert lines[0] == f"Model: \t\t {g.name}"
        assert f"GPU UUID: \t {g.uuid}" in lines
        assert f"Bus Location: \t {g.pci_bus_id}" in lines
        assert f"Device Minor: \t {g.minor}" in lines
        assert lines[-1] == "GPU Excluded:\t No"
        keys = [line.split(":", 1)[0] for line in lines]
        for key in ("IRQ", "Video BIOS", "Bus Type", "DMA Size", "DMA Mask"):
            assert key in keys

    caps = "/proc/driver/nvidia/capabilities"
    assert fake.host_path(f"{caps}/mig/config").read_text() == (
        "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n"
    )
    assert fake.host_path(f"{caps}/mig/monitor").read_text().startswith("DeviceFileMinor: 2\nDeviceFileMode: 292\n")
    minors = dict(
        line.rsplit(" ", 1)[::-1]
        for line in fake.host_path("/proc/driver/nvidia-caps/mig-minors").read_text().splitlines()
    )
    for m in fake.mig_devices:
        gpu = fake.gpus[m.gpu_index]
        assert fake.host_path(m.gi_access).read_text() == (
            f"DeviceFileMinor: {m.gi_cap_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
        )
        assert fake.host_path(m.ci_access).read_text().startswith(f"DeviceFileMinor: {m.ci_cap_minor}\n")
        assert minors[str(m.gi_cap_minor)] == f"gpu{gpu.minor}/gi{m.gi}/access"
        assert minors[str(m.ci_cap_minor)] == f"gpu{gpu.minor}/gi{m.gi}/ci{m.ci}/access"

    devices = fake.host_path("/proc/devices").read_text()
    assert devices.startswith("Character devices:\n")
    char_section = devices.split("\n\n")[0]
    for line in ("195 nvidia-frontend", "508 nvidia-uvm", "237 nvidia-caps", "226 drm"):
        assert f"\n{line}\n" in char_section + "\n"
    assert "\nBlock devices:\n" in devices


def test_sysfs_numa_nodes(fake_driver_mig: FakeDriver) -> None:
    for g in fake_driver_mig.gpus:
        base = fake_driver_mig.host_path(f"/sys/bus/pci/devices/{g.pci_bus_id}")
        assert (base / "numa_node").read_text() == f"{g.numa_node}\n"
        assert (base / "vendor").read_text() == "0x10de\n"
        assert (base / "drm" / f"card{g.dri_card}").is_dir()


# ---- speed and CLI -----------------------------------------------------------------------------------


def test_cli_create(fake_driver_factory: FakeDriverFactory, tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "root"
    result = runner.invoke(fake_driver_cli, ["create", str(target), "--gpus", "2", "--mig", "1:3g.40gb,3g.40gb"])
    assert result.exit_code == 0, result.output
    assert "MIG 1:1  3g.40gb" in result.output
    assert stat.S_ISCHR(os.lstat(target / "dev/nvidia1").st_mode)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--mig", "0:8g.99gb"], "8g.99gb"),
        (["--mig", "zero"], "zero"),
        (["--mig", "3:1g.10gb"], "GPU 3"),
        (["--gpus", "40"], "40"),
        (["--driver-version", "x.y"], "x.y"),
        (["--mig", "0:4g.40gb,4g.40gb"], "4g.40gb"),
    ],
)
def test_cli_rejects_bad_values(tmp_path: Path, args: list[str], named: str) -> None:
    result = CliRunner().invoke(fake_driver_cli, ["create", str(tmp_path / "root"), *args])
    assert result.exit_code == 2, result.output
    assert named in result.output


def test_summary_never_suggests_the_hosts_cdi_folder(fake_driver: FakeDriver) -> None:
    """A simulated driver's spec in /etc/cdi would give every container on the host fake GPUs: the summary
    suggests a folder of its own."""
    from gpuhook.cli.fakedriver import summary

    text = summary(fake_driver)
    assert f"--output {fake_driver.root}-cdi/nvidia.yaml" in text and "/etc/cdi" not in text
