"""The driver's record of prepared claims, so a restart (of the driver or the kubelet) answers a repeated prepare
with the same CDI ids and unprepare still finds what to remove.

One JSON file in the driver's plugin directory (NVIDIA's keeps its own `checkpoint.json` there; ours has its own
name and format), rewritten whole and atomically (`fileio/atomic.write_regular`) on every change: a crash
leaves the old or the new file, never half of one. A file that cannot be read is an error at start, not a fresh
start: the kubelet may still count on the claims it lists.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpuhook.errors import GpuhookError, clip
from gpuhook.model.record import Record

FILE = "gpuhook-checkpoint.json"
KIND = "gpuhook.dra/checkpoint"
VERSION = 1
MAX_BYTES = 16 << 20


class CheckpointError(GpuhookError):
    pass


class PreparedDevice(Record):
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"requests": list(self.requests), "pool": self.pool, "device": self.device,
                "cdiIds": list(self.cdi_ids)}


class PreparedClaim(Record):
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "devices": [d.to_json() for d in self.devices]}


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a list of strings: {clip(value)}")
    return tuple(value)


def _claim(raw: Any) -> PreparedClaim:
    if not isinstance(raw, Mapping):
        raise ValueError(f"not an object: {clip(raw)}")
    devices = []
    for d in raw.get("devices") or []:
        if not isinstance(d, Mapping):
            raise ValueError(f"device not an object: {clip(d)}")
        devices.append(PreparedDevice(_strings(d.get("requests")), str(d["pool"]), str(d["device"]),
                                      _strings(d.get("cdiIds"))))
    return PreparedClaim(str(raw["namespace"]), str(raw["name"]), tuple(devices))


def load(path: str) -> dict[str, PreparedClaim]:
    """The claims recorded at `path` (none when there is no file)."""
    from gpuhook.fileio.atomic import read_regular

    try:
        data = read_regular(path, follow_links=False, limit=MAX_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    except GpuhookError as exc:  # not a regular file
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    try:
        doc = json.loads(data)
        if doc.get("kind") != KIND or doc.get("version") != VERSION:
            raise ValueError(f"not a {KIND} version {VERSION} document")
        return {str(uid): _claim(c) for uid, c in (doc.get("claims") or {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable ({clip(str(exc), quote=False)}); the kubelet may "
                              "still count on the claims it lists: unprepare them, then move it away") from None


def save(path: str, claims: Mapping[str, PreparedClaim]) -> None:
    from gpuhook.fileio.atomic import write_regular

    doc = {"kind": KIND, "version": VERSION, "claims": {uid: c.to_json() for uid, c in sorted(claims.items())}}
    write_regular(path, json.dumps(doc, indent=1).encode() + b"\n", 0o600)
