"""Whether the DaemonSet that runs this pod is still there, asked of the API server with the pod's own service
account (the standard library's HTTP client: one GET, no client library loaded for it).

A node component's pod stops for two very different reasons. Its DaemonSet was deleted (`helm uninstall`,
`kubectl delete -k`): the node must be left as it was before gpuhook, so the pod takes its changes off. Or the
DaemonSet stays and only the pod goes (a rolling update, a restart, an eviction): its successor comes at once and
takes over what it left, so taking it off would only break GPU pods started in between (and restart the node's
runtime twice for nothing). The pod cannot tell the two apart from its signal; the API can. The account needs
`get` on that one DaemonSet (the chart's Role names it).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request

from gpuhook.errors import clip

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_ANSWER = 1 << 20  # a DaemonSet is a few KiB
MAX_SECRET = 1 << 16
PRESENT, GONE, UNKNOWN = "present", "gone", "unknown"


def _small(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(MAX_SECRET).decode().strip()


def state(name: str, namespace: str | None = None, account: str = ACCOUNT, server: str | None = None,
          timeout: float = 5.0) -> tuple[str, str]:
    """(PRESENT | GONE | UNKNOWN, why): GONE when the API says the DaemonSet does not exist or is being deleted;
    UNKNOWN (with the reason) when it cannot be asked, which callers treat as "keep what is installed"."""
    try:
        token = _small(os.path.join(account, "token"))
        namespace = namespace or _small(os.path.join(account, "namespace"))
    except (OSError, UnicodeDecodeError) as exc:
        return UNKNOWN, f"no service account token in {account} ({exc.strerror or exc})"
    if server is None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            return UNKNOWN, "KUBERNETES_SERVICE_HOST is not set (not in a pod)"
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    context = ssl.create_default_context(cafile=os.path.join(account, "ca.crt")) \
        if os.path.exists(os.path.join(account, "ca.crt")) else ssl.create_default_context()
    url = f"{server}/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                                   "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=timeout) as answer:
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
