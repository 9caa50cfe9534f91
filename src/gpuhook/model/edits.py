"""Container edits: the one model shared by the CDI generator, the prestart hook, the runtime shim and `list`.

`device_edits` and `common_edits` are the planning functions (pure: no syscalls, no files written).
The CDI generator renders them per device plus a common part; the hook merges them for one container.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Hashable, Iterable

from gpuhook.errors import RequestError
from gpuhook.model import catalogue
from gpuhook.model.inventory import DeviceNode, DriverFile, Gpu, Inventory, MigDevice
from gpuhook.model.record import Record, field

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path)
if TYPE_CHECKING:
    from typing import TypeVar

    _T = TypeVar("_T")

FILE_OPTIONS: tuple[str, ...] = ("ro", "nosuid", "nodev", "rbind", "rprivate")
CUDA_SONAME = "libcuda.so.1"
MIG_CAP_NODES = 2  # the GPU instance's and the compute instance's access capability
DRI_BY_PATH = "/dev/dri/by-path"
# IPC sockets and the MPS pipe directory: read-only too, beyond NVIDIA (which mounts them writable). A read-only
# mount stops nothing a client does - connect() to a socket, opening a FIFO for writing - but stops a container
# from removing, replacing or adding entries in the host's directory (docs/security.md).
SOCKET_OPTIONS: tuple[str, ...] = ("ro", "nosuid", "nodev", "noexec", "rbind", "rprivate")
# Everything, including the driver-version libraries the catalogue cannot classify.
ALL_CAPABILITIES = frozenset(catalogue.CAPABILITIES) | {catalogue.UNCLASSIFIED}
# What a CDI spec carries: everything but the 32-bit libraries. nvidia-ctk (v1.20.0) finds the driver's
# libraries in 64-bit search paths and the ld cache's 64-bit entries only (pkg/lookup/library.go
# NewLibraryLocator; pkg/lookup/ldcache.go, `_, libs64 := cache.List()`), so its spec mounts, links and
# registers no /usr/lib/i386-linux-gnu library; the hook still does for `compat32` (libnvidia-container).
CDI_CAPABILITIES = ALL_CAPABILITIES - {"compat32"}


class Mount(Record):
    host_path: str
    container_path: str
    options: tuple[str, ...] = FILE_OPTIONS
    type: str = "bind"

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


class Symlink(Record):
    """`link` (absolute container path) pointing at `target` (as written in the link, usually a file name)."""

    target: str
    link: str
    # Made only when `target` (resolved beside the link) exists in the container: the CDI spec's one container
    # hook carries every GPU's /dev/dri/by-path links and makes those of the nodes the runtime gave.
    if_target_exists: bool = False


class ContainerEdits(Record, frozen=False):
    env: list[str] = field(default_factory=list)
    device_nodes: list[DeviceNode] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)
    symlinks: list[Symlink] = field(default_factory=list)
    ld_dirs: list[str] = field(default_factory=list)  # container folders whose libraries need the ld cache
    # Hook-only: /proc/driver/nvidia content of the selected GPUs (a runtime cannot mount into /proc for CDI).
    proc_gpu_dirs: list[str] = field(default_factory=list)
    params_host_path: str = ""
    # The host driver's version when the container gets libcuda: an image's CUDA forward-compatibility
    # libcuda newer than this goes first in its ld cache (inject/cudacompat.py).
    cuda_compat_driver: str = ""

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.symlinks or self.ld_dirs)

    def merge(self, other: ContainerEdits) -> ContainerEdits:
        """Union keeping first-seen order; a later entry for the same container path is dropped."""
        return ContainerEdits(
            env=_unique(self.env + other.env, key=lambda e: e.partition("=")[0]),
            device_nodes=_unique(self.device_nodes + other.device_nodes, key=lambda n: n.path),
            mounts=_unique(self.mounts + other.mounts, key=lambda m: m.container_path),
            symlinks=_unique(self.symlinks + other.symlinks, key=lambda s: s.link),
            ld_dirs=_unique(self.ld_dirs + other.ld_dirs, key=lambda d: d),
            proc_gpu_dirs=_unique(self.proc_gpu_dirs + other.proc_gpu_dirs, key=lambda d: d),
            params_host_path=self.params_host_path or other.params_host_path,
            cuda_compat_driver=self.cuda_compat_driver or other.cuda_compat_driver,
        )


def _unique(items: Iterable[_T], key: Callable[[_T], Hashable]) -> list[_T]:
    seen: set[Hashable] = set()
    out: list[_T] = []
    for item in items:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out


def merge_all(parts: Iterable[ContainerEdits]) -> ContainerEdits:
    result = ContainerEdits()
    for part in parts:
        result = result.merge(part)
    return result


class Selection(Record):
    """What one container gets: devices (whole GPUs and MIG devices) and driver capabilities."""

    devices: tuple[Gpu | MigDevice, ...] = ()
    capabilities: frozenset[str] = frozenset(catalogue.DEFAULT_CAPABILITIES)
    mig_config: bool = False
    mig_monitor: bool = False
    imex_channels: tuple[DeviceNode, ...] = ()  # the host's channel nodes, resolved from the request
    gated: tuple[str, ...] = ()  # catalogue.GATED names asked for (what the host has of them is added)


def _parent(inv: Inventory, device: Gpu | MigDevice) -> Gpu:
    return device if isinstance(device, Gpu) else inv.gpus[device.gpu_index]


def device_edits(
    inv: Inventory, device: Gpu | MigDevice, capabilities: frozenset[str] = ALL_CAPABILITIES
) -> ContainerEdits:
    """The nodes (and, for the hook, proc entries) that belong to one device."""
    gpu = _parent(inv, device)
    caps = catalogue.expand_capabilities(capabilities)
    nodes: list[DeviceNode] = [gpu.node] if gpu.node else []
    links: list[Symlink] = []
    if isinstance(device, MigDevice):
        if len(device.cap_nodes) < MIG_CAP_NODES:
            # NVIDIA refuses too: a MIG device without its capability nodes is not usable, and a container
            # given one without them would see no device rather than fail.
            who = f"MIG device {device.name}" + (f" ({device.uuid})" if device.uuid else "")
            raise RequestError(
                f"error getting MIG capability device paths for {who}: no nvidia-caps node found for "
                f"{device.gi_access} and {device.ci_access}"
            )
        nodes += device.cap_nodes
    elif "graphics" in caps:
        nodes += gpu.dri_nodes
        links = dri_by_path_links(gpu)
    return ContainerEdits(device_nodes=nodes, symlinks=links, proc_gpu_dirs=[gpu.proc_dir] if gpu.proc_dir else [])


def dri_by_path_links(gpu: Gpu) -> list[Symlink]:
    """udev's /dev/dri/by-path/pci-<bus id>-card|render links for the GPU's DRM nodes (discovery found the
    nodes through them, so the host has them): Vulkan and EGL pick a GPU's render node by bus id this way."""
    out: list[Symlink] = []
    for node in gpu.dri_nodes:
        name = posixpath.basename(node.path)
        role = "render" if name.startswith("renderD") else "card"
        out.append(Symlink(f"../{name}", f"{DRI_BY_PATH}/pci-{gpu.pci_bus_id}-{role}"))
    return out


def _wanted(f: DriverFile, caps: frozenset[str]) -> bool:
    if f.kind == "lib32":
        return "compat32" in caps and f.capability in caps
    return f.capability in caps


def _mount(f: DriverFile) -> Mount:
    return Mount(f.host_path, f.path, SOCKET_OPTIONS if f.kind == "ipc" else FILE_OPTIONS)


def _links(libs: list[DriverFile], made: list[DriverFile]) -> list[Symlink]:
    """Each library's soname link (from its DT_SONAME: none without one or when it is the file name), the
    development links, and the links discovery found the driver makes (`kind` link)."""
    links: list[Symlink] = []
    by_soname = {(posixpath.dirname(f.path), f.soname): f for f in libs}
    for f in libs:
        folder, name = posixpath.split(f.path)
        if f.soname and f.soname != name:
            links.append(Symlink(name, posixpath.join(folder, f.soname)))
    links += [Symlink(f.target, f.path) for f in made]
    for link_name, soname in catalogue.DEV_LINKS.items():
        for (folder, so), _f in by_soname.items():
            if so == soname:
                links.append(Symlink(soname, posixpath.join(folder, link_name)))
    return links


def control_nodes(inv: Inventory, capabilities: frozenset[str]) -> list[DeviceNode]:
    caps = catalogue.expand_capabilities(capabilities)
    names = [catalogue.CTL_NODE]
    if caps & {"compute", "video"}:
        names += list(catalogue.UVM_NODES)
    if "display" in caps:
        names.append(catalogue.MODESET_NODE)
    return [inv.control_nodes[n] for n in names if n in inv.control_nodes]


def common_edits(
    inv: Inventory,
    capabilities: frozenset[str] = ALL_CAPABILITIES,
    *,
    mig_config: bool = False,
    mig_monitor: bool = False,
) -> ContainerEdits:
    """Control nodes, driver files, links and ld cache folders for a capability set."""
    caps = catalogue.expand_capabilities(capabilities)
    files = [f for f in inv.files if _wanted(f, caps)]
    libs = [f for f in files if f.kind in ("lib", "lib32")]
    made = [f for f in files if f.kind == "link"]
    libcuda = any(f.soname == CUDA_SONAME for f in libs)
    nodes = control_nodes(inv, caps)
    if mig_config and "config" in inv.mig_control_nodes:
        nodes.append(inv.mig_control_nodes["config"])
    if mig_monitor and "monitor" in inv.mig_control_nodes:
        nodes.append(inv.mig_control_nodes["monitor"])
    return ContainerEdits(
        device_nodes=nodes,
        mounts=[_mount(f) for f in files if f.kind != "link"],
        symlinks=_links(libs, made),
        ld_dirs=_unique([posixpath.dirname(f.path) for f in libs], key=lambda d: d),
        params_host_path=inv.params_host_path,
        cuda_compat_driver=inv.driver_version if libcuda else "",
    )


def imex_edits(channels: Iterable[DeviceNode]) -> ContainerEdits:
    """IMEX channel nodes: nothing else (nvidia-ctk's imex-channel devices carry only their node)."""
    return ContainerEdits(device_nodes=list(channels))


def gated_edits(inv: Inventory, name: str) -> ContainerEdits:
    """One gated family (catalogue.GATED): the nodes the host has and, with them, its read-only mounts."""
    nodes = inv.gated_nodes.get(name, [])
    files = inv.gated_mounts.get(name, []) if nodes else []
    return ContainerEdits(device_nodes=list(nodes), mounts=[_mount(f) for f in files])


# Capabilities whose libraries a host may lack without the request being wrong: `all` asks for whatever the
# driver has, so only these must be present then.
_ESSENTIAL = frozenset(catalogue.DEFAULT_CAPABILITIES)
# display is graphics plus a node; its libraries are graphics'.
_LIBRARY_CAPABILITIES = frozenset(catalogue.CAPABILITIES) - {"display", "compat32"}
_REQUESTABLE = frozenset(catalogue.CAPABILITIES)


def capability_gap(inv: Inventory, capabilities: frozenset[str]) -> str:
    """Why the driver cannot serve `capabilities` (a named capability without any of its libraries); ""."""
    caps = catalogue.expand_capabilities(capabilities)
    everything = caps >= _REQUESTABLE  # `all` (the hook's) or ALL_CAPABILITIES (CDI's, with unclassified)
    wanted = _ESSENTIAL if everything else caps & _LIBRARY_CAPABILITIES
    have = {f.capability for f in inv.files if f.kind == "lib"}
    for cap in sorted(wanted - have):
        return f"no driver library for capability {cap!r} under driver root {inv.driver_root}"
    if "compat32" in caps and not everything and not any(f.kind == "lib32" for f in inv.files):
        return f"no 32-bit driver library (capability 'compat32') under driver root {inv.driver_root}"
    return ""


def plan(inv: Inventory, selection: Selection) -> ContainerEdits:
    """Everything one container gets for `selection`: the hook's, the shim's and `gpuhook list`'s single
    source. RequestError when a selected device lacks its nodes, the control node is missing, or a requested
    capability has no library: a start that cannot get everything it asked for fails, never a smaller one."""
    caps = selection.capabilities
    for device in selection.devices:
        gap = inv.device_gap(device)
        if gap:
            raise RequestError(gap)
    if selection.devices and catalogue.CTL_NODE not in inv.control_nodes:
        raise RequestError(f"no device node /dev/{catalogue.CTL_NODE} under {inv.dev_root}")
    gap = capability_gap(inv, caps)
    if gap:
        raise RequestError(gap)
    common = common_edits(inv, caps, mig_config=selection.mig_config, mig_monitor=selection.mig_monitor)
    extra = [imex_edits(selection.imex_channels), *(gated_edits(inv, name) for name in selection.gated)]
    return merge_all([*(device_edits(inv, d, caps) for d in selection.devices), common, *extra])
