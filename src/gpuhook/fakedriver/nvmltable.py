"""The NVML mock's per-build GPU table as C source (see csrc/fakenvml.h)."""

from __future__ import annotations

from pathlib import Path

from gpuhook.fakedriver.compile import c_string
from gpuhook.fakedriver.model import (
    MAX_GPUS,
    MIG_PROFILES,
    NVML_ARCH,
    NVML_BRAND,
    PCI_DEVICE_ID,
    PCI_SUBSYSTEM_ID,
    FakeGpu,
    FakeMigDevice,
    pci_level,
)

_MIB = 1 << 20


def nvml_version(driver_version: str, cuda_version: str) -> str:
    """nvmlSystemGetNVMLVersion: the CUDA major, then the driver version ("12.550.54.15")."""
    return f"{cuda_version.split('.')[0]}.{driver_version}"


def _gpu_row(gpu: FakeGpu, mig_first: int) -> str:
    domain, bus, rest = gpu.pci_bus_id.split(":")
    device, function = rest.split(".")
    cc_major, cc_minor = gpu.compute_capability.split(".")
    fields = [
        str(gpu.index),
        str(gpu.minor),
        c_string(gpu.uuid),
        c_string(gpu.name),
        f"0x{domain}",
        f"0x{bus}",
        f"0x{device}",
        f"0x{function}",
        f"0x{PCI_DEVICE_ID:08X}u",
        f"0x{PCI_SUBSYSTEM_ID:08X}u",
        f"{gpu.memory_mib * _MIB}ULL",
        cc_major,
        cc_minor,
        str(NVML_BRAND),
        str(NVML_ARCH),
        str(gpu.numa_node),
        "1" if gpu.mig_enabled else "0",
        str(mig_first),
        str(len(gpu.mig_devices)),
    ]
    return "    {" + ", ".join(fields) + "},"


# The H100 80GB's GPU-instance profile ids (nvidia-smi mig -lgip, "ID"; NVIDIA's MIG user guide's H100 table).
GI_PROFILE_IDS = {"1g.10gb": 19, "2g.20gb": 14, "3g.40gb": 9, "4g.40gb": 5, "7g.80gb": 0}


def _mig_row(mig: FakeMigDevice) -> str:
    p = MIG_PROFILES[mig.profile]
    counts = [p.sm_count, p.ce_count, p.dec_count, 0, p.jpg_count, p.ofa_count, p.gi_slices, p.gi_slices]
    start = (mig.gi - p.gi_id_base) * p.mem_slices  # MigProfile.gi_id's inverse
    counts += [GI_PROFILE_IDS[mig.profile], start, p.mem_slices]
    fields = [
        str(mig.gpu_index),
        str(mig.index),
        c_string(mig.uuid),
        c_string(mig.name),
        str(mig.gi),
        str(mig.ci),
        f"{mig.memory_mib * _MIB}ULL",
        *(str(c) for c in counts),
    ]
    return "    {" + ", ".join(fields) + "},"


def _nvlink_rows(gpus: tuple[FakeGpu, ...]) -> tuple[list[str], list[int], list[int]]:
    rows: list[str] = []
    first, count = [0] * MAX_GPUS, [0] * MAX_GPUS
    for gpu in gpus:
        first[gpu.index], count[gpu.index] = len(rows), len(gpu.nvlinks)
        for remote, kind in gpu.nvlinks:
            domain, bus, rest = remote.split(":")
            device, function = rest.split(".")
            rows.append(f"    {{0x{domain}, 0x{bus}, 0x{device}, 0x{function}, {kind}}},")
    return rows, first, count


def _topology_rows(gpus: tuple[FakeGpu, ...]) -> list[str]:
    levels = [[0] * MAX_GPUS for _ in range(MAX_GPUS)]
    for a in gpus:
        for b in gpus:
            levels[a.index][b.index] = pci_level(a, b)
    return ["    {" + ", ".join(str(v) for v in row) + "}," for row in levels]


def table_source(root: Path, driver_version: str, cuda_version: str, cuda_int: int, gpus: tuple[FakeGpu, ...]) -> str:
    gpu_rows, mig_rows = [], []
    for gpu in gpus:
        gpu_rows.append(_gpu_row(gpu, len(mig_rows)))
        mig_rows.extend(_mig_row(m) for m in gpu.mig_devices)
    # An empty initializer list is not C99: keep one unused zero row.
    gpu_rows = gpu_rows or ["    {0},"]
    mig_rows = mig_rows or ["    {0},"]
    link_rows, link_first, link_count = _nvlink_rows(gpus)
    link_rows = link_rows or ["    {0},"]
    vis = '__attribute__((visibility("hidden")))'
    return "\n".join(
        [
            '#include "fakenvml.h"',
            f"{vis} const char fake_root[] = {c_string(str(root))};",
            f"{vis} const char fake_driver_version[] = {c_string(driver_version)};",
            f"{vis} const char fake_nvml_version[] = {c_string(nvml_version(driver_version, cuda_version))};",
            f"{vis} const int fake_cuda_version = {cuda_int};",
            f"{vis} const unsigned fake_gpu_count = {len(gpus)};",
            f"{vis} const struct fake_gpu fake_gpus[] = {{",
            *gpu_rows,
            "};",
            f"{vis} const unsigned fake_mig_count = {sum(len(g.mig_devices) for g in gpus)};",
            f"{vis} const struct fake_mig fake_migs[] = {{",
            *mig_rows,
            "};",
            f"{vis} const unsigned fake_nvlink_first[FAKE_MAX_GPUS] = {{{', '.join(map(str, link_first))}}};",
            f"{vis} const unsigned fake_nvlink_count[FAKE_MAX_GPUS] = {{{', '.join(map(str, link_count))}}};",
            f"{vis} const struct fake_nvlink fake_nvlinks[] = {{",
            *link_rows,
            "};",
            f"{vis} const unsigned char fake_topology[FAKE_MAX_GPUS][FAKE_MAX_GPUS] = {{",
            *_topology_rows(gpus),
            "};",
            "",
        ]
    )
