"""The hook's /proc/driver/nvidia masking, on a rootfs whose /proc shows a driver (as with a real GPU host).

runc's containers on the simulated driver have a kernel procfs without /proc/driver/nvidia, so the masking
is exercised here directly: a rootfs with a plain /proc/driver/nvidia tree, in a private mount namespace.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from support.e2e import need_root
from support.runc import run_in_child

from gpuhook import _native
from gpuhook.discover import Roots, discover
from gpuhook.inject.apply import _mask_proc
from gpuhook.inject.rootfs import RootFS
from gpuhook.model.edits import Selection, plan


def test_proc_masked_to_selected_gpu(fake_driver: Any, tmp_path: Path) -> None:
    need_root()
    root = Path(fake_driver.root)
    inv = discover(Roots.make(str(root), None, str(root / "proc")))
    edits = plan(inv, Selection(devices=(inv.gpus[1],)))
    rootfs = tmp_path / "rootfs"
    for gpu in fake_driver.gpus:  # what a container's procfs shows on a real host: every GPU
        (rootfs / "proc/driver/nvidia/gpus" / gpu.pci_bus_id).mkdir(parents=True)
    selected, other = fake_driver.gpus[1].pci_bus_id, fake_driver.gpus[0].pci_bus_id

    def child() -> None:
        _native.unshare(_native.CLONE_NEWNS)
        _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
        with RootFS(str(rootfs)) as r:
            _mask_proc(r, edits, str(root / "proc"))
        base = rootfs / "proc/driver/nvidia"
        assert sorted(os.listdir(base / "gpus")) == [selected], os.listdir(base / "gpus")
        assert (base / "gpus" / selected / "information").read_text().startswith("Model:")
        params = (base / "params").read_text()
        assert "ModifyDeviceFiles: 0" in params and "ModifyDeviceFiles: 1" not in params
        assert "DeviceFileMode" in params
        assert fake_driver.driver_version in (base / "version").read_text()
        try:
            (base / "params").write_text("x")
        except OSError:
            pass
        else:
            raise AssertionError("params copy is writable")

    run_in_child(child)
    # nothing of it is visible outside the private namespace
    assert sorted(os.listdir(rootfs / "proc/driver/nvidia/gpus")) == sorted([selected, other])
