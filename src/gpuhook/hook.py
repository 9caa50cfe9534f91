"""The OCI prestart (or createRuntime) hook: `gpuhook-hook [--config FILE] [prestart|createRuntime]`.

Runs on every container start, so its import path is kept lean: no click, yaml, jsonschema, grpc or pynvml
(pynvml only when no fresh inventory cache exists). A container that carries no GPU signal at all costs the
config, a state read, a config.json parse and one log line, importing nothing but config.py and json's C
scanner (`quick_skip`, `loads`); every other container goes through the full request parser. `gpuhook hook
install` writes an entry script that starts this with `python -IS` (hook_entry.py).
"""

from __future__ import annotations

import os
import sys
import time

from . import contract

STAGES = ("prestart", "createRuntime")
USAGE = "usage: gpuhook-hook [--config FILE] [prestart|createRuntime]  (OCI state JSON on stdin)"


def append_log(path: str, line: str) -> None:
    """One line to the log file, one write with O_APPEND (concurrent hooks never interleave); best effort."""
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


# What can make a container a GPU container (request.py): the env var, a legacy CUDA image's CUDA_VERSION,
# a device volume mount, a CDI annotation. A container with none of them is "unset" under every policy.
_SIGNAL_ENV = (f"{contract.VISIBLE_DEVICES}=", f"{contract.LEGACY_CUDA_VERSION}=")
_SIGNAL_MOUNT = contract.VOLUME_MOUNT_DIR + "/"
_SIGNAL_ANNOTATION = contract.CDI_ANNOTATION_PREFIX


def _has_annotation_signal(annotations: object) -> bool:
    return isinstance(annotations, dict) and any(k.startswith(_SIGNAL_ANNOTATION) for k in annotations)


class _ScanContext:
    """What json.JSONDecoder() hands its C scanner (_json.make_scanner reads exactly these attributes)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


_WHITESPACE = " \t\n\r"  # json.decoder.WHITESPACE


def loads(data: bytes) -> object:
    """json.loads(data), without importing `json` (its decoder imports `re`, about 5 ms of a 15 ms start).

    UTF-8 without a BOM (what json.loads would decode as UTF-8 too) is parsed by the C scanner json.loads itself
    uses, with json.loads's settings; anything else, and every failure, goes to json.loads, so the result or
    the exception is always json.loads's.
    """
    try:
        from _json import make_scanner

        if b"\x00" in data[:4] or data.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
            raise ValueError("not plain UTF-8")
        text = data.decode("utf-8")
        start = len(text) - len(text.lstrip(_WHITESPACE))
        value, end = make_scanner(_ScanContext())(text, start)
        if text[end:].strip(_WHITESPACE):
            raise ValueError("extra data")
        return value
    except (ImportError, ValueError, StopIteration):
        import json

        return json.loads(data)


def read_bundle_quick(state_text: bytes) -> tuple[dict, dict] | None:
    """(state, config.json) as plain JSON when oci.bundle would accept both; None when anything is off.

    The hook's and the CDI hooks' fast path: it spares the import of oci.bundle (dataclasses pull in `inspect`,
    several ms per container start). Its checks are those of parse_state and load_bundle; on None the caller
    goes through them, so they word every error and results never differ.
    """
    try:
        state = loads(state_text)
        if not isinstance(state, dict):
            return None
        cid, pid, bundle = state.get("id"), state.get("pid"), state.get("bundle")
        if not (isinstance(cid, str) and cid and _plain_path(bundle)):
            return None
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid < 0):
            return None
        with open(os.path.join(bundle, "config.json"), "rb") as f:
            config = loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    root = config.get("root")
    if not isinstance(root, dict) or not _plain_path(root.get("path"), absolute=False):
        return None
    return state, config


def _plain_path(path: object, absolute: bool = True) -> bool:
    """A non-empty path string without control characters (absolute if asked): the only kind the fast path
    accepts; anything odd is left to oci.bundle's checks and messages."""
    return (isinstance(path, str) and path != "" and (path.startswith("/") or not absolute)
            and all(c >= " " for c in path))


def rootfs_quick(state_text: bytes) -> str | None:
    """The container's rootfs exactly as oci.bundle.load_bundle computes it, or None (see read_bundle_quick)."""
    quick = read_bundle_quick(state_text)
    if quick is None:
        return None
    state, config = quick
    root_path = config["root"]["path"]
    return os.path.normpath(root_path if root_path.startswith("/") else os.path.join(state["bundle"], root_path))


def quick_skip(state_text: bytes) -> str | None:
    """The container id when the state and bundle are well formed and carry no GPU signal, else None.

    Conservative by construction: anything unusual (see read_bundle_quick) or any signal at all answers None and
    the full path (oci.bundle, request) decides, so results never differ; this only spares most containers
    the import of the planning modules.
    """
    quick = read_bundle_quick(state_text)
    if quick is None:
        return None
    state, config = quick
    if _has_annotation_signal(state.get("annotations")) or _has_annotation_signal(config.get("annotations")):
        return None
    process = config.get("process")
    env = process.get("env") if isinstance(process, dict) else None
    if isinstance(env, list) and any(isinstance(e, str) and e.startswith(_SIGNAL_ENV) for e in env):
        return None
    mounts = config.get("mounts")
    if isinstance(mounts, list):
        for m in mounts:
            dest = m.get("destination") if isinstance(m, dict) else None
            if isinstance(dest, str) and dest.startswith(_SIGNAL_MOUNT):
                return None
    return state["id"]


def run(state_text: bytes, config) -> str:  # type: ignore[no-untyped-def]
    """Handle one container; returns the log summary. Raises GpuhookError for a start that must fail."""
    cid = quick_skip(state_text)
    if cid is not None:
        return f"{cid} skip request=unset"
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
    from .inject.apply import inject
    from .inject.devcgroup import DeviceRule, allow_devices
    from .planfor import plan_request

    planned = plan_request(config, request)
    if pid <= 0:
        from .errors import InjectionError

        raise InjectionError("OCI state has no pid: run gpuhook-hook at the prestart or createRuntime stage")
    edits = planned.edits
    inject(pid, rootfs, edits, config.ldconfig, proc_root=config.proc_root)
    cgroup = allow_devices(pid, [DeviceRule(n.type, n.major, n.minor, "rwm") for n in edits.device_nodes])
    return f"inject {planned.summary()} cgroup={cgroup}"


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
    except Exception as exc:  # noqa: BLE001 - a bug still fails the start with one line, never a traceback
        summary, code = f"{_state_id(state_text)} internal error: {type(exc).__name__}: {exc}", 1
        print(f"gpuhook-hook: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
    elapsed = (time.monotonic() - start) * 1000
    append_log(log_file, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {summary} took={elapsed:.1f}ms")
    return code


def _state_id(state_text: bytes) -> str:
    try:
        cid = loads(state_text).get("id")  # type: ignore[attr-defined]
        return cid if isinstance(cid, str) else "?"
    except (ValueError, AttributeError, RecursionError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
