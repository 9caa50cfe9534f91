"""How an installed hook entry is recognised: the marker line `gpuhook hook install` writes into it, and the
names it is installed under (its own, and NVIDIA's, which `docker run --gpus` runs). Install, doctor and the
generate-cdi default all ask here, so "is this file gpuhook's" has one answer."""

from __future__ import annotations

import os
import stat

DEFAULT_PATH = "/usr/local/bin/gpuhook-hook"
# Docker registers its `--gpus` driver only when this name is on dockerd's PATH at daemon start, and runs it as
# `nvidia-container-runtime-hook prestart` (moby daemon/nvidia_linux.go): the same entry, under NVIDIA's name.
DOCKER_GPUS_NAME = "nvidia-container-runtime-hook"
MARKER = "# gpuhook's OCI hook (and CDI createContainer hook) entry, written by `gpuhook hook install`."
# The native entry (_native/entry.c) at the hook path execs this beside it, the Python entry script, when no
# service listens: `<path>.py`.
FALLBACK_SUFFIX = ".py"
_ELF_SCAN = 1 << 20  # the native entry holds MARKER in its read-only data, well within its first MiB


def is_ours(path: str) -> bool | None:
    """Whether `path` is an entry script gpuhook wrote (None: nothing there). A link is never ours: replacing it
    would replace what it points to for whoever made it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
            if head.startswith(b"\x7fELF"):
                head += f.read(_ELF_SCAN)
            return MARKER.encode() in head
    except OSError:
        return False


# What the entry script imports (cli/entry.entry_script), and so what must import for an entry to run.
ENTRY_MODULES = ("gpuhook.cli.entry", "gpuhook.cli.leave", "gpuhook.hook.prestart", "gpuhook._native")


def import_problem(python: str, paths: list[str], timeout: float | None = None) -> str:
    """Why `python -IS` cannot import the entry's modules from `paths` alone, as the entry script runs (its last
    line of stderr); '' when it can. Install checks before writing an entry, doctor an installed one."""
    import subprocess

    code = f"import sys; sys.path += {list(paths)!r}; import {', '.join(ENTRY_MODULES)}"
    result = subprocess.run([python, "-IS", "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=timeout, check=False)  # fmt: skip
    if result.returncode == 0:
        return ""
    return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
