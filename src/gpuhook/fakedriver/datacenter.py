"""The datacenter devices a fake driver root can carry: IMEX channels, NVSwitches, GDS, RDMA (MOFED), gdrcopy.

Majors are what a DGX-class host shows: the dynamic ones as the kernel hands them out (from 511 down in the
extended range, from 254 down below 256), infiniband_verbs its static 231 and rdma_cm a misc (10) minor. Each
family's /proc/devices line appears only when its module would be loaded; nvidia-caps-imex-channels always
(nvidia.ko 550 registers it whether or not a channel exists).
"""

from __future__ import annotations

from gpuhook.fakedriver.model import FakeNode
from gpuhook.model import catalogue
from gpuhook.model.record import Record

IMEX_MAJOR = 509
NVSWITCH_MAJOR = 236
NVSWITCH_CTL_MINOR = 255
NVIDIA_FS_MAJOR = 235
NVIDIA_FS_NODES = 16  # nvidia-fs.ko makes /dev/nvidia-fs0..15
GDRDRV_MAJOR = 234
UVERBS_MAJOR = 231
UVERBS_BASE_MINOR = 192
MISC_MAJOR = 10
RDMA_CM_MINOR = 58
MAX_NVSWITCHES = 64
MAX_HCAS = 32
CUFILE_JSON = '{\n    "logging": { "level": "ERROR" },\n    "properties": { "use_poll_mode": false }\n}\n'


class Datacenter(Record):
    """What to simulate: IMEX channel numbers, NVSwitch count, GDS, RDMA HCA count, gdrcopy."""

    imex_channels: tuple[int, ...] = ()
    nvswitches: int = 0
    gds: bool = False
    hcas: int = 0
    gdrcopy: bool = False

    def validate(self) -> None:
        bad = [c for c in self.imex_channels if isinstance(c, bool) or not 0 <= c <= catalogue.IMEX_CHANNEL_MAX]
        if bad:
            raise ValueError(f"IMEX channel {bad[0]!r} out of range (0..{catalogue.IMEX_CHANNEL_MAX})")
        if not 0 <= self.nvswitches <= MAX_NVSWITCHES:
            raise ValueError(f"nvswitches must be 0..{MAX_NVSWITCHES}, got {self.nvswitches!r}")
        if not 0 <= self.hcas <= MAX_HCAS:
            raise ValueError(f"RDMA HCAs must be 0..{MAX_HCAS}, got {self.hcas!r}")

    def nodes(self) -> tuple[FakeNode, ...]:
        imex = catalogue.IMEX_CHANNEL_DIR + "/" + catalogue.IMEX_CHANNEL_PREFIX
        nodes = [FakeNode(f"{imex}{c}", IMEX_MAJOR, c) for c in sorted(set(self.imex_channels))]
        if self.nvswitches:
            nodes.append(FakeNode("/dev/nvidia-nvswitchctl", NVSWITCH_MAJOR, NVSWITCH_CTL_MINOR))
            nodes += [FakeNode(f"/dev/nvidia-nvswitch{i}", NVSWITCH_MAJOR, i) for i in range(self.nvswitches)]
        if self.gds:
            nodes += [FakeNode(f"/dev/nvidia-fs{i}", NVIDIA_FS_MAJOR, i) for i in range(NVIDIA_FS_NODES)]
        if self.hcas:
            nodes += [FakeNode(f"/dev/infiniband/uverbs{i}", UVERBS_MAJOR, UVERBS_BASE_MINOR + i)
                      for i in range(self.hcas)]
            nodes.append(FakeNode("/dev/infiniband/rdma_cm", MISC_MAJOR, RDMA_CM_MINOR))
        if self.gdrcopy:
            nodes.append(FakeNode("/dev/gdrdrv", GDRDRV_MAJOR, 0))
        return tuple(nodes)

    def char_devices(self) -> tuple[tuple[int, str], ...]:
        """The /proc/devices lines these modules add."""
        lines = [(IMEX_MAJOR, catalogue.IMEX_DEVICES_NAME)]
        if self.nvswitches:
            lines.append((NVSWITCH_MAJOR, "nvidia-nvswitch"))
        if self.gds:
            lines.append((NVIDIA_FS_MAJOR, "nvidia-fs"))
        if self.hcas:
            lines.append((UVERBS_MAJOR, "infiniband_verbs"))
        if self.gdrcopy:
            lines.append((GDRDRV_MAJOR, "gdrdrv"))
        return tuple(lines)

    def files(self) -> dict[str, str]:
        """Regular files (canonical path -> text): GDS's cuFile configuration and a udev database entry."""
        if not self.gds:
            return {}
        return {"/etc/cufile.json": CUFILE_JSON, "/run/udev/data/c235:0": "E:DEVNAME=/dev/nvidia-fs0\n"}
