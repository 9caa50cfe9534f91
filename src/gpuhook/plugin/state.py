"""Device health shared between the health monitor (writer) and the gRPC servicers (readers).

One board per plugin process: a dict of unhealthy underlying devices with their reasons, a version bumped on
every change, and a condition ListAndWatch streams sleep on. Allocate reads the dict without taking the lock.
"""

from __future__ import annotations

import logging
import threading
import time

Key = tuple[int, int]  # (gpu index, mig index or -1)

log = logging.getLogger("gpuhook.plugin.health")


class HealthBoard:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.unhealthy: dict[Key, str] = {}
        self.version = 0
        self.changed_at = time.monotonic()  # when the last change was published (for latency measurements)

    def set(self, key: Key, reason: str | None) -> bool:
        """Mark `key` unhealthy for `reason`, or healthy with None. True when that changed anything."""
        with self._cond:
            was = self.unhealthy.get(key)
            if (was is None) == (reason is None):
                if reason is not None and was != reason:
                    self.unhealthy = {**self.unhealthy, key: reason}  # new reason, same health: no stream message
                return False
            # Copy on write: readers (Allocate) see either the old or the new dict, never a half-updated one.
            if reason is None:
                self.unhealthy = {k: v for k, v in self.unhealthy.items() if k != key}
                log.warning("device %s healthy again (was: %s)", _name(key), was)
            else:
                self.unhealthy = {**self.unhealthy, key: reason}
                log.warning("device %s unhealthy: %s", _name(key), reason)
            self.version += 1
            self.changed_at = time.monotonic()
            self._cond.notify_all()
            return True

    def is_healthy(self, key: Key) -> bool:
        return key not in self.unhealthy

    def wait(self, seen_version: int, timeout: float) -> int:
        """Block until the version moves past `seen_version` (or timeout, or wake()); returns the version."""
        with self._cond:
            if self.version == seen_version:
                self._cond.wait(timeout)
            return self.version

    def wake(self) -> None:
        """Let every waiting stream re-check its stop flag."""
        with self._cond:
            self._cond.notify_all()


def _name(key: Key) -> str:
    return str(key[0]) if key[1] < 0 else f"{key[0]}:{key[1]}"
