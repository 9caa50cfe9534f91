"""The pod's own API server, reached with its service account (the standard library's HTTP client: a node
component asks one or two questions, so no client library is loaded for them).

`Api` says why there is no server (not in a pod, no token) instead of raising: every caller has a safe answer
for "cannot ask" (keep what is installed, keep the current configuration). Every answer is read bounded.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import urllib.request
from collections.abc import Iterator
from typing import Any

from gpuhook.errors import clip

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_ANSWER = 1 << 20  # a DaemonSet or a Node is a few KiB; one watch event is one line
MAX_SECRET = 1 << 16


def _small(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(MAX_SECRET).decode().strip()


class Api:
    """The pod's API server, namespace and token, or (`error`) why there is none. With `kubeconfig` (a process
    run outside a pod, as NVIDIA's --kubeconfig), that file's current context instead of the service account."""

    def __init__(self, account: str = ACCOUNT, namespace: str | None = None, server: str | None = None,
                 kubeconfig: str | None = None) -> None:
        self.error, self.token = "", ""
        if kubeconfig:
            try:
                self._kubeconfig(kubeconfig, namespace)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, ssl.SSLError) as exc:
                self.error = f"kubeconfig {clip(kubeconfig)}: {clip(str(exc), quote=False)}"
            return
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

    def _kubeconfig(self, path: str, namespace: str | None) -> None:
        """current-context's server, CA (file, data or insecure-skip-tls-verify), token (or tokenFile) and
        client certificate files; a missing piece is a KeyError/ValueError the caller reports."""
        import yaml

        with open(path, "rb") as f:
            data = yaml.safe_load(f.read(MAX_ANSWER))
        named = {kind: {item["name"]: item[kind[:-1]] for item in data.get(kind) or []}
                 for kind in ("clusters", "contexts", "users")}
        context = named["contexts"][data["current-context"]]
        cluster, user = named["clusters"][context["cluster"]], named["users"].get(context.get("user"), {}) or {}
        self.server = str(cluster["server"]).rstrip("/")
        self.namespace = namespace or context.get("namespace") or "default"
        if cluster.get("insecure-skip-tls-verify"):
            self.context = ssl.create_default_context()
            self.context.check_hostname, self.context.verify_mode = False, ssl.CERT_NONE
        elif cluster.get("certificate-authority-data"):
            self.context = ssl.create_default_context(
                cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
        else:
            self.context = ssl.create_default_context(cafile=cluster.get("certificate-authority"))
        if user.get("client-certificate"):
            self.context.load_cert_chain(user["client-certificate"], user.get("client-key"))
        if user.get("token"):
            self.token = str(user["token"])
        elif user.get("tokenFile"):
            self.token = _small(user["tokenFile"])

    def open(self, path: str, timeout: float) -> Any:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(f"{self.server}{path}", headers=headers)
        return urllib.request.urlopen(request, context=self.context, timeout=timeout)

    def get(self, path: str, timeout: float) -> Any:
        """One object (raises urllib.error.HTTPError, OSError or ValueError)."""
        with self.open(path, timeout) as answer:
            return json.loads(answer.read(MAX_ANSWER))

    def watch(self, path: str, timeout: float) -> Iterator[dict[str, Any]]:
        """The events of one watch (`path` with `watch=1`), each line read bounded, until the server ends it."""
        with self.open(path, timeout) as stream:
            while True:
                line = stream.readline(MAX_ANSWER)
                if not line:
                    return
                event = json.loads(line)
                if isinstance(event, dict):
                    yield event
