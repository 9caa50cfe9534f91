"""The test cluster's network, made without touching the host's: a "fabric" network namespace holding a bridge,
each node's own network namespace joined to it by a veth (the node's address 10.77.0.<n>), and in each node the
way to the API server (which listens on the host's 127.0.0.1): a forwarder on the node's address, port 6443,
created inside the node's namespace by a thread of this process, and a DNAT rule in the node's namespace that
sends the `kubernetes` Service's ClusterIP (10.96.0.1:443, what pods' in-cluster clients dial) there, as
kube-proxy would. No interface, route, rule or sysctl of the host's namespace changes, and nothing is written
under /run (the namespaces are held by processes, never named in /run/netns).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from .daemon import daemon_process, wait_ready

FABRIC = "10.77.0"
SERVICE_IP = "10.96.0.1"
API_PORT = 6443
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def in_netns(pid: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", *argv], capture_output=True, text=True,
                         timeout=30, check=False)
    if check:
        assert out.returncode == 0, f"{' '.join(argv)} in netns of {pid}: {out.stderr}"
    return out


@contextlib.contextmanager
def fabric(root: Path) -> Iterator[int]:
    """A network namespace with the bridge `fab0`, held by a sleep; yields the holder's pid."""
    with daemon_process(["unshare", "--net", "--", "sleep", "86400"], {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                        root, "fabric.log") as holder:
        wait_ready(holder, lambda: _other_netns(holder.pid), "the fabric namespace", root / "fabric.log", 20, 0.05)
        in_netns(holder.pid, "ip", "link", "add", "fab0", "type", "bridge")
        in_netns(holder.pid, "ip", "link", "set", "fab0", "up")
        yield holder.pid


def _other_netns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def wire_node(fabric_pid: int, node_pid: int, index: int) -> str:
    """A veth from the fabric's bridge to the node's namespace (eth0, 10.77.0.<index+10>/24), forwarding on,
    and the `kubernetes` Service's ClusterIP sent to the node's API forwarder; returns the node's address."""
    address = f"{FABRIC}.{index + 10}"
    host_end = f"gh{os.getpid() % 10000}n{index}"
    in_netns(fabric_pid, "ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns",
             str(node_pid))
    in_netns(fabric_pid, "ip", "link", "set", host_end, "master", "fab0", "up")
    for argv in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{address}/24", "dev", "eth0"],
                 ["ip", "link", "set", "eth0", "up"], ["sysctl", "-qw", "net.ipv4.ip_forward=1"]):
        in_netns(node_pid, *argv)
    for chain in ("OUTPUT", "PREROUTING"):
        in_netns(node_pid, "iptables", "-t", "nat", "-A", chain, "-d", SERVICE_IP, "-p", "tcp", "--dport", "443",
                 "-j", "DNAT", "--to-destination", f"{address}:{API_PORT}")
    return address


class Forwarder:
    """Connections to `address`:6443 inside a node's network namespace, each carried to the API server on the
    host's 127.0.0.1:`port` (TLS passes through untouched). One thread, a selector; stopped with `close()`."""

    def __init__(self, node_pid: int, address: str, port: int) -> None:
        self.port = port
        own = os.open("/proc/self/ns/net", os.O_RDONLY)
        theirs = os.open(f"/proc/{node_pid}/ns/net", os.O_RDONLY)
        result: list[socket.socket | BaseException] = []

        def make() -> None:  # setns changes this thread's network namespace only
            try:
                _setns(theirs)
                listener = socket.create_server((address, API_PORT), backlog=64)
                _setns(own)
                result.append(listener)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result.append(exc)

        maker = threading.Thread(target=make)
        maker.start()
        maker.join()
        os.close(own)
        os.close(theirs)
        if isinstance(result[0], BaseException):
            raise result[0]
        self.listener = result[0]
        self.listener.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stop.is_set():
            for key, _ in sel.select(0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    with contextlib.suppress(BlockingIOError):
                        client, _addr = self.listener.accept()
                        try:
                            upstream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                        except OSError:
                            client.close()
                            continue
                        for a, b in ((client, upstream), (upstream, client)):
                            a.setblocking(False)
                            peers[a] = b
                            sel.register(a, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                other = peers.get(sock)
                if data and other is not None:
                    try:
                        other.setblocking(True)
                        other.sendall(data)
                        other.setblocking(False)
                        continue
                    except OSError:
                        pass
                for end in (sock, other):
                    if end is not None and end in peers:
                        sel.unregister(end)
                        peers.pop(end)
                        end.close()
        for end in list(peers):
            end.close()
        self.listener.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
