"""A private Kubernetes control plane for the DRA end-to-end test: etcd, kube-apiserver and kube-scheduler on
127.0.0.1 with everything (data, certificates, tokens, logs) under one temp dir, stopped by PID.

The binaries come from $GPUHOOK_K8S_BIN (kube-apiserver, kube-scheduler, kubelet; etcd there or at
$GPUHOOK_ETCD); nothing here builds them. Authentication is static tokens (an admin in system:masters, the
scheduler, the node) and service-account tokens signed by a key made here; authorization is Node,RBAC, so the DRA
driver runs with exactly the RBAC of deploy/base/dra. The apiserver makes its own self-signed serving certificate
(--cert-dir); clients skip verifying it (this is a throwaway cluster on loopback).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .daemon import daemon_process, wait_ready

BIN_ENV = "GPUHOOK_K8S_BIN"
ETCD_ENV = "GPUHOOK_ETCD"
BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet")


def binaries() -> tuple[Path, Path] | str:
    """(k8s bin dir, etcd) or the one line saying what is missing."""
    folder = os.environ.get(BIN_ENV)
    if not folder:
        return f"${BIN_ENV} is not set (a folder with {', '.join(BINARIES)}: built outside the repository)"
    missing = [b for b in BINARIES if not os.access(os.path.join(folder, b), os.X_OK)]
    if missing:
        return f"${BIN_ENV}={folder} lacks {', '.join(missing)}"
    etcd = os.environ.get(ETCD_ENV) or os.path.join(os.environ.get("GPUHOOK_ETCD_BIN") or folder, "etcd")
    if not os.access(etcd, os.X_OK):
        etcd = shutil.which("etcd") or ""
    if not etcd:
        return f"no etcd (in ${BIN_ENV}, ${ETCD_ENV} or PATH)"
    return Path(folder), Path(etcd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "u"}}],
        "current-context": "e2e",
    }))
    return path


def wait_for(what: str, check: Any, timeout: float = 60, interval: float = 0.25) -> Any:
    """`check()`'s first true value, polled; AssertionError naming `what` and the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def node_token(name: str) -> str:
    return f"node-token-{name}"


class ControlPlane:
    def __init__(self, root: Path, bin_dir: Path, server: str, admin_token: str, first_node_token: str) -> None:
        self.root, self.bin_dir, self.server, self.admin_token = root, bin_dir, server, admin_token
        self.admin_kubeconfig = kubeconfig(root / "admin.kubeconfig", server, admin_token)
        self.node_token = first_node_token
        self._ctx = ssl.create_default_context()
        self._ctx.check_hostname = False
        self._ctx.verify_mode = ssl.CERT_NONE

    def request(self, method: str, path: str, body: Any = None, token: str | None = None,
                content_type: str = "application/json") -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {token or self.admin_token}",
                                              "Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=30) as resp:
                return resp.status, _json(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())
        except (OSError, urllib.error.URLError) as exc:
            return 0, str(exc)

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        code, out = self.request(method, path, body, **kw)
        assert 200 <= code < 300, f"{method} {path}: {code} {out}"
        return out

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        kubectl = shutil.which("kubectl")
        assert kubectl, "kubectl is not installed"
        out = subprocess.run([kubectl, "--kubeconfig", str(self.admin_kubeconfig), *args], input=stdin,
                             capture_output=True, text=True, timeout=60, check=False)
        if check:
            assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}{out.stdout}"
        return out

    def wait(self, what: str, predicate: Any, timeout: float = 60, interval: float = 0.25) -> Any:
        return wait_for(what, predicate, timeout, interval)

    def service_account_token(self, namespace: str, name: str) -> str:
        out = self.ok("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                      {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                       "spec": {"expirationSeconds": 3600}})
        return str(out["status"]["token"])


@contextlib.contextmanager
def control_plane(root: Path, bin_dir: Path, etcd: Path, node: str | list[str], scheduler: bool = True,
                  controller_manager: bool = False) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver (+ kube-scheduler, + kube-controller-manager) under `root`; yields once /readyz
    answers. With the controller manager, service accounts work as in a real cluster (the ServiceAccount
    admission plugin on, tokens and the root CA's ConfigMap made by its controllers)."""
    nodes = [node] if isinstance(node, str) else node
    root.mkdir(parents=True, exist_ok=True)
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    admin_token = "admin-token-e2e"
    (root / "tokens.csv").write_text(
        f'{admin_token},admin,admin,"system:masters"\n'
        "scheduler-token-e2e,system:kube-scheduler,scheduler\n"
        'controller-manager-token-e2e,controller-manager,controller-manager,"system:masters"\n'
        + "".join(f'{node_token(n)},system:node:{n},node-{n},"system:nodes"\n' for n in nodes))
    sa_key = root / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
    server = f"https://127.0.0.1:{api_port}"
    with contextlib.ExitStack() as stack:
        etcd_dir = root / "etcd"
        etcd_proc = stack.enter_context(daemon_process(
            [str(etcd), "--data-dir", str(etcd_dir), "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
             "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}", "--unsafe-no-fsync"],
            {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, root, "etcd.log"))
        wait_ready(etcd_proc, lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), "etcd", root / "etcd.log", 30)
        api_proc = stack.enter_context(daemon_process(
            [str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
             "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
             f"--cert-dir={root / 'apiserver-certs'}", f"--token-auth-file={root / 'tokens.csv'}",
             "--authorization-mode=Node,RBAC", f"--service-account-key-file={sa_key}",
             f"--service-account-signing-key-file={sa_key}", "--service-account-issuer=https://kubernetes.default.svc",
             "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
             "--enable-admission-plugins=NodeRestriction",
             *([] if controller_manager else ["--disable-admission-plugins=ServiceAccount"]),
             "--endpoint-reconciler-type=none", "--storage-media-type=application/json", "--v=1"],
            {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, root, "apiserver.log"))
        plane = ControlPlane(root, bin_dir, server, admin_token, node_token(nodes[0]))
        wait_ready(api_proc, lambda: plane.request("GET", "/readyz")[0] == 200, "kube-apiserver",
                   root / "apiserver.log", 120, 0.5)
        if scheduler:
            sched_config = kubeconfig(root / "scheduler.kubeconfig", server, "scheduler-token-e2e")
            stack.enter_context(daemon_process(
                [str(bin_dir / "kube-scheduler"), f"--kubeconfig={sched_config}",
                 f"--authentication-kubeconfig={sched_config}", f"--authorization-kubeconfig={sched_config}",
                 "--leader-elect=false", "--secure-port=0", "--v=2"],
                {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, root, "scheduler.log"))
        if controller_manager:
            cm_config = kubeconfig(root / "controller-manager.kubeconfig", server, "controller-manager-token-e2e")
            # the self-signed serving certificate's file holds the certificate, then the CA that signed it
            blocks = (root / "apiserver-certs" / "apiserver.crt").read_text().split("-----END CERTIFICATE-----")
            (root / "ca.crt").write_text(blocks[-2].strip() + "\n-----END CERTIFICATE-----\n")
            stack.enter_context(daemon_process(
                [str(bin_dir / "kube-controller-manager"), f"--kubeconfig={cm_config}",
                 f"--authentication-kubeconfig={cm_config}", f"--authorization-kubeconfig={cm_config}",
                 f"--service-account-private-key-file={sa_key}",
                 f"--root-ca-file={root / 'ca.crt'}",
                 "--controllers=*,-csrsigning,-csrapproving,-csrcleaner,-nodeipam",
                 "--leader-elect=false", "--secure-port=0", "--node-monitor-grace-period=20s", "--v=1"],
                {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, root, "controller-manager.log"))
        yield plane


def _json(data: bytes) -> Any:
    try:
        return json.loads(data or b"null")
    except ValueError:
        return data.decode(errors="replace")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False
