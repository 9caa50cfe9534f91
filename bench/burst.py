"""A burst of GPU container starts: 48 `runc run`s, 8 at a time, each in a fresh busybox rootfs with one GPU of
an 8-GPU simulated driver, with no hook, through `gpuhook service` ("service"), and with the native entry's
in-process fallback (nothing listening: "fallback"); with --nvidia-hook and --nvidia-config, also through NVIDIA's
legacy stack ("nvidia": nvidia-container-runtime-hook in front of nvidia-container-cli), side by side.

Per burst: the makespan (first start to last exit) and each start's wall time; overheads are against the no-hook
burst of the same round (bursts interleaved round by round). Also the CPU time a start costs (runc, its hooks and
everything they ran, from this process's reaped children; for "service", plus the service's own and its
children's, its warm workers still running included, ldconfig too): what a burst pays on a busy node. And the
resident memory of the service and of its workers.

The "nvidia" case runs NVIDIA's hook as its config FILE says, except that the driver root is this script's simulated
driver and kernel modules are never loaded (`load-kmods = false`: loading them makes device nodes under the host's
/dev); each of its starts must leave a libcuda mount point in the rootfs. With it, also lone starts
(one at a time, interleaved): no hook, through the service and through NVIDIA's hook, each with 1 GPU and with all
8 GPUs and every capability; and the ratio gpuhook-service / nvidia of every overhead, per round.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import tomlkit
from _common import (
    BenchError,
    fake_driver,
    interleaved,
    main_guard,
    need_root_and,
    paired,
    parse_args,
    percentile,
    print_table,
    row,
    workdir,
    write_json,
)
from _containers import (
    HOOK_ENV,
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
# What a host with the driver loaded has in every container's /proc and the simulated driver cannot give the kernel:
# /proc/driver/nvidia, where libnvidia-container mounts its tmpfs (it fails without). Only the "nvidia" case's
# containers get it: two tmpfs mounts more than the other cases' (tens of microseconds, charged to NVIDIA's case).
PROC_DRIVER = tuple({"destination": d, "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "noexec"]}
                    for d in ("/proc/driver", "/proc/driver/nvidia"))
OVER = ("makespan overhead (ms)", "p95 start overhead (ms)", "CPU per start over no hook (ms)")


def _cpu_children() -> float:
    times = os.times()
    return times.children_user + times.children_system


def _cpu_of(proc: psutil.Process | None) -> float:
    """CPU seconds of `proc` and everything under it: its own, its reaped children's, and those of the children
    still running (the service's warm workers live across bursts: what they spent so far counts)."""
    if proc is None:
        return 0.0
    try:
        t = proc.cpu_times()
        kids = proc.children()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system + t.children_user + t.children_system + sum(_cpu_of(kid) for kid in kids)


def burst(work: Path, template: Path, kind: str, hook: dict[str, object] | None, starts: int,
          service: psutil.Process | None) -> tuple[float, list[float], float]:
    """One burst: (makespan ms, each start's ms, CPU ms per start)."""
    bundles = []
    for n in range(starts):  # prepared before the clock starts: the burst is the starts alone
        bundle = work / f"burst-{kind}-{n}"
        rootfs = fresh_rootfs(template, bundle / "rootfs")
        make_bundle(bundle, rootfs, ["true"], env=ENV, hooks={"prestart": [hook]} if hook else None,
                    mounts=PROC_DRIVER if kind == "nvidia" else ())
        bundles.append(bundle)
    cpu_before = _cpu_children() + _cpu_of(service)
    begin = time.monotonic()
    with ThreadPoolExecutor(AT_ONCE) as pool:
        each = list(pool.map(lambda b: runc_run(b, unique_id(f"burst-{kind}")), bundles))
    makespan = (time.monotonic() - begin) * 1000
    cpu = (_cpu_children() + _cpu_of(service) - cpu_before) * 1000 / starts
    if kind == "nvidia":
        for bundle in bundles:
            check_nvidia_start(bundle / "rootfs")
    return makespan, each, cpu


def nvidia_config(user_config: Path, driver_root: Path, dest: Path) -> Path:
    """`user_config` (NVIDIA's config.toml) written to `dest` with the simulated driver as `[nvidia-container-cli]
    root` and `load-kmods = false`; BenchError naming the file if it is not TOML."""
    try:
        doc = tomlkit.parse(user_config.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"--nvidia-config {user_config}: {exc}; give NVIDIA's config.toml") from None
    cli = doc.setdefault("nvidia-container-cli", tomlkit.table())
    cli["root"] = str(driver_root)
    cli["load-kmods"] = False
    dest.write_text(tomlkit.dumps(doc))
    return dest


def nvidia_hook(hook: str, config: Path) -> dict[str, Any]:
    """NVIDIA's legacy prestart hook entry, as its packages register it, with an explicit config."""
    return {"path": hook, "args": ["nvidia-container-runtime-hook", "-config", str(config), "prestart"],
            "env": HOOK_ENV}


def check_nvidia_start(rootfs: Path) -> None:
    """BenchError unless NVIDIA's hook mounted the driver's libraries into `rootfs`: their mount points stay after
    the container exits (its /dev, a tmpfs, does not): libcuda in /usr/lib64, where libnvidia-container puts it
    on a rootfs without Debian's multiarch directory."""
    if not any((rootfs / "usr" / "lib64").glob("libcuda.so.*")):
        raise BenchError(f"NVIDIA's hook mounted no libcuda into {rootfs}: check --nvidia-config")


LONE_ROUNDS = 5  # lone starts are short and spread by runc's own 15-60 ms: five rounds per burst round
ALL_ENV = ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all"]
LONE = {"none": ENV, "service": ENV, "nvidia": ENV, "service, all GPUs": ALL_ENV, "nvidia, all GPUs": ALL_ENV}


def lone_starts(work: Path, template: Path, hooks: dict[str, dict[str, Any] | None], runs: int,
                seed: int) -> dict[str, list[float]]:
    """One `runc run` at a time per case, interleaved (none; service and nvidia with 1 GPU, and with all 8 GPUs and
    every capability): milliseconds per start."""
    def case(kind: str) -> Callable[[int], float]:
        hook = hooks[kind.partition(",")[0]]
        nvidia = kind.startswith("nvidia")

        def start(_round: int) -> float:
            bundle = work / f"lone-{kind.partition(',')[0]}"
            make_bundle(bundle, fresh_rootfs(template, bundle / "rootfs"), ["true"], env=LONE[kind],
                        hooks={"prestart": [hook]} if hook else None, mounts=PROC_DRIVER if nvidia else ())
            ms = runc_run(bundle, unique_id(f"lone-{kind.partition(',')[0]}"))
            if nvidia:
                check_nvidia_start(bundle / "rootfs")
            return ms

        return start

    return interleaved({kind: case(kind) for kind in LONE}, runs, warmup=1, seed=seed)


def bench(args: argparse.Namespace) -> None:
    need_root_and("runc")
    if (args.nvidia_hook is None) != (args.nvidia_config is None):
        raise BenchError("--nvidia-hook and --nvidia-config go together: give both or neither")
    load_before = list(os.getloadavg())
    starts = 16 if args.quick else STARTS
    kinds = (*KINDS, "nvidia") if args.nvidia_hook else KINDS
    with workdir("burst", args.keep, args.work_dir) as work:
        fake = fake_driver(work / "driver", GPUS)
        config = write_hook_config(work, fake.root)
        native, _script = install_native_entry(work / "bin" / "gpuhook-hook")
        sock = work / "run" / "service.sock"
        template = busybox_template(work / "busybox")
        hooks: dict[str, dict[str, object] | None] = {
            "none": None, "service": hook_entry(str(native), config, sock),
            "fallback": hook_entry(str(native), config, work / "none" / "service.sock")}
        if args.nvidia_hook:
            hooks["nvidia"] = nvidia_hook(args.nvidia_hook, nvidia_config(
                Path(args.nvidia_config), fake.root, work / "nvidia-config.toml"))
        running = start_service(sock, config, work / "service.err")
        lone: dict[str, list[float]] = {}
        try:
            service = psutil.Process(running.proc.pid)
            results: dict[str, list[tuple[float, list[float], float]]] = {k: [] for k in kinds}
            run_one: Callable[[str], None] = lambda kind: results[kind].append(  # noqa: E731
                burst(work, template, kind, hooks[kind], starts, service if kind == "service" else None))
            for kind in kinds:  # warm-up: page cache, the service's plan
                run_one(kind)
                results[kind].clear()
            for n in range(args.runs):
                for kind in (kinds if n % 2 == 0 else tuple(reversed(kinds))):
                    run_one(kind)
            if args.nvidia_hook:
                lone = lone_starts(work, template, hooks, LONE_ROUNDS * args.runs, args.seed)
            rss = service.memory_full_info()
            workers = [kid.memory_full_info() for kid in service.children()]
        finally:
            running.stop()
        log = (work / "gpuhook.log").read_text() if (work / "gpuhook.log").exists() else ""
        fell_back = log.count(f"by=in-process (service {sock} ")  # through the service, then left to the entry
        if "error:" in log:
            raise BenchError("a start failed: " + next(line for line in log.splitlines() if "error:" in line))
    rows = []
    over: dict[str, tuple[list[float], ...]] = {}
    for kind in kinds[1:]:
        base = results["none"]
        over[kind] = ([r[0] - b[0] for r, b in zip(results[kind], base)],
                      [percentile(r[1], 95) - percentile(b[1], 50) for r, b in zip(results[kind], base)],
                      [r[2] - b[2] for r, b in zip(results[kind], base)])
        rows += [row(f"{kind}: {what}", samples) for what, samples in zip(OVER, over[kind])]
    rows.append(row("none: makespan (ms)", [r[0] for r in results["none"]]))
    print_table(f"{starts} runc starts, {AT_ONCE} at a time, 1 GPU of {GPUS} ({args.runs} bursts per case)", rows)
    print(f"service resident memory: RSS {rss.rss / 2**20:.1f} MiB, USS {rss.uss / 2**20:.1f} MiB; its "
          f"{len(workers)} warm workers: PSS {sum(w.pss for w in workers) / 2**20:.1f} MiB, USS "
          f"{sum(w.uss for w in workers) / 2**20:.1f} MiB in all; "
          f"starts through the service that fell back in-process: {fell_back}")
    compared = []
    if args.nvidia_hook:
        lone_over = {kind: paired(lone, kind, "none") for kind in LONE if kind != "none"}
        compared = [row(f"lone start: {kind} overhead (ms)", lone_over[kind]) for kind in lone_over]
        compared.append(row("none: lone start (ms)", lone["none"]))
        for what, ours, theirs in [*zip(OVER, over["service"], over["nvidia"]),
                                   ("lone start overhead", lone_over["service"], lone_over["nvidia"]),
                                   ("lone start overhead, all GPUs", lone_over["service, all GPUs"],
                                    lone_over["nvidia, all GPUs"])]:
            compared.append(row(f"service as % of nvidia: {what.removesuffix(' (ms)')}",
                                [100 * a / b for a, b in zip(ours, theirs) if b > 0]))
        print_table(f"gpuhook service vs NVIDIA's legacy hook ({args.runs} rounds; the % rows are per-round ratios, "
                    "rounds where NVIDIA's overhead was not positive left out)", compared)
    write_json(args, {"starts": starts, "at_once": AT_ONCE, "rows": rows, "compared": compared,
                      "rss_mib": rss.rss / 2**20, "uss_mib": rss.uss / 2**20,
                      "workers": len(workers), "workers_pss_mib": sum(w.pss for w in workers) / 2**20,
                      "workers_uss_mib": sum(w.uss for w in workers) / 2**20, "fell_back": fell_back,
                      "nvidia_hook": args.nvidia_hook}, load_before)


def nvidia_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nvidia-hook", metavar="PATH",
                        help="NVIDIA's nvidia-container-runtime-hook: adds the case \"nvidia\" (legacy stack)")
    parser.add_argument("--nvidia-config", metavar="FILE",
                        help="the config.toml NVIDIA's hook gets (its nvidia-container-cli path and environment; "
                             "`root` and `load-kmods` are set by this script)")


if __name__ == "__main__":
    main_guard(bench, parse_args("burst", __doc__, nvidia_args))
