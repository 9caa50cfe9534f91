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
from gpuhook.plugin.devices import CDI_CLASS, CDI_KIND, CDI_VENDOR, Resource, advertised_targets

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.plugin.devices import Target

# NVIDIA's file name for its kind (the CDI library's GenerateNameForSpec, `<vendor>-<class>`, saved as .json in
# /var/run/cdi: k8s-device-plugin v0.20.0 internal/cdi/cdi.go CreateSpecFile): a node moving from NVIDIA's
# plugin has this one file replaced, never a second spec of the same kind beside it.
SPEC_FILE = f"{CDI_VENDOR}-{CDI_CLASS}.json"
# What gpuhook's plugin wrote before it had a kind of its own (nvidia.com/gpu). Never removed: the host's
# `generate-cdi --watch` unit writes a spec of that name too (runtime-config/systemd/gpuhook-cdi-refresh.service),
# and nothing tells the two apart; doctor names the clash while both are there (/var/run/cdi is cleared at boot).
OLD_SPEC_FILE = "nvidia.com-gpu.yaml"
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


def _rebase_edits(edits: dict[str, Any], key: str, inside: str, outside: str) -> None:
    for item in edits.get(key, []):
        if "hostPath" in item:
            item["hostPath"] = rebase(item["hostPath"], inside, outside)


def _differs(host: str | None, read: str) -> bool:
    return host is not None and os.path.normpath(host) != os.path.normpath(read)


def rebase_spec(spec: dict[str, Any], inv: Inventory, host_driver_root: str | None,
                host_dev_root: str | None = None) -> None:
    """Host paths of a spec built from `inv`, in place, from where this process read them to where the runtime
    finds them: mounts from the read driver root to `host_driver_root`, device nodes from the read dev root to
    `host_dev_root` (None: not rebased). The DRA driver's claim specs are rebased the same way."""
    if host_dev_root is None and os.path.normpath(inv.dev_root) == os.path.normpath(inv.driver_root):
        host_dev_root = host_driver_root  # one root read for both: one root on the host too (NVIDIA's default)
    everything = [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]
    for edits in everything:
        if _differs(host_driver_root, inv.driver_root):
            _rebase_edits(edits, "mounts", inv.driver_root, str(host_driver_root))
        if _differs(host_dev_root, inv.dev_root):
            _rebase_edits(edits, "deviceNodes", inv.dev_root, str(host_dev_root))


def build(inv: Inventory, targets: Sequence[Target], hook_path: str, host_driver_root: str | None,
          host_dev_root: str | None = None) -> dict[str, Any]:
    """The spec for `targets`, its host paths rebased (rebase_spec)."""
    spec = build_spec(inv, vendor=CDI_VENDOR, cls=CDI_CLASS, name_strategies=NAME_STRATEGIES, hook_path=hook_path,
                      devices=targets)
    rebase_spec(spec, inv, host_driver_root, host_dev_root)
    return spec


def check_names(spec: dict[str, Any], resources: Sequence[Resource]) -> None:
    """Every CDI name Allocate can return must be a device of the spec we write."""
    names = {f"{spec['kind']}={d['name']}" for d in spec["devices"]}
    missing = sorted({d.cdi_name for r in resources for d in r.devices} - names)
    if spec["kind"] != CDI_KIND or missing:
        raise ConfigError(f"CDI spec does not name advertised device(s): {', '.join(missing) or spec['kind']}")


def write(inv: Inventory, resources: Sequence[Resource], spec_dir: str, hook_path: str,
          host_driver_root: str | None = None, host_dev_root: str | None = None) -> str:
    """Build, check and atomically write `<spec_dir>/nvidia.com-gpu.yaml`; returns its path."""
    from gpuhook.fileio.atomic import write_atomic

    targets = advertised_targets(resources)
    if not targets:
        raise ConfigError("no GPU to advertise: nothing to write a CDI spec for")
    spec = build(inv, targets, hook_path, host_driver_root, host_dev_root)
    check_names(spec, resources)
    path = os.path.join(spec_dir, SPEC_FILE)
    write_atomic(path, dumps(spec, "json").encode(), 0o644)
    return path

