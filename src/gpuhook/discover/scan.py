"""The scan: a host's driver install, through NVML or procfs and /dev, into an `Inventory`.

NVML is the primary source; procfs and /dev are the fallback (and the only source of cap node minors).
"""

from __future__ import annotations

import os
from contextlib import suppress

from gpuhook.discover import datacenter, devnodes, procfs
from gpuhook.discover.driverfiles import all_files, ldcache_index
from gpuhook.discover.fingerprint import fingerprint
from gpuhook.discover.roots import Roots, join, resolve_in_root
from gpuhook.errors import DiscoveryError
from gpuhook.model import catalogue
from gpuhook.model.edits import CUDA_SONAME
from gpuhook.model.inventory import DeviceNode, DriverFile, Gpu, Inventory, MigDevice, NvLink

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from gpuhook.discover import nvml
    from gpuhook.discover.nvml import NvmlReport

__all__ = ["METHODS", "discover", "nvml_library"]

METHODS = ("auto", "nvml", "procfs")


def nvml_library(driver_root: str) -> str | None:
    """Host path of the root's libnvidia-ml.so.1, through its ld.so.cache, else the usual directories."""
    cached = ldcache_index(driver_root).get(("libnvidia-ml.so.1", 64))
    candidates = [cached] if cached else []
    candidates += [f"{d}/libnvidia-ml.so.1" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")]
    for candidate in candidates:
        host = join(driver_root, resolve_in_root(driver_root, candidate))
        if os.path.isfile(host):
            return host
    return None


def _cap_node(roots: Roots, access_canonical: str, known: dict[str, DeviceNode | None] | None = None
              ) -> DeviceNode | None:
    """The nvidia-caps node an access file names (`known`: _mig_cap_nodes' answers, read ahead)."""
    if known is not None and access_canonical in known:
        return known[access_canonical]
    access = procfs.proc_host_path(roots.proc_root, access_canonical)
    if not os.path.exists(access):
        return None
    minor = procfs.cap_minor(access)
    canonical = f"/dev/{catalogue.CAPS_DIR}/nvidia-cap{minor}"
    found = devnodes.node(roots.dev_root, canonical)
    if found is not None:
        return found
    major = devnodes.devices_major(roots.proc_root, "nvidia-caps")
    if major is None:
        return None
    return DeviceNode(canonical, join(roots.dev_root, canonical), major, minor, 0o444)


def _mig_device(
    roots: Roots, gpu_index: int, gpu_minor: int, index: int, uuid: str, gi: int, ci: int, profile: str,
    memory_mib: int = 0, known: dict[str, DeviceNode | None] | None = None,
) -> MigDevice:
    gi_access, ci_access = procfs.mig_access_paths(gpu_minor, gi, ci)
    nodes = tuple(n for n in (_cap_node(roots, gi_access, known), _cap_node(roots, ci_access, known))
                  if n is not None)
    return MigDevice(gpu_index, index, uuid, gi, ci, profile, gi_access, ci_access, nodes, memory_mib)


def _mig_cap_nodes(roots: Roots) -> dict[str, DeviceNode | None]:
    """The node of every MIG access file procfs shows (keyed by its canonical path), read while NVML's child
    answers: the ~110 small reads of 8 GPUs x 7 MIG devices (~3 ms) leave the cold path's critical one. A file
    that does not parse is left out, for _cap_node to fail on if a MIG device names it."""
    known: dict[str, DeviceNode | None] = {}
    for access in procfs.mig_access_files(roots.proc_root):
        with suppress(DiscoveryError, OSError):
            known[access] = _cap_node(roots, access)
    return known


def _gpu(roots: Roots, index: int, minor: int, uuid: str, bus_id: str, **extra: object) -> Gpu:
    migs = extra.pop("migs", ())
    return Gpu(
        index=index,
        minor=minor,
        uuid=uuid,
        pci_bus_id=bus_id,
        node=devnodes.node(roots.dev_root, f"/dev/nvidia{minor}"),
        dri_nodes=devnodes.dri_nodes(roots.dev_root, bus_id) if bus_id else (),
        proc_dir=f"/proc/driver/nvidia/gpus/{bus_id}" if bus_id else "",
        mig_devices=tuple(migs),  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )


def _from_nvml(roots: Roots, report: NvmlReport, known: dict[str, DeviceNode | None] | None = None
               ) -> tuple[str, str, list[Gpu]]:
    gpus = []
    for g in report.gpus:
        migs = [_mig_device(roots, g.index, g.minor, m.index, m.uuid, m.gi, m.ci, m.profile, m.memory_mib, known)
                for m in g.migs]
        gpus.append(
            _gpu(
                roots,
                g.index,
                g.minor,
                g.uuid,
                g.pci_bus_id,
                name=g.name,
                memory_mib=g.memory_mib,
                compute_capability=g.compute_capability,
                brand=g.brand,
                numa_node=g.numa_node,
                mig_enabled=g.mig_enabled,
                mig_capable=g.mig_capable,
                migs=migs,
                nvlinks=tuple(NvLink(bus, kind) for bus, kind in g.nvlinks),
                pci_levels=tuple(g.pci_levels),
                p2p_ok=tuple(g.p2p_ok),
            )
        )
    return report.driver_version, report.cuda_version, gpus


def _from_procfs(roots: Roots, known: dict[str, DeviceNode | None] | None = None) -> tuple[str, str, list[Gpu]]:
    version = procfs.driver_version(roots.proc_root)
    gpus: list[Gpu] = []
    proc_gpus = [g for g in procfs.gpus(roots.proc_root) if not g.excluded]
    if proc_gpus:
        for index, pg in enumerate(proc_gpus):
            pairs = procfs.mig_instances(roots.proc_root, pg.minor)
            migs = [_mig_device(roots, index, pg.minor, i, "", gi, ci, "", known=known)
                    for i, (gi, ci) in enumerate(pairs)]
            gpus.append(
                _gpu(roots, index, pg.minor, pg.uuid, pg.bus_id, name=pg.model, mig_enabled=bool(migs),
                     mig_capable=bool(migs), migs=migs)
            )
    else:
        for index, minor in enumerate(devnodes.gpu_minors(roots.dev_root)):
            gpus.append(_gpu(roots, index, minor, "", ""))
    return version, "", gpus


def _control_nodes(roots: Roots) -> dict[str, DeviceNode]:
    names = (catalogue.CTL_NODE, catalogue.MODESET_NODE, *catalogue.UVM_NODES)
    nodes = {name: devnodes.node(roots.dev_root, f"/dev/{name}") for name in names}
    return {k: v for k, v in nodes.items() if v is not None}


def _mig_control_nodes(roots: Roots) -> dict[str, DeviceNode]:
    out: dict[str, DeviceNode] = {}
    for name in ("config", "monitor"):
        n = _cap_node(roots, f"/proc/driver/nvidia/capabilities/mig/{name}")
        if n is not None:
            out[name] = n
    return out


def _cuda_from_libcuda(files: list[DriverFile], notes: list[str]) -> str:
    """The CUDA version the driver's own libcuda reports ("" with a note when it cannot say)."""
    from gpuhook.discover.cudaversion import cuda_version

    libcuda = next((f for f in files if f.kind == "lib" and f.soname == CUDA_SONAME), None)
    if libcuda is None:
        return ""
    try:
        return cuda_version(libcuda.host_path)
    except ValueError as exc:
        notes.append(str(exc))
        return ""


def _files_beside(roots: Roots, version: str | None, mps_pipe_dir: str | None) -> tuple[str, list[DriverFile]] | None:
    """all_files for `version` while NVML's child is asked (None without a version, or where the scan fails:
    then it is done again, for the version found, and fails there in its own words; meanwhile the child must
    still be waited for)."""
    if version is None:
        return None
    try:
        return version, all_files(roots.driver_root, version, mps_pipe_dir)
    except Exception:  # noqa: BLE001 - ahead of time only: the scan for the version found says what is wrong
        return None


def discover(roots: Roots, method: str = "auto", mps_pipe_dir: str | None = None,
             nvml_child: nvml.Child | None = None) -> Inventory:
    """Everything the driver at `roots` offers. Raises DiscoveryError with one line on failure. `nvml_child`:
    NVML's child, forked ahead by the caller (cli/inventory.py); it is asked, or cancelled when it is not."""
    try:
        return _discover(roots, method, mps_pipe_dir, nvml_child)
    finally:
        if nvml_child is not None and not nvml_child.asked:
            nvml_child.cancel()


def _discover(roots: Roots, method: str, mps_pipe_dir: str | None, nvml_child: nvml.Child | None) -> Inventory:
    """discover's body."""
    if method not in METHODS:
        raise DiscoveryError(f"unknown discovery method {method!r} (expected one of {', '.join(METHODS)})")
    if not os.path.isdir(roots.driver_root):
        raise DiscoveryError(f"driver root {roots.driver_root}: not a readable directory")
    reasons: list[str] = []
    result: tuple[str, str, list[Gpu]] | None = None
    source = "procfs"
    if mps_pipe_dir is None:
        mps_pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or None
    early: tuple[str, list[DriverFile]] | None = None  # the files for the version NVML will most likely report
    host: dict[str, object] | None = None  # what the roots alone decide, and the MIG cap nodes: read while
    known: dict[str, DeviceNode | None] | None = None  # NVML's child answers, where there is one
    if method in ("auto", "nvml"):
        library = nvml_library(roots.driver_root)
        if library is None:
            reasons.append(f"no libnvidia-ml.so.1 under {roots.driver_root}")
        else:
            from gpuhook.discover import nvml

            report = (nvml_child or nvml.Child()).query(library)
            # while it answers: the driver's files, the MIG capability nodes and what only the roots decide
            early = _files_beside(roots, nvml.version_in_name(library), mps_pipe_dir)
            known = _mig_cap_nodes(roots)
            host = _host_parts(roots)
            try:
                result = _from_nvml(roots, report(), known)
                source = "nvml"
            except DiscoveryError as exc:
                reasons.append(str(exc))
        if result is None and method == "nvml":
            raise DiscoveryError(reasons[-1])
    if result is None:
        version_file = os.path.join(roots.proc_root, "driver/nvidia/version")
        if not os.path.exists(version_file):
            reasons.append(f"no {version_file}")
            raise DiscoveryError(f"no NVIDIA driver found under {roots.driver_root}: " + "; ".join(reasons))
        result = _from_procfs(roots, known)
    version, cuda, gpus = result
    files = early[1] if early is not None and early[0] == version else all_files(roots.driver_root, version,
                                                                                 mps_pipe_dir)
    if not cuda:
        cuda = _cuda_from_libcuda(files, reasons)
    return Inventory(
        driver_version=version,
        cuda_version=cuda,
        source=source,
        driver_root=roots.driver_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        gpus=gpus,
        files=files,
        notes=reasons,
        **(host or _host_parts(roots)),
    )


def _host_parts(roots: Roots) -> dict[str, object]:
    """The inventory's fields that the roots alone decide (control and gated nodes, IMEX, params, fingerprint),
    as Inventory's keywords: read while NVML's child answers, where there is one."""
    params = os.path.join(roots.proc_root, "driver/nvidia/params")
    gated = datacenter.gated_nodes(roots.dev_root)
    return {
        "control_nodes": _control_nodes(roots),
        "mig_control_nodes": _mig_control_nodes(roots),
        "params_host_path": params if os.path.exists(params) else "",
        "fingerprint": fingerprint(roots),
        "imex_major": devnodes.devices_major(roots.proc_root, catalogue.IMEX_DEVICES_NAME),
        "imex_channels": datacenter.imex_channels(roots.dev_root),
        "gated_nodes": gated,
        "gated_mounts": datacenter.gated_mounts(roots.driver_root, gated),
    }
