"""A cached Inventory on disk, so the hook skips NVML and file-system scans on every container start.

The cache records the fingerprint of what it describes (driver version, node set, MIG layout, roots);
a hook that computes a different fingerprint rediscovers and rewrites it.
"""

from __future__ import annotations

import json
import os

from gpuhook.discover.fingerprint import fingerprint
from gpuhook.discover.roots import Roots
from gpuhook.model.inventory import Inventory


def load_fresh(path: str, roots: Roots) -> Inventory | None:
    """The cached inventory if present, readable and still true for `roots`; None otherwise."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            inv = Inventory.from_dict(json.load(f))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # any corrupt cache: rediscover
        return None
    if inv.fingerprint != fingerprint(roots):
        return None
    return inv


def store(path: str, inv: Inventory) -> None:
    """Best effort: a cache that cannot be written only costs speed."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(inv.to_dict(), f)
        os.replace(tmp, path)
    except OSError:
        pass


def inventory(roots: Roots, cache_path: str) -> Inventory:
    inv = load_fresh(cache_path, roots)
    if inv is None:
        from gpuhook.discover import discover

        inv = discover(roots)
        store(cache_path, inv)
    return inv
