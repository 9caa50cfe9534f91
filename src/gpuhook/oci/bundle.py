"""OCI state (hook stdin) and bundle config.json, read with plain json and checked field by field."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import GpuhookError


class BundleError(GpuhookError):
    """The state or config.json is missing, malformed or lacks a required field."""


@dataclass(frozen=True)
class State:
    id: str
    pid: int
    bundle: str
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Bundle:
    path: str
    rootfs: str
    config: dict[str, Any]

    @property
    def process(self) -> dict[str, Any]:
        proc = self.config.get("process")
        return proc if isinstance(proc, dict) else {}

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
        ann = self.config.get("annotations")
        return {k: v for k, v in ann.items() if isinstance(v, str)} if isinstance(ann, dict) else {}


def parse_state(text: str | bytes) -> State:
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise BundleError(f"OCI state on stdin is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BundleError("OCI state on stdin is not a JSON object")
    cid, pid, bundle = data.get("id"), data.get("pid"), data.get("bundle")
    if not isinstance(cid, str) or not cid:
        raise BundleError(f"OCI state: invalid id {cid!r}")
    if not isinstance(bundle, str) or not bundle.startswith("/") or "\0" in bundle:
        raise BundleError(f"OCI state: invalid bundle {bundle!r}")
    if pid is None:
        pid = 0
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise BundleError(f"OCI state: invalid pid {pid!r}")
    ann = data.get("annotations")
    annotations = {k: v for k, v in ann.items() if isinstance(v, str)} if isinstance(ann, dict) else {}
    return State(cid, pid, bundle, annotations)


def load_bundle(bundle_dir: str) -> Bundle:
    path = os.path.join(bundle_dir, "config.json")
    try:
        with open(path, "rb") as f:
            config = json.load(f)
    except OSError as exc:
        raise BundleError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:
        raise BundleError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BundleError(f"{path}: not a JSON object")
    root = config.get("root")
    root_path = root.get("path") if isinstance(root, dict) else None
    if not isinstance(root_path, str) or not root_path:
        raise BundleError(f"{path}: missing root.path")
    if "\0" in root_path:  # a path the kernel cannot take: fail here, not as a ValueError at first use
        raise BundleError(f"{path}: invalid root.path {root_path!r}")
    rootfs = root_path if root_path.startswith("/") else os.path.join(bundle_dir, root_path)
    return Bundle(bundle_dir, os.path.normpath(rootfs), config)
