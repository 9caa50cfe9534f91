"""Inventory -> CDI spec (a plain dict in the order it is written out).

The content comes only from the planning model: each device's edits are `edits.device_edits(...)` and the
spec-wide edits are `edits.common_edits(...)`, both for CDI_CAPABILITIES: every capability but compat32 (CDI has no
capability gating; nvidia-ctk's spec holds no 32-bit library).
The spec claims the lowest cdiVersion that covers what it uses (see `version`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpuhook.cdi import names, version
from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.names import DEFAULT_NAME_STRATEGIES, NAME_STRATEGIES
from gpuhook.model.contract import HOOK_PATH, VISIBLE_DEVICES
from gpuhook.model.edits import (
    CDI_CAPABILITIES,
    ContainerEdits,
    Mount,
    Symlink,
    common_edits,
    device_edits,
    merge_all,
)
from gpuhook.model.inventory import DeviceNode, Gpu, Inventory, MigDevice

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (generate-cdi's path)
if TYPE_CHECKING:
    from typing import Any

    Device = Gpu | MigDevice  # for type checkers only: a runtime `A | B` of classes needs Python 3.10

ALL_DEVICE = "all"
HOOK_NAME = "createContainer"
# The hooks run in the runtime's context with exactly this environment: nothing of the container or of the
# runtime's own environment reaches them (a hook without `env` would inherit the runtime's).
HOOK_ENV: tuple[str, ...] = ("PATH=" + ":".join(HOOK_PATH),)
# A container that also goes through a legacy NVIDIA hook must not get its devices injected a second time.
COMMON_ENV: tuple[str, ...] = (f"{VISIBLE_DEVICES}=void",)
NODE_PERMISSIONS = "rw"  # cgroup access for each node: read and write, no mknod


def default_devices(inv: Inventory) -> list[Device]:
    """Every device a spec names by default: whole GPUs, except that a MIG-enabled GPU gives its MIG devices."""
    out: list[Device] = []
    for gpu in inv.gpus:
        out.extend(gpu.mig_devices if gpu.mig_enabled else (gpu,))
    return out


def device_names(inv: Inventory, device: Device, strategies: Iterable[str]) -> list[str]:
    """The spec's names for one device, one per strategy (a UUID strategy gives nothing without a UUID).

    index: "0" / "0:1"; uuid: "GPU-…" / "MIG-…"; type-index: "gpu0" / "mig0:1".
    """
    out: list[str] = []
    for strategy in strategies:
        if strategy == "index":
            name = str(device.index) if isinstance(device, Gpu) else device.name
        elif strategy == "uuid":
            name = device.uuid
        elif strategy == "type-index":
            name = f"gpu{device.index}" if isinstance(device, Gpu) else f"mig{device.name}"
        else:
            raise CdiError(f"unknown device name strategy {strategy!r} (expected one of {', '.join(NAME_STRATEGIES)})")
        if name and name not in out:
            out.append(name)
    return out


def _describe(device: Device) -> str:
    if isinstance(device, Gpu):
        return f"GPU {device.index}" + (f" ({device.uuid})" if device.uuid else "")
    return f"MIG device {device.name}" + (f" ({device.uuid})" if device.uuid else "")


def render_node(node: DeviceNode) -> dict[str, Any]:
    return {
        "path": node.path,
        "hostPath": node.host_path,
        "type": node.type,
        "major": node.major,
        "minor": node.minor,
        "fileMode": node.mode,
        "permissions": NODE_PERMISSIONS,
    }


def render_mount(mount: Mount) -> dict[str, Any]:
    # `type` needs cdiVersion 0.4.0, below the 0.5.0 every spec of ours needs anyway (node hostPath).
    return {
        "hostPath": mount.host_path,
        "containerPath": mount.container_path,
        "type": mount.type,
        "options": list(mount.options),
    }


def render_hooks(edits: ContainerEdits, hook_path: str) -> list[dict[str, Any]]:
    """Links and the ld cache are made by one `gpuhook cdi-hook update-container …` call (createContainer):
    one process per container start instead of one per step."""
    if not (edits.symlinks or edits.ld_dirs):
        return []
    args = [hook_path, "cdi-hook", "update-container"]
    for link in edits.symlinks:
        args += ["--link-if-present" if link.if_target_exists else "--link", f"{link.target}::{link.link}"]
    for folder in edits.ld_dirs:
        args += ["--folder", folder]
    if edits.ld_dirs and edits.cuda_compat_driver:
        args += ["--host-driver-version", edits.cuda_compat_driver]
    return [{"hookName": HOOK_NAME, "path": hook_path, "args": args, "env": list(HOOK_ENV)}]


def render_edits(edits: ContainerEdits, hook_path: str, env: Sequence[str] = ()) -> dict[str, Any]:
    """A CDI containerEdits mapping; empty lists are left out.

    `proc_gpu_dirs` and `params_host_path` are not rendered: runc refuses a mount destination inside /proc
    unless its source is a procfs, and the container's own procfs already shows the host driver's
    /proc/driver/nvidia. Only the OCI hook (which mounts inside the live container) can add them.
    """
    out: dict[str, Any] = {}
    all_env = [*env, *edits.env]
    if all_env:
        out["env"] = all_env
    if edits.device_nodes:
        out["deviceNodes"] = [render_node(n) for n in edits.device_nodes]
    if edits.mounts:
        out["mounts"] = [render_mount(m) for m in edits.mounts]
    hooks = render_hooks(edits, hook_path)
    if hooks:
        out["hooks"] = hooks
    return out


def _device_only(edits: ContainerEdits) -> ContainerEdits:
    """The part of a device's edits a spec device carries: its nodes. Its /dev/dri/by-path links go in the common
    hook, made there only for the nodes the container got, so a start runs one hook process, not one per device."""
    return ContainerEdits(device_nodes=list(edits.device_nodes))


def build_spec(
    inv: Inventory,
    *,
    vendor: str = "nvidia.com",
    cls: str = "gpu",
    name_strategies: Sequence[str] = DEFAULT_NAME_STRATEGIES,
    hook_path: str,
    devices: Iterable[Device] | None = None,
    cdi_version: str | None = None,
) -> dict[str, Any]:
    """The CDI spec for `inv`: each device under each name strategy, `all`, and the common edits.

    `devices` None means default_devices(inv); otherwise exactly those devices (the device plugin writes what it
    advertises). `cdi_version` may raise the version, never lower it below what the content needs.
    """
    kind = names.make_kind(vendor, cls)
    if not name_strategies:
        raise CdiError("no device name strategy given")
    if not hook_path.startswith("/"):
        raise CdiError(f"hook path {hook_path!r} must be absolute (the runtime runs it without a PATH search)")
    chosen = default_devices(inv) if devices is None else list(devices)
    if not chosen:
        raise CdiError(f"no GPUs found (driver root {inv.driver_root}): a CDI spec needs at least one device")

    spec_devices: list[dict[str, Any]] = []
    owner: dict[str, str] = {}
    per_device: list[ContainerEdits] = []
    present_links: list[Symlink] = []
    for device in chosen:
        gap = inv.device_gap(device)
        if gap:
            raise CdiError(f"{gap} (are the driver's /dev/nvidia* nodes created?)")  # the gap names the device
        full = device_edits(inv, device, CDI_CAPABILITIES)
        present_links += [Symlink(s.target, s.link, if_target_exists=True) for s in full.symlinks]
        edits = _device_only(full)
        per_device.append(edits)
        for name in device_names(inv, device, name_strategies):
            problem = names.device_name_problem(name)
            if problem:
                raise CdiError(f"{_describe(device)}: {problem}")
            if name in owner or name == ALL_DEVICE:
                raise CdiError(f"device name {name!r} given to both {owner.get(name, 'all')} and {_describe(device)}")
            owner[name] = _describe(device)
            # rendered afresh for each name: a shared object would come out as a YAML alias
            spec_devices.append({"name": name, "containerEdits": render_edits(edits, hook_path)})
    spec_devices.append({"name": ALL_DEVICE, "containerEdits": render_edits(merge_all(per_device), hook_path)})
    common = common_edits(inv, CDI_CAPABILITIES)
    common.symlinks += list({s.link: s for s in present_links}.values())

    spec: dict[str, Any] = {
        "cdiVersion": version.EARLIEST,
        "kind": kind,
        "devices": spec_devices,
        "containerEdits": render_edits(common, hook_path, env=COMMON_ENV),
    }
    spec["cdiVersion"] = choose_version(spec, cdi_version)
    return spec


def choose_version(spec: dict[str, Any], wanted: str | None) -> str:
    """The minimum version `spec` needs, or `wanted` if it is known and not below that minimum."""
    needed = version.minimum_version(spec)
    if wanted is None:
        return needed
    if not version.is_known(wanted):
        raise CdiError(f"unknown cdiVersion {wanted!r} (known: {', '.join(version.KNOWN_VERSIONS)})")
    if version.key(wanted) < version.key(needed):
        req = version.highest_requirement(spec)
        why = f" ({req.why} at {req.path})" if req else ""
        raise CdiError(f"cdiVersion {wanted} is below {needed}, the lowest this spec can claim{why}")
    return wanted
