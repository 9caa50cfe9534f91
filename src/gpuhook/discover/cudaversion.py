"""The driver's CUDA version from its own libcuda, for when NVML cannot answer (no kernel module loaded,
a driver root of another machine, procfs discovery).

`cuDriverGetVersion` answers without a kernel module and opens no device (535.309.01 -> 12020). It runs in a
short-lived child with an empty environment, so no long-lived gpuhook process (hook, plugin) keeps the host's
libcuda loaded; as root the child first takes a private mount namespace with an empty tmpfs on /dev, so that
even a libcuda that did try to create its /dev/nvidia* nodes could not make them on the host.
"""

from __future__ import annotations

import subprocess
import sys

TIMEOUT_S = 20
# Runs with `python -I -S`: nothing from the environment, no site packages. Prints "<rc> <version>".
_CHILD = r"""
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        sys.exit("cannot unshare the mount namespace: " + os.strerror(ctypes.get_errno()))
    if libc.mount(None, b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
        sys.exit("cannot make mounts private: " + os.strerror(ctypes.get_errno()))
    if libc.mount(b"tmpfs", b"/dev", b"tmpfs", 0x2 | 0x4 | 0x8, b"size=4k") != 0:  # nosuid nodev noexec
        sys.exit("cannot hide /dev: " + os.strerror(ctypes.get_errno()))
lib = ctypes.CDLL(sys.argv[1])
value = ctypes.c_int(0)
print(lib.cuDriverGetVersion(ctypes.byref(value)), value.value)
"""


def driver_version_int(libcuda: str) -> int:
    """cuDriverGetVersion of the library at host path `libcuda`; ValueError with the reason when it fails."""
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHILD, libcuda],
            env={},
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"cuDriverGetVersion from {libcuda}: {exc}") from None
    words = proc.stdout.split()
    if proc.returncode != 0 or len(words) != 2 or words[0] != "0" or not words[1].isdigit():
        last = (proc.stderr.strip().splitlines() or [proc.stdout.strip() or f"exit status {proc.returncode}"])[-1]
        raise ValueError(f"cuDriverGetVersion from {libcuda} failed: {last[:200]}")
    return int(words[1])


def format_version(value: int) -> str:
    """12020 -> "12.2", the form NVML's CUDA version takes in an inventory."""
    return f"{value // 1000}.{value % 1000 // 10}"


def cuda_version(libcuda: str) -> str:
    return format_version(driver_version_int(libcuda))
