"""The DRA driver end to end, on a real control plane: etcd, kube-apiserver, kube-scheduler and a kubelet with
containerd 1.7 and runc, the driver `gpuhook dra-plugin` with exactly the RBAC of deploy/base/dra, on a
simulated driver with 4 GPUs in two NVLink pairs.

Kubernetes comes from .ci/build-k8s (1.37 in CI; $GPUHOOK_K8S_BIN may name another build, e.g. 1.34, the first
with resource.k8s.io/v1); without it the test skips with one line saying so, and fails under
GPUHOOK_REQUIRE_E2E=1 (CI). tests/support/k8s.py and k8snode.py say how each part runs without touching the host.
The same driver installed with the Helm chart on the two-node cluster: tests/test_cluster_e2e.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.drakubelet import DraKubelet
from support.e2e import need
from support.k8s import binaries, control_plane, kubeconfig
from support.k8snode import BUSYBOX_IMAGE, containerd17, kubelet_node, untaint
from support.processes import short_tempdir

pytestmark = pytest.mark.e2e

NODE = "node1"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "base" / "dra"
PATHS = {  # kind -> collection path, for what deploy/base/dra holds
    "ServiceAccount": "/api/v1/namespaces/kube-system/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/rolebindings",
    "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses",
}
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
PODS = "/api/v1/namespaces/default/pods"
WORKLOAD = ("echo GPUS: $(ls /dev | grep -E '^nvidia[0-9]+$' | sort | tr '\\n' ' '); "
            "for f in /usr/lib/x86_64-linux-gnu/libcuda.so*; do test -e $f && echo LIBCUDA: $f; done; "
            "echo DONE; sleep 3600")


def _found() -> tuple[Path, Path]:
    found = binaries()
    need(not isinstance(found, str), f"no Kubernetes binaries: {found}")
    assert not isinstance(found, str)
    need(containerd17() is not None, "no containerd 1.7 tree (run .ci/fetch-docker-cdi)")
    need(os.geteuid() == 0, "needs root (the simulated driver's device nodes, containerd)")
    need(shutil.which("setpriv") is not None and shutil.which("nsenter") is not None, "needs setpriv and nsenter")
    return found


def _claim(name: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {
                "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}}],
                "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.nvidia.com/nvlinkDomain"}]}}}


def _pod(name: str, claim: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"hostNetwork": True, "terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
                     "containers": [{"name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", WORKLOAD],
                                     "resources": {"claims": [{"name": "gpus"}]}}],
                     "resourceClaims": [{"name": "gpus", "resourceClaimName": claim}]}}


DOC_PATHS = {  # kind -> collection path, for what docs/dra.md's examples hold
    "ResourceClaimTemplate": "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates",
    "ResourceClaim": CLAIMS,
    "Pod": PODS,
}


def _docs_examples_accepted(plane: Any) -> list[str]:
    """Every object in docs/dra.md's yaml blocks, created with dryRun=All: the API server compiles their CEL and
    checks them against its schema, and keeps nothing."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "dra.md").read_text()
    checked = []
    for block in text.split("```yaml\n")[1:]:
        for doc in yaml.safe_load_all(block.split("```", 1)[0]):
            kind = doc["kind"]
            plane.ok("POST", f"{DOC_PATHS[kind]}?dryRun=All", doc)
            checked.append(f"{kind} {doc['metadata']['name']}")
    assert len(checked) >= 4, checked
    return checked


class DriverProcess:
    """`gpuhook dra-plugin` as the DaemonSet runs it (root), restartable; its sockets world-writable (umask 0) so
    the kubelet, an unprivileged user outside its namespace, can dial them."""

    def __init__(self, root: Path, fake: Any, kubelet_dir: Path, cdi_dir: Path, config: Path) -> None:
        self.root, self.fake, self.kubelet_dir, self.cdi_dir, self.config = root, fake, kubelet_dir, cdi_dir, config
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        gpuhook = Path(sys.executable).with_name("gpuhook")
        log = open(self.root / f"driver-{self.starts}.log", "wb")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [str(gpuhook), "dra-plugin", f"--driver-root={self.fake.root}", f"--proc-root={self.fake.root / 'proc'}",
             f"--node-name={NODE}", f"--kubelet-dir={self.kubelet_dir}", f"--cdi-dir={self.cdi_dir}",
             f"--kubeconfig={self.config}", f"--hook-path={gpuhook}", "--health-interval=0.5"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.umask(0), start_new_session=True)
        log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def log(self) -> str:
        return "".join((self.root / f"driver-{n}.log").read_text(errors="replace")
                       for n in range(1, self.starts + 1))


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(short_tempdir("dre"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _log(plane_root: Path, node_root: Path, driver: DriverProcess) -> str:
    parts = []
    for path in (node_root / "kubelet.log", node_root / "containerd.log", plane_root / "scheduler.log"):
        if path.exists():
            parts.append(f"--- {path.name} (end)\n" + path.read_text(errors="replace")[-3000:])
    parts.append("--- driver\n" + driver.log()[-3000:])
    return "\n".join(parts)


def _container_log(node_holder: int, pod: str) -> str:
    base = Path(f"/proc/{node_holder}/root/var/log/pods")
    for folder in base.glob(f"default_{pod}_*"):
        for log in folder.glob("c/*.log"):
            return log.read_text(errors="replace")
    return ""


def test_nvlink_pairs_are_allocated_prepared_and_kept(fake_driver_factory: Any, workdir: Path) -> None:
    bin_dir, etcd = _found()
    fake = fake_driver_factory(gpus=4, nvlink="bridge", fresh=True)
    cdi_dir = workdir / "cdi"
    cdi_dir.mkdir()
    started = time.monotonic()
    with control_plane(workdir / "plane", bin_dir, etcd, NODE) as plane:
        for path in sorted(DEPLOY.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc.get("kind") in PATHS:
                    plane.ok("POST", PATHS[doc["kind"]], doc)
        token = plane.service_account_token("kube-system", "gpuhook-dra")
        driver_config = kubeconfig(workdir / "driver.kubeconfig", plane.server, token)
        with kubelet_node(workdir / "node", plane, NODE, cdi_dir, containerd17()) as node:  # type: ignore[arg-type]
            driver = DriverProcess(workdir, fake, node.kubelet_dir, cdi_dir, driver_config)
            try:
                _scenario(plane, node, driver, cdi_dir, started)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{_log(workdir / 'plane', node.root, driver)}") from None
            finally:
                driver.stop()


def _scenario(plane: Any, node: Any, driver: DriverProcess, cdi_dir: Path, started: float) -> None:
    def say(what: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {what}", flush=True)

    say(f"control plane and kubelet up; node {NODE} registered")
    untaint(plane, NODE)
    driver.start()
    slices = plane.wait("the driver's ResourceSlice", lambda: plane.ok(
        "GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{NODE}")["items"], 60)
    devices = {d["name"]: d["attributes"]["nvlinkDomain"]["string"] for d in slices[0]["spec"]["devices"]}
    say(f"ResourceSlice {slices[0]['metadata']['name']} generation {slices[0]['spec']['pool']['generation']}: "
        f"{json.dumps(devices)}")
    assert sorted(devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    plane.wait("the kubelet to register the driver", lambda: "registered with the kubelet" in driver.log(), 60)
    say("the kubelet registered the driver")

    checked = _docs_examples_accepted(plane)
    say(f"docs/dra.md's examples accepted by the API server (dry run): {', '.join(checked)}")

    for n in (1, 2, 3):
        plane.ok("POST", CLAIMS, _claim(f"pair-{n}"))
        plane.ok("POST", PODS, _pod(f"p{n}", f"pair-{n}"))

    def allocated(name: str) -> list[str]:
        claim = plane.ok("GET", f"{CLAIMS}/{name}")
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
        return sorted(r["device"] for r in results)

    first = plane.wait("pair-1 allocated", lambda: allocated("pair-1"), 60)
    second = plane.wait("pair-2 allocated", lambda: allocated("pair-2"), 60)
    say(f"pair-1 -> {first}, pair-2 -> {second}")
    pairs = [sorted(ds) for ds in ({d for d, v in devices.items() if v == value} for value in set(devices.values()))]
    assert first in pairs and second in pairs and first != second  # a pair each, never a mixed one
    plane.wait("p3 to be unschedulable", lambda: any(
        c.get("reason") == "Unschedulable" for c in plane.ok("GET", f"{PODS}/p3").get("status", {}).get("conditions",
                                                                                                         [])), 60)
    assert allocated("pair-3") == []
    say("pair-3 stays unallocated, p3 Pending (Unschedulable)")

    p1 = plane.wait("p1 running", lambda: (lambda p: p if p["status"].get("phase") == "Running" else None)(
        plane.ok("GET", f"{PODS}/p1")), 120)
    uid1 = plane.ok("GET", f"{CLAIMS}/pair-1")["metadata"]["uid"]
    out = plane.wait("p1's output", lambda: (lambda t: t if "DONE" in t else "")(_container_log(node.holder, "p1")),
                     30)
    say(f"p1 on {p1['spec']['nodeName']} printed: " + " | ".join(
        line.split(" ", 3)[-1] for line in out.splitlines() if "GPUS" in line or "LIBCUDA" in line))
    minors = sorted(int(name.split("-")[1]) for name in first)
    assert f"GPUS: {' '.join(f'nvidia{m}' for m in minors)}\n" in out  # exactly its two GPUs
    assert "LIBCUDA: /usr/lib/x86_64-linux-gnu/libcuda.so.1" in out  # and the driver's libcuda
    spec = cdi_dir / f"k8s.gpu.nvidia.com-claim_{uid1}.yaml"
    assert spec.exists()
    before = spec.read_text()

    # restart the driver: the prepared claim stays prepared, with the same CDI ids
    driver.stop()
    driver.start()
    plane.wait("the driver to register again", lambda: driver.log().count("registered with the kubelet") >= 2, 60)
    kubelet = DraKubelet(str(node.kubelet_dir))
    try:
        kubelet.register()
        answer = kubelet.prepare(("default", uid1, "pair-1")).claims[uid1]
    finally:
        kubelet.close()
    ids = [i for d in answer.devices for i in d.cdi_device_ids]
    assert answer.error == "" and ids == [f"k8s.gpu.nvidia.com/claim={uid1}-{d}" for d in first]
    assert spec.read_text() == before
    say(f"driver restarted: pair-1 still prepared, same CDI ids {ids}")

    # restart the kubelet: it finds the driver again in plugins_registry; p1 keeps running, its claim prepared
    registered = driver.log().count("registered with the kubelet")
    node.restart_kubelet()
    plane.wait("the new kubelet to register the driver",
               lambda: driver.log().count("registered with the kubelet") > registered, 90)
    plane.wait("p1 reported running by the new kubelet", lambda: plane.ok("GET", f"{PODS}/p1")["status"].get(
        "phase") == "Running" and node.kubelet is not None and node.kubelet.poll() is None, 30)
    assert spec.read_text() == before and f"unprepared {uid1}" not in driver.log()
    say("kubelet restarted: it registered the driver again; p1 still running, pair-1 still prepared")

    # delete p1: the kubelet unprepares, the spec goes
    plane.ok("DELETE", f"{PODS}/p1")
    plane.wait("p1 gone", lambda: plane.request("GET", f"{PODS}/p1")[0] == 404, 90)
    plane.wait("pair-1's spec removed", lambda: not spec.exists(), 30)
    assert f"unprepared {uid1}" in driver.log()
    say("p1 deleted: the kubelet unprepared pair-1 and its CDI spec is gone")
    print("--- the driver's log\n" + driver.log(), flush=True)
