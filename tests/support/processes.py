"""Paths and commands the Kubernetes tests share that need no gRPC (so the host-install matrix can collect them)."""

from __future__ import annotations

import os


def short_tempdir(prefix: str = "dp") -> str:
    """A temp dir short enough for unix socket paths (108 bytes) whatever the test's name."""
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def gpuhook_command() -> list[str]:
    """The installed `gpuhook` beside this Python, else `python -m gpuhook.cli`."""
    import sys

    beside = os.path.join(os.path.dirname(sys.executable), "gpuhook")
    return [beside] if os.access(beside, os.X_OK) else [sys.executable, "-m", "gpuhook.cli"]
