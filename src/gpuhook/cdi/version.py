"""`cdiVersion`: the known versions and the lowest one a spec's content needs.

Consumers lag behind (podman 4.3.1 loads at most 0.5.0), so a spec must claim the lowest version that covers
what it uses. A field counts when it is present, even empty: an older, strict loader rejects the field itself.
Rules (DESIGN.md; the Go loader's requiresVxyz): 1.1.0 netDevices; 0.7.0 intelRdt or additionalGids; 0.6.0
annotations or a dot in the class; 0.5.0 a device name not starting with a letter or a device node hostPath;
0.4.0 a mount type; else 0.3.0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from gpuhook.model.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (generate-cdi's path)
if TYPE_CHECKING:
    from typing import Any

KNOWN_VERSIONS: tuple[str, ...] = (
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
)
EARLIEST = "0.3.0"  # the lowest version a current loader considers (0.1.0 and 0.2.0 load as 0.3.0)


class Requirement(Record):
    """One piece of content that needs `version`, at JSON path `path`."""

    version: str
    path: str
    why: str


def key(version: str) -> tuple[int, ...]:
    """Sort key of a dotted version ("0.10.0" > "0.9.0"); ValueError if it is not dotted integers."""
    return tuple(int(part) for part in version.split("."))


def is_known(version: object) -> bool:
    return isinstance(version, str) and version in KNOWN_VERSIONS


def _edits(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    top = spec.get("containerEdits")
    if isinstance(top, Mapping):
        yield "$.containerEdits", top
    devices = spec.get("devices")
    if isinstance(devices, list):
        for i, dev in enumerate(devices):
            if isinstance(dev, Mapping) and isinstance(dev.get("containerEdits"), Mapping):
                yield f"$.devices[{i}].containerEdits", dev["containerEdits"]


def _items(edits: Mapping[str, Any], field: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    items = edits.get(field)
    if isinstance(items, list):
        for i, item in enumerate(items):
            if isinstance(item, Mapping):
                yield i, item


def _found(spec: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """Every feature in `spec` that needs more than the earliest version, in document order, as (version, path,
    why): plain tuples, since a generated spec has one per mount and device node (~600 for 8 GPUs x 7 MIG) and
    only the first of the highest becomes a Requirement."""
    if "annotations" in spec:
        yield "0.6.0", "$.annotations", "spec annotations"
    kind = spec.get("kind")
    if isinstance(kind, str) and "." in kind.partition("/")[2]:
        yield "0.6.0", "$.kind", "a '.' in the class name"
    devices = spec.get("devices")
    for i, dev in enumerate(devices if isinstance(devices, list) else []):
        if not isinstance(dev, Mapping):
            continue
        name = dev.get("name")
        if isinstance(name, str) and name and not (name[0].isascii() and name[0].isalpha()):
            yield "0.5.0", f"$.devices[{i}].name", "a device name not starting with a letter"
        if "annotations" in dev:
            yield "0.6.0", f"$.devices[{i}].annotations", "device annotations"
    for path, edits in _edits(spec):
        for i, node in _items(edits, "deviceNodes"):
            if "hostPath" in node:
                yield "0.5.0", f"{path}.deviceNodes[{i}].hostPath", "a device node hostPath"
        for i, mount in _items(edits, "mounts"):
            if "type" in mount:
                yield "0.4.0", f"{path}.mounts[{i}].type", "a mount type"
        if "intelRdt" in edits:
            yield "0.7.0", f"{path}.intelRdt", "intelRdt"
        if "additionalGids" in edits:
            yield "0.7.0", f"{path}.additionalGids", "additionalGids"
        if "netDevices" in edits:
            yield "1.1.0", f"{path}.netDevices", "netDevices"


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that covers everything `spec` uses."""
    top = highest_requirement(spec)
    return top.version if top is not None else EARLIEST


def highest_requirement(spec: Mapping[str, Any]) -> Requirement | None:
    """The first feature that forces minimum_version(spec), for error messages."""
    best: tuple[str, str, str] | None = None
    best_key: tuple[int, ...] = ()
    keys: dict[str, tuple[int, ...]] = {}  # a handful of distinct versions among hundreds of findings
    for found in _found(spec):
        k = keys.get(found[0])
        if k is None:
            k = keys[found[0]] = key(found[0])
        if best is None or k > best_key:
            best, best_key = found, k
    return Requirement(*best) if best is not None else None
