"""Faults: a broken driver, a dying hook, a restarting kubelet. Nothing may be lost, left mounted or hung.

The spec output running out of space (a full tmpfs keeps the previous spec, exit 1, one line) is
tests/test_cdi_cli.py::test_disk_full_keeps_the_previous_spec; atomic.write_atomic's failure paths are next to it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from support import hostile
from support.kubelet import PluginProcess, TestKubelet, health
from support.processes import short_tempdir
from support.runc import busybox_rootfs, make_bundle, runc_run, unique_id

from gpuhook.fakedriver import FakeDriver

PROBE = ("echo NODES $(ls /dev | grep nvidia | sort | tr '\\n' ' '); "
         "echo LIBS $(grep -o '/libnvidia-ml.so[^ ]*\\|/libcuda.so[^ ]*' /proc/self/mountinfo | sort | tr '\\n' ' ')")


@pytest.fixture()
def e2e() -> None:
    hostile.need_hook_e2e("gcc")


def start(work: Path, fake: FakeDriver, env: list[str], timeout: int | None = None,
          **config: Any) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """One busybox container with the hook; returns runc's result and the probe's KEY value lines."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = hostile.write_config(work, fake.root, **config)
    rootfs = busybox_rootfs(work / "bundle")
    bundle = make_bundle(work / "bundle", rootfs, ["sh", "-c", PROBE], env=env,
                         hooks=hostile.prestart_hooks(cfg, timeout=timeout))
    result = runc_run(bundle, unique_id("fault"), timeout=90)
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in result.stdout.splitlines())
    return result, lines


def one_clear_line(result: subprocess.CompletedProcess[str]) -> str:
    """A refused start: runc relays the hook's single `gpuhook-hook: ...` line; no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "gpuhook-hook:" in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- NVML missing or failing at hook time ------------------------------------------------------------------


def test_nvml_failing_falls_back_to_procfs(e2e: None, fake_driver: FakeDriver, tmp_path: Path) -> None:
    """nvmlInit fails (the fake's fail-init control) and there is no inventory cache: /proc/driver/nvidia and
    /dev still describe the GPUs, and the container gets the one it asked for."""
    fake_driver.set_fail_init()
    try:
        result, lines = start(tmp_path, fake_driver, ["NVIDIA_VISIBLE_DEVICES=1"], inventory_cache="")
    finally:
        fake_driver.set_fail_init(False)
    assert result.returncode == 0, result.stderr
    assert lines["NODES"].split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
    assert "/libcuda.so." in lines["LIBS"]


def test_nvml_failing_with_a_fresh_cache_needs_no_nvml(e2e: None, fake_driver: FakeDriver, tmp_path: Path) -> None:
    """The inventory cache, written by an earlier start, stays true while the driver is unchanged."""
    first, _ = start(tmp_path / "first", fake_driver, ["NVIDIA_VISIBLE_DEVICES=0"],
                     inventory_cache=str(tmp_path / "inventory.json"))
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "inventory.json").exists()
    fake_driver.set_fail_init()
    try:
        result, lines = start(tmp_path / "second", fake_driver, ["NVIDIA_VISIBLE_DEVICES=0"],
                              inventory_cache=str(tmp_path / "inventory.json"))
    finally:
        fake_driver.set_fail_init(False)
    assert result.returncode == 0, result.stderr
    assert "nvidia0" in lines["NODES"].split()


@pytest.mark.parametrize("garbage", [
    b"",
    b"\x00\xff garbage",
    b'{"format": 1, "gpus": [7]}',
    b"[]",
], ids=["empty", "binary", "wrong-shape", "not-an-object"])
def test_corrupt_inventory_cache_is_rediscovered(e2e: None, fake_driver: FakeDriver, tmp_path: Path,
                                                 garbage: bytes) -> None:
    """A cache that cannot be read back only costs a rediscovery."""
    cache = tmp_path / "inventory.json"
    cache.write_bytes(garbage)
    result, lines = start(tmp_path / "run", fake_driver, ["NVIDIA_VISIBLE_DEVICES=0"], inventory_cache=str(cache))
    assert result.returncode == 0, result.stderr
    assert "nvidia0" in lines["NODES"].split()


def test_nvml_library_missing_falls_back(e2e: None, fake_driver_factory: Any, tmp_path: Path) -> None:
    """No libnvidia-ml at all (a broken install): procfs discovery, and the container gets the GPU without
    the library that is not there."""
    fake = fake_driver_factory(fresh=True)
    nvml = fake.library("libnvidia-ml")
    for path in {nvml.path, nvml.soname_path, *(p for p, _ in fake.dev_links if "libnvidia-ml" in p)}:
        fake.host_path(path).unlink(missing_ok=True)
    result, lines = start(tmp_path, fake, ["NVIDIA_VISIBLE_DEVICES=0"], inventory_cache="")
    assert result.returncode == 0, result.stderr
    assert "nvidia0" in lines["NODES"].split()
    assert "/libcuda.so." in lines["LIBS"] and "libnvidia-ml" not in lines["LIBS"]


def test_no_driver_at_all_fails_clearly(e2e: None, fake_driver_factory: Any, tmp_path: Path) -> None:
    """NVML failing and no /proc/driver/nvidia: a GPU start fails naming the driver root; a plain start works."""
    fake = fake_driver_factory(fresh=True)
    (fake.root / "proc/driver/nvidia/version").unlink()
    fake.set_fail_init()
    mounts = hostile.own_mounts(tmp_path, fake.root)
    result, _ = start(tmp_path / "gpu", fake, ["NVIDIA_VISIBLE_DEVICES=0"], inventory_cache="")
    line = one_clear_line(result)
    assert "no NVIDIA driver found under" in line and str(fake.root) in line, line
    plain, _ = start(tmp_path / "plain", fake, [], inventory_cache="")
    assert plain.returncode == 0, plain.stderr
    assert hostile.own_mounts(tmp_path, fake.root) == mounts


# --- a crash in the middle of an injection -----------------------------------------------------------------

FAKE_LDCONFIG = r"""
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
/* Stands in for the host's ldconfig, run by the hook after its mounts (static, as the hook requires, and
   chrooted into the container: READY is a path in the rootfs): reports, then misbehaves. */
int main(void)
{
    FILE *f = fopen(READY, "w");
    if (f) { fprintf(f, "%d %d\n", (int)getpid(), (int)getppid()); fclose(f); }
    /* Until the hook (or, "kill-parent", the injection child, its parent: the test kills it from the host, as
       the confined ldconfig may not) is killed, and the hook's alarm ends this. A spin: the seccomp allow-list
       has neither nanosleep nor kill. */
    for (time_t end = time(NULL) + 120; time(NULL) < end;)
        ;
    return 0;
}
"""


def fake_ldconfig(directory: Path, mode: str) -> tuple[Path, Path]:
    """The stand-in and where its report appears on the host: /ready-MODE in start()'s rootfs."""
    src, exe = directory / f"ldconfig-{mode}.c", directory / f"ldconfig-{mode}"
    src.write_text(FAKE_LDCONFIG)
    subprocess.run(["gcc", "-static", "-O1", f'-DREADY="/ready-{mode}"', f'-DMODE="{mode}"', "-o", str(exe),
                    str(src)], check=True, capture_output=True)
    return exe, directory / "run/bundle/rootfs" / f"ready-{mode}"


@pytest.fixture()
def no_stragglers(tmp_path: Path) -> Iterator[None]:
    """After the test, no process of it (the hook's children, the fake ldconfig) may be left; killed if any."""
    yield
    assert hostile.kill_leftovers(str(tmp_path)) == [], "processes outlived the failed start"


def test_hook_killed_mid_injection_leaves_no_host_mount(e2e: None, fake_driver: FakeDriver, tmp_path: Path,
                                                        no_stragglers: None) -> None:
    """runc's hook timeout SIGKILLs the hook while its mounts are made and ldconfig runs: the start fails, the
    mounts lived only in the dying container's namespace, and runc cleans up the container."""
    exe, ready = fake_ldconfig(tmp_path, "sleep")
    mounts = hostile.own_mounts(tmp_path, fake_driver.root)
    began = time.monotonic()
    result, _ = start(tmp_path / "run", fake_driver, ["NVIDIA_VISIBLE_DEVICES=0"], timeout=3, ldconfig=f"@{exe}")
    assert time.monotonic() - began < 60  # no hang: the hook's children die with it (PR_SET_PDEATHSIG)
    assert ready.exists(), "the hook never got as far as ldconfig"
    assert result.returncode != 0
    assert "timeout" in result.stderr, result.stderr
    assert hostile.own_mounts(tmp_path, fake_driver.root) == mounts
    assert hostile.mounts_under(tmp_path) == []


def test_injection_child_killed_fails_clearly(e2e: None, fake_driver: FakeDriver, tmp_path: Path,
                                              no_stragglers: None) -> None:
    """The child that joined the container's mount namespace dies by SIGKILL after mounting: the hook reports
    it in one line, and nothing stays mounted on the host."""
    import threading

    exe, ready = fake_ldconfig(tmp_path, "kill-parent")
    mounts = hostile.own_mounts(tmp_path, fake_driver.root)

    def kill_the_injection_child() -> None:
        """The fake's parent as the host sees it (psutil, never a pid the fake reports: in another PID
        namespace that could be 0, this very process group), and only if it is the hook's own Python; once the
        fake has reported (killed sooner, the parent's PR_SET_PDEATHSIG would end the fake before it writes)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for proc in psutil.process_iter(["exe"]) if ready.exists() else ():
                if proc.info["exe"] == str(exe):
                    parent = proc.parent()
                    if parent is not None and parent.pid > 1 and "python" in os.path.basename(parent.exe()):
                        parent.send_signal(signal.SIGKILL)
                    return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_the_injection_child)
    killer.start()
    result, _ = start(tmp_path / "run", fake_driver, ["NVIDIA_VISIBLE_DEVICES=0"], ldconfig=f"@{exe}")
    killer.join(70)
    assert ready.exists()
    line = one_clear_line(result)
    assert "died" in line or "ldconfig" in line, line
    assert hostile.own_mounts(tmp_path, fake_driver.root) == mounts


def test_failure_after_some_mounts_leaves_no_host_mount(e2e: None, fake_driver: FakeDriver, tmp_path: Path) -> None:
    """A target that fails late (a file where the firmware folder goes, after the libraries are mounted)."""
    mounts = hostile.own_mounts(tmp_path, fake_driver.root)
    cfg = hostile.write_config(tmp_path, fake_driver.root)
    rootfs = busybox_rootfs(tmp_path / "bundle")
    (rootfs / "lib").mkdir(exist_ok=True)
    (rootfs / "lib/firmware").write_text("not a directory\n")
    bundle = make_bundle(tmp_path / "bundle", rootfs, ["true"], env=["NVIDIA_VISIBLE_DEVICES=0"],
                         hooks=hostile.prestart_hooks(cfg))
    result = runc_run(bundle, unique_id("fault"))
    line = one_clear_line(result)
    assert "/lib/firmware" in line, line
    assert hostile.own_mounts(tmp_path, fake_driver.root) == mounts
    log = hostile.log_lines(tmp_path)
    assert len(log) == 1 and " error: " in log[0], log


# --- the device plugin against a restarting kubelet and dying clients --------------------------------------


@pytest.fixture()
def plugin_world(fake_driver: FakeDriver) -> Iterator[tuple[TestKubelet, PluginProcess]]:
    workdir = short_tempdir()
    kubelet = TestKubelet(os.path.join(workdir, "dp")).start()
    args = ["--driver-root", str(fake_driver.root), "--kubelet-dir", kubelet.directory,
            "--cdi-spec-dir", os.path.join(workdir, "cdi"), "--hook-path", "/bin/true",
            "--sys-root", str(fake_driver.root / "sys"), "--health-interval", "0.05", "--recovery-window", "0.5"]
    proc = PluginProcess(args, os.path.join(workdir, "log"))
    try:
        kubelet.wait_registrations(1, timeout=30)
        yield kubelet, proc
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.log()
        assert "Traceback" not in proc.log()
    finally:
        proc.kill()
        kubelet.stop()
        subprocess.run(["rm", "-rf", workdir], check=False)


def usage(pid: int) -> tuple[int, int]:
    p = psutil.Process(pid)
    return p.num_fds(), p.num_threads()


def served(kubelet: TestKubelet) -> None:
    """kubelet's view is whole: a full healthy list on its stream, and Allocate answers. A plugin may register
    twice after one restart: an attempt stamped just before the new kubelet.sock appeared can still reach it, and
    the plugin, unable to tell (Registrar.registered_since), asks once more. The test kubelet then closes the
    superseded client, as kubelet replaces an endpoint, and a call in flight on it ends CANCELLED. Such a call is
    asked again of the registration that replaced it; any other failure stands."""
    for _ in range(3):
        client, stream = kubelet.client(), kubelet.stream()
        try:
            ids = [d.ID for d in stream.first(timeout=10).devices]
            assert len(ids) == 2
            assert client.allocate(ids[:1], timeout=10).container_responses
            return
        except (grpc.RpcError, AssertionError):
            if kubelet.client() is client:  # not superseded: a real failure
                raise
    raise AssertionError("the plugin's registration was superseded three times in a row")


def test_plugin_survives_20_kubelet_restarts(plugin_world: tuple[TestKubelet, PluginProcess]) -> None:
    kubelet, proc = plugin_world
    served(kubelet)
    fds, threads = usage(proc.proc.pid)
    for _ in range(20):
        restarted = kubelet.restart()
        regs = kubelet.wait_registrations(1, timeout=10)  # this kubelet generation's
        assert regs[-1].options is not None  # kubelet could dial the new socket back
        assert regs[-1].at > restarted
        served(kubelet)
        assert proc.proc.poll() is None, proc.log()
    time.sleep(1.5)  # streams of the old kubelets notice they are gone (one STREAM_TICK)
    now_fds, now_threads = usage(proc.proc.pid)
    assert now_fds <= fds + 8, f"descriptors grew from {fds} to {now_fds} over 20 restarts"
    assert now_threads <= threads + 4, f"threads grew from {threads} to {now_threads}"


WATCH_CLIENT = """
import sys
import grpc
from gpuhook.plugin import api_pb2 as pb, api_pb2_grpc as pb_grpc
stub = pb_grpc.DevicePluginStub(grpc.insecure_channel("unix://" + sys.argv[1]))
for message in stub.ListAndWatch(pb.Empty()):
    print(len(message.devices), flush=True)
"""


def first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no ListAndWatch message within {timeout}s"
    return proc.stdout.readline().strip()


def test_plugin_survives_killed_list_and_watch_clients(plugin_world: tuple[TestKubelet, PluginProcess],
                                                       fake_driver: FakeDriver) -> None:
    """Watchers SIGKILLed mid-stream, 15 of them, three at a time: each stream must end with its client (a
    stream holds one of the server's worker threads), the plugin keeps serving kubelet, leaks nothing."""
    kubelet, proc = plugin_world
    served(kubelet)
    fds, threads = usage(proc.proc.pid)
    socket = os.path.join(kubelet.directory, kubelet.registrations[-1].request.endpoint)
    for _ in range(5):
        clients = [subprocess.Popen([sys.executable, "-c", WATCH_CLIENT, socket], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True) for _ in range(3)]
        try:
            for c in clients:
                assert first_line(c, 20) == "2"
        finally:
            for c in clients:
                c.kill()
                c.wait(10)
        served(kubelet)
        time.sleep(1.2)  # one STREAM_TICK: the server notices the dead peers
    stream = kubelet.stream()
    start = len(stream.messages)
    fake_driver.inject_xid(1, 79)  # the health loop and kubelet's own stream still work
    stream.wait_for(lambda m: health(m)[1][1] == "Unhealthy", timeout=10, start=start)
    assert not stream.ended.is_set()
    now_fds, now_threads = usage(proc.proc.pid)
    assert now_fds <= fds + 8, f"descriptors grew from {fds} to {now_fds}"
    assert now_threads <= threads + 4, f"threads grew from {threads} to {now_threads}"
    assert proc.proc.poll() is None, proc.log()
