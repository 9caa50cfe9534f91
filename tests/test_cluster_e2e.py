"""gpuhook installed on a real two-node Kubernetes cluster with its Helm chart, as users install it, and taken off
again (tests/support/cluster.py builds the cluster: Kubernetes, containerd 2.x, helm and the CNI plugins from Go
modules by .ci/build-k8s; the node-setup and device-plugin images by .ci/build-images, imported into each
node's containerd). Node gpu-a has 4 simulated GPUs in two NVLink pairs, gpu-b 2 GPUs, the first split into two
MIG devices; the release runs migStrategy mixed.

The tests run in order on one cluster: install; GPU pods on both nodes; a MIG device; a node relabelled to a
time-sliced config (NVIDIA's config.map and node label); `helm upgrade` to a new image while GPU pods keep
starting (none may fail); a switch to the DRA driver (an NVLink pair and a MIG device by ResourceClaimTemplate);
a node-setup pod's restart; `helm uninstall`, after which each node's paths are as
they were before, byte for byte."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cluster import (
    CONTAINERD_CONFIG,
    DRIVER_AT,
    NODE_ETC,
    ClusterNode,
    base_images,
    cluster_node,
    tools,
    wait_for,
)
from support.clusternet import fabric
from support.e2e import need
from support.k8s import ControlPlane, binaries, control_plane
from support.k8snode import BUSYBOX_IMAGE
from support.processes import short_tempdir

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy/helm/gpuhook"
NAMESPACE = "gpuhook"
IMAGES = {"node-setup": os.environ.get("GPUHOOK_NODE_SETUP_IMAGE", "localhost/gpuhook-node-setup:ci"),
          "device-plugin": os.environ.get("GPUHOOK_PLUGIN_IMAGE", "localhost/gpuhook-device-plugin:ci")}
PREFIX = "/var/lib/gpuhook"
FEATURES = f"{NODE_ETC}/features.d"
DEV_CHAR = f"{NODE_ETC}/dev-char"
# what a node has before gpuhook: its runtime's config, the CDI and NFD folders, /dev/char
WATCHED = [NODE_ETC, "/var/run/cdi", "/run/gpuhook", PREFIX, "/var/lib/kubelet/device-plugins",
           "/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry"]
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
WORK = "/api/v1/namespaces/default/pods"
TIME_SLICED = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
               "      replicas: 4\n")
CONFIG_LABEL = "nvidia.com/device-plugin.config"
UPGRADE_TAG = "ci-next"


def _values(tag: str = "ci") -> dict[str, Any]:
    def image(name: str) -> dict[str, str]:
        return {"repository": IMAGES[name].rsplit(":", 1)[0], "tag": tag, "pullPolicy": "Never"}

    return {"image": image("device-plugin"),
            "nodeSetup": {"image": image("node-setup"), "runtime": "containerd", "restart": "signal",
                          "runtimeConfig": CONTAINERD_CONFIG,
                          "env": [{"name": "GPUHOOK_PROC_ROOT", "value": f"{DRIVER_AT}/proc"}]},
            # the simulated driver's own /proc/driver/nvidia (a real driver's is the host's /proc), and where the
            # pod sees its root (its NVML looks for its files there)
            "devicePlugin": {"containers": {"main": {"env": [
                {"name": "GPUHOOK_PROC_ROOT", "value": "/driver-root/proc"},
                {"name": "GPUHOOK_FAKE_DRIVER_ROOT", "value": "/driver-root"}]}}},
            "nvidiaDriverRoot": DRIVER_AT, "nvidiaDevRoot": "", "prefix": PREFIX, "featuresDir": FEATURES,
            "devCharPath": DEV_CHAR, "migStrategy": "mixed",
            # NVIDIA's named configs: unlabelled nodes get "default"; the node label picks another
            "config": {"map": {"default": "version: v1\n", "time-sliced": TIME_SLICED}}}


@dataclass
class Cluster:
    plane: ControlPlane
    nodes: dict[str, ClusterNode]
    root: Path
    helm_bin: Path
    before: dict[str, dict[str, Any]] = field(default_factory=dict)
    runtime_pids: dict[str, int | None] = field(default_factory=dict)

    def helm(self, *args: str, values: dict[str, Any] | None = None, timeout: float = 600) -> str:
        argv = [str(self.helm_bin / "helm"), "--kubeconfig", str(self.plane.admin_kubeconfig), *args]
        if values is not None:
            path = self.root / "values.yaml"
            path.write_text(yaml.safe_dump(values))
            argv += ["--values", str(path)]
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.root), "HELM_CACHE_HOME": str(self.root / "h"),
               "HELM_CONFIG_HOME": str(self.root / "h"), "HELM_DATA_HOME": str(self.root / "h")}
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, env=env)
        assert out.returncode == 0, f"helm {' '.join(args)}: {out.stderr}{out.stdout}\n{self.diagnose()}"
        return out.stdout

    def pods(self, path: str = PODS) -> list[dict[str, Any]]:
        return list(self.plane.ok("GET", path)["items"])

    def diagnose(self) -> str:
        parts = []
        for pod in self.pods() + self.pods(WORK):
            status = pod.get("status", {})
            parts.append(f"{pod['metadata']['name']} on {pod['spec'].get('nodeName')}: {status.get('phase')} "
                         f"{[c.get('state') for c in status.get('containerStatuses', [])]} "
                         f"{[c.get('message') for c in status.get('conditions', []) if c.get('message')]}")
            for name, node in self.nodes.items():
                if pod["spec"].get("nodeName") == name:
                    parts.append(_container_logs(node, pod)[-1500:])
        for node in self.nodes.values():
            parts.append(f"--- {node.name} kubelet (end)\n" + node.kubelet_log.read_text(errors="replace")[-2000:])
        return "\n".join(parts)


def _container_logs(node: ClusterNode, pod: dict[str, Any]) -> str:
    meta = pod["metadata"]
    base = node.path(f"/var/log/pods/{meta['namespace']}_{meta['name']}_{meta['uid']}")
    return "".join(p.read_text(errors="replace") for p in sorted(base.glob("*/*.log"))) if base.is_dir() else ""


def snapshot(node: ClusterNode) -> dict[str, Any]:
    """Every watched path of the node: type, mode and content (files) or target (links); sockets by name."""
    out: dict[str, Any] = {}
    for top in WATCHED:
        base = node.path(top)
        if not base.exists():
            out[top] = None
            continue
        for folder, dirs, files in os.walk(base):
            for name in sorted(dirs + files):
                if name == "kubelet_internal_checkpoint":  # the kubelet's own state, not gpuhook's
                    continue
                path = Path(folder, name)
                key = "/" + str(path.relative_to(node.path("/")))
                st = path.lstat()
                if stat.S_ISLNK(st.st_mode):
                    out[key] = ("link", os.readlink(path))
                elif stat.S_ISREG(st.st_mode):
                    out[key] = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(path.read_bytes()).hexdigest())
                else:
                    out[key] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
    return out


def _export_images(folder: Path) -> list[Path]:
    """Both images under their CI tag and under UPGRADE_TAG (the same content: what `helm upgrade` rolls to)."""
    archives = []
    for name, ref in IMAGES.items():
        need(subprocess.run(["podman", "image", "exists", ref], check=False).returncode == 0,
             f"image {ref} missing: run .ci/build-images")
        for tag in ("ci", UPGRADE_TAG):
            tagged = f"{ref.rsplit(':', 1)[0]}:{tag}"
            if tagged != ref:
                subprocess.run(["podman", "tag", ref, tagged], check=True, timeout=60)
            archive = folder / f"{name}-{tag}.tar"
            out = subprocess.run(["podman", "save", "--format", "oci-archive", "-o", str(archive), tagged],
                                 capture_output=True, text=True, timeout=300, check=False)
            if tagged != ref:
                subprocess.run(["podman", "untag", ref, tagged], check=False, timeout=60)
            assert out.returncode == 0, out.stderr
            archives.append(archive)
    return archives


@pytest.fixture(scope="module")
def cluster(fake_driver_factory: Any) -> Iterator[Cluster]:
    found, more = binaries(), tools()
    need(not isinstance(found, str), f"no Kubernetes binaries: {found}")
    need(not isinstance(more, str), str(more))
    need(os.geteuid() == 0, "needs root (namespaces, containerd, the simulated driver's device nodes)")
    assert not isinstance(found, str) and not isinstance(more, str)
    fakes = {"gpu-a": fake_driver_factory(gpus=4, nvlink="bridge", fresh=True),
             "gpu-b": fake_driver_factory(gpus=2, mig={0: ["1g.10gb", "1g.10gb"]}, fresh=True)}
    root = Path(short_tempdir("clu"))
    os.chmod(root, 0o755)
    images = [*base_images(root), *_export_images(root)]
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.callback(subprocess.run, ["rm", "-rf", str(root)], check=False)
        plane = stack.enter_context(control_plane(root / "plane", *found, list(fakes), controller_manager=True))
        fab = stack.enter_context(fabric(root))
        nodes = {}
        for index, (name, fake) in enumerate(fakes.items(), 1):
            nodes[name] = stack.enter_context(cluster_node(
                root / name, plane, name, index, fab, fake.root, more, images, {"nvidia.com/gpu.present": "true"}))
            for folder in ("/var/run/cdi", FEATURES, DEV_CHAR):  # what a GPU node has before gpuhook
                nodes[name].path(folder).mkdir(parents=True, exist_ok=True)
        print(f"[{time.monotonic() - started:5.1f}s] cluster up: {', '.join(nodes)} Ready", flush=True)
        yield Cluster(plane, nodes, root, more["GPUHOOK_HELM_BIN"])


def _allocatable(c: Cluster, node: str) -> dict[str, str]:
    status = c.plane.ok("GET", f"/api/v1/nodes/{node}")["status"]
    return {k: v for k, v in status.get("allocatable", {}).items() if k.startswith("nvidia.com/")}


def test_helm_install_sets_up_both_nodes_and_advertises_their_gpus(cluster: Cluster) -> None:
    c = cluster
    for name, node in c.nodes.items():
        c.before[name] = snapshot(node)
        c.runtime_pids[name] = node.containerd_pid()
    c.helm("install", "gh", str(CHART), "--namespace", NAMESPACE, "--create-namespace", "--wait", "--timeout",
           "4m", values=_values())
    wanted = {"gpu-a": {"nvidia.com/gpu": "4"}, "gpu-b": {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "2"}}
    for name in c.nodes:
        wait_for(f"{name}'s GPUs allocatable", lambda name=name: _allocatable(c, name) == wanted[name], 120)
    for name, node in c.nodes.items():
        config = node.path(CONTAINERD_CONFIG).read_text()
        assert "99-gpuhook.toml" in config, config
        dropin = node.path(f"{NODE_ETC}/containerd/conf.d/99-gpuhook.toml").read_text()
        assert "enable_cdi = true" in dropin
        assert node.containerd_pid() != c.runtime_pids[name]  # restarted once to read it
        assert (node.path(PREFIX) / "bin/gpuhook-hook").exists()
        c.runtime_pids[name] = node.containerd_pid()


def _gpu_pod(name: str, resource: str = "nvidia.com/gpu", count: int = 1, node: str | None = None
             ) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                        "command": ["/bin/sh", "-c", "echo GPUS: $(ls /dev | grep -E '^nvidia[0-9]+$' | sort | "
                                    "tr '\\n' ' '); ls /dev/nvidia-caps 2>/dev/null | sed 's/^/CAP: /'; echo DONE"],
                        "resources": {"limits": {resource: str(count)}}}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _finished(c: Cluster, name: str) -> dict[str, Any] | None:
    pod = c.plane.ok("GET", f"{WORK}/{name}")
    return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None


def _output(c: Cluster, pod: dict[str, Any]) -> str:
    return _container_logs(c.nodes[pod["spec"]["nodeName"]], pod)


def test_gpu_pods_get_distinct_gpus_on_both_nodes_and_too_big_a_pod_stays_pending(cluster: Cluster) -> None:
    c = cluster
    names = [f"one-{n}" for n in range(5)]
    for name in names:
        c.plane.ok("POST", WORK, _gpu_pod(name))
    c.plane.ok("POST", WORK, _gpu_pod("five", count=5))
    seen: dict[str, list[str]] = {}
    for name in names:
        pod = wait_for(f"{name} to finish", lambda name=name: _finished(c, name), 120)
        assert pod["status"]["phase"] == "Succeeded", c.diagnose()
        out = _output(c, pod)
        gpus = out.split("GPUS:", 1)[1].split("\n", 1)[0].split()
        assert len(gpus) == 1, out
        seen.setdefault(pod["spec"]["nodeName"], []).extend(gpus)
    assert sorted(seen) == ["gpu-a", "gpu-b"], seen  # the scheduler used both nodes
    for gpus in seen.values():
        assert len(set(gpus)) == len(gpus), seen  # never one GPU to two pods of a node
    wait_for("five Unschedulable", lambda: any(
        cond.get("reason") == "Unschedulable"
        for cond in c.plane.ok("GET", f"{WORK}/five")["status"].get("conditions", [])), 60)
    for name in [*names, "five"]:
        c.plane.ok("DELETE", f"{WORK}/{name}")


def test_a_mig_device_under_the_mixed_strategy(cluster: Cluster) -> None:
    c = cluster
    c.plane.ok("POST", WORK, _gpu_pod("mig", resource="nvidia.com/mig-1g.10gb"))
    pod = wait_for("mig to finish", lambda: _finished(c, "mig"), 120)
    assert pod["status"]["phase"] == "Succeeded" and pod["spec"]["nodeName"] == "gpu-b", c.diagnose()
    out = _output(c, pod)
    assert "GPUS: nvidia0" in out and "CAP: " in out, out  # its parent GPU's node and its MIG capability
    c.plane.ok("DELETE", f"{WORK}/mig")


def _setup_pod(c: Cluster, node: str, name: str = "gpuhook-node-setup") -> dict[str, Any] | None:
    for pod in c.pods():
        if pod["spec"].get("nodeName") == node and pod["metadata"]["name"].startswith(name):
            return pod
    return None


def _label(c: Cluster, node: str, value: str | None) -> None:
    c.plane.ok("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {CONFIG_LABEL: value}}},
               content_type="application/merge-patch+json")


def _restarts(pod: dict[str, Any] | None) -> tuple[str, int]:
    assert pod is not None
    return pod["metadata"]["uid"], sum(s.get("restartCount", 0) for s in pod["status"].get("containerStatuses", []))


def test_a_relabelled_node_advertises_its_time_sliced_config_without_a_restart(cluster: Cluster) -> None:
    c = cluster
    plugin = _restarts(_setup_pod(c, "gpu-b", "gpuhook-device-plugin"))
    others = {n: _allocatable(c, n) for n in c.nodes}
    _label(c, "gpu-b", "time-sliced")
    sliced = {"nvidia.com/gpu": "4", "nvidia.com/mig-1g.10gb": "2"}  # its one whole GPU, 4 times; MIG as it was
    wait_for("gpu-b time-sliced", lambda: _allocatable(c, "gpu-b") == sliced, 120)
    c.plane.ok("POST", WORK, _gpu_pod("sliced", node="gpu-b"))
    pod = wait_for("sliced to finish", lambda: _finished(c, "sliced"), 120)
    assert pod["status"]["phase"] == "Succeeded", c.diagnose()
    assert "GPUS: nvidia1" in _output(c, pod)  # a replica of the whole GPU (GPU 0 is split into MIG devices)
    c.plane.ok("DELETE", f"{WORK}/sliced")
    assert _allocatable(c, "gpu-a") == others["gpu-a"]  # the other node keeps its config
    _label(c, "gpu-b", "no-such-config")  # one error line; the current config keeps serving
    time.sleep(3)
    assert _allocatable(c, "gpu-b") == sliced
    _label(c, "gpu-b", None)
    wait_for("gpu-b back to its default", lambda: _allocatable(c, "gpu-b") == others["gpu-b"], 120)
    assert _restarts(_setup_pod(c, "gpu-b", "gpuhook-device-plugin")) == plugin  # the same pod, never restarted
    for name, node in c.nodes.items():
        assert node.containerd_pid() == c.runtime_pids[name]  # nothing else restarted either
    logs = _container_logs(c.nodes["gpu-b"], _setup_pod(c, "gpu-b", "gpuhook-device-plugin") or {})
    assert "config 'time-sliced'" in logs and "='no-such-config': no such config" in logs, logs[-3000:]


def _ready(pod: dict[str, Any] | None) -> bool:
    return bool(pod) and any(cond["type"] == "Ready" and cond["status"] == "True"
                             for cond in pod.get("status", {}).get("conditions", []))  # type: ignore[union-attr]


def _gpuhook_pods(c: Cluster) -> dict[str, tuple[str, str, bool]]:
    """name -> (uid, image, Ready) of gpuhook's pods."""
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["spec"]["containers"][0]["image"], _ready(p))
            for p in c.pods()}


def test_helm_upgrade_to_a_new_image_fails_no_gpu_pod_started_during_it(cluster: Cluster) -> None:
    c = cluster
    before = _gpuhook_pods(c)
    stop, started, errors = threading.Event(), [], []

    def start_gpu_pods() -> None:
        nodes = ("gpu-a", "gpu-a", "gpu-b")  # gpu-b has one whole GPU: fewer there
        while not stop.is_set():
            name = f"roll-{len(started)}"
            try:
                c.plane.ok("POST", WORK, _gpu_pod(name, node=nodes[len(started) % len(nodes)]))
                started.append(name)
            except AssertionError as exc:  # pragma: no cover - reported below
                errors.append(str(exc))
            stop.wait(1.0)

    loop = threading.Thread(target=start_gpu_pods, daemon=True)
    loop.start()
    try:
        time.sleep(3)
        c.helm("upgrade", "gh", str(CHART), "--namespace", NAMESPACE, "--wait", "--timeout", "5m",
               values=_values(UPGRADE_TAG))
        wait_for("every gpuhook pod replaced and Ready", lambda: all(
            image.endswith(f":{UPGRADE_TAG}") and ready for _, image, ready in _gpuhook_pods(c).values())
            and len(_gpuhook_pods(c)) == len(before), 300)
        time.sleep(3)  # and a few more after it
    finally:
        stop.set()
        loop.join(10)
    assert not errors, errors
    assert len(started) >= 10, started
    failed = []
    for name in started:
        pod = wait_for(f"{name} to finish", lambda name=name: _finished(c, name), 300)
        if pod["status"]["phase"] != "Succeeded":
            failed.append((name, pod["status"].get("reason"), pod["status"].get("message")))
    assert failed == [], f"{len(failed)} of {len(started)} GPU pods failed during the upgrade: {failed}"
    print(f"helm upgrade: {len(started)} GPU pods started during the rolling update, all Succeeded", flush=True)
    assert not set(before) & set(_gpuhook_pods(c))  # every pod was replaced
    for name, node in c.nodes.items():
        assert node.containerd_pid() == c.runtime_pids[name]  # the same configuration: no runtime restart
    for name in started:
        c.plane.ok("DELETE", f"{WORK}/{name}")


TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates"


def _claim_template(name: str, device_class: str, count: int, nvlink: bool) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": "gpus", "exactly": {"deviceClassName": device_class,
                                                                          "count": count}}]}
    if nvlink:
        devices["constraints"] = [{"requests": ["gpus"], "matchAttribute": "gpu.nvidia.com/nvlinkDomain"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": devices}}}


def _claim_pod(name: str, template: str) -> dict[str, Any]:
    pod = _gpu_pod(name)
    container = pod["spec"]["containers"][0]
    container["resources"] = {"claims": [{"name": "gpus"}]}
    pod["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": template}]
    return pod


def test_dra_on_both_nodes_pairs_by_nvlink_and_mig_after_switching_from_the_device_plugin(cluster: Cluster) -> None:
    c = cluster
    values = _values(UPGRADE_TAG)
    values["devicePlugin"]["enabled"] = False
    values["draDriver"] = {"enabled": True, "containers": {"main": {"env": [
        {"name": "GPUHOOK_PROC_ROOT", "value": "/driver-root/proc"},
        {"name": "GPUHOOK_FAKE_DRIVER_ROOT", "value": "/driver-root"}]}}}
    c.helm("upgrade", "gh", str(CHART), "--namespace", NAMESPACE, "--wait", "--timeout", "5m", values=values)

    def slices(node: str) -> list[str]:
        items = c.plane.ok("GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{node}")
        return sorted(d["name"] for s in items["items"] for d in s["spec"].get("devices", []))

    for node in c.nodes:
        wait_for(f"{node}'s ResourceSlice", lambda node=node: slices(node), 120)
    assert slices("gpu-a") == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert len([d for d in slices("gpu-b") if "-mig-" in d]) == 2, slices("gpu-b")
    # the device plugin's DaemonSet is gone: its spec and labels left the nodes
    for node in c.nodes.values():
        assert not list(node.path("/var/run/cdi").glob("k8s.device-plugin.nvidia.com*")), node.name
        assert not node.path(f"{FEATURES}/gpuhook").exists()

    c.plane.ok("POST", TEMPLATES, _claim_template("nvlink-pair", "gpu.nvidia.com", 2, nvlink=True))
    c.plane.ok("POST", TEMPLATES, _claim_template("one-mig", "mig.nvidia.com", 1, nvlink=False))
    c.plane.ok("POST", WORK, _claim_pod("pair", "nvlink-pair"))
    c.plane.ok("POST", WORK, _claim_pod("mig-dra", "one-mig"))
    pair = wait_for("pair to finish", lambda: _finished(c, "pair"), 180)
    mig = wait_for("mig-dra to finish", lambda: _finished(c, "mig-dra"), 180)
    assert pair["status"]["phase"] == mig["status"]["phase"] == "Succeeded", c.diagnose()
    assert pair["spec"]["nodeName"] == "gpu-a" and mig["spec"]["nodeName"] == "gpu-b"
    gpus = _output(c, pair).split("GPUS:", 1)[1].split("\n", 1)[0].split()
    assert gpus in (["nvidia0", "nvidia1"], ["nvidia2", "nvidia3"]), gpus  # an NVLink pair, never a mixed one
    out = _output(c, mig)
    assert "GPUS: nvidia0" in out and "CAP: " in out, out
    for name in ("pair", "mig-dra"):
        c.plane.ok("DELETE", f"{WORK}/{name}")
    wait_for("the claims' CDI specs removed", lambda: not any(
        list(n.path("/var/run/cdi").glob("*claim*")) for n in c.nodes.values()), 120)
    # the controller-manager deletes the claims it made from the templates with their pods
    wait_for("the generated claims deleted", lambda: not c.plane.ok(
        "GET", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims")["items"], 120)
    for name in ("nvlink-pair", "one-mig"):
        c.plane.ok("DELETE", f"{TEMPLATES}/{name}")


def test_a_node_setup_pod_restart_restarts_no_runtime(cluster: Cluster) -> None:
    c = cluster
    node = c.nodes["gpu-a"]
    installed = snapshot(node)
    old = _setup_pod(c, "gpu-a")
    assert old is not None
    c.plane.ok("DELETE", f"{PODS}/{old['metadata']['name']}")
    try:
        wait_for("a new node-setup pod Ready", lambda: (lambda p: p if _ready(p) and p["metadata"]["uid"] !=
                                                        old["metadata"]["uid"] else None)(_setup_pod(c, "gpu-a")), 180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.diagnose()}") from None
    assert node.containerd_pid() == c.runtime_pids["gpu-a"]
    assert snapshot(node) == installed
    new = _setup_pod(c, "gpu-a")
    assert new is not None
    logs = _container_logs(node, new)
    assert "containerd's configuration is already gpuhook's: not restarted" in logs, logs


def test_helm_uninstall_leaves_each_node_as_it_was(cluster: Cluster) -> None:
    c = cluster
    wait_for("the workload pods gone", lambda: not c.pods(WORK), 120)
    c.helm("uninstall", "gh", "--namespace", NAMESPACE, "--wait", "--timeout", "5m")
    wait_for("gpuhook's pods gone", lambda: not c.pods(), 180)
    for name, node in c.nodes.items():
        after = snapshot(node)
        # Known remainder: the empty hooks' state folder the kubelet made for the plugin's hostPath volume
        # (DirectoryOrCreate); the plugin cannot remove its own mount point. Anything else left fails here.
        assert after.pop("/run/gpuhook/records") == (stat.S_IFDIR, 0o755)
        after["/run/gpuhook"] = None
        assert after == c.before[name]
        assert node.containerd_pid() not in (None, c.runtime_pids[name])  # restarted on its own config again
