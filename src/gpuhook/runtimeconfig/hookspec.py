"""The one description of gpuhook's prestart hook, as oci-hooks(5) JSON and as an OCI `hooks` entry.

`oci-hooks.d/gpuhook.json` in the source tree is this module's output for DEFAULT_HOOK_PATH (a test checks it),
so the file a user copies and the file `runtime configure` installs never drift apart.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

from gpuhook.model.contract import HOOK_PATH, PACKAGED_HOOK_PATH

DEFAULT_HOOK_PATH = "/usr/local/bin/gpuhook-hook"
HOOK_NAME = "gpuhook-hook"
HOOK_ARGS = (HOOK_NAME, "prestart")
# A hook with `env` gets exactly this: never the container's environment, never the runtime's.
HOOK_ENV = ("PATH=" + ":".join(HOOK_PATH),)
HOOKS_D_FILE = "gpuhook.json"
OCI_HOOKS_VERSION = "1.0.0"


def oci_hook(path: str, config: str | None = None) -> dict[str, Any]:
    """The entry for config.json `hooks.prestart` (runc, containerd's base spec); `config`: the hook's own
    config file, passed as `--config FILE` (gpuhook-hook's usage: `[--config FILE] [prestart|createRuntime]`)."""
    name, stage = HOOK_ARGS
    args = [name, "--config", config, stage] if config else [name, stage]
    return {"path": path, "args": args, "env": list(HOOK_ENV)}


def hooks_d_config(path: str, config: str | None = None) -> dict[str, Any]:
    """oci-hooks(5) 1.0.0 for podman and CRI-O; `always` because the hook itself decides, see oci-hooks.d/."""
    return {
        "version": OCI_HOOKS_VERSION,
        "hook": oci_hook(path, config),
        "when": {"always": True},
        "stages": ["prestart"],
    }


def render_json(data: Any) -> str:
    """JSON as gpuhook writes it: 2-space indent, key order kept, non-ASCII kept, final newline."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def default_hook_path() -> str:
    """The hook `runtime configure` registers without --hook-path: where `gpuhook hook install` writes it, else
    the Debian package's entry when that is what this host has."""
    if not os.path.isfile(DEFAULT_HOOK_PATH) and os.path.isfile(PACKAGED_HOOK_PATH):
        return PACKAGED_HOOK_PATH
    return DEFAULT_HOOK_PATH


def installed_hook_path() -> str:
    """`gpuhook-hook` beside this interpreter (a venv's bin), else on PATH, else the beside path anyway."""
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), HOOK_NAME)
    if os.path.isfile(beside):
        return beside
    found = shutil.which(HOOK_NAME)
    return os.path.abspath(found) if found else beside
