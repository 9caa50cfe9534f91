"""What a simulated driver install contains: the expected values tests compare against (pure, no I/O).

The hardware is a DGX-like H100 SXM box: bus ids, NUMA nodes and DRM card numbers are stable per GPU index
(independent of the GPU count), MIG GPU-instance ids follow the real placement rules, and the nvidia-caps
minors follow the driver's `/proc/driver/nvidia-caps/mig-minors` numbering.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuhook.model import catalogue
from gpuhook.model.record import Record, field

DEFAULT_DRIVER_VERSION = "550.54.15"
DEFAULT_CUDA_VERSION = "12.4"
DEFAULT_UUID_SALT = "gpuhook-fake"
MAX_GPUS = 16
MAX_MIG_PER_GPU = 7

GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_MEMORY_MIB = 81559
COMPUTE_CAPABILITY = "9.0"
BRAND = "nvidia"
NVML_BRAND = 14  # NVML_BRAND_NVIDIA
NVML_ARCH = 9  # NVML_DEVICE_ARCH_HOPPER
PCI_DEVICE_ID = 0x233010DE
PCI_SUBSYSTEM_ID = 0x16C110DE
VBIOS_VERSION = "96.00.74.00.01"

NVIDIA_MAJOR = catalogue.NVIDIA_MAJOR
UVM_MAJOR = 508
CAPS_MAJOR = 237
DRI_MAJOR = catalogue.DRI_MAJOR
CTL_MINOR = 255
MODESET_MINOR = 254
MIG_CONFIG_MINOR = 1
MIG_MONITOR_MINOR = 2
MIG_CONFIG_MODE = 0o400  # DeviceFileMode: 256
CAP_MODE = 0o444  # DeviceFileMode: 292

# The BMC's VGA (ASPEED) is DRM card0 on a server, so the GPUs' cards start at 1.
BMC_BUS_ID = "0000:03:00.0"
_BUS_NUMBERS = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
# NVLink layouts: none (PCIe only), bridge (NVLink bridges joining GPUs 0-1, 2-3, ... on PCIe cards), nvswitch
# (an HGX box: every GPU's links go to the NVSwitches, all-to-all). Link counts as nvidia-smi shows them.
NVLINK_LAYOUTS = ("none", "bridge", "nvswitch")
BRIDGE_LINKS = 12  # NV12 between the two cards of a bridged pair (three bridges of 4 links)
NVSWITCH_LINKS = 18  # H100 SXM: 18 links per GPU, spread over 4 NVSwitches (5, 5, 4, 4)
NVSWITCH_BUS_IDS = ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0")
NVLINK_REMOTE_GPU = 0  # nvmlIntNvLinkDeviceType_t
NVLINK_REMOTE_SWITCH = 2
# nvmlGpuTopologyLevel_t: the fake's PCI tree puts each GPU behind its own root port; GPUs of one NUMA node meet at
# the node's interconnect between host bridges, GPUs of different nodes across the SMP interconnect.
TOPOLOGY_NODE = 40
TOPOLOGY_SYSTEM = 50
# The EGL external platform libraries carry their own upstream versions (Debian bookworm's, with 535).
EGL_PLATFORM_LIBRARIES: tuple[tuple[str, str], ...] = (
    ("libnvidia-egl-gbm", "1.1.0"),
    ("libnvidia-egl-wayland", "1.1.10"),
)
XORG_DRIVER = "/usr/lib/xorg/modules/drivers/nvidia_drv.so"
XORG_EXTENSIONS = "/usr/lib/xorg/modules/extensions"
DRIVER_VERSION_RE = re.compile(r"\d+\.\d+(\.\d+)?")
CUDA_VERSION_RE = re.compile(r"\d+\.\d+")


class MigProfile(Record):
    """A GPU-instance profile of the H100 80GB; placements are in memory slices (8 per GPU)."""

    name: str
    gi_slices: int
    mem_slices: int
    placements: tuple[int, ...]
    gi_id_base: int
    memory_mib: int
    sm_count: int
    ce_count: int
    dec_count: int
    jpg_count: int
    ofa_count: int

    def gi_id(self, placement: int) -> int:
        """The driver numbers GIs by slot: 7g 0, 4g/3g 1-2, 2g 3-5, 1g 7-13."""
        return self.gi_id_base + placement // self.mem_slices


MIG_PROFILES: dict[str, MigProfile] = {
    p.name: p
    for p in (
        MigProfile("1g.10gb", 1, 1, (0, 1, 2, 3, 4, 5, 6), 7, 9984, 16, 1, 1, 1, 0),
        MigProfile("2g.20gb", 2, 2, (0, 2, 4), 3, 20096, 32, 2, 2, 2, 0),
        MigProfile("3g.40gb", 3, 4, (0, 4), 1, 40320, 60, 3, 3, 3, 0),
        MigProfile("4g.40gb", 4, 4, (0,), 1, 40320, 64, 4, 4, 4, 0),
        MigProfile("7g.80gb", 7, 8, (0,), 0, 80896, 132, 8, 7, 7, 1),
    )
}


class FakeNode(Record):
    """A character device node made under the root; `path` is canonical (/dev/...)."""

    path: str
    major: int
    minor: int
    mode: int = 0o666


class FakeMigDevice(Record):
    gpu_index: int
    index: int  # position among its GPU's MIG devices (NVML's MIG handle index), ordered by GI id
    uuid: str  # MIG-...
    gi: int
    ci: int
    profile: str  # 1g.10gb
    name: str  # "<gpu name> MIG 1g.10gb"
    memory_mib: int
    gi_cap_minor: int
    ci_cap_minor: int
    gi_access: str  # canonical /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access
    ci_access: str

    @property
    def cap_nodes(self) -> tuple[str, str]:
        return (f"/dev/nvidia-caps/nvidia-cap{self.gi_cap_minor}", f"/dev/nvidia-caps/nvidia-cap{self.ci_cap_minor}")


class FakeGpu(Record):
    index: int
    minor: int
    uuid: str
    pci_bus_id: str  # 0000:18:00.0
    name: str
    memory_mib: int
    compute_capability: str
    brand: str
    numa_node: int
    mig_enabled: bool
    mig_devices: tuple[FakeMigDevice, ...]
    dri_card: int  # /dev/dri/card<N>
    dri_render: int  # /dev/dri/renderD<N>
    nvlinks: tuple[tuple[str, int], ...] = ()  # (remote bus id, nvmlIntNvLinkDeviceType_t) per active link

    @property
    def node_path(self) -> str:
        return f"/dev/nvidia{self.minor}"

    @property
    def proc_dir(self) -> str:
        return f"/proc/driver/nvidia/gpus/{self.pci_bus_id}"

    @property
    def nvml_bus_id(self) -> str:
        """NVML's busId: 8-digit domain, upper case."""
        domain, rest = self.pci_bus_id.split(":", 1)
        return f"{int(domain, 16):08X}:{rest.upper()}"


class FakeLibrary(Record):
    name: str  # libcuda
    capability: str
    path: str  # canonical /usr/lib/x86_64-linux-gnu/libcuda.so.<ver>
    soname: str
    bits: int

    @property
    def soname_path(self) -> str:
        """Where the loader finds it by soname: the file itself when it has no soname."""
        return f"{self.path.rsplit('/', 1)[0]}/{self.soname}" if self.soname else self.path


class FakeDriver(Record):
    """A built fake driver root. Paths are canonical (as in a container); `host_path` maps them under root."""

    root: Path
    driver_version: str
    cuda_version: str
    gpus: tuple[FakeGpu, ...]
    compat32: bool
    libraries: tuple[FakeLibrary, ...] = ()
    # The driver's files of other versions or places, as NVIDIA ships them: the EGL platform libraries (own
    # versions), the X driver and GLX server module (no soname).
    others: tuple[FakeLibrary, ...] = ()
    dev_links: tuple[tuple[str, str], ...] = ()  # (canonical link path, target name in the same dir)
    binaries: tuple[str, ...] = ()
    firmware: tuple[str, ...] = ()
    configs: tuple[str, ...] = ()
    ipc: tuple[str, ...] = ()
    nodes: tuple[FakeNode, ...] = ()
    proc_files: tuple[str, ...] = ()
    char_devices: tuple[tuple[int, str], ...] = ()  # /proc/devices lines beyond the GPU driver's own
    extra_files: tuple[tuple[str, str], ...] = ()  # (canonical path, text) of datacenter files (GDS)
    uuid_salt: str = field(default=DEFAULT_UUID_SALT, compare=False)

    def host_path(self, canonical: str) -> Path:
        return self.root / canonical.lstrip("/")

    @property
    def cuda_driver_version(self) -> int:
        """cuDriverGetVersion's value: 12.4 -> 12040."""
        major, minor = self.cuda_version.split(".")
        return int(major) * 1000 + int(minor) * 10

    @property
    def mig_devices(self) -> tuple[FakeMigDevice, ...]:
        return tuple(m for g in self.gpus for m in g.mig_devices)

    def library(self, name: str, bits: int = 64) -> FakeLibrary:
        for lib in self.libraries:
            if lib.name == name and lib.bits == bits:
                return lib
        raise KeyError(f"{name} ({bits}-bit) is not in this fake driver")

    @property
    def nvml_library(self) -> Path:
        """Host path of the 64-bit libnvidia-ml.so.1 (the soname link)."""
        return self.host_path(self.library("libnvidia-ml").soname_path)

    @property
    def cuda_library(self) -> Path:
        return self.host_path(self.library("libcuda").soname_path)

    @property
    def control_dir(self) -> Path:
        """Where tests steer the NVML mock: xid, fail-init, lost-<index>, wait-at-once, registrations,
        compute-mode-<index>, compute-mode-denied."""
        return self.root / "run" / "fake-nvml"

    def inject_xid(self, gpu_index: int, xid: int, gi: int | None = None, ci: int | None = None) -> None:
        """Queue an XID critical error on a GPU (by table index); each event set delivers it once."""
        self._gpu(gpu_index)
        extra = f" {gi} {ci}" if gi is not None and ci is not None else ""
        with open(self.control_dir / "xid", "a", encoding="ascii") as f:
            f.write(f"{gpu_index} {xid}{extra}\n")

    def set_gpu_lost(self, gpu_index: int, lost: bool = True) -> None:
        self._gpu(gpu_index)
        self._flag(f"lost-{gpu_index}", lost)

    def set_fail_init(self, fail: bool = True) -> None:
        self._flag("fail-init", fail)

    def set_wait_at_once(self, at_once: bool = True) -> None:
        """nvmlEventSetWait answers NVML_ERROR_TIMEOUT at once, without blocking, and counts its calls."""
        self._flag("wait-at-once", at_once)

    def compute_mode(self, gpu_index: int) -> int:
        """A GPU's NVML compute mode (0 DEFAULT, 2 PROHIBITED, 3 EXCLUSIVE_PROCESS)."""
        self._gpu(gpu_index)
        path = self.control_dir / f"compute-mode-{gpu_index}"
        return int(path.read_text(encoding="ascii").split()[0]) if path.exists() else 0

    def set_compute_mode(self, gpu_index: int, mode: int) -> None:
        self._gpu(gpu_index)
        (self.control_dir / f"compute-mode-{gpu_index}").write_text(f"{mode}\n", encoding="ascii")

    def set_compute_mode_denied(self, denied: bool = True) -> None:
        """nvmlDeviceSetComputeMode answers NO_PERMISSION."""
        self._flag("compute-mode-denied", denied)

    def event_waits(self) -> int:
        """How many nvmlEventSetWait calls were answered at once (set_wait_at_once) so far."""
        path = self.control_dir / "wait-calls"
        return path.stat().st_size if path.exists() else 0

    def registrations(self) -> list[tuple[int, int, int]]:
        """(pid, gpu index, event mask) for every nvmlDeviceRegisterEvents so far."""
        path = self.control_dir / "registrations"
        if not path.exists():
            return []
        rows = (line.split() for line in path.read_text(encoding="ascii").splitlines())
        return [(int(p), int(i), int(m, 16)) for p, i, m in rows]

    def reset_controls(self) -> None:
        """Undo every test control: no queued XIDs, no lost GPUs, init succeeds."""
        for entry in self.control_dir.iterdir():
            entry.unlink()
        (self.control_dir / "xid").touch()

    def _gpu(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise ValueError(f"GPU index {index} out of range (this fake has {len(self.gpus)} GPUs)")
        return self.gpus[index]

    def _flag(self, name: str, on: bool) -> None:
        path = self.control_dir / name
        if on:
            path.touch()
        else:
            path.unlink(missing_ok=True)


def nvlinks(index: int, gpus: int, layout: str) -> tuple[tuple[str, int], ...]:
    """GPU `index`'s active NVLinks in `layout`: its bridge partner's bus id BRIDGE_LINKS times, or the
    NVSwitches' bus ids (link l to switch l mod 4), or none."""
    if layout == "bridge":
        partner = index ^ 1
        return ((bus_id(partner), NVLINK_REMOTE_GPU),) * BRIDGE_LINKS if partner < gpus else ()
    if layout == "nvswitch" and gpus > 1:
        return tuple((NVSWITCH_BUS_IDS[link % len(NVSWITCH_BUS_IDS)], NVLINK_REMOTE_SWITCH)
                     for link in range(NVSWITCH_LINKS))
    return ()


def pci_level(a: FakeGpu, b: FakeGpu) -> int:
    """nvmlDeviceGetTopologyCommonAncestor of two GPUs of the fake (0 for the same GPU)."""
    if a.index == b.index:
        return 0
    return TOPOLOGY_NODE if a.numa_node == b.numa_node else TOPOLOGY_SYSTEM


def bus_id(index: int) -> str:
    """Stable per index: 8 GPUs per PCI domain, so GPUs 8-15 exercise a non-zero domain."""
    return f"{index // 8:04x}:{_BUS_NUMBERS[index % 8]:02x}:00.0"


def gpu_uuid(index: int, salt: str = DEFAULT_UUID_SALT) -> str:
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'{salt}/gpu/{index}')}"


def mig_uuid(gpu_index: int, gi: int, ci: int, salt: str = DEFAULT_UUID_SALT) -> str:
    return f"MIG-{uuid.uuid5(uuid.NAMESPACE_URL, f'{salt}/gpu/{gpu_index}/gi/{gi}/ci/{ci}')}"


def cap_minors(gpu_minor: int, gi: int, ci: int) -> tuple[int, int]:
    """nvidia-caps minors of gpu<m>/gi<g>/access and .../ci<c>/access (15 GIs x (1 + 8 CIs) per GPU)."""
    gi_minor = 3 + gpu_minor * 135 + gi * 9
    return gi_minor, gi_minor + 1 + ci


def place_mig(gpu_index: int, profiles: Sequence[str]) -> list[tuple[str, int]]:
    """Largest first, each at its first free placement; returns (profile, GI id) ordered by GI id."""
    used = [False] * 8
    compute = 0
    placed: list[tuple[str, int]] = []
    for name in sorted(profiles, key=lambda p: (-MIG_PROFILES[p].mem_slices, -MIG_PROFILES[p].gi_slices)):
        profile = MIG_PROFILES[name]
        compute += profile.gi_slices
        start = next(
            (p for p in profile.placements if not any(used[p : p + profile.mem_slices])),
            None,
        )
        if compute > MAX_MIG_PER_GPU or start is None:
            raise ValueError(f"MIG profiles {list(profiles)} do not fit on GPU {gpu_index}: no room for {name}")
        used[start : start + profile.mem_slices] = [True] * profile.mem_slices
        placed.append((name, profile.gi_id(start)))
    return sorted(placed, key=lambda p: p[1])


def _mig_devices(gpu_index: int, minor: int, profiles: Sequence[str], salt: str) -> tuple[FakeMigDevice, ...]:
    devices = []
    for index, (name, gi) in enumerate(place_mig(gpu_index, profiles)):
        ci = 0  # one full-size compute instance per GPU instance, as mig-parted makes them
        gi_minor, ci_minor = cap_minors(minor, gi, ci)
        base = f"/proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{gi}"
        devices.append(
            FakeMigDevice(
                gpu_index=gpu_index,
                index=index,
                uuid=mig_uuid(gpu_index, gi, ci, salt),
                gi=gi,
                ci=ci,
                profile=name,
                name=f"{GPU_NAME} MIG {name}",
                memory_mib=MIG_PROFILES[name].memory_mib,
                gi_cap_minor=gi_minor,
                ci_cap_minor=ci_minor,
                gi_access=f"{base}/access",
                ci_access=f"{base}/ci{ci}/access",
            )
        )
    return tuple(devices)


def validate(
    gpus: int,
    driver_version: str,
    cuda_version: str,
    mig: Mapping[int, Sequence[str]] | None,
    minors: Sequence[int] | None,
    nvlink: str = "none",
) -> None:
    """Reject bad parameters up front, naming the value."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise ValueError(f"gpus must be an integer from 0 to {MAX_GPUS}, got {gpus!r}")
    if not DRIVER_VERSION_RE.fullmatch(driver_version):
        raise ValueError(f"driver version {driver_version!r} is not like 550.54.15")
    if not CUDA_VERSION_RE.fullmatch(cuda_version):
        raise ValueError(f"CUDA version {cuda_version!r} is not like 12.4")
    for index, profiles in (mig or {}).items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < gpus:
            raise ValueError(f"MIG GPU index {index!r} out of range (0..{gpus - 1})")
        if isinstance(profiles, str):
            raise ValueError(f"MIG profiles for GPU {index} must be a list, got {profiles!r}")
        for profile in profiles:
            if profile not in MIG_PROFILES:
                raise ValueError(f"unknown MIG profile {profile!r} for GPU {index}; known: {', '.join(MIG_PROFILES)}")
    if nvlink not in NVLINK_LAYOUTS:
        raise ValueError(f"unknown NVLink layout {nvlink!r}; known: {', '.join(NVLINK_LAYOUTS)}")
    if minors is not None:
        if len(minors) != gpus or len(set(minors)) != gpus:
            raise ValueError(f"minors {list(minors)!r} must be {gpus} distinct numbers")
        if any(not 0 <= m < MODESET_MINOR for m in minors):
            raise ValueError(f"minors {list(minors)!r} must lie in 0..{MODESET_MINOR - 1}")


def plan_gpus(
    gpus: int, mig: Mapping[int, Sequence[str]] | None, minors: Sequence[int] | None, salt: str,
    nvlink: str = "none",
) -> tuple[FakeGpu, ...]:
    mig = mig or {}
    result = []
    for index in range(gpus):
        minor = minors[index] if minors is not None else index
        result.append(
            FakeGpu(
                index=index,
                minor=minor,
                uuid=gpu_uuid(index, salt),
                pci_bus_id=bus_id(index),
                name=GPU_NAME,
                memory_mib=GPU_MEMORY_MIB,
                compute_capability=COMPUTE_CAPABILITY,
                brand=BRAND,
                numa_node=(index // 4) % 2,
                mig_enabled=index in mig,
                mig_devices=_mig_devices(index, minor, mig.get(index, ()), salt),
                dri_card=index + 1,
                dri_render=128 + index,
                nvlinks=nvlinks(index, gpus, nvlink),
            )
        )
    return tuple(result)
