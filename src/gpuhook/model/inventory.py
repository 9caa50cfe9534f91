"""What the host's driver offers, as plain data (no behaviour beyond (de)serialisation).

Everything here is JSON-round-trippable: the hook's inventory cache and `gpuhook info --json` both use
`Inventory.to_dict()` / `Inventory.from_dict()`.
"""

from __future__ import annotations

from gpuhook.model.record import Record, as_dict, field

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path)
if TYPE_CHECKING:
    from typing import Any

# 2: GPU-to-GPU topology (NVLinks, PCI common ancestors, P2P); 3: IMEX channels, gated devices;
# 4: driver files from the files (unclassified libraries, ELF sonames, links)
INVENTORY_FORMAT = 4


def normalize_bus_id(bus_id: str) -> str:
    """NVML says 00000000:18:00.0, procfs and sysfs say 0000:18:00.0: keep a 4-digit lower-case domain."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if not rest:
        return bus_id
    return f"{int(domain, 16):04x}:{rest}"


class DeviceNode(Record):
    """A character device node on the host. `path` is the canonical (container) path, e.g. /dev/nvidia0;
    `host_path` is where it lives on this host (dev root prefixed)."""

    path: str
    host_path: str
    major: int
    minor: int
    mode: int = 0o666
    type: str = "c"


class DriverFile(Record):
    """A driver file to bind into containers. `kind`: lib, lib32, bin, firmware, ipc, config, xorg (an X
    server module: mounted, not a loader folder), link (made in the container, nothing mounted)."""

    kind: str
    capability: str  # one of catalogue.CAPABILITIES, or catalogue.UNCLASSIFIED
    path: str  # canonical container path
    host_path: str  # real path on this host (driver root prefixed, symlinks resolved); "" for a link
    soname: str = ""  # libraries only: the file's DT_SONAME ("" when it has none)
    target: str = ""  # links only: what the link says


class MigDevice(Record):
    gpu_index: int
    index: int  # position among its GPU's MIG devices (the `<gpu>:<mig>` name)
    uuid: str  # MIG-...
    gi: int
    ci: int
    profile: str  # e.g. 1g.10gb
    gi_access: str  # canonical /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access
    ci_access: str
    cap_nodes: tuple[DeviceNode, ...] = ()  # /dev/nvidia-caps/nvidia-cap<N> for gi and ci
    memory_mib: int | None = None  # NVML only; None (0 made None) when unknown, as for a GPU

    def __post_init__(self) -> None:
        if self.memory_mib == 0:
            object.__setattr__(self, "memory_mib", None)

    @property
    def name(self) -> str:
        return f"{self.gpu_index}:{self.index}"


class NvLink(Record):
    """One active NVLink of a GPU: where its far end is. `remote_type` is NVML's: gpu, switch, ibmnpu, unknown."""

    remote_bus_id: str  # 0000:2a:00.0 (normalised like Gpu.pci_bus_id)
    remote_type: str = "gpu"


class Gpu(Record):
    """None is "unknown" (procfs discovery has no memory size, compute capability, brand or NUMA node; an NVML
    query can fail): `info --json` shows null and the text "unknown", never a 0 that reads like a value."""

    index: int
    minor: int
    uuid: str
    pci_bus_id: str  # 0000:18:00.0 (domain 4 hex digits, lower case)
    name: str = ""
    memory_mib: int | None = None
    compute_capability: str | None = None  # "9.0"
    brand: str | None = None  # tesla, nvidia, geforce, quadro, ...
    numa_node: int | None = None
    mig_enabled: bool = False
    mig_capable: bool = False  # NVML answers its MIG mode (procfs: only known when MIG is on)
    mig_devices: tuple[MigDevice, ...] = ()
    node: DeviceNode | None = None  # /dev/nvidia<minor>
    dri_nodes: tuple[DeviceNode, ...] = ()  # /dev/dri/card<N>, renderD<N>
    proc_dir: str = ""  # canonical /proc/driver/nvidia/gpus/<bus id>
    # GPU-to-GPU topology, read once at discovery (NVML only; empty when unknown, e.g. from procfs):
    nvlinks: tuple[NvLink, ...] = ()  # the active NVLinks, in link order
    pci_levels: tuple[int, ...] = ()  # NVML common-ancestor level to GPU i (by index); 0 for itself
    p2p_ok: tuple[bool, ...] = ()  # NVML P2P read status to GPU i is OK (by index); True for itself

    def __post_init__(self) -> None:
        """The sentinels a source may still give for "unknown" (0 MiB, "", NUMA -1; also an older cache) become
        None, the model's one spelling of it."""
        for name, unknown in (("memory_mib", 0), ("compute_capability", ""), ("brand", ""), ("numa_node", -1)):
            if getattr(self, name) == unknown:
                object.__setattr__(self, name, None)


class Inventory(Record, frozen=False):
    driver_version: str
    cuda_version: str | None  # driver's CUDA version "12.4"; None (or "", made None) if unknown
    source: str  # "nvml" or "procfs"
    driver_root: str
    dev_root: str
    proc_root: str
    gpus: list[Gpu] = field(default_factory=list)
    control_nodes: dict[str, DeviceNode] = field(default_factory=dict)  # name under /dev -> node
    mig_control_nodes: dict[str, DeviceNode] = field(default_factory=dict)  # "config"/"monitor" -> cap node
    files: list[DriverFile] = field(default_factory=list)
    params_host_path: str = ""  # <proc root>/driver/nvidia/params, if present
    fingerprint: str = ""  # what invalidates a cache: driver version, node set, MIG layout
    notes: list[str] = field(default_factory=list)  # why a fallback source was used
    imex_major: int | None = None  # /proc/devices "nvidia-caps-imex-channels"; None: the driver has no IMEX
    imex_channels: list[DeviceNode] = field(default_factory=list)  # the channel nodes present, by minor
    gated_nodes: dict[str, list[DeviceNode]] = field(default_factory=dict)  # catalogue.GATED name -> nodes found
    gated_mounts: dict[str, list[DriverFile]] = field(default_factory=dict)  # name -> files mounted with them

    def __post_init__(self) -> None:
        if not self.cuda_version:
            self.cuda_version = None

    def to_dict(self) -> dict[str, Any]:
        data = as_dict(self)
        data["format"] = INVENTORY_FORMAT
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Inventory:
        if data.get("format") != INVENTORY_FORMAT:
            raise ValueError(f"unsupported inventory format {data.get('format')!r}")

        def node(d: dict[str, Any] | None) -> DeviceNode | None:
            return DeviceNode(**d) if d else None

        def mig(d: dict[str, Any]) -> MigDevice:
            d = dict(d)
            d["cap_nodes"] = tuple(DeviceNode(**n) for n in d["cap_nodes"])
            return MigDevice(**d)

        def gpu(d: dict[str, Any]) -> Gpu:
            d = dict(d)
            d["mig_devices"] = tuple(mig(m) for m in d["mig_devices"])
            d["node"] = node(d["node"])
            d["dri_nodes"] = tuple(DeviceNode(**n) for n in d["dri_nodes"])
            d["nvlinks"] = tuple(NvLink(**n) for n in d.get("nvlinks", ()))
            d["pci_levels"] = tuple(int(v) for v in d.get("pci_levels", ()))
            d["p2p_ok"] = tuple(bool(v) for v in d.get("p2p_ok", ()))
            return Gpu(**d)

        # `topology` is the derived matrix `gpuhook info --json` adds (model/report.py), not stored state
        fields = {k: v for k, v in data.items() if k not in ("format", "topology")}
        fields["gpus"] = [gpu(g) for g in data["gpus"]]
        fields["control_nodes"] = {k: DeviceNode(**v) for k, v in data["control_nodes"].items()}
        fields["mig_control_nodes"] = {k: DeviceNode(**v) for k, v in data["mig_control_nodes"].items()}
        fields["files"] = [DriverFile(**f) for f in data["files"]]
        fields["imex_channels"] = [DeviceNode(**n) for n in data.get("imex_channels", [])]
        fields["gated_nodes"] = {k: [DeviceNode(**n) for n in v] for k, v in data.get("gated_nodes", {}).items()}
        fields["gated_mounts"] = {k: [DriverFile(**f) for f in v] for k, v in data.get("gated_mounts", {}).items()}
        return cls(**fields)

    def imex_channel(self, channel: int) -> DeviceNode | None:
        """The host's node for IMEX channel `channel` (by name: /dev/nvidia-caps-imex-channels/channel<N>)."""
        return next((n for n in self.imex_channels if n.path.rsplit("/channel", 1)[-1] == str(channel)), None)

    def all_mig_devices(self) -> list[MigDevice]:
        return [m for g in self.gpus for m in g.mig_devices]

    def device_gap(self, device: Gpu | MigDevice) -> str:
        """Why `device` cannot be given to a container (its GPU has no node, a MIG device lacks its gi/ci
        nvidia-caps nodes); "" when it is whole. The one check behind the hook, the shim, the CDI generator and
        the inventory cache, so a start never gets a device without the nodes that make it usable."""
        if isinstance(device, MigDevice):
            gpu = self.gpus[device.gpu_index] if 0 <= device.gpu_index < len(self.gpus) else None
            name = f"MIG device {device.name}" + (f" ({device.uuid})" if device.uuid else "")
            if gpu is None:
                return f"{name}: its GPU {device.gpu_index} is not in the inventory"
            if gpu.node is None:
                return f"{name}: its GPU has no device node /dev/nvidia{gpu.minor} under {self.dev_root}"
            if len(device.cap_nodes) < 2:
                return (f"{name} has no nvidia-caps device nodes for {device.gi_access} and {device.ci_access} "
                        f"under {self.dev_root} (error getting MIG capability device paths)")
            return ""
        if device.node is None:
            return f"GPU {device.index} has no device node /dev/nvidia{device.minor} under {self.dev_root}"
        return ""

    def incomplete(self) -> str:
        """Why this inventory cannot be trusted as a whole (a scan that raced a driver change), "" if it can:
        a driver version, and every GPU and MIG device with the nodes that make it usable."""
        if not self.driver_version:
            return "no driver version"
        for gpu in self.gpus:
            for device in (gpu, *gpu.mig_devices):
                gap = self.device_gap(device)
                if gap:
                    return gap
        return ""
