"""The transient CDI spec of one prepared claim: exactly its devices, with the edits `generate-cdi` gives them.

Content comes from the CDI generator (`cdi.spec.build_spec`, the same edits model), renamed the way NVIDIA's DRA
driver names a claim's devices (cmd/gpu-kubelet-plugin/cdi.go: vendor `k8s.gpu.nvidia.com`, class `claim`,
device `<claim UID>-<device name>`, file `k8s.gpu.nvidia.com-claim_<claim UID>.yaml`, the CDI package's
GenerateTransientSpecName), so a claim's CDI ids name it and nothing else. The spec-wide edits (driver libraries,
control nodes, the container hook) apply to the container with any of them, as in every gpuhook spec.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from typing import Any

from gpuhook.cdi.codec import dumps
from gpuhook.cdi.spec import ALL_DEVICE, build_spec
from gpuhook.dra.devices import DraDevice
from gpuhook.model.inventory import Inventory
from gpuhook.plugin.cdispec import rebase_spec

VENDOR = "k8s.gpu.nvidia.com"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
_PREFIX = f"{VENDOR}-{CLASS}_"
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$")


def spec_path(cdi_dir: str, uid: str) -> str:
    if not _UID.match(uid):
        raise ValueError(f"claim UID {uid!r} is not a Kubernetes UID")
    return os.path.join(cdi_dir, f"{_PREFIX}{uid}.yaml")


def claim_uids(cdi_dir: str) -> list[str]:
    """The claims whose specs are in `cdi_dir` (what a restart compares with its checkpoint)."""
    try:
        names = os.listdir(cdi_dir)
    except OSError:
        return []
    return [n[len(_PREFIX):-5] for n in names if n.startswith(_PREFIX) and n.endswith(".yaml")]


def cdi_id(uid: str, device: str) -> str:
    return f"{KIND}={uid}-{device}"


def build(inv: Inventory, uid: str, devices: Sequence[DraDevice], hook_path: str,
          host_driver_root: str | None = None, host_dev_root: str | None = None) -> dict[str, Any]:
    """The spec: one CDI device per DRA device, named `<uid>-<name>`, no `all`."""
    spec = build_spec(inv, vendor=VENDOR, cls=CLASS, name_strategies=("index",), hook_path=hook_path,
                      devices=[d.target for d in devices])
    named = [d for d in spec["devices"] if d["name"] != ALL_DEVICE]
    for entry, device in zip(named, devices):  # build_spec keeps the given order, one name each
        entry["name"] = f"{uid}-{device.name}"
    spec["devices"] = named
    rebase_spec(spec, inv, host_driver_root, host_dev_root)
    return spec


def write(cdi_dir: str, uid: str, spec: dict[str, Any]) -> str:
    from gpuhook.fileio.atomic import write_atomic

    path = spec_path(cdi_dir, uid)
    write_atomic(path, dumps(spec, "yaml").encode(), 0o644)
    return path


def remove(cdi_dir: str, uid: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(spec_path(cdi_dir, uid))
