"""Where each MIG device sits on its GPU: its GPU instance's profile id and placement (memory slices), from NVML
(nvmlDeviceGetGpuInstanceById, nvmlGpuInstanceGetInfo), which NVIDIA's DRA driver names MIG devices by
(`gpu-<minor>-mig-<profile>-<profile id>-<placement start>`) and publishes as `memorySlice<i>` capacities.

Asked at each discovery of the driver, while no health monitor holds the process's NVML (driver.py stops it
first). A GPU or instance NVML does not answer for is left out: its MIG devices keep a name of their own.
"""

from __future__ import annotations

import logging

from gpuhook.errors import DiscoveryError
from gpuhook.model.inventory import Inventory
from gpuhook.model.record import Record

log = logging.getLogger("gpuhook.dra.placement")


class Placement(Record):
    profile_id: int
    start: int
    size: int


def read(library: str | None, inv: Inventory) -> dict[str, Placement]:
    """MIG device UUID -> its placement, for every MIG device NVML describes (none without NVML or MIG)."""
    migs = inv.all_mig_devices()
    if library is None or not migs:
        return {}
    from gpuhook.discover.nvml import bound_nvml

    out: dict[str, Placement] = {}
    try:
        with bound_nvml(library) as nv:
            for gpu in inv.gpus:
                if not gpu.mig_devices:
                    continue
                try:
                    handle = nv.nvmlDeviceGetHandleByUUID(gpu.uuid)
                except nv.NVMLError as exc:
                    log.warning("MIG placement of GPU %d: %s", gpu.index, exc)
                    continue
                for mig in gpu.mig_devices:
                    try:
                        info = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(handle, mig.gi))
                    except nv.NVMLError as exc:
                        log.warning("MIG placement of %s (GPU %d, GI %d): %s", mig.uuid, gpu.index, mig.gi, exc)
                        continue
                    out[mig.uuid] = Placement(int(info.profileId), int(info.placement.start),
                                              int(info.placement.size))
    except DiscoveryError as exc:
        log.warning("MIG placements unknown: %s", exc)
    return out
