"""A cached Inventory on disk, so the hook skips NVML and file-system scans on every container start.

The cache records the fingerprint of what it describes (driver version, node set, MIG layout, roots);
a hook that computes a different fingerprint rediscovers and rewrites it.

The cache is a hint, never an authority: whatever is at its path (a FIFO, a directory, a truncated or hostile
JSON file, one a driver change raced) must cost at most a rediscovery. So it is read non-blocking and only when
it is a regular file, loaded only when whole (`Inventory.incomplete`), and written (through fileio.atomic, which
never leaves a temp file) only from a scan whose fingerprint was the same before and after it.
"""

from __future__ import annotations

import json
import os

from gpuhook.discover.fingerprint import fingerprint
from gpuhook.discover.roots import Roots
from gpuhook.errors import GpuhookError
from gpuhook.model.inventory import Inventory

SCAN_TRIES = 2  # a driver that changes under two scans in a row is still changing: use the last, store nothing


def load_fresh(path: str, roots: Roots) -> Inventory | None:
    """The cached inventory if present, a regular file, whole and still true for `roots`; None otherwise."""
    if not path:
        return None
    from gpuhook.fileio.atomic import read_regular

    try:
        inv = Inventory.from_dict(json.loads(read_regular(path)))
    # any damaged cache (deep nesting included) only means: rediscover
    except (OSError, GpuhookError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    if inv.fingerprint != fingerprint(roots) or inv.incomplete():
        return None
    return inv


def store(path: str, inv: Inventory) -> None:
    """Best effort: a cache that cannot be written only costs speed."""
    if not path:
        return
    from gpuhook.fileio.atomic import write_atomic

    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        write_atomic(path, json.dumps(inv.to_dict()).encode(), 0o644)
    except (OSError, GpuhookError):
        pass


def scan(roots: Roots) -> tuple[Inventory, bool]:
    """A fresh inventory and whether it is stable: the fingerprint taken before the scan equals the one taken
    after it (discover's own), so nothing it describes changed while it was being read."""
    from gpuhook.discover.scan import discover

    for _ in range(SCAN_TRIES):
        before = fingerprint(roots)
        inv = discover(roots)
        if inv.fingerprint == before:
            return inv, True
    return inv, False


def inventory(roots: Roots, cache_path: str) -> Inventory:
    inv = load_fresh(cache_path, roots)
    if inv is None:
        inv, stable = scan(roots)
        if stable and not inv.incomplete():
            store(cache_path, inv)
    return inv
