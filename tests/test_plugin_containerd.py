"""Issue 25, item 0: the device plugin's default device-list strategy on a node whose runtime has no CDI.

kubelet's device manager (tests/support/kubelet.py) allocates one GPU; the container is then started by a real
containerd 1.6 (Debian 12's, no CDI: it ignores Allocate's cdi_devices) through gpuhook's shim, with the
environment CRI builds (the image's, then Allocate's envs). It must see exactly the allocated GPU."""

from __future__ import annotations

import sys
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


def test_allocated_gpu_reaches_a_containerd_1_6_container(fake_driver: Any, kubelet: TestKubelet,
                                                          tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'driver-root = "{fake_driver.root}"\nproc-root = "{fake_driver.root}/proc"\n'
                      f'log-file = "{tmp_path}/gpuhook.log"\ninventory-cache = ""\n')
    rootfs = glibc_rootfs(tmp_path / "image", probe_cache=tmp_path / "probe")
    with running(fake_driver, kubelet, Options()) as plugin:
        kubelet.wait_registrations(1)
        ids = [d.ID for d in kubelet.stream().first().devices]
        resp = kubelet.client().allocate(ids[1:]).container_responses[0]
        assert plugin.spec_path and resp.cdi_devices  # the CDI names are there, and containerd 1.6 ignores them
    env = {"NVIDIA_VISIBLE_DEVICES": "all", **dict(resp.envs)}  # a CUDA image's own default, then kubelet's
    with private_containerd(tmp_path / "containerd", {"GPUHOOK_CONFIG": str(config)}) as containerd:
        result = containerd.run(rootfs, "gpu1", env, ["sh", "-c", PROBE], runc_binary=SHIM)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
        plain = containerd.run(rootfs, "plain", {}, ["sh", "-c", PROBE], runc_binary=SHIM)
        assert plain.returncode == 0 and plain.stdout.split() == []  # no request: untouched
    assert " runtime inject devices=" in (tmp_path / "gpuhook.log").read_text()
