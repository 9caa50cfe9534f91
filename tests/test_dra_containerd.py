"""The DRA driver's prepare and unprepare through a real containerd 1.7 with CDI (Debian trixie's, from
.ci/fetch-docker-cdi), driven over the CRI the way the kubelet drives it: the test kubelet prepares the recorded
claim (tests/support/apireplay.py), then runs a pod sandbox and a container whose CDI devices are the ids the
driver answered; the container sees exactly the claim's GPUs and the driver's libcuda. After unprepare the ids no
longer resolve: containerd refuses a container asking for them. The full path with a real kubelet and scheduler
is tests/test_dra_e2e.py."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.apireplay import ApiReplay, recorded
from support.cri import cri_modules, host_sandbox, run_container
from support.drakubelet import DraKubelet
from support.e2e import need, need_root
from support.k8snode import containerd17, cri_containerd
from support.processes import short_tempdir

from gpuhook.discover import Roots, discover
from gpuhook.dra.driver import Driver, DriverConfig
from gpuhook.dra.kube import Api
from gpuhook.plugin.health import HealthConfig

pytestmark = pytest.mark.e2e

CLAIM = recorded("claim-allocated")
UID = CLAIM["body"]["metadata"]["uid"]


def test_claim_devices_reach_a_container_through_containerd_cri(fake_driver_factory: Any, tmp_path: Path) -> None:
    need_root()
    tree = containerd17()
    need(tree is not None, "no containerd 1.7 tree (run .ci/fetch-docker-cdi)")
    need(shutil.which("runc") is not None, "needs runc")
    pb, pb_grpc = cri_modules(tmp_path)
    fake = fake_driver_factory(gpus=4, nvlink="bridge")
    root = Path(short_tempdir("drc"))
    os.chmod(root, 0o755)
    cdi_dir = root / "cdi"
    logs = root / "logs"
    logs.mkdir()
    gpuhook = str(Path(sys.executable).with_name("gpuhook"))
    config = DriverConfig(node="node1", kubelet_dir=str(root / "kubelet"), cdi_dir=str(cdi_dir), hook_path=gpuhook,
                          health=HealthConfig(enabled=False))
    try:
        with ApiReplay().serve() as api, cri_containerd(root / "node", cdi_dir, tree) as (socket, _ctr):  # type: ignore[arg-type]
            api.add("node")
            api.add("slices-none", path="/apis/resource.k8s.io/v1/resourceslices")
            api.add("slice-created")
            api.add("claim-allocated")
            driver = Driver(config, lambda: discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc"))),
                            Api(server=api.url))
            driver.start()
            kubelet = DraKubelet(config.kubelet_dir)
            channel = grpc.insecure_channel(f"unix://{socket}")
            try:
                kubelet.register()
                answer = kubelet.prepare(("default", UID, "pair")).claims[UID]
                assert answer.error == ""
                ids = [i for d in answer.devices for i in d.cdi_device_ids]
                stub = pb_grpc.RuntimeServiceStub(channel)
                assert stub.Version(pb.VersionRequest(version="v1"), timeout=10).runtime_version.startswith("1.7")
                sandbox, sandbox_config = host_sandbox(pb, stub, logs)
                status, out = run_container(pb, stub, sandbox, sandbox_config, "c", ids, logs)
                assert status.exit_code == 0, f"{status.reason}: {status.message}\n{out}"
                assert "GPUS: nvidia0 nvidia1\n" in out and "LIBCUDA: yes" in out, out  # exactly the claim's two
                stub.RemoveContainer(pb.RemoveContainerRequest(container_id=status.id), timeout=30)

                assert kubelet.unprepare(("default", UID, "pair")).claims[UID].error == ""
                assert not any(cdi_dir.iterdir())
                with pytest.raises(grpc.RpcError) as refused:  # the ids resolve no more
                    run_container(pb, stub, sandbox, sandbox_config, "again", ids, logs)
                assert "unresolvable CDI devices" in (refused.value.details() or "")
                stub.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox), timeout=60)
                stub.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox), timeout=60)
            finally:
                channel.close()
                kubelet.close()
                driver.shutdown()
                driver.api.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
