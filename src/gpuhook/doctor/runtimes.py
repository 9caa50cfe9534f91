"""Each installed runtime's way to GPUs: CDI (enabled, reading a current spec), the prestart hook, or the shim.

A runtime is fine when at least one way works; otherwise the finding names the one `gpuhook` command that sets
one up (`gpuhook runtime configure …` or `gpuhook generate-cdi …`). Config locations and names are
`gpuhook.runtimeconfig`'s where that module is installed, so doctor checks what `runtime configure` writes.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from gpuhook.cdi import version as cdi_version
from gpuhook.cdi.registry import DEFAULT_SPEC_DIRS
from gpuhook.doctor.daemons import Daemon, running_daemons
from gpuhook.doctor.model import INFO, OK, PROBLEM, WARN, Finding
from gpuhook.doctor.specs import SpecStatus
from gpuhook.errors import GpuhookError
from gpuhook.fileio.atomic import read_regular
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.model import cdiignored, record
from gpuhook.model.contract import CDI_IGNORED_RECORD, HOOK_PATH, PLUGIN_CDI_KIND
from gpuhook.model.record import Record
from gpuhook.shim.runtime import has_gpuhook_hook

try:  # another front door's constants, when it is there (it is optional for doctor)
    from gpuhook.runtimeconfig import runtimes as _rc

    CONTAINERD_CONFIG: str = _rc.CONTAINERD_CONFIG
    CRIO_CONFIG: str = _rc.CRIO_CONFIG
    DOCKER_CONFIG: str = _rc.DOCKER_CONFIG
    PODMAN_CONFIG: str = _rc.PODMAN_CONFIG
    PODMAN_VENDOR_CONFIG: str = _rc.PODMAN_VENDOR_CONFIG
    HOOKS_DIRS: tuple[str, ...] = (_rc.BUILTIN_HOOKS_DIR, _rc.DEFAULT_HOOKS_DIR)
except ImportError:  # pragma: no cover
    CONTAINERD_CONFIG = "/etc/containerd/config.toml"
    CRIO_CONFIG = "/etc/crio/crio.conf"
    DOCKER_CONFIG = "/etc/docker/daemon.json"
    PODMAN_CONFIG = "/etc/containers/containers.conf"
    PODMAN_VENDOR_CONFIG = "/usr/share/containers/containers.conf"
    HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d")

RUNTIMES = ("runc", "podman", "containerd", "crio", "docker")
# runtime -> the Paths field of its one config file
CONFIG_FIELDS = {"containerd": "containerd_config", "crio": "crio_config", "docker": "docker_config"}
BINARIES = {"runc": "runc", "podman": "podman", "containerd": "containerd", "crio": "crio", "docker": "dockerd"}
# The first release of each runtime that reads CDI specs (Docker: features.cdi; containerd: enable_cdi).
CDI_SINCE = {"docker": (25,), "containerd": (1, 7)}
SHIM = "gpuhook-runtime"
CONTAINERD_CRI = {1: ("plugins", "cri"), 2: ("plugins", "io.containerd.grpc.v1.cri"),
                  3: ("plugins", "io.containerd.cri.v1.runtime")}
PODMAN_MAX_CDI = {(4, 3): "0.5.0"}  # podman 4.3 vendors CDI 0.5.x: it drops specs claiming a later version
Version = tuple[int, ...]


class Paths(Record):
    """Where each runtime keeps its configuration (tests point these into a temporary directory);
    `generate_flags`: the root options a `gpuhook generate-cdi` fix needs on this host."""

    generate_flags: str = ""
    spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS  # where a runtime left at its defaults reads CDI specs
    containerd_config: str = CONTAINERD_CONFIG
    crio_config: str = CRIO_CONFIG
    docker_config: str = DOCKER_CONFIG
    podman_configs: tuple[str, ...] = (PODMAN_VENDOR_CONFIG, PODMAN_CONFIG)
    hooks_dirs: tuple[str, ...] = HOOKS_DIRS
    # where dockerd (started by systemd: its default PATH) looks for nvidia-container-runtime-hook for --gpus
    docker_path: tuple[str, ...] = HOOK_PATH
    # a Kubernetes node: pods get their CDI specs from the device plugin or the DRA driver when they are
    # allocated, so a runtime with CDI on works without a spec of the host's
    kubernetes_node: bool = False

    @property
    def cdi_fix(self) -> str:
        return f"gpuhook generate-cdi{self.generate_flags} --output {self.spec_dirs[0]}/nvidia.yaml"

    def configure(self, runtime: str, mode: str) -> str:
        """The `gpuhook runtime configure` command that fixes `runtime`, naming the config file checked when it
        is not the default one (the running daemon's `--config`)."""
        config = getattr(self, CONFIG_FIELDS[runtime])
        named = "" if config == getattr(Paths, CONFIG_FIELDS[runtime]) else f" --config {config}"
        return f"gpuhook runtime configure --runtime {runtime}{named} --mode {mode}"

    @property
    def crio_dropins(self) -> str:
        return os.path.join(os.path.dirname(self.crio_config), "crio.conf.d")

    @property
    def podman_dropins(self) -> str:
        return os.path.join(os.path.dirname(self.podman_configs[-1]), "containers.conf.d")


def _f(status: str, message: str, fix: str = "") -> Finding:
    return Finding("runtimes", status, message, fix)


def installed() -> list[str]:
    return [name for name in RUNTIMES if shutil.which(BINARIES[name])]


def version_of(binary: str) -> Version | None:
    """`<binary> --version`'s first x.y[.z] (containerd says v1.7.2, Docker 24.0.5, podman 4.3.1)."""
    path = shutil.which(binary)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(out)


def parse_version(text: str) -> Version | None:
    match = re.search(r"(?:^|[\s/])v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in match.groups() if g is not None) if match else None


def _vtext(ver: Version | None) -> str:
    return ".".join(map(str, ver)) if ver else "(version unknown)"


def _toml(path: str) -> tuple[dict[str, Any] | None, str]:
    """(data, error); data None when absent."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f), ""
    except FileNotFoundError:
        return None, ""
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return None, f"cannot parse {path}: {exc}"


MAX_IMPORTS = 64


def _containerd_toml(path: str) -> tuple[dict[str, Any] | None, str]:
    """containerd's config as the daemon reads it: the main file, then every file its `imports` name (globs;
    relative to the main file's folder), each replacing whole plugin tables, as containerd 1.x merges them
    (gpuhook's own drop-in, node-setup's, carries the whole CRI table for that reason)."""
    data, error = _toml(path)
    if error or not data or not isinstance(data.get("imports"), list):
        return data, error
    import glob

    merged = dict(data)
    plugins = dict(merged.get("plugins") or {})
    names: list[str] = []
    for pattern in data["imports"]:
        if isinstance(pattern, str):
            full = pattern if os.path.isabs(pattern) else os.path.join(os.path.dirname(path), pattern)
            names += sorted(glob.glob(full)) if glob.has_magic(full) else [full]
    for name in names[:MAX_IMPORTS]:
        part, part_error = _toml(name)
        if part_error:
            return None, part_error
        for key, value in (part or {}).items():
            if key == "plugins" and isinstance(value, dict):
                plugins.update(value)
            elif key not in ("version", "imports"):
                merged[key] = value
    merged["plugins"] = plugins
    return merged, ""


def _json(path: str) -> tuple[dict[str, Any] | None, str]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as exc:
        return None, f"cannot parse {path}: {exc}"
    return (data, "") if isinstance(data, dict) else (None, f"{path} is not a JSON object")


def _get(data: Any, keys: Sequence[str]) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def installed_tools() -> dict[str, str]:
    """gpuhook's own programs: beside this interpreter (a venv's bin), else on PATH; '' when not found."""
    out = {}
    for name in ("gpuhook", "gpuhook-hook", SHIM):
        beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), name)
        found = shutil.which(name)
        out[name] = beside if _executable(beside) else os.path.abspath(found) if found else ""
    return out


# --- hooks directories (podman, CRI-O) ----------------------------------------------------------------------


def gpuhook_hook_files(dirs: Sequence[str]) -> list[tuple[str, str]]:
    """(oci-hooks file, program it runs) for every gpuhook hook in `dirs`."""
    found = []
    for folder in dirs:
        for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
            data, _ = _json(path)
            hook = _get(data, ("hook",))
            if isinstance(hook, dict) and has_gpuhook_hook({"hooks": {"prestart": [hook]}}):
                found.append((path, str(hook.get("path", ""))))
    return found


def _hook_findings(label: str, dirs: Sequence[str], configure: str) -> tuple[bool, list[Finding]]:
    hooks = gpuhook_hook_files(dirs)
    out = []
    works = False
    for path, program in hooks:
        if _executable(program):
            works = True
            out.append(_f(OK, f"{label}: prestart hook {program} from {path}"))
        else:
            out.append(_f(PROBLEM, f"{label}: {path} runs {program}, which does not exist: the hook is skipped "
                                   "silently", configure))
    return works, out


def _cdi_findings(label: str, dirs: Sequence[str], specs: SpecStatus, max_version: str | None = None,
                  kubernetes_node: bool = False) -> tuple[bool, list[Finding]]:
    files = specs.gpu_specs(dirs)
    out = []
    works = False
    if kubernetes_node:
        works = True
        out.append(_f(OK, f"{label}: CDI on, reading {', '.join(dirs)}, where the device plugin and the DRA driver "
                          "write the specs of the GPUs they allocate"))
    for path in files:
        claimed = str(specs.loaded.get(path, {}).get("cdiVersion", ""))
        if max_version and cdi_version.is_known(claimed) and cdi_version.key(claimed) > cdi_version.key(max_version):
            out.append(_f(PROBLEM, f"{label}: {path} claims cdiVersion {claimed}, {label} reads at most "
                                   f"{max_version}", f"gpuhook generate-cdi --output {path}"))
        elif path in specs.current:
            works = True
            out.append(_f(OK, f"{label}: CDI devices nvidia.com/gpu=… from {path}"))
        else:
            out.append(_f(WARN, f"{label}: reads {path}, which is stale or unchecked (see CDI specs)"))
    for path in specs.plugin_specs(dirs):  # written by the running device plugin for what it advertises
        works = True
        out.append(_f(OK, f"{label}: CDI devices {PLUGIN_CDI_KIND}=… from {path} (the device plugin's, for pods)"))
    return works, out


def _verdict(label: str, works: bool, fix: str, why: str) -> list[Finding]:
    return [] if works else [_f(PROBLEM, f"{label}: containers get no GPU: {why}", fix)]


# --- one function per runtime ---------------------------------------------------------------------------------


def check_runc(ver: Version | None, tools: dict[str, str]) -> list[Finding]:
    missing = [name for name, path in tools.items() if not path]
    out = [_f(INFO, f"runc {_vtext(ver)}: a bundle gets GPUs from gpuhook-hook in hooks.prestart, or by running "
                    f"through {SHIM} (which writes the edits into config.json)")]
    if missing:
        out.append(_f(PROBLEM, f"not installed: {', '.join(missing)}", "pip install gpuhook (it installs gpuhook, "
                                                                        f"gpuhook-hook and {SHIM})"))
    return out


def _podman_hooks_dirs(paths: Paths) -> list[str]:
    value: Any = None
    dropins = sorted(glob.glob(os.path.join(paths.podman_dropins, "*.conf")))
    for path in [*paths.podman_configs, *dropins]:
        data, _ = _toml(path)
        value = _get(data, ("engine", "hooks_dir")) or value
    return [str(v) for v in value] if isinstance(value, list) else list(paths.hooks_dirs)


def check_podman(ver: Version | None, paths: Paths, specs: SpecStatus) -> list[Finding]:
    label = f"podman {_vtext(ver)}"
    hook_ok, out = _hook_findings(label, _podman_hooks_dirs(paths),
                                  "gpuhook runtime configure --runtime podman --mode hook")
    cdi_ok, cdi_out = _cdi_findings(label, paths.spec_dirs, specs, PODMAN_MAX_CDI.get(tuple(ver[:2]))
                                    if ver else None)
    return out + cdi_out + _verdict(label, hook_ok or cdi_ok, paths.cdi_fix,
                                    f"no current nvidia.com/gpu CDI spec in {', '.join(paths.spec_dirs)} and no "
                                    "gpuhook hook in its hooks directories")


def check_crio(ver: Version | None, paths: Paths, specs: SpecStatus) -> list[Finding]:
    label = f"CRI-O {_vtext(ver)}"
    files = [paths.crio_config] + sorted(p for p in glob.glob(os.path.join(paths.crio_dropins, "*"))
                                         if os.path.isfile(p) and not p.endswith(".gpuhook.bak"))
    hooks_dir: Any = None
    spec_dirs: Any = None
    out: list[Finding] = []
    for path in files:
        data, error = _toml(path)
        if error:
            out.append(_f(PROBLEM, f"{label}: {error}", f"fix the TOML syntax in {path}"))
        hooks_dir = _get(data, ("crio", "runtime", "hooks_dir")) or hooks_dir
        spec_dirs = _get(data, ("crio", "runtime", "cdi_spec_dirs")) or spec_dirs
    hooks = [str(h) for h in hooks_dir] if isinstance(hooks_dir, list) else [paths.hooks_dirs[0]]
    dirs = [str(d) for d in spec_dirs] if isinstance(spec_dirs, list) else list(paths.spec_dirs)
    hook_ok, hook_out = _hook_findings(label, hooks, paths.configure("crio", "hook"))
    cdi_ok, cdi_out = _cdi_findings(label, dirs, specs, kubernetes_node=paths.kubernetes_node)
    return out + hook_out + cdi_out + _verdict(label, hook_ok or cdi_ok, paths.cdi_fix,
                                               f"no current nvidia.com/gpu CDI spec in {', '.join(dirs)} and no "
                                               "gpuhook hook in hooks_dir")


def check_containerd(ver: Version | None, paths: Paths, specs: SpecStatus) -> list[Finding]:
    label = f"containerd {_vtext(ver)}"
    data, error = _containerd_toml(paths.containerd_config)
    if error:
        return [_f(PROBLEM, f"{label}: {error}", f"fix the TOML syntax in {paths.containerd_config}")]
    modern = ver is None or ver >= (2,)
    config_version = (data or {}).get("version", 1 if data else (3 if modern else 2))
    cri = _get(data or {}, CONTAINERD_CRI.get(config_version, CONTAINERD_CRI[2])) or {}
    out: list[Finding] = []
    works = False
    cdi_supported = ver is None or ver >= CDI_SINCE["containerd"]
    if cdi_supported:
        enabled = cri.get("enable_cdi", modern)
        dirs = cri.get("cdi_spec_dirs") or list(paths.spec_dirs)
        if enabled:
            works, out = _cdi_findings(label, [str(d) for d in dirs], specs, kubernetes_node=paths.kubernetes_node)
        else:
            out.append(_f(INFO, f"{label}: CDI is off (enable_cdi) in {paths.containerd_config}"))
    name = _get(cri, ("containerd", "default_runtime_name")) or "runc"
    runtime = _get(cri, ("containerd", "runtimes", name)) or {}
    base = runtime.get("base_runtime_spec")
    if isinstance(base, str) and base:
        spec, spec_error = _json(base)
        if spec_error or spec is None:
            out.append(_f(PROBLEM, f"{label}: base_runtime_spec {base}: {spec_error or 'missing'}",
                          paths.configure("containerd", "hook")))
        elif has_gpuhook_hook(spec):
            works = True
            out.append(_f(OK, f"{label}: runtime {name!r} starts from {base}, which has gpuhook's prestart hook"))
    binary = _get(runtime, ("options", "BinaryName"))
    if isinstance(binary, str) and os.path.basename(binary) == SHIM:
        if _executable(binary):
            works = True
            out.append(_f(OK, f"{label}: runtime {name!r} runs {binary} (the shim applies the edits)"))
        else:
            out.append(_f(PROBLEM, f"{label}: BinaryName {binary} does not exist: every container fails",
                          f"ln -s $(command -v {SHIM}) {binary}"))
    mode = "cdi" if cdi_supported else "hook"
    why = ("no CDI (enable_cdi) with a current spec, no gpuhook hook in the base runtime spec, no "
           f"BinaryName = {SHIM}")
    return out + _verdict(label, works, paths.configure("containerd", mode), why)


def check_docker(ver: Version | None, paths: Paths, specs: SpecStatus) -> list[Finding]:
    label = f"Docker {_vtext(ver)}"
    data, error = _json(paths.docker_config)
    if error:
        return [_f(PROBLEM, f"{label}: {error}", f"fix the JSON syntax in {paths.docker_config}")]
    data = data or {}
    out: list[Finding] = []
    works = False
    cdi_supported = ver is None or ver >= CDI_SINCE["docker"]
    if cdi_supported and _get(data, ("features", "cdi")) is True:
        dirs = data.get("cdi-spec-dirs") or list(paths.spec_dirs)
        works, out = _cdi_findings(label, [str(d) for d in dirs], specs)
    gpus_works, gpus = _docker_gpus(label, paths)
    works, out = works or gpus_works, out + gpus
    runtimes = data.get("runtimes") if isinstance(data.get("runtimes"), dict) else {}
    default = data.get("default-runtime")
    for name, entry in sorted(runtimes.items()):
        path = entry.get("path") if isinstance(entry, dict) else None
        if isinstance(path, str) and os.path.basename(path) in NVIDIA_RUNTIMES:
            if default == name:
                out.append(_f(WARN, f"{label}: every container runs NVIDIA's {os.path.basename(path)} "
                                    f"(default-runtime {name!r}), which injects GPUs itself", _NVIDIA_FIX))
            else:
                out.append(_f(INFO, f"{label}: NVIDIA's runtime {name!r} ({path}) is configured: "
                                    f"`docker run --runtime {name}` containers get NVIDIA's toolkit, not gpuhook"))
            continue
        if not isinstance(path, str) or os.path.basename(path) != SHIM:
            continue
        if not _executable(path):
            out.append(_f(PROBLEM, f"{label}: runtime {name!r} runs {path}, which does not exist",
                          f"ln -s $(command -v {SHIM}) {path}"))
            continue
        works = True
        every = data.get("default-runtime") == name
        out.append(_f(OK, f"{label}: runtime {name!r} ({path}) "
                          + ("is the default runtime" if every else f"for `docker run --runtime {name}`")))
    mode = "cdi" if cdi_supported else "hook"
    why = ("no CDI (features.cdi) with a current spec, no gpuhook nvidia-container-runtime-hook for --gpus and no "
           "runtime entry for " + SHIM)
    return out + _verdict(label, works, paths.configure("docker", mode), why)


NVIDIA_RUNTIMES = ("nvidia-container-runtime", "nvidia-container-runtime.cdi", "nvidia-container-runtime.legacy")
_NVIDIA_FIX = "remove NVIDIA's toolkit from this runtime's configuration to have gpuhook answer, or keep it alone"


def _docker_gpus(label: str, paths: Paths) -> tuple[bool, list[Finding]]:
    """Docker's own --gpus: whatever `nvidia-container-runtime-hook` dockerd finds first on its PATH runs for
    every --gpus container. gpuhook's entry under that name counts as configured; NVIDIA's is named."""
    from gpuhook.hook.installed import DOCKER_GPUS_NAME, is_ours

    for folder in paths.docker_path:
        candidate = os.path.join(folder, DOCKER_GPUS_NAME)
        if not _executable(candidate):
            continue
        if is_ours(candidate):
            return True, [_f(OK, f"{label}: `docker run --gpus` runs gpuhook ({candidate}; dockerd finds it only "
                                 "when it starts, so restart it once after installing)")]
        return False, [_f(INFO, f"{label}: `docker run --gpus` runs NVIDIA's {candidate} (the NVIDIA Container "
                                "Toolkit), not gpuhook", "gpuhook hook install --docker-gpus refuses to replace it: "
                                + _NVIDIA_FIX)]
    return False, []


def with_config(name: str, paths: Paths, config: str) -> Paths:
    """`paths` with runtime `name`'s config file replaced by the one its running daemon was started with."""
    field_name = CONFIG_FIELDS.get(name)
    if field_name:
        return record.replace(paths, **{field_name: config})
    if name == "podman":
        return record.replace(paths, podman_configs=(config,))
    return paths


def _daemon_paths(name: str, paths: Paths, daemons: Sequence[Daemon]) -> tuple[list[Paths], list[Finding]]:
    """The config paths to check for runtime `name`: each running daemon's own file (its command line's
    `--config`), else the default; with an INFO finding per daemon, or saying none runs. A daemon that is not
    this host's own (Docker's managed containerd, another user's) is named and not checked; with only such
    daemons running, nothing is checked."""
    theirs = [d for d in daemons if d.runtime == name and d.not_ours()]
    mine = [d for d in daemons if d.runtime == name and not d.not_ours()]
    notes = [_f(INFO, d.not_ours()) for d in theirs] + [_f(INFO, d.describe()) for d in mine]
    if theirs and not mine:
        return [], notes
    if not mine and name in ("containerd", "crio", "docker"):
        notes.append(_f(INFO, f"no {name} daemon running: checking its default config"))
    configs = list(dict.fromkeys(d.config for d in mine if d.config))
    if len(configs) < len(mine) or not configs:  # a daemon on its default config, or none running
        return [paths, *(with_config(name, paths, c) for c in configs)], notes
    return [with_config(name, paths, c) for c in configs], notes


def _daemon_version(name: str, daemons: Sequence[Daemon]) -> Version | None:
    """The running daemon's own binary's version (a node may have another, older one on PATH, or none), else
    the one on PATH."""
    for daemon in daemons:
        if daemon.runtime == name:
            found = version_of(f"/proc/{daemon.pid}/exe")
            if found is not None:
                return found
    return version_of(BINARIES.get(name, name))


def check_runtimes(names: Sequence[str], specs: SpecStatus, paths: Paths = Paths(),
                   versions: dict[str, Version | None] | None = None,
                   daemons: Sequence[Daemon] | None = None) -> list[Finding]:
    """Findings for each runtime in `names` (versions from `<binary> --version` unless given), checking the config
    file each running daemon uses (`daemons`: from this host's process table unless given)."""
    daemons = running_daemons() if daemons is None else daemons
    versions = versions if versions is not None else {n: _daemon_version(n, daemons) for n in names}
    checks = {"podman": check_podman, "crio": check_crio, "containerd": check_containerd, "docker": check_docker}
    out: list[Finding] = []
    for name in names:
        ver = versions.get(name)
        if name == "runc":
            out += check_runc(ver, installed_tools())
            continue
        if name not in checks:
            continue
        each, notes = _daemon_paths(name, paths, daemons)
        out += notes
        for one in each:
            out += checks[name](ver, one, specs)
    if not names:
        out.append(_f(INFO, "no container runtime checked"))
    return out


def check_cdi_ignored(state_dir: str) -> list[Finding]:
    """The hook's or shim's record (hook/cdiignored.py) that a runtime on this node ignored a container's CDI
    devices, as the device plugin reports it: one WARN, and nothing without a record (or a state dir)."""
    if not state_dir:
        return []
    path = os.path.join(state_dir, CDI_IGNORED_RECORD)
    try:
        rec = cdiignored.parse(read_regular(path, follow_links=False, limit=cdiignored.MAX_BYTES))
    except (OSError, GpuhookError):  # absent, or not a regular file (a link is not read): no record
        return []
    if rec is None:
        return []
    return [_f(WARN, f"{cdiignored.message(rec)} (recorded in {path})",
               f"once the runtime applies CDI devices: rm {path}")]
