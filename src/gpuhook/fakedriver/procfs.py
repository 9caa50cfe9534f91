"""The kernel module's /proc text, byte for byte in the real formats (nv-procfs.c, nv-caps.c, fs/proc)."""

from __future__ import annotations

from gpuhook.fakedriver.model import (
    CAPS_MAJOR,
    DRI_MAJOR,
    NVIDIA_MAJOR,
    UVM_MAJOR,
    VBIOS_VERSION,
    FakeGpu,
)

BUILD_DATE = "Tue Mar  5 22:23:56 UTC 2024"
GCC_LINE = "gcc version 12.2.0 (Debian 12.2.0-14) "

# nv_parms[] of the 550 kernel module, in order, with their defaults.
_PARAMS: tuple[tuple[str, int], ...] = (
    ("ResmanDebugLevel", 4294967295),
    ("RmLogonRC", 1),
    ("ModifyDeviceFiles", 1),
    ("DeviceFileUID", 0),
    ("DeviceFileGID", 0),
    ("DeviceFileMode", 438),
    ("InitializeSystemMemoryAllocations", 1),
    ("UsePageAttributeTable", 4294967295),
    ("EnableMSI", 1),
    ("EnablePCIeGen3", 0),
    ("MemoryPoolSize", 0),
    ("KMallocHeapMaxSize", 0),
    ("VMallocHeapMaxSize", 0),
    ("IgnoreMMIOCheck", 0),
    ("EnableStreamMemOPs", 0),
    ("EnableUserNUMAManagement", 1),
    ("NvLinkDisable", 0),
    ("RmProfilingAdminOnly", 1),
    ("PreserveVideoMemoryAllocations", 0),
    ("EnableS0ixPowerManagement", 0),
    ("S0ixPowerManagementVideoMemoryThreshold", 256),
    ("DynamicPowerManagement", 3),
    ("DynamicPowerManagementVideoMemoryThreshold", 200),
    ("RegisterPCIDriver", 1),
    ("EnablePCIERelaxedOrderingMode", 0),
    ("EnableResizableBar", 0),
    ("EnableGpuFirmware", 18),
    ("EnableGpuFirmwareLogs", 2),
    ("RmNvlinkBandwidthLinkCount", 0),
    ("EnableDbgBreakpoint", 0),
    ("OpenRmEnableUnsupportedGpus", 0),
    ("DmaRemapPeerMmio", 1),
    ("ImexChannelCount", 2048),
    ("CreateImexChannel0", 0),
    ("GrdmaPciTopoCheckOverride", 0),
)
_STRING_PARAMS = (
    "RegistryDwords",
    "RegistryDwordsPerDevice",
    "RmMsg",
    "GpuBlacklist",
    "TemporaryFilePath",
    "ExcludedGpus",
)

# Character devices besides the driver's, so parsers meet a realistic file.
_OTHER_CHAR_DEVICES: tuple[tuple[int, str], ...] = (
    (1, "mem"),
    (4, "/dev/vc/0"),
    (4, "tty"),
    (4, "ttyS"),
    (5, "/dev/tty"),
    (5, "/dev/console"),
    (5, "/dev/ptmx"),
    (7, "vcs"),
    (10, "misc"),
    (13, "input"),
    (29, "fb"),
    (128, "ptm"),
    (136, "pts"),
    (180, "usb"),
    (189, "usb_device"),
    (240, "hidraw"),
    (241, "aux"),
    (242, "bsg"),
    (243, "watchdog"),
)
_NVIDIA_CHAR_DEVICES = (
    (NVIDIA_MAJOR, "nvidia-frontend"),
    (DRI_MAJOR, "drm"),
    (CAPS_MAJOR, "nvidia-caps"),
    (UVM_MAJOR, "nvidia-uvm"),
)
_BLOCK_DEVICES = ((7, "loop"), (8, "sd"), (9, "md"), (65, "sd"), (259, "blkext"))


def version_text(driver_version: str) -> str:
    return f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver_version}  {BUILD_DATE}\nGCC version:  {GCC_LINE}\n"


def params_text(modify_device_files: int = 1) -> str:
    lines = [f"{k}: {modify_device_files if k == 'ModifyDeviceFiles' else v}" for k, v in _PARAMS]
    lines += [f'{k}: ""' for k in _STRING_PARAMS]
    return "\n".join(lines) + "\n"


def gpu_information_text(gpu: FakeGpu, driver_version: str) -> str:
    """nv_procfs_read_gpu_info(); GSP-based GPUs (H100) also print their firmware version."""
    return (
        f"Model: \t\t {gpu.name}\n"
        "IRQ:   \t\t 0\n"
        f"GPU UUID: \t {gpu.uuid}\n"
        f"Video BIOS: \t {VBIOS_VERSION}\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 52 bits\n"
        "DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {gpu.pci_bus_id}\n"
        f"Device Minor: \t {gpu.minor}\n"
        f"GPU Firmware: \t {driver_version}\n"
        "GPU Excluded:\t No\n"
    )


def gpu_power_text() -> str:
    return (
        "Runtime D3 status:          Not supported\n"
        "Video Memory:               Active\n\n"
        "GPU Hardware Support:\n"
        " Video Memory Self Refresh: Not supported\n"
        " Video Memory Off:          Not supported\n\n"
        "Power Limits:\n"
        " Default:                   N/A milliwatts\n"
        " GPU Boost:                 N/A milliwatts\n"
    )


def cap_text(minor: int, mode: int) -> str:
    """A capability file under /proc/driver/nvidia/capabilities; mode is decimal (292 = 0444)."""
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def mig_minors_text(max_gpus: int = 32) -> str:
    """/proc/driver/nvidia-caps/mig-minors: every possible GPU's 15 GIs x (1 + 8 CIs)."""
    lines = ["config 1", "monitor 2"]
    minor = 3
    for gpu in range(max_gpus):
        for gi in range(15):
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            minor += 1
            for ci in range(8):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {minor}")
                minor += 1
    return "\n".join(lines) + "\n"


def devices_text(extra: tuple[tuple[int, str], ...] = ()) -> str:
    """fs/proc/devices.c: "%3d %s\\n" per driver, sorted by major, char then block; `extra` adds char drivers."""
    chars = sorted(_OTHER_CHAR_DEVICES + _NVIDIA_CHAR_DEVICES + extra, key=lambda d: d[0])
    lines = ["Character devices:"] + [f"{major:3d} {name}" for major, name in chars]
    lines += ["", "Block devices:"] + [f"{major:3d} {name}" for major, name in _BLOCK_DEVICES]
    return "\n".join(lines) + "\n"
