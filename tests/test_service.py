"""`gpuhook service` and the native hook entry (issue 21): the protocol's bounds, who may talk to the service,
a runc start through it giving the container the in-process hook gives, and every way the service can fail a
client (stopped, hung, dead after accepting) ending as the safety rules say: fall back only before a request
was sent, otherwise one line and exit 1, never a second injection."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.e2e import need_root
from test_hook_e2e import write_config

from gpuhook.service import protocol


def state(bundle: Path, cid: str = "c1", pid: int = 1) -> bytes:
    return json.dumps({"ociVersion": "1.0.2", "id": cid, "pid": pid, "status": "creating",
                       "bundle": str(bundle)}).encode()  # fmt: skip


def plain_bundle(tmp: Path, env: list[str]) -> Path:
    bundle = tmp / "plain-bundle"
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"},
                                                    "process": {"env": ["PATH=/bin", *env]}}))
    return bundle


# --- the protocol -----------------------------------------------------------------------------------------------


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def test_request_round_trip_with_the_pid_fd() -> None:
    client, server = _pair()
    fd = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:
        protocol.send_request(client, ["--config", "/x.toml", "prestart"], b'{"pid": 1}', "/env.toml", pid_fd=fd)
        request = protocol.read_request(server)
    finally:
        os.close(fd)
    assert request.argv == ["--config", "/x.toml", "prestart"] and request.config_env == "/env.toml"
    assert request.state == b'{"pid": 1}' and request.pid_fd is not None
    assert os.path.samestat(os.fstat(request.pid_fd), os.stat("/proc/self"))
    os.close(request.pid_fd)
    assert protocol.decode_answer(protocol.encode_answer(1, "gpuhook-hook: no")) == (1, "gpuhook-hook: no")


def _framed(header: bytes) -> bytes:
    return len(header).to_bytes(4, "big") + header


@pytest.mark.parametrize(("raw", "why"), [
    ((protocol.MAX_HEADER + 1).to_bytes(4, "big"), "header of .* bytes is over"),
    (_framed(b"hello"), "not JSON"),
    (_framed(b'{"v": 99}'), "version 99 is not 1"),
    (_framed(b'{"v": 1, "argv": [], "state": 1073741824}'), "state size 1073741824 is outside"),
    (_framed(b'{"v": 1, "argv": [1], "state": 0}'), "argv is not a list of strings"),
    (_framed(b'{"v": 1, "argv": [], "state": 9}'), "cut short after 0 of 9 bytes"),
])  # fmt: skip
def test_requests_outside_the_bounds_are_refused(raw: bytes, why: str) -> None:
    client, server = _pair()
    client.sendall(raw)
    client.shutdown(socket.SHUT_WR)
    with pytest.raises(protocol.ProtocolError, match=why):
        protocol.read_request(server)


def test_a_slow_client_is_timed_out() -> None:
    client, server = _pair()
    client.sendall(b"\0\0")  # half a length, then nothing
    start = time.monotonic()
    with pytest.raises(protocol.ProtocolError, match="not complete within"):
        protocol.read_request(server, timeout=0.3)
    assert time.monotonic() - start < 2


def test_extra_descriptors_are_closed_never_kept() -> None:
    client, server = _pair()
    import array

    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(3)]
    data = protocol.encode_request([], b"", pid_fd=True)
    client.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    before = set(os.listdir("/proc/self/fd"))
    request = protocol.read_request(server)
    assert request.pid_fd is not None
    os.close(request.pid_fd)
    assert set(os.listdir("/proc/self/fd")) <= before
    for fd in fds:
        os.close(fd)


# --- the running service ----------------------------------------------------------------------------------------


class Running:
    def __init__(self, proc: subprocess.Popen[bytes], sock: Path, log: Path) -> None:
        self.proc, self.sock, self.log = proc, sock, log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


def start_service(tmp: Path, config: Path) -> Running:
    sock = tmp / "run" / "service.sock"
    log = tmp / "service.err"
    gpuhook = Path(sys.executable).with_name("gpuhook")
    with open(log, "wb") as err:
        proc = subprocess.Popen([str(gpuhook), "service", "--config", str(config), "--socket", str(sock)],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"service did not start: {log.read_text()}")
        time.sleep(0.02)
    return Running(proc, sock, log)


@pytest.fixture()
def root_tmp(tmp_path: Path) -> Path:
    need_root()
    return tmp_path


@pytest.fixture()
def service(root_tmp: Path) -> Iterator[Running]:
    running = start_service(root_tmp, write_config(root_tmp, Path("/")))
    yield running
    running.stop()


def ask(sock: Path, argv: list[str], body: bytes) -> tuple[int, str]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(sock))
        protocol.send_request(conn, argv, body)
        return protocol.recv_answer(conn)


def test_socket_is_root_only_and_removed_at_stop(service: Running) -> None:
    assert stat.S_IMODE(service.sock.stat().st_mode) == 0o600 and stat.S_ISSOCK(service.sock.stat().st_mode)
    assert stat.S_IMODE(service.sock.parent.stat().st_mode) == 0o700
    service.stop()
    assert service.proc.returncode == 0 and not service.sock.exists()


def test_no_gpu_request_is_one_round_trip_logged_as_skip(service: Running, root_tmp: Path) -> None:
    code, line = ask(service.sock, ["--config", str(root_tmp / "config.toml"), "prestart"],
                     state(plain_bundle(root_tmp, []), cid="nogpu"))
    assert (code, line) == (0, "")
    (logged,) = (root_tmp / "gpuhook.log").read_text().splitlines()
    assert " nogpu skip request=unset took=" in logged


def test_errors_are_the_hooks_own_line(service: Running, root_tmp: Path) -> None:
    code, line = ask(service.sock, ["--config", str(root_tmp / "missing.toml")], state(plain_bundle(root_tmp, [])))
    assert code == 1 and line == f"gpuhook-hook: config file {root_tmp / 'missing.toml'} not found"
    code, line = ask(service.sock, ["--bogus"], b"")
    assert code == 1 and line.startswith("gpuhook-hook: unexpected argument '--bogus'")
    code, line = ask(service.sock, ["--config", str(root_tmp / "config.toml")], b"{not json")
    assert code == 1 and line.startswith("gpuhook-hook: ") and "\n" not in line


def test_a_second_service_on_the_same_socket_is_refused(service: Running, root_tmp: Path) -> None:
    gpuhook = Path(sys.executable).with_name("gpuhook")
    result = subprocess.run([str(gpuhook), "service", "--socket", str(service.sock)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 1 and result.stderr == f"gpuhook service: a service already listens on {service.sock}\n"


def test_systemd_socket_activation(root_tmp: Path) -> None:
    """LISTEN_FDS=1 with our pid in LISTEN_PID: fd 3 is the socket, nothing is bound at the config's path."""
    sock_path = root_tmp / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(8)
    config = write_config(root_tmp, Path("/"), service_socket=str(root_tmp / "unused" / "s.sock"))
    code = (f"import os, sys; os.dup2({listener.fileno()}, 3); os.environ['LISTEN_FDS'] = '1'; "
            "os.environ['LISTEN_PID'] = str(os.getpid()); from gpuhook.service.server import main; "
            f"sys.exit(main({str(config)!r}, None))")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(listener.fileno(),))
    try:
        answer = ask(sock_path, ["--config", str(config)], state(plain_bundle(root_tmp, []), cid="activated"))
        assert answer == (0, "")
        assert " activated skip request=unset" in (root_tmp / "gpuhook.log").read_text()
        assert not (root_tmp / "unused").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        listener.close()
