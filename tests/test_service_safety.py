"""The resident service as safe and as available as no service at all: who it serves (a pinned peer with
CAP_SYS_ADMIN in its user namespace, never a process it cannot pin), that no client delays another, that a
stopped service costs a start a bounded delay and never a failure, that a driver change never leaves a stale plan,
and that its log cannot be given a second line by a client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.e2e import need_tool
from support.runc import busybox_rootfs, make_bundle, need_busybox, runc_run, unique_id
from support.service import Running, start
from test_hook_e2e import nodes, write_config
from test_service import plain_bundle, run_native, runc_start, state

from gpuhook.cli import entry as hook_entry
from gpuhook.service import protocol
from gpuhook.service.server import Service

NEEDS_NATIVE = pytest.mark.skipif(hook_entry.native_entry() is None, reason="the native entry was not built")


def _log(root_tmp: Path) -> str:
    return (root_tmp / "gpuhook.log").read_text()


@pytest.fixture()
def gpu_service(root_tmp: Path, fake_driver: Any) -> Iterator[Running]:
    running = start(root_tmp / "run" / "service.sock", write_config(root_tmp, Path(fake_driver.root)),
                    root_tmp / "service.err")
    yield running
    running.stop()


# --- who is served ------------------------------------------------------------------------------------------------


def test_a_peer_that_exited_before_it_was_pinned_is_declined_never_served_as_the_host(
        root_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit trick: a child connects, sends all but the last byte of a command that writes a host file, and
    exits; its parent, which shares the socket, sends the rest. The service cannot pin the process that connected
    (it is gone): it answers DECLINED and runs nothing, where it used to serve it in its own namespace."""
    from gpuhook.discover import cache

    monkeypatch.setattr(cache, "_WARM", None)  # keep_warm() is the service's: this test process gets it back off
    ran = root_tmp / "ran"

    def command(args: list[str], cwd: str, take: Any) -> tuple[int, str, bytes]:
        take()
        ran.write_text("served")
        return 0, "", b""

    service = Service(None, str(root_tmp / "run" / "service.sock"), {"generate-cdi": command})
    service.open()
    assert service.listener is not None
    service.listener.setblocking(False)
    request = protocol.encode_request(["generate-cdi", "--output", str(root_tmp / "host-file")], b"", cwd="/",
                                      exe=os.path.realpath(os.sys.executable))  # type: ignore[attr-defined]
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        child = os.fork()
        if child == 0:  # the process the kernel records as the peer
            try:
                client.connect(service.socket_path)
                client.sendall(request[:-1])
            finally:
                os._exit(0)
        os.waitpid(child, 0)
        client.sendall(request[-1:])
        service._accept_ready()
        client.settimeout(10)
        try:
            answer = protocol.recv_answer(client, with_output=True, go=False)[0]
        except ConnectionResetError:  # declined and closed before the last byte was read: not served either
            answer = protocol.DECLINED
        assert answer == protocol.DECLINED
    finally:
        client.close()
        service.close()
    assert not ran.exists() and not (root_tmp / "host-file").exists()


@NEEDS_NATIVE
@pytest.mark.e2e
def test_a_container_with_the_socket_folder_mounted_gets_nothing_from_the_service(root_tmp: Path,
                                                                                 gpu_service: Running) -> None:
    """A container without capabilities that has the socket's folder mounted (read-only is enough) asks the
    service for the three things a root process on the host could once be made to do: a host file written by
    generate-cdi, a prestart on a bundle whose root is /, a cdi-hook making /etc/ld.so.preload. Each is DECLINED
    (the peer lacks CAP_SYS_ADMIN), so the entry inside runs them with the container's own rights: nothing on the
    host changes."""
    need_tool("runc")
    need_busybox()
    rootfs = busybox_rootfs(root_tmp / "attacker")
    shutil.copy(str(hook_entry.native_entry()), rootfs / "entry")
    (rootfs / "entry.py").write_text("#!/bin/sh\necho fallback-ran >&2\nexit 7\n")
    (rootfs / "entry.py").chmod(0o755)
    (rootfs / "state.json").write_text(json.dumps({"ociVersion": "1.0.2", "id": "evil\nforged line", "pid": 1,
                                                   "bundle": "/"}))
    target = root_tmp / "host-written"
    script = (f"/entry generate-cdi --output {target} --hook-path /bin/sh; echo rc=$?; "
              "/entry prestart < /state.json; echo rc=$?; "
              "/entry cdi-hook update-ldcache --folder /lib < /state.json; echo rc=$?")
    bundle = make_bundle(root_tmp / "attack-bundle", rootfs, ["sh", "-c", script],
                         env=[f"GPUHOOK_SERVICE_SOCKET=/svc/{gpu_service.sock.name}"],
                         mounts=[{"destination": "/svc", "type": "bind", "source": str(gpu_service.sock.parent),
                                  "options": ["rbind", "ro"]}])
    gpu_service.sock.parent.chmod(0o755)  # as if opened up by mistake: the peer check must hold alone
    gpu_service.sock.chmod(0o666)
    result = runc_run(bundle, unique_id("attack"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["rc=7", "rc=7", "rc=7"], (result.stdout, result.stderr)  # each one in-process
    assert result.stderr.count("fallback-ran") == 3
    assert not target.exists() and not Path("/etc/ld.so.preload").exists()
    assert "lacks CAP_SYS_ADMIN" in gpu_service.log.read_text()
    assert not (root_tmp / "gpuhook.log").exists()  # the service logged no start for any of them


def test_a_state_id_never_gives_the_log_a_second_line(root_tmp: Path, gpu_service: Running) -> None:
    """An OCI state's id is the client's string: its newline and other control characters are escapes in the
    log, which keeps one line per start."""
    body = state(plain_bundle(root_tmp, []), cid="one\n2026-01-01T00:00:00 forged skip\r\x1b[2J")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(str(gpu_service.sock))
        protocol.send_request(conn, ["--config", str(root_tmp / "config.toml")], body)
        assert protocol.recv_answer(conn)[:2] == (0, "")
    lines = _log(root_tmp).splitlines()
    assert len(lines) == 1 and "one\\x0a2026-01-01T00:00:00 forged skip\\x0d\\x1b[2J skip" in lines[0]


# --- no client delays another ------------------------------------------------------------------------------------


def _hold_connections(sock: Path, count: int, half: bytes) -> int:
    """A forked process that opens `count` connections (every other one sends `half`, a request's start) and holds
    them until killed: its pid."""
    pid = os.fork()
    if pid == 0:
        held = []
        try:
            for n in range(count):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(str(sock))
                if n % 2:
                    conn.sendall(half)
                held.append(conn)
            time.sleep(60)
        finally:
            os._exit(0)
    return pid


@NEEDS_NATIVE
def test_a_thousand_idle_and_half_sent_connections_delay_no_honest_start(native: Path, root_tmp: Path,
                                                                          gpu_service: Running) -> None:
    """Slowloris: 32 processes hold 1,024 connections that never finish a request. An honest start meanwhile is
    answered by the service itself: had it waited past the client's bound, its log line would say in-process."""
    half = protocol.encode_request(["prestart"], b'{"id": "x"}')[:20]
    holders = [_hold_connections(gpu_service.sock, 32, half) for _ in range(32)]
    try:
        time.sleep(1)  # all connected, the service reading every one of them
        config = ["--config", str(root_tmp / "config.toml"), "prestart"]
        result = run_native(native, gpu_service.sock, config, state(plain_bundle(root_tmp, []), cid="honest"))
    finally:
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert (result.returncode, result.stderr) == (0, "")
    assert " honest skip request=unset took=" in _log(root_tmp) and " by=service" in _log(root_tmp)


def test_cdi_hooks_whose_state_never_comes_take_no_child_another_start_needs(root_tmp: Path, fake_driver: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """150 cdi-hook requests whose state never comes hold at most MAX_LATE children (the rest are DECLINED:
    their clients run them in-process); a prestart start that touches a container still gets its child."""
    from gpuhook.discover import cache
    from gpuhook.service import calls, server

    monkeypatch.setattr(cache, "_WARM", None)
    # the children forked here hold copies of this process's other clients' ends, so a client closed here is not
    # gone for them: they wait out GO_WAIT_S (a service holds no client's end: its children see every close)
    monkeypatch.setattr(calls, "GO_WAIT_S", 2.0)
    service = Service(str(write_config(root_tmp, Path(fake_driver.root))), str(root_tmp / "run" / "s.sock"))
    answers, clients = [], []
    try:
        bundle = plain_bundle(root_tmp, [])
        for _ in range(150):
            client, conn = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            protocol.send_request(client, ["cdi-hook", "update-ldcache", "--folder", "/lib"], b"", later=True)
            service.serve_one(conn)
            conn.close()
            clients.append(client)
        assert len(service.late) == server.MAX_LATE and len(service.children) == server.MAX_LATE
        for client in clients[server.MAX_LATE:]:
            client.settimeout(10)
            answers.append(protocol.recv_answer(client, go=False)[0])
        assert answers == [protocol.DECLINED] * (150 - server.MAX_LATE)
        gone = subprocess.Popen(["sleep", "30"])  # a GPU start that reaches its child, which fails it at once
        gone.kill()
        gone.wait()
        client, conn = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        body = state(plain_bundle(root_tmp, ["NVIDIA_VISIBLE_DEVICES=all"]), cid="gpu", pid=gone.pid)
        protocol.send_request(client, ["--config", str(root_tmp / "config.toml")], body)
        service.serve_one(conn)
        conn.close()
        assert len(service.children) == server.MAX_LATE + 1  # its own child, beside the waiting ones
        client.settimeout(30)
        code, line, _ = protocol.recv_answer(client)
        assert code == 1 and line.startswith("gpuhook-hook: ")
        assert " gpu error: " in _log(root_tmp)
    finally:
        for client in clients:
            client.close()
        service.close()  # workers whose client went away are clean and wait for the next start: let go here
        while service.children:  # each ends once it finds its client gone; close() waits a bounded time only
            service.reap(block=True)
    assert bundle.exists()


# --- a stopped service --------------------------------------------------------------------------------------------


@NEEDS_NATIVE
@pytest.mark.e2e
def test_a_stopped_service_costs_a_start_a_bounded_delay_never_a_failure(native: Path, root_tmp: Path,
                                                                        gpu_service: Running,
                                                                        fake_driver: Any) -> None:
    """SIGSTOP on the service: a start with a GPU and one without both succeed, in-process, after the client's
    bound, each logged once with why; after SIGCONT the service answers again and adds no line for the starts it
    found given up."""
    need_tool("runc")
    need_busybox()
    config = root_tmp / "config.toml"
    os.kill(gpu_service.proc.pid, signal.SIGSTOP)
    try:
        gpu = runc_start(root_tmp, native, config, gpu_service.sock, ["NVIDIA_VISIBLE_DEVICES=1"], "stopped-gpu")
        plain = run_native(native, gpu_service.sock, ["--config", str(config), "prestart"],
                           state(plain_bundle(root_tmp, []), cid="stopped-plain"))
    finally:
        os.kill(gpu_service.proc.pid, signal.SIGCONT)
    assert gpu.returncode == 0, gpu.stderr
    assert "nvidia1" in nodes(gpu.stdout)
    assert (plain.returncode, plain.stderr) == (0, "")
    time.sleep(1)  # the service, running again, finds both connections given up
    after = run_native(native, gpu_service.sock, ["--config", str(config), "prestart"],
                       state(plain_bundle(root_tmp, []), cid="after"))
    assert (after.returncode, after.stderr) == (0, "")
    lines = _log(root_tmp).splitlines()
    why = f"by=in-process (service {gpu_service.sock} gave no answer within 250 ms)"
    assert [line.split()[1] for line in lines if why in line][-1] == "stopped-plain"
    assert sum(" stopped-plain " in line for line in lines) == 1  # once: the service did not log it too
    assert sum(" inject " in line and why in line for line in lines) == 1
    assert lines[-1].split()[1] == "after" and lines[-1].endswith(" by=service")


# --- one line per start, whatever the timing -----------------------------------------------------------------------


def test_an_answer_made_by_the_parent_waits_for_go_and_is_never_logged_for_a_client_that_left(
        gpu_service: Running, root_tmp: Path) -> None:
    """A start the parent answers itself (no GPU request) is answered and logged only after its client's GO: a
    client that gave up (it ran the start itself, and logged it) gets no line from the service; one that says
    GO gets its answer and one line."""
    config = ["--config", str(root_tmp / "config.toml"), "prestart"]
    for cid, go in (("left", False), ("stayed", True)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(gpu_service.sock))
            protocol.send_request(conn, config, state(plain_bundle(root_tmp, []), cid=cid))
            if go:
                assert protocol.recv_answer(conn)[:2] == (0, "")
            else:
                assert protocol.recv_answer(conn, go=False)[0] == protocol.TAKING
    time.sleep(0.5)
    lines = _log(root_tmp).splitlines()
    assert [line.split()[1] for line in lines] == ["stayed"], lines


@NEEDS_NATIVE
@pytest.mark.e2e
def test_a_worker_stopped_past_the_bound_adds_no_line_when_it_resumes(native: Path, root_tmp: Path,
                                                                       gpu_service: Running) -> None:
    """The start goes to an idle worker that is stopped (SIGSTOP): with the entry's real 250 ms bound, the client
    runs it in-process and the container exits; the worker, resumed, finds the start taken back before it looks
    at the container (gone by then), and writes nothing: one line, the fallback's."""
    from test_service import _one_waiting_child

    need_tool("runc")
    need_busybox()
    worker = _one_waiting_child(psutil.Process(gpu_service.proc.pid))
    os.kill(worker, signal.SIGSTOP)
    try:
        gpu = runc_start(root_tmp, native, root_tmp / "config.toml", gpu_service.sock,
                         ["NVIDIA_VISIBLE_DEVICES=0"], "resumed")
    finally:
        os.kill(worker, signal.SIGCONT)
    assert gpu.returncode == 0, gpu.stderr
    time.sleep(1)  # the worker, running again, has read the start and found its client gone
    lines = _log(root_tmp).splitlines()
    assert len(lines) == 1 and " inject " in lines[0] and "by=in-process (service " in lines[0], lines


BURST = 200  # starts, PARALLEL at a time, through the native entry with its real bound
PARALLEL = 50


@NEEDS_NATIVE
@pytest.mark.e2e
@pytest.mark.slow
def test_a_burst_with_the_real_bound_logs_each_start_once(native: Path, root_tmp: Path,
                                                           gpu_service: Running) -> None:
    """200 starts, 50 at a time, GPU and not, through the native entry with its real 250 ms bound (not the
    suite's service mode, which waits longer): some are the service's, some run in-process after the bound, and
    every one succeeds with exactly one log line."""
    from concurrent.futures import ThreadPoolExecutor

    need_tool("runc")
    need_busybox()
    template = busybox_rootfs(root_tmp / "template")
    hook = {"path": str(native), "args": ["gpuhook-hook", "--config", str(root_tmp / "config.toml"), "prestart"],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", f"GPUHOOK_SERVICE_SOCKET={gpu_service.sock}"]}
    jobs = []
    for i in range(BURST):
        bundle = root_tmp / f"b{i:03d}"
        shutil.copytree(template, bundle / "rootfs", symlinks=True, copy_function=os.link)
        env = ["NVIDIA_VISIBLE_DEVICES=0"] if i % 2 else []
        make_bundle(bundle, bundle / "rootfs", ["true"], env=env, hooks={"prestart": [hook]})
        jobs.append((unique_id(f"burst{i:03d}"), bundle))
    with ThreadPoolExecutor(PARALLEL) as threads:
        results = list(threads.map(lambda job: runc_run(job[1], job[0], timeout=120), jobs))
    assert [r.stderr[-300:] for r in results if r.returncode != 0] == []
    time.sleep(1)  # any worker or held answer still running has had its chance to (wrongly) add a line
    ids = [line.split()[1] for line in _log(root_tmp).splitlines()]
    assert sorted(ids) == sorted(cid for cid, _ in jobs), "not exactly one log line per start"


# --- never a stale plan -------------------------------------------------------------------------------------------


def _gpu_start(root_tmp: Path, native: Path, sock: Path, name: str) -> Any:
    return runc_start(root_tmp, native, root_tmp / "config.toml", sock, ["NVIDIA_VISIBLE_DEVICES=0",
                                                                          "NVIDIA_DRIVER_CAPABILITIES=all"], name)


@NEEDS_NATIVE
@pytest.mark.e2e
@pytest.mark.parametrize("seen", [True, False], ids=["folder-changed", "folder-unchanged"])
def test_a_driver_file_removed_under_a_running_service_never_fails_a_start(native: Path, root_tmp: Path,
                                                                          fake_driver_factory: Any,
                                                                          seen: bool) -> None:
    """A library of the driver is removed while the service holds a plan that names it. Its folder's change is
    in the inventory's fingerprint: the next start plans anew. Where nothing shows it (the folder's times put
    back), the start meets the vanished file before it touches the container and plans once more from a fresh
    scan. Either way the start succeeds, without that file."""
    need_tool("runc")
    need_busybox()
    driver = fake_driver_factory(fresh=True)  # this one is changed: never the session's shared driver
    running = start(root_tmp / "run" / "service.sock", write_config(root_tmp, Path(driver.root)),
                    root_tmp / "service.err")
    try:
        _driver_change(root_tmp, native, running, Path(driver.root), seen)
    finally:
        running.stop()


def _driver_change(root_tmp: Path, native: Path, gpu_service: Running, driver_root: Path, seen: bool) -> None:
    first = _gpu_start(root_tmp, native, gpu_service.sock, "before")
    assert first.returncode == 0, first.stderr
    lib_dir = driver_root / "usr/lib/x86_64-linux-gnu"
    victim = next(p for p in sorted(lib_dir.glob("libnvidia-opencl.so.*")) if not p.is_symlink())
    times = os.stat(lib_dir)
    victim.unlink()
    if not seen:
        os.utime(lib_dir, ns=(times.st_atime_ns, times.st_mtime_ns))
    second = _gpu_start(root_tmp, native, gpu_service.sock, "after")
    assert second.returncode == 0, second.stderr
    assert victim.name not in second.stdout and "nvidia0" in nodes(second.stdout)
    last = _log(root_tmp).splitlines()[-1]
    assert last.endswith(" by=service") and ("planned again" in last) is not seen


# --- one socket, and doctor says where ----------------------------------------------------------------------------


def test_doctor_says_whether_the_service_answers_where_the_entry_looks(root_tmp: Path, gpu_service: Running,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry and the service follow one rule ($GPUHOOK_SERVICE_SOCKET, else the default); doctor asks the
    service at that path, and names a running service that listens elsewhere (it would serve no start)."""
    from gpuhook.doctor.model import OK, WARN
    from gpuhook.doctor.service import check_service

    monkeypatch.setenv("GPUHOOK_SERVICE_SOCKET", str(gpu_service.sock))
    found = check_service()
    assert found[0].status == OK and f"pid {gpu_service.proc.pid} answers at {gpu_service.sock}" in found[0].message
    elsewhere = root_tmp / "elsewhere.sock"
    monkeypatch.setenv("GPUHOOK_SERVICE_SOCKET", str(elsewhere))
    found = check_service()
    assert f"no gpuhook service at {elsewhere}" in found[0].message
    assert any(f.status == WARN and f"pid {gpu_service.proc.pid} listens at {gpu_service.sock}" in f.message
               for f in found[1:])


def test_a_config_that_still_moves_the_socket_says_what_to_do_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config's service-socket is no longer read (the native entry cannot follow it): the same path as the
    rule's is accepted as it is, another is refused with the way out."""
    from gpuhook.errors import ConfigError

    monkeypatch.delenv("GPUHOOK_SERVICE_SOCKET", raising=False)
    from gpuhook.hook.config import parse_config

    assert parse_config('service-socket = "/run/gpuhook/service.sock"\n').log_file == "/var/log/gpuhook.log"
    with pytest.raises(ConfigError, match=r"service-socket '/srv/s.sock' is no longer read: .*GPUHOOK_SERVICE_SOCKET"):
        parse_config('service-socket = "/srv/s.sock"\n')


def test_the_socket_path_appears_only_once_the_service_listens(root_tmp: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Readiness is the path: a client that sees it can connect (bound and listening under a temporary name, then
    renamed), never meets ECONNREFUSED in between; a stale socket of a dead service is replaced the same way."""
    from gpuhook.service.server import bind_socket

    path = root_tmp / "run" / "service.sock"
    seen_at_listen: list[bool] = []
    real_listen = socket.socket.listen

    def listen(sock: socket.socket, *args: Any) -> None:
        seen_at_listen.append(path.exists())
        real_listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", listen)
    for _ in range(2):  # the second time over the first one's socket file, nothing listening on it any more
        listener = bind_socket(str(path))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
        listener.close()
    assert seen_at_listen == [False, True]  # the first: no path before listen; the second: the stale one
    assert sorted(p.name for p in path.parent.iterdir()) == ["service.sock"]  # no temporary name left
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
