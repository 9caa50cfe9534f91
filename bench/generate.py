"""`gpuhook generate-cdi` wall time and peak memory on simulated drivers of 1 GPU, 8 GPUs and 8 GPUs x 7 MIG.

Runs the installed `gpuhook` command (what a boot-time unit runs), writing the spec to a file, the three
drivers interleaved round by round. Peak memory is the child's own ru_maxrss (os.wait4), not this process's.
Targets (issue 7): <= 100 ms for 8 GPUs, and at most 2x growth from 1 GPU to 8 GPUs x 7 MIG devices.
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
    rss: dict[str, list[float]] = {name: [] for name in DRIVERS}
    counts: dict[str, int] = {}
    with workdir("gen", args.keep) as work:
        cases: dict[str, Callable[[int], float]] = {}
        for name, (_label, gpus, mig) in DRIVERS.items():
            fake = fake_driver(work / name, gpus, mig)
            out = work / f"{name}.yaml"
            argv = [*gpuhook_command(), "generate-cdi", "--driver-root", str(fake.root), "--proc-root",
                    str(fake.root / "proc"), "--hook-path", "/usr/local/bin/gpuhook-hook", "--output", str(out)]

            def start(round_: int, argv: list[str] = argv, name: str = name) -> float:
                ms, peak = run_once(argv, work / f"{name}.err")
                if round_ >= WARMUP:
                    rss[name].append(peak / 1024)
                return ms

            cases[name] = start
        samples = interleaved(cases, args.runs, warmup=WARMUP, seed=args.seed)
        for name in DRIVERS:
            counts[name] = (work / f"{name}.yaml").read_text().count("\n- name: ")

    rows = [row(f"{label}: {counts[name]} spec devices", samples[name],
                TARGET_4MIG if name == "4gpu1mig" else None, peak_rss_mib=round(statistics.median(rss[name]), 1))
            for name, (label, _g, _m) in DRIVERS.items()]
    growth = rows[3]["median"] / rows[1]["median"]
    print_table("gpuhook generate-cdi wall time", rows, ["peak_rss_mib"])
    print(f"growth 4 GPUs (1 MIG) -> 8 GPUs x 7 MIG: {growth:.2f}x (target <= {MAX_GROWTH}x: "
          f"{'yes' if growth <= MAX_GROWTH else 'NO'})")
    write_json(args, {"rows": rows, "growth": {"value": growth, "target": MAX_GROWTH, "met": growth <= MAX_GROWTH}},
               load_before)


if __name__ == "__main__":
    main_guard(bench, parse_args("generate", __doc__))
