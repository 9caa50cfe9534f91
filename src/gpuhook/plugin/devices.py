"""What the plugin advertises: an Inventory turned into kubelet resources and their device ids.

Pure planning (no NVML, no files): every per-device answer Allocate gives (CDI name, env id, mount, annotation)
is computed here once, so the RPC path only looks things up.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence

from gpuhook.errors import ConfigError
from gpuhook.model.contract import CDI_ANNOTATION_PREFIX as ANNOTATION_PREFIX
from gpuhook.model.contract import PLUGIN_CDI_KIND
from gpuhook.model.edits import device_edits
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record

# The plugin's CDI devices are a kind of their own (contract.PLUGIN_CDI_KIND, NVIDIA's plugin's), never the host
# spec's nvidia.com/gpu: a node may carry `gpuhook generate-cdi`'s or nvidia-ctk's nvidia.com/gpu spec too, and
# one name defined by two specs resolves to nothing.
CDI_VENDOR, CDI_CLASS = PLUGIN_CDI_KIND.split("/")
CDI_KIND = PLUGIN_CDI_KIND
CDI_STRATEGIES = ("cdi-cri", "cdi-annotations")  # the list strategies that name CDI devices (NVIDIA: "cdi-*")
ID_STRATEGIES = ("uuid", "index")
MIG_STRATEGIES = ("none", "single", "mixed")
LIST_STRATEGIES = ("cdi-cri", "envvar", "volume-mounts", "cdi-annotations")
REPLICA_SEP = "::"
ANNOTATION_PLUGIN = "gpuhook"
_RESOURCE_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_KEY_BAD = re.compile(r"[^A-Za-z0-9_.-]")

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; the aliases are for type checkers only
if TYPE_CHECKING:  # (a runtime `A | B` of classes needs Python 3.10)
    Target = Gpu | MigDevice


class PluginDevice(Record):
    """One advertised device id. Replicas of a GPU are distinct PluginDevices sharing `target`."""

    id: str  # what kubelet sees: "GPU-…", "0", "0:1", or "<base>::<n>" with replicas
    base_id: str  # id without the replica suffix: what the env and mount fallbacks name
    target: Target
    cdi_name: str  # fully-qualified CDI name, e.g. nvidia.com/gpu=GPU-…
    gpu_index: int
    mig_index: int  # -1 for a whole GPU
    replica: int
    pci_bus_id: str
    node_paths: tuple[str, ...]  # host paths whose disappearance makes the device unhealthy

    @property
    def key(self) -> tuple[int, int]:
        """The underlying device (replicas share it): health is tracked per key."""
        return (self.gpu_index, self.mig_index)

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.gpu_index, self.mig_index, self.replica)


class Resource(Record):
    """One kubelet extended resource: its own socket, its own registration, its own device list."""

    name: str
    devices: tuple[PluginDevice, ...]

    @property
    def socket_name(self) -> str:
        return "gpuhook-" + self.name.replace("/", "-") + ".sock"

    def socket_for(self, tag: str) -> str:
        """The socket name with a plugin process's own tag (empty: none): a new plugin serves beside the one it
        replaces, so kubelet always has one registered (kubelet 1.36+ keeps an endpoint per socket)."""
        return self.socket_name if not tag else f"{self.socket_name[:-len('.sock')]}-{tag}.sock"

    def by_id(self) -> dict[str, PluginDevice]:
        return {d.id: d for d in self.devices}


class SharedResource(Record):
    """Time-slicing of one resource (NVIDIA's sharing.timeSlicing.resources[]): each of its devices advertised
    `replicas` times, under `rename` (e.g. nvidia.com/gpu.shared) when that is set."""

    name: str
    replicas: int
    rename: str = ""


# CDI names for runtimes that read them (containerd >= 1.7, CRI-O) and NVIDIA_VISIBLE_DEVICES for those that do
# not (containerd 1.6) and gpuhook's hook or shim: the spec's own NVIDIA_VISIBLE_DEVICES=void overrides the
# variable when a runtime applies the CDI devices, so no container gets its GPU twice.
DEFAULT_LIST_STRATEGIES = ("cdi-cri", "envvar")


class Options(Record):
    resource_name: str = "nvidia.com/gpu"
    id_strategy: str = "uuid"
    mig_strategy: str = "none"
    replicas: int = 1  # every resource not in `shared` (gpuhook's --replicas)
    list_strategies: tuple[str, ...] = DEFAULT_LIST_STRATEGIES
    shared: tuple[SharedResource, ...] = ()  # per-resource time-slicing (the config file's sharing.timeSlicing)
    fail_requests_greater_than_one: bool = False  # Allocate refuses more than one replica per container
    pass_device_specs: bool = False  # Allocate also names the device nodes (DeviceSpec), for non-CDI strategies
    gated_env: tuple[str, ...] = ()  # NVIDIA_GDS & co set to `enabled` in every Allocate (NVIDIA's gdsEnabled…)

    def replication(self, name: str) -> tuple[int, str]:
        """(replicas, advertised name) of the resource `name`: its time-slicing entry, else --replicas."""
        for entry in self.shared:
            if entry.name == name:
                return entry.replicas, entry.rename or name
        return self.replicas, name

    def check(self) -> None:
        if not _RESOURCE_RE.match(self.resource_name):
            raise ConfigError(f"invalid resource name {self.resource_name!r} (expected <domain>/<name>)")
        if self.id_strategy not in ID_STRATEGIES:
            raise ConfigError(f"unknown device id strategy {self.id_strategy!r}")
        if self.mig_strategy not in MIG_STRATEGIES:
            raise ConfigError(f"unknown MIG strategy {self.mig_strategy!r}")
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, not {self.replicas}")
        for entry in self.shared:
            if entry.replicas < 2:
                raise ConfigError(f"time-slicing of {entry.name}: replicas must be at least 2, not {entry.replicas}")
        unknown = [s for s in self.list_strategies if s not in LIST_STRATEGIES]
        if unknown or not self.list_strategies:
            raise ConfigError(f"unknown device list strategy {', '.join(unknown) or '(empty)'} "
                              f"(expected a comma list of {', '.join(LIST_STRATEGIES)})")


def parse_list_strategies(value: str) -> tuple[str, ...]:
    items: list[str] = []
    for item in (i.strip() for i in value.split(",")):
        if item and item not in items:
            items.append(item)
    return tuple(items)


def base_id(target: Target, id_strategy: str) -> str:
    """The id naming a device to kubelet, the env fallback and the CDI spec (uuid, else index form)."""
    if id_strategy == "uuid" and target.uuid:
        return target.uuid
    return str(target.index) if isinstance(target, Gpu) else target.name


def strip_replica(device_id: str) -> str:
    return device_id.split(REPLICA_SEP, 1)[0]


def _node_paths(inv: Inventory, target: Target) -> tuple[str, ...]:
    """The device's own nodes, from the planning model (which refuses a MIG device without its caps nodes)."""
    return tuple(n.host_path for n in device_edits(inv, target, frozenset()).device_nodes)


def _resource(inv: Inventory, name: str, targets: Iterable[Target], opts: Options) -> Resource:
    """One resource under its advertised name, each device replicated as its time-slicing says."""
    replicas, advertised = opts.replication(name)
    return Resource(advertised, _devices(inv, targets, opts, replicas))


def _devices(inv: Inventory, targets: Iterable[Target], opts: Options, replicas: int) -> tuple[PluginDevice, ...]:
    out: list[PluginDevice] = []
    for target in targets:
        ident = base_id(target, opts.id_strategy)
        gpu = target if isinstance(target, Gpu) else inv.gpus[target.gpu_index]
        for n in range(replicas):
            out.append(PluginDevice(
                id=f"{ident}{REPLICA_SEP}{n}" if replicas > 1 else ident,
                base_id=ident,
                target=target,
                cdi_name=f"{CDI_KIND}={ident}",
                gpu_index=gpu.index,
                mig_index=target.index if isinstance(target, MigDevice) else -1,
                replica=n,
                pci_bus_id=gpu.pci_bus_id,
                node_paths=_node_paths(inv, target),
            ))
    out.sort(key=lambda d: d.order)
    return tuple(out)


def mig_resource_name(resource_name: str, profile: str) -> str:
    """nvidia.com/mig-1g.10gb; a profile like 1g.10gb+me becomes mig-1g.10gb.me (resource names allow no '+')."""
    domain = resource_name.partition("/")[0]
    return f"{domain}/mig-" + re.sub(r"[^-A-Za-z0-9_.]", ".", profile)


def _single(inv: Inventory) -> list[Target]:
    """`single`: every GPU MIG-enabled with one profile, MIG devices advertised under the main resource."""
    enabled = [g for g in inv.gpus if g.mig_enabled]
    if not enabled:
        return list(inv.gpus)
    if len(enabled) != len(inv.gpus):
        plain = ", ".join(str(g.index) for g in inv.gpus if not g.mig_enabled)
        raise ConfigError(f"MIG strategy single needs every GPU MIG-enabled; GPU {plain} is not (use mixed)")
    migs = inv.all_mig_devices()
    profiles = sorted({m.profile for m in migs})
    if not migs:
        raise ConfigError("MIG strategy single: MIG is enabled but no MIG device exists")
    if len(profiles) > 1:
        raise ConfigError(f"MIG strategy single needs one MIG profile, found {', '.join(profiles)} (use mixed)")
    return list(migs)


def plan(inv: Inventory, opts: Options) -> list[Resource]:
    """The resources to serve (none without devices), each in index order. Raises ConfigError (one line)."""
    opts.check()
    if opts.mig_strategy == "none":
        resources = [_resource(inv, opts.resource_name, inv.gpus, opts)]
    elif opts.mig_strategy == "single":
        resources = [_resource(inv, opts.resource_name, _single(inv), opts)]
    else:
        resources = _mixed(inv, opts)
    return [r for r in resources if r.devices]


def _mixed(inv: Inventory, opts: Options) -> list[Resource]:
    """`mixed`: whole GPUs under the main resource, each MIG profile its own `<domain>/mig-<profile>` resource."""
    resources = [_resource(inv, opts.resource_name, [g for g in inv.gpus if not g.mig_enabled], opts)]
    by_profile: dict[str, list[MigDevice]] = {}
    for mig in inv.all_mig_devices():
        if not mig.profile:
            raise ConfigError(f"MIG strategy mixed: MIG device {mig.name} has no known profile (NVML needed)")
        by_profile.setdefault(mig.profile, []).append(mig)
    for profile in sorted(by_profile):
        resources.append(_resource(inv, mig_resource_name(opts.resource_name, profile), by_profile[profile], opts))
    return resources


def advertised_targets(resources: Sequence[Resource]) -> list[Target]:
    """The distinct underlying devices of all resources, in index order (what the CDI spec must name)."""
    seen: dict[tuple[int, int], Target] = {}
    for res in resources:
        for d in res.devices:
            seen.setdefault(d.key, d.target)
    return [seen[k] for k in sorted(seen)]


def annotation_key(device_id: str) -> str:
    """`cdi.k8s.io/gpuhook_<id>`: the part after the prefix is a valid annotation name of at most 63 chars."""
    name = f"{ANNOTATION_PLUGIN}_" + _KEY_BAD.sub("_", device_id.replace("/", "_")).strip("_.-")
    if len(name) > 63:
        name = f"{ANNOTATION_PLUGIN}_" + hashlib.sha256(device_id.encode()).hexdigest()[:32]
    return ANNOTATION_PREFIX + name
