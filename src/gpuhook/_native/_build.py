"""cffi build script (API mode, out of line) for `gpuhook._native._gpuhook_native`.

The package build runs it through `cffi_modules` in pyproject.toml, from the project root, where setuptools
wants source paths relative to that root. Run directly (`python src/gpuhook/_native/_build.py`) it compiles
into a temporary directory and copies the extension next to this file, for an in-place development build.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = "gpuhook_native.h"
SOURCES = ("gpuhook_native.c", "confine.c")
MODULE = "gpuhook._native._gpuhook_native"

# Values taken from the system headers at build time (cffi fills in each `...`).
CONSTANTS = (
    "MS_RDONLY", "MS_NOSUID", "MS_NODEV", "MS_NOEXEC", "MS_REMOUNT", "MS_BIND", "MS_MOVE", "MS_REC",
    "MS_PRIVATE", "MS_SLAVE", "MS_SHARED", "MS_UNBINDABLE", "MS_RELATIME", "MS_NOATIME", "MS_STRICTATIME",
    "MNT_FORCE", "MNT_DETACH", "MNT_EXPIRE", "UMOUNT_NOFOLLOW",
    "CLONE_NEWNS", "CLONE_NEWCGROUP", "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWUSER", "CLONE_NEWPID",
    "CLONE_NEWNET", "CLONE_FS",
    "O_PATH", "O_CLOEXEC", "O_DIRECTORY", "O_NOFOLLOW", "O_RDONLY", "O_WRONLY", "O_RDWR", "O_CREAT",
    "O_EXCL", "O_TRUNC", "AT_FDCWD",
    "S_IFCHR", "S_IFBLK", "S_IFIFO", "S_IFREG",
    "BPF_CGROUP_DEVICE", "BPF_PROG_TYPE_CGROUP_DEVICE", "BPF_F_ALLOW_OVERRIDE", "BPF_F_ALLOW_MULTI",
    "BPF_F_REPLACE",
)

# RESOLVE_* (<linux/openat2.h>) and the mount API flags are missing from older headers; their values are
# fixed ABI.
PREAMBLE = """
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <linux/bpf.h>
#include "gpuhook_native.h"
#ifndef RESOLVE_NO_XDEV
#define RESOLVE_NO_XDEV 0x01
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_NO_SYMLINKS 0x04
#define RESOLVE_BENEATH 0x08
#define RESOLVE_IN_ROOT 0x10
#endif
#ifndef RESOLVE_CACHED
#define RESOLVE_CACHED 0x20
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
"""
FALLBACKS = ("RESOLVE_NO_XDEV", "RESOLVE_NO_MAGICLINKS", "RESOLVE_NO_SYMLINKS", "RESOLVE_BENEATH",
             "RESOLVE_IN_ROOT", "RESOLVE_CACHED", "OPEN_TREE_CLONE", "OPEN_TREE_CLOEXEC",
             "MOVE_MOUNT_F_EMPTY_PATH", "AT_RECURSIVE", "AT_EMPTY_PATH")


def _cdef() -> str:
    """The header's declarations (between its CDEF markers) plus the constants, so nothing is written twice."""
    text = (HERE / HEADER).read_text()
    begin, end = "/* CDEF BEGIN */", "/* CDEF END */"
    body = text[text.index(begin) + len(begin) : text.index(end)]
    return body + "".join(f"#define {name} ...\n" for name in CONSTANTS + FALLBACKS)


def make_builder(absolute: bool) -> FFI:
    """Relative paths for setuptools (it builds from the project root); absolute ones for a direct run,
    because cffi's own compile() changes directory."""
    here = str(HERE) if absolute else os.path.relpath(HERE)
    builder = FFI()
    builder.cdef(_cdef())
    builder.set_source(
        MODULE,
        PREAMBLE,
        sources=[os.path.join(here, name) for name in SOURCES],
        include_dirs=[here],
        extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        # confine.c's pthread_sigmask goes to gpuhook_native.c's raw rt_sigprocmask: no glibc 2.32 symbol
        extra_link_args=["-Wl,--wrap=pthread_sigmask"],
    )
    return builder


ffibuilder = make_builder(absolute=False)


def build_inplace() -> Path:
    """Compile in a scratch directory and copy the extension beside this file."""
    with tempfile.TemporaryDirectory(prefix="gpuhook-native-") as tmp:
        built = Path(make_builder(absolute=True).compile(tmpdir=tmp, verbose=False))
        target = HERE / built.name
        shutil.copy2(built, target)
    return target


if __name__ == "__main__":
    print(build_inplace(), file=sys.stderr)
