"""cli/leave.py: a click-free command ends at once with its output flushed, and the usual way whenever something
is still owed (an atexit callback, a running thread, click loaded)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The process writes without a newline to both streams (so only a flush delivers it), keeps an object whose
# __del__ reports itself (the interpreter's teardown runs it; os._exit does not), sets up what `extra` says and
# ends through leave(3).
PROBE = """
import sys
class Teardown:
    def __del__(self):
        sys.stderr.write(" teardown-ran")
kept = Teardown()
extra = sys.argv[1]
if extra == "atexit":
    import atexit
    atexit.register(lambda: sys.stderr.write(" atexit-ran"))
elif extra == "thread":
    import threading, time
    threading.Thread(target=lambda: (time.sleep(0.3), sys.stderr.write(" thread-done"))).start()
elif extra == "click":
    import click
sys.stdout.write("out")
sys.stderr.write("err")
from gpuhook.cli.leave import leave
leave(3)
"""


def run_probe(extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE, extra], capture_output=True, text=True, timeout=60)


def test_nothing_owed_ends_at_once_with_the_streams_flushed() -> None:
    result = run_probe("none")
    assert result.returncode == 3
    assert result.stdout == "out"
    assert result.stderr == "err"  # no teardown: the object's __del__ never ran


@pytest.mark.parametrize(("extra", "owed"), [("atexit", "atexit-ran"), ("thread", "thread-done"),
                                             ("click", "teardown-ran")])
def test_anything_owed_ends_the_usual_way(extra: str, owed: str) -> None:
    result = run_probe(extra)
    assert result.returncode == 3
    assert result.stdout == "out"
    assert owed in result.stderr.split()


def test_a_closed_stdout_ends_as_python_reports_it() -> None:
    """A flush that fails (stdout closed early by a reader) is not swallowed: sys.exit's path reports it."""
    code = "import sys; sys.stdout.write('x' * 100000); from gpuhook.cli.leave import leave; leave(0)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) != 0
    assert "BrokenPipeError" in err


def test_the_console_script_keeps_the_status_and_the_whole_line() -> None:
    """`python -m gpuhook.cli` (the console script's `run`, ended by leave) exits with the command's status and
    its one line whole."""
    result = subprocess.run([sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", "/nonexistent-root",
                             "--inventory-cache", ""], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "GPUHOOK_SERVICE_SOCKET": "/nonexistent/s"})
    assert result.returncode == 1
    assert result.stderr.startswith("gpuhook: ") and "/nonexistent-root" in result.stderr
    assert result.stderr.endswith("\n")
