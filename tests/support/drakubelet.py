"""The kubelet's side of a DRA driver, over real gRPC: what its plugin watcher does with a socket that appears in
plugins_registry/ (GetInfo, check the type and versions, dial the endpoint, NotifyRegistrationStatus), and the
DRAPlugin calls its DRA manager makes (v1, or v1beta1 as a 1.32-1.33 kubelet does)."""

from __future__ import annotations

import os
import time

import grpc

from gpuhook.dra import dra_pb2 as pb
from gpuhook.dra import dra_pb2_grpc as pb_grpc
from gpuhook.dra import dra_v1beta1_pb2_grpc as pb_v1beta1_grpc
from gpuhook.dra import registration_pb2 as reg_pb
from gpuhook.dra import registration_pb2_grpc as reg_grpc

KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # what a 1.34 kubelet knows, newest first


def wait_socket(path: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"no socket at {path} after {timeout}s")
        time.sleep(0.02)


class DraKubelet:
    def __init__(self, kubelet_dir: str, driver: str = "gpu.nvidia.com") -> None:
        self.kubelet_dir, self.driver = kubelet_dir, driver
        self.info: reg_pb.PluginInfo | None = None
        self.service = ""
        self.channel: grpc.Channel | None = None

    def register(self, timeout: float = 10.0, versions: tuple[str, ...] = KUBELET_SERVICES) -> reg_pb.PluginInfo:
        """Register the driver as the kubelet does; returns its PluginInfo."""
        reg_socket = os.path.join(self.kubelet_dir, "plugins_registry", f"{self.driver}-reg.sock")
        wait_socket(reg_socket, timeout)
        with grpc.insecure_channel(f"unix://{reg_socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg_pb.InfoRequest(), timeout=timeout)
            chosen = next((v for v in info.supported_versions if v in versions), "")
            error = "" if info.type == "DRAPlugin" and info.name == self.driver and chosen else \
                f"unusable plugin {info.type}/{info.name} {list(info.supported_versions)}"
            if not error:
                self.service = chosen
                self.channel = grpc.insecure_channel(f"unix://{info.endpoint}")
            stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=not error, error=error),
                                          timeout=timeout)
        assert not error, error
        self.info = info
        return info

    def _stub(self) -> pb_grpc.DRAPluginStub | pb_v1beta1_grpc.DRAPluginStub:
        assert self.channel is not None, "register() first"
        if self.service == "v1beta1.DRAPlugin":
            return pb_v1beta1_grpc.DRAPluginStub(self.channel)
        return pb_grpc.DRAPluginStub(self.channel)

    def prepare(self, *claims: tuple[str, str, str], timeout: float = 10.0) -> pb.NodePrepareResourcesResponse:
        """claims: (namespace, uid, name)."""
        request = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=n, uid=u, name=c) for n, u, c in claims])
        return self._stub().NodePrepareResources(request, timeout=timeout)

    def unprepare(self, *claims: tuple[str, str, str], timeout: float = 10.0) -> pb.NodeUnprepareResourcesResponse:
        request = pb.NodeUnprepareResourcesRequest(claims=[pb.Claim(namespace=n, uid=u, name=c)
                                                           for n, u, c in claims])
        return self._stub().NodeUnprepareResources(request, timeout=timeout)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
