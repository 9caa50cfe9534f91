"""The OCI runtime's inputs, parsed once: the state a hook reads on stdin and the bundle's config.json.

The prestart hook, the CDI spec's container hook, the shim and doctor all read them through this module, so an
input is accepted or refused with the same words on every path, and the container with no GPU request takes the
same code as any other. The standard `json` parses: measured here with `python -IS`, it imports in about 7 ms
where orjson 3.9-3.13 costs about 20 ms (its module init loads dataclasses, uuid, datetime, zoneinfo and enum).
Plain classes with `__slots__` instead of dataclasses keep `inspect` off the hook's path.
"""

from __future__ import annotations

import json
import os
import sys

from gpuhook.errors import GpuhookError, clip

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any


MAX_DOCUMENT = 64 << 20  # the most of a state or a config.json read: far above what any runtime writes


class BundleError(GpuhookError):
    """The state or config.json is missing, malformed or lacks a required field."""


def read_bounded(stream: Any, what: str) -> bytes:
    """All of `stream` when it holds at most MAX_DOCUMENT bytes, else BundleError naming `what`: a hook reads its
    inputs whole, never without bound."""
    data = stream.read(MAX_DOCUMENT + 1)
    if len(data) > MAX_DOCUMENT:
        raise BundleError(f"{what} is over {MAX_DOCUMENT >> 20} MiB")
    return data


def read_stdin_state() -> bytes:
    """The OCI state on stdin (read_bounded)."""
    return read_bounded(sys.stdin.buffer, "OCI state on stdin")


def _strings(value: object) -> dict[str, str]:
    return {k: v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}


class State:
    """The OCI state: what runc hands a hook on stdin."""

    __slots__ = ("id", "pid", "bundle", "annotations")

    def __init__(self, id: str, pid: int, bundle: str, annotations: dict[str, str] | None = None) -> None:
        self.id, self.pid, self.bundle, self.annotations = id, pid, bundle, annotations or {}

    def __repr__(self) -> str:
        return f"State(id={self.id!r}, pid={self.pid}, bundle={self.bundle!r})"


class Bundle:
    """A bundle's config.json, with the fields gpuhook reads, each checked for its type where it is read."""

    __slots__ = ("path", "rootfs", "config")

    def __init__(self, path: str, rootfs: str, config: dict[str, Any]) -> None:
        self.path, self.rootfs, self.config = path, rootfs, config

    @property
    def process(self) -> dict[str, Any]:
        proc = self.config.get("process")
        return proc if isinstance(proc, dict) else {}

    @property
    def oci_version(self) -> str:
        version = self.config.get("ociVersion")
        return version if isinstance(version, str) else ""

    @property
    def env(self) -> list[str]:
        env = self.process.get("env")
        return [e for e in env if isinstance(e, str)] if isinstance(env, list) else []

    @property
    def mounts(self) -> list[dict[str, Any]]:
        mounts = self.config.get("mounts")
        return [m for m in mounts if isinstance(m, dict)] if isinstance(mounts, list) else []

    @property
    def annotations(self) -> dict[str, str]:
        return _strings(self.config.get("annotations"))

    @property
    def linux(self) -> dict[str, Any]:
        linux = self.config.get("linux")
        return linux if isinstance(linux, dict) else {}


def _field(data: dict[str, Any], name: str) -> object:
    if name not in data:
        raise BundleError(f"OCI state: missing {name}")
    return data[name]


def parse_state(text: str | bytes) -> State:
    """The state JSON -> State; BundleError naming the field that is missing or wrong."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also text that is not UTF-8
        raise BundleError(f"OCI state on stdin is not JSON: {clip(str(exc))}") from None
    if not isinstance(data, dict):
        raise BundleError("OCI state on stdin is not a JSON object")
    cid, bundle = _field(data, "id"), _field(data, "bundle")
    if not isinstance(cid, str) or not cid:
        raise BundleError(f"OCI state: invalid id {clip(cid)}")
    if not isinstance(bundle, str) or not bundle.startswith("/") or "\0" in bundle:
        raise BundleError(f"OCI state: invalid bundle {clip(bundle)}")
    pid = data.get("pid")
    if pid is None:
        pid = 0
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise BundleError(f"OCI state: invalid pid {clip(pid)}")
    return State(cid, pid, bundle, _strings(data.get("annotations")))


def load_bundle(bundle_dir: str) -> Bundle:
    """`<bundle_dir>/config.json` -> Bundle (rootfs resolved against the bundle as runc does)."""
    path = os.path.join(bundle_dir, "config.json")
    try:
        with open(path, "rb") as f:
            config = json.loads(read_bounded(f, clip(path, quote=False)))
    except OSError as exc:
        raise BundleError(f"cannot read {clip(path, quote=False)}: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:
        raise BundleError(f"{clip(path, quote=False)} is not valid JSON: {clip(str(exc))}") from None
    if not isinstance(config, dict):
        raise BundleError(f"{clip(path, quote=False)}: not a JSON object")
    root = config.get("root")
    root_path = root.get("path") if isinstance(root, dict) else None
    if not isinstance(root_path, str) or not root_path:
        raise BundleError(f"{clip(path, quote=False)}: missing root.path")
    if "\0" in root_path:  # a path the kernel cannot take: fail here, not as a ValueError at first use
        raise BundleError(f"{clip(path, quote=False)}: invalid root.path {clip(root_path)}")
    rootfs = root_path if root_path.startswith("/") else os.path.join(bundle_dir, root_path)
    return Bundle(bundle_dir, os.path.normpath(rootfs), config)


def state_id(text: bytes) -> str:
    """The state's id for a log line, whatever else is wrong with it ('?' when there is none)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return "?"
    cid = data.get("id") if isinstance(data, dict) else None
    return clip(cid, quote=False) if isinstance(cid, str) and cid else "?"
