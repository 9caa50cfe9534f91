"""What every benchmark shares: its command line, the statistics, the table, the JSON result, the machine.

Every script reports the same numbers (median, p90, min, max over >= 20 runs, with the core
count) and for timings, never timed assertions in tests; so the scripts only measure and report, and a
script exits 1 only when what it measured did not work (a container failed, the hook logged the wrong thing).
A `target_ms` on a row is compared and shown, never enforced.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
TESTS_DIR = BENCH_DIR.parent / "tests"
# The containers the benchmarks start are the tests' (tests/support: bundles, runc, a private podman), so the
# scripts run where the tests do: after the README's test install (`pip install '.[test]'`, for pytest).
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(1, str(TESTS_DIR))
RUNS = 20
QUICK_RUNS = 3


class BenchError(Exception):
    """The thing measured did not work: reported as one line, exit status 1."""


def parse_args(name: str, doc: str | None, extra: Callable[[argparse.ArgumentParser], None] | None = None,
               ) -> argparse.Namespace:
    """--quick (3 runs, for CI), --runs N, --json OUT (default bench/results/<name>.json), --keep (work dir)."""
    parser = argparse.ArgumentParser(prog=f"bench/{name}.py", description=(doc or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} runs: proves the script works")
    parser.add_argument("--runs", type=int, default=None, help=f"measured runs per case [default: {RUNS}]")
    parser.add_argument("--json", dest="json_out", default=str(RESULTS_DIR / f"{name}.json"), metavar="OUT",
                        help="where to write the results [default: %(default)s]")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (printed at the end)")
    parser.add_argument("--seed", type=int, default=7, help="order of the interleaved cases [default: 7]")
    parser.add_argument("--work-dir", default="/tmp", metavar="DIR",
                        help="where the work directory (rootfs copies, bundles) goes [default: %(default)s]; "
                             "/dev/shm takes the disk's metadata writes out of the hook's time")
    if extra:
        extra(parser)
    args = parser.parse_args()
    args.name = name
    if args.runs is None:
        args.runs = QUICK_RUNS if args.quick else RUNS
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def compile_package() -> None:
    """Write gpuhook's bytecode first, as `pip install` does: an editable install under PYTHONDONTWRITEBYTECODE
    (or a source tree just edited) would otherwise recompile every changed module at every timed start."""
    import compileall

    import gpuhook

    folder = os.path.dirname(os.path.abspath(gpuhook.__file__ or ""))
    if not compileall.compile_dir(folder, quiet=1):
        raise BenchError(f"cannot byte-compile {folder}")


def main_guard(body: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """Byte-compile gpuhook, then run `body`; a BenchError is one line on stderr and exit 1."""
    try:
        compile_package()
        body(args)
    except BenchError as exc:
        print(f"bench/{args.name}.py: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


# --- statistics -------------------------------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    data = sorted(samples)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def summary(samples: Sequence[float]) -> dict[str, float]:
    """n, median, p90, p99, min, max, mean of `samples` (milliseconds by convention)."""
    return {
        "n": len(samples),
        "median": statistics.median(samples),
        "p90": percentile(samples, 90),
        "p99": percentile(samples, 99),
        "min": min(samples),
        "max": max(samples),
        "mean": statistics.fmean(samples),
    }


def median_ci95(samples: Sequence[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median: the order statistics whose ranks are
    n/2 -+ 0.98 sqrt(n) (the binomial's normal approximation). A paired overhead on this VM spreads by more than
    the hook costs, so whether a median under or over its target means anything is this interval's to say; with
    a handful of samples it is simply (min, max)."""
    ordered = sorted(samples)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)
    low = max(0, math.floor(n / 2 - half) - 1)
    high = min(n - 1, math.ceil(n / 2 + half))
    return ordered[low], ordered[high]


def row(label: str, samples: Sequence[float], target: float | None = None, **extra: Any) -> dict[str, Any]:
    """One table row: the summary of `samples`, the target (compared on the median, with the median's 95 %
    interval beside it) and free extra fields."""
    out: dict[str, Any] = {"case": label, **summary(samples), "samples": [round(s, 3) for s in samples]}
    if target is not None:
        out["ci95"] = median_ci95(samples)
        out["target"] = target
        out["met"] = out["median"] <= target
    out.update(extra)
    return out


def interleaved(cases: Mapping[str, Callable[[int], float]], runs: int, warmup: int = 1, seed: int = 7,
                ) -> dict[str, list[float]]:
    """Run every case once per round, in a shuffled order each round, `warmup` rounds discarded.

    Samples of one round are taken close together, so `paired()` differences cancel slow drifts of the machine
    (other jobs, thermal); shuffling keeps a fixed order from favouring one case.
    """
    rng = random.Random(seed)
    out: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(warmup + runs):
        order = list(cases)
        rng.shuffle(order)
        for name in order:
            value = cases[name](round_)
            if round_ >= warmup:
                out[name].append(value)
    return out


def paired(samples: Mapping[str, Sequence[float]], case: str, base: str) -> list[float]:
    """Per-round differences case - base (same round, so the same machine state)."""
    return [a - b for a, b in zip(samples[case], samples[base], strict=True)]


# --- output -----------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the numbers depend on: cores, load, kernel, Python, and the runtimes' versions where installed."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for tool in ("runc", "podman"):
        if shutil.which(tool):
            first = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False).stdout
            info[tool] = (first.splitlines() or [""])[0]
    return info


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, tuple):  # an interval
        return "–".join(_fmt(v) for v in value)
    return str(value)


def print_table(title: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = (),
                unit: str = "ms") -> None:
    """A plain-text table: case, n, median, p90, min, max, then `columns` (target/met when any row has one)."""
    cols = ["case", "n", "median", "p90", "min", "max", *columns]
    if any("target" in r for r in rows):
        cols += ["median 95% CI", "target", "met"]
    cells = [[_fmt(r.get("ci95" if c == "median 95% CI" else c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    print(f"\n{title} ({unit}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f})")
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True))))
    for line in cells:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths,
                                                                                           strict=True))))


def write_json(args: argparse.Namespace, data: Mapping[str, Any], load_before: list[float]) -> None:
    """bench/results/<name>.json (or --json): the rows, the machine, and the load before and after."""
    info = machine()
    payload = {"bench": args.name, "runs": args.runs, "quick": args.quick,
               "machine": {**info, "loadavg_before": load_before, "loadavg_after": info.pop("loadavg")}, **data}
    path = Path(args.json_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nresults: {path}")


# --- environment ------------------------------------------------------------------------------------------------


def need(condition: bool, why: str) -> None:
    if not condition:
        raise BenchError(why)


def need_root_and(*tools: str) -> None:
    need(os.geteuid() == 0, "needs root (the simulated driver makes device nodes; runc and podman run containers)")
    for tool in tools:
        need(shutil.which(tool) is not None, f"needs {tool} on PATH")


@contextmanager
def workdir(name: str, keep: bool, base: str = "/tmp") -> Iterator[Path]:
    """A short directory under `base` (podman limits its runroot path to 50 characters), removed unless `keep`."""
    path = Path(tempfile.mkdtemp(prefix=f"gh-{name}-", dir=base))
    if journal_less_ext4(path):
        print(f"note: {base} is ext4 without a journal: there ext4 allocates no inode freed in the last one to six "
              "minutes (recently_deleted), so a file created soon after many were deleted (another benchmark's "
              "clean-up) costs up to ~100 us more; leave two minutes between benchmarks, or --work-dir /dev/shm",
              file=sys.stderr)
    try:
        yield path
    finally:
        if keep:
            print(f"work directory kept: {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def journal_less_ext4(path: Path) -> bool:
    """Whether `path` is on an ext4 filesystem without a journal (its jbd2 task, in sysfs, is "<none>")."""
    dev = os.stat(path).st_dev
    try:
        name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
        with open(f"/sys/fs/ext4/{name}/journal_task", encoding="ascii") as f:
            return f.read().strip() == "<none>"
    except OSError:
        return False


def gpuhook_command() -> list[str]:
    """The installed `gpuhook` console script beside this Python (what users run), else `python -m gpuhook.cli`."""
    beside = Path(sys.executable).with_name("gpuhook")
    return [str(beside)] if os.access(beside, os.X_OK) else [sys.executable, "-m", "gpuhook.cli"]


def console_hook() -> str | None:
    """The pip console script `gpuhook-hook` beside this Python (runs `site`), when installed."""
    beside = Path(sys.executable).with_name("gpuhook-hook")
    return str(beside) if os.access(beside, os.X_OK) else None


def fake_driver(root: Path, gpus: int, mig: Mapping[int, Sequence[str]] | None = None) -> Any:
    """A simulated driver install (gpuhook.fakedriver) with `gpus` GPUs."""
    from gpuhook.fakedriver import build_fake_driver

    return build_fake_driver(root, gpus, mig=mig)


# The spawner's program: one JSON line in ({"argv", "env", "err"}), one out ({"ms", "status", "maxrss_kib"}).
_SPAWNER = """
import json, os, sys, time
null = os.open("/dev/null", os.O_RDWR)
for line in sys.stdin:
    job = json.loads(line)
    err = os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    start = time.perf_counter()
    pid = os.posix_spawn(job["argv"][0], job["argv"], job["env"], file_actions=[
        (os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, err, 2)])
    _, status, usage = os.wait4(pid, 0)
    ms = (time.perf_counter() - start) * 1000
    os.close(err)
    print(json.dumps({"ms": ms, "status": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss}),
          flush=True)
"""


class Spawner:
    """Runs commands from a small resident `python3 -I -S` process and reports each one's wall time and peak RSS.

    A child's ru_maxrss (wait4) is the peak over every memory image the process had, the one it was forked or
    vfork-spawned with included: a command started from the benchmark itself reports at least the benchmark's own
    RSS (33 MiB), whatever it uses. Started from this spawner, the floor is the spawner's few MiB."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SPAWNER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, argv: Sequence[str], env: Mapping[str, str], err: Path) -> tuple[float, int, int]:
        """(wall ms, exit status, peak RSS KiB) of `argv` with exactly `env`, stderr to `err`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise BenchError(f"the spawner ended (status {self.proc.wait()}) running {' '.join(argv[:3])}")
        done = json.loads(answer)
        return done["ms"], done["status"], done["maxrss_kib"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def timed(argv: Sequence[str], **kw: Any) -> tuple[float, subprocess.CompletedProcess[str]]:
    """(wall milliseconds, result) of one command, output captured; stdin closed unless `input=` is given."""
    if "input" not in kw:
        kw["stdin"] = subprocess.DEVNULL
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)
    return (time.perf_counter() - start) * 1000, result
