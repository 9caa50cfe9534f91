"""Where the installed `gpuhook` lives: what CDI specs, the plugin's spec and the shim's hooks call."""

from __future__ import annotations

import os
import sys


def gpuhook_executable() -> str | None:
    """Beside this interpreter (a venv's bin), else on PATH; absolute. None when there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), "gpuhook")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return os.path.abspath(beside)
    import shutil  # only off the common path: it loads the compression modules (~8 ms)

    found = shutil.which("gpuhook")
    return os.path.abspath(found) if found else None
