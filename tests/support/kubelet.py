"""A test kubelet: the Registration service on a temp `kubelet.sock`, and clients to plugin sockets (real gRPC).

It behaves like kubelet where the plugin can tell: Register is synchronous and dials the plugin's endpoint
(GetDevicePluginOptions) before answering, then a ListAndWatch stream is opened and every message recorded.
`restart()` does what a kubelet restart does to the directory: every socket deleted, kubelet.sock recreated.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from gpuhook.plugin import api_pb2 as pb
from gpuhook.plugin import api_pb2_grpc as pb_grpc
from support.processes import gpuhook_command

KUBELET_SOCKET = "kubelet.sock"


@dataclass
class Registration:
    request: pb.RegisterRequest
    options: pb.DevicePluginOptions | None  # what the plugin answered when dialled back
    generation: int = 0  # which start() of the test kubelet it reached
    at: float = field(default_factory=time.monotonic)


class Stream:
    """A ListAndWatch stream consumed in the background; every message is kept, in order."""

    def __init__(self, stub: pb_grpc.DevicePluginStub) -> None:
        self.messages: list[pb.ListAndWatchResponse] = []
        self.arrived: list[float] = []
        self.ended = threading.Event()
        self.error: grpc.RpcError | None = None
        self._cond = threading.Condition()
        self._call = stub.ListAndWatch(pb.Empty())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self._call:
                with self._cond:
                    self.messages.append(msg)
                    self.arrived.append(time.monotonic())
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[pb.ListAndWatchResponse], bool], timeout: float = 5.0,
                 start: int = 0) -> pb.ListAndWatchResponse:
        """The first message from index `start` on that satisfies `predicate`; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for msg in self.messages[start:]:
                    if predicate(msg):
                        return msg
                left = deadline - time.monotonic()
                if left <= 0 or self.ended.is_set():
                    raise AssertionError(f"no matching ListAndWatch message in {timeout}s; got {self.summary()}")
                self._cond.wait(left)

    def first(self, timeout: float = 5.0) -> pb.ListAndWatchResponse:
        return self.wait_for(lambda m: True, timeout)

    def summary(self) -> list[list[tuple[str, str]]]:
        return [health(m) for m in self.messages]

    def cancel(self) -> None:
        self._call.cancel()
        self.ended.wait(5)


def health(msg: pb.ListAndWatchResponse) -> list[tuple[str, str]]:
    return [(d.ID, d.health) for d in msg.devices]


class PluginClient:
    """kubelet's side of one plugin socket."""

    def __init__(self, socket_path: str) -> None:
        self.path = socket_path
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)

    def options(self, timeout: float = 5.0) -> pb.DevicePluginOptions:
        return self.stub.GetDevicePluginOptions(pb.Empty(), timeout=timeout)

    def allocate(self, *containers: Sequence[str], timeout: float = 5.0) -> pb.AllocateResponse:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))
                                                         for ids in containers])
        return self.stub.Allocate(request, timeout=timeout)

    def preferred(self, available: Iterable[str], must: Iterable[str] = (), size: int = 1,
                  timeout: float = 5.0) -> list[str]:
        request = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must), allocation_size=size)])
        return list(self.stub.GetPreferredAllocation(request, timeout=timeout).container_responses[0].deviceIDs)

    def watch(self) -> Stream:
        return Stream(self.stub)

    def close(self) -> None:
        self.channel.close()


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: TestKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        k = self.kubelet
        generation = k.generation  # taken now: a call the previous kubelet accepted may end after a restart
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
        options = None
        if k.dial_back:
            client = PluginClient(os.path.join(k.directory, request.endpoint))
            try:
                options = client.options(timeout=2.0)
            except grpc.RpcError as exc:
                client.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot dial plugin {request.endpoint}: {exc.code()}")
            k._attach(request.resource_name, client, generation)
        k._record(Registration(request, options, generation))
        return pb.Empty()


class TestKubelet:
    """Registration server on `<directory>/kubelet.sock`; streams and clients per registered resource."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: str, dial_back: bool = True, watch: bool = True) -> None:
        self.directory = directory
        self.dial_back = dial_back
        self.watch = watch
        self.registrations: list[Registration] = []
        self.events: queue.Queue[Registration] = queue.Queue()
        self.clients: dict[str, PluginClient] = {}
        self.streams: dict[str, Stream] = {}
        self.superseded: list[tuple[PluginClient, Stream | None]] = []  # other sockets' earlier registrations
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self.generation = 0

    @property
    def socket(self) -> str:
        return os.path.join(self.directory, KUBELET_SOCKET)

    def start(self) -> TestKubelet:
        os.makedirs(self.directory, exist_ok=True)
        self.generation += 1
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(5)
            self._server = None
        for client, stream in self.superseded:
            if stream is not None:
                stream.cancel()
            client.close()
        for stream in list(self.streams.values()):
            stream.cancel()
        for client in list(self.clients.values()):
            client.close()
        self.streams.clear()
        self.clients.clear()
        self.superseded.clear()

    def restart(self, remove_dir: bool = False) -> float:
        """What a kubelet restart does: stop, delete every socket (or the whole directory), serve kubelet.sock
        again. Returns the monotonic time taken just before the new kubelet.sock is served: a registration this
        generation receives comes after it (one stamped after start() could lose the race to a fast plugin)."""
        self.stop()
        if remove_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            for name in os.listdir(self.directory):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
        serving_from = time.monotonic()
        self.start()
        return serving_from

    def _attach(self, resource: str, client: PluginClient, generation: int) -> None:
        """Make the registration the resource's current client and stream; a registration the previous kubelet
        took, ending after the restart, attaches nothing. The one it supersedes on the same socket is closed; one
        on another socket (the plugin being replaced) keeps its stream until that plugin ends it, as kubelet 1.36+
        keeps an endpoint per socket."""
        if generation != self.generation:
            client.close()
            return
        old_stream, old_client = self.streams.get(resource), self.clients.get(resource)
        self.clients[resource] = client
        if self.watch:
            self.streams[resource] = client.watch()
        if old_client is not None and old_client.path != client.path:
            self.superseded.append((old_client, old_stream))
            return
        if old_stream is not None:
            old_stream.cancel()
        if old_client is not None:
            old_client.close()

    def _record(self, reg: Registration) -> None:
        with self._cond:
            self.registrations.append(reg)
            self._cond.notify_all()
        self.events.put(reg)

    def wait_registrations(self, count: int, timeout: float = 10.0, current: bool = True) -> list[Registration]:
        """The first `count` registrations this kubelet (since its last start, unless current=False) received."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = [r for r in self.registrations if not current or r.generation == self.generation]
                if len(got) >= count:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [(r.request.resource_name, r.request.endpoint, r.generation) for r in self.registrations]
                    raise AssertionError(f"expected {count} registrations in {timeout}s, got {names}")
                self._cond.wait(left)

    def client(self, resource: str = "nvidia.com/gpu") -> PluginClient:
        return self.clients[resource]

    def stream(self, resource: str = "nvidia.com/gpu") -> Stream:
        return self.streams[resource]

    def __enter__(self) -> TestKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- running the plugin ----------------------------------------------------------------------------------------


class PluginProcess:
    """`gpuhook device-plugin …` as a real subprocess (for signals and kubelet restarts)."""

    def __init__(self, args: Sequence[str], log_path: str) -> None:
        import subprocess

        # the plugin makes the node's key in its --hook-state-dir: one of the test's own, never the host's
        own = [] if any(a.startswith("--hook-state-dir") for a in args) else [
            "--hook-state-dir", os.path.join(os.path.dirname(os.path.abspath(log_path)), "records")]
        self.args = [*gpuhook_command(), "device-plugin", *args, *own]
        self.log_path = log_path
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, encoding="utf-8") as f:
            return f.read()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> PluginProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
