"""A kubelet node for the DRA end-to-end test, without touching the host:

- a user + mount namespace, created by an unprivileged user (`nobody`, root inside), held open by a `sleep`;
  in its mount namespace tmpfs lies over /var/lib and /var/log (the kubelet writes /var/log/pods whatever its
  flags say);
- containerd 1.7 with CDI (Debian trixie's, from .ci/fetch-docker-cdi's tree) in that mount namespace (so the
  pod logs land on the tmpfs) but as the real root (runc makes the device nodes the CDI spec names), with its
  root, state, socket and config under the test's temp dir, its CRI on, `enable_cdi` and the test's CDI dir;
- the kubelet in the namespace (`KubeletInUserNamespace=true`, cgroupfs, no QoS cgroups), its root dir under the
  temp dir (so the DRA driver, outside, sees plugins_registry/ and plugins/);
- a pause image and a workload image made here from busybox-static (an OCI archive, `ctr images import`): no
  registry is reachable and none is asked.
Pods run with hostNetwork (there is no CNI). Everything is stopped by PID; the cgroups runc made for our
containers are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pwd
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

from .daemon import daemon_process, namespace_holder, wait_ready
from .k8s import ControlPlane, free_port, kubeconfig

PAUSE_IMAGE = "e2e.local/pause:1"
BUSYBOX_IMAGE = "e2e.local/busybox:1"
CGROUP_V1 = Path("/sys/fs/cgroup")


def containerd17() -> Path | None:
    """Debian trixie's containerd 1.7 tree (.ci/fetch-docker-cdi), or None."""
    cache = os.environ.get("GPUHOOK_DOCKER_CDI_CACHE") or os.path.join(
        os.environ.get("GPUHOOK_DEB_CACHE") or "/var/cache/gpuhook-test-debs", "docker-trixie")
    root = Path(cache) / "root"
    return root if (root / ".done").exists() and (root / "usr/bin/containerd").exists() else None


# -- images ---------------------------------------------------------------------------------------------------
def _blob(layout: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    layout.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}", len(data)


def oci_archive(path: Path, name: str, busybox: str, cmd: list[str]) -> Path:
    """An OCI image archive: one layer with busybox-static as /bin/busybox and its applets as links."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for folder in ("bin", "dev", "proc", "sys", "etc", "tmp", "usr", "usr/lib", "usr/lib/x86_64-linux-gnu"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(busybox, "bin/busybox")
        for applet in ("sh", "ls", "sleep", "cat", "echo", "readlink", "test", "true", "find", "grep", "wc"):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    layer_data = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_data).hexdigest()
    with tarfile.open(path, "w") as out:
        layer_digest, layer_size = _blob(out, layer_data)
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "config": {"Cmd": cmd, "Env": ["PATH=/bin"]},
                             "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
        config_digest, config_size = _blob(out, config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                       "size": config_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                        "size": layer_size}]}).encode()
        manifest_digest, manifest_size = _blob(out, manifest)
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
            "size": manifest_size, "annotations": {"io.containerd.image.name": name,
                                                   "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}]})
        for member, data in (("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", index.encode())):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return path


# -- containerd 1.7 with CRI and CDI ----------------------------------------------------------------------------
def write_containerd_config(root: Path, socket: Path, cdi_dir: Path, uid: int = 0, gid: int = 0) -> Path:
    """`root`/containerd.toml: everything under `root`, the CRI on with CDI from `cdi_dir`, the native
    snapshotter, the host's runc, the pause image made here; the socket owned by `uid`:`gid`."""
    runc = shutil.which("runc") or "/usr/sbin/runc"
    config = root / "containerd.toml"
    config.write_text(f"""version = 2
root = "{root}/containerd/root"
state = "{root}/containerd/state"
[grpc]
  address = "{socket}"
  uid = {uid}
  gid = {gid}
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_cdi = true
  cdi_spec_dirs = ["{cdi_dir}"]
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{root}/cni/bin"
    conf_dir = "{root}/cni/conf"
""")
    return config


def import_images(root: Path, ctr: list[str]) -> None:
    """The pause and workload images, made from busybox-static and imported into the k8s.io namespace."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    oci_archive(root / "pause.tar", PAUSE_IMAGE, busybox,
                ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 1; done"])
    oci_archive(root / "busybox.tar", BUSYBOX_IMAGE, busybox, ["/bin/sh"])
    for archive in ("pause.tar", "busybox.tar"):
        out = subprocess.run([*ctr, "images", "import", str(root / archive)], capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 0, f"ctr images import {archive}: {out.stderr}"


@contextlib.contextmanager
def cri_containerd(root: Path, cdi_dir: Path, containerd_tree: Path) -> Iterator[tuple[Path, list[str]]]:
    """containerd 1.7 as root in the host's namespaces, everything of its own under `root`, its CRI on with CDI;
    yields (socket, ctr argv). Every container is killed and removed, and the cgroups it made, when it stops."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "containerd").mkdir(exist_ok=True)
    socket = root / "containerd" / "containerd.sock"
    config = write_containerd_config(root, socket, cdi_dir)
    env = {"PATH": f"{containerd_tree}/usr/bin:" + os.environ.get("PATH", "/usr/bin:/bin")}
    ctr = [str(containerd_tree / "usr/bin/ctr"), "--address", str(socket), "-n", "k8s.io"]
    with daemon_process([str(containerd_tree / "usr/bin/containerd"), "--config", str(config)], env, root,
                        "containerd.log") as proc:
        wait_ready(proc, lambda: subprocess.run([*ctr, "version"], capture_output=True, timeout=10,
                                                check=False).returncode == 0,
                   "containerd", root / "containerd.log", 30)
        try:
            import_images(root, ctr)
            yield socket, ctr
        finally:
            stop_tasks(ctr)


# -- the node -------------------------------------------------------------------------------------------------
class Node:
    def __init__(self, root: Path, name: str, holder: int, ctr: list[str], kubelet_dir: Path,
                 kubelet_argv: list[str], env: dict[str, str]) -> None:
        self.root, self.name, self.holder, self._ctr, self.kubelet_dir = root, name, holder, ctr, kubelet_dir
        self.kubelet_log = root / "kubelet.log"
        self.containerd_log = root / "containerd.log"
        self._argv, self._env = kubelet_argv, env
        self.kubelet: subprocess.Popen[bytes] | None = None
        self.kubelet_starts = 0

    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._ctr, *args], capture_output=True, text=True, timeout=timeout, check=False)

    def start_kubelet(self) -> None:
        self.kubelet_starts += 1
        with open(self.kubelet_log, "ab") as log:
            self.kubelet = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                                            start_new_session=True)

    def stop_kubelet(self) -> None:
        """SIGTERM (its containers keep running, as on a real node), then SIGKILL after 30 s."""
        proc, self.kubelet = self.kubelet, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(10)

    def restart_kubelet(self) -> None:
        self.stop_kubelet()
        self.start_kubelet()


def remove_cgroups(ids: list[str]) -> None:
    """The cgroups runc made for our containers (cgroupfs: k8s.io/<id> under each v1 controller, or under the v2
    root), once they are empty; only those, so another containerd's on the same host is never touched."""
    if not CGROUP_V1.is_dir():
        return
    parents = [CGROUP_V1, *(c for c in CGROUP_V1.iterdir() if c.is_dir() and not c.is_symlink())]
    for parent in parents:
        for cid in ids:
            with contextlib.suppress(OSError):
                (parent / "k8s.io" / cid).rmdir()


@contextlib.contextmanager
def kubelet_node(root: Path, plane: ControlPlane, name: str, cdi_dir: Path, containerd_tree: Path
                 ) -> Iterator[Node]:
    root.mkdir(parents=True, exist_ok=True)
    user = pwd.getpwnam("nobody")
    uid, gid = user.pw_uid, user.pw_gid
    kubelet_dir = root / "kubelet"
    for folder in (kubelet_dir, root / "kubelet-pki", root / "containerd"):
        folder.mkdir(parents=True, exist_ok=True)
    os.chown(kubelet_dir, uid, gid)
    os.chown(root / "kubelet-pki", uid, gid)
    os.chmod(root, 0o755)
    socket = root / "containerd" / "containerd.sock"
    write_containerd_config(root, socket, cdi_dir, uid, gid)
    port, healthz = free_port(), free_port()
    (root / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    (root / "kubelet.yaml").write_text(json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
        "failCgroupV1": False,  # this machine mounts cgroup v1; kubelets from 1.35 refuse it unless told
        "featureGates": {"KubeletInUserNamespace": True}, "failSwapOn": False,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{socket}", "address": "127.0.0.1", "port": port,
        "readOnlyPort": 0, "healthzPort": healthz, "healthzBindAddress": "127.0.0.1",
        "resolvConf": str(root / "resolv.conf"), "localStorageCapacityIsolation": False,
        "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "protectKernelDefaults": False, "makeIPTablesUtilChains": False, "serializeImagePulls": False,
        "registerNode": True, "syncFrequency": "2s", "nodeStatusUpdateFrequency": "2s",
        "fileCheckFrequency": "2s", "httpCheckFrequency": "2s",
    }))
    node_config = kubeconfig(root / "kubelet.kubeconfig", plane.server, plane.node_token)
    os.chmod(node_config, 0o644)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    # The namespace: created by nobody (root inside), held by a sleep. The tmpfs over /var/lib and /var/log is
    # mounted by the real root (a tmpfs mounted inside the user namespace would refuse containerd's files, whose
    # owner it cannot map) and given to nobody, whom the kubelet is outside.
    with contextlib.ExitStack() as stack:
        holder = stack.enter_context(namespace_holder(
            ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
             "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "--",
             "sleep", "86400"], env, root, "mnt", "the user+mount namespace"))
        for folder in ("/var/lib", "/var/log"):
            subprocess.run(["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--", "mount", "-t", "tmpfs", "-o",
                            f"mode=0755,uid={uid},gid={gid}", "tmpfs", folder], check=True, capture_output=True)
        # containerd: the namespace's mounts, the host's user (real root)
        tree_path = f"{containerd_tree}/usr/bin:{env['PATH']}"
        containerd = stack.enter_context(daemon_process(
            ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--",
             str(containerd_tree / "usr/bin/containerd"), "--config", str(root / "containerd.toml")],
            {**env, "PATH": tree_path}, root, "containerd.log"))
        ctr = [str(containerd_tree / "usr/bin/ctr"), "--address", str(socket), "-n", "k8s.io"]
        wait_ready(containerd, lambda: subprocess.run([*ctr, "version"], capture_output=True, timeout=10,
                                                      check=False).returncode == 0,
                   "containerd", root / "containerd.log", 30)
        stack.callback(stop_tasks, ctr)  # after the kubelet stops, before containerd does: no shim outlives it
        import_images(root, ctr)
        # the kubelet: in the namespace (user and mount)
        node = Node(root, name, holder.pid, ctr, kubelet_dir,
                    ["nsenter", f"--user=/proc/{holder.pid}/ns/user", f"--mount=/proc/{holder.pid}/ns/mnt",
                     "--", str(plane.bin_dir / "kubelet"),
                     f"--config={root / 'kubelet.yaml'}", f"--kubeconfig={node_config}", f"--root-dir={kubelet_dir}",
                     f"--cert-dir={root / 'kubelet-pki'}", f"--hostname-override={name}", "--v=2"], env)
        stack.callback(node.stop_kubelet)
        node.start_kubelet()
        plane.wait("the kubelet to register its node", lambda: plane.request("GET", f"/api/v1/nodes/{name}")[0] == 200
                   or (node.kubelet is not None and node.kubelet.poll() is not None and _fail(root / "kubelet.log")),
                   90, 0.5)
        yield node


def stop_tasks(ctr: list[str]) -> None:
    """Kill and delete every container's task (their shims then exit), then the containers and their cgroups."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ctr, *args], capture_output=True, text=True, timeout=30, check=False)

    ids = run("tasks", "ls", "-q").stdout.split()
    for task in ids:
        run("tasks", "kill", "-a", "-s", "SIGKILL", task)
    for task in ids:
        deadline = time.monotonic() + 10
        while run("tasks", "delete", task).returncode != 0 and time.monotonic() < deadline:
            if run("tasks", "ls", "-q").stdout.split().count(task) == 0:
                break
            time.sleep(0.1)
    containers = run("containers", "ls", "-q").stdout.split()
    for container in containers:
        run("containers", "rm", container)
    remove_cgroups(containers)


def _fail(log: Path) -> bool:
    raise AssertionError("the kubelet exited: " + log.read_text(errors="replace")[-4000:])


def untaint(plane: ControlPlane, name: str) -> None:
    """What the node lifecycle controller would do once the node is up: drop the not-ready taint (there is no
    kube-controller-manager here)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        node = plane.ok("GET", f"/api/v1/nodes/{name}")
        taints = node["spec"].get("taints") or []
        if not taints:
            return
        keep = [t for t in taints if t.get("key") != "node.kubernetes.io/not-ready"]
        plane.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": keep or None}},
                      content_type="application/merge-patch+json")
        time.sleep(0.5)
    raise AssertionError(f"node {name} keeps its taints")
