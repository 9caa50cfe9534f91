"""CUDA forward compatibility (inject/cudacompat.py), on image folders: which compat libcuda counts, and that the
image cannot point the check outside its rootfs. Containers: tests/test_realdriver_e2e.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuhook.inject.cudacompat import COMPAT_DIR, compat_folder, compat_libraries
from gpuhook.inject.rootfs import RootFS

HOST = "535.309.01"


def image(tmp_path: Path, *names: str) -> Path:
    rootfs = tmp_path / "rootfs"
    folder = rootfs / COMPAT_DIR.lstrip("/")
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(b"\x7fELF")
    return rootfs


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("libcuda.so.550.54.15", "libcuda.so.1", "libcuda.so"), COMPAT_DIR),  # newer major: first in the cache
        (("libcuda.so.550.54",), COMPAT_DIR),
        (("libcuda.so.535.400.01",), None),  # same major: the host's is at least as new
        (("libcuda.so.530.30.02",), None),  # older
        (("libcuda.so.1",), None),  # no version to compare
        (("libcuda.so.550.54.15", "libcuda.so.560.28.03"), None),  # ambiguous: NVIDIA skips it too
        ((), None),
    ],
)
def test_compat_folder(tmp_path: Path, names: tuple[str, ...], expected: str | None) -> None:
    with RootFS(str(image(tmp_path, *names))) as rootfs:
        assert compat_folder(rootfs, HOST) == expected


def test_links_and_folders_are_not_compat_libraries(tmp_path: Path) -> None:
    rootfs = image(tmp_path)
    folder = rootfs / COMPAT_DIR.lstrip("/")
    (folder / "libcuda.so.550.54.15").symlink_to("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    (folder / "libcuda.so.560.1.1").mkdir()
    with RootFS(str(rootfs)) as fs:
        assert compat_libraries(fs) == [] and compat_folder(fs, HOST) is None


def test_compat_folder_link_out_of_the_rootfs_stays_inside(tmp_path: Path) -> None:
    """/usr/local/cuda -> /opt/elsewhere (absolute) resolves inside the image, never on the host."""
    outside = tmp_path / "host-cuda" / "compat"
    outside.mkdir(parents=True)
    (outside / "libcuda.so.550.54.15").write_bytes(b"\x7fELF")
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr/local").mkdir(parents=True)
    (rootfs / "usr/local/cuda").symlink_to(str(tmp_path / "host-cuda"))
    with RootFS(str(rootfs)) as fs:
        assert compat_folder(fs, HOST) is None
    os.unlink(rootfs / "usr/local/cuda")
    (rootfs / "opt/cuda/compat").mkdir(parents=True)
    (rootfs / "opt/cuda/compat/libcuda.so.550.54.15").write_bytes(b"\x7fELF")
    (rootfs / "usr/local/cuda").symlink_to("/opt/cuda")  # inside the image: followed in-root
    with RootFS(str(rootfs)) as fs:
        assert compat_folder(fs, HOST) == COMPAT_DIR


def test_unknown_host_version_enables_nothing(tmp_path: Path) -> None:
    with RootFS(str(image(tmp_path, "libcuda.so.550.54.15"))) as fs:
        assert compat_folder(fs, "") is None
