"""Creating a symbolic link on the host without ever replacing anything: a link already there with the same
target is left as it is, anything else at the path (another link, a file, a node) is kept and reported."""

from __future__ import annotations

import os

from gpuhook.errors import GpuhookError

CREATED, PRESENT = "created", "present"


def ensure_link(path: str, target: str) -> str:
    """CREATED or PRESENT; raises GpuhookError naming what is in the way (never removed or changed)."""
    try:
        os.symlink(target, path)
        return CREATED
    except FileExistsError:
        pass
    except OSError as exc:
        raise GpuhookError(f"cannot create {path} -> {target}: {exc.strerror}") from None
    try:
        current = os.readlink(path)
    except OSError:
        raise GpuhookError(f"{path} exists and is not a link: kept as it is") from None
    if current != target:
        raise GpuhookError(f"{path} points to {current}, not {target}: kept as it is")
    return PRESENT
