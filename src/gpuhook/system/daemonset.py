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

import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gpuhook.errors import clip

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_ANSWER = 1 << 20  # a DaemonSet is a few KiB
MAX_SECRET = 1 << 16
PRESENT, GONE, UNKNOWN = "present", "gone", "unknown"


def _small(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(MAX_SECRET).decode().strip()


class _Api:
    """The pod's API server, namespace and token, or why there is none."""

    def __init__(self, account: str, namespace: str | None, server: str | None) -> None:
        self.error = ""
        try:
            self.token = _small(os.path.join(account, "token"))
            self.namespace = namespace or _small(os.path.join(account, "namespace"))
        except (OSError, UnicodeDecodeError) as exc:
            self.error = f"no service account token in {account} ({exc.strerror or exc})"
            return
        if server is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                self.error = "KUBERNETES_SERVICE_HOST is not set (not in a pod)"
                return
            server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.server = server
        ca = os.path.join(account, "ca.crt")
        self.context = ssl.create_default_context(cafile=ca) if os.path.exists(ca) else ssl.create_default_context()

    def open(self, path: str, timeout: float) -> Any:
        request = urllib.request.Request(f"{self.server}{path}", headers={"Authorization": f"Bearer {self.token}",
                                                                          "Accept": "application/json"})
        return urllib.request.urlopen(request, context=self.context, timeout=timeout)


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
            api = _Api(self.account, self.namespace, self.server)
            if api.error:
                return
            query = urllib.parse.urlencode({"watch": "1", "fieldSelector": f"metadata.name={self.name}",
                                            "timeoutSeconds": "600"})
            try:
                path = f"/apis/apps/v1/namespaces/{api.namespace}/daemonsets?{query}"
                with api.open(path, 660) as stream:
                    for line in stream:
                        event = json.loads(line[:MAX_ANSWER])
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
    api = _Api(account, namespace, server)
    if api.error:
        return UNKNOWN, api.error
    namespace = api.namespace
    url = f"{api.server}/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}"
    try:
        with api.open(f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}", timeout) as answer:
            data = json.loads(answer.read(MAX_ANSWER))
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
