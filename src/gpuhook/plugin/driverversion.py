"""Whether the loaded driver is still the one discovered: the device plugin and the DRA driver discover again
after a driver upgrade, which they learn from procfs's version file, read at most every CHECK_INTERVAL."""

from __future__ import annotations

import logging
import time

from gpuhook.errors import GpuhookError
from gpuhook.model.inventory import Inventory

CHECK_INTERVAL = 2.0  # seconds between reads of the driver's version file
log = logging.getLogger(__name__)


def loaded_version(inventory: Inventory | None) -> str:
    """The loaded driver's version from the inventory's procfs, "" when it cannot be read."""
    if inventory is None:
        return ""
    from gpuhook.discover import procfs

    try:
        return procfs.driver_version(inventory.proc_root)
    except GpuhookError:
        return ""


class VersionWatch:
    """changed(): a loaded driver whose version differs from `known` (an upgrade: discover again)."""

    def __init__(self) -> None:
        self.checked = 0.0

    def changed(self, inventory: Inventory | None, known: str) -> bool:
        now = time.monotonic()
        if now - self.checked < CHECK_INTERVAL:
            return False
        self.checked = now
        current = loaded_version(inventory)
        if current and known and current != known:
            log.warning("driver version changed from %s to %s", known, current)
            return True
        return False
