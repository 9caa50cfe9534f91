"""`gpuhook-runtime`: an OCI runtime shim for runtimes without CDI or a hooks directory (containerd 1.6, Docker < 25).

Invoked exactly like runc. On `create` (and `run`, which creates too) it reads the bundle's config.json, parses the
container's GPU request as the prestart hook does, plans the edits with `edits.plan` and writes them into
config.json — device nodes, device cgroup allow rules, bind mounts and the CDI generator's createContainer hooks
(links, ld cache) — then execs the real runtime with the original arguments. The runtime applies everything itself,
so the result is the same on cgroup v1 and v2. Every other subcommand, and every container without a GPU request,
reaches the runtime untouched (config.json byte for byte).

Environment: GPUHOOK_RUNTIME (the real runtime: a name looked up on PATH, or a path; default: the first of the
config's `runtimes` found, runc) and GPUHOOK_CONFIG (the hook's config file; default /etc/gpuhook/config.toml).
Like the hook, the import path is lean: no click, YAML, jsonschema or gRPC.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuhook.errors import GpuhookError, clip, render
from gpuhook.hook.config import CONFIG_ENV
from gpuhook.hook.installed import DEFAULT_PATH as DEFAULT_HOOK_PATH
from gpuhook.hook.installed import DOCKER_GPUS_NAME
from gpuhook.hook.log import append_log
from gpuhook.model.record import Record

RUNTIME_ENV = "GPUHOOK_RUNTIME"
DEFAULT_RUNTIME = "runc"
PROG = "gpuhook-runtime"
CREATE_COMMANDS = frozenset({"create", "run"})
# runc's global options that take a value (urfave/cli accepts -x and --x, and --x=value).
GLOBAL_VALUE_OPTIONS = frozenset({"root", "log", "log-format", "criu", "rootless"})
# `runc create|run` options that take a value.
CREATE_VALUE_OPTIONS = frozenset({"bundle", "b", "console-socket", "pid-file", "preserve-fds"})


class ShimError(GpuhookError):
    """A start that must not go ahead: one line for stderr."""


class Invocation(Record):
    """What the runtime is asked to do: the subcommand and, for create/run, the bundle and container id."""

    command: str | None
    bundle: str = ""
    container_id: str = ""
    help: bool = False
    log: str = ""  # runc's --log: where the runtime's caller reads the reason a create failed
    log_format: str = "text"


def _option(arg: str) -> tuple[str, bool]:
    """('name', has inline '=value') for '-name', '--name' or '--name=value'."""
    name = arg.lstrip("-")
    return name.partition("=")[0], "=" in name


def parse_argv(args: Sequence[str], cwd: str | None = None) -> Invocation:
    """Find the subcommand after runc's global options and, for create/run, `--bundle`/`-b` (default: the cwd)."""
    i = 0
    logging = {"log": "", "log-format": "text"}
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        name, inline = _option(args[i])
        if name in logging:
            logging[name] = args[i].partition("=")[2] if inline else (args[i + 1] if i + 1 < len(args) else "")
        i += 2 if name in GLOBAL_VALUE_OPTIONS and not inline else 1
    log, log_format = logging["log"], logging["log-format"]
    if i >= len(args):
        return Invocation(None, log=log, log_format=log_format)
    command, rest = args[i], args[i + 1 :]
    if command not in CREATE_COMMANDS:
        return Invocation(command, log=log, log_format=log_format)
    bundle, positional, wants_help = "", [], False
    j = 0
    while j < len(rest):
        arg = rest[j]
        if arg.startswith("-") and arg != "-":
            name, inline = _option(arg)
            value = arg.partition("=")[2] if inline else (rest[j + 1] if j + 1 < len(rest) else "")
            if name in ("bundle", "b"):
                bundle = value
            wants_help = wants_help or name in ("h", "help")
            j += 2 if name in CREATE_VALUE_OPTIONS and not inline else 1
        else:
            positional.append(arg)
            j += 1
    base = cwd if cwd is not None else os.getcwd()
    return Invocation(command, os.path.normpath(os.path.join(base, bundle or ".")),
                      positional[0] if positional else "", wants_help, log, log_format)


# --- rewriting config.json ----------------------------------------------------------------------------------


# Programs that inject GPUs at prestart by themselves, by the name in `path` or `args[0]`: gpuhook's entry (also
# under NVIDIA's name, which `docker run --gpus` adds to every --gpus container) and NVIDIA's toolkit.
GPU_HOOKS = {os.path.basename(DEFAULT_HOOK_PATH): "gpuhook", DOCKER_GPUS_NAME: "nvidia",
             "nvidia-container-toolkit": "nvidia"}


def hook_owner(hook: Any) -> str | None:
    """'gpuhook' or 'nvidia' for a prestart hook that injects GPUs itself (NVIDIA's name may be gpuhook's entry
    too: the shim cannot tell, and need not: either way the hook injects), else None."""
    if not isinstance(hook, dict):
        return None
    path, args = os.path.basename(str(hook.get("path", ""))), hook.get("args")
    first = os.path.basename(str(args[0])) if isinstance(args, list) and args else ""
    if path == "gpuhook" and isinstance(args, list) and "hook" in args[1:2]:
        return "gpuhook"
    return GPU_HOOKS.get(path) or GPU_HOOKS.get(first)


def gpu_hooks(config: dict[str, Any]) -> list[str]:
    """The owners of the GPU-injecting prestart/createRuntime hooks config.json already carries. A `hooks` that
    is not an object of lists is one ShimError line: runc would refuse the spec anyway."""
    hooks = config.get("hooks")
    if hooks is None:
        return []
    if not isinstance(hooks, dict):
        raise ShimError("config.json: 'hooks' is not an object")
    owners = []
    for stage in ("prestart", "createRuntime"):
        entries = hooks.get(stage)
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise ShimError(f"config.json: 'hooks.{stage}' is not a list")
        owners += [o for o in map(hook_owner, entries) if o]
    return owners


def has_gpuhook_hook(config: dict[str, Any]) -> bool:
    """A gpuhook prestart hook is already configured (e.g. containerd's base spec): it will inject, the shim won't."""
    try:
        return "gpuhook" in gpu_hooks(config)
    except ShimError:
        return False


def _list(parent: dict[str, Any], key: str) -> list[Any]:
    value = parent.setdefault(key, [])
    if not isinstance(value, list):
        raise ShimError(f"config.json: {key!r} is not a list")
    return value


def _object(parent: dict[str, Any], key: str) -> dict[str, Any]:
    value = parent.setdefault(key, {})
    if not isinstance(value, dict):
        raise ShimError(f"config.json: {key!r} is not an object")
    return value


def apply_edits(config: dict[str, Any], edits: Any, hook_path: str) -> dict[str, Any]:
    """`config` (changed in place and returned) with `edits` in OCI form, exactly as a CDI runtime renders them.

    Idempotent: a node, rule, mount, env key or hook already present is not added twice (a retried create).
    """
    from gpuhook.cdi.spec import NODE_PERMISSIONS, render_hooks

    linux = _object(config, "linux")
    devices = _list(linux, "devices")
    rules = _list(_object(linux, "resources"), "devices")
    have_nodes = {d.get("path") for d in devices if isinstance(d, dict)}
    for node in edits.device_nodes:
        if node.path not in have_nodes:
            devices.append({"path": node.path, "type": node.type, "major": node.major, "minor": node.minor,
                            "fileMode": node.mode, "uid": 0, "gid": 0})
            have_nodes.add(node.path)
        rule = {"allow": True, "type": node.type, "major": node.major, "minor": node.minor, "access": NODE_PERMISSIONS}
        if rule not in rules:
            rules.append(rule)
    mounts = _list(config, "mounts")
    have_mounts = {m.get("destination") for m in mounts if isinstance(m, dict)}
    for m in edits.mounts:
        if m.container_path not in have_mounts:
            mounts.append({"destination": m.container_path, "type": m.type, "source": m.host_path,
                           "options": list(m.options)})
    if edits.env:
        env = _list(_object(config, "process"), "env")
        keys = {e.partition("=")[0] for e in env if isinstance(e, str)}
        env += [e for e in edits.env if e.partition("=")[0] not in keys]
    hooks = _object(config, "hooks") if (edits.symlinks or edits.ld_dirs) else {}
    for hook in render_hooks(edits, hook_path):
        stage = _list(hooks, hook.pop("hookName"))
        if hook not in stage:
            stage.append(hook)
    return config


# --- the pieces around it -----------------------------------------------------------------------------------


def _volumes(mounts: list[dict[str, Any]]) -> list[str]:
    """Destinations of the bind mounts config.json already has (oci/bundle's Bundle.mounts): host directories the
    runtime will mount."""
    out = []
    for m in mounts:
        if isinstance(m.get("destination"), str) and (
                m.get("type") == "bind" or any(o in ("bind", "rbind") for o in m.get("options") or [])):
            out.append(os.path.normpath("/" + m["destination"].lstrip("/")))
    return out


def check_off_volumes(rootfs_path: str, mounts: list[dict[str, Any]], edits: Any) -> None:
    """Refuse a start whose mount targets, links or ld configuration would land on a volume through an image link
    (a library folder linking to /data/lib, /data a host directory): runc creates missing mount targets before
    any hook runs, in the host's directory. Followed as runc does (RootFS.leads_to), before config.json changes."""
    volumes = _volumes(mounts)
    if not volumes:
        return
    from gpuhook.inject.rootfs import RootFS
    from gpuhook.model.contract import LD_CONF_FILE

    paths = [m.container_path for m in edits.mounts] + [link.link for link in edits.symlinks]
    if edits.ld_dirs:
        paths.append(LD_CONF_FILE)
    with RootFS(rootfs_path) as rootfs:
        for path in paths:
            where = rootfs.leads_to(path)
            hit = next((v for v in volumes if where == v or where.startswith(v.rstrip("/") + "/")), None)
            if hit is not None:
                raise ShimError(f"{clip(path, quote=False)} in the image leads to {clip(where, quote=False)}, on the "
                                f"volume mounted at {clip(hit, quote=False)}: refusing to create it there")


def gpuhook_executable() -> str:
    """The installed `gpuhook` the createContainer hooks run (discover/executables.py)."""
    from gpuhook.discover.executables import gpuhook_executable as installed

    found = installed()
    if found is None:
        raise ShimError(f"cannot find the gpuhook executable next to {sys.executable} or on PATH")
    return found


def _self_paths() -> set[str]:
    me = sys.argv[0] if os.sep in sys.argv[0] else (shutil.which(sys.argv[0]) or sys.argv[0])
    return {os.path.realpath(me), os.path.realpath(os.path.join(os.path.dirname(sys.executable), PROG))}


def real_runtime(environ: dict[str, str] | None = None, runtimes: Sequence[str] = (DEFAULT_RUNTIME,)) -> str:
    """The runtime to exec: $GPUHOOK_RUNTIME, else the first of the config's `runtimes` found (NVIDIA's
    [nvidia-container-runtime] runtimes: each a path, or a name looked up on PATH), never this shim itself (that
    would loop)."""
    env = os.environ if environ is None else environ
    me = _self_paths()
    wanted = env.get(RUNTIME_ENV)
    if wanted and os.sep in wanted:
        if os.path.realpath(wanted) in me:
            raise ShimError(f"{RUNTIME_ENV}={wanted} is {PROG} itself")
        return wanted
    for name in [wanted] if wanted else runtimes:
        if os.sep in name:
            if os.path.isfile(name) and os.access(name, os.X_OK) and os.path.realpath(name) not in me:
                return name
            continue
        for folder in env.get("PATH", os.defpath).split(os.pathsep):
            candidate = os.path.join(folder or ".", name)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and os.path.realpath(candidate) not in me:
                return candidate
    if wanted or list(runtimes) == [DEFAULT_RUNTIME]:
        raise ShimError(f"cannot find the runtime {wanted or DEFAULT_RUNTIME!r} on PATH (set {RUNTIME_ENV})")
    raise ShimError(f"cannot find any of the config's runtimes {', '.join(runtimes)} (set {RUNTIME_ENV})")


def configured_runtimes(config_path: str | None) -> tuple[str, ...]:
    """The config's `runtimes` when $GPUHOOK_RUNTIME does not name one; a config that cannot be read names
    none (runc, the default), as it fails only a container that asks for a GPU."""
    if os.environ.get(RUNTIME_ENV):
        return (DEFAULT_RUNTIME,)
    from gpuhook.hook.config import load_config

    try:
        return load_config(config_path, warn=False).runtimes or (DEFAULT_RUNTIME,)
    except GpuhookError:
        return (DEFAULT_RUNTIME,)


def prepare(inv: Invocation, config_path: str | None) -> tuple[str, str]:
    """Rewrite the bundle's config.json for a GPU request (nothing for any other container).

    Returns (log file, log line). Everything is checked before the one atomic write, so a failure changes nothing.
    """
    from gpuhook.hook.config import load_config
    from gpuhook.hook.plan import plan_request
    from gpuhook.model.request import is_privileged, parse_request
    from gpuhook.oci.bundle import load_bundle

    try:
        config = load_config(config_path)
    except GpuhookError as exc:  # only a container that asks for a GPU fails with it (hook/unreadconfig)
        from gpuhook.hook.unreadconfig import fallback_log, started_without

        return fallback_log(config_path), f"{inv.container_id} runtime skip" + started_without(
            exc, lambda: (load_bundle(inv.bundle), None))
    bundle = load_bundle(inv.bundle)
    privileged = is_privileged(bundle.process, bundle.oci_version)
    request = parse_request(bundle.env, bundle.mounts, bundle.annotations, privileged, config.policy)
    notes = "".join(f" ({n})" for n in request.notes)
    if not request.wants_gpu_setup:
        return config.log_file, f"{inv.container_id} runtime skip request={request.kind}{notes}"
    owners = gpu_hooks(bundle.config)
    if owners:  # one injection only: `docker run --runtime gpuhook --gpus …` carries the --gpus hook too
        who = "gpuhook's prestart hook" if "gpuhook" in owners else \
            "NVIDIA's prestart hook (nvidia-container-runtime-hook)"
        return config.log_file, f"{inv.container_id} runtime skip: {who} gives this container its GPUs"
    planned = plan_request(config, request)
    check_off_volumes(bundle.rootfs, bundle.mounts, planned.edits)
    path = os.path.join(inv.bundle, "config.json")
    new = apply_edits(bundle.config, planned.edits, gpuhook_executable())
    from gpuhook.fileio.atomic import write_atomic

    write_atomic(path, (json.dumps(new, indent=2) + "\n").encode(), os.stat(path).st_mode & 0o7777)
    if request.cdi_ignored:  # the device plugin's record (hook/cdiignored.py)
        from gpuhook.hook.cdiignored import note

        notes += note(config.state_dir, inv.container_id, request.cdi_ignored, request.cdi_marker)
    return config.log_file, f"{inv.container_id} runtime inject {planned.summary()}{notes}"


def serve(args: list[str], cwd: str, take: Callable[[], None] = lambda: None) -> tuple[int, str, bytes] | None:
    """`runtime-prepare BUNDLE ID CONFIG` for `gpuhook service`: prepare() in the service's child, warm, as
    (0, "", b"<log file>\\n<log line>") or (1, the shim's one line, b""); None (declined) for another argv.
    `take()` comes before prepare() may write anything (protocol.py's TAKING and GO)."""
    if len(args) != 3:
        return None
    take()
    bundle, container_id, config_path = args
    inv = Invocation("create", bundle=os.path.join(cwd, bundle), container_id=container_id)
    try:
        log_file, line = prepare(inv, config_path or None)
    except Exception as exc:  # noqa: BLE001 - what main would print: one line, whatever failed
        return 1, f"{PROG}: {render(exc)}", b""
    return 0, "", f"{log_file}\n{line}".encode()


def prepare_anywhere(inv: Invocation, config_path: str | None) -> tuple[str, str]:
    """prepare(), by `gpuhook service` when one runs and takes it (its planning modules and inventory warm), else
    here. A service that took it and failed fails the create: never prepared twice."""
    from gpuhook.service.client import ask
    from gpuhook.service.protocol import RUNTIME_PREPARE

    answer = ask([RUNTIME_PREPARE, inv.bundle, inv.container_id, config_path or ""])
    if answer is None:
        return prepare(inv, config_path)
    code, err, out = answer
    if code != 0:
        raise ShimError(err.strip().removeprefix(f"{PROG}: ") or f"gpuhook service failed ({code})")
    log_file, _, line = out.decode(errors="replace").partition("\n")
    return log_file, line


def main(argv: Sequence[str] | None = None) -> int:
    """Prepare a create/run, then exec the real runtime with the original arguments; 1 (and no exec) on error:
    one `gpuhook-runtime: ` line (errors.render) whatever failed, never a traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    config_path = os.environ.get(CONFIG_ENV) or None
    inv = Invocation(None)
    if args[:1] in (["--version"], ["-v"]):  # its own version, then the real runtime's (runc --version)
        from gpuhook.hook.prestart import version

        print(f"{PROG} {version()} (gpuhook's OCI runtime shim)", flush=True)
    try:
        inv = parse_argv(args)
        runtime = real_runtime(runtimes=configured_runtimes(config_path))
        if inv.command in CREATE_COMMANDS and not inv.help:
            log_file, line = prepare_anywhere(inv, config_path)
            append_log(log_file, time.strftime("%Y-%m-%dT%H:%M:%S ") + line)
    except Exception as exc:  # noqa: BLE001 - GpuhookError, a stray OSError or a bug: one line
        line = f"{PROG}: {render(exc)}"
        print(line, file=sys.stderr)
        runtime_log(inv, line)  # where Docker and containerd read why a create failed
        if inv.command in CREATE_COMMANDS and not inv.help:  # the log's one line per container, refusals too
            append_log(refusal_log(config_path), time.strftime("%Y-%m-%dT%H:%M:%S ")
                       + f"{inv.container_id} runtime error: {render(exc)}")
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(runtime, [runtime, *args])
    except OSError as exc:
        print(f"{PROG}: cannot run {runtime}: {exc.strerror}", file=sys.stderr)
    return 1


def refusal_log(config_path: str | None) -> str:
    """The log file for a refused create: the config's, else where a start without a config logs."""
    from gpuhook.hook.config import load_config

    try:
        return load_config(config_path).log_file
    except GpuhookError:
        from gpuhook.hook.unreadconfig import fallback_log

        return fallback_log(config_path)


def runtime_log(inv: Invocation, message: str) -> None:
    """Write an error where runc writes its own (`--log FILE`, JSON lines under `--log-format json`): containerd
    and Docker read the reason a create failed from there, not from stderr ("unable to retrieve OCI runtime
    error" otherwise). Only into a regular file, appended, never through a link; failing to log is not an error."""
    if not inv.log:
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1e9) % 10**9:09d}Z"
    if inv.log_format == "json":
        line = json.dumps({"level": "error", "msg": message, "time": stamp})
    else:
        line = f"time={json.dumps(stamp)} level=error msg={json.dumps(message)}"
    append_log(inv.log, line, mode=0o644)


if __name__ == "__main__":
    sys.exit(main())
