"""The OCI prestart (or createRuntime) hook: `gpuhook-hook [--config FILE] [prestart|createRuntime]`.

Runs on every container start, so its import path is kept lean: no click, yaml, jsonschema, grpc or pynvml
(pynvml only when no fresh inventory cache exists). Every container takes the same path: the config, the state
and config.json through oci.bundle (the one parser of both), then, only for a container that carries a GPU signal
at all (contract.has_gpu_signal), the request parser and planning. `gpuhook hook install` writes an entry script
that starts this with `python -IS` (cli/entry.py).
"""

from __future__ import annotations

import os
import sys
import time

from gpuhook.errors import GpuhookError
from gpuhook.hook.log import append_log
from gpuhook.model import contract
from gpuhook.oci.bundle import load_bundle, parse_state, read_stdin_state, state_id

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuhook.hook.config import Config
    from gpuhook.hook.plan import Decided, Planned
    from gpuhook.model.request import Request
    from gpuhook.oci.bundle import Bundle

STAGES = ("prestart", "createRuntime")
USAGE = "usage: gpuhook-hook [--config FILE] [prestart|createRuntime]  (OCI state JSON on stdin)"


HELP = f"""{USAGE}

gpuhook's OCI prestart hook: reads the OCI state on stdin and the bundle's config.json, and gives a container
that asks for GPUs (NVIDIA_VISIBLE_DEVICES, a device volume mount, a cdi.k8s.io annotation) its devices, driver
files and ld cache; every other container is left untouched. Also run as nvidia-container-runtime-hook by
`docker run --gpus`. The config file: --config, else $GPUHOOK_CONFIG, else /etc/gpuhook/config.toml."""


def version() -> str:
    """The installed gpuhook's version (importlib.metadata only when asked: it is not on a start's path)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gpuhook")
    except PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def _parse_args(argv: list[str]) -> tuple[str | None, str]:
    config, stage = None, "prestart"
    args = list(argv)
    if args[:1] in (["--help"], ["-h"], ["--version"]):
        text = HELP if args[0] != "--version" else f"gpuhook-hook {version()}"
        import contextlib

        with contextlib.suppress(BrokenPipeError):  # `gpuhook-hook --help | head`
            print(text, flush=True)
        raise SystemExit(0)
    while args:
        arg = args.pop(0)
        if arg == "--config" and args:
            config = args.pop(0)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg in STAGES:
            stage = arg
        else:
            raise SystemExit(f"gpuhook-hook: unexpected argument {arg!r}\n{USAGE}")
    return config, stage


def decide(state_text: bytes, config: Config, plan: Callable[[Config, Request], Planned] | None = None,
           ) -> Decided | str:
    """The read-only part of a start: the state, config.json, the request and its plan; a str is the log summary
    of a container left untouched. Raises GpuhookError for a start that must fail (a refused request)."""
    state = parse_state(state_text)
    bundle = load_bundle(state.bundle)
    annotations = {**bundle.annotations, **state.annotations}
    if not contract.has_gpu_signal(bundle.env, bundle.mounts, annotations, tuple(config.swarm_resource),
                                   tuple(config.annotation_prefixes)):
        return f"{state.id} skip request=unset"
    from gpuhook.model.request import is_privileged, parse_request

    privileged = is_privileged(bundle.process, bundle.oci_version)
    request = parse_request(bundle.env, bundle.mounts, annotations, privileged, config.policy)
    notes = "".join(f" ({n})" for n in request.notes)
    if not request.wants_gpu_setup:
        return f"{state.id} skip request={request.kind}{notes}"
    if plan is None:
        from gpuhook.hook.plan import plan_request as plan
    planned = plan(config, request)
    from gpuhook.hook.plan import Decided

    if state.pid <= 0:
        from gpuhook.errors import InjectionError

        raise InjectionError("OCI state has no pid: run gpuhook-hook at the prestart or createRuntime stage")
    return Decided(state.id, state.pid, bundle.rootfs, planned.edits, planned.summary(), notes, request.cdi_ignored,
                   request.cdi_marker)


def run(state_text: bytes, config: Config, before_inject: Callable[[Decided], int | None] | None = None,
        plan: Callable[[Config, Request], Planned] | None = None, decided: Decided | None = None) -> str:
    """Handle one container; returns the log summary. Raises GpuhookError for a start that must fail.

    Everything up to the plan (decide) only reads, so the service runs it in its resident process;
    `before_inject(decided)` is called right before a container is touched (never for one that asks for no GPU,
    nor for one refused while planning). Whoever passes it promises that the process it returns in is a
    single-threaded child that may leave its mount namespace (one the service forks there, or its worker, which
    gets the decision as `decided`, so reads nothing again, and goes back to its namespace itself after the
    start), which then joins the container's mount namespace itself instead of forking once more for it. What it
    returns, when not None, is a descriptor of the container process's /proc/<pid> directory to reach it through
    instead of the state's pid (the service's client opened it where that pid means that process). `plan` is
    plan_request, or the service's memo of it."""
    if decided is None:
        outcome = decide(state_text, config, plan)
        if isinstance(outcome, str):
            return outcome
        decided = outcome
    via_fd = before_inject(decided) if before_inject is not None else None
    recorded = ""  # written by whoever injects, from the host, before injecting (nothing before this point may
    if decided.cdi_ignored:  # have an effect: the service decides, and its worker or a fork injects)
        from gpuhook.hook.cdiignored import note

        recorded = note(config.state_dir, decided.state_id, decided.cdi_ignored, decided.cdi_marker)
    try:
        injected = _inject(config, decided, before_inject is not None, via_fd)
    except Exception as exc:
        from gpuhook.inject.mounts import HostFileGone

        if not isinstance(exc, HostFileGone):
            raise
        # A driver file is gone since the plan (the driver changed under a cached or warm inventory). Nothing was
        # touched yet (_inject takes every host file before the container), so plan once more from a fresh scan.
        again = decide(state_text, config, _replan)
        if isinstance(again, str):
            return again
        decided = again
        injected = _inject(config, decided, before_inject is not None, via_fd) + " (planned again: a driver file " \
            "was gone)"
    return f"{decided.state_id} " + injected + decided.notes + recorded


def _replan(config: Config, request: Request) -> Planned:
    """plan_request on a fresh scan (cache.rescan), for a start whose plan named a host file that is gone."""
    from gpuhook.discover.cache import rescan
    from gpuhook.hook.plan import plan_request

    return plan_request(config, request, rescan(config.roots(), config.inventory_cache))


def _inject(config: Config, decided: Decided, disposable: bool, via_fd: int | None) -> str:
    """The container's files, nodes and ld cache applied, its device cgroup widened while ldconfig runs (opened
    first, from the host's mount namespace, which a `disposable` process leaves for the container's: apply.inject
    fork=False). The process is /proc/<pid>, or with `via_fd` the /proc/<pid> directory that descriptor holds
    (/proc/self/fd/N)."""
    from gpuhook.inject.apply import inject
    from gpuhook.inject.devcgroup import DeviceRule, open_grant

    edits = decided.edits
    procs, pid = ("/proc/self/fd", via_fd) if via_fd is not None else ("/proc", decided.pid)
    rules = [DeviceRule(n.type, n.major, n.minor, "rwm") for n in edits.device_nodes]
    grant = open_grant(pid, rules, proc_root=procs)
    try:
        inject(pid, decided.rootfs, edits, config.ldconfig, proc_root=config.proc_root, host_proc_root=procs,
               fork=not disposable, beside=grant.apply)
    finally:
        grant.close()
    return f"inject {decided.summary} cgroup={grant.version}"


def without_config(state_text: bytes, error: GpuhookError) -> str:
    """The log summary of a container that starts although its config could not be read (it asks for no GPU);
    raises `error` for one that asks for a GPU, or whose state cannot be read (hook/unreadconfig)."""
    from gpuhook.hook.unreadconfig import started_without

    def read() -> tuple[Bundle, dict[str, str]]:
        state = parse_state(state_text)
        bundle = load_bundle(state.bundle)
        return bundle, {**bundle.annotations, **state.annotations}

    return f"{state_id(state_text)} skip" + started_without(error, read)


def config_path_for(argv: list[str], config_env: str | None) -> str | None:
    """The config file a hook command line names: --config, else GPUHOOK_CONFIG (Docker's --gpus runs the hook
    with dockerd's environment and no --config), else None (the default file). SystemExit for a bad argv."""
    config_path, _stage = _parse_args(argv)
    return config_path or config_env or None


def handle(config_path: str | None, read_state: Callable[[], bytes], start: float,
           load: Callable[[str | None], Config] | None = None,
           before_inject: Callable[[Decided], int | None] | None = None,
           plan: Callable[[Config, Request], Planned] | None = None,
           decided: Decided | None = None, served: str = "in-process",
           log: Callable[[str, str], None] = append_log) -> tuple[int, str]:
    """One container start, as `main` and `gpuhook service` run it: (exit status, the one stderr line or "").

    Every failure (OSError and bugs included) is one escaped, bounded line (errors.render), the same text in the
    log line; `load` reads the config (the service passes its warm one); `before_inject`, `plan` and `decided`
    go to run (the service: fork or hand over there, its plan memo; its worker: the decision handed over). A
    BaseException that is no Exception (the service parent's word that a child took the start over) passes
    through, with nothing logged. `served`: who ran it, the log line's last field (`by=service`, or
    `by=in-process` with the native entry's reason for not asking the service: contract.SERVED_BY_ENV). `log`
    (path, line) writes the log line: the service holds it until its client said GO (service/calls.Held)."""
    from gpuhook.hook.unreadconfig import fallback_log

    log_file = fallback_log(config_path)  # until the config says: the host's default log for the default file only
    state_text = b""
    line = ""
    try:
        if load is None:
            from gpuhook.hook.config import load_config as load
        try:  # the config first, so that a state that cannot be read is logged where the config says
            config, unread = load(config_path), None
            log_file = config.log_file
        except GpuhookError as exc:  # only a container that asks for a GPU fails with it (hook/unreadconfig)
            config, unread = None, exc
        state_text = read_state()
        if config is None:
            summary, code = without_config(state_text, unread), 0
        else:
            summary, code = run(state_text, config, before_inject, plan, decided), 0
    except Exception as exc:  # noqa: BLE001 - a bug still fails the start with one line, never a traceback
        from gpuhook.errors import render

        what = render(exc)
        summary, code = f"{state_id(state_text)} error: {what}", 1
        line = f"gpuhook-hook: {what}"
    elapsed = (time.monotonic() - start) * 1000
    log(log_file, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {summary} took={elapsed:.1f}ms by={served}")
    return code, line


def main(argv: list[str] | None = None) -> int:
    """One container start: exit 0, or 1 with one `gpuhook-hook: ` line on stderr and the same text in the log."""
    start = time.monotonic()
    from gpuhook.hook.config import CONFIG_ENV

    config_path = config_path_for(sys.argv[1:] if argv is None else list(argv), os.environ.get(CONFIG_ENV))
    code, line = handle(config_path, read_stdin_state, start, served=os.environ.get(contract.SERVED_BY_ENV)
                        or "in-process")
    if line:
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
