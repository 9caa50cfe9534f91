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

SPECIAL_WORDS = ("void", "none", "all")  # in precedence order: the first one present anywhere in a list wins
JETPACK_REQUIREMENT = f"{REQUIRE_PREFIX}JETPACK"  # a Jetson board requirement, not a driver constraint
TRUE_WORDS = ("1", "t", "T", "TRUE", "true", "True")  # Go's strconv.ParseBool; anything else is false
# Bounds on one request, checked before any per-item work: an image or a pod spec chooses these values, and the
# hook runs on every container start. No real container names thousands of GPUs.
MAX_IDS = 4096
MAX_VALUE_CHARS = 256 * 1024


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

    @property
    def wants_gpu_setup(self) -> bool:
        return self.kind in ("none", "all", "list")


class Policy(Record):
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = False  # NVIDIA's accept-nvidia-visible-devices-as-volume-mounts default
    disable_require: bool = False
    supported_capabilities: frozenset[str] = frozenset(catalogue.CAPABILITIES)


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
    """(kind, device ids). Special words win wherever they stand, void > none > all (NVIDIA's
    internal/config/image/devices.go): `all,void` is void, `all,none` none, `0,all` all. Empty is void."""
    if value is None:
        return "unset", ()
    ids = split_ids(name, value)
    if not ids:
        return "void", ()
    present = set(ids)
    for word in SPECIAL_WORDS:
        if word in present:
            return word, ()
    return "list", tuple(ids)


def parse_capabilities(
    value: str | None, supported: frozenset[str] = frozenset(catalogue.CAPABILITIES)
) -> frozenset[str]:
    """Unset or empty: the defaults the host supports (utility,compute). See `request_capabilities` for the
    legacy-image rule, which needs to know whether the variable is set at all."""
    if value is None or not value.strip():
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
            raise RequestError(f"unknown driver capability {clip(item)} in {DRIVER_CAPABILITIES}={clip(value)}")
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
    """The NVIDIA_REQUIRE_* variables that carry a constraint (JETPACK is not one), sorted."""
    return sorted(k for k, v in env.items() if k.startswith(REQUIRE_PREFIX) and k != JETPACK_REQUIREMENT and v.strip())


def requirements(env: Mapping[str, str], legacy: bool) -> tuple[str, ...]:
    """The NVIDIA_REQUIRE_* constraints (JETPACK excepted), plus a legacy image's implicit cuda>=X.Y."""
    found = [env[key].strip() for key in requirement_keys(env)]
    if legacy:
        found.append(f"cuda>={legacy_cuda_version(env[LEGACY_CUDA_VERSION])}")
    return tuple(found)


def is_legacy_image(env: Mapping[str, str]) -> bool:
    """A CUDA image from before NVIDIA_VISIBLE_DEVICES: CUDA_VERSION non-empty, NVIDIA_REQUIRE_CUDA empty or unset
    (NVIDIA's CUDA.IsLegacy)."""
    return bool(env.get(LEGACY_CUDA_VERSION)) and not env.get(f"{REQUIRE_PREFIX}CUDA")


def volume_mount_devices(mounts: Sequence[Mapping[str, object]]) -> tuple[str, ...]:
    """Device ids from mounts of /dev/null at /var/run/nvidia-container-devices/<id> (the kubelet plugin's form).

    Only a /dev/null source counts, as in NVIDIA's getDevicesFromMounts: any other mount there is the image's or
    the user's own and requests nothing."""
    ids: dict[str, None] = {}
    prefix = VOLUME_MOUNT_DIR + "/"
    for m in mounts:
        dest, source = m.get("destination"), m.get("source")
        if not isinstance(dest, str) or not isinstance(source, str) or posixpath.normpath(source) != "/dev/null":
            continue
        if not dest.startswith(prefix):
            continue
        dev = dest[len(prefix) :].strip("/")
        if dev and "/" not in dev:
            ids[dev] = None
            if len(ids) > MAX_IDS:
                raise RequestError(f"more than {MAX_IDS} device mounts under {VOLUME_MOUNT_DIR}")
    return tuple(ids)


def cdi_annotation_devices(annotations: Mapping[str, object]) -> tuple[str, ...]:
    """Device names from `cdi.k8s.io/*` annotations whose qualified names are of kind nvidia.com/gpu.

    Each value is bounded (split_ids) before its names are looked at, and so is the total."""
    ids: dict[str, None] = {}
    for key in sorted(annotations):
        value = annotations[key]
        if not key.startswith(CDI_ANNOTATION_PREFIX) or not isinstance(value, str):
            continue
        for name in split_ids(f"annotation {clip(key)}", value):
            kind, sep, device = name.partition("=")
            if sep and kind == CDI_KIND and device:
                ids[device] = None
        if len(ids) > MAX_IDS:
            raise RequestError(f"cdi.k8s.io/ annotations name more than {MAX_IDS} devices")
    return tuple(ids)


def _ids_request(ids: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    if "all" in ids:
        return "all", ()
    return "list", ids


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
    kind, ids = parse_visible_devices(env.get(VISIBLE_DEVICES))
    source = "env"
    if kind == "unset" and legacy:
        kind, source = "all", "legacy-image"
    if kind != "unset" and not privileged and not policy.accept_envvar_unprivileged:
        notes.append(f"{VISIBLE_DEVICES} ignored: unprivileged container and accept-envvar-unprivileged is false")
        kind, ids = "unset", ()
    if policy.accept_volume_mounts:
        mounted = volume_mount_devices(mounts)
        if mounted:
            (kind, ids), source = _ids_request(mounted), "volume-mounts"
    annotated = cdi_annotation_devices(annotations or {})
    if annotated:
        (kind, ids), source = _ids_request(annotated), "cdi-annotations"
    if kind in ("unset", "void"):
        return Request(kind=kind, source=source, notes=tuple(notes))
    caps = request_capabilities(env, legacy, policy.supported_capabilities)
    reqs: tuple[str, ...] = ()
    if not (policy.disable_require or is_true(env.get(DISABLE_REQUIRE))):
        reqs = requirements(env, legacy)
    mig_flags = []
    for var in (MIG_CONFIG, MIG_MONITOR):
        mig_kind, _ = parse_visible_devices(env.get(var), var)
        wanted = mig_kind in ("all", "list")
        if wanted and not privileged:
            raise RequestError(f"{var} requires a privileged container (CAP_SYS_ADMIN in the bounding set)")
        mig_flags.append(wanted)
    imex = imex_channel_request(env, mounts, privileged, policy, notes)
    return Request(kind, ids, caps, reqs, mig_flags[0], mig_flags[1], source, tuple(notes), imex, gated_devices(env))


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
    prefix = IMEX_VOLUME_MOUNT_DIR + "/"
    ids: list[str] = []
    for m in mounts:
        dest, source = m.get("destination"), m.get("source")
        if isinstance(dest, str) and dest.startswith(prefix) and source == "/dev/null":
            ids.append(dest[len(prefix):].strip("/"))
            if len(ids) > MAX_IDS:
                raise RequestError(f"more than {MAX_IDS} device mounts under {IMEX_VOLUME_MOUNT_DIR}")
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


def is_privileged(process: Mapping[str, object] | None) -> bool:
    """CAP_SYS_ADMIN in the bounding set: what the NVIDIA toolkit calls a privileged container."""
    caps = (process or {}).get("capabilities")
    if not isinstance(caps, Mapping):
        return False
    bounding = caps.get("bounding")
    return isinstance(bounding, list) and "CAP_SYS_ADMIN" in bounding
