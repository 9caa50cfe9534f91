"""Whether the DaemonSet that runs this pod is still there, asked of the API server with the pod's own service
account (the standard library's HTTP client: one GET, no client library loaded for it).

A node component's pod stops for two very different reasons. Its DaemonSet was deleted (`helm uninstall`,
`kubectl delete -k`): the node must be left as it was before gpuhook, so the pod takes its changes off. Or the
DaemonSet stays and only the pod goes (a rolling update, a restart, an eviction): its successor comes at once and
takes over what it left, so taking it off would only break GPU pods started in between (and restart the node's
runtime twice for nothing). The pod cannot tell the two apart from its signal; the API can. The account needs
`get`, `list` and `watch` on that one DaemonSet (the chart's Role names it).

Asking only at SIGTERM is too late after an uninstall: `helm uninstall` deletes the DaemonSet and then, at once,
the Role, its binding and the ServiceAccount, so by the time the pods get their signal the question is
forbidden. `Watch` follows the DaemonSet from the pod's start instead, on one long-lived watch that was
authorized when it began: its deletion is seen as it happens.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.parse

from gpuhook.errors import clip
from gpuhook.system.kubeapi import ACCOUNT, Api

PRESENT, GONE, UNKNOWN = "present", "gone", "unknown"


class Watch:
    """Follows one DaemonSet from now on (a daemon thread, one watch at a time, opened again when the server
    ends it); `state()` says GONE once its deletion was seen, else asks afresh."""

    def __init__(self, name: str, namespace: str | None = None, account: str = ACCOUNT,
                 server: str | None = None) -> None:
        self.name, self.namespace, self.account, self.server = name, namespace, account, server
        self.gone: str | None = None
        threading.Thread(target=self._run, name="daemonset-watch", daemon=True).start()

    def _run(self) -> None:
        while self.gone is None:
            api = Api(self.account, self.namespace, self.server)
            if api.error:
                return
            query = urllib.parse.urlencode({"watch": "1", "fieldSelector": f"metadata.name={self.name}",
                                            "timeoutSeconds": "600"})
            try:
                path = f"/apis/apps/v1/namespaces/{api.namespace}/daemonsets?{query}"
                for event in api.watch(path, 660):
                    meta = (event.get("object") or {}).get("metadata") or {}
                    if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
                        self.gone = f"DaemonSet {api.namespace}/{self.name} was deleted"
                        return
            except (OSError, ValueError, AttributeError):
                time.sleep(5)

    def state(self, timeout: float = 5.0) -> tuple[str, str]:
        if self.gone is not None:
            return GONE, self.gone
        return state(self.name, self.namespace, self.account, self.server, timeout)


def state(name: str, namespace: str | None = None, account: str = ACCOUNT, server: str | None = None,
          timeout: float = 5.0) -> tuple[str, str]:
    """(PRESENT | GONE | UNKNOWN, why): GONE when the API says the DaemonSet does not exist or is being deleted;
    UNKNOWN (with the reason) when it cannot be asked, which callers treat as "keep what is installed"."""
    api = Api(account, namespace, server)
    if api.error:
        return UNKNOWN, api.error
    namespace = api.namespace
    url = f"{api.server}/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}"
    try:
        data = api.get(f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}", timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return GONE, f"DaemonSet {namespace}/{name} is gone"
        return UNKNOWN, f"GET {clip(url)}: HTTP {exc.code} {clip(exc.reason, quote=False)}"
    except (OSError, ValueError) as exc:
        return UNKNOWN, f"GET {clip(url)}: {clip(str(exc), quote=False)}"
    if not isinstance(data, dict) or not isinstance(data.get("metadata"), dict):
        return UNKNOWN, f"GET {clip(url)}: not a DaemonSet"
    if data["metadata"].get("deletionTimestamp"):
        return GONE, f"DaemonSet {namespace}/{name} is being deleted"
    return PRESENT, f"DaemonSet {namespace}/{name} is still there"
