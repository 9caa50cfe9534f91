"""What `runtime configure` changes for each runtime, as a Plan: every file's old and new text, computed before
anything is written (a refusal or a malformed file leaves everything untouched).

Where each setting lives (see runtime-config/README.md for the sources):
- containerd: config version 2 (1.x) puts CRI under `plugins."io.containerd.grpc.v1.cri"`, version 3 (2.x) under
  `plugins."io.containerd.cri.v1.runtime"`; CDI is `enable_cdi` + `cdi_spec_dirs` there (containerd >= 1.7);
  the hook goes into the `base_runtime_spec` of the default runtime (containerd 1.6 has no CDI, no hooks dir).
- CRI-O: `[crio.runtime]` `cdi_spec_dirs` and `hooks_dir` (oci-hooks(5) files).
- Docker: daemon.json `"features": {"cdi": true}` (Docker >= 25); before that only a `"runtimes"` entry for the
  gpuhook-runtime shim (a runc wrapper that writes the GPU edits into config.json).
- podman: `[engine] hooks_dir` in containers.conf; CDI dirs /etc/cdi and /var/run/cdi are read by default.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import tomlkit
from tomlkit.toml_document import TOMLDocument

from gpuhook.errors import ConfigError
from gpuhook.fileio.atomic import FileKindError, read_regular
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.model.record import Record, field
from gpuhook.runtimeconfig import hookspec
from gpuhook.runtimeconfig.files import (
    BACKUP_SUFFIX,
    FileChange,
    parse_json_object,
    parse_toml,
    read_text,
    render_json_like,
    target,
)
from gpuhook.runtimeconfig.tomledit import add_items, check, dotted, ensure_table, lookup, set_value

RUNTIMES = ("containerd", "crio", "docker", "podman")
MODES = ("cdi", "hook")
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
# The hooks dir podman and CRI-O read when `hooks_dir` is unset; setting the key replaces it, so keep it listed.
BUILTIN_HOOKS_DIR = "/usr/share/containers/oci/hooks.d"
DEFAULT_HOOKS_DIR = "/etc/containers/oci/hooks.d"

CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CONTAINERD_CRI = {2: ("plugins", "io.containerd.grpc.v1.cri"), 3: ("plugins", "io.containerd.cri.v1.runtime")}
BASE_SPEC_NAME = "gpuhook-base-spec.json"
CRIO_CONFIG = "/etc/crio/crio.conf"
CRIO_DROPIN = "/etc/crio/crio.conf.d/99-gpuhook.conf"
DOCKER_CONFIG = "/etc/docker/daemon.json"
# The option naming a daemon's config file on its command line.
CONFIG_OPTIONS = {"containerd": ("--config", "-c"), "crio": ("--config", "-c"), "docker": ("--config-file",)}
DOCKER_RUNTIME = "gpuhook"
RUNTIME_SHIM = "gpuhook-runtime"
PODMAN_CONFIG = "/etc/containers/containers.conf"
PODMAN_DROPIN = "/etc/containers/containers.conf.d/99-gpuhook.conf"
PODMAN_VENDOR_CONFIG = "/usr/share/containers/containers.conf"

RESTART = {
    "containerd": "restart containerd to apply: systemctl restart containerd",
    "crio": "restart CRI-O to apply: systemctl restart crio",
    "docker": "restart Docker to apply: systemctl restart docker",
    "podman": "no restart needed: podman reads its configuration on every command "
    "(restart `podman system service` / podman.socket if you use the API)",
}


class Options(Record):
    runtime: str
    mode: str = "cdi"
    config: str | None = None
    hooks_dir: str | None = None
    hook_path: str | None = None
    hook_config: str | None = None  # the hook's own config file, passed in the hook entry as --config FILE
    # Where the host's `/` is mounted (node-setup's host mount): files are read and written under it, while the
    # paths written *into* configs stay the host's own. `default_spec`: `ctr oci spec`'s output, when the
    # caller ran the host's ctr itself (a pod has none of its own).
    root: str = "/"
    default_spec: str | None = None


class Plan(Record, frozen=False):
    runtime: str
    mode: str
    config: str
    changes: list[FileChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def restart(self) -> str:
        return RESTART[self.runtime]


def plan(opts: Options) -> Plan:
    """The changes that configure `opts.runtime` for `opts.mode`; raises ConfigError for what cannot be done."""
    _check_options(opts)
    return {"containerd": _containerd, "crio": _crio, "docker": _docker, "podman": _podman}[opts.runtime](opts)


def _check_options(opts: Options) -> None:
    if opts.runtime not in RUNTIMES or opts.mode not in MODES:
        raise ConfigError(f"unknown runtime {opts.runtime!r} or mode {opts.mode!r}")
    if opts.mode == "cdi" and (opts.hooks_dir or opts.hook_path or opts.hook_config):
        raise ConfigError("--hooks-dir, --hook-path and --hook-config only apply to --mode hook")
    if opts.hook_config and opts.runtime == "docker":
        raise ConfigError("--hook-config does not apply to docker: its runtime shim reads GPUHOOK_CONFIG "
                          "(default /etc/gpuhook/config.toml)")
    if opts.hooks_dir and opts.runtime not in ("crio", "podman"):
        raise ConfigError(f"--hooks-dir only applies to crio and podman ({opts.runtime} has no hooks directory)")
    for name, value in (("--hooks-dir", opts.hooks_dir), ("--hook-path", opts.hook_path),
                        ("--hook-config", opts.hook_config)):
        if value is not None and not os.path.isabs(value):
            raise ConfigError(f"{name} must be an absolute path, not {value!r}")


def option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The last `--name VALUE` / `--name=VALUE` in `args` (the last one wins, as Go's flag parsing does)."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value


def under(root: str, path: str) -> str:
    """`path` (a host path) as seen through the host mount at `root`."""
    return path if root == "/" else os.path.join(root, os.path.abspath(path).lstrip("/"))


def _hook_path(opts: Options, result: Plan) -> str:
    """The hook to register: --hook-path, else where `gpuhook hook install` writes its lean entry script; a
    missing file is worth a loud note because podman and CRI-O silently skip a hook whose path does not exist."""
    path = opts.hook_path or hookspec.default_hook_path()
    if not os.path.isfile(under(opts.root, path)):
        result.notes.append(f"{path} does not exist (yet); runtimes skip or fail a hook whose program is missing")
    return path


def _load_toml(where: str, root: str = "/") -> tuple[str, str | None, TOMLDocument]:
    path = target(under(root, where))
    old = read_text(path)
    return path, old, parse_toml(where, old or "")


def _toml_change(path: str, old: str | None, doc: TOMLDocument, backup_to: str | None = None) -> FileChange:
    """The rendered document: tomlkit renders an unedited document as the exact text it parsed, so a re-run
    that changes no value compares equal and writes nothing."""
    return FileChange(path, old, tomlkit.dumps(doc), backup_to)


def _has_all(wanted: Sequence[str]) -> Callable[[Any], bool]:
    want = {os.path.normpath(w) for w in wanted}
    return lambda v: isinstance(v, list) and want <= {os.path.normpath(str(x)) for x in v}


# --- containerd -------------------------------------------------------------------------------------------


def containerd_version(where: str, doc: TOMLDocument) -> int:
    """Config version 2 or 3; an empty file becomes version 2 (read by containerd 1.x and 2.x alike)."""
    raw = doc.get("version")
    version = raw.unwrap() if hasattr(raw, "unwrap") else raw
    if version is None and not doc:
        set_value(doc, "version", 2)
        return 2
    if version is None or version == 1:
        raise ConfigError(
            f"{where} is containerd config version 1 (no `version` line means 1), which gpuhook does not edit: "
            "upgrade it to version 2 (containerd 1.x) or 3 (containerd 2.x) first, see `containerd config default`"
        )
    if isinstance(version, bool) or version not in CONTAINERD_CRI:
        raise ConfigError(f"{where}: unknown containerd config version {version!r} (expected 2 or 3)")
    return int(version)


def _containerd(opts: Options) -> Plan:
    where = opts.config or CONTAINERD_CONFIG
    path, old, doc = _load_toml(where, opts.root)
    version = containerd_version(where, doc)
    cri_keys = CONTAINERD_CRI[version]
    result = Plan("containerd", opts.mode, where)
    if opts.mode == "cdi":
        change = FileChange(path, old, containerd_cdi(where, doc, version))
        if version == 2:
            result.notes.append("CDI needs containerd >= 1.7; containerd 1.6 ignores enable_cdi (use --mode hook)")
        result.changes.append(change)
        return result
    hook = _hook_path(opts, result)
    runtime_keys, base = _containerd_runtime(where, opts.root, doc, cri_keys)
    change = _toml_change(path, old, doc)
    check(where, change.new, (*runtime_keys, "base_runtime_spec"), lambda v: v == base)
    # The base spec first: the config must never name a file that is not there yet.
    result.changes += [_base_spec_change(base, hook, opts.hook_config, opts.root, opts.default_spec), change]
    result.notes.append(f"the base spec replaces containerd's built-in default spec for runtime {runtime_keys[-1]!r}; "
                        "containers created before the restart keep their old spec")
    return result


def containerd_cdi(where: str, doc: TOMLDocument, version: int) -> str:
    """`doc` (a containerd config of `version`, or a drop-in holding its CRI table) with CDI on and both CDI
    directories listed, rendered and re-read to check it."""
    cri_keys = CONTAINERD_CRI[version]
    cri, _ = ensure_table(where, doc, cri_keys)
    set_value(cri, "enable_cdi", True)
    add_items(where, cri, (*cri_keys, "cdi_spec_dirs"), CDI_DIRS, CDI_DIRS)
    text = tomlkit.dumps(doc)
    check(where, text, (*cri_keys, "enable_cdi"), lambda v: v is True)
    check(where, text, (*cri_keys, "cdi_spec_dirs"), _has_all(CDI_DIRS))
    return text


def _containerd_runtime(
    where: str, root: str, doc: TOMLDocument, cri_keys: tuple[str, ...]
) -> tuple[tuple[str, ...], str]:
    """Point the default runtime's `base_runtime_spec` at a spec file (the one already set, or ours beside the
    config); returns that runtime's key path and the spec path."""
    name = lookup(doc.unwrap(), (*cri_keys, "containerd", "default_runtime_name")) or "runc"
    runtime_keys = (*cri_keys, "containerd", "runtimes", str(name))
    runtime, created = ensure_table(where, doc, runtime_keys)
    if created and name == "runc":
        # A partial runtimes.runc table replaces containerd's default one, so it must name the shim itself.
        set_value(runtime, "runtime_type", "io.containerd.runc.v2")
    current = runtime.get("base_runtime_spec")
    host_path = os.path.realpath(where) if root == "/" else os.path.abspath(where)
    base = str(current) if current else os.path.join(os.path.dirname(host_path), BASE_SPEC_NAME)
    set_value(runtime, "base_runtime_spec", base)
    return runtime_keys, base


def _base_spec_change(where: str, hook: str, hook_config: str | None, root: str = "/",
                      default_spec: str | None = None) -> FileChange:
    """The base OCI spec with the prestart hook added (once; an entry for the same program is updated); a
    missing spec starts from `ctr oci spec` cut down to what CRI applies anyway (`cri_default_spec`)."""
    path = target(under(root, where))
    old = read_text(path)
    if old is not None:
        spec = parse_json_object(where, old)
    else:
        spec = cri_default_spec(default_spec if default_spec is not None else _ctr_default_spec(where))
    hooks = spec.setdefault("hooks", {})
    prestart = hooks.setdefault("prestart", []) if isinstance(hooks, dict) else None
    if not isinstance(prestart, list):
        raise ConfigError(f"{where}: `hooks` must be an object and `hooks.prestart` a list")
    wanted = hookspec.oci_hook(hook, hook_config)
    mine = [i for i, h in enumerate(prestart) if isinstance(h, dict) and h.get("path") == hook]
    if not mine:
        prestart.append(wanted)
    elif prestart[mine[0]] != wanted:
        prestart[mine[0]] = wanted
    elif old is not None:
        return FileChange(path, old, old)
    return FileChange(path, old, render_json_like(old, spec))


# What containerd's CRI plugin removes from its default spec (oci.populateDefaultUnixSpec, which `ctr oci spec`
# prints) before building a container's spec, in criService's spec generation and
# customopts.WithoutRunMount / WithoutDefaultSecuritySettings. A base_runtime_spec replaces that default whole
# and CRI applies it as given, so anything kept here would reach every container on the node: above all
# `process.rlimits` (RLIMIT_NOFILE 1024:1024 instead of containerd's own limit, kubernetes-sigs/kind#2532).
_CRI_DROPS_PROCESS = ("rlimits", "apparmorProfile")
_CRI_DROPS_LINUX = ("seccomp",)
_CRI_DROPS_MOUNTS = ("/run",)


def cri_default_spec(text: str) -> dict[str, Any]:
    """`ctr oci spec` output as CRI would use it for a container without a base spec: no rlimits, no
    apparmor/seccomp defaults (CRI sets those from the pod's security context), no /run mount."""
    spec = parse_json_object("`ctr oci spec` output", text)
    process = spec.get("process")
    if isinstance(process, dict):
        for key in _CRI_DROPS_PROCESS:
            process.pop(key, None)
    linux = spec.get("linux")
    if isinstance(linux, dict):
        for key in _CRI_DROPS_LINUX:
            linux.pop(key, None)
    mounts = spec.get("mounts")
    if isinstance(mounts, list):
        spec["mounts"] = [m for m in mounts
                          if not (isinstance(m, dict) and os.path.normpath(str(m.get("destination", ""))) in
                                  _CRI_DROPS_MOUNTS)]
    return spec


def _ctr_default_spec(where: str) -> str:
    ctr = shutil.which("ctr")
    if ctr is None:
        raise ConfigError(f"{where} does not exist and `ctr` is not on PATH to make it: "
                          f"run `ctr oci spec > {where}`, then configure again")
    try:
        result = subprocess.run([ctr, "oci", "spec"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"`ctr oci spec` failed: {exc}") from None
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise ConfigError(f"`ctr oci spec` failed: {why}")
    return result.stdout


# --- CRI-O and podman (oci-hooks(5) directories) ----------------------------------------------------------


def _crio(opts: Options) -> Plan:
    """crio.conf when it exists, else our own drop-in: CRI-O reads /etc/crio/crio.conf.d/* after the main file."""
    where = opts.config or (CRIO_CONFIG if os.path.exists(CRIO_CONFIG) else CRIO_DROPIN)
    path, old, doc = _load_toml(where, opts.root)
    keys = ("crio", "runtime")
    table, _ = ensure_table(where, doc, keys)
    result = Plan("crio", opts.mode, where)
    if opts.mode == "cdi":
        key, wanted, default = "cdi_spec_dirs", CDI_DIRS, list(CDI_DIRS)
    else:
        hooks_dir = opts.hooks_dir or DEFAULT_HOOKS_DIR
        key, wanted = "hooks_dir", (hooks_dir,)
        default = _inherited(path, [CRIO_CONFIG], (*keys, key), (BUILTIN_HOOKS_DIR,))
        result.changes.append(_hooks_d_change(hooks_dir, _hook_path(opts, result), opts.hook_config))
    add_items(where, table, (*keys, key), wanted, default)
    change = _toml_change(path, old, doc, _crio_backup(path))
    check(where, change.new, (*keys, key), _has_all(wanted))
    result.changes.append(change)
    result.notes += _overrides(path, _dropins(path, "crio.conf.d", "*"), (*keys, key))
    return result


def _crio_backup(path: str) -> str | None:
    """CRI-O reads every file in crio.conf.d, a backup there included (and it would sort after the file it
    backs up, undoing the change), so a drop-in's backup goes one directory up."""
    folder = os.path.dirname(path)
    if os.path.basename(folder) != "crio.conf.d":
        return None
    return os.path.join(os.path.dirname(folder), os.path.basename(path) + BACKUP_SUFFIX)


def _podman(opts: Options) -> Plan:
    """containers.conf when it exists, else our own drop-in: newer podman reads /etc/containers/containers.conf
    *instead of* the vendor's /usr/share one, so creating it could drop the vendor's settings; drop-ins
    (containers.conf.d/*.conf) are read on top by every version."""
    where = opts.config or (PODMAN_CONFIG if os.path.exists(PODMAN_CONFIG) else PODMAN_DROPIN)
    result = Plan("podman", opts.mode, where)
    if opts.mode == "cdi":
        result.notes.append(f"podman reads CDI specs from {' and '.join(CDI_DIRS)} without any setting "
                            "(`podman run --device nvidia.com/gpu=0`)")
        return result
    path, old, doc = _load_toml(where)
    keys = ("engine", "hooks_dir")
    engine, _ = ensure_table(where, doc, keys[:1])
    hooks_dir = opts.hooks_dir or DEFAULT_HOOKS_DIR
    default = _inherited(path, [PODMAN_VENDOR_CONFIG, PODMAN_CONFIG], keys, (BUILTIN_HOOKS_DIR,))
    add_items(where, engine, keys, (hooks_dir,), default)
    change = _toml_change(path, old, doc)
    check(where, change.new, keys, _has_all((hooks_dir,)))
    result.changes += [_hooks_d_change(hooks_dir, _hook_path(opts, result), opts.hook_config), change]
    result.notes += _overrides(path, _dropins(path, "containers.conf.d", "*.conf"), keys)
    return result


def _inherited(path: str, earlier: Sequence[str], keys: tuple[str, ...], default: Sequence[str]) -> list[str]:
    """The list a new `keys` setting in `path` replaces: the last value among the files read before it (the
    main or vendor config, when `path` is a drop-in or the /etc file), else the runtime's built-in default."""
    value: Any = None
    for other in earlier:
        if os.path.realpath(other) == path:
            break
        value = _toml_value(other, keys) or value
    return [str(v) for v in value] if isinstance(value, list) else list(default)


def _toml_value(path: str, keys: tuple[str, ...]) -> Any:
    """`keys` in a TOML file that may be absent or broken (None then): only ever used for notes and defaults."""
    try:
        return lookup(tomllib.loads(read_regular(path).decode()), keys)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, FileKindError):
        return None


def _hooks_d_change(hooks_dir: str, hook: str, hook_config: str | None) -> FileChange:
    """gpuhook.json in the hooks dir, naming the real hook program (and its config file, when given)."""
    path = target(os.path.join(hooks_dir, hookspec.HOOKS_D_FILE))
    old = read_text(path)
    return FileChange(path, old, hookspec.render_json(hookspec.hooks_d_config(hook, hook_config)))


def _dropins(path: str, dirname: str, pattern: str) -> list[str]:
    """The drop-in files read after `path` (lexical order, later wins): all of them for the main file, those
    sorting after it for a drop-in."""
    folder = os.path.dirname(path)
    dropin_dir = folder if os.path.basename(folder) == dirname else os.path.join(folder, dirname)
    found = sorted(p for p in glob.glob(os.path.join(dropin_dir, "**", pattern), recursive=True) if os.path.isfile(p))
    return [p for p in found if p > path or os.path.dirname(path) != dropin_dir]


def _overrides(path: str, later: Sequence[str], keys: tuple[str, ...]) -> list[str]:
    return [f"{other} also sets {dotted(keys)} and is read later, so it wins: edit or remove it there"
            for other in later
            if not other.endswith(BACKUP_SUFFIX) and os.path.realpath(other) != path
            and _toml_value(other, keys) is not None]


# --- Docker -----------------------------------------------------------------------------------------------


def _docker(opts: Options) -> Plan:
    """daemon.json, created when absent; rewritten with its own indent and key order, only when it changes."""
    where = opts.config or DOCKER_CONFIG
    path = target(where)
    old = read_text(path)
    data = parse_json_object(where, old or "")
    result = Plan("docker", opts.mode, where)
    if opts.mode == "cdi":
        features = _json_object(where, data, "features")
        changed = features.get("cdi") is not True
        features["cdi"] = True
        result.notes.append("CDI needs Docker >= 25 (`docker run --device nvidia.com/gpu=0`); "
                            "older Docker: --mode hook")
    else:
        # the shim is a console script installed with gpuhook, beside the interpreter (or beside --hook-path)
        shim = os.path.join(os.path.dirname(opts.hook_path or hookspec.installed_hook_path()), RUNTIME_SHIM)
        entry = _json_object(where, _json_object(where, data, "runtimes"), DOCKER_RUNTIME)
        changed = entry.get("path") != shim
        entry["path"] = shim
        if not os.path.isfile(shim):
            result.notes.append(f"{shim} does not exist: Docker has no hooks directory, so GPUs get in through "
                                f"{RUNTIME_SHIM}, the runc wrapper installed with gpuhook beside gpuhook-hook")
        result.notes.append(f"containers get the hook with `docker run --runtime {DOCKER_RUNTIME}`, or for every "
                            f'container with `"default-runtime": "{DOCKER_RUNTIME}"` in {where}')
    default = data.get("default-runtime")
    if isinstance(default, str) and default not in (DOCKER_RUNTIME, "runc"):
        result.notes.append(f'"default-runtime": "{default}" left in place: every container still goes through '
                            f"{default!r}" + (" (NVIDIA's toolkit, which injects GPUs itself)" if default == "nvidia"
                                              else ""))
    new = render_json_like(old, data) if changed or old is None else old
    result.changes.append(FileChange(path, old, new))
    return result


def _json_object(where: str, parent: dict[str, Any], key: str) -> dict[str, Any]:
    """parent[key] as an object; added when absent, which only happens when a change follows anyway."""
    value = parent.setdefault(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {key!r} must be a JSON object")
    return value
