"""Bind mounts into a rootfs (inject/mounts.py): the flags a bind ends up with are a bind remount's, whichever way
the kernel is asked (mount_setattr since Linux 5.12, the two mount(2) calls before), and no bind propagates."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from support.e2e import need_root
from support.runc import run_in_child

from gpuhook import _native as nat
from gpuhook.errors import InjectionError
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


class _CountedBinds(nat.FileBinds):
    """The real FileBinds, noting which container names its runs made (not the ones they stopped at)."""

    made: list[str] = []

    def __init__(self, items: list[tuple[int, str, int, int, int]], *args: object) -> None:
        super().__init__(items, *args)  # type: ignore[arg-type]
        self.names = [item[1] for item in items]

    def run(self, at: int) -> tuple[int, int, int]:
        stopped, step, err = super().run(at)
        _CountedBinds.made.extend(self.names[at:stopped])
        return stopped, step, err


def _mounted_under(top: Path) -> list[str]:
    return sorted(m.mountpoint[len(str(top)):] for m in read_mounts() if m.mountpoint.startswith(f"{top}/"))


@pytest.mark.parametrize("kernel", ["mount_setattr", "remount"])
def test_bind_all_is_bind_one_by_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """bind_all gives every target what bind() gives it, in a run of the native helper where it can: its runs
    stop at a folder's tree (which covers a folder: the next run looks its folders up again), at a file the
    image already has and at a socket's tree, bind() does those, and the runs go on; every target has its
    options, no propagation, one mount and the host file's content, as bind() one by one makes them."""
    need_root()
    if kernel == "remount":
        monkeypatch.setitem(mounts._setattr, "missing", True)
    monkeypatch.setattr(nat, "FileBinds", _CountedBinds)
    host, one, each = tmp_path / "host", tmp_path / "all", tmp_path / "each"
    lib = "/usr/lib/x86_64-linux-gnu"
    binds = [("liba", f"{lib}/liba.so.1", ("ro", "nosuid", "nodev")),
             ("share", "/usr/share/nvidia", ("ro", "nosuid", "nodev")),
             ("libc", f"{lib}/libc-image.so", ("ro",)),
             ("sock", "/run/nvidia-persistenced/socket", ("ro", "nosuid", "nodev", "noexec")),
             ("libb", f"{lib}/libb.so.1", ("ro", "nosuid", "nodev", "noexec")),
             ("libd", "/usr/share/vulkan/icd.d/nvidia_icd.json", ("ro", "nosuid", "nodev"))]

    def child() -> None:
        import socket

        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE, None)
        for folder in (host, one, each):
            folder.mkdir()
            nat.mount("tmpfs", str(folder), "tmpfs", 0, "size=256k")
        for name in ("liba", "libb", "libc", "libd"):
            (host / name).write_bytes(name.encode())
        (host / "share").mkdir()
        (host / "share" / "nvoptix.bin").write_bytes(b"optix")
        socket.socket(socket.AF_UNIX).bind(str(host / "sock"))
        for top in (one, each):
            (top / lib.lstrip("/")).mkdir(parents=True)
            (top / lib.lstrip("/") / "libc-image.so").write_bytes(b"image's")
        for top, whole in ((one, True), (each, False)):
            trees = [mounts.clone_source(str(host / name)) for name, _, _ in binds]
            try:
                with RootFS(str(top)) as root:
                    work = [(tree, path, options) for tree, (_, path, options) in zip(trees, binds)]
                    if whole:
                        mounts.bind_all(root, work)
                    else:
                        for item in work:
                            mounts.bind(root, *item)
            finally:
                for tree in trees:
                    os.close(tree)
        assert _mounted_under(one) == _mounted_under(each) == sorted(path for _, path, _ in binds)
        for name, path, options in binds:
            target = one / path.lstrip("/")
            assert (flags_of(target), optional_fields(target)) == (set(options), ""), path
            if name == "share":
                assert (target / "nvoptix.bin").read_bytes() == b"optix"
            elif name != "sock":
                assert target.read_bytes() == name.encode()
        expected = [] if kernel == "remount" else ["liba.so.1", "libb.so.1", "nvidia_icd.json"]
        assert _CountedBinds.made == expected

    run_in_child(child)


def test_bind_all_and_symlinks_refuse_a_volume_as_one_by_one(tmp_path: Path) -> None:
    """An image folder that leads onto a volume (another mount in the rootfs): bind_all and symlinks fail with
    the line bind() and symlink() give, and create nothing there."""
    need_root()
    host, rootfs = tmp_path / "host", tmp_path / "rootfs"

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE, None)
        for folder in (host, rootfs):
            folder.mkdir()
            nat.mount("tmpfs", str(folder), "tmpfs", 0, "size=64k")
        (host / "liba").write_bytes(b"a")
        (rootfs / "data").mkdir()
        nat.mount("tmpfs", str(rootfs / "data"), "tmpfs", 0, "size=64k")
        (rootfs / "usr").mkdir()
        (rootfs / "usr" / "lib").symlink_to("/data")
        lines = []

        def refused(make: Callable[..., object], *args: object) -> None:
            with pytest.raises(InjectionError) as caught:
                make(*args)
            lines.append(str(caught.value))

        for whole in (True, False):
            tree = mounts.clone_source(str(host / "liba"))
            try:
                with RootFS(str(rootfs)) as root:
                    if whole:
                        refused(mounts.bind_all, root, [(tree, "/usr/lib/liba.so.1", ("ro",))])
                        refused(root.symlinks, [("liba.so.1", "/usr/lib/liba.so")])
                    else:
                        refused(mounts.bind, root, tree, "/usr/lib/liba.so.1", ("ro",))
                        refused(root.symlink, "liba.so.1", "/usr/lib/liba.so")
            finally:
                os.close(tree)
        assert lines[:2] == lines[2:]
        assert all("leads out of the container's own filesystem" in line for line in lines)
        assert os.listdir(rootfs / "data") == []

    run_in_child(child)


@pytest.mark.parametrize("owner", [None, (1234, 4321)])
def test_symlinks_is_symlink_one_by_one(tmp_path: Path, owner: tuple[int, int] | None) -> None:
    """RootFS.symlinks makes what symlink() one by one makes: new links (in folders it creates), an identical
    link kept, another link replaced (which drops the held folders: the links after it are looked up again), a
    file left alone; with an owner, new links belong to it."""
    if owner is not None:
        need_root()
    lib = "usr/lib/x86_64-linux-gnu"
    pairs = [("libcuda.so.1", f"/{lib}/libcuda.so"), ("libsame.so.1", f"/{lib}/libsame.so"),
             ("libnew.so.1", f"/{lib}/libold.so"), ("libfile.so.1", f"/{lib}/libfile.so"),
             ("libnvidia-ml.so.1", f"/{lib}/libnvidia-ml.so"), ("../card1", "/dev/dri/by-path/pci-0-card")]
    tops = {}
    for whole in (True, False):
        top = tops[whole] = tmp_path / str(whole)
        (top / lib).mkdir(parents=True)
        (top / lib / "libsame.so").symlink_to("libsame.so.1")
        (top / lib / "libold.so").symlink_to("libwrong.so.1")
        (top / lib / "libfile.so").write_text("image's")
        with RootFS(str(top), owner=owner) as root:
            if whole:
                root.symlinks(pairs)
            else:
                for target, link in pairs:
                    root.symlink(target, link)

    def seen(top: Path) -> list[tuple[str, str]]:
        out = []
        for _, link in pairs:
            path = top / link.lstrip("/")
            out.append(("link", os.readlink(path)) if path.is_symlink() else ("file", path.read_text()))
        return out

    assert seen(tops[True]) == seen(tops[False]) == [
        ("link", "libcuda.so.1"), ("link", "libsame.so.1"), ("link", "libnew.so.1"), ("file", "image's"),
        ("link", "libnvidia-ml.so.1"), ("link", "../card1")]
    if owner is not None:
        for name in ("libcuda.so", "libold.so", "libnvidia-ml.so"):
            st = os.lstat(tops[True] / lib / name)
            assert (st.st_uid, st.st_gid) == owner, name
        st = os.lstat(tops[True] / "dev/dri/by-path")
        assert (st.st_uid, st.st_gid) == owner
