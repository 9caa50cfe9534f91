"""The DevicePlugin gRPC service for one resource, served on its own unix socket.

ListAndWatch sends the full list (stable order: by GPU index, MIG index, replica) at once and again on every
health change; Allocate and GetPreferredAllocation answer from tables built at plan time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import grpc

from gpuhook.fileio.atomic import kind_of
from gpuhook.model.inventory import Inventory
from gpuhook.plugin import api_pb2 as pb
from gpuhook.plugin import api_pb2_grpc as pb_grpc
from gpuhook.plugin.allocate import AllocationError, allocate
from gpuhook.plugin.devices import Options, Resource
from gpuhook.plugin.devicespecs import DeviceSpecs
from gpuhook.plugin.state import HealthBoard
from gpuhook.plugin.topology import Chooser, Place

log = logging.getLogger("gpuhook.plugin.server")

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
STREAM_TICK = 1.0  # seconds a ListAndWatch stream sleeps before re-checking that it should still run


def _ms(start: float) -> float:
    return (time.monotonic() - start) * 1000


class DevicePluginService(pb_grpc.DevicePluginServicer):
    def __init__(self, resource: Resource, board: HealthBoard, table: dict[str, Place],
                 options: Options, inventory: Inventory | None = None, specs: DeviceSpecs | None = None,
                 marker_key: bytes = b"") -> None:
        self.resource = resource
        self.marker_key = marker_key  # seals Allocate's CDI marker (model/cdiignored.seal)
        self.board = board
        self.table = table
        self.options = options
        self.specs = specs  # DeviceSpecs for passDeviceSpecs, built once
        self.by_id = resource.by_id()
        self.chooser = Chooser(resource.devices, table, inventory)  # the inventory's GPU links, read once
        self.stopped = threading.Event()
        self._streams = threading.Lock()
        self.open_streams = 0
        self.dropped_at: float | None = None  # when kubelet last ended a stream while we served (monotonic)
        self.on_drop: Callable[[], None] | None = None  # told at once (the plugin's watch loop wakes)

    # -- list ---------------------------------------------------------------------------------------------------
    def device_list(self) -> pb.ListAndWatchResponse:
        unhealthy = self.board.unhealthy
        out = pb.ListAndWatchResponse()
        for d in self.resource.devices:
            dev = out.devices.add(ID=d.id, health=UNHEALTHY if d.key in unhealthy else HEALTHY)
            numa = self.table[d.id].numa if d.id in self.table else -1
            if numa >= 0:
                dev.topology.nodes.add(ID=numa)
        return out

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        context.add_callback(self.board.wake)
        with self._streams:
            self.open_streams += 1
            self.dropped_at = None
        try:
            version = self.board.version
            last = self.device_list()
            yield last
            while not self.stopped.is_set() and context.is_active():
                version = self.board.wait(version, STREAM_TICK)
                current = self.device_list()
                if current != last and not self.stopped.is_set():
                    last = current
                    yield current
        finally:
            with self._streams:
                self.open_streams -= 1
                if not self.stopped.is_set():
                    self.dropped_at = time.monotonic()
                wake = self.dropped_at is not None and not self.open_streams
            if wake and self.on_drop is not None:
                self.on_drop()

    def dropped_for(self) -> float:
        """Seconds since kubelet ended our last stream with none open since (0 while one is open, or none ended):
        a kubelet before 1.36 ends the new plugin's stream when the one it replaced stops."""
        with self._streams:
            if self.open_streams or self.dropped_at is None:
                return 0.0
            return time.monotonic() - self.dropped_at

    def forget_drop(self) -> None:
        with self._streams:
            self.dropped_at = None

    def stop(self) -> None:
        self.stopped.set()
        self.board.wake()

    # -- allocation ---------------------------------------------------------------------------------------------
    # Each call is logged at info level, ids in, CDI names out and the time taken: what an operator needs to
    # tie a pod's GPUs to the kubelet's request when a container starts with the wrong device or none.
    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> pb.PreferredAllocationResponse:
        start = time.monotonic()
        out = pb.PreferredAllocationResponse()
        logged = log.isEnabledFor(logging.INFO)  # the line is built only when it is written: this is a hot path
        parts = []
        for creq in request.container_requests:
            chosen = self.chooser.choose(list(creq.available_deviceIDs), list(creq.must_include_deviceIDs),
                                         int(creq.allocation_size))
            out.container_responses.add(deviceIDs=chosen)
            if logged:
                available, must = ",".join(creq.available_deviceIDs), ",".join(creq.must_include_deviceIDs)
                parts.append(f"available [{available}] must [{must}] size {creq.allocation_size} -> "
                             f"[{','.join(chosen)}] ({','.join(self._cdi_names(chosen))})")
        if logged:
            log.info("GetPreferredAllocation %s: %s in %.1f ms", self.resource.name, "; ".join(parts), _ms(start))
        return out

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        start = time.monotonic()
        ids = "; ".join(f"[{','.join(c.devices_ids)}]" for c in request.container_requests)
        try:
            response, chosen = allocate(request, self.by_id, self.board.unhealthy, self.options, self.specs,
                                        self.marker_key)
        except AllocationError as exc:
            log.warning("Allocate %s: ids %s refused in %.1f ms: %s", self.resource.name, ids, _ms(start), exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.resource.name}: {exc}")
            raise  # unreachable: abort raises
        if log.isEnabledFor(logging.INFO):
            names = "; ".join(f"[{','.join(d.cdi_name for d in devices)}]" for devices in chosen)
            log.info("Allocate %s: ids %s -> %s in %.1f ms", self.resource.name, ids, names, _ms(start))
        return response

    def _cdi_names(self, ids: Sequence[str]) -> list[str]:
        return [self.by_id[i].cdi_name if i in self.by_id else i for i in ids]

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _socket_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def remove_dead_sockets(folder: str, prefix: str = "gpuhook-") -> list[str]:
    """Remove our sockets in kubelet's folder that nobody listens on (a plugin killed without its clean-up);
    a live one (the plugin this one replaces, still serving) and anything that is not a socket stay."""
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".sock")]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(path)
                    continue  # somebody serves it
                except ConnectionRefusedError:
                    pass
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


class Endpoint:
    """One gRPC server on `<kubelet dir>/<socket name>`; knows whether its socket file is still its own."""

    def __init__(self, service: DevicePluginService, socket_path: str, workers: int = 32) -> None:
        self.service = service
        self.path = socket_path
        self.workers = workers  # each live ListAndWatch stream holds one worker thread
        self.server: grpc.Server | None = None
        self.identity: tuple[int, int] | None = None

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._remove_stale_socket()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers,
                                                        thread_name_prefix="gpuhook-grpc"),
                             options=[("grpc.so_reuseport", 0)])
        self.add_services(server)
        if server.add_insecure_port(f"unix://{self.path}") == 0:
            raise OSError(f"cannot listen on {self.path}")
        server.start()
        self.server = server
        self.identity = _socket_identity(self.path)
        log.info("serving %s on %s", self.label(), self.path)

    def add_services(self, server: grpc.Server) -> None:
        """What the socket serves (the DRA driver's endpoints serve other services the same way)."""
        pb_grpc.add_DevicePluginServicer_to_server(self.service, server)

    def label(self) -> str:
        return self.service.resource.name

    def _remove_stale_socket(self) -> None:
        """A socket left by an earlier run would make bind fail; anything else at the path (a file, FIFO,
        directory or device node) is not ours to remove."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise OSError(f"cannot listen on {self.path}: it is {kind_of(mode)}, not a socket")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def socket_intact(self) -> bool:
        return self.identity is not None and _socket_identity(self.path) == self.identity

    def stop(self, grace: float | None = 0.2) -> None:
        """Stop serving (streams end), then remove the socket if it is still ours."""
        self.service.stop()
        if self.server is not None:
            self.server.stop(grace).wait(2.0)
            self.server = None
        if self.socket_intact():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.identity = None
