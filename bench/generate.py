"""`gpuhook generate-cdi` wall time and peak memory on simulated drivers: 1 GPU, 4 GPUs with one in MIG mode,
8 GPUs, 8 GPUs x 7 MIG; each cold (discovery every run), with the inventory cache the first round wrote, and
answered by a running `gpuhook service` (the console script asks it first; same cache), and the same
asked by the native entry `gpuhook hook install` writes (`gpuhook-hook generate-cdi …`, no interpreter at all);
plus `python -c pass` of the console script's interpreter, the floor of any Python command here.

Runs the installed `gpuhook` command (what a boot-time unit runs), writing the spec to a file, every case
interleaved round by round, each started from a small resident spawner (_common.Spawner), so that its
ru_maxrss (os.wait4) is its own peak memory and not this script's.
Targets: <= 40 ms for 4 GPUs with one in MIG mode (cached), and at most 1.5x growth from there to
8 GPUs x 7 MIG devices; <= 60 ms without the service (cold) and <= 20 ms with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from _common import (
    BenchError,
    Spawner,
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
from _containers import install_native_entry, start_service

TARGET_4MIG = 40.0  # 4 GPUs, one in MIG mode
TARGET_COLD, TARGET_SERVICE = 60.0, 20.0  # without the service (no cache), through it
MAX_GROWTH = 1.5  # from that to 8 GPUs x 7 MIG
WARMUP = 1
CACHED, SERVED, NATIVE = "+cache", "+service", "+native"
VARIANTS = ("", CACHED, SERVED, NATIVE)
DRIVERS: dict[str, tuple[str, int, dict[int, list[str]] | None]] = {
    "1gpu": ("1 GPU", 1, None),
    "4gpu1mig": ("4 GPUs, GPU 0 in MIG mode (7 x 1g.10gb)", 4, {0: ["1g.10gb"] * 7}),
    "8gpu": ("8 GPUs", 8, None),
    "8x7mig": ("8 GPUs x 7 MIG (1g.10gb)", 8, {g: ["1g.10gb"] * 7 for g in range(8)}),
}


def run_once(spawner: Spawner, argv: list[str], err_path: Path, env: dict[str, str]) -> tuple[float, int]:
    """(wall ms, peak RSS KiB) of one run, started from the small spawner (its RSS, not this script's, is the
    floor of ru_maxrss); BenchError when it fails."""
    ms, status, peak = spawner.run(argv, {**os.environ, **env}, err_path)
    if status != 0:
        raise BenchError(f"{' '.join(argv[:3])} failed ({status}): {err_path.read_text().strip()[-600:]}")
    return ms, peak


def bench(args: argparse.Namespace) -> None:
    need_root_and()
    load_before = list(os.getloadavg())
    rss: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    spawner = Spawner()
    with workdir("gen", args.keep, args.work_dir) as work, contextlib.closing(spawner):
        sock = work / "run" / "service.sock"

        def case(name: str, argv: list[str], env: dict[str, str]) -> Callable[[int], float]:
            """One interleaved case: its wall time per round, its peak RSS kept past the warm-up."""
            rss[name] = []

            def start(round_: int) -> float:
                ms, peak = run_once(spawner, argv, work / f"{name}.err", env)
                if round_ >= WARMUP:
                    rss[name].append(peak / 1024)
                return ms

            return start

        nowhere = {"GPUHOOK_SERVICE_SOCKET": str(work / "none" / "service.sock")}
        native = str(install_native_entry(work / "bin" / "gpuhook-hook")[0])
        cases: dict[str, Callable[[int], float]] = {}
        for driver, (_label, gpus, mig) in DRIVERS.items():
            fake = fake_driver(work / driver, gpus, mig)
            for variant in VARIANTS:
                name = f"{driver}{variant}"
                out = work / f"{name}.yaml"
                # cold: discovery every time; cached and served: the inventory cache the first (warm-up) round wrote
                cache = str(work / f"{driver}.inventory.json") if variant else ""
                command = [native] if variant == NATIVE else gpuhook_command()
                argv = [*command, "generate-cdi", "--driver-root", str(fake.root), "--proc-root",
                        str(fake.root / "proc"), "--hook-path", "/usr/local/bin/gpuhook-hook", "--output", str(out),
                        "--inventory-cache", cache]
                env = {"GPUHOOK_SERVICE_SOCKET": str(sock)} if variant in (SERVED, NATIVE) else nowhere
                cases[name] = case(name, argv, env)
        python = [str(Path(gpuhook_command()[0]).with_name("python3")), "-c", "pass"]
        cases["python"] = case("python", python, nowhere)
        cases["true"] = case("true", ["/bin/true"], nowhere)
        service = start_service(sock, None, work / "service.err")
        try:
            samples = interleaved(cases, args.runs, warmup=WARMUP, seed=args.seed)
        finally:
            service.stop()
        for name in DRIVERS:
            counts[name] = (work / f"{name}.yaml").read_text().count("\n- name: ")
            for variant in (CACHED, SERVED, NATIVE):
                if (work / f"{name}{variant}.yaml").read_bytes() != (work / f"{name}.yaml").read_bytes():
                    raise BenchError(f"{name}{variant}: another spec than the cold run's")

    targets = {"4gpu1mig" + CACHED: TARGET_4MIG}
    for driver in DRIVERS:
        targets.update({driver: TARGET_COLD, driver + SERVED: TARGET_SERVICE, driver + NATIVE: TARGET_SERVICE})
    notes = {"": "", CACHED: ", inventory cache", SERVED: ", through gpuhook service",
             NATIVE: ", native entry through gpuhook service"}
    names = [f"{d}{v}" for d in DRIVERS for v in VARIANTS]

    def peak(name: str) -> float:
        return round(statistics.median(rss[name]), 1)

    rows = [row(f"{label}: {counts[driver]} spec devices{notes[variant]}", samples[f"{driver}{variant}"],
                targets.get(f"{driver}{variant}"), peak_rss_mib=peak(f"{driver}{variant}"))
            for driver, (label, _g, _m) in DRIVERS.items() for variant in VARIANTS]
    rows.append(row("python3 -c pass (the interpreter alone)", samples["python"], peak_rss_mib=peak("python")))
    rows.append(row("/bin/true (the spawner alone: the floor of peak_rss_mib)", samples["true"],
                    peak_rss_mib=peak("true")))
    by_name = dict(zip(names, rows, strict=False))
    growth = by_name[f"8x7mig{CACHED}"]["median"] / by_name[f"4gpu1mig{CACHED}"]["median"]
    print_table("gpuhook generate-cdi wall time", rows, ["peak_rss_mib"])
    print(f"growth 4 GPUs (1 MIG) -> 8 GPUs x 7 MIG, cached: {growth:.2f}x (target <= {MAX_GROWTH}x: "
          f"{'yes' if growth <= MAX_GROWTH else 'NO'})")
    write_json(args, {"rows": rows, "growth": {"value": growth, "target": MAX_GROWTH, "met": growth <= MAX_GROWTH}},
               load_before)


if __name__ == "__main__":
    main_guard(bench, parse_args("generate", __doc__))
