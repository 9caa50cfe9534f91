"""`gpuhook demo`, the README's first command: the whole pipeline on a simulated driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.e2e import need_root, need_tool
from support.runc import need_busybox

GPUHOOK = str(Path(sys.executable).with_name("gpuhook"))


def test_demo_runs_the_pipeline() -> None:
    need_root()
    need_tool("runc")
    need_busybox()
    result = subprocess.run([GPUHOOK, "demo"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "source:         nvml" in out and "GPUs (2):" in out
    assert "validation: OK" in out and "nvidia.com/gpu=all" in out and "cdiVersion 0.5.0" in out
    assert "/dev: nvidia-uvm nvidia-uvm-tools nvidia0 nvidiactl" in out
    assert "No such device or address" in out
    assert "libcuda.so.1 -> libcuda.so.550.54.15" in out
    assert " inject devices=GPU-" in out
    verdict = out.split("== verdict", 1)[1]
    assert "  ok       discovery: 2 GPUs" in verdict
    assert "  ok       CDI spec: cdiVersion 0.5.0" in verdict
    assert "  ok       container with the prestart hook: " in verdict and "ENXIO" in verdict
    assert "skipped" not in verdict and "failed" not in verdict
    assert '"No such device or address" on /dev/nvidia0 is the expected success' in verdict


def test_demo_says_what_it_skipped_and_why(tmp_path: Path) -> None:
    """Without runc the container step is skipped, the verdict names it and why, and the demo still succeeds."""
    need_tool("gcc")  # the simulated driver's libraries are compiled
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name != "runc" and not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(os.path.join(folder, name))
    result = subprocess.run([GPUHOOK, "demo"], capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, PATH=str(bin_dir)))
    assert result.returncode == 0, result.stderr
    verdict = result.stdout.split("== verdict", 1)[1]
    assert "  ok       discovery: 2 GPUs" in verdict
    assert "  ok       CDI spec: " in verdict
    assert "  skipped  container with the prestart hook: needs runc" in verdict
    assert "expected success" in verdict


def test_demo_without_a_compiler_says_what_to_install(tmp_path: Path) -> None:
    """The packages ship no compiler: where there is none (and nothing cached), the demo ends with one line
    naming what to install, never an internal error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = dict(os.environ, PATH=str(bin_dir), GPUHOOK_FAKEDRIVER_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([GPUHOOK, "demo"], capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["gpuhook: the simulated driver's libraries are built here with a C "
                                          "compiler, and there is no gcc (or cc) on PATH: install one (Debian, "
                                          "Ubuntu: apt-get install gcc libc6-dev; RHEL: dnf install gcc)"]
    fake = subprocess.run([GPUHOOK, "fake-driver", "create", str(tmp_path / "root")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert fake.returncode != 0 and "install one" in fake.stderr and "internal error" not in fake.stderr
