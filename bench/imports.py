"""`python -X importtime` of the hook's paths: what each container start imports, and what that costs.

Paths, each run through the lean entry script (`gpuhook hook install`, python -IS) on a simulated 8-GPU driver:
the prestart hook for a container without a GPU request; for 1 GPU with a warm inventory cache (under runc,
so the whole injection runs); for 1 GPU with no cache (discovery, hence NVML: pynvml is expected there); and
the CDI spec's two createContainer hooks. Reported, without asserting anything: total import time, module
count, the 10 modules with the largest own import time, and which of yaml, jsonschema, click, grpc and pynvml
(none belongs on a path with a fresh cache) were imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from _common import (
    BenchError,
    fake_driver,
    main_guard,
    need_root_and,
    parse_args,
    print_table,
    row,
    workdir,
    write_json,
)
from _containers import (
    busybox_template,
    fresh_rootfs,
    hook_entry,
    install_lean_entry,
    make_bundle,
    runc_run,
    unique_id,
    write_hook_config,
)

WATCHED = ("yaml", "jsonschema", "click", "grpc", "pynvml")
LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)$")
GPUS = 8


def parse_importtime(text: str) -> dict[str, tuple[int, int, int]]:
    """module -> (own µs, cumulative µs, depth) from -X importtime output."""
    out = {}
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            own, cumulative, indent, name = match.groups()
            out[name] = (int(own), int(cumulative), len(indent) // 2)
    return out


def bench(args: argparse.Namespace) -> None:
    need_root_and("runc")
    load_before = list(os.getloadavg())
    with workdir("imp", args.keep, args.work_dir) as work:
        fake = fake_driver(work / "driver", GPUS)
        entry = install_lean_entry(work / "gpuhook-hook")
        config = write_hook_config(work, fake.root)
        cold = work / "cold.toml"
        cold.write_text(config.read_text().replace(f'"{work}/inventory.json"', '""'))
        template = busybox_template(work / "busybox")
        traces = work / "traces"
        traces.mkdir()
        wrapper = work / "traced-hook"
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -IS -X importtime {entry} "$@" '
                           f'2>"{traces}/$$.txt"\n')
        wrapper.chmod(0o755)

        def under_runc(env: list[str], config_file: Path) -> Callable[[int], str]:
            def once(i: int) -> str:
                bundle = work / "bundle"
                rootfs = fresh_rootfs(template, bundle / "rootfs")
                hooks = {"prestart": [hook_entry(str(wrapper), config_file)]}
                make_bundle(bundle, rootfs, ["true"], env=env, hooks=hooks)
                for old in traces.iterdir():
                    old.unlink()
                runc_run(bundle, unique_id("ghi"))
                (trace,) = list(traces.iterdir())
                return trace.read_text()

            return once

        def direct(argv: list[str], env: list[str]) -> Callable[[int], str]:
            """The entry run as a runtime would, on a bundle that is not started (paths that need no pid)."""

            def once(i: int) -> str:
                bundle = work / "direct"
                rootfs = fresh_rootfs(template, bundle / "rootfs")
                make_bundle(bundle, rootfs, ["true"], env=env)
                state = json.dumps({"ociVersion": "1.0.2", "id": f"imp-{i}", "pid": os.getpid(), "status": "creating",
                                    "bundle": str(bundle)})
                result = subprocess.run([sys.executable, "-IS", "-X", "importtime", entry, *argv],
                                        input=state, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    raise BenchError(f"{' '.join(argv)} failed: {result.stderr.strip()[-600:]}")
                return result.stderr

            return once

        libdir = "/usr/lib/x86_64-linux-gnu"
        paths: dict[str, Callable[[int], str]] = {
            "hook, no GPU requested": direct(["--config", str(config), "prestart"], []),
            "hook, 1 GPU, warm cache": under_runc(["NVIDIA_VISIBLE_DEVICES=0"], config),
            "hook, 1 GPU, no cache": under_runc(["NVIDIA_VISIBLE_DEVICES=0"], cold),
            "cdi-hook create-symlinks": direct(["cdi-hook", "create-symlinks", "--link",
                                                f"libcuda.so.{fake.driver_version}::{libdir}/libcuda.so.1"], []),
            "cdi-hook update-ldcache": direct(["cdi-hook", "update-ldcache", "--folder", libdir], []),
        }
        paths["hook, 1 GPU, warm cache"](0)  # fills the inventory cache
        results = {name: [parse_importtime(once(i)) for i in range(args.runs)] for name, once in paths.items()}

    rows, details = [], {}
    for name, runs in results.items():
        totals = [sum(cum for _own, cum, depth in run.values() if depth == 0) / 1000 for run in runs]
        modules = set().union(*runs)
        own = {m: statistics.median(run[m][0] for run in runs if m in run) / 1000 for m in modules}
        top = sorted(own.items(), key=lambda kv: -kv[1])[:10]
        watched = {w: any(m == w or m.startswith(w + ".") for m in modules) for w in WATCHED}
        imported = ",".join(w for w, on in watched.items() if on) or "none"
        rows.append(row(name, totals, modules=len(modules), heavy=imported))
        details[name] = {"top10_own_ms": [[m, round(v, 2)] for m, v in top], "watched": watched}
    print_table("import time of each path (sum of top-level cumulative -X importtime)", rows, ["modules", "heavy"])
    print("heavy: which of yaml, jsonschema, click, grpc, pynvml the path imported")
    for name, info in details.items():
        print(f"\n{name}: top 10 by own import time (median ms)")
        for module, ms in info["top10_own_ms"]:
            print(f"  {ms:6.2f}  {module}")
    write_json(args, {"entry": entry, "rows": rows, "paths": details}, load_before)


if __name__ == "__main__":
    main_guard(bench, parse_args("imports", __doc__))
