"""The CDI spec directories as a runtime sees them: which qualified device names resolve, and why not.

Mirrors the Go cache (tags.cncf.io/container-device-interface/pkg/cdi): directories in order of increasing
priority (the later one wins), only `*.yaml` and `*.json` files directly inside them, a spec that fails to
load contributes nothing, and a name defined twice at one priority is a conflict that leaves it unresolvable
(even when a higher-priority directory defines it again).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from gpuhook.cdi import codec
from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.validate import validate_spec
from gpuhook.model.record import Record, field

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (generate-cdi's path)
if TYPE_CHECKING:
    from typing import Any

DEFAULT_SPEC_DIRS: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")


class SpecDevice(Record):
    name: str  # qualified: vendor/class=name
    spec_path: str
    priority: int


class Registry(Record, frozen=False):
    devices: dict[str, SpecDevice] = field(default_factory=dict)  # resolvable names only
    conflicts: dict[str, list[str]] = field(default_factory=dict)  # name -> spec files defining it at one priority
    errors: list[str] = field(default_factory=list)  # one line per spec that does not load (or unreadable dir)

    def names(self) -> list[str]:
        return sorted(self.devices)


def spec_files(folder: str) -> list[str]:
    """The spec files a loader reads from `folder` (not recursive), sorted; [] if it does not exist."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [e.path for e in entries if codec.has_spec_extension(e.name) and not e.is_dir()]


def scan(dirs: Sequence[str] = DEFAULT_SPEC_DIRS) -> Registry:
    """Load every spec in `dirs` (priority = position) and resolve qualified names like a runtime would."""
    reg = Registry()
    for priority, folder in enumerate(dirs):
        try:
            files = spec_files(folder)
        except OSError as exc:
            reg.errors.append(f"{folder}: cannot list spec directory: {exc.strerror}")
            continue
        for path in files:
            try:
                data = codec.read(path)
            except CdiError as exc:
                reg.errors.append(str(exc))
                continue
            problems = validate_spec(data, path)
            if problems:
                extra = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                reg.errors.append(problems[0] + extra)
                continue
            _add(reg, data, path, priority)
    for name in reg.conflicts:
        reg.devices.pop(name, None)
    return reg


def _add(reg: Registry, spec: dict[str, Any], path: str, priority: int) -> None:
    kind = spec["kind"]
    for device in spec["devices"]:
        name = f"{kind}={device['name']}"
        old = reg.devices.get(name)
        if old is not None and old.priority == priority:
            reg.conflicts.setdefault(name, [old.spec_path])
            reg.conflicts[name].append(path)
            continue
        reg.devices[name] = SpecDevice(name, path, priority)
