"""node-setup on a containerd 1.7 node whose CDI is off, end to end through the CRI the kubelet uses: node-setup's
drop-in turns CDI on and its `--restart signal` restarts the supervised daemon; a CDI spec made by the gpuhook it
installed (its hooks call the installed entry: the image's Python by its own loader) then gives a CRI container
exactly the GPU it names, with the driver's libraries; uninstall restarts the daemon on the node's own config,
which is back to the byte."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.cri import cri_modules, host_sandbox, run_container
from support.e2e import need, need_root
from support.k8snode import containerd17, import_images, stop_tasks, write_containerd_config
from support.processes import short_tempdir
from test_nodesetup import containerd_pid, dump, snapshot, supervised_containerd, wait_for

pytestmark = pytest.mark.e2e
GPUHOOK = str(Path(sys.executable).with_name("gpuhook"))


def test_node_setup_turns_cdi_on_and_a_cri_container_gets_its_gpu(fake_driver: Any, tmp_path: Path) -> None:
    need_root()
    tree = containerd17()
    need(tree is not None, "no containerd 1.7 tree (run .ci/fetch-docker-cdi)")
    need(shutil.which("runc") is not None and shutil.which("nsenter") is not None, "needs runc and nsenter")
    pb, pb_grpc = cri_modules(tmp_path)
    node = Path(short_tempdir("nsc"))
    try:
        cdi = node / "cdi"
        cdi.mkdir()
        socket = node / "containerd" / "containerd.sock"
        (node / "containerd").mkdir()
        config = write_containerd_config(node, socket, cdi)
        config.write_text(config.read_text().replace("enable_cdi = true", "enable_cdi = false"))  # before gpuhook
        (node / "devchar").mkdir()
        stand_in = node_files(node)
        assert "containerd.toml" in stand_in
        binary = str(tree / "usr/bin/containerd")  # type: ignore[operator]
        ctr = [str(tree / "usr/bin/ctr"), "--address", str(socket), "-n", "k8s.io"]  # type: ignore[operator]
        prefix = node / "opt/gpuhook"
        args = ["--prefix", str(prefix), "--runtime", "containerd", "--runtime-config", str(config), "--restart",
                "signal", "--driver-root", str(fake_driver.root), "--dev-root", str(fake_driver.root),
                "--proc-root", f"{fake_driver.root}/proc", "--dev-char-path", str(node / "devchar")]
        with supervised_containerd(binary, config, node / "daemon"):
            first = wait_for("containerd", lambda: containerd_pid(config))
            wait_for("containerd's socket", lambda: socket.exists())
            import_images(node, ctr)
            assert "enable_cdi = false" in dump(binary, config)
            result = subprocess.run([GPUHOOK, "node-setup", "install", *args], capture_output=True, text=True,
                                    timeout=300, check=False)  # fmt: skip
            assert result.returncode == 0, result.stdout + result.stderr
            assert wait_for("containerd again", lambda: containerd_pid(config)) != first
            assert "enable_cdi = true" in dump(binary, config)
            made = subprocess.run([str(prefix / "bin/gpuhook"), "generate-cdi", "--driver-root", str(fake_driver.root),
                                   "--proc-root", f"{fake_driver.root}/proc", "--hook-path",
                                   str(prefix / "bin/gpuhook-hook"), "--output", str(cdi / "nvidia.yaml")],
                                  capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
            assert made.returncode == 0, made.stderr
            assert f"path: {prefix}/bin/gpuhook-hook" in (cdi / "nvidia.yaml").read_text()
            wait_for("the CRI", lambda: socket.exists())
            channel = grpc.insecure_channel(f"unix://{socket}")
            try:
                stub = pb_grpc.RuntimeServiceStub(channel)
                wait_for("the CRI to answer", lambda: _answers(pb, stub))
                logs = node / "logs"
                logs.mkdir()
                sandbox, sandbox_config = host_sandbox(pb, stub, logs)
                status, out = run_container(pb, stub, sandbox, sandbox_config, "c", ["nvidia.com/gpu=1"], logs)
                assert status.exit_code == 0, f"{status.reason}: {status.message}\n{out}"
                assert "GPUS: nvidia1\n" in out and "LIBCUDA: yes" in out, out
                stub.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox), timeout=60)
                stub.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox), timeout=60)
            finally:
                channel.close()
                stop_tasks(ctr)
            second = containerd_pid(config)
            result = subprocess.run([GPUHOOK, "node-setup", "uninstall", *args], capture_output=True, text=True,
                                    timeout=300, check=False)  # fmt: skip
            assert result.returncode == 0, result.stdout + result.stderr
            assert wait_for("containerd once more", lambda: containerd_pid(config)) != second
            assert "enable_cdi = false" in dump(binary, config)
        assert node_files(node) == stand_in
    finally:
        shutil.rmtree(node, ignore_errors=True)


# containerd's own root, state and socket, its CNI folders, the CDI spec and images the test makes: not the node's
DAEMON_OWN = {"containerd", "cni", "cdi", "daemon", "logs", "pause.tar", "busybox.tar"}


def node_files(node: Path) -> dict[str, tuple[Any, ...]]:
    """The stand-in node as node-setup may touch it: its containerd config, the prefix, the /dev/char folder."""
    return {p: v for p, v in snapshot(node).items() if p.split("/")[0] not in DAEMON_OWN}


def _answers(pb: Any, stub: Any) -> bool:
    try:
        return stub.Version(pb.VersionRequest(version="v1"), timeout=5).runtime_version.startswith("1.7")
    except grpc.RpcError:
        return False
