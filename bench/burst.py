"""A burst of GPU container starts: 48 `runc run`s, 8 at a time, each in a fresh busybox rootfs with one GPU of
an 8-GPU simulated driver, with no hook, through `gpuhook service` ("service"), and with the native entry's
in-process fallback (nothing listening: "fallback").

Per burst: the makespan (first start to last exit) and each start's wall time; overheads are against the no-hook
burst of the same round (bursts interleaved round by round). Also the CPU time a start costs (runc, its hooks and
everything they ran, from this process's reaped children; for "service", plus the service's own and its
children's, ldconfig included): what a burst pays on a busy node. And the service's resident memory.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from _common import (
    BenchError,
    fake_driver,
    main_guard,
    need_root_and,
    parse_args,
    percentile,
    print_table,
    row,
    workdir,
    write_json,
)
from _containers import (
    busybox_template,
    fresh_rootfs,
    hook_entry,
    install_native_entry,
    make_bundle,
    runc_run,
    start_service,
    unique_id,
    write_hook_config,
)

STARTS, AT_ONCE, GPUS = 48, 8, 8
ENV = ["NVIDIA_VISIBLE_DEVICES=0"]
KINDS = ("none", "service", "fallback")


def _cpu_children() -> float:
    times = os.times()
    return times.children_user + times.children_system


def _cpu_of(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def burst(work: Path, template: Path, kind: str, hook: dict[str, object] | None, starts: int,
          service: psutil.Process | None) -> tuple[float, list[float], float]:
    """One burst: (makespan ms, each start's ms, CPU ms per start)."""
    bundles = []
    for n in range(starts):  # prepared before the clock starts: the burst is the starts alone
        bundle = work / f"burst-{kind}-{n}"
        rootfs = fresh_rootfs(template, bundle / "rootfs")
        make_bundle(bundle, rootfs, ["true"], env=ENV, hooks={"prestart": [hook]} if hook else None)
        bundles.append(bundle)
    cpu_before = _cpu_children() + _cpu_of(service)
    begin = time.monotonic()
    with ThreadPoolExecutor(AT_ONCE) as pool:
        each = list(pool.map(lambda b: runc_run(b, unique_id(f"burst-{kind}")), bundles))
    makespan = (time.monotonic() - begin) * 1000
    cpu = (_cpu_children() + _cpu_of(service) - cpu_before) * 1000 / starts
    return makespan, each, cpu


def bench(args: argparse.Namespace) -> None:
    need_root_and("runc")
    load_before = list(os.getloadavg())
    starts = 16 if args.quick else STARTS
    with workdir("burst", args.keep, args.work_dir) as work:
        fake = fake_driver(work / "driver", GPUS)
        config = write_hook_config(work, fake.root)
        native, _script = install_native_entry(work / "bin" / "gpuhook-hook")
        sock = work / "run" / "service.sock"
        template = busybox_template(work / "busybox")
        hooks: dict[str, dict[str, object] | None] = {
            "none": None, "service": hook_entry(str(native), config, sock),
            "fallback": hook_entry(str(native), config, work / "none" / "service.sock")}
        running = start_service(sock, config, work / "service.err")
        try:
            service = psutil.Process(running.proc.pid)
            results: dict[str, list[tuple[float, list[float], float]]] = {k: [] for k in KINDS}
            run_one: Callable[[str], None] = lambda kind: results[kind].append(  # noqa: E731
                burst(work, template, kind, hooks[kind], starts, service if kind == "service" else None))
            for kind in KINDS:  # warm-up: page cache, the service's plan
                run_one(kind)
                results[kind].clear()
            for n in range(args.runs):
                for kind in (KINDS if n % 2 == 0 else tuple(reversed(KINDS))):
                    run_one(kind)
            rss = service.memory_full_info()
        finally:
            running.stop()
        log = (work / "gpuhook.log").read_text() if (work / "gpuhook.log").exists() else ""
        fell_back = log.count(f"by=in-process (service {sock} ")  # through the service, then left to the entry
        if "error:" in log:
            raise BenchError("a start failed: " + next(line for line in log.splitlines() if "error:" in line))
    rows = []
    for kind in ("service", "fallback"):
        over_makespan = [r[0] - base[0] for r, base in zip(results[kind], results["none"])]
        p95_over = [percentile(r[1], 95) - percentile(base[1], 50) for r, base in zip(results[kind], results["none"])]
        cpu_over = [r[2] - base[2] for r, base in zip(results[kind], results["none"])]
        rows += [row(f"{kind}: makespan overhead (ms)", over_makespan),
                 row(f"{kind}: p95 start overhead (ms)", p95_over),
                 row(f"{kind}: CPU per start over no hook (ms)", cpu_over)]
    rows.append(row("none: makespan (ms)", [r[0] for r in results["none"]]))
    print_table(f"{starts} runc starts, {AT_ONCE} at a time, 1 GPU of {GPUS} ({args.runs} bursts per case)", rows)
    print(f"service resident memory: RSS {rss.rss / 2**20:.1f} MiB, USS {rss.uss / 2**20:.1f} MiB; "
          f"starts through the service that fell back in-process: {fell_back}")
    write_json(args, {"starts": starts, "at_once": AT_ONCE, "rows": rows, "rss_mib": rss.rss / 2**20,
                      "uss_mib": rss.uss / 2**20, "fell_back": fell_back}, load_before)


if __name__ == "__main__":
    main_guard(bench, parse_args("burst", __doc__))
