"""The node-feature-discovery feature file the plugin keeps current (`--feature-file`).

Written atomically (fileio/atomic.py: NFD reads the old file or the new one, never half) at start and again
whenever the labels change: a reload after a driver upgrade or MIG change, or a device turning unhealthy or
healthy. An unchanged label set is not rewritten. A file that cannot be written is a log line, never a stop:
the devices are still served.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from gpuhook.fileio.atomic import WriteError, write_atomic
from gpuhook.model.inventory import Inventory
from gpuhook.plugin.devices import Options
from gpuhook.plugin.labels import Key, labels, render

log = logging.getLogger("gpuhook.plugin.features")

NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"


class FeatureFile:
    def __init__(self, path: str, options: Options) -> None:
        self.path = path
        self.options = options
        self.written: str | None = None  # what the file holds, as far as we know

    def update(self, inv: Inventory, unhealthy: Collection[Key]) -> bool:
        """Write the labels for `inv` and the unhealthy devices if they differ from the last write; a failed
        write is logged (and tried again at the next change or check)."""
        try:
            return self.write(inv, unhealthy)
        except WriteError as exc:
            log.warning("feature file not updated: %s", exc)
            return False

    def write(self, inv: Inventory, unhealthy: Collection[Key]) -> bool:
        """As update(), but a file that cannot be written raises WriteError (one line)."""
        text = render(labels(inv, self.options, unhealthy).items())
        if text == self.written:
            return False
        write_atomic(self.path, text.encode(), 0o644)
        self.written = text
        log.info("wrote %d labels to %s", text.count("\n"), self.path)
        return True
