"""What gpuhook's CDI path adds to a podman start: `--device nvidia.com/gpu=all` vs the same container without.

podman 4.3.1 + runc, private storage, our spec in a private /etc/cdi (see tests/support/podman.py). The spec is
`gpuhook generate-cdi` for a simulated driver (2 GPUs by default, as the issue's nvidia-ctk reference) with
`--hook-path` the lean entry script (`gpuhook hook install` without the native entry), so its createContainer
hook (update-container) starts python -IS. Measured alongside, interleaved: the spec whose hook is the native
entry (what `gpuhook hook install` writes) answered by a running `gpuhook service` ("service"), the same entry
with nothing listening, so it execs its Python fallback ("fallback"), the spec whose hooks call the `gpuhook`
console script (click, `site`), the spec with its hooks removed (what the runtime's own nodes and bind
mounts cost; the hooks' share is the rest), and the spec whose one hook is a no-op that reads its state
(busybox `wc -c`): what the runtime charges for running any createContainer hook, which runc does from `runc
init` (its stdin written only when that process's one-P Go scheduler gets round to it, then the wait for the
hook's exit). Targets (through the service): <= 30 ms added vs no device, of which the container hook
<= 6 ms; shown, never enforced.

Where tracefs is available (root), each start's hook process is also timed from its exec to its exit by the
kernel's events (_trace.py): how long the runtime waited on it, free of podman's spread. Our hook's own share
against the 6 ms is that time, service minus no-op hook, per round. The wall-time pair of the same two specs
also holds what the hook leaves to the rest of the start (podman's teardown of the files it made, the
service's next worker forked ahead), which the 30 ms row covers.

podman's own start spreads by more than the hook costs, so the container hook is also timed alone: the spec's
own `cdi-hook update-container` command line run on a prepared bundle (a fresh busybox rootfs each round, the
state on stdin), through the service, its fallback and the lean entry, paired with /bin/true.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import yaml
from _common import (
    BenchError,
    fake_driver,
    gpuhook_command,
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
    Podman,
    busybox_template,
    fresh_rootfs,
    install_lean_entry,
    install_native_entry,
    make_bundle,
    noop_hook,
    podman_run,
    start_service,
)
from _trace import exec_tracer, print_traced, traced_cases
from support.service import spec_with_hook_env

TARGET = 25.0  # the lean entry
SERVICE_TARGET, HOOK_TARGET = 30.0, 6.0  # through the service
DEVICE = "nvidia.com/gpu=all"
WARMUP = 2


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the simulated driver [default: 2]")


def generate(fake_root: Path, hook: str, out: Path) -> str:
    argv = [*gpuhook_command(), "generate-cdi", "--driver-root", str(fake_root), "--proc-root",
            str(fake_root / "proc"), "--hook-path", hook, "--output", str(out)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchError(f"generate-cdi failed: {result.stderr.strip()}")
    return out.read_text()


def bench(args: argparse.Namespace) -> None:
    need_root_and("podman", "runc", "unshare", "busybox")
    load_before = list(os.getloadavg())
    with workdir("cdi", args.keep, args.work_dir) as work:
        fake = fake_driver(work / "driver", args.gpus)
        lean = install_lean_entry(work / "gpuhook-hook")
        native = str(install_native_entry(work / "bin" / "gpuhook-hook")[0])
        sock = work / "run" / "service.sock"
        native_spec = generate(fake.root, native, work / "native.yaml")
        specs = {
            "lean": generate(fake.root, lean, work / "lean.yaml"),
            "service": spec_with_hook_env(native_spec, {"GPUHOOK_SERVICE_SOCKET": str(sock)}),
            "fallback": spec_with_hook_env(native_spec, {"GPUHOOK_SERVICE_SOCKET": str(work / "none" / "s.sock")}),
            "console": generate(fake.root, gpuhook_command()[0], work / "console.yaml"),
        }
        stripped = yaml.safe_load(specs["lean"])
        hooks = stripped["containerEdits"].pop("hooks", [])
        specs["no-hooks"] = yaml.safe_dump(stripped, sort_keys=False)
        stripped["containerEdits"]["hooks"] = [{"hookName": "createContainer", **noop_hook()}]
        specs["noop-hook"] = yaml.safe_dump(stripped, sort_keys=False)
        # each spec's one createContainer hook, traced by the base name of the file it execs
        programs = {name: Path(yaml.safe_load(spec)["containerEdits"]["hooks"][0]["path"]).name
                    for name, spec in specs.items() if name != "no-hooks"}
        template = busybox_template(work / "busybox")
        with Podman.create(work / "podman") as podman:
            spec_file = podman.spec_dir / "nvidia.yaml"

            def case(name: str, spec: str, devices: list[str]) -> Callable[[int], float]:
                def start(round_: int) -> float:
                    spec_file.write_text(spec)
                    rootfs = fresh_rootfs(template, work / f"rootfs-{name}")
                    return podman_run(podman, rootfs, devices, ["true"])

                return start

            cases = {"none": case("none", specs["lean"], [])}
            cases.update({name: case(name, text, [DEVICE]) for name, text in specs.items()})
            alone = {"true": alone_case(work, template, "true", ["/bin/true"], {})}
            for name, spec in (("service", "service"), ("fallback", "fallback"), ("lean", "lean")):
                hook = yaml.safe_load(specs[spec])["containerEdits"]["hooks"][0]
                env = dict(e.split("=", 1) for e in hook.get("env", []))
                alone[f"alone-{name}"] = alone_case(work, template, name, [hook["path"], *hook["args"][1:]], env)
            service = start_service(sock, None, work / "service.err")
            try:
                with exec_tracer(f"gpuhook-bench-cdi-{os.getpid()}") as tracer:
                    cases, traced = traced_cases(tracer, cases, programs, WARMUP)
                    samples = interleaved(cases, args.runs, warmup=WARMUP, seed=args.seed)
                samples.update(interleaved(alone, args.runs, warmup=WARMUP, seed=args.seed))
            finally:
                service.stop()
            for name in ("lean", "service", "fallback"):
                check_hooks_ran(work / f"rootfs-{name}")

    rows = [row("podman run, no device", samples["none"]),
            row(f"{DEVICE}, hook via native entry + service", samples["service"]),
            row(f"{DEVICE}, hook via native entry, no service (fallback)", samples["fallback"]),
            row(f"{DEVICE}, hooks via lean entry", samples["lean"]),
            row(f"{DEVICE}, hooks via gpuhook console script", samples["console"]),
            row(f"{DEVICE}, hooks removed", samples["no-hooks"]),
            row(f"{DEVICE}, one no-op hook reading its state", samples["noop-hook"])]
    added = [row("service spec - no device", paired(samples, "service", "none"), SERVICE_TARGET),
             row("service spec - hooks removed (the hook's share, the runtime's part in it)",
                 paired(samples, "service", "no-hooks")),
             row("service spec - no-op hook spec (our hook's share and what it leaves to the rest of the start)",
                 paired(samples, "service", "noop-hook")),
             row("no-op hook - hooks removed (what the runtime charges for a hook)",
                 paired(samples, "noop-hook", "no-hooks")),
             row("fallback spec - no device", paired(samples, "fallback", "none")),
             row("lean spec - no device", paired(samples, "lean", "none"), TARGET),
             row("console-script spec - no device", paired(samples, "console", "none")),
             row("hooks removed - no device (runtime's share)", paired(samples, "no-hooks", "none")),
             row("lean spec - hooks removed (the hooks' share)", paired(samples, "lean", "no-hooks"))]
    alone_rows = [row(f"the container hook alone: {kind} - /bin/true", paired(samples, f"alone-{kind}", "true"),
                      HOOK_TARGET if kind == "service" else None) for kind in ("service", "fallback", "lean")]
    waited = [row(f"{name}: the hook process, exec to exit", hook_ms) for name, hook_ms in traced.items() if hook_ms]
    if traced["service"]:
        waited.append(row("service - no-op hook (our container hook's own share)",
                          paired(traced, "service", "noop-hook"), HOOK_TARGET))
    print_table(f"podman run wall time, {args.gpus}-GPU simulated driver", rows)
    print_table("CDI path overhead (paired per round)", added)
    print_traced("what podman waited on the spec's createContainer hook, traced in the same starts", waited)
    print_table("the spec's container hook alone on a prepared bundle (paired per round, /bin/true subtracted)",
                alone_rows)
    write_json(args, {"gpus": args.gpus, "device": DEVICE, "entry": lean, "hooks": [h["args"][1:3] for h in hooks],
                      "rows": rows, "overhead": added, "traced": waited, "alone": alone_rows}, load_before)


def alone_case(work: Path, template: Path, name: str, argv: list[str], env: dict[str, str]) -> Callable[[int], float]:
    """Milliseconds of `argv` (a spec's createContainer hook, or /bin/true) with an OCI state on stdin for a fresh
    bundle: a busybox rootfs copied before the clock starts, so every round creates the links and the ld cache
    anew. A hook that fails is a BenchError."""
    def run(_round: int) -> float:
        bundle = work / f"alone-{name}"
        make_bundle(bundle, fresh_rootfs(template, bundle / "rootfs"), ["true"])
        state = json.dumps({"ociVersion": "1.0.2", "id": f"alone-{name}", "pid": os.getpid(), "status": "creating",
                            "bundle": str(bundle)})
        ms, result = timed(argv, input=state, env={"PATH": "/usr/bin:/bin", **env})
        if result.returncode != 0:
            raise BenchError(f"{name}: {argv[0]} failed ({result.returncode}): {result.stderr[-400:]}")
        if name != "true" and not (bundle / "rootfs" / "etc" / "ld.so.cache").is_file():
            raise BenchError(f"{name}: the hook left no ld cache in {bundle}/rootfs")
        return ms

    return run


def check_hooks_ran(rootfs: Path) -> None:
    """The lean spec's hooks did their work: the ld cache and a soname link exist in the last rootfs."""
    if not (rootfs / "etc/ld.so.cache").exists():
        raise BenchError(f"update-ldcache left no ld cache in {rootfs}")
    if not (rootfs / "usr/lib/x86_64-linux-gnu/libcuda.so.1").is_symlink():
        raise BenchError(f"create-symlinks left no libcuda.so.1 link in {rootfs}")


if __name__ == "__main__":
    main_guard(bench, parse_args("cdi", __doc__, options))
