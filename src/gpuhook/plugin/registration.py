"""Register with kubelet: one background registrar per resource, retrying with a short capped backoff.

Kubelet's Register is synchronous (it dials our socket and asks GetDevicePluginOptions before answering), so it
is only called once our server is up. The incumbent waits 30 s after a failure; here the first retry comes after
10 ms and the delay doubles up to 1 s, so a kubelet that is just starting is caught within its first second.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from gpuhook.plugin import api_pb2 as pb
from gpuhook.plugin import api_pb2_grpc as pb_grpc

log = logging.getLogger("gpuhook.plugin.registration")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
FIRST_DELAY = 0.01
MAX_DELAY = 1.0
CALL_TIMEOUT = 5.0


def register(kubelet_socket: str, endpoint: str, resource_name: str, timeout: float = CALL_TIMEOUT) -> None:
    """One Register call; raises grpc.RpcError on failure."""
    request = pb.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
    )
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout, wait_for_ready=False)


class Registrar:
    """Keeps one resource registered: `request()` (re)starts the attempt loop, newest request wins."""

    def __init__(self, kubelet_socket: str, endpoint: str, resource_name: str) -> None:
        self.kubelet_socket = kubelet_socket
        self.endpoint = endpoint
        self.resource_name = resource_name
        self._cond = threading.Condition()
        self._wanted = 0  # generation asked for
        self._done = 0  # generation registered
        self._stopped = False
        self.registrations = 0
        self.last_success_ns = 0  # wall clock (ns) at which the last successful attempt started
        self._inflight_ns = 0  # start of the attempt under way for the newest generation, 0 when none
        self._thread = threading.Thread(target=self._run, name=f"gpuhook-register-{resource_name}", daemon=True)
        self._thread.start()

    def request(self) -> None:
        with self._cond:
            self._wanted += 1
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(1.0)  # a daemon thread: a Register call kubelet never answers must not hold up exit

    def registered(self) -> bool:
        with self._cond:
            return self._done == self._wanted and self._done > 0

    def registered_since(self, wall_ns: int) -> bool:
        """True when an attempt begun at or after `wall_ns` succeeded and nothing newer is pending."""
        with self._cond:
            if self._done == self._wanted:
                return self.last_success_ns >= wall_ns
            return self._inflight_ns >= wall_ns  # an attempt begun after kubelet came back is on its way

    def _run(self) -> None:
        delay = FIRST_DELAY
        failures = 0
        while True:
            with self._cond:
                while not self._stopped and self._done == self._wanted:
                    self._cond.wait()
                if self._stopped:
                    return
                generation = self._wanted
                started_ns = self._inflight_ns = time.time_ns()
            try:
                register(self.kubelet_socket, self.endpoint, self.resource_name)
            except grpc.RpcError as exc:
                with self._cond:
                    self._inflight_ns = 0
                failures += 1
                if failures == 1 or failures % 50 == 0:
                    log.warning("registering %s with %s failed (%s attempt(s)): %s", self.resource_name,
                                self.kubelet_socket, failures, _describe(exc))
                with self._cond:
                    if not self._stopped and self._wanted == generation:
                        self._cond.wait(delay)
                    # a new reason to register (kubelet came back) retries at once
                    delay = FIRST_DELAY if self._wanted != generation else min(delay * 2, MAX_DELAY)
                continue
            with self._cond:
                self._inflight_ns = 0
                self._done = max(self._done, generation)
                self.registrations += 1
                self.last_success_ns = max(self.last_success_ns, started_ns)
            delay, failures = FIRST_DELAY, 0
            log.info("registered %s with kubelet (endpoint %s)", self.resource_name, self.endpoint)


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'error'}: {details}"
