"""The CRI (runtime.v1) as the kubelet speaks it, for the tests that drive containerd's CRI plugin directly:
the messages compiled from cri.proto, a pod sandbox on the node's network, and a container run to its end."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from support.k8snode import BUSYBOX_IMAGE

PROTO = Path(__file__).resolve().parent / "cri.proto"


def cri_modules(out: Path) -> tuple[ModuleType, ModuleType]:
    """runtime.v1 messages and stubs, compiled from support/cri.proto into `out`."""
    work = out / "cri"
    work.mkdir()
    shutil.copy(PROTO, work / "cri.proto")
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{work}", f"--python_out={work}",
                           f"--grpc_python_out={work}", str(work / "cri.proto")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(work))
    try:
        import cri_pb2
        import cri_pb2_grpc
    finally:
        sys.path.remove(str(work))
    return cri_pb2, cri_pb2_grpc


def host_sandbox(pb: Any, stub: Any, logs: Path) -> tuple[str, Any]:
    """A pod sandbox "p1" on the node's network, its containers' logs under `logs`: (its id, its config)."""
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="p1", uid="p1-uid", namespace="default"),
        log_directory=str(logs),
        linux=pb.LinuxPodSandboxConfig(security_context=pb.LinuxSandboxSecurityContext(
            namespace_options=pb.NamespaceOption(network=pb.NODE))))
    return stub.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=120).pod_sandbox_id, config


def run_container(pb: Any, stub: Any, sandbox: str, sandbox_config: Any, name: str, cdi_ids: list[str],
                  logs: Path) -> Any:
    """Create and start a container with `cdi_ids` that prints its GPU nodes and whether libcuda is there; wait
    for it to exit: (its status, its log)."""
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=BUSYBOX_IMAGE),
        command=["/bin/sh", "-c", "echo GPUS: $(ls /dev | grep -E '^nvidia[0-9]+$' | sort | tr '\\n' ' '); "
                                  "test -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 && echo LIBCUDA: yes"],
        log_path=f"{name}.log", CDI_devices=[pb.CDIDevice(name=i) for i in cdi_ids])
    created = stub.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=sandbox, config=config,
                                                             sandbox_config=sandbox_config), timeout=60)
    stub.StartContainer(pb.StartContainerRequest(container_id=created.container_id), timeout=60)
    deadline = time.monotonic() + 30
    while True:
        status = stub.ContainerStatus(pb.ContainerStatusRequest(container_id=created.container_id), timeout=10).status
        if status.state == pb.CONTAINER_EXITED or time.monotonic() > deadline:
            return status, (logs / f"{name}.log").read_text(errors="replace") if (logs / f"{name}.log").exists() else ""
        time.sleep(0.1)
