"""CUDA forward compatibility, as NVIDIA's `enable-cuda-compat` hook does it.

An image built for a newer CUDA than the host driver supports may ship NVIDIA's compat libcuda in
/usr/local/cuda/compat (`libcuda.so.<X.Y.Z>`, X the driver major it comes from). When X is greater than the
host driver's major, that folder must come before the host's libcuda in the container's ld cache; an older or
equal one is left out (the host's libcuda is newer). NVIDIA writes the folder to
/etc/ld.so.conf.d/00-compat-<id>.conf, which sorts before its own driver entry; here the folder is also given
first to ldconfig (command-line folders come before configured ones, and the first entry of a soname wins).

The image is read only through RootFS (openat2 in-root): a hostile compat folder or library link cannot lead
outside the rootfs. One implementation for the prestart hook, the CDI spec's container hook and the shim.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator

from gpuhook.errors import InjectionError
from gpuhook.inject import ldcache
from gpuhook.inject.rootfs import RootFS

COMPAT_DIR = "/usr/local/cuda/compat"
CONF_FILE = "/etc/ld.so.conf.d/00-compat-gpuhook.conf"
_COMPAT_LIB = r"libcuda\.so\.([0-9]{1,6})\.[0-9]{1,6}(\.[0-9]{1,6})?"  # compiled at first use
MAX_ENTRIES = 4096  # a compat folder holds a handful of files; an image cannot make us list a million


def _major(version: str) -> int | None:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() and len(head) <= 6 else None


def compat_libraries(rootfs: RootFS) -> list[str]:
    """Names of the regular `libcuda.so.<X.Y[.Z]>` files in the image's compat folder (links ignored)."""
    if not rootfs.exists(COMPAT_DIR):
        return []
    try:
        dfd = rootfs.open(COMPAT_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except InjectionError:
        return []  # not a folder: nothing to enable
    try:
        names: list[str] = []
        with os.scandir(dfd) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_ENTRIES:
                    break
                if re.fullmatch(_COMPAT_LIB, entry.name):
                    st = os.stat(entry.name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        names.append(entry.name)
    finally:
        os.close(dfd)
    return sorted(names)


def compat_folder(rootfs: RootFS, host_driver_version: str) -> str | None:
    """COMPAT_DIR when the image's one compat libcuda comes from a newer driver major than the host's."""
    host_major = _major(host_driver_version)
    libs = compat_libraries(rootfs)
    if host_major is None or len(libs) != 1:  # none, or ambiguous (NVIDIA skips several too)
        return None
    match = re.fullmatch(_COMPAT_LIB, libs[0])
    return COMPAT_DIR if match is not None and int(match.group(1)) > host_major else None


def update_ldcache(rootfs: RootFS, folders: list[str], ldconfig_fd: int, host_driver_version: str,
                   disposable: bool = False) -> None:
    """running() to ldconfig's end, with nothing to do meanwhile."""
    with running(rootfs, folders, ldconfig_fd, host_driver_version, disposable):
        pass


@contextlib.contextmanager
def running(rootfs: RootFS, folders: list[str], ldconfig_fd: int, host_driver_version: str,
            disposable: bool = False) -> Iterator[None]:
    """ldcache.running (`disposable` and the with-block: its), with the image's compat folder first when it is
    newer than the host driver; under the image's lock (ldcache.image_lock), so concurrent starts of one image
    directory take turns."""
    with ldcache.image_lock(rootfs):
        compat = compat_folder(rootfs, host_driver_version) if host_driver_version else None
        if compat is not None:
            rootfs.write_file(CONF_FILE, f"{compat}\n".encode())
            folders = [compat, *(f for f in folders if f != compat)]
        with ldcache.running(rootfs, folders, ldconfig_fd, disposable):
            yield
