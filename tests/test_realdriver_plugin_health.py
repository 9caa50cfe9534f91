"""The device plugin's health thread on NVIDIA's real user space never creates device nodes.

Run as root on a host whose kernel module is not loaded (a node booting, or this one), NVIDIA's libnvidia-ml
creates /dev/nvidiactl when it is initialised. Discovery runs NVML in a child without CAP_MKNOD; the plugin's
health thread loaded it in-process with every capability and made the node in the host's /dev. Both checks
here run in a forked child with a private mount namespace whose /dev is an empty tmpfs, so whatever NVML does
lands there, never in the host's /dev: first the control (NVML initialised with CAP_MKNOD does make the node),
then the health monitor, which must leave /dev as it found it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import pytest
from support.e2e import need_root
from support.realdriver import RealRoot
from support.runc import run_in_child

from gpuhook import _native
from gpuhook.discover import Roots, discover, nvml_library
from gpuhook.plugin import devices as plugin_devices
from gpuhook.plugin.health import HealthConfig, HealthMonitor
from gpuhook.plugin.state import HealthBoard

pytestmark = pytest.mark.usefixtures("no_host_nodes")


def private_dev() -> None:
    """In the calling (forked) process: a private mount namespace whose /dev is an empty tmpfs."""
    _native.unshare(_native.CLONE_NEWNS)
    _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
    _native.mount("tmpfs", "/dev", "tmpfs", _native.MS_NOSUID | _native.MS_NOEXEC, "size=64k,mode=755")


def nvidia_nodes() -> list[str]:
    return sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))


def test_health_thread_creates_no_device_node(real_driver_debian: RealRoot) -> None:
    need_root()
    real = real_driver_debian
    library = nvml_library(str(real.root))
    assert library, "no libnvidia-ml in the real driver root"
    inv = discover(Roots.make(str(real.root), str(real.dev_root), str(real.proc_root)))
    devices = [d for r in plugin_devices.plan(inv, plugin_devices.Options()) for d in r.devices]
    assert devices

    def control() -> None:
        private_dev()
        errors: list[object] = []
        thread = threading.Thread(target=lambda: errors.append(ctypes.CDLL(library).nvmlInit_v2()))
        thread.start()
        thread.join(60)
        assert "nvidiactl" in nvidia_nodes(), f"the control made no node (nvmlInit: {errors}): the check sees nothing"

    def monitored() -> None:
        private_dev()
        monitor = HealthMonitor(inv, devices, HealthBoard(), HealthConfig(interval=0.1, event_wait_ms=50), library)
        monitor.start()
        time.sleep(2.0)
        monitor.stop()
        assert nvidia_nodes() == [], f"the health thread's NVML created {nvidia_nodes()}"
        assert Path("/proc/self/status").exists()

    run_in_child(control)
    run_in_child(monitored)
