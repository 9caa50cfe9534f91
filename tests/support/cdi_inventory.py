"""Hand-built inventories of any size for CDI unit tests (no driver, no files): 1, 8 or 8×7-MIG GPUs."""

from __future__ import annotations

from gpuhook.model import catalogue
from gpuhook.model.inventory import DeviceNode, DriverFile, Gpu, Inventory, MigDevice

VERSION = "550.54.15"
ROOT = "/host"
CONTROL = (("nvidiactl", 195, 255), ("nvidia-modeset", 195, 254), ("nvidia-uvm", 508, 0), ("nvidia-uvm-tools", 508, 1))


def node(path: str, major: int, minor: int, mode: int = 0o666) -> DeviceNode:
    return DeviceNode(path, ROOT + path, major, minor, mode, "c")


def gpu_uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-444444444444"


def mig_uuid(g: int, m: int) -> str:
    return f"MIG-{g:04x}{m:04x}-5555-6666-7777-888888888888"


def _migs(g: int, count: int) -> tuple[MigDevice, ...]:
    out = []
    for m in range(count):
        gi = 7 + m
        base = 2 + (g * 100 + m) * 2
        out.append(MigDevice(
            g, m, mig_uuid(g, m), gi, 0, "1g.10gb",
            f"/proc/driver/nvidia/capabilities/gpu{g}/mig/gi{gi}/access",
            f"/proc/driver/nvidia/capabilities/gpu{g}/mig/gi{gi}/ci0/access",
            (node(f"/dev/nvidia-caps/nvidia-cap{base}", 237, base, 0o444),
             node(f"/dev/nvidia-caps/nvidia-cap{base + 1}", 237, base + 1, 0o444)),
        ))
    return tuple(out)


def files() -> list[DriverFile]:
    out = []
    for lib in catalogue.LIBRARIES:
        folder = f"{catalogue.LIB_DIR}/{lib.subdir}" if lib.subdir else catalogue.LIB_DIR
        path = f"{folder}/{lib.file_name(VERSION)}"
        out.append(DriverFile("lib", lib.capability, path, ROOT + path, lib.soname(VERSION)))
    for binary in catalogue.BINARIES:
        out.append(DriverFile("bin", binary.capability, f"/usr/bin/{binary.name}", f"{ROOT}/usr/bin/{binary.name}"))
    out.append(DriverFile("firmware", "utility", f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
                          f"{ROOT}/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"))
    out.append(DriverFile("ipc", "utility", "/var/run/nvidia-persistenced/socket",
                          f"{ROOT}/run/nvidia-persistenced/socket"))
    return out


def synthetic_inventory(gpus: int = 1, mig_per_gpu: int = 0, uuids: bool = True) -> Inventory:
    """`gpus` H100-like GPUs, each MIG-enabled with `mig_per_gpu` devices when that is > 0."""
    out = []
    for i in range(gpus):
        migs = _migs(i, mig_per_gpu) if mig_per_gpu else ()
        if not uuids:
            migs = tuple(MigDevice(m.gpu_index, m.index, "", m.gi, m.ci, m.profile, m.gi_access, m.ci_access,
                                   m.cap_nodes) for m in migs)
        bus = f"0000:{0x18 + i:02x}:00.0"
        out.append(Gpu(
            index=i, minor=i, uuid=gpu_uuid(i) if uuids else "", pci_bus_id=bus, name="NVIDIA H100",
            mig_enabled=bool(mig_per_gpu), mig_devices=migs, node=node(f"/dev/nvidia{i}", 195, i),
            dri_nodes=(node(f"/dev/dri/card{i + 1}", 226, i + 1), node(f"/dev/dri/renderD{128 + i}", 226, 128 + i)),
            proc_dir=f"/proc/driver/nvidia/gpus/{bus}",
        ))
    return Inventory(
        driver_version=VERSION, cuda_version="12.4", source="nvml", driver_root=ROOT, dev_root=ROOT,
        proc_root=ROOT + "/proc", gpus=out,
        control_nodes={name: node(f"/dev/{name}", major, minor) for name, major, minor in CONTROL},
        mig_control_nodes={"config": node("/dev/nvidia-caps/nvidia-cap1", 237, 1, 0o400),
                           "monitor": node("/dev/nvidia-caps/nvidia-cap2", 237, 2, 0o444)},
        files=files(), params_host_path=ROOT + "/proc/driver/nvidia/params",
    )
