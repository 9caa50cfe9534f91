"""`gpuhook generate-cdi --watch`: the spec follows GPU and MIG changes of a simulated driver, is replaced
atomically (it exists at every instant) and the watcher stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fakefix import FAKE_MIG_LAYOUT

from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.watch import SpecWatcher, usable_devices, watched_dirs
from gpuhook.discover import Roots
from gpuhook.model.inventory import Inventory

HOOK = "/opt/gpuhook/bin/gpuhook"


class Presence:
    """Polls a path in a thread for as long as it runs and counts the instants it was missing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.missing = 0
        self.checks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.checks += 1
            if not os.path.exists(self.path):
                self.missing += 1

    def __enter__(self) -> Presence:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def names(spec_path: Path) -> set[str]:
    try:
        spec = yaml.safe_load(spec_path.read_text())
    except (OSError, yaml.YAMLError):
        return set()
    return {d["name"] for d in (spec or {}).get("devices", [])}


@pytest.fixture()
def watcher(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[str], Path]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(root: Path, *extra: str, poll: float = 60) -> tuple[subprocess.Popen[str], Path]:
        out = tmp_path / "cdi" / "nvidia.yaml"
        cmd = [sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--watch", "--poll-interval", str(poll),
               "--driver-root", str(root), "--proc-root", str(root / "proc"), "--hook-path", HOOK,
               "--output", str(out), *extra]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        wait_for(lambda: bool(names(out)), 20, "the first spec")
        return proc, out

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_gpu_node_removed_and_back(watcher: Any, fake_driver_factory: Any) -> None:
    """A long poll interval: inotify on the dev dir is what notices, within a few seconds."""
    fake = fake_driver_factory(gpus=2, fresh=True)
    proc, out = watcher(fake.root)
    gone = fake.gpus[1]
    assert {"0", "1", gone.uuid, "all"} <= names(out)
    node = fake.host_path(gone.node_path)
    with Presence(out) as presence:
        os.unlink(node)
        wait_for(lambda: "1" not in names(out), 30, "GPU 1 to leave the spec")
        assert names(out) == {"0", fake.gpus[0].uuid, "all"}
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, gone.minor))
        wait_for(lambda: gone.uuid in names(out), 30, "GPU 1 to come back")
    assert presence.checks > 100 and presence.missing == 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
    err = proc.stderr.read() if proc.stderr else ""
    assert "stopped" in err and err.count("wrote ") == 3, err
    assert [p.name for p in out.parent.iterdir()] == ["nvidia.yaml"]  # no temp file left behind


def test_mig_layout_change(watcher: Any, fake_driver_factory: Any) -> None:
    """A GPU instance destroyed: its proc capability directory and cap nodes go away. procfs discovery, because
    the simulated NVML library has its MIG table compiled in."""
    fake = fake_driver_factory(gpus=4, mig=FAKE_MIG_LAYOUT, fresh=True)
    proc, out = watcher(fake.root, "--discovery", "procfs")
    migs = fake.gpus[1].mig_devices
    assert {"1:0", "1:1", "1:2"} <= names(out)
    victim = migs[-1]
    with Presence(out) as presence:
        shutil.rmtree(fake.host_path(os.path.dirname(victim.gi_access)))
        for cap in victim.cap_nodes:
            os.unlink(fake.host_path(cap))
        wait_for(lambda: "1:2" not in names(out), 5, "the destroyed MIG device to leave the spec")
    assert presence.missing == 0
    text = out.read_text()
    assert all(cap not in text for cap in victim.cap_nodes)
    assert {"1:0", "1:1"} <= names(out)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=5) == 0


def test_poll_alone_notices(tmp_path: Path, fake_driver_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without inotify (procfs sends no events; a kernel may lack inotify) the slow poll finds the change."""
    import gpuhook.cdi.watch as watch_mod

    monkeypatch.setattr(watch_mod.Inotify, "available", property(lambda self: False))
    fake = fake_driver_factory(gpus=2, fresh=True)
    roots = Roots.make(str(fake.root), proc_root=str(fake.root / "proc"))
    out = tmp_path / "spec.txt"
    logs: list[str] = []
    w = SpecWatcher(roots, str(out), lambda inv, devices: f"{len(devices)}\n", poll_interval=0.2, log=logs.append)

    def change_then_stop() -> None:
        wait_for(out.exists, 10, "the first spec")
        os.unlink(fake.host_path(fake.gpus[1].node_path))
        try:
            wait_for(lambda: out.read_text() == "1\n", 5, "the poll")
        finally:
            w.stop()

    helper = threading.Thread(target=change_then_stop)
    helper.start()
    assert w.run() == 0  # in the main thread: it installs the signal handlers
    helper.join()
    assert out.read_text() == "1\n"
    assert "poll only" in logs[0] and logs[-1] == "stopped"


def test_refresh_writes_only_on_change_and_keeps_the_spec_on_failure(tmp_path: Path, fake_driver: Any) -> None:
    roots = Roots.make(str(fake_driver.root), proc_root=str(fake_driver.root / "proc"))
    out = tmp_path / "spec.yaml"
    logs: list[str] = []
    fail = {"on": False}

    def render(inv: Inventory, devices: list[Any]) -> str:
        if fail["on"]:
            raise CdiError("boom")
        return f"driver {inv.driver_version} devices {len(devices)}\n"

    w = SpecWatcher(roots, str(out), render, log=logs.append)
    assert w.refresh() is True
    assert out.read_text() == "driver 550.54.15 devices 2\n"
    inode = out.stat().st_ino
    assert w.refresh() is False and w.refresh(force=True) is False  # same fingerprint / same text: no rewrite
    assert out.stat().st_ino == inode
    fail["on"] = True
    assert w.refresh(force=True) is False and w.refresh(force=True) is False
    assert out.read_text() == "driver 550.54.15 devices 2\n"
    assert sum("kept the previous spec" in line and "boom" in line for line in logs) == 1  # said once


def test_watched_dirs_cover_dev_caps_and_mig(fake_driver_mig: Any) -> None:
    roots = Roots.make(str(fake_driver_mig.root), proc_root=str(fake_driver_mig.root / "proc"))
    dirs = watched_dirs(roots)
    root = str(fake_driver_mig.root)
    assert f"{root}/dev" in dirs and f"{root}/dev/nvidia-caps" in dirs
    assert f"{root}/proc/driver/nvidia/gpus" in dirs
    gi_dir = os.path.dirname(str(fake_driver_mig.host_path(fake_driver_mig.mig_devices[0].gi_access)))
    assert gi_dir in dirs


def test_usable_devices_leave_out_a_gpu_without_node(fake_driver: Any) -> None:
    from gpuhook.discover import discover

    inv = discover(Roots.make(str(fake_driver.root), proc_root=str(fake_driver.root / "proc")))
    kept, notes = usable_devices(inv)
    assert len(kept) == 2 and notes == []
    from gpuhook.model import record

    inv.gpus[1] = record.replace(inv.gpus[1], node=None)
    kept, notes = usable_devices(inv)
    assert [d.index for d in kept] == [0] and "GPU 1 has no device node" in notes[0]


def test_watch_needs_output() -> None:
    result = subprocess.run([sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--watch", "--hook-path", HOOK],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "--watch needs --output" in result.stderr


def test_systemd_unit_runs_the_watcher() -> None:
    """The unit's ExecStart is a valid `gpuhook generate-cdi --watch` command line writing into /var/run/cdi."""
    import shlex

    from gpuhook.cli.cdi import generate_cdi

    unit = Path(__file__).parents[1] / "runtime-config/systemd/gpuhook-cdi-refresh.service"
    lines = dict(line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line and line[:1].isalpha())
    argv = shlex.split(lines["ExecStart"])
    assert argv[:2] == ["/usr/local/bin/gpuhook", "generate-cdi"] and "--watch" in argv
    ctx = generate_cdi.make_context("generate-cdi", argv[2:])
    assert ctx.params["watch"] and ctx.params["output"].startswith("/var/run/cdi/")
    assert ctx.params["output"].endswith(".yaml")
    assert lines["KillSignal"] == "SIGTERM" and lines["Type"] == "simple"
