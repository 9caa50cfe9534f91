"""A hand-built Inventory for pure planning tests (no driver, no files)."""

from __future__ import annotations

from gpuhook.model.inventory import DeviceNode, DriverFile, Gpu, Inventory, MigDevice

LIB = "/usr/lib/x86_64-linux-gnu"


def node(path: str, major: int, minor: int) -> DeviceNode:
    return DeviceNode(path, "/host" + path, major, minor, 0o666, "c")


def sample_inventory(gpus: int = 3, mig_on: int | None = 2) -> Inventory:
    out = []
    for i in range(gpus):
        migs: tuple[MigDevice, ...] = ()
        if i == mig_on:
            migs = tuple(
                MigDevice(
                    i,
                    m,
                    f"MIG-0000000{i}-000{m}",
                    gi,
                    0,
                    "1g.10gb",
                    f"/proc/driver/nvidia/capabilities/gpu{i}/mig/gi{gi}/access",
                    f"/proc/driver/nvidia/capabilities/gpu{i}/mig/gi{gi}/ci0/access",
                    (
                        node(f"/dev/nvidia-caps/nvidia-cap{10 + 2 * m}", 237, 10 + 2 * m),
                        node(f"/dev/nvidia-caps/nvidia-cap{11 + 2 * m}", 237, 11 + 2 * m),
                    ),
                )
                for m, gi in enumerate((3, 5))
            )
        out.append(
            Gpu(
                index=i,
                minor=i,
                uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
                pci_bus_id=f"0000:{0x18 + i:02x}:00.0",
                name="NVIDIA H100",
                compute_capability="9.0",
                brand="nvidia",
                numa_node=i // 2,
                mig_enabled=bool(migs),
                mig_devices=migs,
                node=node(f"/dev/nvidia{i}", 195, i),
                dri_nodes=(node(f"/dev/dri/card{i + 1}", 226, i + 1), node(f"/dev/dri/renderD{128 + i}", 226, 128 + i)),
                proc_dir=f"/proc/driver/nvidia/gpus/0000:{0x18 + i:02x}:00.0",
            )
        )
    files = [
        DriverFile("lib", "compute", f"{LIB}/libcuda.so.550.54.15", f"/host{LIB}/libcuda.so.550.54.15", "libcuda.so.1"),
        DriverFile(
            "lib",
            "utility",
            f"{LIB}/libnvidia-ml.so.550.54.15",
            f"/host{LIB}/libnvidia-ml.so.550.54.15",
            "libnvidia-ml.so.1",
        ),
        DriverFile(
            "lib",
            "graphics",
            f"{LIB}/libGLX_nvidia.so.550.54.15",
            f"/host{LIB}/libGLX_nvidia.so.550.54.15",
            "libGLX_nvidia.so.0",
        ),
        DriverFile(
            "lib",
            "graphics",
            f"{LIB}/libnvidia-glcore.so.550.54.15",
            f"/host{LIB}/libnvidia-glcore.so.550.54.15",
            "libnvidia-glcore.so.550.54.15",
        ),
        DriverFile(
            "lib32",
            "compute",
            "/usr/lib/i386-linux-gnu/libcuda.so.550.54.15",
            "/host/usr/lib/i386-linux-gnu/libcuda.so.550.54.15",
            "libcuda.so.1",
        ),
        DriverFile("bin", "utility", "/usr/bin/nvidia-smi", "/host/usr/bin/nvidia-smi"),
        DriverFile("ipc", "utility", "/var/run/nvidia-persistenced/socket", "/host/run/nvidia-persistenced/socket"),
        DriverFile(
            "firmware",
            "utility",
            "/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
            "/host/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
        ),
    ]
    return Inventory(
        driver_version="550.54.15",
        cuda_version="12.4",
        source="nvml",
        driver_root="/host",
        dev_root="/host",
        proc_root="/host/proc",
        gpus=out,
        control_nodes={
            n: node(f"/dev/{n}", 195 if n != "nvidia-uvm" and n != "nvidia-uvm-tools" else 508, m)
            for n, m in (("nvidiactl", 255), ("nvidia-modeset", 254), ("nvidia-uvm", 0), ("nvidia-uvm-tools", 1))
        },
        mig_control_nodes={
            "config": node("/dev/nvidia-caps/nvidia-cap1", 237, 1),
            "monitor": node("/dev/nvidia-caps/nvidia-cap2", 237, 2),
        },
        files=files,
        params_host_path="/host/proc/driver/nvidia/params",
    )
