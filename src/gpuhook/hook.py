"""The OCI prestart (or createRuntime) hook: `gpuhook-hook [--config FILE] [prestart|createRuntime]`.

Runs on every container start, so its import path is kept lean: no click, yaml, jsonschema, grpc or pynvml
(pynvml only when no fresh inventory cache exists). A container without a GPU request costs a state read,
a config.json parse and one log line.
"""

from __future__ import annotations

import os
import sys
import time

STAGES = ("prestart", "createRuntime")
USAGE = "usage: gpuhook-hook [--config FILE] [prestart|createRuntime]  (OCI state JSON on stdin)"


def _log(path: str, line: str) -> None:
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    except OSError:
        return
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _parse_args(argv: list[str]) -> tuple[str | None, str]:
    config, stage = None, "prestart"
    args = list(argv)
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


def run(state_text: bytes, config) -> str:  # type: ignore[no-untyped-def]
    """Handle one container; returns the log summary. Raises GpuhookError for a start that must fail."""
    from .oci.bundle import load_bundle, parse_state
    from .request import is_privileged, parse_request

    state = parse_state(state_text)
    bundle = load_bundle(state.bundle)
    annotations = {**bundle.annotations, **state.annotations}
    request = parse_request(bundle.env, bundle.mounts, annotations, is_privileged(bundle.process), config.policy)
    notes = "".join(f" ({n})" for n in request.notes)
    if not request.wants_gpu_setup:
        return f"{state.id} skip request={request.kind}{notes}"
    return f"{state.id} " + _inject(config, state.pid, bundle.rootfs, request) + notes


def _inject(config, pid: int, rootfs: str, request) -> str:  # type: ignore[no-untyped-def]
    from . import require
    from .discover.roots import Roots
    from .edits import plan
    from .inject.apply import inject
    from .inject.devcgroup import DeviceRule, allow_devices
    from .invcache import inventory
    from .select import resolve

    roots = Roots.make(config.driver_root, config.dev_root or None, config.proc_root)
    inv = inventory(roots, config.inventory_cache)
    selection = resolve(inv, request)
    require.check(inv, request.requirements, selection.devices)
    edits = plan(inv, selection)
    if pid <= 0:
        from .errors import InjectionError

        raise InjectionError("OCI state has no pid: run gpuhook-hook at the prestart or createRuntime stage")
    inject(pid, rootfs, edits, config.ldconfig, proc_root=config.proc_root)
    cgroup = allow_devices(pid, [DeviceRule(n.type, n.major, n.minor, "rwm") for n in edits.device_nodes])
    names = ",".join(d.uuid or str(d.index) for d in selection.devices) or "none"
    caps = ",".join(sorted(selection.capabilities))
    return (f"inject devices={names} caps={caps} nodes={len(edits.device_nodes)} mounts={len(edits.mounts)} "
            f"links={len(edits.symlinks)} cgroup={cgroup}")


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    from .errors import GpuhookError

    config_path, _stage = _parse_args(sys.argv[1:] if argv is None else argv)
    log_file = "/var/log/gpuhook.log"
    state_text = sys.stdin.buffer.read()
    try:
        from .config import load_config

        config = load_config(config_path)
        log_file = config.log_file
        summary, code = run(state_text, config), 0
    except (GpuhookError, OSError) as exc:
        summary, code = f"{_state_id(state_text)} error: {exc}", 1
        print(f"gpuhook-hook: {exc}", file=sys.stderr)
    elapsed = (time.monotonic() - start) * 1000
    _log(log_file, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {summary} took={elapsed:.1f}ms")
    return code


def _state_id(state_text: bytes) -> str:
    import json

    try:
        cid = json.loads(state_text).get("id")
        return cid if isinstance(cid, str) else "?"
    except (ValueError, AttributeError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
