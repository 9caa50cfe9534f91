"""The DRA driver: start -> ResourceSlice published, NodePrepareResources for 1 and 8 GPUs, resident memory.

`gpuhook dra-plugin` runs as a subprocess on an 8-GPU simulated driver against the recorded API server of the
tests (tests/support/apireplay.py: responses recorded from a real kube-apiserver 1.34, served on 127.0.0.1).
Start -> published: a fresh process each round, from spawn to the ResourceSlice's POST arriving at the server
(discovery, slice building, the client's import and connection included). Prepare: the kubelet's call over the
driver's unix socket for a claim not prepared before (the claim read from the server, the checks, the CDI spec
written, the checkpoint written: all of it), one claim of 1 GPU and one of 8, then the repeated prepare the
kubelet makes after its restart (answered from the checkpoint); each claim is unprepared after it is measured
(not timed). Resident memory after the calls. Target (the issue): NodePrepareResources <= 20 ms, the claim read
included.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    BenchError,
    fake_driver,
    gpuhook_command,
    main_guard,
    need_root_and,
    parse_args,
    print_table,
    row,
    workdir,
    write_json,
)

TESTS = Path(__file__).resolve().parent.parent / "tests"
GPUS = 8
PREPARE_MS = 20.0
CALLS, QUICK_CALLS = 100, 10
STARTS, QUICK_STARTS = 10, 3
NODE = "node1"  # the recorded node
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def _claim(template: dict, name: str, uid: str, gpus: int) -> dict:
    claim = copy.deepcopy(template)
    claim["metadata"].update(name=name, uid=uid)
    claim["status"]["allocation"]["devices"]["results"] = [
        {"request": "gpus", "driver": "gpu.nvidia.com", "pool": NODE, "device": f"gpu-{i}"} for i in range(gpus)]
    claim["status"]["allocation"]["devices"]["config"] = []  # time-slicing would time NVML's child, not prepare
    return claim


def _wait(predicate, what: str, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise BenchError(f"the driver exited ({proc.returncode}) before {what}: {log.read_text()[-800:]}")
        if time.monotonic() > deadline:
            raise BenchError(f"timed out waiting for {what}; driver log: {log}")
        time.sleep(0.002)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise BenchError(f"no VmRSS for pid {pid}")


def bench(args: argparse.Namespace) -> None:
    need_root_and()
    sys.path.insert(1, str(TESTS))
    from support.apireplay import ApiReplay, recorded
    from support.drakubelet import DraKubelet

    load_before = list(os.getloadavg())
    calls = QUICK_CALLS if args.quick else CALLS
    template = recorded("claim-allocated")["body"]
    with workdir("dra", args.keep, args.work_dir) as work, ApiReplay().serve() as api:
        fake = fake_driver(work / "driver", GPUS)
        api.add("node")
        api.add("slices-none", path="/apis/resource.k8s.io/v1/resourceslices")
        api.add("slice-created")
        names = {1: [f"one-{n}" for n in range(calls)], GPUS: [f"eight-{n}" for n in range(calls)]}
        for gpus, claim_names in names.items():
            for n, name in enumerate(claim_names):
                uid = f"00000000-0000-0000-{gpus:04d}-{n:012d}"
                api.add("claim-allocated", body=_claim(template, name, uid, gpus), path=f"{CLAIMS}/{name}")

        def argv(kdir: Path) -> list[str]:
            return [*gpuhook_command(), "dra-plugin", "--driver-root", str(fake.root), "--node-name", NODE,
                    "--kubelet-dir", str(kdir), "--cdi-dir", str(work / "cdi"), "--api-server", api.url,
                    "--hook-path", "/usr/local/bin/gpuhook", "--log-level", "warning",
                    "--inventory-cache", str(work / "inventory.json")]  # fmt: skip

        starts = []
        for n in range(QUICK_STARTS if args.quick else STARTS):
            kdir = work / f"kubelet-start-{n}"
            posts = len(api.requests("POST", "/apis/resource.k8s.io/v1/resourceslices"))
            log = work / f"start-{n}.log"
            started = time.perf_counter()
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv(kdir), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            try:
                _wait(lambda: len(api.requests("POST", "/apis/resource.k8s.io/v1/resourceslices")) > posts,  # noqa: B023
                      "the ResourceSlice's POST", proc, log)  # noqa: B023
                starts.append((time.perf_counter() - started) * 1000)
            finally:
                _stop(proc)
            shutil.rmtree(kdir, ignore_errors=True)

        kdir = work / "kubelet"
        log = work / "driver.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv(kdir), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        kubelet = DraKubelet(str(kdir))
        try:
            kubelet.register()
            rows_prepare = {}
            repeat: list[float] = []
            for gpus, claim_names in names.items():
                samples = []
                for n, name in enumerate(claim_names):
                    uid = f"00000000-0000-0000-{gpus:04d}-{n:012d}"
                    start = time.perf_counter()
                    answer = kubelet.prepare(("default", uid, name)).claims[uid]
                    samples.append((time.perf_counter() - start) * 1000)
                    if answer.error or len(answer.devices) != gpus:
                        raise BenchError(f"prepare {name}: {answer.error or answer}")
                    if gpus == GPUS:
                        start = time.perf_counter()
                        kubelet.prepare(("default", uid, name))
                        repeat.append((time.perf_counter() - start) * 1000)
                    kubelet.unprepare(("default", uid, name))
                rows_prepare[gpus] = samples
            rss_mb = _resident_mb(proc.pid)
        finally:
            kubelet.close()
            _stop(proc)
    rows = [
        row("start -> ResourceSlice published (fresh process)", starts),
        row("NodePrepareResources, 1 GPU (claim read, spec, checkpoint)", rows_prepare[1][1:], PREPARE_MS),
        row(f"NodePrepareResources, {GPUS} GPUs (claim read, spec, checkpoint)", rows_prepare[GPUS][1:], PREPARE_MS),
        row(f"NodePrepareResources again, {GPUS} GPUs (from the checkpoint)", repeat),
        row("resident set after the calls (MB)", [rss_mb]),
    ]
    print_table(f"DRA driver on {GPUS} simulated GPUs, recorded API server ({calls} claims per case, the first "
                "of each left out as warm-up)", rows)
    write_json(args, {"gpus": GPUS, "calls": calls, "rows": rows}, load_before)


if __name__ == "__main__":
    main_guard(bench, parse_args("dra", __doc__))
