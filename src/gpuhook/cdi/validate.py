"""`gpuhook cdi validate`: the official JSON schema plus the Go loader's rules the schema does not state.

The schema (schemas/schema.json + defs.json, spec 1.1.0) is permissive: no syntax for kind or names, unknown
fields pass, versions unchecked. The loader (tags.cncf.io/container-device-interface) is strict, and a spec it
refuses makes the runtime fail every container that asks for one of its devices, so both are checked here.
Problems come back as "<origin>: <JSON path>: <message>", in document order, schema problems first.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping

from gpuhook.cdi import names, version

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (generate-cdi's path)
if TYPE_CHECKING:
    from typing import Any

VALID_HOOK_NAMES: frozenset[str] = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"})
NODE_TYPES: frozenset[str] = frozenset({"b", "c", "u", "p"})
NO_PERMISSIONS = "none"  # the loader's word for an empty cgroup access

# Known fields per object (strict, like the Go loader's UnmarshalStrict); version gating is in `version`.
FIELDS: dict[str, frozenset[str]] = {
    "spec": frozenset({"cdiVersion", "kind", "annotations", "devices", "containerEdits"}),
    "device": frozenset({"name", "annotations", "containerEdits"}),
    "containerEdits": frozenset(
        {"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids", "netDevices"}),
    "deviceNode": frozenset({"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}),
    "mount": frozenset({"hostPath", "containerPath", "type", "options"}),
    "hook": frozenset({"hookName", "path", "args", "env", "timeout"}),
    "intelRdt": frozenset({"closID", "l3CacheSchema", "memBwSchema", "schemata", "enableMonitoring"}),
    "netDevice": frozenset({"hostInterfaceName", "name"}),
}
SCHEMA_BASE = "https://gpuhook.invalid/cdi/"


def json_path(parts: Iterator[str | int] | list[str | int] | tuple[str | int, ...]) -> str:
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


@functools.cache
def _schema_validator() -> Any:
    """Draft-07 validator over the packaged schema, defs.json resolved through a `referencing` registry."""
    from importlib import resources  # only with the schema check: ~8 ms that generate-cdi need not pay

    from jsonschema import Draft7Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    folder = resources.files("gpuhook").joinpath("schemas")
    schema = json.loads(folder.joinpath("schema.json").read_text(encoding="utf-8"))
    defs = json.loads(folder.joinpath("defs.json").read_text(encoding="utf-8"))
    # The official schema leaves the spec-level containerEdits undescribed; the Go loader types it like a
    # device's, so it is checked against the same definition.
    properties = {"containerEdits": {"$ref": "defs.json#/definitions/containerEdits"}, **schema["properties"]}
    schema = {**schema, "$id": SCHEMA_BASE + "schema.json", "properties": properties}
    registry: Registry = Registry().with_resources([
        (SCHEMA_BASE + "schema.json", Resource.from_contents(schema, default_specification=DRAFT7)),
        (SCHEMA_BASE + "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)),
    ])
    return Draft7Validator(schema, registry=registry)


def schema_problems(data: Any) -> list[tuple[str, str]]:
    """(JSON path, message) for each schema violation, in document order."""
    errors = sorted(_schema_validator().iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    return [(json_path(list(e.absolute_path)), e.message) for e in errors]


class _Checker:
    """The loader rules, walking the document; type errors are left to the schema (and skipped here)."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append((path, message))

    def fields(self, obj: Mapping[str, Any], what: str, path: str) -> None:
        for k in obj:
            if k not in FIELDS[what]:
                self.add(f"{path}.{k}" if isinstance(k, str) else path, f"unknown field {k!r}")

    def spec(self, data: Any) -> None:
        if not isinstance(data, Mapping):
            self.add("$", "a CDI spec must be a mapping")
            return
        self.fields(data, "spec", "$")
        cdi_version = data.get("cdiVersion")
        if isinstance(cdi_version, str):
            if not version.is_known(cdi_version):
                self.add("$.cdiVersion", f"unknown cdiVersion {cdi_version!r} "
                                         f"(known: {', '.join(version.KNOWN_VERSIONS)})")
            else:
                req = version.highest_requirement(data)
                if req is not None and version.key(req.version) > version.key(cdi_version):
                    self.add("$.cdiVersion", f"cdiVersion {cdi_version} is below {req.version}, "
                                             f"needed for {req.why} at {req.path}")
        kind = data.get("kind")
        if isinstance(kind, str):
            problem = names.kind_problem(kind)
            if problem:
                self.add("$.kind", problem)
        if isinstance(data.get("containerEdits"), Mapping):
            self.edits(data["containerEdits"], "$.containerEdits")
        devices = data.get("devices")
        if isinstance(devices, list):
            if not devices:
                self.add("$.devices", "a spec needs at least one device")
            seen: dict[str, int] = {}
            for i, dev in enumerate(devices):
                if isinstance(dev, Mapping):
                    self.device(dev, f"$.devices[{i}]", i, seen)

    def device(self, dev: Mapping[str, Any], path: str, index: int, seen: dict[str, int]) -> None:
        self.fields(dev, "device", path)
        name = dev.get("name")
        if isinstance(name, str):
            problem = names.device_name_problem(name)
            if problem:
                self.add(f"{path}.name", problem)
            elif name in seen:
                self.add(f"{path}.name", f"duplicate device name {name!r} (also $.devices[{seen[name]}])")
            else:
                seen[name] = index
        edits = dev.get("containerEdits")
        if isinstance(edits, Mapping):
            if not (any(edits.get(k) for k in FIELDS["containerEdits"]) or edits.get("intelRdt") is not None):
                self.add(f"{path}.containerEdits", "a device needs non-empty containerEdits")
            self.edits(edits, f"{path}.containerEdits")

    def env(self, env: Any, path: str) -> None:
        for i, item in enumerate(env if isinstance(env, list) else []):
            if isinstance(item, str) and item.find("=") <= 0:
                self.add(f"{path}[{i}]", f"invalid environment variable {item!r} (expected NAME=value)")
            elif not isinstance(item, str):
                self.add(f"{path}[{i}]", f"environment entry {item!r} is not a string")

    def absolute(self, obj: Mapping[str, Any], key: str, path: str) -> None:
        value = obj.get(key)
        if isinstance(value, str) and not value.startswith("/"):
            self.add(f"{path}.{key}", f"{key} {value!r} must be an absolute path")

    def edits(self, edits: Mapping[str, Any], path: str) -> None:
        self.fields(edits, "containerEdits", path)
        self.env(edits.get("env"), f"{path}.env")
        for i, node in _objects(edits, "deviceNodes"):
            self.node(node, f"{path}.deviceNodes[{i}]")
        for i, mount in _objects(edits, "mounts"):
            p = f"{path}.mounts[{i}]"
            self.fields(mount, "mount", p)
            if mount.get("hostPath") == "":
                self.add(f"{p}.hostPath", "empty hostPath")
            self.absolute(mount, "containerPath", p)
        for i, hook in _objects(edits, "hooks"):
            p = f"{path}.hooks[{i}]"
            self.fields(hook, "hook", p)
            hook_name = hook.get("hookName")
            if isinstance(hook_name, str) and hook_name not in VALID_HOOK_NAMES:
                self.add(f"{p}.hookName", f"invalid hook name {hook_name!r} "
                                          f"(expected one of {', '.join(sorted(VALID_HOOK_NAMES))})")
            self.absolute(hook, "path", p)
            self.env(hook.get("env"), f"{p}.env")
        if isinstance(edits.get("intelRdt"), Mapping):
            self.intel_rdt(edits["intelRdt"], f"{path}.intelRdt")
        self.net_devices(edits, path)

    def node(self, node: Mapping[str, Any], path: str) -> None:
        self.fields(node, "deviceNode", path)
        self.absolute(node, "path", path)
        kind = node.get("type")
        if isinstance(kind, str) and kind and kind not in NODE_TYPES:
            self.add(f"{path}.type", f"invalid device type {kind!r} (expected b, c, u or p)")
        perms = node.get("permissions")
        if isinstance(perms, str) and perms != NO_PERMISSIONS and perms.strip("rwm"):
            self.add(f"{path}.permissions", f"invalid permissions {perms!r} (expected letters from rwm)")
        for key in ("major", "minor"):
            value = node.get(key)
            if isinstance(value, int) and value < 0:
                self.add(f"{path}.{key}", f"negative {key} {value}")
        mode = node.get("fileMode")
        if mode is not None and (not isinstance(mode, int) or isinstance(mode, bool) or mode < 0):
            self.add(f"{path}.fileMode", f"fileMode {mode!r} is not a non-negative integer")

    def intel_rdt(self, rdt: Mapping[str, Any], path: str) -> None:
        self.fields(rdt, "intelRdt", path)
        clos = rdt.get("closID")
        if isinstance(clos, str) and clos != "/" and (
                len(clos) >= 4096 or clos in (".", "..") or "/" in clos or "\n" in clos):
            self.add(f"{path}.closID", f"invalid closID {clos!r}")

    def net_devices(self, edits: Mapping[str, Any], path: str) -> None:
        hosts: set[str] = set()
        names_seen: set[str] = set()
        for i, dev in _objects(edits, "netDevices"):
            p = f"{path}.netDevices[{i}]"
            self.fields(dev, "netDevice", p)
            host, name = dev.get("hostInterfaceName"), dev.get("name")
            if host == "" or name == "":
                self.add(p, "empty hostInterfaceName or name")
            if isinstance(host, str) and host:
                if host in hosts:
                    self.add(f"{p}.hostInterfaceName", f"duplicate hostInterfaceName {host!r}")
                hosts.add(host)
            if isinstance(name, str) and name:
                if name in names_seen:
                    self.add(f"{p}.name", f"duplicate name {name!r}")
                names_seen.add(name)


def _objects(edits: Mapping[str, Any], key: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    items = edits.get(key)
    if isinstance(items, list):
        for i, item in enumerate(items):
            if isinstance(item, Mapping):
                yield i, item


def validate_spec(data: Any, origin: str, *, schema: bool = True) -> list[str]:
    """Every problem with a parsed spec, as "<origin>: <JSON path>: <message>"; empty means it loads.

    `schema=False` keeps only the loader rules: generate-cdi checks its own output that way, since importing and
    running jsonschema would cost more than the rest of generation (the tests hold the generator to the schema).
    """
    checker = _Checker()
    try:
        checker.spec(data)
        found = (schema_problems(data) if schema else []) + checker.problems
    except RecursionError:  # the parser took it, the walk (or jsonschema's, on Python < 3.11) cannot
        return [f"{origin}: $: nested too deeply to be a CDI spec"]
    out: list[str] = []
    for path, message in found:
        line = f"{origin}: {path}: {message}"
        if line not in out:
            out.append(line)
    return out


def validate_file(path: str) -> list[str]:
    """validate_spec for a file, a read or parse failure being one problem at `$`."""
    from gpuhook.cdi import codec
    from gpuhook.cdi.errors import CdiError

    try:
        data = codec.read(path)
    except CdiError as exc:
        return [f"{path}: $: {str(exc).removeprefix(path + ': ')}"]
    except (ValueError, OverflowError, RecursionError) as exc:  # a YAML scalar no value fits (2001-13-01)
        return [f"{path}: $: not valid YAML/JSON: {exc}"]
    return validate_spec(data, path)
