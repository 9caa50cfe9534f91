"""CDI specs on disk: does each one load (gpuhook.cdi.validate), and does it still describe this driver?

A spec goes stale when the driver is upgraded (its mounts name `lib*.so.<old version>` and firmware of the old
version), when GPUs come or go (names of devices the host no longer has, devices it does not name), and when the
MIG layout changes (a MIG device's capability nodes differ). Each device of the spec is compared with what
`edits.device_edits` gives for the device its name resolves to (`selection.find_device`), so "current" means: what
`gpuhook generate-cdi` would write today.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from gpuhook.cdi import codec
from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.names import DEFAULT_NAME_STRATEGIES
from gpuhook.cdi.registry import Registry, scan, spec_files
from gpuhook.cdi.spec import ALL_DEVICE, default_devices
from gpuhook.doctor.model import INFO, OK, PROBLEM, WARN, Finding
from gpuhook.model.contract import PLUGIN_CDI_KIND
from gpuhook.model.edits import CDI_CAPABILITIES, common_edits, device_edits, merge_all
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record, field
from gpuhook.model.request import CDI_KIND
from gpuhook.model.selection import find_device

# The driver's version shows in libcuda's and libnvidia-ml's names; other libraries of the driver's packages
# carry their own (libnvidia-egl-gbm.so.1.1.0, libnvidia-api.so.1) and say nothing about it.
_LIB_VERSION = re.compile(r"/lib(?:cuda|nvidia-ml)\.so\.(\d+\.\d+(?:\.\d+)?)$")
_FIRMWARE_VERSION = re.compile(r"/firmware/nvidia/(\d+\.\d+(?:\.\d+)?)/")
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; the aliases are for type checkers only
if TYPE_CHECKING:  # (a runtime `A | B` of classes needs Python 3.10)
    Device = Gpu | MigDevice
Nodes = frozenset[tuple[str, int, int]]


class SpecStatus(Record, frozen=False):
    """What the runtime checks need: which spec files are good (load and are current) and which names resolve."""

    registry: Registry
    current: set[str] = field(default_factory=set)  # spec paths that load and match the driver
    loaded: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> parsed spec

    def gpu_specs(self, dirs: Sequence[str]) -> list[str]:
        """Paths in `dirs` whose nvidia.com/gpu devices a runtime reading those dirs resolves."""
        return _specs_of_kind(dirs, CDI_KIND)

    def plugin_specs(self, dirs: Sequence[str]) -> list[str]:
        """Paths in `dirs` whose device-plugin devices (k8s.device-plugin.nvidia.com/gpu, gpuhook's or NVIDIA's
        plugin) a runtime reading those dirs resolves: how a Kubernetes node's pods get their GPUs."""
        return _specs_of_kind(dirs, PLUGIN_CDI_KIND)


def _specs_of_kind(dirs: Sequence[str], kind: str) -> list[str]:
    reg = scan(dirs)
    return sorted({d.spec_path for name, d in reg.devices.items() if name.startswith(kind + "=")})


def _nodes(items: Any) -> Nodes:
    out = set()
    for n in items if isinstance(items, list) else []:
        if isinstance(n, dict) and isinstance(n.get("path"), str):
            out.add((n["path"], int(n.get("major", -1)), int(n.get("minor", -1))))
    return frozenset(out)


def _inv_nodes(nodes: Any) -> Nodes:
    return frozenset((n.path, n.major, n.minor) for n in nodes)


def _resolve(inv: Inventory, name: str) -> Device | None:
    """A spec device name under any naming strategy (index, uuid, type-index) → the device it means today."""
    for prefix in ("gpu", "mig"):
        if name.startswith(prefix) and name[3:4].isdigit():
            name = name[3:]
    return find_device(inv, name)


def _key(device: Device) -> tuple[int, int]:
    return (device.index, -1) if isinstance(device, Gpu) else (device.gpu_index, device.index)


def _describe(device: Device) -> str:
    if isinstance(device, Gpu):
        return f"GPU {device.index}" + (f" ({device.uuid})" if device.uuid else "")
    return f"MIG device {device.name}" + (f" ({device.uuid})" if device.uuid else "")


def _paths(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(hostPath, containerPath) of every mount in the spec."""
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices") or []]
    return [(m.get("hostPath", ""), m.get("containerPath", "")) for e in edits for m in e.get("mounts") or []
            if isinstance(m, dict)]


def _hook_paths(spec: dict[str, Any]) -> set[str]:
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices") or []]
    return {h.get("path", "") for e in edits for h in e.get("hooks") or [] if isinstance(h, dict)}


def stale_reasons(spec: dict[str, Any], inv: Inventory) -> list[str]:
    """Why `spec` (an nvidia.com/gpu spec that loads) no longer matches `inv`; empty when it is current."""
    reasons: list[str] = []
    mounts = _paths(spec)
    versions = sorted({m.group(1) for pair in mounts for p in pair
                       for m in (_LIB_VERSION.search(p), _FIRMWARE_VERSION.search(p)) if m})
    if versions and versions != [inv.driver_version]:
        reasons.append(f"made for driver {', '.join(versions)}, the driver is {inv.driver_version}")
    gone = [host for host, _ in mounts if host and not os.path.lexists(host)]
    if gone:
        reasons.append(f"{len(gone)} mounted file(s) no longer exist (e.g. {gone[0]})")
    hooks = sorted(p for p in _hook_paths(spec) if p and not os.path.exists(p))
    if hooks:
        reasons.append(f"its hooks run {hooks[0]}, which does not exist")
    named: set[tuple[int, int]] = set()
    for dev in spec.get("devices") or []:
        name = dev.get("name", "")
        if name == ALL_DEVICE:
            continue
        found = _resolve(inv, name)
        if found is None:
            reasons.append(f"names device {name!r}, which this host does not have (any more)")
            continue
        if isinstance(found, Gpu) and found.mig_enabled:
            reasons.append(f"names {_describe(found)} as {name!r}, but it is in MIG mode now")
            continue
        named.add(_key(found))
        have = _nodes((dev.get("containerEdits") or {}).get("deviceNodes"))
        want = _inv_nodes(device_edits(inv, found, CDI_CAPABILITIES).device_nodes)
        if have != want:
            reasons.append(f"device {name!r}: nodes {_fmt(have)} differ from the host's {_fmt(want)}")
    missing = [d for d in default_devices(inv) if _key(d) not in named]
    if missing:
        reasons.append("does not name " + ", ".join(_describe(d) for d in missing))
    everything = next((d for d in spec.get("devices") or [] if d.get("name") == ALL_DEVICE), None)
    if everything is not None and not missing:
        want = _inv_nodes(merge_all(device_edits(inv, d, CDI_CAPABILITIES) for d in default_devices(inv)).device_nodes)
        have = _nodes((everything.get("containerEdits") or {}).get("deviceNodes"))
        if have != want:
            reasons.append(f"device 'all': nodes {_fmt(have)} differ from the host's {_fmt(want)}")
    common_have = _nodes((spec.get("containerEdits") or {}).get("deviceNodes"))
    common_want = _inv_nodes(common_edits(inv, CDI_CAPABILITIES).device_nodes)
    if common_have != common_want:
        reasons.append(f"control nodes {_fmt(common_have)} differ from the host's {_fmt(common_want)}")
    return reasons


def _fmt(nodes: Nodes) -> str:
    items = sorted(nodes)
    text = ", ".join(f"{p} {a}:{b}" for p, a, b in items[:3])
    return "[" + text + (f", … {len(items) - 3} more" if len(items) > 3 else "") + "]"


def _strategies(spec: dict[str, Any]) -> list[str]:
    found = []
    for d in spec.get("devices") or []:
        name = str(d.get("name", ""))
        if name[:1].isdigit():
            found.append("index")
        elif name.startswith(("GPU-", "MIG-")):
            found.append("uuid")
        elif name.startswith(("gpu", "mig")):
            found.append("type-index")
    return [s for s in ("index", "uuid", "type-index") if s in found]


def regenerate_command(path: str, spec: dict[str, Any] | None = None, flags: str = "") -> str:
    """The generate-cdi line that rewrites `path` with the naming it has now (`flags`: non-default roots)."""
    cmd = f"gpuhook generate-cdi{flags} --output {path}"
    strategies = _strategies(spec or {})
    if strategies and tuple(strategies) != tuple(DEFAULT_NAME_STRATEGIES):
        cmd += "".join(f" --device-name-strategy {s}" for s in strategies)
    return cmd


def check_specs(dirs: Sequence[str], inv: Inventory | None, flags: str = "") -> tuple[list[Finding], SpecStatus]:
    reg = scan(dirs)
    status = SpecStatus(reg)
    out: list[Finding] = []
    files = [p for d in dirs for p in _files(d)]
    winners = {d.spec_path for d in reg.devices.values()}
    for path in files:
        problems = validate_file_quiet(path)
        if problems:
            more = f" (and {len(problems) - 1} more: gpuhook cdi validate {path})" if len(problems) > 1 else ""
            out.append(Finding("cdi", PROBLEM, f"{path} does not load, a runtime ignores it: {problems[0]}{more}",
                               regenerate_command(path, None, flags)))
            continue
        spec = codec.read(path)
        status.loaded[path] = spec
        if spec.get("kind") != CDI_KIND:
            out.append(Finding("cdi", OK, f"{path}: kind {spec.get('kind')}, not gpuhook's (loads)"))
            continue
        if inv is None:
            out.append(Finding("cdi", INFO, f"{path}: loads; not compared with the driver (no driver found)"))
            continue
        reasons = stale_reasons(spec, inv)
        devices = len([d for d in spec.get("devices") or [] if d.get("name") != ALL_DEVICE])
        if not reasons:
            status.current.add(path)
            out.append(Finding("cdi", OK, f"{path}: current ({devices} device names, driver {inv.driver_version}, "
                                          f"cdiVersion {spec.get('cdiVersion')})"))
            continue
        shadowed = path not in winners
        where = " (shadowed: every name it defines comes from another spec)" if shadowed else ""
        out.append(Finding("cdi", WARN if shadowed else PROBLEM, f"{path} is stale{where}: {'; '.join(reasons)}",
                           regenerate_command(path, spec, flags)))
    out += clashes(reg.conflicts)
    if not files:
        out.append(Finding("cdi", INFO, f"no CDI spec in {', '.join(dirs)}"))
    return out, status


def clashes(conflicts: dict[str, list[str]]) -> list[Finding]:
    """One PROBLEM per set of spec files that define the same qualified names in one directory (a runtime's CDI
    cache then resolves none of them): the files, how many names, the first few. The usual cause: two writers
    of one kind on a node (a device plugin's spec beside a host spec of kind nvidia.com/gpu)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, paths in conflicts.items():
        groups.setdefault(tuple(paths), []).append(name)
    out = []
    for paths, names in sorted(groups.items()):
        names.sort()
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(Finding("cdi", PROBLEM, f"CDI name clash: {' and '.join(paths)} both define {shown} at one "
                                           f"priority: a runtime resolves none of these {len(names)} name(s)",
                           f"keep one writer of this kind: rm {paths[-1]} (or regenerate it under another kind)"))
    return out


def _files(folder: str) -> list[str]:
    try:
        return spec_files(folder)
    except OSError:
        return []


def validate_file_quiet(path: str) -> list[str]:
    """validate_file, each problem without the leading path (the finding names the file once)."""
    from gpuhook.cdi.validate import validate_file

    try:
        return [line.removeprefix(f"{path}: ") for line in validate_file(path)]
    except CdiError as exc:  # pragma: no cover - validate_file reports read errors itself
        return [str(exc)]


__all__ = ["SpecStatus", "check_specs", "regenerate_command", "stale_reasons"]
