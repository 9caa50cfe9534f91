"""What a container asks for, parsed from its OCI config (env, mounts, annotations, capabilities).

Pure functions only: the NVIDIA environment contract of DESIGN.md, turned into a `Request`.
`select.py` then resolves a Request against an Inventory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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

SPECIAL_WORDS = ("all", "none", "void")
JETPACK_REQUIREMENT = f"{REQUIRE_PREFIX}JETPACK"  # a Jetson board requirement, not a driver constraint
TRUE_WORDS = ("1", "true", "yes", "on", "y", "t")


@dataclass(frozen=True)
class Request:
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


@dataclass(frozen=True)
class Policy:
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = True
    disable_require: bool = False
    supported_capabilities: frozenset[str] = frozenset(catalogue.CAPABILITIES)


def env_map(env: Iterable[str]) -> dict[str, str]:
    """OCI `process.env` ("K=V" list) to a dict; the last assignment of a key wins, as in execve."""
    out: dict[str, str] = {}
    for item in env:
        if not isinstance(item, str):
            raise RequestError(f"process.env entry {item!r} is not a string")
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def parse_visible_devices(value: str | None) -> tuple[str, tuple[str, ...]]:
    """(kind, device ids). The first special word in list order wins; duplicates collapse."""
    if value is None:
        return "unset", ()
    items = [i.strip() for i in value.split(",")]
    items = [i for i in items if i]
    if not items:
        return "void", ()
    ids: list[str] = []
    for item in items:
        if item in SPECIAL_WORDS:
            return item, ()
        if item not in ids:
            ids.append(item)
    return "list", tuple(ids)


def parse_capabilities(
    value: str | None, supported: frozenset[str] = frozenset(catalogue.CAPABILITIES)
) -> frozenset[str]:
    if value is None or not value.strip():
        return frozenset(catalogue.DEFAULT_CAPABILITIES)
    caps: set[str] = set()
    for item in (i.strip() for i in value.split(",")):
        if not item:
            continue
        if item == "all":
            caps.update(supported)
        elif item in catalogue.CAPABILITIES:
            caps.add(item)
        else:
            raise RequestError(f"unknown driver capability {item!r} in {DRIVER_CAPABILITIES}={value!r}")
    unsupported = caps - supported
    if unsupported:
        raise RequestError(
            f"driver capability {sorted(unsupported)[0]!r} is not supported by this host's configuration"
        )
    return frozenset(caps)


def is_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in TRUE_WORDS


_CUDA_VERSION_RE = re.compile(r"^(\d+)\.(\d+)")


def requirement_keys(env: Mapping[str, str]) -> list[str]:
    """The NVIDIA_REQUIRE_* variables that carry a constraint (JETPACK is not one), sorted."""
    return sorted(k for k, v in env.items() if k.startswith(REQUIRE_PREFIX) and k != JETPACK_REQUIREMENT and v.strip())


def requirements(env: Mapping[str, str], legacy: bool) -> tuple[str, ...]:
    """The NVIDIA_REQUIRE_* constraints (JETPACK excepted), plus a legacy image's implicit cuda>=X.Y."""
    found = [env[key].strip() for key in requirement_keys(env)]
    if legacy:
        match = _CUDA_VERSION_RE.match(env.get(LEGACY_CUDA_VERSION, ""))
        if match:
            found.append(f"cuda>={match.group(1)}.{match.group(2)}")
    return tuple(found)


def is_legacy_image(env: Mapping[str, str]) -> bool:
    """A CUDA image from before NVIDIA_VISIBLE_DEVICES: CUDA_VERSION set, no NVIDIA_REQUIRE_CUDA."""
    return LEGACY_CUDA_VERSION in env and f"{REQUIRE_PREFIX}CUDA" not in env


def volume_mount_devices(mounts: Sequence[Mapping[str, object]]) -> tuple[str, ...]:
    """Device ids from /dev/null mounts at /var/run/nvidia-container-devices/<id> (the kubelet plugin's form)."""
    ids: list[str] = []
    prefix = VOLUME_MOUNT_DIR + "/"
    for m in mounts:
        dest = m.get("destination")
        if not isinstance(dest, str) or not dest.startswith(prefix):
            continue
        dev = dest[len(prefix) :].strip("/")
        if dev and "/" not in dev and dev not in ids:
            ids.append(dev)
    return tuple(ids)


def cdi_annotation_devices(annotations: Mapping[str, object]) -> tuple[str, ...]:
    """Device names from `cdi.k8s.io/*` annotations whose qualified names are of kind nvidia.com/gpu."""
    ids: list[str] = []
    for key in sorted(annotations):
        value = annotations[key]
        if not key.startswith(CDI_ANNOTATION_PREFIX) or not isinstance(value, str):
            continue
        for name in (n.strip() for n in value.split(",")):
            kind, sep, device = name.partition("=")
            if sep and kind == CDI_KIND and device and device not in ids:
                ids.append(device)
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
    caps = parse_capabilities(env.get(DRIVER_CAPABILITIES), policy.supported_capabilities)
    reqs: tuple[str, ...] = ()
    if not (policy.disable_require or is_true(env.get(DISABLE_REQUIRE))):
        reqs = requirements(env, legacy)
    mig_flags = []
    for var in (MIG_CONFIG, MIG_MONITOR):
        mig_kind, _ = parse_visible_devices(env.get(var))
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
    """Channel numbers, duplicates collapsed; `all` anywhere in the list means every channel the host has."""
    out: list[str] = []
    for item in (i.strip() for i in items):
        if item == "all":
            return ("all",)
        if item:
            channel = imex_channel_id(item, origin)
            if channel not in out:
                out.append(channel)
    return tuple(out)


def imex_volume_mounts(mounts: Sequence[Mapping[str, object]]) -> tuple[str, ...]:
    """Channel ids from /dev/null mounts at /var/run/nvidia-container-devices/imex/<id> (NVIDIA's imex/ form)."""
    prefix = IMEX_VOLUME_MOUNT_DIR + "/"
    ids: list[str] = []
    for m in mounts:
        dest, source = m.get("destination"), m.get("source")
        if isinstance(dest, str) and dest.startswith(prefix) and source == "/dev/null":
            ids.append(dest[len(prefix):].strip("/"))
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
    return imex_channel_ids(value.split(","), IMEX_CHANNELS)


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
