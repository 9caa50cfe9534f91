"""Load: 1,000 runc starts with the prestart hook, 50 at a time, GPU and non-GPU containers mixed.

Every start must succeed and see exactly what it asked for; afterwards the host's mount table, this
process's descriptors and its child processes are as before, runc knows no container, and the hook's log
has exactly one line per container. Marked `slow`; `.ci/run` runs it (a few minutes on two CPUs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from support import hostile
from support.runc import busybox_rootfs, make_bundle, runc_cmd, runc_run

from gpuhook.fakedriver import FakeDriver

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STARTS = 1000
PARALLEL = 50
CONTROL = ["nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]
# (env, the /dev/nvidia* names the container must see, whether the driver is mounted)
KINDS: list[tuple[list[str], list[str], bool]] = [
    ([], [], False),
    (["NVIDIA_VISIBLE_DEVICES=0"], sorted([*CONTROL, "nvidia0"]), True),
    (["NVIDIA_VISIBLE_DEVICES=1"], sorted([*CONTROL, "nvidia1"]), True),
    (["NVIDIA_VISIBLE_DEVICES=all"], sorted([*CONTROL, "nvidia0", "nvidia1"]), True),
    (["NVIDIA_VISIBLE_DEVICES=void"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=none"], CONTROL, True),
]
PROBE = ("echo NODES $(ls /dev | grep nvidia | sort | tr '\\n' ' '); "
         "echo DRIVER $(grep -c '/libcuda.so' /proc/self/mountinfo)")


def _of_the_service(proc: psutil.Process) -> bool:
    """A child of the session's `gpuhook service` (service mode): one of its warm workers, forked as starts need
    them and kept between starts (server.py), whose number changes with the load by design."""
    try:
        parent = proc.parent()
        argv = parent.cmdline() if parent is not None else []
    except psutil.Error:
        return False
    return "service" in argv and any(a.endswith("gpuhook") for a in argv)


def snapshot(*own: Path) -> dict[str, object]:
    """What this test's starts could leave behind: the mounts at or under its own paths and the host folders a
    start binds over (hostile.own_mounts), this process's descriptors and children."""
    me = psutil.Process()
    return {
        "mounts": hostile.own_mounts(*own),
        "fds": sorted(os.listdir("/proc/self/fd")),
        "children": sorted(p.pid for p in me.children(recursive=True) if not _of_the_service(p)),
    }


@pytest.fixture()
def e2e() -> None:
    hostile.need_hook_e2e()


def test_1000_starts_50_at_a_time(e2e: None, fake_driver: FakeDriver, tmp_path: Path) -> None:
    config = hostile.write_config(tmp_path, fake_driver.root)
    hooks = hostile.prestart_hooks(config)
    state = tmp_path / "runc-state"  # this test's own runc root: `runc list` there must end empty
    template = busybox_rootfs(tmp_path / "template")
    jobs = []
    for i in range(STARTS):
        env, nodes, driver = KINDS[i % len(KINDS)]
        bundle = tmp_path / f"c{i:03d}"
        shutil.copytree(template, bundle / "rootfs", symlinks=True, copy_function=os.link)  # the hook only adds
        make_bundle(bundle, bundle / "rootfs", ["sh", "-c", PROBE], env=env, hooks=hooks)
        jobs.append((f"load-{tmp_path.name[-8:]}-{i:03d}", bundle, nodes, driver))
    before = snapshot(tmp_path, fake_driver.root)

    def run(job: tuple[str, Path, list[str], bool]) -> tuple[str, subprocess.CompletedProcess[str], float]:
        cid, bundle, _, _ = job
        began = time.monotonic()
        result = runc_run(bundle, cid, timeout=120, root=str(state))
        return cid, result, time.monotonic() - began

    began = time.monotonic()
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(run, jobs))
    elapsed = time.monotonic() - began

    failures = [(cid, r.stderr.strip()[-300:]) for cid, r, _ in results if r.returncode != 0]
    assert failures == [], f"{len(failures)} of {STARTS} starts failed: {failures[:3]}"
    for (cid, result, _), (_, _, nodes, driver) in zip(results, jobs):
        lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in result.stdout.splitlines())
        assert lines["NODES"].split() == nodes, (cid, result.stdout)
        assert (int(lines["DRIVER"]) > 0) == driver, (cid, result.stdout)

    listed = subprocess.run(runc_cmd("list", "-q", root=str(state)), capture_output=True, text=True, check=True)
    assert listed.stdout.split() == []
    assert snapshot(tmp_path, fake_driver.root) == before
    assert hostile.kill_leftovers(str(config)) == [], "hook processes outlived their containers"

    log = hostile.log_lines(tmp_path)
    ids = [line.split()[1] for line in log]
    assert sorted(ids) == sorted(cid for cid, _, _, _ in jobs), "not exactly one log line per container"
    for line, (_cid, _, _, driver) in zip(sorted(log, key=lambda x: x.split()[1]), sorted(jobs)):
        assert (" inject " in line if driver else " skip " in line), line
    slowest = max(t for _, _, t in results)
    print(f"\n{STARTS} starts, {PARALLEL} at a time: {elapsed:.1f}s ({STARTS / elapsed:.1f}/s), slowest {slowest:.1f}s")
