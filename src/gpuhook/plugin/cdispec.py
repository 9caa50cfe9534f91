"""The CDI spec the plugin writes at start: exactly the advertised devices, so every name Allocate returns resolves.

Content comes from the CDI generator (`cdi.spec.build_spec`), never from a second list. When the plugin runs in
a container, the driver root it reads (`--driver-root /driver-root`) is not where the runtime finds the files
(`--host-driver-root /`): host paths in the spec are rebased from one to the other.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from typing import Any

from gpuhook.cdi.codec import dumps
from gpuhook.cdi.spec import build_spec
from gpuhook.errors import ConfigError
from gpuhook.model.inventory import Inventory
from gpuhook.plugin.devices import CDI_KIND, Resource, advertised_targets

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.plugin.devices import Target

SPEC_FILE = "nvidia.com-gpu.yaml"
NAME_STRATEGIES = ("index", "uuid")


def rebase(path: str, inside: str, outside: str) -> str:
    """`inside`/x -> `outside`/x; paths elsewhere are left alone."""
    inside = inside.rstrip("/") or "/"
    if inside == "/":
        rel = path
    elif path == inside or path.startswith(inside + "/"):
        rel = path[len(inside):] or "/"
    else:
        return path
    return posixpath.normpath(outside.rstrip("/") + "/" + rel.lstrip("/")) if outside not in ("", "/") else rel


def _rebase_edits(edits: dict[str, Any], inside: str, outside: str) -> None:
    for key in ("deviceNodes", "mounts"):
        for item in edits.get(key, []):
            if "hostPath" in item:
                item["hostPath"] = rebase(item["hostPath"], inside, outside)


def rebase_spec(spec: dict[str, Any], inv: Inventory, host_driver_root: str | None) -> None:
    """Host paths of a spec built from `inv` as the runtime sees them, when its driver root differs (in place)."""
    if host_driver_root is not None and os.path.normpath(host_driver_root) != os.path.normpath(inv.driver_root):
        _rebase_edits(spec.get("containerEdits", {}), inv.driver_root, host_driver_root)
        for device in spec["devices"]:
            _rebase_edits(device["containerEdits"], inv.driver_root, host_driver_root)


def build(inv: Inventory, targets: Sequence[Target], hook_path: str, host_driver_root: str | None) -> dict[str, Any]:
    spec = build_spec(inv, vendor="nvidia.com", cls="gpu", name_strategies=NAME_STRATEGIES, hook_path=hook_path,
                      devices=targets)
    rebase_spec(spec, inv, host_driver_root)
    return spec


def check_names(spec: dict[str, Any], resources: Sequence[Resource]) -> None:
    """Every CDI name Allocate can return must be a device of the spec we write."""
    names = {f"{spec['kind']}={d['name']}" for d in spec["devices"]}
    missing = sorted({d.cdi_name for r in resources for d in r.devices} - names)
    if spec["kind"] != CDI_KIND or missing:
        raise ConfigError(f"CDI spec does not name advertised device(s): {', '.join(missing) or spec['kind']}")


def write(inv: Inventory, resources: Sequence[Resource], spec_dir: str, hook_path: str,
          host_driver_root: str | None = None) -> str:
    """Build, check and atomically write `<spec_dir>/nvidia.com-gpu.yaml`; returns its path."""
    from gpuhook.fileio.atomic import write_atomic

    targets = advertised_targets(resources)
    if not targets:
        raise ConfigError("no GPU to advertise: nothing to write a CDI spec for")
    spec = build(inv, targets, hook_path, host_driver_root)
    check_names(spec, resources)
    path = os.path.join(spec_dir, SPEC_FILE)
    write_atomic(path, dumps(spec, "yaml").encode(), 0o644)
    return path
