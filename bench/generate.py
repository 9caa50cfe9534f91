"""`gpuhook generate-cdi` wall time and peak memory on simulated drivers: 1 GPU, 4 GPUs with one in MIG mode,
8 GPUs, 8 GPUs x 7 MIG; each cold (discovery every run) and with the inventory cache the first round wrote.

Runs the installed `gpuhook` command (what a boot-time unit runs), writing the spec to a file, every case
interleaved round by round. Peak memory is the child's own ru_maxrss (os.wait4), not this process's.
Targets (issue 14): <= 40 ms for 4 GPUs with one in MIG mode (cached), and at most 1.5x growth from there to
8 GPUs x 7 MIG devices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from _common import (
    BenchError,
    fake_driver,
    gpuhook_command,
    interleaved,
    main_guard,
    need_root_and,
    parse_args,
    print_table,
    row,
    workdir,
    write_json,
)

TARGET_4MIG = 40.0  # issue 14: 4 GPUs, one in MIG mode
MAX_GROWTH = 1.5  # from that to 8 GPUs x 7 MIG
WARMUP = 1
CACHED = "+cache"
DRIVERS: dict[str, tuple[str, int, dict[int, list[str]] | None]] = {
    "1gpu": ("1 GPU", 1, None),
    "4gpu1mig": ("4 GPUs, GPU 0 in MIG mode (7 x 1g.10gb)", 4, {0: ["1g.10gb"] * 7}),
    "8gpu": ("8 GPUs", 8, None),
    "8x7mig": ("8 GPUs x 7 MIG (1g.10gb)", 8, {g: ["1g.10gb"] * 7 for g in range(8)}),
}


def run_once(argv: list[str], err_path: Path) -> tuple[float, int]:
    """(wall ms, peak RSS KiB) of one child; BenchError when it fails."""
    with open(err_path, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        ms = (time.perf_counter() - start) * 1000
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv[:3])} failed ({proc.returncode}): {err_path.read_text().strip()[-600:]}")
    return ms, usage.ru_maxrss


def bench(args: argparse.Namespace) -> None:
    need_root_and()
    load_before = list(os.getloadavg())
    rss: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    with workdir("gen", args.keep) as work:
        cases: dict[str, Callable[[int], float]] = {}
        for driver, (_label, gpus, mig) in DRIVERS.items():
            fake = fake_driver(work / driver, gpus, mig)
            for cached in (False, True):
                name = f"{driver}{CACHED if cached else ''}"
                rss[name] = []
                out = work / f"{name}.yaml"
                # cold: discovery every time; cached: the inventory cache the first (warm-up) round wrote
                cache = str(work / f"{driver}.inventory.json") if cached else ""
                argv = [*gpuhook_command(), "generate-cdi", "--driver-root", str(fake.root), "--proc-root",
                        str(fake.root / "proc"), "--hook-path", "/usr/local/bin/gpuhook-hook", "--output", str(out),
                        "--inventory-cache", cache]

                def start(round_: int, argv: list[str] = argv, name: str = name) -> float:
                    ms, peak = run_once(argv, work / f"{name}.err")
                    if round_ >= WARMUP:
                        rss[name].append(peak / 1024)
                    return ms

                cases[name] = start
        samples = interleaved(cases, args.runs, warmup=WARMUP, seed=args.seed)
        for name in DRIVERS:
            counts[name] = (work / f"{name}.yaml").read_text().count("\n- name: ")

    rows = [row(f"{label}: {counts[driver]} spec devices{', inventory cache' if name.endswith(CACHED) else ''}",
                samples[name], TARGET_4MIG if name == f"4gpu1mig{CACHED}" else None,
                peak_rss_mib=round(statistics.median(rss[name]), 1))
            for driver, (label, _g, _m) in DRIVERS.items() for name in (driver, f"{driver}{CACHED}")]
    by_name = {name: r for name, r in zip([n for d in DRIVERS for n in (d, f"{d}{CACHED}")], rows, strict=True)}
    growth = by_name[f"8x7mig{CACHED}"]["median"] / by_name[f"4gpu1mig{CACHED}"]["median"]
    print_table("gpuhook generate-cdi wall time", rows, ["peak_rss_mib"])
    print(f"growth 4 GPUs (1 MIG) -> 8 GPUs x 7 MIG, cached: {growth:.2f}x (target <= {MAX_GROWTH}x: "
          f"{'yes' if growth <= MAX_GROWTH else 'NO'})")
    write_json(args, {"rows": rows, "growth": {"value": growth, "target": MAX_GROWTH, "met": growth <= MAX_GROWTH}},
               load_before)


if __name__ == "__main__":
    main_guard(bench, parse_args("generate", __doc__))
