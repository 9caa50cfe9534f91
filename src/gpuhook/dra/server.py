"""The kubelet-facing gRPC services: DRAPlugin (v1, and v1beta1 for 1.32-1.33 kubelets, same messages) on
`<kubelet-dir>/plugins/<driver>/dra.sock`, and pluginregistration's Registration on
`<kubelet-dir>/plugins_registry/<driver>-reg.sock` (the kubelet's plugin watcher finds it there, asks GetInfo,
dials the DRA socket and reports with NotifyRegistrationStatus).

Claims of one request are prepared one after another: each gets its own result, a refused one never stops the
others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from gpuhook.dra import dra_pb2 as pb
from gpuhook.dra import dra_pb2_grpc as pb_grpc
from gpuhook.dra import dra_v1beta1_pb2_grpc as pb_v1beta1_grpc
from gpuhook.dra import registration_pb2 as reg_pb
from gpuhook.dra import registration_pb2_grpc as reg_grpc
from gpuhook.dra.prepare import Preparer
from gpuhook.plugin.server import Endpoint

log = logging.getLogger("gpuhook.dra.server")

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # newest first: the kubelet takes the first it knows


class DraService(pb_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    def NodePrepareResources(self, request: pb.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> pb.NodePrepareResourcesResponse:
        out = pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            devices, error = self.preparer.prepare(claim.namespace, claim.uid, claim.name)
            result = out.claims[claim.uid]
            if error:
                result.error = error
                continue
            for d in devices:
                result.devices.add(request_names=list(d.requests), pool_name=d.pool, device_name=d.device,
                                   cdi_device_ids=list(d.cdi_ids))
        return out

    def NodeUnprepareResources(self, request: pb.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> pb.NodeUnprepareResourcesResponse:
        out = pb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            out.claims[claim.uid].error = self.preparer.unprepare(claim.uid)
        return out


class DraServiceV1Beta1(pb_v1beta1_grpc.DRAPluginServicer):
    """The same calls under v1beta1's service name (identical messages on the wire)."""

    def __init__(self, service: DraService) -> None:
        self.NodePrepareResources = service.NodePrepareResources  # type: ignore[method-assign]
        self.NodeUnprepareResources = service.NodeUnprepareResources  # type: ignore[method-assign]


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered = threading.Event()
        self.last_error = ""
        self.notifications = 0

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(type=PLUGIN_TYPE, name=self.driver, endpoint=self.endpoint,
                                 supported_versions=list(SUPPORTED_VERSIONS))

    def NotifyRegistrationStatus(self, request: reg_pb.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg_pb.RegistrationStatusResponse:
        self.notifications += 1
        if request.plugin_registered:
            self.last_error = ""
            self.registered.set()
            log.info("registered with the kubelet as DRA driver %s", self.driver)
        else:
            self.last_error = request.error
            self.registered.clear()
            log.error("the kubelet refused the registration of %s: %s", self.driver, request.error)
        return reg_pb.RegistrationStatusResponse()


class _Stoppable:
    """What Endpoint.stop() calls on its service."""

    def stop(self) -> None:
        pass


class GrpcEndpoint(Endpoint):
    """One gRPC server on a unix socket: the device plugin's Endpoint (stale-socket removal, the socket's
    identity, a stop that removes only our own socket) serving the services `add` puts on it."""

    def __init__(self, add: Callable[[grpc.Server], None], socket_path: str, name: str, workers: int = 8) -> None:
        super().__init__(_Stoppable(), socket_path, workers)  # type: ignore[arg-type]
        self.add = add
        self.name = name

    def add_services(self, server: grpc.Server) -> None:
        self.add(server)

    def label(self) -> str:
        return self.name


def dra_endpoint(service: DraService, path: str) -> GrpcEndpoint:
    def add(server: grpc.Server) -> None:
        pb_grpc.add_DRAPluginServicer_to_server(service, server)
        pb_v1beta1_grpc.add_DRAPluginServicer_to_server(DraServiceV1Beta1(service), server)

    return GrpcEndpoint(add, path, "DRAPlugin")


def registration_endpoint(service: RegistrationService, path: str) -> GrpcEndpoint:
    return GrpcEndpoint(lambda server: reg_grpc.add_RegistrationServicer_to_server(service, server), path,
                        "Registration", workers=2)
