"""The node's ResourceSlice: built from the devices, written through the API when it changes.

One slice per node (pool = node name, `resourceSliceCount` 1, named `<node>-gpu.nvidia.com`), owned by the Node
object when the driver may read it (so it goes with the node). Its pool generation goes up by one on every
change, above any generation a slice of this pool had (a restart continues from what the server holds); other
slices of this node and driver (a renamed node, an older driver) are deleted. The scheduler only ever sees one
generation. A background thread publishes at start and after every change (health, rediscovery) and retries
with a capped backoff while the API server cannot be reached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuhook.dra.devices import DRIVER
from gpuhook.dra.kube import Api, Conflict, KubeError, NotFound

log = logging.getLogger("gpuhook.dra.publish")

API_VERSION = "resource.k8s.io/v1"
FIRST_RETRY = 0.2
MAX_RETRY = 10.0


def slice_name(node: str, driver: str = DRIVER) -> str:
    return f"{node}-{driver}"[:253]


def build(node: str, devices: list[dict[str, Any]], generation: int, driver: str = DRIVER,
          owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ResourceSlice object (resource.k8s.io/v1)."""
    metadata: dict[str, Any] = {"name": slice_name(node, driver)}
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def _generation(obj: dict[str, Any]) -> int:
    try:
        return int(obj["spec"]["pool"]["generation"])
    except (KeyError, TypeError, ValueError):
        return 0


class Publisher:
    """Keeps the node's slice equal to `devices()`; `changed()` asks for a new look."""

    def __init__(self, api: Api, node: str, devices: Callable[[], list[dict[str, Any]]],
                 driver: str = DRIVER) -> None:
        self.api = api
        self.node = node
        self.driver = driver
        self.devices = devices
        self.generation = 0
        self.published = 0  # successful writes (create or update)
        self.published_at = 0.0  # time.monotonic() of the last write or confirmation
        self.last_error = ""
        self._owner: dict[str, Any] | None = None
        self._owner_read = False
        self._cond = threading.Condition()
        self._wanted = 1
        self._done = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    # -- one publication --------------------------------------------------------------------------------------
    def owner(self) -> dict[str, Any] | None:
        if not self._owner_read:
            self._owner_read = True
            try:
                node = self.api.get_node(self.node)
                self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node,
                               "uid": node["metadata"]["uid"], "controller": True}
            except (KubeError, KeyError, TypeError) as exc:
                log.warning("the slice will have no owner (it stays when the node is deleted): %s", exc)
        return self._owner

    def publish_once(self) -> bool:
        """Make the server's slices of this node what they should be; True when something was written."""
        devices = self.devices()
        name = slice_name(self.node, self.driver)
        existing = self.api.list_slices(self.node, self.driver)
        mine = next((s for s in existing if s.get("metadata", {}).get("name") == name), None)
        for other in existing:
            other_name = other.get("metadata", {}).get("name")
            if other is not mine and other_name:
                try:
                    self.api.delete_slice(other_name)
                    log.info("deleted stale ResourceSlice %s", other_name)
                except NotFound:
                    pass
        top = max([_generation(s) for s in existing] + [self.generation])
        if mine is not None and (mine.get("spec") or {}).get("devices", []) == devices and \
                _generation(mine) == top and mine["spec"].get("pool", {}).get("resourceSliceCount") == 1:
            self.generation = top
            self.published_at = time.monotonic()
            return False
        obj = build(self.node, devices, top + 1, self.driver, self.owner())
        if mine is None:
            self.api.create_slice(obj)
        else:
            obj["metadata"]["resourceVersion"] = mine["metadata"].get("resourceVersion")
            self.api.replace_slice(obj)
        self.generation = top + 1
        self.published += 1
        self.published_at = time.monotonic()
        log.info("published ResourceSlice %s: %d device(s), generation %d", name, len(devices), self.generation)
        return True

    # -- the thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuhook-dra-publish", daemon=True)
        self._thread.start()

    def changed(self) -> None:
        with self._cond:
            self._wanted += 1
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def wait_published(self, timeout: float) -> bool:
        """Block until everything asked for so far is on the server (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done < self._wanted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _run(self) -> None:
        delay = FIRST_RETRY
        while True:
            with self._cond:
                while not self._stopped and self._done >= self._wanted:
                    self._cond.wait()
                if self._stopped:
                    return
                wanted = self._wanted
            try:
                self.publish_once()
            except Conflict as exc:  # someone else wrote in between: look again at once
                log.info("ResourceSlice changed meanwhile (%s); publishing again", exc)
                continue
            except KubeError as exc:
                if str(exc) != self.last_error:
                    log.warning("publishing the ResourceSlice failed (retrying): %s", exc)
                self.last_error = str(exc)
                with self._cond:
                    if not self._stopped:
                        self._cond.wait(delay)
                delay = min(delay * 2, MAX_RETRY)
                continue
            except Exception:  # noqa: BLE001 - the thread must keep trying; the log says what broke
                log.exception("publishing the ResourceSlice failed (retrying)")
                with self._cond:
                    if not self._stopped:
                        self._cond.wait(delay)
                delay = min(delay * 2, MAX_RETRY)
                continue
            delay, self.last_error = FIRST_RETRY, ""
            with self._cond:
                self._done = max(self._done, wanted)
                self._cond.notify_all()
