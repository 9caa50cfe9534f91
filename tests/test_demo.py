"""`gpuhook demo`, the README's first command: the whole pipeline on a simulated driver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.e2e import need_root, need_tool
from support.runc import need_busybox


def test_demo_runs_the_pipeline() -> None:
    need_root()
    need_tool("runc")
    need_busybox()
    gpuhook = str(Path(sys.executable).with_name("gpuhook"))
    result = subprocess.run([gpuhook, "demo"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "source:         nvml" in out and "GPUs (2):" in out
    assert "validation: OK" in out and "nvidia.com/gpu=all" in out and "cdiVersion 0.5.0" in out
    assert "/dev: nvidia-uvm nvidia-uvm-tools nvidia0 nvidiactl" in out
    assert "No such device or address" in out
    assert "libcuda.so.1 -> libcuda.so.550.54.15" in out
    assert " inject devices=GPU-" in out
