"""Wall time of `runc run` with the prestart hook through `gpuhook service` vs its fallback vs no hook.

The hook is what `gpuhook hook install` writes: the native entry (`_native/entry.c`) at PATH and the -IS Python
entry at PATH.py. Cases, interleaved round by round on an 8-GPU simulated driver with a warm inventory cache:
(a) no hook; for each request (no GPU, 1 GPU, 8 GPUs with NVIDIA_DRIVER_CAPABILITIES=all) the native entry with
the service running ("service"), the native entry with nothing listening, so it execs PATH.py ("fallback"), and
PATH.py run directly, without the native entry ("python"). Overheads are per-round differences against (a); the
targets (8, 10 and 2 ms through the service) are shown, never enforced. Beside them, a start whose one prestart
hook only reads its state (busybox `wc -c`, "noop"): what runc charges for running any hook. As root, each
hooked start's hook process is also timed from its exec to its exit by the kernel's events (_trace.py): what
runc waited on it, without `runc run`'s own spread, which the paired rows carry.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

from _common import (
    BenchError,
    fake_driver,
    interleaved,
    main_guard,
    need_root_and,
    paired,
    parse_args,
    print_table,
    row,
    timed,
    workdir,
    write_json,
)
from _containers import (
    busybox_template,
    fresh_rootfs,
    install_native_entry,
    make_bundle,
    noop_hook,
    runc_run,
    start_service,
    unique_id,
    write_hook_config,
)
from _trace import exec_tracer, print_traced, traced_cases
from hook import GPUS, LABELS, REQUESTS, check_log, runc_case

TARGETS = {"b": 2.0, "c": 8.0, "d": 10.0}  # through the service
KINDS = ("service", "fallback", "python")


def bench(args: argparse.Namespace) -> None:
    need_root_and("runc")
    load_before = list(os.getloadavg())
    with workdir("svc", args.keep, args.work_dir) as work:
        fake = fake_driver(work / "driver", GPUS)
        config = write_hook_config(work, fake.root)
        native, script = install_native_entry(work / "bin" / "gpuhook-hook")
        sock = work / "run" / "service.sock"
        paths = {"service": (native, sock), "fallback": (native, work / "none" / "service.sock"),
                 "python": (script, sock)}
        template = busybox_template(work / "busybox")
        expected: dict[str, tuple[str, str]] = {}

        def case(name: str, env: list[str], hook: tuple[Path, Path] | None) -> Callable[[int], float]:
            entry, entry_sock = hook if hook else (None, None)
            return runc_case(work, template, config, expected, name, env, entry and str(entry), entry_sock)

        cases = {"a": case("a", [], None), "noop": noop_case(work, template)}
        for kind in KINDS:
            for letter, (env, _) in REQUESTS.items():
                cases[f"{letter}-{kind}"] = case(f"{letter}-{kind}", env, paths[kind])
        # The no-GPU hook alone, without runc's noise: the entry run on a prepared state, paired with /bin/true.
        alone_bundle = make_bundle(work / "bundle-alone", fresh_rootfs(template, work / "bundle-alone" / "rootfs"),
                                   ["true"])
        state = json.dumps({"ociVersion": "1.0.2", "id": "alone", "pid": os.getpid(), "status": "creating",
                            "bundle": str(alone_bundle)}).encode()
        alone = {"true": alone_case(["/bin/true"], state, {})}
        for kind in KINDS:
            entry, entry_sock = paths[kind]
            alone[f"alone-{kind}"] = alone_case([str(entry), "--config", str(config), "prestart"], state,
                                                {"GPUHOOK_SERVICE_SOCKET": str(entry_sock)})
        # each case's prestart hook, traced by the base name of the file it execs
        programs = {name: Path(paths[kind][0]).name for name in cases for kind in KINDS if name.endswith(kind)}
        programs["noop"] = Path(noop_hook()["path"]).name
        service = start_service(sock, config, work / "service.err")
        try:
            with exec_tracer(f"gpuhook-bench-service-{os.getpid()}") as tracer:
                cases, traced = traced_cases(tracer, cases, programs, 1)
                samples = interleaved(cases, args.runs, warmup=1, seed=args.seed)
            samples.update(interleaved(alone, args.runs * 3, warmup=2, seed=args.seed))
        finally:
            service.stop()
        took = check_log(work / "gpuhook.log", expected)

    rows = [row("(a) runc run, no hook", samples["a"]), row("(a) runc run, one no-op hook", samples["noop"])]
    overhead = []
    for letter in REQUESTS:
        for kind in KINDS:
            name = f"{letter}-{kind}"
            rows.append(row(f"({letter}) {kind}, {LABELS[letter]}", samples[name], hook_ms=took.get(name)))
            overhead.append(row(f"({letter}) {kind} - (a): {LABELS[letter]}", paired(samples, name, "a"),
                                TARGETS[letter] if kind == "service" else None))
    overhead.append(row("no-op hook - (a): what runc charges for running any prestart hook",
                        paired(samples, "noop", "a")))
    overhead.append(row("(b) service - no-op hook: no GPU requested, our hook's own share",
                        paired(samples, "b-service", "noop")))
    print_table("runc run wall time", rows, ["hook_ms"])
    print("hook_ms: the hook's own 'took=' from its log (median): the service's child, or the Python entry")
    print_table("hook overhead (paired per round)", overhead)
    alone_rows = [row(f"no GPU requested, the hook alone: {kind} - /bin/true", paired(samples, f"alone-{kind}", "true"),
                      TARGETS["b"] if kind == "service" else None) for kind in KINDS]
    print_table("the hook alone on a no-GPU state (paired per round, exec of /bin/true subtracted)", alone_rows)
    waited = [row(f"({name[0]}) {name[2:]}, {LABELS[name[0]]}: the hook process, exec to exit", traced[name],
                  TARGETS[name[0]] if name.endswith("service") else None)
              for name in traced if traced[name] and name != "noop"]
    if traced["noop"]:
        waited += [row("no-op hook: the hook process, exec to exit", traced["noop"]),
                   row("(b) service - no-op hook, exec to exit: no GPU requested, our hook's own share",
                       paired(traced, "b-service", "noop"), TARGETS["b"])]
    print_traced("what runc waited on the prestart hook, traced in the same starts", waited)
    write_json(args, {"gpus": GPUS, "entry": str(native), "rows": rows, "overhead": overhead, "alone": alone_rows,
                      "traced": waited}, load_before)


def noop_case(work: Path, template: Path) -> Callable[[int], float]:
    """One timed `runc run` of `true` whose one prestart hook only reads its state (busybox `wc -c`)."""
    hooks = {"prestart": [noop_hook()]}

    def start(_round: int) -> float:
        bundle = work / "bundle-noop"
        make_bundle(bundle, fresh_rootfs(template, bundle / "rootfs"), ["true"], hooks=hooks)
        return runc_run(bundle, unique_id("gh-noop"))

    return start


def alone_case(argv: list[str], state: bytes, env: dict[str, str]) -> Callable[[int], float]:
    """Milliseconds of one run of `argv` with `state` on stdin (it must exit 0)."""
    def run(_round: int) -> float:
        ms, result = timed(argv, input=state.decode(), env={"PATH": "/usr/bin:/bin", **env})
        if result.returncode != 0:
            raise BenchError(f"{argv[0]} failed ({result.returncode}): {result.stderr[-400:]}")
        return ms

    return run


if __name__ == "__main__":
    main_guard(bench, parse_args("service", __doc__))
