"""What a container asks for, parsed from its OCI config (env, mounts, annotations, capabilities).

Pure functions only: the NVIDIA environment contract of DESIGN.md, turned into a `Request`.
`model/selection.py` then resolves a Request against an Inventory.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence

from gpuhook.errors import RequestError, clip
from gpuhook.model import catalogue
from gpuhook.model.contract import (  # noqa: F401 - re-exported: the contract's names as the parser's
    CDI_ANNOTATION_PREFIX,
    CDI_DEVICES_MARKER,
    CDI_KIND,
    DISABLE_REQUIRE,
    DRIVER_CAPABILITIES,
    ENABLED,
    GATED_DEVICE_ENV,
    IMEX_CHANNELS,
    IMEX_VOLUME_MOUNT_DIR,
    LEGACY_CUDA_VERSION,
    MIG_CONFIG,
    MIG_MONITOR,
    REQUIRE_PREFIX,
    VISIBLE_DEVICES,
    VOLUME_MOUNT_DIR,
)
from gpuhook.model.record import Record, field

SPECIAL_WORDS = ("void", "none", "all")
JETPACK_REQUIREMENT = f"{REQUIRE_PREFIX}JETPACK"  # a prefix: NVIDIA_REQUIRE_JETPACK* are Jetson board settings
TRUE_WORDS = ("1", "t", "T", "TRUE", "true", "True")  # Go's strconv.ParseBool; anything else is false
# Bounds on one request, checked before any per-item work: an image or a pod spec chooses these values, and the
# hook runs on every container start. No real container names thousands of GPUs or constraints.
MAX_IDS = 4096
MAX_VALUE_CHARS = 256 * 1024
MAX_CONDITIONS = 4096  # NVIDIA_REQUIRE_* factors of one container, all variables together
CDI_VOLUME_PREFIX = "cdi/"  # …/nvidia-container-devices/cdi/<vendor>/<class>/<name>: a CDI device by mount
IMEX_VOLUME_PREFIX = "imex/"


class Request(Record):
    """kind: "unset" (not a GPU container), "void" (leave untouched), "none", "all" or "list"."""

    kind: str
    devices: tuple[str, ...] = ()
    capabilities: frozenset[str] = frozenset(catalogue.DEFAULT_CAPABILITIES)
    requirements: tuple[str, ...] = ()
    mig_config: bool = False
    mig_monitor: bool = False
    source: str = "env"  # env, volume-mounts, cdi-annotations, legacy-image
    notes: tuple[str, ...] = field(default=())
    imex_channels: tuple[str, ...] = ()  # channel numbers as decimal text, or ("all",)
    gated: tuple[str, ...] = ()  # contract.GATED_DEVICE_ENV names whose variable is `enabled`
    foreign_cdi: tuple[str, ...] = ()  # CDI names of other kinds in the annotations: the runtime's to inject
    cdi_ignored: tuple[str, ...] = ()  # CDI names Allocate gave that the runtime did not apply (cdi_ignored())
    cdi_marker: str = ""  # with them, the marker as Allocate sealed it (model/cdiignored.sealed_by checks it)

    @property
    def wants_gpu_setup(self) -> bool:
        return self.kind in ("none", "all", "list")


class Policy(Record):
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = False  # NVIDIA's accept-nvidia-visible-devices-as-volume-mounts default
    disable_require: bool = False
    supported_capabilities: frozenset[str] = frozenset(catalogue.CAPABILITIES)
    # NVIDIA's swarm-resource: variables (DOCKER_RESOURCE_GPUS…) that, when present, name the devices instead of
    # NVIDIA_VISIBLE_DEVICES, their lists concatenated.
    swarm_resource: tuple[str, ...] = ()
    annotation_prefixes: tuple[str, ...] = (CDI_ANNOTATION_PREFIX,)  # NVIDIA's modes.cdi.annotation-prefixes


def env_map(env: Iterable[str]) -> dict[str, str]:
    """OCI `process.env` ("K=V" list) to a dict; the last assignment of a key wins, as in execve."""
    out: dict[str, str] = {}
    for item in env:
        if not isinstance(item, str):
            raise RequestError(f"process.env entry {clip(item)} is not a string")
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def split_ids(name: str, value: str) -> list[str]:
    """A comma list's items, trimmed, empty ones dropped, duplicates collapsed (first kept), in linear time.

    Refuses (one line naming `name`) a value over MAX_VALUE_CHARS or with more than MAX_IDS items before looking
    at any item: a list membership test per item made 150,000 ids take minutes."""
    if len(value) > MAX_VALUE_CHARS:
        raise RequestError(f"{name} is {len(value)} characters, more than {MAX_VALUE_CHARS}: {clip(value)}")
    items = [i for i in (i.strip() for i in value.split(",")) if i]
    if len(items) > MAX_IDS:
        raise RequestError(f"{name} names {len(items)} devices, more than {MAX_IDS}: {clip(value)}")
    return list(dict.fromkeys(items))


def parse_visible_devices(value: str | None, name: str = VISIBLE_DEVICES) -> tuple[str, tuple[str, ...]]:
    """(kind, device ids), as NVIDIA's hook reads the list (internal/config/image: devicesFromEnvvars, then
    NewVisibleDevices item by item): `void` anywhere leaves the container alone; otherwise the first of `all` and
    `none` in the list decides (`0,none` and `none,all` are none, `1,all` and `all,none` all). Empty is void."""
    if value is None:
        return "unset", ()
    return _ids_kind(split_ids(name, value))


def _ids_kind(ids: list[str]) -> tuple[str, tuple[str, ...]]:
    if not ids or "void" in ids:
        return "void", ()
    for item in ids:
        if item in ("all", "none"):
            return item, ()
    return "list", tuple(ids)


def visible_devices(env: Mapping[str, str], swarm_resource: Sequence[str] = ()) -> tuple[str, tuple[str, ...]]:
    """The device list the environment asks for: the swarm-resource variables that are present (their items
    concatenated), else NVIDIA_VISIBLE_DEVICES (NVIDIA's visibleEnvVars)."""
    present = [var for var in swarm_resource if var in env]
    if not present:
        return parse_visible_devices(env.get(VISIBLE_DEVICES))
    ids: list[str] = []
    for var in present:
        ids.extend(split_ids(var, env[var]))
        if len(ids) > MAX_IDS:
            raise RequestError(f"{', '.join(present)} name more than {MAX_IDS} devices")
    return _ids_kind(list(dict.fromkeys(ids)))


def parse_capabilities(
    value: str | None, supported: frozenset[str] = frozenset(catalogue.CAPABILITIES)
) -> frozenset[str]:
    """Unset or empty: the defaults the host supports (utility,compute). A value of only blanks and commas names
    no capability and gets none, as NVIDIA's hook (getDriverCapabilities intersects the supported set with the
    empty set it parses). See `request_capabilities` for the legacy-image rule, which needs to know whether the
    variable is set at all."""
    if not value:
        return frozenset(catalogue.DEFAULT_CAPABILITIES) & supported
    if len(value) > MAX_VALUE_CHARS:
        raise RequestError(f"{DRIVER_CAPABILITIES} is {len(value)} characters: {clip(value)}")
    caps: set[str] = set()
    for item in (i.strip() for i in value.split(",")):
        if not item:
            continue
        if item == "all":
            caps.update(supported)
        elif item in catalogue.CAPABILITIES:
            caps.add(item)
        else:
            raise RequestError(f"unknown driver capability {clip(item)} in {DRIVER_CAPABILITIES}={clip(value)} "
                               f"(known: all, {', '.join(sorted(catalogue.CAPABILITIES))})")
    unsupported = caps - supported
    if unsupported:
        raise RequestError(
            f"driver capability {sorted(unsupported)[0]!r} is not supported by this host's configuration"
        )
    return frozenset(caps)


def request_capabilities(env: Mapping[str, str], legacy: bool, supported: frozenset[str]) -> frozenset[str]:
    """A legacy CUDA image without NVIDIA_DRIVER_CAPABILITIES gets every supported capability (NVIDIA's hook,
    getDriverCapabilities: it predates the variable); set, even empty, the variable decides as for any image."""
    if legacy and DRIVER_CAPABILITIES not in env:
        return supported
    return parse_capabilities(env.get(DRIVER_CAPABILITIES), supported)


def is_true(value: str | None) -> bool:
    """Go's strconv.ParseBool, as NVIDIA reads NVIDIA_DISABLE_REQUIRE: an invalid value ("yes") is false."""
    return value in TRUE_WORDS


# golang.org/x/mod/semver.IsValid after a "v" prefix (what NVIDIA's cuda_image.go checks CUDA_VERSION with):
# MAJOR[.MINOR[.PATCH[-prerelease][+build]]], numbers without leading zeros, ASCII only.
_NUM = r"(?:0|[1-9][0-9]*)"
_IDENT = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_SEMVER_RE = (  # text: `re` compiles it at first use (a legacy CUDA image), not at every hook start
    rf"({_NUM})(?:\.({_NUM})(?:\.{_NUM}(?:-{_IDENT}(?:\.{_IDENT})*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?)?)?"
)


def legacy_cuda_version(value: str) -> str:
    """CUDA_VERSION's "major.minor" ("12" is 12.0), as NVIDIA's parseMajorMinorVersion; RequestError if it is not
    a version: the implied cuda>= requirement could not be checked, so the start fails."""
    text = value[1:] if value.startswith("v") else value
    match = re.fullmatch(_SEMVER_RE, text)
    major, minor = (match.group(1), match.group(2) or "0") if match else ("", "")
    if not match or max(len(major), len(minor)) > 10 or int(major) >= 2**32 or int(minor) >= 2**32:
        raise RequestError(f"invalid {LEGACY_CUDA_VERSION} {clip(value)} in a legacy CUDA image: not a version")
    return f"{major}.{minor}"


def requirement_keys(env: Mapping[str, str]) -> list[str]:
    """The NVIDIA_REQUIRE_* variables that carry a constraint, sorted: every name starting with
    NVIDIA_REQUIRE_JETPACK is a Jetson setting, not a constraint (NVIDIA's GetRequirements), and a value of only
    separators asks nothing (dsl.c finds no factor in it)."""
    return sorted(k for k, v in env.items()
                  if k.startswith(REQUIRE_PREFIX) and not k.startswith(JETPACK_REQUIREMENT) and v.strip(" ,"))


def requirements(env: Mapping[str, str], legacy: bool) -> tuple[str, ...]:
    """The NVIDIA_REQUIRE_* constraints, values as written, plus a legacy image's implicit cuda>=X.Y.

    Bounded before anything is split: each value at MAX_VALUE_CHARS, all of them together at MAX_CONDITIONS
    factors (counted in one pass), so the check that follows is linear and small whatever the image says."""
    from gpuhook.model.requirements import count_conditions

    found, total = [], 0
    for key in requirement_keys(env):
        value = env[key]
        if len(value) > MAX_VALUE_CHARS:
            raise RequestError(f"{key} is {len(value)} characters, more than {MAX_VALUE_CHARS}: {clip(value)}")
        total += count_conditions(value)
        if total > MAX_CONDITIONS:
            raise RequestError(f"NVIDIA_REQUIRE_* hold more than {MAX_CONDITIONS} conditions "
                               f"(at {key}={clip(value)})")
        found.append(value)
    if legacy:
        found.append(f"cuda>={legacy_cuda_version(env[LEGACY_CUDA_VERSION])}")
    return tuple(found)


def checked_requirements(env: Mapping[str, str], policy: Policy = Policy()) -> tuple[str, ...]:
    """The constraints a start checks: none under NVIDIA_DISABLE_REQUIRE or disable-require (NVIDIA's
    GetRequirements, which then never reads CUDA_VERSION either)."""
    if policy.disable_require or is_true(env.get(DISABLE_REQUIRE)):
        return ()
    return requirements(env, is_legacy_image(env))


def is_legacy_image(env: Mapping[str, str]) -> bool:
    """A CUDA image from before NVIDIA_VISIBLE_DEVICES: CUDA_VERSION non-empty, NVIDIA_REQUIRE_CUDA empty or unset
    (NVIDIA's CUDA.IsLegacy)."""
    return bool(env.get(LEGACY_CUDA_VERSION)) and not env.get(f"{REQUIRE_PREFIX}CUDA")


def clean_path(path: str) -> str:
    """Go's filepath.Clean, which NVIDIA applies to mount paths: posixpath.normpath, but `//x` is `/x` too."""
    cleaned = posixpath.normpath(path)
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


def _requests_from_mounts(mounts: Sequence[Mapping[str, object]]) -> list[str]:
    """Everything below /var/run/nvidia-container-devices/ that a /dev/null mount names, in order, each cleaned
    destination once (NVIDIA's requestsFromMounts; only a /dev/null source counts: any other mount there is the
    image's or the user's own). The id is the whole path below the folder and may hold `/` (`GPU0-MIG0/0/1`)."""
    seen: dict[str, None] = {}
    out: list[str] = []
    prefix = VOLUME_MOUNT_DIR + "/"
    for m in mounts:
        dest, source = m.get("destination"), m.get("source")
        if not isinstance(dest, str) or not isinstance(source, str) or clean_path(source) != "/dev/null":
            continue
        dest = clean_path(dest)
        if dest in seen or not dest.startswith(prefix):
            continue
        seen[dest] = None
        device = dest[len(prefix):].strip("/")
        if device:
            out.append(device)
            if len(out) > MAX_IDS:
                raise RequestError(f"more than {MAX_IDS} device mounts under {VOLUME_MOUNT_DIR}")
    return out


def cdi_mount_name(request: str) -> str | None:
    """`cdi/<vendor>/<class>/<name>` or `cdi/<vendor>/<class>=<name>` to the qualified CDI name; None if it is
    neither (NVIDIA's cdiDeviceMountRequest, which logs and ignores such a mount)."""
    rest = request[len(CDI_VOLUME_PREFIX):]
    kind, sep, name = rest.partition("=")
    if sep and kind.count("/") == 1 and all(kind.split("/")) and name:
        return rest
    parts = rest.split("/", 2)
    if len(parts) == 3 and all(parts):
        return f"{parts[0]}/{parts[1]}={parts[2]}"
    return None


def volume_mount_devices(mounts: Sequence[Mapping[str, object]], notes: list[str] | None = None) -> tuple[str, ...]:
    """Device ids requested by /dev/null mounts at /var/run/nvidia-container-devices/<id> (the kubelet plugin's
    form; NVIDIA's visibleDevicesFromMounts): `imex/…` are IMEX channels, not devices; `cdi/…` names a CDI
    device, kept as its qualified name (`nvidia.com/gpu=0`) for selection to resolve or refuse."""
    ids: dict[str, None] = {}
    for device in _requests_from_mounts(mounts):
        if device.startswith(IMEX_VOLUME_PREFIX):
            continue
        if device.startswith(CDI_VOLUME_PREFIX):
            name = cdi_mount_name(device)
            if name is None:
                if notes is not None:
                    notes.append(f"ignored the mount request {clip(device)}: not cdi/<vendor>/<class>/<name>")
                continue
            device = name
        ids[device] = None
    return tuple(ids)


def qualified_annotation_name(name: str) -> str:
    """A CDI annotation's device as NVIDIA's runtime reads it: a name without a kind is one of ours
    (`1` is `nvidia.com/gpu=1`, `example.com/device` is `nvidia.com/gpu=example.com/device`)."""
    return name if "=" in name else f"{CDI_KIND}={name}"


def _annotation_names(annotations: Mapping[str, object], prefixes: Sequence[str]) -> dict[str, None]:
    """Every CDI name the annotations under `prefixes` carry (keys sorted, as NVIDIA), qualified, once each.
    Each value is bounded (split_ids) before its names are looked at, and so is the total."""
    names: dict[str, None] = {}
    for key in sorted(annotations):
        value = annotations[key]
        if not prefixes or not key.startswith(tuple(prefixes)) or not isinstance(value, str):
            continue
        for name in split_ids(f"annotation {clip(key)}", value):
            names[qualified_annotation_name(name)] = None
        if len(names) > MAX_IDS:
            raise RequestError(f"{', '.join(prefixes)} annotations name more than {MAX_IDS} devices")
    return names


def cdi_annotation_devices(
    annotations: Mapping[str, object], prefixes: Sequence[str] = (CDI_ANNOTATION_PREFIX,)
) -> tuple[str, ...]:
    """Device names of kind nvidia.com/gpu from the CDI annotations. A name of ours that no device resolves fails
    the start later, in selection: never a container without the GPU it asked for."""
    ids = (n.partition("=") for n in _annotation_names(annotations, prefixes))
    return tuple(device for kind, _, device in ids if kind == CDI_KIND and device)


def foreign_cdi_names(annotations: Mapping[str, object], prefixes: Sequence[str] = (CDI_ANNOTATION_PREFIX,)
                      ) -> tuple[str, ...]:
    """The annotations' CDI names of other kinds: other vendors' devices (or our datacenter kinds), which the
    CDI-aware runtime injects from its spec dirs; gpuhook notes them and leaves them alone."""
    return tuple(n for n in _annotation_names(annotations, prefixes) if n.partition("=")[0] != CDI_KIND)


def cdi_ignored(env: Mapping[str, str]) -> tuple[str, ...]:
    """The CDI names gpuhook's device plugin gave this container (contract.CDI_DEVICES_MARKER) when
    NVIDIA_VISIBLE_DEVICES is still set and not void: their spec sets it to void, so the runtime did not apply
    them (containerd 1.6), and the variable is how the container gets its GPUs. Empty without the marker (no
    plugin, or a list strategy without both CDI and the variable) and where the runtime applied the spec."""
    marker = env.get(CDI_DEVICES_MARKER)
    if not marker or parse_visible_devices(env.get(VISIBLE_DEVICES))[0] in ("unset", "void"):
        return ()
    from gpuhook.model.cdiignored import names_of

    return tuple(split_ids(CDI_DEVICES_MARKER, names_of(marker)))


def _ids_request(ids: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    if "all" in ids:
        return "all", ()
    return "list", ids


def env_devices(env: Mapping[str, str], swarm_resource: Sequence[str] = ()) -> tuple[str, tuple[str, ...], str]:
    """(kind, ids, source) the environment asks for: visible_devices, and a legacy CUDA image that names no
    device asks for all of them (NVIDIA's devicesFromEnvvars)."""
    kind, ids = visible_devices(env, swarm_resource)
    if kind == "unset" and is_legacy_image(env):
        return "all", (), "legacy-image"
    return kind, ids, "env"


def parse_request(
    env_list: Iterable[str],
    mounts: Sequence[Mapping[str, object]] = (),
    annotations: Mapping[str, object] | None = None,
    privileged: bool = False,
    policy: Policy = Policy(),
) -> Request:
    """A container's GPU request. Raises RequestError (one line) for a request that must fail the start."""
    env = env_map(env_list)
    notes: list[str] = []
    legacy = is_legacy_image(env)
    kind, ids, source = env_devices(env, policy.swarm_resource)
    if kind != "unset" and not privileged and not policy.accept_envvar_unprivileged:
        notes.append(f"{VISIBLE_DEVICES} ignored: unprivileged container and accept-envvar-unprivileged is false")
        kind, ids = "unset", ()
    if policy.accept_volume_mounts:
        mounted = volume_mount_devices(mounts, notes)
        if mounted:
            (kind, ids), source = _ids_request(mounted), "volume-mounts"
    annotated = cdi_annotation_devices(annotations or {}, policy.annotation_prefixes)
    if annotated:
        (kind, ids), source = _ids_request(annotated), "cdi-annotations"
    foreign = foreign_cdi_names(annotations or {}, policy.annotation_prefixes)
    if foreign:
        notes.append(f"CDI devices of other kinds left to the runtime: {clip(','.join(foreign), quote=False)}")
    ignored = cdi_ignored(env)
    marker = env.get(CDI_DEVICES_MARKER, "") if ignored else ""
    if kind in ("unset", "void"):
        return Request(kind=kind, source=source, notes=tuple(notes), foreign_cdi=foreign, cdi_ignored=ignored,
                       cdi_marker=marker)
    caps = request_capabilities(env, legacy, policy.supported_capabilities)
    reqs = checked_requirements(env, policy)
    mig_flags = []
    for var in (MIG_CONFIG, MIG_MONITOR):
        mig_kind, _ = parse_visible_devices(env.get(var), var)
        wanted = mig_kind in ("all", "list")
        if wanted and not privileged:
            raise RequestError(f"{var} requires a privileged container (CAP_SYS_ADMIN in the bounding set)")
        mig_flags.append(wanted)
    imex = imex_channel_request(env, mounts, privileged, policy, notes)
    gated = gated_devices(env)
    if gated and not privileged and not policy.accept_envvar_unprivileged:
        # Beyond NVIDIA (gated.go honours these whatever the policy): the policy exists so that an image cannot
        # widen its device set, and these add every host nvidia-fs, InfiniBand and gdrdrv node.
        names = ",".join(GATED_DEVICE_ENV[g] for g in gated)
        notes.append(f"{names} ignored: unprivileged container and accept-envvar-unprivileged is false")
        gated = ()
    return Request(kind, ids, caps, reqs, mig_flags[0], mig_flags[1], source, tuple(notes), imex, gated, foreign,
                   ignored, marker)


def imex_channel_id(text: str, origin: str) -> str:
    """One IMEX channel as written (`3` or `channel3`) to its number as decimal text; bad ids fail, naming them."""
    digits = text[len(catalogue.IMEX_CHANNEL_PREFIX):] if text.startswith(catalogue.IMEX_CHANNEL_PREFIX) else text
    if digits.isascii() and digits.isdigit() and len(digits) <= 8 and int(digits) <= catalogue.IMEX_CHANNEL_MAX:
        return str(int(digits))
    raise RequestError(f"invalid IMEX channel {clip(text)} in {origin} "
                       f"(expected 0..{catalogue.IMEX_CHANNEL_MAX}, channel<N> or all)")


def imex_channel_ids(items: Iterable[str], origin: str) -> tuple[str, ...]:
    """Channel numbers, duplicates collapsed (in linear time); `all` anywhere in the list means every channel the
    host has."""
    out: dict[str, None] = {}
    for item in (i.strip() for i in items):
        if item == "all":
            return ("all",)
        if item:
            out[imex_channel_id(item, origin)] = None
    return tuple(out)


def imex_volume_mounts(mounts: Sequence[Mapping[str, object]]) -> tuple[str, ...]:
    """Channel ids from /dev/null mounts at /var/run/nvidia-container-devices/imex/<id> (NVIDIA's imex/ form)."""
    ids = [d[len(IMEX_VOLUME_PREFIX):] for d in _requests_from_mounts(mounts) if d.startswith(IMEX_VOLUME_PREFIX)]
    return imex_channel_ids(ids, f"a volume mount under {IMEX_VOLUME_MOUNT_DIR}")


def imex_channel_request(
    env: Mapping[str, str],
    mounts: Sequence[Mapping[str, object]],
    privileged: bool,
    policy: Policy,
    notes: list[str],
) -> tuple[str, ...]:
    """NVIDIA's ImexChannelRequests: accepted volume mounts win, then NVIDIA_IMEX_CHANNELS, which an unprivileged
    container may only use under accept-envvar-unprivileged (else it is ignored with a note)."""
    if policy.accept_volume_mounts:
        mounted = imex_volume_mounts(mounts)
        if mounted:
            return mounted
    value = env.get(IMEX_CHANNELS)
    if value is None or not value.strip():
        return ()
    if not privileged and not policy.accept_envvar_unprivileged:
        notes.append(f"{IMEX_CHANNELS} ignored: unprivileged container and accept-envvar-unprivileged is false")
        return ()
    return imex_channel_ids(split_ids(IMEX_CHANNELS, value), IMEX_CHANNELS)


def gated_devices(env: Mapping[str, str]) -> tuple[str, ...]:
    """The gated device families asked for: each variable exactly `enabled` (NVIDIA compares the same way)."""
    return tuple(name for name, var in GATED_DEVICE_ENV.items() if env.get(var) == ENABLED)


def is_privileged(process: Mapping[str, object] | None, oci_version: str = "") -> bool:
    """CAP_SYS_ADMIN in the bounding set: what the NVIDIA toolkit calls a privileged container. Specs of
    ociVersion 1.0.0-rc1 up to (not including) rc5 carry `process.capabilities` as one flat list, read as such
    (NVIDIA's hook, Spec.GetCapabilities)."""
    caps = (process or {}).get("capabilities")
    if isinstance(caps, list) and _flat_capabilities(oci_version):
        return "CAP_SYS_ADMIN" in caps
    if not isinstance(caps, Mapping):
        return False
    bounding = caps.get("bounding")
    return isinstance(bounding, list) and "CAP_SYS_ADMIN" in bounding


def _prerelease_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Semver's prerelease order: dot-separated identifiers, numeric ones before and below alphanumeric ones."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in text.split("."))


def _flat_capabilities(version: str) -> bool:
    """rc1 <= ociVersion < rc5 by semver's order (so `1.0.0-rc2-dev` is flat, `1.0.0` and an invalid one not)."""
    core, sep, pre = version.partition("-")
    pre = pre.partition("+")[0]
    if core != "1.0.0" or not sep or not pre or not re.fullmatch(_IDENT + r"(?:\." + _IDENT + ")*", pre):
        return False
    return _prerelease_key("rc1") <= _prerelease_key(pre) < _prerelease_key("rc5")
