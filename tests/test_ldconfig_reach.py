"""ldconfig reaches nothing but its own job: a subverted ldconfig (here a static stand-in, what a memory bug
driven by a hostile image could make of it) can neither signal another process nor change its limits, whether
the CDI hook runs in-process (in the container's PID namespace or the runtime's) or through the service (the
host's). Its seccomp filter allows tgkill only on itself, prlimit64 only on pid 0 (itself), and no kill."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.e2e import need_tool
from support.runc import need_busybox
from support.service import start
from test_hook_e2e import write_config
from test_service import cdi_hook_start, runc_start

STAND_IN = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    struct rlimit one = {1, 1};
    syscall(SYS_prlimit64, VICTIM, RLIMIT_NOFILE, &one, 0);
    syscall(SYS_tgkill, VICTIM, VICTIM, SIGKILL);
    syscall(SYS_kill, VICTIM, SIGKILL);
    return 0;
}
"""


def _stand_in(tmp: Path, victim: int) -> Path:
    """A static ldconfig stand-in that tries to kill `victim` and set its RLIMIT_NOFILE to 1."""
    need_tool("gcc")
    source, binary = tmp / "standin.c", tmp / "standin-ldconfig"
    source.write_text(STAND_IN)
    built = subprocess.run(["gcc", "-static", "-O0", f"-DVICTIM={victim}", "-o", str(binary), str(source)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no static libc to build the stand-in: {built.stderr.strip()[-200:]}")
    return binary


def _open_files_limit(pid: int) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return line
    raise AssertionError("no open-files line")


@pytest.mark.e2e
@pytest.mark.parametrize("door", ["cdi-hook", "prestart"])
@pytest.mark.parametrize("served", ["in-process", "service"])
def test_a_subverted_ldconfig_cannot_reach_a_host_process(native: Path, root_tmp: Path, fake_driver: Any,
                                                          door: str, served: str) -> None:
    """The CDI hook's ldconfig (in-process it runs in the container's PID namespace, through the service in the
    host's) and the prestart hook's (the runtime's PID namespace, the host's, either way)."""
    need_tool("runc")
    need_busybox()
    victim = subprocess.Popen(["sleep", "120"])
    try:
        limit = _open_files_limit(victim.pid)
        stand_in = _stand_in(root_tmp, victim.pid)
        config = write_config(root_tmp, Path(fake_driver.root), ldconfig=f"@{stand_in}")
        running = start(root_tmp / "run" / "service.sock", config, root_tmp / "service.err") \
            if served == "service" else None
        sock = running.sock if running is not None else root_tmp / "none" / "service.sock"
        try:
            if door == "cdi-hook":
                result = cdi_hook_start(root_tmp, native, sock, ["update-ldcache", "--folder", "/opt/lib",
                                                                  "--ldconfig-path", str(stand_in)], door)
            else:
                result = runc_start(root_tmp, native, config, sock, ["NVIDIA_VISIBLE_DEVICES=0"], door)
        finally:
            if running is not None:
                running.stop()
        assert "gpuhook" not in result.stderr, result.stderr  # the hook ran the stand-in and succeeded
        if door == "prestart":
            assert f"by={served}" in (root_tmp / "gpuhook.log").read_text()
        time.sleep(0.1)
        assert victim.poll() is None, "the stand-in ldconfig killed a host process"
        assert _open_files_limit(victim.pid) == limit, "the stand-in ldconfig changed a host process's limits"
    finally:
        victim.kill()
        victim.wait()
