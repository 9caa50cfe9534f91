"""NVIDIA k8s-device-plugin's config file (`--config-file`, `CONFIG_FILE`; api/config/v1 of v0.20), read once.

Clusters moving from NVIDIA's plugin keep their ConfigMap: the same file has to mean the same thing here. The
structure (which keys exist, their JSON types) is `schemas/nvidia-device-plugin-config-v1.json`; an unknown key
is an error naming it (NVIDIA's loader silently drops it, which hides a typo like `renameByDefualt`). What the
schema cannot say is checked here as NVIDIA's UnmarshalJSON methods do: `version` v1, resource names,
`replicas >= 2`, `devices` as `all`, a count or a list of indices/UUIDs, the enums. Then v0.20's
DisableResourceNamingInConfig is applied with its warnings: `resources` is ignored, a `rename` other than the
default `<name>.shared` and a `devices` other than `all` are reset. Keys gpuhook cannot honour (MPS, IMEX
channels, CDI annotation prefixes, the packed policy) are an error when set, never a
silent difference; GFD's own section (`flags.gfd`) is checked and ignored, as NVIDIA's plugin ignores it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

from gpuhook.errors import ConfigError, clip
from gpuhook.model.contract import CDI_ANNOTATION_PREFIX
from gpuhook.model.record import Record, replace
from gpuhook.plugin.devices import (
    ID_STRATEGIES,
    LIST_STRATEGIES,
    MIG_STRATEGIES,
    SharedResource,
)

VERSION = "v1"
RESOURCE_PREFIX = "nvidia.com"
SHARED_SUFFIX = ".shared"  # NVIDIA's DefaultSharedResourceNameSuffix
MAX_RESOURCE_NAME = 63
DISCOVERY = ("auto", "nvml")  # NVIDIA's deviceDiscoveryStrategy values gpuhook's --discovery has too
GATED_ENV = {"gdrcopyEnabled": "NVIDIA_GDRCOPY", "gdsEnabled": "NVIDIA_GDS", "mofedEnabled": "NVIDIA_MOFED"}
SCHEMA_FILE = "nvidia-device-plugin-config-v1.json"

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_HEX_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_UUID = re.compile(rf"^(?:[uU][rR][nN]:[uU][uU][iI][dD]:{_HEX_UUID}|\{{{_HEX_UUID}\}}|{_HEX_UUID}|[0-9a-fA-F]{{32}})$")
_GO_DURATION = re.compile(r"^[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+$|^0$")


class Sharing(Record):
    """sharing.timeSlicing after v0.20's renaming rules: one entry per replicated resource."""

    resources: tuple[SharedResource, ...]
    fail_requests_greater_than_one: bool = False


class FileConfig(Record):
    """What the file sets, in gpuhook's terms; None: not set there (a flag, the environment or the default
    decides). `warnings` are NVIDIA's own warnings for what v0.20 ignores, logged by the caller."""

    mig_strategy: str | None = None
    fail_on_init_error: bool | None = None
    host_driver_root: str | None = None  # NVIDIA's nvidiaDriverRoot: the driver root as the runtime sees it
    host_dev_root: str | None = None  # NVIDIA's nvidiaDevRoot: the /dev root as the runtime sees it
    driver_root: str | None = None  # NVIDIA's plugin.containerDriverRoot: where this process reads it
    discovery: str | None = None
    pass_device_specs: bool | None = None
    list_strategies: tuple[str, ...] | None = None
    id_strategy: str | None = None
    gated_env: tuple[str, ...] = ()
    sharing: Sharing | None = None
    warnings: tuple[str, ...] = ()

    def options_fields(self) -> dict[str, Any]:
        """The plugin Options only the file sets (no flag carries them): time-slicing and the gated variables."""
        sharing = self.sharing
        return {"shared": sharing.resources if sharing else (),
                "fail_requests_greater_than_one": bool(sharing and sharing.fail_requests_greater_than_one),
                "gated_env": self.gated_env}


def load(path: str) -> FileConfig:
    """Read and check `path` (YAML or JSON). Raises ConfigError (one line naming the file and the key)."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20)
    except OSError as exc:
        raise ConfigError(f"config file {clip(path, quote=False)}: {exc.strerror or exc}") from None
    return parse(text, path)


def parse(text: str | bytes, source: str = "config file") -> FileConfig:
    """The file's content as a FileConfig. Raises ConfigError `<source>: <key path>: <problem>`."""
    import yaml

    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        why = clip(" ".join(str(exc).split()), quote=False)
        raise ConfigError(f"{clip(source, quote=False)}: not YAML or JSON: {why}") from None
    if data is None:
        data = {}  # an empty file: every default (as NVIDIA)
    try:
        lenient = _check_structure(data)
        read = _interpret(data)
    except _Bad as bad:
        raise ConfigError(f"{clip(source, quote=False)}: {bad.where}: {bad.problem}") from None
    return replace(read, warnings=(*lenient, *read.warnings)) if lenient else read


class _Bad(Exception):
    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where or "(top level)"
        self.problem = problem


def _schema() -> dict[str, Any]:
    return json.loads(resources.files("gpuhook").joinpath("schemas", SCHEMA_FILE).read_text(encoding="utf-8"))


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# Sections whose unknown keys are a warning, not an error: NVIDIA's plugin ignores them, and a newer chart (or
# NVIDIA's config-manager) may set keys of a later plugin release there. Anywhere else an unknown key is a typo.
LENIENT_SECTIONS = ("flags.plugin",)


def _check_structure(data: Any) -> list[str]:
    """The schema's verdict, as one line: unknown keys named, else the first type error with its key path. Unknown
    keys of a LENIENT_SECTIONS section are returned as warnings (the file is read without them)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: (list(e.absolute_path), e.validator != "required"))
    warnings = []
    for err in errors:
        where = _path(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = set(err.schema.get("properties", {}))
            unknown = sorted(str(k) for k in err.instance if k not in known)
            names = ", ".join(clip(f"{where}.{k}" if where else k, quote=False) for k in unknown)
            if where in LENIENT_SECTIONS:
                warnings.append(f"unknown key{'s' if len(unknown) > 1 else ''} {names} ignored (not in NVIDIA's "
                                "v1 schema; NVIDIA's plugin ignores it too)")
                continue
            raise _Bad(where, f"unknown key{'s' if len(unknown) > 1 else ''} {names} (not in NVIDIA's v1 schema)")
    errors = [e for e in errors if not (e.validator == "additionalProperties" and _path(e.absolute_path)
                                        in LENIENT_SECTIONS)]
    if errors:
        err = errors[0]
        if err.validator == "required":
            raise _Bad(_path(err.absolute_path), clip(err.message, quote=False))
        raise _Bad(_path(err.absolute_path), f"{clip(err.instance)} is not {_expected(err)}")
    return warnings


def _expected(err: Any) -> str:
    if err.validator == "type":
        kinds = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        text = " or ".join(k for k in kinds if k != "null")
        return ("an " if text[0] in "aeiou" else "a ") + text
    if err.validator == "minItems":
        return "a non-empty list"
    return clip(err.message, quote=False)


def _choice(value: str, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise _Bad(where, f"{clip(value)} is not one of {', '.join(allowed)}")
    return value


def resource_name(value: str, where: str) -> str:
    """NVIDIA's NewResourceName: `nvidia.com/` is prefixed when missing; at most 63 characters; the part after
    the prefix must be a DNS subdomain (lower case)."""
    name = value if value.startswith(RESOURCE_PREFIX + "/") else f"{RESOURCE_PREFIX}/{value}"
    if len(name) > MAX_RESOURCE_NAME:
        raise _Bad(where, f"resource name {clip(name)} is longer than {MAX_RESOURCE_NAME} characters")
    local = name.split("/", 1)[1]
    if len(local) > 253 or not _DNS_SUBDOMAIN.match(local):
        raise _Bad(where, f"resource name {clip(name)}: {clip(local)} is not a DNS subdomain (lower case "
                          "letters, digits, '-' and '.')")
    return name


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _is_uuid(text: str) -> bool:
    """The forms Go's github.com/google/uuid Parse takes: 8-4-4-4-12 hex, in braces or after `urn:uuid:`, or
    32 hex digits."""
    return bool(_UUID.match(text))


def device_ref(item: Any, where: str) -> str:
    """One entry of a `devices` list, as NVIDIA's ReplicatedDeviceRef: a GPU index (number or string), a MIG
    index `<gpu>:<mig>`, a GPU UUID `GPU-<uuid>`, a MIG UUID `MIG-<uuid>` or `MIG-GPU-<uuid>/<gi>/<ci>`."""
    if type(item) is int and item >= 0:
        return str(item)
    if isinstance(item, str):
        gpu, colon, mig = item.partition(":")
        if _is_index(item) or (colon and _is_index(gpu) and _is_index(mig)):
            return item
        if item.startswith("GPU-") and _is_uuid(item[4:]):
            return item
        if item.startswith("MIG-"):
            rest = item[4:]
            parts = rest.split("/")
            if _is_uuid(rest) or (len(parts) == 3 and parts[0].startswith("GPU-") and _is_uuid(parts[0][4:])
                                  and _is_index(parts[1]) and _is_index(parts[2])):
                return item
    raise _Bad(where, f"{clip(item)} is not a GPU index, MIG index (<gpu>:<mig>) or GPU/MIG UUID")


def _devices(value: Any, where: str) -> str | int | tuple[str, ...]:
    """`devices`: "all", a count > 0, or a list of device references (NVIDIA's ReplicatedDevices)."""
    if isinstance(value, str):
        if value != "all":
            raise _Bad(where, f"{clip(value)}: the only string allowed is 'all'")
        return "all"
    if type(value) is int:
        if value <= 0:
            raise _Bad(where, f"a count of devices must be > 0, not {value}")
        return value
    if isinstance(value, list):
        return tuple(device_ref(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise _Bad(where, f"{clip(value)} is not 'all', a count or a list of devices")


def _replicated(section: Mapping[str, Any], where: str, warnings: list[str]) -> Sharing:
    """NVIDIA's ReplicatedResources/ReplicatedResource rules, then v0.20's disableResoureRenaming."""
    rename_default = bool(section.get("renameByDefault", False))
    seen: set[str] = set()
    out: list[SharedResource] = []
    odd_rename = odd_devices = False
    for i, entry in enumerate(section["resources"]):
        at = f"{where}.resources[{i}]"
        name = resource_name(entry["name"], f"{at}.name")
        if name in seen:
            raise _Bad(f"{at}.name", f"{clip(name)} is listed twice")
        seen.add(name)
        replicas = entry["replicas"]
        if type(replicas) is not int or replicas < 2:
            raise _Bad(f"{at}.replicas", f"the number of replicas must be >= 2, not {clip(replicas)}")
        rename = resource_name(entry["rename"], f"{at}.rename") if entry.get("rename") else ""
        devices = _devices(entry.get("devices", "all"), f"{at}.devices")
        default = name + SHARED_SUFFIX
        if rename_default and not rename:
            rename = default
        # v0.20 (DisableResourceNamingInConfig): only the default rename and all devices are honoured.
        if (rename_default and rename != default) or (not rename_default and rename):
            odd_rename = True
        rename = default if rename_default else ""
        odd_devices = odd_devices or devices != "all"
        out.append(SharedResource(name=name, replicas=replicas, rename=rename))
    kind = where.rsplit(".", 1)[-1]
    if odd_rename:
        warnings.append(f"Setting the 'rename' field in sharing.{kind}.resources is not yet supported in the "
                        "config. Ignoring...")
    if odd_devices:
        warnings.append(f"Customizing the 'devices' field in sharing.{kind}.resources is not yet supported in "
                        "the config. Ignoring...")
    return Sharing(tuple(out), bool(section.get("failRequestsGreaterThanOne", False)))


def _unsupported(where: str, value: Any, why: str) -> None:
    raise _Bad(where, f"{clip(value)}: {why}")


def _flags(flags: Mapping[str, Any], out: dict[str, Any], warnings: list[str]) -> None:
    if flags.get("migStrategy") is not None:
        out["mig_strategy"] = _choice(flags["migStrategy"], MIG_STRATEGIES, "flags.migStrategy")
    if flags.get("failOnInitError") is not None:
        out["fail_on_init_error"] = flags["failOnInitError"]
    if flags.get("nvidiaDriverRoot"):
        out["host_driver_root"] = flags["nvidiaDriverRoot"]
    if flags.get("nvidiaDevRoot"):
        out["host_dev_root"] = flags["nvidiaDevRoot"]
    if flags.get("mpsRoot"):
        _unsupported("flags.mpsRoot", flags["mpsRoot"], "MPS is not supported by gpuhook's device plugin")
    out["gated_env"] = tuple(env for key, env in GATED_ENV.items() if flags.get(key))
    strategy = flags.get("deviceDiscoveryStrategy")
    if strategy is not None:
        if strategy not in DISCOVERY:
            _unsupported("flags.deviceDiscoveryStrategy", strategy, f"gpuhook discovers with {', '.join(DISCOVERY)}")
        out["discovery"] = strategy
    plugin = flags.get("plugin") or {}
    if plugin.get("passDeviceSpecs") is not None:
        out["pass_device_specs"] = plugin["passDeviceSpecs"]
    listed = plugin.get("deviceListStrategy")
    if listed is not None:
        items = [listed] if isinstance(listed, str) else list(listed)
        out["list_strategies"] = tuple(dict.fromkeys(
            _choice(s, LIST_STRATEGIES, f"flags.plugin.deviceListStrategy[{i}]") for i, s in enumerate(items)))
        if not out["list_strategies"]:
            raise _Bad("flags.plugin.deviceListStrategy", "the list is empty")
    if plugin.get("deviceIDStrategy") is not None:
        out["id_strategy"] = _choice(plugin["deviceIDStrategy"], ID_STRATEGIES, "flags.plugin.deviceIDStrategy")
    if plugin.get("containerDriverRoot"):
        out["driver_root"] = plugin["containerDriverRoot"]
    prefix = plugin.get("cdiAnnotationPrefix")
    if prefix and prefix != CDI_ANNOTATION_PREFIX:
        _unsupported("flags.plugin.cdiAnnotationPrefix", prefix, f"gpuhook uses {CDI_ANNOTATION_PREFIX}")
    policy = plugin.get("sharedDevicesAllocationPolicy")
    if policy is not None and policy != "distributed":
        if policy != "packed":
            raise _Bad("flags.plugin.sharedDevicesAllocationPolicy", f"{clip(policy)} is not one of distributed, "
                                                                     "packed")
        _unsupported("flags.plugin.sharedDevicesAllocationPolicy", policy,
                     "gpuhook spreads replicas over GPUs (distributed) only")
    if plugin.get("nvidiaCTKPath"):
        warnings.append("flags.plugin.nvidiaCTKPath ignored: the CDI spec's hooks call gpuhook (--hook-path)")
    interval = (flags.get("gfd") or {}).get("sleepInterval")
    if isinstance(interval, str) and interval != "infinite" and not _GO_DURATION.match(interval):
        raise _Bad("flags.gfd.sleepInterval", f"{clip(interval)} is not a duration (e.g. 60s) or 'infinite'")


def _interpret(data: Mapping[str, Any]) -> FileConfig:
    version = data.get("version") or VERSION
    if version != VERSION:
        raise _Bad("version", f"unknown version {clip(str(version))} (expected {VERSION})")
    out: dict[str, Any] = {}
    warnings: list[str] = []
    _flags(data.get("flags") or {}, out, warnings)
    res = data.get("resources") or {}
    for kind in ("gpus", "mig"):
        for i, entry in enumerate(res.get(kind) or []):
            resource_name(entry["name"], f"resources.{kind}[{i}].name")
    if res.get("gpus") or res.get("mig"):
        warnings.append("Customizing the 'resources' field is not yet supported in the config. Ignoring...")
    sharing = data.get("sharing") or {}
    if "mps" in sharing and sharing["mps"] is not None:
        _unsupported("sharing.mps", "mps", "MPS is not supported by gpuhook's device plugin (use timeSlicing)")
    if "timeSlicing" in sharing:
        out["sharing"] = _replicated(sharing["timeSlicing"], "sharing.timeSlicing", warnings)
    imex = data.get("imex") or {}
    if imex.get("channelIDs") or imex.get("required"):
        _unsupported("imex", imex, "IMEX channels are not given by gpuhook's device plugin (use NVIDIA_IMEX_CHANNELS "
                                   "or generate-cdi --mode imex)")
    return FileConfig(**out, warnings=tuple(warnings))
