"""One label of this pod's node, read now and followed as it changes (NVIDIA's `nvidia.com/device-plugin.config`
selects a node's device-plugin configuration this way).

The account needs `get`, `list` and `watch` on nodes (the chart's ClusterRole). What cannot be asked (not in a
pod, a forbidden or unreachable API) is reported, never raised: the caller keeps what it runs.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.parse
from collections.abc import Callable
from typing import Any

from gpuhook.errors import clip
from gpuhook.system.kubeapi import ACCOUNT, Api

log = logging.getLogger("gpuhook.nodelabel")
RETRY = 5.0  # seconds before a failed or ended watch is opened again


def _label(node: Any, label: str) -> str:
    labels = ((node or {}).get("metadata") or {}).get("labels") or {} if isinstance(node, dict) else {}
    value = labels.get(label, "") if isinstance(labels, dict) else ""
    return value if isinstance(value, str) else ""


class NodeLabel:
    """`current()` asks once; `follow(on_change)` calls on_change(value) from a daemon thread whenever the value
    differs from the last one seen ("" for unset, as for a deleted node)."""

    def __init__(self, node: str, label: str, account: str = ACCOUNT, server: str | None = None,
                 kubeconfig: str | None = None) -> None:
        self.node, self.label, self.account, self.server = node, label, account, server
        self.kubeconfig = kubeconfig
        self.last: str | None = None
        self._stop = threading.Event()

    def current(self, timeout: float = 5.0) -> tuple[str | None, str]:
        """(value, "") or (None, why it cannot be read)."""
        api = Api(self.account, None, self.server, self.kubeconfig)
        if api.error:
            return None, api.error
        path = f"/api/v1/nodes/{urllib.parse.quote(self.node, safe='')}"
        try:
            value = _label(api.get(path, timeout), self.label)
        except urllib.error.HTTPError as exc:
            return None, f"GET {clip(path)}: HTTP {exc.code} {clip(exc.reason, quote=False)}"
        except (OSError, ValueError) as exc:
            return None, f"GET {clip(path)}: {clip(str(exc), quote=False)}"
        self.last = value
        return value, ""

    def follow(self, on_change: Callable[[str], None]) -> None:
        threading.Thread(target=self._run, args=(on_change,), name="node-label-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, on_change: Callable[[str], None]) -> None:
        query = urllib.parse.urlencode({"watch": "1", "fieldSelector": f"metadata.name={self.node}",
                                        "timeoutSeconds": "600"})
        while not self._stop.is_set():
            api = Api(self.account, None, self.server, self.kubeconfig)
            if api.error:
                log.warning("node %s: not following label %s: %s", clip(self.node), self.label, api.error)
                return
            try:
                for event in api.watch(f"/api/v1/nodes?{query}", 660):
                    if self._stop.is_set():
                        return
                    kind = event.get("type")
                    if kind == "ERROR":
                        break
                    value = "" if kind == "DELETED" else _label(event.get("object"), self.label)
                    if kind in ("ADDED", "MODIFIED", "DELETED") and value != self.last:
                        self.last = value
                        on_change(value)
            except (OSError, ValueError, AttributeError) as exc:
                log.debug("node %s: watch ended: %s", clip(self.node), exc)
            self._stop.wait(RETRY)
