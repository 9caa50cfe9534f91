"""Wall time of `runc run` of a trivial busybox container with and without gpuhook's prestart hook.

Cases, interleaved round by round on an 8-GPU simulated driver with a warm inventory cache: (a) no hook,
(b) hook and no GPU requested, (c) hook and 1 GPU, (d) hook and 8 GPUs with NVIDIA_DRIVER_CAPABILITIES=all.
The hook is the lean entry script (`gpuhook hook install`, python -IS); the same three hook cases through
pip's `gpuhook-hook` console script (python with `site`) are measured alongside to show what the entry saves.
Overheads are per-round differences against (a). Targets: 45, 80 and 110 ms.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path

from _common import (
    BenchError,
    console_hook,
    fake_driver,
    interleaved,
    main_guard,
    need_root_and,
    paired,
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

GPUS = 8
REQUESTS: dict[str, tuple[list[str], str]] = {  # case letter -> (env, what the hook must log)
    "b": ([], "skip request=unset"),
    "c": (["NVIDIA_VISIBLE_DEVICES=0"], "inject devices="),
    "d": (["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all"], "inject devices="),
}
LABELS = {"b": "no GPU requested", "c": "1 GPU", "d": f"{GPUS} GPUs, all capabilities"}
TARGETS = {"b": 10.0, "c": 40.0, "d": 50.0}
TOOK = re.compile(r"^\S+ (\S+) (.*) took=([\d.]+)ms(?: by=.*)?$")


def bench(args: argparse.Namespace) -> None:
    need_root_and("runc")
    load_before = list(os.getloadavg())
    with workdir("hook", args.keep, args.work_dir) as work:
        fake = fake_driver(work / "driver", GPUS)
        config = write_hook_config(work, fake.root)
        lean = install_lean_entry(work / "gpuhook-hook")
        entries = {"lean": lean}
        console = console_hook()
        if console:
            entries["console"] = console
        template = busybox_template(work / "busybox")
        expected: dict[str, tuple[str, str]] = {}  # container id -> (case, expected log text)

        def case(name: str, env: list[str], hook: str | None) -> Callable[[int], float]:
            return runc_case(work, template, config, expected, name, env, hook)

        cases = {"a": case("a", [], None)}
        for kind, hook in entries.items():
            for letter, (env, _) in REQUESTS.items():
                name = letter if kind == "lean" else f"{letter}-console"
                cases[name] = case(name, env, hook)
        samples = interleaved(cases, args.runs, warmup=1, seed=args.seed)
        took = check_log(work / "gpuhook.log", expected)

    rows = [row("(a) runc run, no hook", samples["a"])]
    for letter in REQUESTS:
        rows.append(row(f"({letter}) hook, {LABELS[letter]}", samples[letter], hook_ms=took.get(letter)))
    for letter in REQUESTS:
        if f"{letter}-console" in samples:
            rows.append(row(f"({letter}') console script, {LABELS[letter]}", samples[f"{letter}-console"],
                            hook_ms=took.get(f"{letter}-console")))
    overhead = [row(f"({letter}) - (a): {LABELS[letter]}", paired(samples, letter, "a"), TARGETS[letter])
                for letter in REQUESTS]
    overhead += [row(f"({letter}') - (a): console script, {LABELS[letter]}", paired(samples, f"{letter}-console", "a"))
                 for letter in REQUESTS if f"{letter}-console" in samples]
    print_table("runc run wall time", rows, ["hook_ms"])
    print("hook_ms: the hook's own 'took=' from its log (median), i.e. without interpreter start-up")
    print_table("hook overhead (paired per round)", overhead)
    write_json(args, {"gpus": GPUS, "entry": lean, "rows": rows, "overhead": overhead}, load_before)


def runc_case(work: Path, template: Path, config: Path, expected: dict[str, tuple[str, str]], name: str,
              env: list[str], hook: str | None, sock: Path | None = None) -> Callable[[int], float]:
    """One timed `runc run` of `true` in a fresh busybox rootfs with `env`, with `hook` as its prestart hook
    (hook_entry; `sock`: the service socket it is pointed at) or none; what its log line must say goes to
    `expected` (the case's letter names its REQUESTS entry)."""
    def start(_round: int) -> float:
        bundle = work / f"bundle-{name}"
        rootfs = fresh_rootfs(template, bundle / "rootfs")
        hooks = {"prestart": [hook_entry(hook, config, sock)]} if hook else None
        make_bundle(bundle, rootfs, ["true"], env=env, hooks=hooks)
        cid = unique_id(f"gh-{name}")
        if hook:
            expected[cid] = (name, REQUESTS[name[0]][1])
        return runc_run(bundle, cid)

    return start


def check_log(log: Path, expected: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Every hooked start logged what its request implies; returns the median `took=` per case."""
    seen: dict[str, list[float]] = {}
    lines = log.read_text().splitlines() if log.exists() else []
    found = {}
    for line in lines:
        match = TOOK.match(line)
        if match:
            found[match.group(1)] = (match.group(2), float(match.group(3)))
    for cid, (name, text) in expected.items():
        if cid not in found:
            raise BenchError(f"the hook logged nothing for {cid} ({name}); log: {log}")
        summary, ms = found[cid]
        if not summary.startswith(text):
            raise BenchError(f"{cid} ({name}): expected '{text}…' in the hook log, got '{summary[:120]}'")
        seen.setdefault(name, []).append(ms)
    return {name: round(statistics.median(values), 1) for name, values in seen.items()}


if __name__ == "__main__":
    main_guard(bench, parse_args("hook", __doc__))
