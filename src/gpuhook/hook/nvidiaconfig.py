"""NVIDIA's own config.toml (nvidia-container-toolkit v1.20.0, `api/config/v1`), read as gpuhook's config.

hook/config.py parses the file (the one parser of it); this module only sorts the parsed tables. Every key of
NVIDIA's file either maps to the gpuhook key that has its meaning (`MAPPED`), or has no gpuhook setting
(`UNMAPPED`): a value that asks for what gpuhook does anyway (NVIDIA's default among them) is taken silently,
any other value is ignored and named in one warning, with why. A key NVIDIA's v1.20.0 does not know inside one
of its tables is ignored and named the same way, as NVIDIA's own loader ignores it. Data and one function;
imported only for a file that holds NVIDIA's tables or dotted keys.
"""

from __future__ import annotations

from gpuhook.errors import ConfigError, clip

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# NVIDIA's tables (api/config/v1/config.go's Config): a key inside one of them is NVIDIA's.
TABLES = ("nvidia-container-cli", "nvidia-container-runtime", "nvidia-container-runtime-hook", "nvidia-ctk",
          "features")

# NVIDIA's key (dotted below its table) -> the gpuhook key with the same meaning. The top-level NVIDIA keys
# (accept-nvidia-visible-devices-*, supported-driver-capabilities, disable-require, swarm-resource) are
# gpuhook's own spellings too: hook/config.py's aliases.
MAPPED: dict[str, str] = {
    "nvidia-container-cli.root": "driver-root",  # "" (NVIDIA's default): the host's root
    "nvidia-container-cli.ldconfig": "ldconfig",  # '@' + a host path, as here (checked in expand())
    "nvidia-container-cli.debug": "log-file",  # the hook's log
    "nvidia-container-runtime.runtimes": "runtimes",  # the shim's runtime: the first found, in order
    "nvidia-container-runtime.modes.cdi.annotation-prefixes": "annotation-prefixes",
}

_ANY = None  # every value is taken silently: the setting is moot where gpuhook does the job itself

# NVIDIA's key -> (the values taken silently, or _ANY; why any other value is ignored). The values are NVIDIA's
# defaults (config.go's GetDefault, toml_test.go's default file) and their equivalents here.
UNMAPPED: dict[str, tuple[tuple[Any, ...] | None, str]] = {
    "nvidia-container-cli.path": (_ANY, "gpuhook runs no nvidia-container-cli"),
    "nvidia-container-cli.environment": (([],), "gpuhook runs no nvidia-container-cli to give it an environment"),
    "nvidia-container-cli.load-kmods": (_ANY, "gpuhook loads no kernel modules (doctor names the "
                                              "nvidia-modprobe to run)"),
    "nvidia-container-cli.no-cgroups": ((False,), "gpuhook always allows the devices it injects in the "
                                                  "container's device cgroup"),
    "nvidia-container-cli.user": (("", "root", "root:root", "root:video"),
                                  "gpuhook's hook runs as the runtime's user, root"),
    "nvidia-container-cli.ldcache": (("/etc/ld.so.cache",), "gpuhook reads the driver root's /etc/ld.so.cache"),
    "nvidia-container-cli.no-pivot": ((False,), "gpuhook never pivots into the container"),
    "nvidia-container-runtime.debug": (("", "/dev/null"), "gpuhook-runtime writes its one line per container to "
                                                          "log-file"),
    "nvidia-container-runtime.log-level": (_ANY, "gpuhook logs one line per container at any level"),
    "nvidia-container-runtime.mode": (("auto", "legacy", "cdi"),
                                      "gpuhook-runtime injects every request itself, as NVIDIA's auto mode"),
    "nvidia-container-runtime.modes.cdi.default-kind": (("nvidia.com/gpu",),
                                                        "gpuhook's CDI kind is nvidia.com/gpu"),
    "nvidia-container-runtime.modes.cdi.spec-dirs": ((["/etc/cdi", "/var/run/cdi"],),
                                                     "gpuhook-runtime reads no CDI specs"),
    "nvidia-container-runtime.modes.csv.mount-spec-path": (
        ("/etc/nvidia-container-runtime/host-files-for-container.d",), "gpuhook has no CSV (Tegra) mode"),
    "nvidia-container-runtime.modes.csv.compat-container-root": (("",), "gpuhook has no CSV (Tegra) mode"),
    "nvidia-container-runtime.modes.legacy.cuda-compat-mode": (
        ("", "ldconfig"), "gpuhook puts an image's CUDA compat libraries first in its ld cache (ldconfig)"),
    "nvidia-container-runtime.modes.jit-cdi.nvcdi-feature-flags": (([],), "gpuhook has no jit-cdi mode"),
    "nvidia-container-runtime.modes.jit-cdi.nvcdi-disable-hooks": (([],), "gpuhook has no jit-cdi mode"),
    "nvidia-container-runtime-hook.path": (("nvidia-container-runtime-hook",),
                                           "gpuhook's hook entry is the one `gpuhook hook install` writes"),
    "nvidia-container-runtime-hook.skip-mode-detection": ((False,), "gpuhook's hook decides per container"),
    "nvidia-ctk.path": (("nvidia-ctk",), "gpuhook's CDI specs name gpuhook's own hook"),
    "features.allow-cuda-compat-libs-from-container": ((False,), "gpuhook always honours an image's CUDA "
                                                                 "compat libraries when the driver is older"),
    "features.allow-ldconfig-from-container": ((False,), "gpuhook never runs the image's ldconfig"),
    "features.allow-unknown-oci-spec-fields": ((False,), "gpuhook keeps every field of config.json as it is"),
    "features.disable-cuda-compat-lib-hook": ((False,), "gpuhook has no such hook to disable"),
    "features.disable-imex-channel-creation": ((False,), "gpuhook creates the IMEX channels a container asks for"),
    "features.ignore-imex-channel-requests": ((False,), "gpuhook honours IMEX channel requests"),
    "features.no-additional-gids-for-device-nodes": ((False,), "gpuhook adds no groups for device nodes"),
}


def _flat(prefix: str, table: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every leaf of `table` as (dotted key, value); a table NVIDIA knows as a leaf stays one."""
    items: list[tuple[str, Any]] = []
    for key, value in table.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict) and name not in MAPPED and name not in UNMAPPED:
            items.extend(_flat(name, value))
        else:
            items.append((name, value))
    return items


def _shown(value: object) -> str:
    import json

    return clip(json.dumps(value) if isinstance(value, (bool, list, dict, str)) else str(value), quote=False)


def expand(path: str, data: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`data` with NVIDIA's tables replaced by the gpuhook keys they map to; and what was ignored, one
    `key = value (why)` each, in the file's order. A gpuhook key and the NVIDIA key that maps to it both given,
    with different values, is an error naming both: neither could be chosen silently."""
    out: dict[str, Any] = {}
    ignored: list[str] = []
    nested: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key in TABLES and isinstance(value, dict):
            nested.extend(_flat(key, value))
        else:
            out[key] = value
    for key, value in nested:
        if key in MAPPED:
            target = MAPPED[key]
            if key == "nvidia-container-cli.ldconfig" and not (isinstance(value, str) and value.startswith("@")):
                raise ConfigError(f"{path}: {key} {_shown(value)} is not a host path ('@' first): gpuhook never "
                                  "runs the image's ldconfig")
            if key == "nvidia-container-cli.root" and value == "":
                value = "/"
            if target in out and out[target] != value:
                raise ConfigError(f"{path}: {target} {_shown(out[target])} and {key} {_shown(value)} both set: "
                                  "keep one")
            out[target] = value
            continue
        taken, why = UNMAPPED.get(key, ((), "not a key of NVIDIA's toolkit v1.20.0"))
        if taken is not _ANY and value not in taken:
            ignored.append(f"{key} = {_shown(value)} ({why})")
    return out, tuple(ignored)
