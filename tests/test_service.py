"""`gpuhook service` and the native hook entry: the protocol's bounds, who may talk to the service,
a runc start through it giving the container the in-process hook gives, and every way the service can fail a
client (stopped, hung, dead after accepting) ending as the safety rules say: fall back only before a request
was sent, otherwise one line and exit 1, never a second injection."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.e2e import need_tool
from support.glibc import glibc_rootfs
from support.runc import make_bundle, need_busybox, runc_run, unique_id
from support.service import GPUHOOK, Running, no_fallback, start
from test_hook_e2e import PROBE, nodes, write_config

from gpuhook.cli import entry as hook_entry
from gpuhook.service import protocol

NEEDS_NATIVE = pytest.mark.skipif(hook_entry.native_entry() is None, reason="the native entry was not built")
HOOK_PATH_ENV = "PATH=/usr/sbin:/usr/bin:/sbin:/bin"


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
    assert protocol.decode_answer(protocol.encode_answer(1, "gpuhook-hook: no")) == (1, "gpuhook-hook: no", b"")


def test_a_commands_answer_carries_its_output_and_a_header_its_context() -> None:
    """generate-cdi's answer: stderr and stdout, each bounded; its request: cwd, interpreter, SERVED_ENV."""
    answer = protocol.encode_answer(0, "note\n", b"cdiVersion: 0.5.0\n")
    assert protocol.decode_answer(answer, with_output=True) == (0, "note\n", b"cdiVersion: 0.5.0\n")
    assert protocol.decode_answer(protocol.encode_answer(1, "refused"), with_output=True) == (1, "refused", b"")
    with pytest.raises(protocol.ProtocolError, match="does not match its length"):
        protocol.decode_answer(answer)  # a hook's answer has no output part
    with pytest.raises(protocol.ProtocolError, match="output length"):
        protocol.decode_answer(answer[:-1], with_output=True)
    client, server = _pair()
    with client, server:
        client.sendall(protocol.encode_request(["generate-cdi", "-o", 'a"\n\u00e9'], b"", cwd="/w", exe="/v/bin/py",
                                               env=protocol.served_env({"PATH": "/bin", "HOME": "/root"})))
        request = protocol.read_request(server)
    assert (request.argv, request.cwd, request.exe, request.env) == (["generate-cdi", "-o", 'a"\n\u00e9'], "/w",
                                                                     "/v/bin/py", ["PATH=/bin"])


def _framed(header: bytes) -> bytes:
    return len(header).to_bytes(4, "big") + header


def _sent(data: bytes) -> socket.socket:
    """The server end of a pair whose client sent `data` and closed."""
    client, server = _pair()
    client.sendall(data)
    client.close()
    return server


_NO_LATE = "a request whose state follows has no state or descriptor"


@pytest.mark.parametrize(("raw", "why"), [
    ((protocol.MAX_HEADER + 1).to_bytes(4, "big"), "header of .* bytes is over"),
    (_framed(b"hello"), "not JSON"),
    (_framed(b'{"v": 99}'), "version 99 is not 2"),
    (_framed(b'{"v": 2, "argv": [], "state": 1073741824}'), "state size 1073741824 is outside"),
    (_framed(b'{"v": 2, "argv": [1], "state": 0}'), "argv is not a list of strings"),
    (_framed(b'{"v": 2, "argv": [], "state": 9}'), "cut short after 0 of 9 bytes"),
    # a header whose state follows (`later`) carries neither a state nor a descriptor
    (_framed(b'{"v": 2, "argv": [], "state": 2, "later": true}') + b"{}", _NO_LATE),
    (_framed(b'{"v": 2, "argv": [], "state": 0, "pid_fd": true, "later": true}'), _NO_LATE),
    (_framed(b'{"v": 2, "argv": [], "state": 0, "later": "yes"}'), _NO_LATE),
])  # fmt: skip
def test_requests_outside_the_bounds_are_refused(raw: bytes, why: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=why):
        protocol.read_request(_sent(raw))


def test_a_slow_client_is_timed_out() -> None:
    client, server = _pair()
    client.sendall(b"\0\0")  # half a length, then nothing
    start = time.monotonic()
    with pytest.raises(protocol.ProtocolError, match="not complete within"):
        protocol.read_request(server, timeout=0.3)
    assert time.monotonic() - start < 2


def test_extra_descriptors_are_closed_never_kept() -> None:
    client, server = _pair()
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(3)]
    socket.send_fds(client, [protocol.encode_request([], b"", pid_fd=True)], fds)
    before = set(os.listdir("/proc/self/fd"))
    request = protocol.read_request(server)
    assert request.pid_fd is not None
    os.close(request.pid_fd)
    assert set(os.listdir("/proc/self/fd")) <= before
    for fd in fds:
        os.close(fd)


def test_a_late_state_follows_its_header_and_any_descriptor_with_it_is_closed() -> None:
    """A cdi-hook request may send its header first (`later`) and its state once it has it; the state part has
    no descriptor in the format, so one sent along is closed, never kept."""
    client, server = _pair()
    protocol.send_request(client, ["cdi-hook", "update-ldcache"], b"", later=True)
    request = protocol.read_request(server)
    assert (request.argv, request.state, request.later, request.pid_fd) == (["cdi-hook", "update-ldcache"], b"",
                                                                            True, None)
    body = b'{"id": "late", "pid": 1}'
    fd = os.open("/dev/null", os.O_RDONLY)
    socket.send_fds(client, [protocol.encode_late_state(body)], [fd])
    os.close(fd)
    before = set(os.listdir("/proc/self/fd"))
    assert protocol.read_late_state(server) == body
    assert set(os.listdir("/proc/self/fd")) <= before
    assert protocol.read_request(_sent(protocol.encode_request(["prestart"], body))).later is False


def test_a_late_state_is_bounded_and_timed() -> None:
    with pytest.raises(protocol.ProtocolError, match=f"state size {protocol.MAX_STATE + 1} is outside"):
        protocol.read_late_state(_sent((protocol.MAX_STATE + 1).to_bytes(4, "big")))
    with pytest.raises(protocol.ProtocolError, match="cut short after 3 of 9 bytes"):
        protocol.read_late_state(_sent(b"\0\0\0\x09abc"))
    client, server = _pair()
    with client, server:
        client.sendall(b"\0\0\0\x09ab")  # a runtime that never writes the rest
        start = time.monotonic()
        with pytest.raises(protocol.ProtocolError, match="not complete within 0.3 s"):
            protocol.read_late_state(server, timeout=0.3)
        assert time.monotonic() - start < 2


# --- the running service ----------------------------------------------------------------------------------------


def start_service(tmp: Path, config: Path) -> Running:
    return start(tmp / "run" / "service.sock", config, tmp / "service.err")


@pytest.fixture()
def service(root_tmp: Path) -> Iterator[Running]:
    running = start_service(root_tmp, write_config(root_tmp, Path("/")))
    yield running
    running.stop()


def ask(sock: Path, argv: list[str], body: bytes, pid_fd: int | None = None) -> tuple[int, str]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(str(sock))
        protocol.send_request(conn, argv, body, pid_fd=pid_fd)
        return protocol.recv_answer(conn)[:2]


@pytest.fixture()
def gpu_service(root_tmp: Path, fake_driver: Any) -> Iterator[Running]:
    """A service on a simulated driver: a request for GPUs is planned there and reaches the injection step."""
    running = start_service(root_tmp, write_config(root_tmp, Path(fake_driver.root)))
    yield running
    running.stop()


def test_a_dead_process_descriptor_fails_the_start_in_one_line(gpu_service: Running, root_tmp: Path) -> None:
    """The client's /proc/<pid> descriptor is what the start goes through (checked after planning, right before the
    container would be touched): one of a process gone since names nothing, and the start fails in one line."""
    config = ["--config", str(root_tmp / "config.toml")]
    body = state(plain_bundle(root_tmp, ["NVIDIA_VISIBLE_DEVICES=all"]), cid="pidfd", pid=os.getpid())
    gone = subprocess.Popen(["sleep", "30"])
    fd = os.open(f"/proc/{gone.pid}", os.O_RDONLY | os.O_DIRECTORY)
    try:
        gone.kill()
        gone.wait()
        code, line = ask(gpu_service.sock, config, body, pid_fd=fd)
    finally:
        os.close(fd)
    assert code == 1 and line.startswith(f"gpuhook-hook: cannot reach container process {os.getpid()} through"), line
    assert " pidfd error: cannot reach container process" in (root_tmp / "gpuhook.log").read_text()


@pytest.mark.e2e
def test_a_service_that_cannot_pin_its_peers_serves_none_and_starts_go_on(native: Path, root_tmp: Path,
                                                                           fake_driver: Any) -> None:
    """A service in a PID namespace of its own (a pod without hostPID; `unshare --pid --mount-proc`) cannot see
    its peers' processes, so it cannot pin them (peer.py): it serves none of them, never as its own, and every
    start runs in-process, getting what it gets with no service at all."""
    need_tool("runc")
    need_tool("unshare")
    need_busybox()
    config = write_config(root_tmp, Path(fake_driver.root))
    env = ["NVIDIA_VISIBLE_DEVICES=1"]
    sock = root_tmp / "run" / "service.sock"
    alone = runc_start(root_tmp, native, config, sock, env, "alone")
    assert alone.returncode == 0, alone.stderr
    running = start(sock, config, root_tmp / "service.err", ["unshare", "--pid", "--fork", "--mount-proc", GPUHOOK])
    try:
        declined = runc_start(root_tmp, native, config, sock, env, "declined")
    finally:  # the service is its namespace's init, unshare's child: SIGTERM goes to it, and unshare follows
        for child in psutil.Process(running.proc.pid).children():
            child.terminate()
        running.proc.wait(timeout=20)
    assert declined.returncode == 0, declined.stderr
    assert declined.stdout == alone.stdout and "nvidia1" in nodes(declined.stdout)
    assert "declined: the peer is in a PID namespace this service cannot see" in running.log.read_text()
    assert f"by=in-process (service {sock} declined the call)" in (root_tmp / "gpuhook.log").read_text()


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
    code, line = ask(service.sock, ["--config", str(root_tmp / "config.toml")], state(root_tmp / "gone", cid="gone"))
    assert code == 1 and line.startswith("gpuhook-hook: ") and str(root_tmp / "gone") in line
    assert " gone error: " in (root_tmp / "gpuhook.log").read_text()  # the same line in the log, as in-process
    code, line = ask(service.sock, ["--bogus"], b"")
    assert code == 1 and line.startswith("gpuhook-hook: unexpected argument '--bogus'")
    code, line = ask(service.sock, ["--config", str(root_tmp / "config.toml")], b"{not json")
    assert code == 1 and line.startswith("gpuhook-hook: ") and "\n" not in line


@NEEDS_NATIVE
def test_a_peer_without_cap_sys_admin_is_never_served_even_on_an_open_socket(service: Running,
                                                                               root_tmp: Path) -> None:
    """The mode bits are the first wall; the peer's capabilities the second: opened up by mistake, the service
    still serves nobody without CAP_SYS_ADMIN in its user namespace, uid 65534 here and root without that
    capability (`setpriv --bounding-set -sys_admin`): it answers DECLINED, and the entry runs the call with the
    client's own rights (here there is no Python entry beside the copy)."""
    need_tool("setpriv")
    service.sock.parent.chmod(0o755)
    service.sock.chmod(0o666)
    body = state(plain_bundle(root_tmp, []))
    public = Path(tempfile.mkdtemp(prefix="gpuhook-svc-"))  # pytest's 0700 tmp is closed to uid 65534
    folder = os.open(service.sock.parent, os.O_PATH | os.O_DIRECTORY)  # ... so it reaches the socket through this
    try:
        public.chmod(0o755)
        client = public / "gpuhook-hook"
        shutil.copy(str(hook_entry.native_entry()), client)
        env = {"GPUHOOK_SERVICE_SOCKET": f"/proc/self/fd/{folder}/{service.sock.name}"}
        nobody = subprocess.run([str(client), "prestart"], input=body, capture_output=True, user=65534,
                                group=65534, env=env, pass_fds=(folder,), timeout=60, check=False)
        capless = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin",
                                  str(client), "prestart"], input=body, capture_output=True, env=env,
                                 pass_fds=(folder,), timeout=60, check=False)
    finally:
        os.close(folder)
        shutil.rmtree(public)
    # The entry's own last resort, with no Python entry beside it: root without the capability reads the bundle
    # and lets a start without a GPU request go on; uid 65534 cannot read it, so that start fails, saying why.
    assert (capless.returncode, capless.stderr) == (0, b""), capless.stderr
    assert nobody.returncode == 1 and nobody.stderr.startswith(b"gpuhook-hook: cannot run the Python entry ")
    assert not (root_tmp / "gpuhook.log").exists()  # nothing ran
    log = service.log.read_text()
    assert "(uid 65534) lacks CAP_SYS_ADMIN" in log or "(uid 0) lacks CAP_SYS_ADMIN" in log


def test_a_second_service_on_the_same_socket_is_refused(service: Running, root_tmp: Path) -> None:
    result = subprocess.run([GPUHOOK, "service"], env={**os.environ, "GPUHOOK_SERVICE_SOCKET": str(service.sock)},
                            capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 1 and result.stderr == f"gpuhook service: a service already listens on {service.sock}\n"


def test_systemd_socket_activation(root_tmp: Path) -> None:
    """LISTEN_FDS=1 with our pid in LISTEN_PID: fd 3 is the socket, nothing is bound at $GPUHOOK_SERVICE_SOCKET."""
    sock_path = root_tmp / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(8)
    config = write_config(root_tmp, Path("/"))
    code = (f"import os, sys; os.dup2({listener.fileno()}, 3); os.environ['LISTEN_FDS'] = '1'; "
            "os.environ['LISTEN_PID'] = str(os.getpid()); from gpuhook.service.server import main; "
            f"sys.exit(main({str(config)!r}))")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(listener.fileno(),),
                            env={**os.environ, "GPUHOOK_SERVICE_SOCKET": str(root_tmp / "unused" / "s.sock")})
    try:
        answer = ask(sock_path, ["--config", str(config)], state(plain_bundle(root_tmp, []), cid="activated"))
        assert answer == (0, "")
        assert " activated skip request=unset" in (root_tmp / "gpuhook.log").read_text()
        assert not (root_tmp / "unused").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        listener.close()


# --- the native entry against a service -------------------------------------------------------------------------


def run_native(entry: Path, sock: Path, args: list[str], body: bytes, timeout_ms: int | None = None,
               ack_ms: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_SERVICE_SOCKET": str(sock)}
    if timeout_ms:
        env["GPUHOOK_SERVICE_TIMEOUT_MS"] = str(timeout_ms)
    if ack_ms:
        env["GPUHOOK_SERVICE_ACK_MS"] = str(ack_ms)
    result = subprocess.run([str(entry), *args], input=body, capture_output=True, env=env, timeout=60, check=False)
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(errors="replace"),
                                       result.stderr.decode(errors="replace"))


def test_native_no_gpu_through_the_service_never_falls_back(native: Path, service: Running, root_tmp: Path) -> None:
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)
    result = run_native(native, service.sock, ["--config", str(root_tmp / "config.toml"), "prestart"],
                        state(plain_bundle(root_tmp, []), cid="native-nogpu", pid=os.getpid()))
    assert (result.returncode, result.stderr) == (0, "")
    assert " native-nogpu skip request=unset took=" in (root_tmp / "gpuhook.log").read_text()
    assert not marker.exists()
    result = run_native(native, service.sock, ["--config", str(root_tmp / "config.toml")], state(root_tmp / "gone"))
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and str(root_tmp / "gone") in result.stderr


def test_native_falls_back_when_nothing_listens(native: Path, root_tmp: Path) -> None:
    """No socket (ENOENT) and a dead service's socket file (ECONNREFUSED): today's Python entry, same result."""
    config = write_config(root_tmp, Path("/"))
    stale = root_tmp / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # bound, never listening: connect gets ECONNREFUSED
        for n, sock in enumerate((root_tmp / "nothing" / "s.sock", stale)):
            result = run_native(native, sock, ["--config", str(config), "prestart"],
                                state(plain_bundle(root_tmp, []), cid=f"fallback{n}"))
            assert (result.returncode, result.stderr) == (0, "")
    log = (root_tmp / "gpuhook.log").read_text()
    assert " fallback0 skip request=unset" in log and " fallback1 skip request=unset" in log


def test_a_state_over_the_services_bound_goes_whole_to_the_fallback(native: Path, service: Running,
                                                                     root_tmp: Path) -> None:
    """A state over protocol.MAX_STATE (a 3 MiB annotation) is never sent: the entry execs its fallback with all
    of it, which parses it as the in-process hook does; one over oci/bundle.MAX_DOCUMENT is refused there in
    one line, after the entry passed on no more than one byte past that bound."""
    from gpuhook.oci.bundle import MAX_DOCUMENT

    config = ["--config", str(root_tmp / "config.toml"), "prestart"]
    body = json.loads(state(plain_bundle(root_tmp, []), cid="big"))
    body["annotations"] = {"x": "y" * (3 << 20)}
    result = run_native(native, service.sock, config, json.dumps(body).encode())
    assert (result.returncode, result.stderr) == (0, "")
    assert " big skip request=unset" in (root_tmp / "gpuhook.log").read_text()  # the whole state was read
    huge = run_native(native, service.sock, config, b" " * (MAX_DOCUMENT + (4 << 20)))
    assert huge.returncode == 1 and huge.stderr.strip() == "gpuhook-hook: OCI state on stdin is over 64 MiB"
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)
    assert run_native(native, service.sock, config, json.dumps(body).encode()).returncode == 3 and marker.exists()


def _fake_service(sock: Path, behaviour: str) -> tuple[socket.socket, threading.Thread, list[protocol.Request]]:
    """A server that accepts one connection and then hangs ("hang"), reads the request and closes ("die"), answers
    DECLINED ("decline"), says TAKING, reads GO and then closes without an answer ("taken-die"), or refuses the
    request unread: DECLINED ("refuse-unread") or nothing ("close-unread"), then closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(1)
    got: list[protocol.Request] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            if behaviour == "hang":
                time.sleep(3)
                return
            if behaviour.endswith("-unread"):
                if behaviour == "refuse-unread":
                    conn.sendall(protocol.encode_answer(protocol.DECLINED, ""))
                return
            got.append(protocol.read_request(conn))
            if behaviour == "decline":
                conn.sendall(protocol.encode_answer(protocol.DECLINED, ""))
            elif behaviour == "taken-die":
                conn.sendall(protocol.encode_taking())
                assert conn.recv(1) == protocol.GO

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread, got


@pytest.mark.parametrize(("behaviour", "why"), [
    ("hang", "gave no answer within 400 ms"),
    ("die", "closed without taking the call"),
    ("decline", "declined the call"),
])  # fmt: skip
def test_a_service_that_did_not_take_the_start_leaves_it_to_the_fallback(native: Path, root_tmp: Path,
                                                                          behaviour: str, why: str) -> None:
    """Stuck, crashed or declining before it said TAKING: nothing was done there, so the Python entry runs the start
    (told why, for its log line), within the bound of $GPUHOOK_SERVICE_ACK_MS when the service keeps silent."""
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)
    sock = root_tmp / f"{behaviour}.sock"
    listener, thread, got = _fake_service(sock, behaviour)
    body = b'{"id": "x", "pid": 1}'
    result = run_native(native, sock, ["prestart"], body, ack_ms=400)
    thread.join(5)
    listener.close()
    assert (result.returncode, result.stderr) == (3, "gpuhook-hook: fallback ran\n")
    assert marker.read_text() == f"ran in-process (service {sock} {why})\n"
    if behaviour != "hang":
        assert [request.state for request in got] == [body]  # it had the request whole, and still did nothing


@pytest.mark.parametrize(("behaviour", "why"), [
    ("refuse-unread", "declined the call"),
    ("close-unread", "closed before it read the call"),
])  # fmt: skip
def test_a_request_refused_before_it_was_sent_whole_is_the_fallbacks(native: Path, root_tmp: Path, behaviour: str,
                                                                      why: str) -> None:
    """A service that refuses a request before the entry could send all of it (a state bigger than the socket's
    buffer: the entry's send meets the closed end) leaves the start to the fallback, which is told the service's
    own word when it came (DECLINED), else that the service closed."""
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)
    sock = root_tmp / f"{behaviour}.sock"
    listener, thread, _ = _fake_service(sock, behaviour)
    body = b'{"id": "x", "pid": 1, "pad": "' + b"x" * (900 << 10) + b'"}'
    result = run_native(native, sock, ["prestart"], body, ack_ms=5000)
    thread.join(5)
    listener.close()
    assert (result.returncode, result.stderr) == (3, "gpuhook-hook: fallback ran\n")
    assert marker.read_text() == f"ran in-process (service {sock} {why})\n"


def test_a_service_that_took_the_start_and_died_is_one_line_never_a_second_run(native: Path, root_tmp: Path) -> None:
    """After TAKING and our GO the start is the service's: its death fails the start in one line, and the entry
    never runs it again (the service may have changed the container)."""
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)
    listener, thread, got = _fake_service(root_tmp / "dies.sock", "taken-die")
    result = run_native(native, root_tmp / "dies.sock", ["prestart"], b'{"id": "x", "pid": 1}')
    thread.join(5)
    listener.close()
    assert result.returncode == 1 and not marker.exists()
    assert result.stderr == f"gpuhook-hook: service {root_tmp / 'dies.sock'} closed without an answer: " \
                            "the start fails\n"


def _late_service(sock: Path, behaviour: str) -> tuple[socket.socket, threading.Thread, list[object]]:
    """A server for one cdi-hook client: it records the header it read, then answers 0 after the late state
    ("answer"), closes before it ("leave") or closes after reading it ("die"); a client that closed instead of
    sending the state is recorded as the ProtocolError."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(1)
    got: list[object] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            got.append(protocol.read_request(conn))
            if behaviour == "leave":
                return
            try:
                got.append(protocol.read_late_state(conn))
            except protocol.ProtocolError as exc:  # the client closed instead
                got.append(exc)
                return
            if behaviour == "answer":
                conn.sendall(protocol.encode_taking())
                assert conn.recv(1) == protocol.GO
                conn.sendall(protocol.encode_answer(0, ""))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread, got


def _cdi_entry(native: Path, sock: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(native), "cdi-hook", "update-ldcache", "--folder", "/opt/lib"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "GPUHOOK_SERVICE_SOCKET": str(sock)})


@pytest.mark.parametrize("behaviour", ["answer", "leave", "die"])
def test_a_native_cdi_hook_sends_its_header_before_its_state(native: Path, root_tmp: Path, behaviour: str) -> None:
    """The createContainer hook's header reaches the service while the runtime has not written the state yet;
    the state follows whole. A service gone before it read the state, or one that read it and closed without
    TAKING, did nothing, so the entry runs the call in-process; one that said TAKING owns it (the test above)."""
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)
    sock = root_tmp / f"{behaviour}.sock"
    listener, thread, got = _late_service(sock, behaviour)
    body = b'{"id": "late", "pid": 1, "bundle": "/nonexistent"}'
    proc = _cdi_entry(native, sock)
    try:
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got and proc.poll() is None  # the header came, stdin still open
        header = got[0]
        assert isinstance(header, protocol.Request) and header.later and header.state == b""
        assert header.argv == ["cdi-hook", "update-ldcache", "--folder", "/opt/lib"]
        if behaviour == "leave":
            thread.join(5)
        out, err = proc.communicate(body, timeout=30)
    finally:
        proc.kill()
        listener.close()
    thread.join(5)
    if behaviour == "answer":
        assert (proc.returncode, err, got[1:]) == (0, b"", [body]) and not marker.exists()
    else:
        assert (proc.returncode, err) == (3, b"gpuhook-hook: fallback ran\n") and marker.exists()
        assert behaviour == "leave" or got[1:] == [body]


def test_a_cdi_hooks_state_over_the_bound_goes_to_the_fallback_unsent(native: Path, root_tmp: Path) -> None:
    """A cdi-hook state over protocol.MAX_STATE: the connection is closed with only the header sent (nothing can
    be done without the state) and the fallback gets all of it."""
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)
    sock = root_tmp / "big.sock"
    listener, thread, got = _late_service(sock, "answer")
    proc = _cdi_entry(native, sock)
    try:
        out, err = proc.communicate(b" " * (protocol.MAX_STATE + 1), timeout=30)
    finally:
        proc.kill()
        listener.close()
    thread.join(5)
    assert proc.returncode == 3 and marker.exists()
    assert isinstance(got[0], protocol.Request) and got[0].later  # the header, then the connection's end
    assert [str(exc) for exc in got[1:]] == ["request cut short after 0 of 4 bytes"]


# --- a real container ---------------------------------------------------------------------------------------------


def runc_start(tmp: Path, entry: Path, config: Path, sock: Path, env: list[str], name: str) -> Any:
    work = tmp / name
    rootfs = glibc_rootfs(work, probe_cache=tmp / "probe")
    hook = {"path": str(entry), "args": ["gpuhook-hook", "--config", str(config), "prestart"],
            "env": [HOOK_PATH_ENV, f"GPUHOOK_SERVICE_SOCKET={sock}"]}
    bundle = make_bundle(work, rootfs, ["sh", "-c", PROBE], env=env, hooks={"prestart": [hook]})
    return runc_run(bundle, unique_id("svc"))


@pytest.mark.e2e
def test_runc_start_through_the_service_gives_the_same_container(native: Path, root_tmp: Path,
                                                                   fake_driver: Any) -> None:
    need_tool("runc")
    need_busybox()
    config = write_config(root_tmp, Path(fake_driver.root))
    env = ["NVIDIA_VISIBLE_DEVICES=1"]
    fallback = runc_start(root_tmp, native, config, root_tmp / "run" / "service.sock", env, "fallback")
    assert fallback.returncode == 0, fallback.stderr
    running = start_service(root_tmp, config)
    try:
        marker = root_tmp / "fallback-ran"
        script = native.with_name(native.name + ".py")
        kept = script.read_text()
        no_fallback(native, marker)  # from here on the service must answer
        served = runc_start(root_tmp, native, config, running.sock, env, "served")
        assert served.returncode == 0, served.stderr
        assert not marker.exists()
        script.write_text(kept)
    finally:
        running.stop()
    assert nodes(served.stdout) == nodes(fallback.stdout) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1",
                                                              "nvidiactl"]
    assert served.stdout == fallback.stdout  # the same nodes, mounts, links, ld cache and CUDA view
    log = (root_tmp / "gpuhook.log").read_text().splitlines()
    assert len(log) == 2 and all(" inject devices=" in line and " took=" in line for line in log)


# --- what the resident process does itself (in-process: the real Service, its serve_one on a socket pair) ----------


class Forks:
    """Counts this process's forks through os.register_at_fork (hooks cannot be removed: `on` scopes them)."""

    count = 0
    on = False

    @classmethod
    def before(cls) -> None:
        if cls.on:
            cls.count += 1


os.register_at_fork(before=Forks.before)


@pytest.fixture()
def in_process(root_tmp: Path, fake_driver: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from gpuhook.discover import cache
    from gpuhook.service.server import Service

    monkeypatch.setattr(cache, "_WARM", None)  # keep_warm() is the service's; this test process gets it back off
    config = write_config(root_tmp, Path(fake_driver.root))
    service = Service(str(config), str(root_tmp / "run" / "service.sock"))
    Forks.count, Forks.on = 0, True
    try:
        yield service
    finally:
        Forks.on = False
        service.close()  # its workers end: an idle one at once, a busy one once its start is answered


def serve(service: Any, argv: list[str], body: bytes) -> tuple[int, str]:
    """One request served in-process, its client answering TAKING with GO (a thread: an answer made in the
    parent comes only after its client's GO)."""
    client, server = _pair()
    with client, server:
        protocol.send_request(client, argv, body)
        serving = threading.Thread(target=service.serve_one, args=(server,))
        serving.start()
        try:
            return protocol.recv_answer(client)[:2]
        finally:
            serving.join()


def test_the_parent_answers_what_touches_no_container_without_forking(in_process: Any, root_tmp: Path) -> None:
    """No GPU request, a request for GPUs that is refused while planning, a bad state: answered by the resident
    process itself, one round trip, no child; each logged as the in-process hook logs it."""
    config = ["--config", str(root_tmp / "config.toml"), "prestart"]
    assert serve(in_process, config, state(plain_bundle(root_tmp, []), cid="none")) == (0, "")
    code, line = serve(in_process, config, state(plain_bundle(root_tmp, ["NVIDIA_VISIBLE_DEVICES=7"]), cid="seven"))
    assert code == 1 and "7" in line and line.startswith("gpuhook-hook: ")
    code, line = serve(in_process, config, state(root_tmp / "gone", cid="gone"))
    assert code == 1 and str(root_tmp / "gone") in line
    assert Forks.count == 0
    log = (root_tmp / "gpuhook.log").read_text()
    assert " none skip request=unset took=" in log and " seven error: " in log and " gone error: " in log


def test_a_plan_is_remembered_while_the_driver_stays_the_same(in_process: Any, root_tmp: Path,
                                                              fake_driver_factory: Any) -> None:
    """The memo returns the very plan for the same config and request, and a new one once the inventory's
    fingerprint changes (a GPU's node gone: the device set the next start gets is the new one)."""
    from gpuhook.model.request import parse_request

    fresh = fake_driver_factory(fresh=True)
    config_path = write_config(root_tmp, Path(fresh.root))
    config = in_process.load(str(config_path))
    request = parse_request(["NVIDIA_VISIBLE_DEVICES=all"], [], {}, False, config.policy)
    first = in_process.plan(config, request)
    assert in_process.plan(config, request) is first and len(first.selection.devices) == 2
    (Path(fresh.root) / "dev" / "nvidia1").unlink()
    again = in_process.plan(config, request)
    assert again is not first and [d.index for d in again.selection.devices] == [0]


def cdi_hook_start(tmp: Path, entry: Path, sock: Path, args: list[str], name: str) -> Any:
    """runc with `entry cdi-hook ARGS` as its createContainer hook (where a CDI spec's hook runs: in the
    container's mount namespace, before pivot_root); the container prints the link and its ld cache."""
    work = tmp / name
    rootfs = glibc_rootfs(work, probe_cache=tmp / "probe")
    (rootfs / "opt/lib").mkdir(parents=True, exist_ok=True)
    hook = {"path": str(entry), "args": ["gpuhook-hook", "cdi-hook", *args],
            "env": [HOOK_PATH_ENV, f"GPUHOOK_SERVICE_SOCKET={sock}"]}
    probe = "readlink /opt/libmarker.so; cat /etc/ld.so.conf.d/*.conf; test -s /etc/ld.so.cache && echo cache"
    bundle = make_bundle(work, rootfs, ["sh", "-c", probe], hooks={"createContainer": [hook]})
    return runc_run(bundle, unique_id("cdi"))


@pytest.mark.e2e
def test_a_cdi_hook_through_the_service_is_the_in_process_one(native: Path, root_tmp: Path) -> None:
    """The CDI spec's createContainer hook through the native entry: answered by the service, which joins the
    client's (the container's) mount namespace, with the same links and ld configuration as the fallback;
    a command line only click can word is declined and then answered in-process, with click's words."""
    need_tool("runc")
    need_busybox()
    args = ["update-container", "--link", "lib/libmarker.so.1::/opt/libmarker.so", "--folder", "/opt/lib"]
    fallback = cdi_hook_start(root_tmp, native, root_tmp / "none" / "service.sock", args, "fallback")
    assert fallback.returncode == 0, fallback.stderr
    running = start_service(root_tmp, write_config(root_tmp, Path("/")))
    try:
        script = native.with_name(native.name + ".py")
        kept = script.read_text()
        no_fallback(native, root_tmp / "fallback-ran")
        worker = _one_waiting_child(psutil.Process(running.proc.pid))
        served = cdi_hook_start(root_tmp, native, running.sock, args, "served")
        assert served.returncode == 0, served.stderr
        assert not (root_tmp / "fallback-ran").exists()
        assert _one_waiting_child(psutil.Process(running.proc.pid)) == worker  # it ran it (no fork), and stays
        failed = cdi_hook_start(root_tmp, native, running.sock, ["update-container", "--folder", "/opt/lib",
                                                                  "--ldconfig-path", "/nonexistent"], "failed")
        assert failed.returncode != 0 and "gpuhook: cannot open ldconfig /nonexistent" in failed.stderr
        bad = cdi_hook_start(root_tmp, native, running.sock, ["update-container", "--link", "nolink"], "bad")
        assert (root_tmp / "fallback-ran").exists() and bad.returncode != 0  # declined: the Python entry ran
        script.write_text(kept)
        bad = cdi_hook_start(root_tmp, native, running.sock, ["update-container", "--link", "nolink"], "bad2")
        assert bad.returncode != 0 and "expected TARGET::/absolute/link" in bad.stderr  # click's own words
    finally:
        running.stop()
    assert served.stdout == fallback.stdout
    assert served.stdout.splitlines()[0] == "lib/libmarker.so.1" and "/opt/lib" in served.stdout.splitlines()
    assert served.stdout.splitlines()[-1] == "cache"


@pytest.mark.e2e
def test_a_runtime_in_its_own_mount_namespace_is_declined_and_runs_in_process(native: Path, root_tmp: Path,
                                                                              fake_driver: Any) -> None:
    """runc in a private mount namespace with cgroup2 at /sys/fs/cgroup (the host here has v1): its start needs
    that namespace's files, so the service declines it at once (never joining it: nothing of its files may run
    in the service), and the entry's fallback runs it in-process there, widening the eBPF filter runc made there;
    the log line says who ran it and why."""
    from support.runc import cgroup2_namespace

    need_tool("runc")
    need_busybox()
    config = write_config(root_tmp, Path(fake_driver.root))
    running = start_service(root_tmp, config)
    try:
        rootfs = glibc_rootfs(root_tmp / "v2", probe_cache=root_tmp / "probe")
        hook = {"path": str(native), "args": ["gpuhook-hook", "--config", str(config), "prestart"],
                "env": [HOOK_PATH_ENV, f"GPUHOOK_SERVICE_SOCKET={running.sock}"]}
        bundle = make_bundle(root_tmp / "v2", rootfs, ["sh", "-c", "cat /dev/nvidia0 2>&1 | head -1"],
                             env=["NVIDIA_VISIBLE_DEVICES=0"], hooks={"prestart": [hook]})
        with cgroup2_namespace() as prefix:
            result = runc_run(bundle, unique_id("v2"), prefix=prefix)
    finally:
        running.stop()
    assert result.returncode == 0, result.stderr
    assert "No such device or address" in result.stdout  # the node got through the widened filter
    log = (root_tmp / "gpuhook.log").read_text().splitlines()
    assert len(log) == 1 and "cgroup=v2" in log[0] and "by=in-process (service " in log[0], log
    assert log[0].endswith(" declined the call)"), log


# --- generate-cdi through the service ---------------------------------------------------------------------------

# The console script's main, saying on its last stderr line whether the spec modules were loaded here (so the
# command ran in-process) or not (the service answered it).
CLIENT = ("import sys; from gpuhook.cli import main; code = main(sys.argv[1:]); "
          "sys.stderr.write('IN-PROCESS\\n' if 'gpuhook.cli.generate' in sys.modules else 'SERVED\\n'); sys.exit(code)")


def generate_cdi(args: list[str], cwd: Path, sock: Path, exe: str = sys.executable,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, "-c", CLIENT, "generate-cdi", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "GPUHOOK_SERVICE_SOCKET": str(sock), **(env or {})})


def _client_dir(root_tmp: Path, fake_driver: Any) -> tuple[Path, list[str]]:
    """A client's working directory and generate-cdi arguments relative to it (the driver root, a hook path and
    an inventory cache), so that a served command must use the client's cwd."""
    work = root_tmp / "client"
    work.mkdir()
    driver = os.path.relpath(fake_driver.root, work)
    return work, ["--driver-root", driver, "--proc-root", os.path.join(driver, "proc"), "--hook-path", "bin/hook",
                  "--inventory-cache", "inv.json"]


def test_generate_cdi_through_the_service_is_the_in_process_spec(gpu_service: Running, root_tmp: Path,
                                                                  fake_driver: Any) -> None:
    """Issue 21, item 1: the service answers `gpuhook generate-cdi`; stdout, --output (relative: the client's cwd)
    and errors are byte for byte what the command does in-process, which runs when nothing listens."""
    work, args = _client_dir(root_tmp, fake_driver)
    none = root_tmp / "none.sock"
    local, served, again = (generate_cdi(args, work, sock) for sock in (none, gpu_service.sock, gpu_service.sock))
    assert local.returncode == served.returncode == again.returncode == 0, (local.stderr, served.stderr)
    assert local.stderr.splitlines()[-1] == "IN-PROCESS" and served.stderr.splitlines()[-1] == "SERVED"
    assert served.stdout == local.stdout == again.stdout and f"path: {work}/bin/hook" in served.stdout
    assert (work / "inv.json").is_file()  # the client's relative cache path, written by the service
    to_file = generate_cdi([*args, "-o", "out/spec.yaml"], work, gpu_service.sock)
    assert to_file.returncode == 0 and to_file.stdout == "" and to_file.stderr == "SERVED\n", to_file.stderr
    assert (work / "out/spec.yaml").read_text() == local.stdout
    bad = {sock: generate_cdi(["--driver-root", "missing"], work, sock) for sock in (none, gpu_service.sock)}
    assert bad[none].returncode == bad[gpu_service.sock].returncode == 1
    assert bad[none].stderr.replace("IN-PROCESS", "SERVED") == bad[gpu_service.sock].stderr
    assert "missing" in bad[none].stderr


def test_what_the_service_cannot_run_as_the_client_runs_in_process(gpu_service: Running, root_tmp: Path,
                                                                   fake_driver: Any) -> None:
    """Declined, so click or the client answers: --help, --watch, an unknown option, an interpreter from another
    folder (the spec names the gpuhook beside it). The client's PATH is the one a served command sees."""
    sock = gpu_service.sock
    for args in (["--help"], ["--watch"], ["--bogus"]):
        result = generate_cdi(args, root_tmp, sock)
        assert result.stderr.splitlines()[-1] == "IN-PROCESS", (args, result.stderr)
    other = root_tmp / "other-bin"
    other.mkdir()
    (other / "python3").symlink_to(os.path.realpath(sys.executable))
    args = ["--driver-root", fake_driver.root, "--proc-root", f"{fake_driver.root}/proc", "--inventory-cache", ""]
    moved = generate_cdi(args, root_tmp, sock, exe=str(other / "python3"),
                         env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert moved.stderr.splitlines()[-1] == "IN-PROCESS", moved.stderr


def native_generate(entry: Path, args: list[str], cwd: Path, sock: Path) -> subprocess.CompletedProcess[str]:
    """`ENTRY generate-cdi ARGS` in `cwd`, the service at `sock`."""
    return subprocess.run([str(entry), "generate-cdi", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPUHOOK_SERVICE_SOCKET": str(sock)})


def test_the_native_entry_runs_generate_cdi_through_the_service(native: Path, gpu_service: Running, root_tmp: Path,
                                                                fake_driver: Any) -> None:
    """`gpuhook-hook generate-cdi ARGS` is the console script's command without an interpreter's start: served, its
    stdout, a relative --output and an error are what the command gives in-process and no Python runs; with nothing
    listening, or declined (--help, an unknown option: click's words), the Python entry beside it runs the
    command, with the console script's result."""
    work, args = _client_dir(root_tmp, fake_driver)
    none = root_tmp / "none.sock"
    local = generate_cdi(args, work, none)
    unserved = native_generate(native, args, work, none)
    assert (unserved.returncode, unserved.stderr) == (0, "") and unserved.stdout == local.stdout
    assert f"path: {work}/bin/hook" in local.stdout
    script = native.with_name(native.name + ".py")
    kept = script.read_text()
    marker = root_tmp / "fallback-ran"
    no_fallback(native, marker)  # from here on, the service answers or the fallback shows
    served = native_generate(native, args, work, gpu_service.sock)
    assert (served.returncode, served.stderr, served.stdout) == (0, "", local.stdout)
    to_file = native_generate(native, [*args, "-o", "out/spec.yaml"], work, gpu_service.sock)
    assert (to_file.returncode, to_file.stdout, to_file.stderr) == (0, "", "")
    assert (work / "out/spec.yaml").read_text() == local.stdout
    bad = native_generate(native, ["--driver-root", "missing"], work, gpu_service.sock)
    bad_local = generate_cdi(["--driver-root", "missing"], work, none)
    assert bad.returncode == bad_local.returncode == 1 and "missing" in bad.stderr
    assert bad.stderr == bad_local.stderr.replace("IN-PROCESS\n", "")
    assert not marker.exists()
    for declined in (["--help"], ["--bogus"]):
        assert native_generate(native, declined, work, gpu_service.sock).returncode == 3 and marker.exists()
        marker.unlink()
    script.write_text(kept)
    for declined in (["--help"], ["--bogus"]):
        ours, theirs = native_generate(native, declined, work, gpu_service.sock), generate_cdi(declined, work, none)
        assert (ours.returncode, ours.stdout) == (theirs.returncode, theirs.stdout), declined
        assert ours.stderr == theirs.stderr.replace("IN-PROCESS\n", ""), declined


def test_a_service_dying_after_taking_generate_cdi_is_one_line_and_no_second_run(native: Path,
                                                                                 root_tmp: Path) -> None:
    """The entry's command request says where the client is (its cwd, the Python entry's interpreter, its PATH);
    a service that took it (TAKING, our GO) and closed without an answer is the console script's `gpuhook:
    service …` line and exit 1, and the command does not run again in the fallback."""
    marker = root_tmp / "fallback-ran"
    interpreter = native.with_name(native.name + ".py").read_text().split()[0][2:]
    no_fallback(native, marker)
    sock = root_tmp / "dies.sock"
    listener, thread, got = _fake_service(sock, "taken-die")
    result = native_generate(native, ["-o", "spec.yaml"], root_tmp, sock)
    thread.join(5)
    listener.close()
    assert (result.returncode, result.stderr) == (1, f"gpuhook: service {sock}: closed without an answer\n")
    assert not marker.exists() and not (root_tmp / "spec.yaml").exists()
    (request,) = got
    assert (request.argv, request.state, request.cwd, request.exe) == (["generate-cdi", "-o", "spec.yaml"], b"",
                                                                       str(root_tmp), interpreter)
    assert request.env == [f"PATH={os.environ['PATH']}"] + [
        f"{name}={os.environ[name]}" for name in protocol.SERVED_ENV[1:] if name in os.environ]


def test_a_served_command_sees_the_clients_cwd_and_environment(in_process: Any) -> None:
    """The service hands a command the client's cwd and its SERVED_ENV values (a PATH the client has, a variable it
    lacks unset), in a child of its own (the resident process's environment is never touched); what the command
    writes is the answer, once the client said GO to its TAKING."""
    def command(args: list[str], cwd: str, take: Any) -> tuple[int, str, bytes]:
        take()
        seen = [args, cwd, os.environ.get("PATH"), os.environ.get("CUDA_MPS_PIPE_DIRECTORY")]
        return 3, "said\n", json.dumps(seen).encode()

    in_process.commands["generate-cdi"] = command
    own = os.environ.get("PATH")
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = "/service/mps"
    try:
        client, server = _pair()
        with client, server:
            client.sendall(protocol.encode_request(["generate-cdi", "-o", "x"], b"", cwd="/client", exe=sys.executable,
                                                   env=["PATH=/client/bin"]))
            in_process.serve_one(server)
            server.close()
            client.settimeout(30)
            code, err, out = protocol.recv_answer(client, with_output=True)
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == "/service/mps" and os.environ.get("PATH") == own
    finally:
        del os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        while in_process.children:
            in_process.reap(block=True)
    assert (code, err) == (3, "said\n") and json.loads(out) == [["-o", "x"], "/client", "/client/bin", None]
    assert Forks.count == 1  # a child ran it


def test_a_command_whose_client_gave_up_does_nothing(in_process: Any, root_tmp: Path) -> None:
    """A client that closes instead of saying GO (it ran the command itself) leaves the service's child without an
    effect: take() never returns there, so nothing after it runs."""
    marker = root_tmp / "ran"

    def command(args: list[str], cwd: str, take: Any) -> tuple[int, str, bytes]:
        take()
        marker.write_text("ran")
        return 0, "", b""

    in_process.commands["generate-cdi"] = command
    client, server = _pair()
    with client, server:
        client.sendall(protocol.encode_request(["generate-cdi"], b"", cwd="/", exe=sys.executable))
        in_process.serve_one(server)
        server.close()
        client.settimeout(30)
        assert protocol.recv_answer(client, with_output=True, go=False)[0] == protocol.TAKING
    while in_process.children:
        in_process.reap(block=True)
    assert not marker.exists()


# --- warm workers: a child that runs one start at a time and comes back for the next -------------------------------


def _dead_process_start(service: Any, root_tmp: Path, cid: str, go: bool = True) -> tuple[int, str, list[int]]:
    """A GPU start planned by the parent and failed by whoever takes it over, right after TAKING and the client's GO
    (the state's pid names a process gone since, and no /proc/<pid> descriptor came to vet it before): the answer,
    and the child (a worker or one forked for it) that took it. Without `go` the client hangs up at TAKING (it runs
    the start itself): (TAKING, "", that child), and the child leaves without touching anything."""
    gone = subprocess.Popen(["sleep", "30"])
    gone.kill()
    gone.wait()
    body = state(plain_bundle(root_tmp, ["NVIDIA_VISIBLE_DEVICES=all"]), cid=cid, pid=gone.pid)
    return _child_answer(service, ["--config", str(root_tmp / "config.toml")], body, go=go)


def _child_answer(service: Any, argv: list[str], body: bytes, before_state: Callable[[], None] | None = None,
                  go: bool = True) -> tuple[int, str, list[int]]:
    """A request the service gives to a child (a worker, or one forked for it): the answer, and that child, once it
    is done with the start (_settle). With `before_state`, the header goes alone (protocol's `later`): serve_one
    must return without the state, and before_state() runs before the state follows. Without `go`: see
    _dead_process_start."""
    client, server = _pair()
    with client, server:
        protocol.send_request(client, argv, b"" if before_state else body, later=before_state is not None)
        service.serve_one(server)
        server.close()
        took = list(service.children)
        assert took
        if before_state is not None:
            before_state()
            client.sendall(protocol.encode_late_state(body))
        client.settimeout(30)
        if go:
            code, line, _ = protocol.recv_answer(client)  # TAKING, our GO, then the answer
        else:
            code, line, _ = protocol.recv_answer(client, go=False)
            client.close()
        _settle(service, took)
        return code, line, took


def _settle(service: Any, pids: list[int]) -> None:
    """Until none of `pids` runs a start: a worker's READY read (it stays, idle), or its end and any child's
    reaped, so that its connection's last copy here is closed."""
    import select

    deadline = time.monotonic() + 30
    while set(pids) & set(service.children):
        assert time.monotonic() < deadline, f"{pids} still run a start"
        busy = [w for w in list(service.workers.values()) if w.busy]
        if busy:
            select.select([w.sock for w in busy], [], [], 0.05)
            for worker in busy:
                if worker.pid in service.workers:
                    service._worker_said(worker.pid)
        else:
            time.sleep(0.01)
        service.reap()


@pytest.mark.parametrize("later", [False, True], ids=["state-with-header", "state-later"])
def test_a_cdi_hook_is_handed_to_a_worker_whole(in_process: Any, root_tmp: Path, later: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A CDI createContainer hook (a call run whole in a child, _serve_in_child) goes to an idle worker too: no fork
    at that moment, the worker makes the link in the container's rootfs, answers, and comes back for the next; with
    no worker to be had (MAX_WORKERS 0), a child forked for it does the same. With its state after its header
    (`later`), the service hands the connection on at once (its accept loop never waits on a runtime) and the child
    does nothing before the state is whole."""
    from gpuhook.service import pool

    bundle = plain_bundle(root_tmp, [])
    rootfs = bundle / "rootfs"
    worker = in_process._fork_worker().pid
    answers = []
    for n in (1, 2, 3):
        if n == 3:
            in_process._let_go(in_process.workers[worker])
            monkeypatch.setattr(pool, "MAX_WORKERS", 0)
        link = rootfs / f"opt/libmarker{n}.so"

        def nothing_yet(link: Path = link) -> None:
            time.sleep(0.2)
            assert not link.is_symlink()

        args = ["cdi-hook", "create-symlinks", "--link", f"libmarker.so.{n}::/opt/libmarker{n}.so"]
        answers.append(_child_answer(in_process, args, state(bundle, cid=f"cdi{n}", pid=os.getpid()),
                                     nothing_yet if later else None))
    assert answers[:2] == [(0, "", [worker])] * 2 and Forks.count == 2  # the worker twice, then a fork for the third
    assert answers[2][:2] == (0, "") and answers[2][2] != [worker] and not in_process.workers
    assert [os.readlink(rootfs / f"opt/libmarker{n}.so") for n in (1, 2, 3)] == [f"libmarker.so.{n}" for n in (1, 2, 3)]


def test_only_a_cdi_hook_may_send_its_state_later(in_process: Any, root_tmp: Path) -> None:
    """A prestart request (decided by the service itself, which must never wait on a runtime) with a state to
    follow is refused in one line, nothing forked; a cdi-hook line only click can word is declined before its
    state is sent, so the client still has it to run the call in-process."""
    for argv, expected in ((["--config", str(root_tmp / "config.toml"), "prestart"],
                            (1, "gpuhook-hook: service: refused: only a cdi-hook request's state may follow it")),
                           (["cdi-hook", "update-container", "--link", "nolink"], (protocol.DECLINED, ""))):
        client, server = _pair()
        with client, server:
            protocol.send_request(client, argv, b"", later=True)
            in_process.serve_one(server)
            server.close()
            assert protocol.recv_answer(client)[:2] == expected
    assert Forks.count == 0 and not in_process.children


def test_a_worker_never_runs_a_whole_call_without_the_clients_namespace(in_process: Any, root_tmp: Path) -> None:
    """A hand-off whose descriptors do not match what it says it carries (a client namespace announced, none
    sent) is refused by the worker in one line, and the worker ends: a call is never run in a namespace other
    than its client's."""
    import pickle

    worker = in_process._fork_worker()
    client, server = _pair()
    with client, server:
        message = pickle.dumps((([], [], "", "", []), ["cdi-hook", "create-symlinks"], None, b"{}", time.monotonic(),
                                False, True, None, False, None))
        socket.send_fds(worker.sock, [message], [server.fileno()])
        server.close()
        _, status = os.waitpid(worker.pid, 0)
        code, line, _ = protocol.recv_answer(client)
    in_process._let_go(worker)
    assert code == 1 and line == "gpuhook-hook: service: the worker got 1 descriptors for a start that has 2"
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_start_is_handed_to_a_worker_and_answered_by_it(in_process: Any, root_tmp: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With a worker idle, a start that touches a container is handed over (its connection, the request and the
    plan): no fork at that moment, the worker recorded as the start's child, its answer the one a child forked for
    the same request gives (no worker may be forked: MAX_WORKERS 0). A start that failed ends its worker."""
    from gpuhook.service import pool

    worker = in_process._fork_worker().pid
    assert Forks.count == 1 and psutil.Process(worker).ppid() == os.getpid()
    code, line, took = _dead_process_start(in_process, root_tmp, "worker")
    assert Forks.count == 1, "the parent forked although a worker was idle"
    assert took == [worker] and _gone(worker) and not in_process.workers
    monkeypatch.setattr(pool, "MAX_WORKERS", 0)
    forked_code, forked_line, forked = _dead_process_start(in_process, root_tmp, "forked")
    assert Forks.count == 2 and forked != [worker] and not in_process.workers
    same = [re.sub(r"/proc/[0-9]+/", "/proc/N/", text) for text in (line, forked_line)]
    assert code == forked_code == 1 and same[0] == same[1] and "/proc/N/cgroup" in same[0], (line, forked_line)
    log = (root_tmp / "gpuhook.log").read_text()
    assert " worker error: " in log and " forked error: " in log


@pytest.fixture()
def sent(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every message handed to a worker (socket.send_fds recorded), in order."""
    messages: list[bytes] = []
    send_fds = socket.send_fds

    def recording(sock: socket.socket, buffers: list[bytes], fds: list[int], *rest: Any) -> int:
        messages.append(bytes(buffers[0]))
        return send_fds(sock, buffers, fds, *rest)

    monkeypatch.setattr(socket, "send_fds", recording)
    return messages


def test_a_worker_comes_back_for_the_next_start(in_process: Any, root_tmp: Path, sent: list[bytes]) -> None:
    """A start its client took back (no GO) leaves its worker clean: it says READY, is idle again, and takes the next
    start, whose plan (made after the worker was forked) it was sent whole the first time and now gets by number."""
    worker = in_process._fork_worker().pid  # before any plan
    code, _, took = _dead_process_start(in_process, root_tmp, "taken-back", go=False)
    assert code == protocol.TAKING and Forks.count == 1 and list(in_process.workers) == took == [worker]
    assert not in_process.workers[took[0]].busy and not in_process.children and not _gone(took[0])
    code, line, again = _dead_process_start(in_process, root_tmp, "by-number")
    assert again == took and Forks.count == 1, "the idle worker did not take the next start"
    assert len(sent) == 2 and len(sent[1]) * 2 < len(sent[0]), [len(m) for m in sent]
    whole, by_number = (in_process._unpickled(m)[7] for m in sent)
    assert by_number.edits is next(iter(in_process._plans.values()))[2].edits and by_number.edits == whole.edits
    assert code == 1 and "/cgroup" in line, line
    log = (root_tmp / "gpuhook.log").read_text()
    assert " taken-back " not in log and log.count(" by-number error: ") == 1


def test_a_decided_start_with_no_idle_worker_gets_a_worker_forked_for_it(in_process: Any, root_tmp: Path) -> None:
    """No worker idle and room for one (MAX_WORKERS): the start's fork is a worker, which stays for the next. It
    keeps none of the descriptors it was forked with (that start's connection, its client's pidfd, the parent's
    files): beside stdio only its socket, its mount namespace and its cwd."""
    _, _, took = _dead_process_start(in_process, root_tmp, "first", go=False)
    assert Forks.count == 1 and list(in_process.workers) == took and not in_process.workers[took[0]].busy
    held = sorted(os.readlink(f"/proc/{took[0]}/fd/{fd}") for fd in os.listdir(f"/proc/{took[0]}/fd")
                  if int(fd) > 2)
    assert len(held) == 3 and held[0].startswith("/") and held[1].startswith("mnt:[") and \
        held[2].startswith("socket:["), held
    _, _, again = _dead_process_start(in_process, root_tmp, "second", go=False)
    assert again == took and Forks.count == 1


def test_a_plan_remembered_before_a_worker_was_forked_goes_by_number(in_process: Any, root_tmp: Path,
                                                                     sent: list[bytes]) -> None:
    """A start whose plan was remembered before its worker was forked hands its edits over by number (the worker's
    copy of that plan), not whole; one remembered after the fork goes whole. Both arrive as the same edits, and
    both starts are answered alike."""
    in_process._fork_worker()  # forked before any plan: the first start's plan goes whole
    first = _dead_process_start(in_process, root_tmp, "whole")
    in_process._fork_worker()  # forked after it: the same request's plan goes by number
    second = _dead_process_start(in_process, root_tmp, "by-number")
    assert len(sent) == 2 and len(sent[1]) * 2 < len(sent[0]), [len(m) for m in sent]
    whole, by_number = (in_process._unpickled(m)[7] for m in sent)
    assert by_number.edits is next(iter(in_process._plans.values()))[2].edits and by_number.edits == whole.edits
    assert by_number.summary == whole.summary and by_number.edits.mounts
    same = [re.sub(r"/proc/[0-9]+/", "/proc/N/", line) for _, line, _ in (first, second)]
    assert first[0] == second[0] == 1 and same[0] == same[1], (first, second)


def test_a_worker_that_died_leaves_the_start_to_a_fork(in_process: Any, root_tmp: Path) -> None:
    """A worker killed while idle (not yet reaped): the hand-off cannot go, so the parent forks for the start,
    which is done once; a worker that dies idle is reaped, and none is forked ahead for WORKER_RETRY_S."""
    import signal

    from gpuhook.service import pool

    pid = in_process._fork_worker().pid
    os.kill(pid, signal.SIGKILL)
    _until_zombie(pid)
    code, line, took = _dead_process_start(in_process, root_tmp, "handoff-failed")
    assert Forks.count == 2 and took != [pid] and pid not in in_process.workers
    while in_process.spent:
        in_process.reap(block=True)
    assert code == 1 and line.startswith("gpuhook-hook: "), line
    assert (root_tmp / "gpuhook.log").read_text().count(" handoff-failed error: ") == 1
    assert not in_process.spent and not in_process.children

    pid = in_process._fork_worker().pid
    os.kill(pid, signal.SIGKILL)
    _until_zombie(pid)
    before = time.monotonic()
    in_process.reap()
    assert not in_process.workers and in_process.ahead_after >= before + pool.WORKER_RETRY_S
    assert not in_process._ahead_due()


def test_no_idle_worker_and_no_room_for_one_forks_a_child(in_process: Any, root_tmp: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """At MAX_WORKERS, all busy, a start gets a child of its own (one start, then it exits); the workers stay."""
    from gpuhook.service import pool

    monkeypatch.setattr(pool, "MAX_WORKERS", 1)
    worker = in_process._fork_worker()
    worker.busy = True  # as if it ran another start
    _, _, took = _dead_process_start(in_process, root_tmp, "overflow")
    assert took != [worker.pid] and Forks.count == 2 and list(in_process.workers) == [worker.pid]
    worker.busy = False


def test_idle_workers_but_the_last_end_after_worker_idle_s(in_process: Any) -> None:
    """Of the idle workers, those idle for WORKER_IDLE_S end, all but the most recently used: a node at rest keeps
    one worker; a busy one is never let go for it."""
    from gpuhook.service import pool

    first, second, third = (in_process._fork_worker() for _ in range(3))
    first.idle_since -= pool.WORKER_IDLE_S
    second.idle_since -= pool.WORKER_IDLE_S + 1
    third.busy = True
    third.idle_since -= pool.WORKER_IDLE_S + 2
    in_process._retire_idle()
    assert list(in_process.workers) == [first.pid, third.pid]
    first.idle_since -= 5  # now the only idle one: kept however long it waits
    in_process._retire_idle()
    assert list(in_process.workers) == [first.pid, third.pid]
    third.busy = False
    os.waitpid(second.pid, 0)  # it read its socket's end and exited


def test_a_worker_goes_back_home_clean_or_not_at_all(tmp_path: Path) -> None:
    """_Home.back in a forked child: after joining a private copy of its mount namespace (as a start's ldconfig
    view does) and changing its cwd and umask it is home again and clean; a descriptor left open, or a child left,
    makes it not clean."""
    from gpuhook import _native
    from gpuhook.service.worker import Home as _Home

    if os.geteuid() != 0:
        pytest.skip("needs root: unshare(CLONE_NEWNS) and setns")
    result = tmp_path / "result"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            cwd, mask = os.getcwd(), home_umask()
            home = _Home()
            ns = os.stat("/proc/self/ns/mnt").st_ino
            _native.unshare(_native.CLONE_NEWNS)
            os.chdir(tmp_path)
            os.umask(0o077)
            moved = os.stat("/proc/self/ns/mnt").st_ino != ns
            clean = home.back()
            back = [os.stat("/proc/self/ns/mnt").st_ino == ns, os.getcwd() == cwd, home_umask() == mask]
            fd = os.open("/", os.O_RDONLY)
            with_fd = home.back()
            os.close(fd)
            child = subprocess.Popen(["sleep", "30"])
            with_child = home.back()
            child.kill()
            child.wait()
            result.write_text(json.dumps([moved, clean, *back, with_fd, with_child, home.back()]))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert json.loads(result.read_text()) == [True, True, True, True, True, False, False, True]


def home_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_worker_is_forked_ahead_only_once_the_start_before_is_over(in_process: Any, root_tmp: Path) -> None:
    """A start's child that ended (here a worker whose start failed) makes the next worker forked ahead wait
    WORKER_AHEAD_S: its fork would otherwise take the CPU from the runtime still starting that container. The
    accept loop sleeps no longer than that, so a worker is there for the next start; a dead worker's longer retry
    is kept."""
    from gpuhook.service import pool

    assert in_process._poll_ms() == 1000  # nothing pending: the loop's usual wait
    in_process._fork_worker()
    before = time.monotonic()
    _dead_process_start(in_process, root_tmp, "then-idle")
    assert not in_process.workers and not in_process.children and not in_process._ahead_due()
    assert before + pool.WORKER_AHEAD_S <= in_process.ahead_after <= time.monotonic() + pool.WORKER_AHEAD_S
    assert 1 <= in_process._poll_ms() <= int(pool.WORKER_AHEAD_S * 1000) + 1
    time.sleep(pool.WORKER_AHEAD_S)
    assert in_process._ahead_due()

    in_process.ahead_after = retry = time.monotonic() + pool.WORKER_RETRY_S  # a worker died idle meanwhile
    _dead_process_start(in_process, root_tmp, "forked")
    assert in_process.ahead_after == retry and in_process._poll_ms() == 1000


def _until_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} did not die"
        time.sleep(0.01)


@pytest.mark.e2e
def test_the_running_service_keeps_a_warm_worker_across_starts(native: Path, root_tmp: Path,
                                                               fake_driver: Any) -> None:
    """The real service: idle, it has one child waiting (a worker forked ahead); GPU starts through the native entry
    are done by that very worker, one after the other (it is still the one child after each, and each container is
    the fallback's); at stop no child is left."""
    need_tool("runc")
    need_busybox()
    config = write_config(root_tmp, Path(fake_driver.root))
    env = ["NVIDIA_VISIBLE_DEVICES=1"]
    fallback = runc_start(root_tmp, native, config, root_tmp / "run" / "service.sock", env, "fallback")
    running = start_service(root_tmp, config)
    try:
        service = psutil.Process(running.proc.pid)
        worker = _one_waiting_child(service)
        no_fallback(native, root_tmp / "fallback-ran")
        served = [runc_start(root_tmp, native, config, running.sock, env, f"served{n}") for n in (1, 2)]
        assert [s.returncode for s in served] == [0, 0], [s.stderr for s in served]
        assert _one_waiting_child(service) == worker and not _gone(worker)
    finally:
        running.stop()
    assert served[0].stdout == served[1].stdout == fallback.stdout and "nvidia1" in nodes(fallback.stdout)
    assert (root_tmp / "gpuhook.log").read_text().count(" by=service") == 2
    assert _gone(worker)


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (reaped, or a zombie); a process that ends while it is looked at has too."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _one_waiting_child(service: psutil.Process) -> int:
    """The pid of the service's one child, once it has exactly one (a worker, forked ahead when idle)."""
    deadline = time.monotonic() + 10
    while True:
        children = [c for c in service.children() if not _gone(c.pid)]
        if len(children) == 1:
            return children[0].pid
        assert time.monotonic() < deadline, f"the idle service has children {children}, not one worker"
        time.sleep(0.02)
