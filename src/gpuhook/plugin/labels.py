"""GPU feature labels as NVIDIA's gpu-feature-discovery writes them (k8s-device-plugin internal/lm), from the
inventory the plugin already holds: no NVML call of its own, so the labels always say what the plugin serves.

Label names and values follow NVIDIA's: `nvidia.com/gpu.{count,product,memory,family,compute.major,compute.minor,
replicas,sharing-strategy}` for whole GPUs, `nvidia.com/cuda.driver.*` / `cuda.driver-version.*` /
`cuda.runtime.*` / `cuda.runtime-version.*`, `nvidia.com/mig.capable`, `mig.strategy` (single and mixed only),
`nvidia.com/mig-<profile>.*` under mixed, `nvidia.com/mps.capable`; plus `nvidia.com/gpu.nvlink`, the active
NVLinks per GPU (or `none`), and `nvidia.com/gpu.present=true`. Counts, replicas and renames follow what the
plugin advertises (Options.replication, the plan's own rule): count x replicas is what kubelet is offered, where
GFD counts MIG-enabled GPUs as nvidia.com/gpu under every strategy. Where GFD's answer depends on Go's map order
(several GPU products on one node: one product's labels win, and its count is that product's), the
lowest-indexed GPU's product wins here, whole GPUs
over MIG-enabled ones as in GFD. A device the plugin marks unhealthy is left out of the counts, so a node whose
GPU failed stops attracting pods that select on the count.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Iterable

from gpuhook.model import topology
from gpuhook.model.inventory import Inventory, MigDevice
from gpuhook.model.record import Record
from gpuhook.plugin.devices import Options, mig_resource_name

log = logging.getLogger("gpuhook.plugin.labels")

PREFIX = "nvidia.com"
GPU_RESOURCE = f"{PREFIX}/gpu"  # GFD labels whole GPUs under this name whatever the resource is called
Key = tuple[int, int]  # (gpu index, mig index or -1), as the health board keys devices

_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SANITISE_RE = re.compile(r"[^A-Za-z0-9-_. ]")


class LabelError(ValueError):
    """A label name or value Kubernetes would refuse."""


def check(name: str, value: str) -> None:
    """Kubernetes' label syntax: an optional DNS-subdomain prefix (at most 253 characters) and `/`, a name of
    at most 63 characters, alphanumeric at both ends with `-_.` inside; a value likewise, or empty."""
    prefix, slash, local = name.rpartition("/")
    dns = bool(prefix) and len(prefix) <= 253 and all(_DNS_LABEL_RE.match(p) for p in prefix.split("."))
    if slash and not dns:
        raise LabelError(f"label prefix {prefix!r} of {name!r} is not a DNS subdomain")
    if not _NAME_RE.match(local):
        raise LabelError(f"label name {local!r} of {name!r} is not a valid name (at most 63 of [A-Za-z0-9-_.])")
    if value and not _NAME_RE.match(value):
        raise LabelError(f"label value {value!r} of {name!r} is not valid (at most 63 of [A-Za-z0-9-_.])")


def sanitise(text: str) -> str:
    """GFD's product sanitising: drop all but `A-Za-z0-9-_. `, then join the words with `-`."""
    return "-".join(_SANITISE_RE.sub("", text).split())


def _value(text: str) -> str:
    """A label value: at most 63 characters, alphanumeric at both ends (GFD would emit a label NFD refuses)."""
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", re.sub(r"[^-A-Za-z0-9_.]", "-", text)[:63])


def arch_family(major: int, minor: int) -> str:
    """GFD's getArchFamily (compute capability -> architecture)."""
    families = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell",
                12: "blackwell"}
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return families.get(major, "undefined")


class _Resource(Record):
    """What one resource labeler of GFD describes: a name prefix, a product, a count and its sharing."""

    name: str  # nvidia.com/gpu, nvidia.com/mig-1g.10gb
    product: str
    count: int
    replicas: int  # 0: sharing not applicable (MIG-enabled parents, as GFD labels them)
    memory_mib: int | None = None  # None: unknown (no label)
    renamed: bool = False  # advertised under another name (nvidia.com/gpu.shared): GFD adds no -SHARED then

    def labels(self) -> dict[str, str]:
        shared = self.replicas > 1
        product = _value("-".join([self.product, "SHARED"]) if shared and not self.renamed else self.product)
        out = {
            f"{self.name}.product": product,
            f"{self.name}.count": str(self.count),
            f"{self.name}.replicas": str(self.replicas),
            f"{self.name}.sharing-strategy": "time-slicing" if shared else "none",
        }
        if self.memory_mib:
            out[f"{self.name}.memory"] = str(self.memory_mib)
        return out


def _sharing(opts: Options, name: str) -> tuple[int, bool]:
    """(replicas, renamed) of the resource the plan calls `name`: the labels read the plugin's own rule."""
    replicas, advertised = opts.replication(name)
    return replicas, advertised != name


def _gpu_labels(inv: Inventory, opts: Options, unhealthy: Collection[Key]) -> dict[str, str]:
    """Whole-GPU labels for what the plugin advertises as whole GPUs: every GPU under `none` (MIG-enabled ones
    are served whole then), the MIG-disabled ones under single/mixed. The product is the lowest-indexed such
    GPU's, MIG-disabled ones first (as GFD's full-GPU labels win); the count is that product's advertised
    devices. With no whole GPU advertised (every GPU MIG-enabled under single/mixed) the MIG-enabled product is
    labelled without sharing (replicas 0, as GFD) and count 0: nothing is allocatable as nvidia.com/gpu."""
    gpus = inv.gpus
    whole = list(gpus) if opts.mig_strategy == "none" else [g for g in gpus if not g.mig_enabled]
    pick = ([g for g in whole if not g.mig_enabled] or whole or list(gpus))[0]
    products = sorted({g.name for g in gpus})
    if len(products) > 1:
        log.warning("multiple GPU products on this node (%s): labelling %s", ", ".join(products), pick.name)
    count = sum(1 for g in whole if g.name == pick.name and (g.index, -1) not in unhealthy)
    replicas, renamed = _sharing(opts, opts.resource_name) if whole else (0, False)
    out = _Resource(GPU_RESOURCE, sanitise(pick.name), count, replicas, pick.memory_mib, renamed).labels()
    if pick.compute_capability:
        major, _, minor = pick.compute_capability.partition(".")
        if major.isdigit() and minor.isdigit() and int(major):
            out[f"{GPU_RESOURCE}.family"] = arch_family(int(major), int(minor))
            out[f"{GPU_RESOURCE}.compute.major"] = major
            out[f"{GPU_RESOURCE}.compute.minor"] = minor
    return out


def _mig_labels(inv: Inventory, opts: Options, unhealthy: Collection[Key]) -> dict[str, str]:
    """`single`: the MIG devices as nvidia.com/gpu (or GFD's INVALID labels); `mixed`: one name per profile."""
    migs = inv.all_mig_devices()
    if opts.mig_strategy == "single":
        enabled = [g for g in inv.gpus if g.mig_enabled]
        if not enabled:
            return {}
        profiles = {m.profile for m in migs}
        if len(enabled) != len(inv.gpus) or len(profiles) != 1 or any(not g.mig_devices for g in enabled):
            log.warning("invalid configuration for MIG strategy single: labelling %s as INVALID", enabled[0].name)
            return {f"{GPU_RESOURCE}.product": _value(f"{sanitise(enabled[0].name)}-MIG-INVALID"),
                    f"{GPU_RESOURCE}.count": "0", f"{GPU_RESOURCE}.replicas": "0", f"{GPU_RESOURCE}.memory": "0"}
        return _mig_resource(inv, GPU_RESOURCE, migs, _sharing(opts, opts.resource_name), unhealthy).labels()
    out: dict[str, str] = {}
    by_profile: dict[str, list[MigDevice]] = {}
    for m in migs:
        by_profile.setdefault(m.profile, []).append(m)
    for profile in sorted(p for p in by_profile if p):
        name = mig_resource_name(GPU_RESOURCE, profile)
        sharing = _sharing(opts, mig_resource_name(opts.resource_name, profile))
        out.update(_mig_resource(inv, name, by_profile[profile], sharing, unhealthy).labels())
    return out


def _mig_resource(inv: Inventory, name: str, migs: list[MigDevice], sharing: tuple[int, bool],
                  unhealthy: Collection[Key]) -> _Resource:
    first = migs[0]
    product = f"{sanitise(inv.gpus[first.gpu_index].name)}-MIG-{sanitise(first.profile)}"
    count = sum(1 for m in migs if (m.gpu_index, m.index) not in unhealthy)
    return _Resource(name, product, count, sharing[0], first.memory_mib, sharing[1])


def _version_labels(inv: Inventory) -> dict[str, str]:
    parts = inv.driver_version.split(".")
    out: dict[str, str] = {}
    if 2 <= len(parts) <= 3:
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) > 2 else ""
        out.update({
            f"{PREFIX}/cuda.driver.major": major,
            f"{PREFIX}/cuda.driver.minor": minor,
            f"{PREFIX}/cuda.driver.rev": rev,
            f"{PREFIX}/cuda.driver-version.major": major,
            f"{PREFIX}/cuda.driver-version.minor": minor,
            f"{PREFIX}/cuda.driver-version.revision": rev,
            f"{PREFIX}/cuda.driver-version.full": inv.driver_version,
        })
    cuda_major, dot, cuda_minor = (inv.cuda_version or "").partition(".")
    if dot and cuda_major.isdigit() and cuda_minor.isdigit():
        out.update({
            f"{PREFIX}/cuda.runtime.major": cuda_major,
            f"{PREFIX}/cuda.runtime.minor": cuda_minor,
            f"{PREFIX}/cuda.runtime-version.major": cuda_major,
            f"{PREFIX}/cuda.runtime-version.minor": cuda_minor,
            f"{PREFIX}/cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}",
        })
    return out


def nvlink_value(inv: Inventory) -> str | None:
    """`nvidia.com/gpu.nvlink`: active NVLinks per GPU (the fewest among GPUs that have any), `none` without
    any, None (no label) when the topology is unknown."""
    if not topology.known(inv):
        return None
    counts = [topology.nvlink_count(g) for g in inv.gpus if topology.nvlink_count(g)]
    return str(min(counts)) if counts else "none"


def labels(inv: Inventory, opts: Options = Options(), unhealthy: Collection[Key] = ()) -> dict[str, str]:
    """Every label for this node, checked against Kubernetes' syntax; empty when there is no GPU (as GFD)."""
    if not inv.gpus:
        return {}
    out = _version_labels(inv)
    out[f"{GPU_RESOURCE}.present"] = "true"  # what NVIDIA's DaemonSets (and ours) select GPU nodes on
    out[f"{PREFIX}/mig.capable"] = "true" if any(g.mig_capable or g.mig_enabled for g in inv.gpus) else "false"
    out[f"{PREFIX}/mps.capable"] = "false"
    out.update(_gpu_labels(inv, opts, unhealthy))
    if opts.mig_strategy != "none":
        out[f"{PREFIX}/mig.strategy"] = opts.mig_strategy
        out.update(_mig_labels(inv, opts, unhealthy))
    nvlink = nvlink_value(inv)
    if nvlink is not None:
        out[f"{GPU_RESOURCE}.nvlink"] = nvlink
    for name, value in out.items():
        check(name, value)
    return dict(sorted(out.items()))


def render(items: Iterable[tuple[str, str]]) -> str:
    """node-feature-discovery's local feature file format (features.d): one `name=value` per line."""
    return "".join(f"{name}={value}\n" for name, value in items)
