"""system/daemonset.state and Watch against a real kube-apiserver (tests/support/k8s.py's control plane,
Kubernetes built by .ci/build-k8s): what node-setup asks when its pod stops, with exactly the RBAC the chart gives it. A
DaemonSet that is there is PRESENT; deleted, GONE; deleted with a finalizer holding it, GONE (being deleted);
a token without the Role, or no API at all, UNKNOWN with the reason (node-setup then keeps its install)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import need
from support.k8s import binaries, control_plane
from support.processes import short_tempdir

from gpuhook.system import daemonset

pytestmark = pytest.mark.e2e
CHART_RBAC = Path(__file__).resolve().parent.parent / "deploy/base/node-setup/rbac.yaml"
PATHS = {"ServiceAccount": "/api/v1/namespaces/gpuhook/serviceaccounts",
         "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/gpuhook/roles",
         "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/gpuhook/rolebindings"}
DS = "/apis/apps/v1/namespaces/gpuhook/daemonsets"


def _daemonset(finalizer: bool = False) -> dict[str, Any]:
    labels = {"app": "node-setup"}
    meta: dict[str, Any] = {"name": "gpuhook-node-setup"}
    if finalizer:
        meta["finalizers"] = ["gpuhook.test/hold"]
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta,
            "spec": {"selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "e2e.local/busybox:1"}]}}}}


def _account(folder: Path, token: str, ca: Path) -> Path:
    folder.mkdir()
    (folder / "token").write_text(token)
    (folder / "namespace").write_text("gpuhook\n")
    shutil.copy(ca, folder / "ca.crt")
    return folder


def test_present_gone_being_deleted_and_unknown() -> None:
    found = binaries()
    need(not isinstance(found, str), f"no Kubernetes binaries: {found}")
    assert not isinstance(found, str)
    bin_dir, etcd = found
    root = Path(short_tempdir("dss"))
    try:
        with control_plane(root / "plane", bin_dir, etcd, "node1", scheduler=False) as plane:
            plane.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": "gpuhook"}})
            for doc in yaml.safe_load_all(CHART_RBAC.read_text()):
                plane.ok("POST", PATHS[doc["kind"]], doc)
            plane.ok("POST", "/api/v1/namespaces/gpuhook/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "other"}})
            ca = next((root / "plane" / "apiserver-certs").glob("*.crt"))
            server = plane.server  # https://127.0.0.1:<port>, a name of the self-signed certificate
            account = _account(root / "sa", plane.service_account_token("gpuhook", "gpuhook-node-setup"), ca)

            def state() -> tuple[str, str]:
                return daemonset.state("gpuhook-node-setup", account=str(account), server=server)

            assert state() == (daemonset.GONE, "DaemonSet gpuhook/gpuhook-node-setup is gone")
            plane.ok("POST", DS, _daemonset())
            assert state() == (daemonset.PRESENT, "DaemonSet gpuhook/gpuhook-node-setup is still there")
            plane.ok("DELETE", f"{DS}/gpuhook-node-setup")
            assert state()[0] == daemonset.GONE
            plane.ok("POST", DS, _daemonset(finalizer=True))
            plane.ok("DELETE", f"{DS}/gpuhook-node-setup")
            assert state() == (daemonset.GONE, "DaemonSet gpuhook/gpuhook-node-setup is being deleted")
            plane.ok("PATCH", f"{DS}/gpuhook-node-setup", {"metadata": {"finalizers": None}},
                     content_type="application/merge-patch+json")
            # another account (no Role): forbidden, so unknown, never "gone"
            other = _account(root / "other", plane.service_account_token("gpuhook", "other"), ca)
            verdict, why = daemonset.state("gpuhook-node-setup", account=str(other), server=server)
            assert verdict == daemonset.UNKNOWN and "HTTP 403" in why
            # the Role names one DaemonSet: another's state is not ours to read
            verdict, why = daemonset.state("kube-proxy", account=str(account), server=server)
            assert verdict == daemonset.UNKNOWN and "HTTP 403" in why
            # an uninstall: the DaemonSet deleted, then at once the account's RoleBinding and the account itself,
            # before the pods are told to stop; a watch begun earlier has seen the deletion
            plane.ok("POST", DS, _daemonset())
            follower = daemonset.Watch("gpuhook-node-setup", account=str(account), server=server)
            time.sleep(1)  # the watch is open
            assert follower.state()[0] == daemonset.PRESENT
            plane.ok("DELETE", f"{DS}/gpuhook-node-setup")
            plane.ok("DELETE", f"{PATHS['RoleBinding']}/gpuhook-node-setup")
            plane.ok("DELETE", f"{PATHS['ServiceAccount']}/gpuhook-node-setup")
            assert daemonset.state("gpuhook-node-setup", account=str(account), server=server)[0] == daemonset.UNKNOWN
            deadline = time.monotonic() + 10
            while follower.gone is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert follower.state() == (daemonset.GONE, "DaemonSet gpuhook/gpuhook-node-setup was deleted")
        # no API server any more
        verdict, why = daemonset.state("gpuhook-node-setup", account=str(account), server=server, timeout=2)
        assert verdict == daemonset.UNKNOWN and why.startswith("GET ")
        assert daemonset.state("x", account=str(root / "none")) == (
            daemonset.UNKNOWN, f"no service account token in {root / 'none'} (No such file or directory)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
