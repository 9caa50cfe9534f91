"""Bind mounts into a rootfs (inject/mounts.py): the flags a bind ends up with are a bind remount's, whichever way
the kernel is asked (mount_setattr since Linux 5.12, the two mount(2) calls before), and no bind propagates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.e2e import need_root
from support.runc import run_in_child

from gpuhook import _native as nat
from gpuhook.inject import mounts
from gpuhook.inject.mountinfo import read_mounts
from gpuhook.inject.rootfs import RootFS

FLAGS = {"ro": os.ST_RDONLY, "nosuid": os.ST_NOSUID, "nodev": os.ST_NODEV, "noexec": os.ST_NOEXEC}


def flags_of(path: Path) -> set[str]:
    got = os.statvfs(path).f_flag
    return {name for name, bit in FLAGS.items() if got & bit}


def optional_fields(path: Path) -> str:
    """mountinfo's optional fields (shared:N, master:N) of the last mount at `path`, "" for a private one."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        lines = [line.split(" - ")[0].split()[6:] for line in f if line.split()[4] == str(path)]
    return " ".join(lines[-1])


@pytest.mark.parametrize("kernel", ["mount_setattr", "remount"])
@pytest.mark.parametrize("options", [("ro", "nosuid", "nodev"), ("ro", "nosuid", "nodev", "noexec"), ("ro",)])
def test_bind_has_exactly_its_options_and_no_propagation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         kernel: str, options: tuple[str, ...]) -> None:
    """A host file on a nosuid,noexec,nodev mount, bound into a rootfs whose mount is shared: the bind has the
    listed options and none of the host's others (a library from a noexec mount must stay mappable), and it is
    private, so nothing mounted on it reaches the host. The same through mount_setattr and through the two
    mount(2) calls that a kernel before 5.12 gets (the path mounts.set_options falls back to on ENOSYS)."""
    need_root()
    if kernel == "remount":
        monkeypatch.setitem(mounts._setattr, "missing", True)
    host, rootfs = tmp_path / "host", tmp_path / "rootfs"
    host.mkdir()
    rootfs.mkdir()

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE, None)
        nat.mount("tmpfs", str(host), "tmpfs", nat.MS_NOSUID | nat.MS_NOEXEC | nat.MS_NODEV, "size=64k")
        (host / "libx.so.1").write_bytes(b"\x7fELF")
        nat.mount("tmpfs", str(rootfs), "tmpfs", 0, "size=64k")
        nat.mount(None, str(rootfs), None, nat.MS_SHARED, None)
        assert optional_fields(rootfs).startswith("shared:")
        tree = mounts.clone_source(str(host / "libx.so.1"))
        try:
            with RootFS(str(rootfs)) as root:
                mounts.bind(root, tree, "/usr/lib/libx.so.1", options)
        finally:
            os.close(tree)
        target = rootfs / "usr/lib/libx.so.1"
        assert (flags_of(target), optional_fields(target)) == (set(options), "")
        assert target.read_bytes() == b"\x7fELF"
        assert [m.mountpoint for m in read_mounts()].count(str(target)) == 1

    run_in_child(child)
    assert mounts._setattr["missing"] is (kernel == "remount")  # the child's learning stays in the child


def test_set_options_names_the_mount_by_descriptor(tmp_path: Path) -> None:
    """set_options on a descriptor that is no mount's root (a folder inside one) fails with the kernel's error
    rather than changing the mount that holds it."""
    need_root()
    top = tmp_path / "top"
    top.mkdir()

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE, None)
        nat.mount("tmpfs", str(top), "tmpfs", 0, "size=64k")
        (top / "inner").mkdir()
        fd = os.open(top / "inner", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with pytest.raises(OSError):
                mounts.set_options(fd, ("ro",), private=True)
        finally:
            os.close(fd)
        assert "ro" not in flags_of(top)

    run_in_child(child)
