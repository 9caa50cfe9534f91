"""How long a runtime waited on one hook process inside a start: its exec to its exit, from the kernel's events.

podman's start spreads by more than a CDI hook costs (p90 - median ~20 ms on 2 CPUs), so wall-time pairs place
the hook's share only within several milliseconds. The kernel's `sched_process_exec` and `sched_process_exit`
events time the hook process itself, in the very starts measured, to the microsecond: from the moment its
program was loaded to its end, which is what the runtime waited on (runc runs createContainer hooks one after
another and waits for each). The events come from a private ftrace instance (tracefs `instances/`), made for the
bench and removed after it: the host's own tracing is not touched. Without tracefs (not root, not mounted, a
kernel without instances) nothing is traced and the caller leaves its traced rows out.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from _common import BenchError, print_table

TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
EVENTS = ("sched/sched_process_exec", "sched/sched_process_exit")
_EXEC = re.compile(r" (\d+\.\d+): sched_process_exec: filename=(\S+) pid=(\d+) ")
_EXIT = re.compile(r" (\d+\.\d+): sched_process_exit: comm=\S* pid=(\d+) ")


class ExecTracer:
    """A private ftrace instance recording exec and exit events while `record` runs a start."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def open(cls, name: str) -> ExecTracer | None:
        """The instance `name` (made here), its clock CLOCK_MONOTONIC (an exec and its exit may be on two CPUs),
        its exec and exit events on; None where tracefs or its instances are not available."""
        root = next((p for p in TRACEFS if (p / "instances").is_dir()), None)
        if root is None or os.geteuid() != 0:
            return None
        path = root / "instances" / name
        try:
            path.mkdir()
        except OSError:
            return None
        tracer = cls(path)
        try:
            tracer._write("tracing_on", "0")
            tracer._write("trace_clock", "mono")
            tracer._write("buffer_size_kb", "2048")
            for event in EVENTS:
                tracer._write(f"events/{event}/enable", "1")
        except OSError:
            tracer.close()
            return None
        return tracer

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def record(self, run: Callable[[], float]) -> tuple[float, str]:
        """(run()'s result, the events of its time as text): the buffer is cleared first."""
        self._write("trace", "")
        self._write("tracing_on", "1")
        try:
            result = run()
        finally:
            self._write("tracing_on", "0")
        return result, (self.path / "trace").read_text()

    def close(self) -> None:
        """Events off, then the instance removed (rmdir: the kernel frees its buffers)."""
        for event in EVENTS:
            with contextlib.suppress(OSError):
                self._write(f"events/{event}/enable", "0")
        with contextlib.suppress(OSError):
            self.path.rmdir()


@contextlib.contextmanager
def exec_tracer(name: str) -> Iterator[ExecTracer | None]:
    """ExecTracer.open(name) for the with-block (None where there is no tracefs), closed after it."""
    tracer = ExecTracer.open(name)
    try:
        yield tracer
    finally:
        if tracer is not None:
            tracer.close()


def exec_to_exit_ms(trace: str, program: str) -> float | None:
    """Milliseconds from the first exec of a file named `program` (its base name) in `trace` to that process's
    last exit event (a thread's exit is reported too; the process's own comes last); None if either is missing."""
    for match in _EXEC.finditer(trace):
        if os.path.basename(match.group(2)) != program:
            continue
        start, pid = float(match.group(1)), match.group(3)
        ends = [float(m.group(1)) for m in _EXIT.finditer(trace, match.end()) if m.group(2) == pid]
        return (ends[-1] - start) * 1000 if ends else None
    return None


def traced_cases(tracer: ExecTracer | None, cases: Mapping[str, Callable[[int], float]],
                 programs: Mapping[str, str], warmup: int,
                 ) -> tuple[dict[str, Callable[[int], float]], dict[str, list[float]]]:
    """`cases` (interleaved()'s), every one run under `tracer` (so that what tracing costs is in the baselines
    too); each round from `warmup` on of a case named in `programs` also appends the exec-to-exit milliseconds of
    its hook process (programs[name]: the base name of the file it execs) to the second result's list for that
    case, so that the lists pair round by round as interleaved()'s samples do. Without a tracer the cases are
    returned as they are and the lists stay empty."""
    out: dict[str, list[float]] = {name: [] for name in programs}
    if tracer is None:
        return dict(cases), out

    def wrap(name: str, run: Callable[[int], float]) -> Callable[[int], float]:
        def start(round_: int) -> float:
            ms, trace = tracer.record(lambda: run(round_))
            if name not in programs:
                return ms
            hook_ms = exec_to_exit_ms(trace, programs[name])
            if hook_ms is None:
                raise BenchError(f"{name}: no exec and exit of {programs[name]} traced in this start")
            if round_ >= warmup:
                out[name].append(hook_ms)
            return ms

        return start

    return {name: wrap(name, run) for name, run in cases.items()}, out


def print_traced(title: str, rows: list[dict[str, Any]]) -> None:
    """The traced rows as a table, or the one line saying there were none (no tracefs here)."""
    if rows:
        print_table(title, rows)
    else:
        print("\nno tracefs instance here (not root, or not mounted): the hook processes were not traced")
