"""A two-node Kubernetes cluster for the end-to-end tests, built from Go modules by .ci/build-k8s, on one
machine, without touching the host:

- the control plane (tests/support/k8s.py): etcd, kube-apiserver, kube-controller-manager and kube-scheduler on
  the host's 127.0.0.1, everything under the test's temp dir;
- each node: a user + mount + network namespace (root inside is root outside, so the kubelet can dial the
  plugins' root-owned sockets, but holds no capability over the host: it cannot set the host's sysctls or
  cgroups, which `KubeletInUserNamespace` lets it skip), held by a sleep; in its mount
  namespace tmpfs lies over /var/lib, /var/log and /run, so the node's kubelet dir, CDI dir, gpuhook prefix,
  runtime config and state are the node's own at the paths a real node uses (and the chart's defaults work);
  its simulated driver bound at /var/lib/gpuhook-driver; its network a veth to the fabric (clusternet.py), pods
  on a CNI bridge (the reference plugins, built by .ci/build-k8s) and the API server reached through a forwarder;
- per node a containerd 2.x (CRI, CDI on) as the real root in that mount and network namespace, restarted by a
  supervisor loop whenever it exits (systemd's Restart=always, which node-setup's `--restart signal` relies on),
  with the images imported (no registry); and the kubelet in the namespace (`KubeletInUserNamespace`).
Everything is stopped by PID; the containers are killed and removed and the cgroups runc made are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .clusternet import Forwarder, wire_node
from .daemon import daemon_process, namespace_holder
from .k8s import ControlPlane, free_port, kubeconfig, node_token, wait_for
from .k8snode import BUSYBOX_IMAGE, PAUSE_IMAGE, oci_archive, stop_tasks

DRIVER_AT = "/var/lib/gpuhook-driver"  # where each node sees its simulated driver
NODE_ETC = "/var/lib/gpuhook-node"  # the node's containerd config and CNI config (tmpfs)
CONTAINERD_CONFIG = f"{NODE_ETC}/containerd/config.toml"
SOCKET = "/run/containerd/containerd.sock"
# containerd started again whenever it exits; SIGTERM to the loop stops the running one and the loop
SUPERVISOR = ("trap 'kill -TERM $child 2>/dev/null; wait $child; exit 0' TERM INT; "
              'while :; do "$0" --config "$1" & child=$!; wait $child; sleep 0.2; done')
TOOLS = {"GPUHOOK_CONTAINERD_BIN": "containerd", "GPUHOOK_CNI_BIN": "bridge", "GPUHOOK_HELM_BIN": "helm"}


def tools() -> dict[str, Path] | str:
    """containerd 2.x, the CNI plugins and helm from .ci/build-k8s's cache (exported by .ci/run), or why not."""
    found = {}
    for env, binary in TOOLS.items():
        folder = os.environ.get(env)
        if not folder or not os.access(os.path.join(folder, binary), os.X_OK):
            return f"${env} does not name a folder with {binary} (run .ci/build-k8s)"
        found[env] = Path(folder)
    return found


def containerd_config(cni_bin: Path, uid: int, gid: int) -> str:
    """The node's containerd: CRI with CDI off (node-setup turns it on), the kubelet's user owning the socket."""
    return f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "{SOCKET}"
  uid = {uid}
  gid = {gid}
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true  # no lower score than containerd's own (not allowed here)
  enable_cdi = false
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      BinaryName = "{shutil.which("runc") or "/usr/sbin/runc"}"
      SystemdCgroup = false
[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{cni_bin}"]
  conf_dir = "{NODE_ETC}/cni"
"""


def cni_config(index: int) -> str:
    return json.dumps({"cniVersion": "1.0.0", "name": "pods", "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": f"10.244.{index}.0/24"}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "loopback"}]})


class ClusterNode:
    """One node: its namespaces' holder, its paths as the host sees them, its daemons."""

    def __init__(self, root: Path, name: str, index: int, holder: int, address: str) -> None:
        self.root, self.name, self.index, self.holder, self.address = root, name, index, holder, address
        self.kubelet_log, self.containerd_log = root / "kubelet.log", root / "containerd.log"

    def path(self, node_path: str) -> Path:
        """`node_path` inside the node's mount namespace, from here."""
        return Path(f"/proc/{self.holder}/root") / node_path.lstrip("/")

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self._ctr), "--address", str(self.path(SOCKET)), "-n", "k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)

    def containerd_pid(self) -> int | None:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if (Path(f"/proc/{entry}/comm").read_text().strip() == "containerd"
                            and os.readlink(f"/proc/{entry}/ns/mnt") == os.readlink(f"/proc/{self.holder}/ns/mnt")):
                        return int(entry)
        return None

    _ctr: Path


def _nsenter(holder: int, user: bool = False) -> list[str]:
    return ["nsenter", *([f"--user=/proc/{holder}/ns/user"] if user else []), f"--mount=/proc/{holder}/ns/mnt",
            f"--net=/proc/{holder}/ns/net", "--"]


@contextlib.contextmanager
def cluster_node(root: Path, plane: ControlPlane, name: str, index: int, fabric_pid: int, fake_root: Path,
                 tools: dict[str, Path], images: list[Path], labels: dict[str, str]) -> Iterator[ClusterNode]:
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    uid = gid = 0  # root inside the node's user namespace is root outside, without a capability there
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    with contextlib.ExitStack() as stack:
        holder = stack.enter_context(namespace_holder(
            ["unshare", "--user", "--map-root-user", "--mount", "--net", "--propagation", "slave", "--",
             "sleep", "86400"], env, root, "net", "the node's namespaces"))
        stack.callback(_kill_left_in, os.readlink(f"/proc/{holder.pid}/ns/mnt"), holder.pid)
        mnt = ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--"]
        # shared inside the node (as on a systemd host: hostPath volumes with mount propagation need it), and a
        # slave of the host's: the host's mounts reach the node, none of the node's reach the host
        subprocess.run([*mnt, "mount", "--make-rshared", "/"], check=True, capture_output=True)
        for folder in ("/var/lib", "/var/log", "/run"):
            subprocess.run([*mnt, "mount", "-t", "tmpfs", "-o", f"mode=0755,uid={uid},gid={gid}", "tmpfs", folder],
                           check=True, capture_output=True)
        node = ClusterNode(root, name, index, holder.pid, "")
        node._ctr = tools["GPUHOOK_CONTAINERD_BIN"] / "ctr"
        for folder in (DRIVER_AT, f"{NODE_ETC}/containerd", f"{NODE_ETC}/cni", "/var/lib/kubelet",
                       "/var/lib/containerd", "/run/containerd"):
            node.path(folder).mkdir(parents=True, exist_ok=True)
        subprocess.run([*mnt, "mount", "--bind", str(fake_root), DRIVER_AT], check=True, capture_output=True)
        os.chown(node.path("/var/lib/kubelet"), uid, gid)
        node.path(CONTAINERD_CONFIG).write_text(containerd_config(tools["GPUHOOK_CNI_BIN"], uid, gid))
        node.path(f"{NODE_ETC}/cni/10-pods.conflist").write_text(cni_config(index))
        node.address = wire_node(fabric_pid, holder.pid, index)
        forwarder = Forwarder(holder.pid, node.address, int(plane.server.rsplit(":", 1)[1]))
        stack.callback(forwarder.close)
        # containerd: real root in the node's mount and network namespaces, restarted whenever it exits
        binary = tools["GPUHOOK_CONTAINERD_BIN"] / "containerd"
        path = f"{tools['GPUHOOK_CONTAINERD_BIN']}:{env['PATH']}"
        stack.enter_context(daemon_process(
            [*_nsenter(holder.pid), "sh", "-c", SUPERVISOR, str(binary), CONTAINERD_CONFIG], {"PATH": path}, root,
            "containerd.log"))
        wait_for(f"{name}'s containerd", lambda: node.ctr("version", timeout=10).returncode == 0, 60)
        stack.callback(stop_tasks, [str(node._ctr), "--address", str(node.path(SOCKET)), "-n", "k8s.io"])
        for archive in images:
            out = node.ctr("images", "import", str(archive), timeout=300)
            assert out.returncode == 0, f"ctr images import {archive.name} on {name}: {out.stderr}"
        # the kubelet: in the node's user, mount and network namespaces
        port, healthz = free_port(), free_port()
        node.path("/var/lib/kubelet/resolv.conf").write_text("nameserver 127.0.0.1\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [], "failCgroupV1": False,
            "featureGates": {"KubeletInUserNamespace": True}, "failSwapOn": False,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"}, "containerRuntimeEndpoint": f"unix://{SOCKET}",
            "address": node.address, "port": port, "readOnlyPort": 0, "healthzPort": healthz,
            "healthzBindAddress": "127.0.0.1", "resolvConf": "/var/lib/kubelet/resolv.conf",
            "localStorageCapacityIsolation": False,
            "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99, "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False, "serializeImagePulls": False, "registerNode": True,
            "syncFrequency": "2s", "nodeStatusUpdateFrequency": "2s", "fileCheckFrequency": "2s",
        }
        (root / "kubelet.yaml").write_text(json.dumps(config))
        node_config = kubeconfig(root / "kubelet.kubeconfig", f"https://{node.address}:6443", node_token(name))
        os.chmod(node_config, 0o644)
        (root / "kubelet-pki").mkdir(exist_ok=True)
        os.chown(root / "kubelet-pki", uid, gid)
        label_arg = ",".join(f"{k}={v}" for k, v in labels.items())
        stack.enter_context(daemon_process(
            [*_nsenter(holder.pid, user=True), str(plane.bin_dir / "kubelet"), f"--config={root / 'kubelet.yaml'}",
             f"--kubeconfig={node_config}", "--root-dir=/var/lib/kubelet", f"--cert-dir={root / 'kubelet-pki'}",
             f"--hostname-override={name}", f"--node-ip={node.address}", f"--node-labels={label_arg}", "--v=2"],
            env, root, "kubelet.log"))
        try:
            wait_for(f"node {name} Ready", lambda: _ready(plane, name), 120)
        except AssertionError as exc:
            tail = [f"--- {log.name} (end)\n" + "".join(
                line for line in log.read_text(errors="replace").splitlines(keepends=True)[-300:]
                if "FLAG:" not in line and (line[:1] in "EW" or "level=error" in line or "level=warn" in line))[-5000:]
                for log in (node.kubelet_log, node.containerd_log)]
            tail.append(f"--- node status: {plane.request('GET', f'/api/v1/nodes/{name}')[1]}"[:3000])
            raise AssertionError(f"{exc}\n" + "\n".join(tail)) from None
        yield node


def _kill_left_in(mount_ns: str, holder: int) -> None:
    """Whatever of ours still runs in the node's mount namespace when the node goes (a containerd shim whose
    task was deleted while containerd restarted): only processes in that namespace, never another's."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != holder:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/mnt") == mount_ns:
                    os.kill(int(entry), 9)


def _ready(plane: ControlPlane, name: str) -> bool:
    code, node = plane.request("GET", f"/api/v1/nodes/{name}")
    if code != 200:
        return False
    conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
    return conditions.get("Ready") == "True"


def base_images(folder: Path) -> list[Path]:
    """The pause and workload images, made from busybox-static (tests/support/k8snode.py)."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    return [oci_archive(folder / "pause.tar", PAUSE_IMAGE, busybox,
                        ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 1; done"]),
            oci_archive(folder / "busybox.tar", BUSYBOX_IMAGE, busybox, ["/bin/sh"])]

