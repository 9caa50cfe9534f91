"""The device plugin's default device-list strategy on a node whose runtime has no CDI.

kubelet's device manager (tests/support/kubelet.py) allocates one GPU; the container is then started by a real
containerd 1.6 (Debian 12's, no CDI: it ignores Allocate's cdi_devices) through gpuhook's shim, with the
environment CRI builds (the image's, then Allocate's envs). It must see exactly the allocated GPU, and the
plugin, watching the hooks' state dir, must say once that the runtime ignored the CDI devices."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.containerd import private_containerd
from support.glibc import glibc_rootfs
from support.kubelet import TestKubelet
from test_plugin import running

from gpuhook.plugin.devices import Options

pytestmark = pytest.mark.e2e
SHIM = str(Path(sys.executable).with_name("gpuhook-runtime"))
PROBE = "ls /dev | grep nvidia | sort | tr '\\n' ' '"
IGNORED = "the container runtime ignored the CDI devices of container "


def ignored_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "gpuhook.plugin.cdiignored" and r.getMessage().startswith(IGNORED)]


def test_allocated_gpu_reaches_a_containerd_1_6_container(fake_driver: Any, kubelet: TestKubelet,
                                                          tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"  # the nodes' state-dir and the plugin's --hook-state-dir, as the DaemonSet has it
    state.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(f'driver-root = "{fake_driver.root}"\nproc-root = "{fake_driver.root}/proc"\n'
                      f'log-file = "{tmp_path}/gpuhook.log"\ninventory-cache = ""\nstate-dir = "{state}"\n')
    rootfs = glibc_rootfs(tmp_path / "image", probe_cache=tmp_path / "probe")
    daemon_env = {"GPUHOOK_CONFIG": str(config)}
    with running(fake_driver, kubelet, Options(), hook_state_dir=str(state)) as plugin:
        kubelet.wait_registrations(1)
        ids = [d.ID for d in kubelet.stream().first().devices]
        resp = kubelet.client().allocate(ids[1:]).container_responses[0]
        assert plugin.spec_path and resp.cdi_devices  # the CDI names are there, and containerd 1.6 ignores them
        env = {"NVIDIA_VISIBLE_DEVICES": "all", **dict(resp.envs)}  # a CUDA image's own default, then kubelet's
        with private_containerd(tmp_path / "containerd", daemon_env) as containerd:
            # What a CDI runtime would start: the spec's NVIDIA_VISIBLE_DEVICES=void over Allocate's. No record.
            applied = containerd.run(rootfs, "applied", {**env, "NVIDIA_VISIBLE_DEVICES": "void"},
                                     ["sh", "-c", PROBE], runc_binary=SHIM)
            assert applied.returncode == 0 and applied.stdout.split() == [], applied.stderr
            assert not (state / "cdi-ignored").exists()  # (the plugin's key is there: it seals its marker)
            result = containerd.run(rootfs, "gpu1", env, ["sh", "-c", PROBE], runc_binary=SHIM)
            assert result.returncode == 0, result.stderr
            assert result.stdout.split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
            deadline = time.monotonic() + 10
            while not ignored_lines(caplog):
                assert time.monotonic() < deadline, "the plugin never said the runtime ignored the CDI devices"
                time.sleep(0.05)
            again = containerd.run(rootfs, "gpu2", env, ["sh", "-c", PROBE], runc_binary=SHIM)
            assert again.returncode == 0 and "nvidia1" in again.stdout.split(), again.stderr
            plain = containerd.run(rootfs, "plain", {}, ["sh", "-c", PROBE], runc_binary=SHIM)
            assert plain.returncode == 0 and plain.stdout.split() == []  # no request: untouched
        time.sleep(0.3)  # room for a second line, which must not come
    (line,) = ignored_lines(caplog)
    assert line.startswith(f"{IGNORED}gpu1 ({','.join(c.name for c in resp.cdi_devices)}) at ")
    assert "enable CDI in the runtime (containerd >= 1.7: enable_cdi)" in line
    assert next(r for r in caplog.records if r.getMessage() == line).levelno == logging.WARNING
    log = (tmp_path / "gpuhook.log").read_text()
    assert " runtime inject devices=" in log and " applied runtime skip request=void" in log
