"""A container root file system of a static busybox, for containers on the simulated driver.

What `gpuhook demo`, the end-to-end tests and the benchmarks start: a statically linked busybox (Debian's
busybox-static) runs in an otherwise empty rootfs, so no image and no loader is needed. Nothing here needs
pytest; the tests' gate (skip or fail without a busybox) is tests/support/runc.py's `need_busybox()`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
DEFAULT_APPLETS = (
    "sh", "cat", "ls", "sleep", "stat", "readlink", "mount", "umount", "test", "[", "echo", "true", "false",
    "mkdir", "mknod", "rm", "ln", "touch", "id", "env", "grep", "head", "tail", "wc", "find", "dd", "printf",
    "chmod", "uname", "ps", "kill", "hexdump", "od", "cut", "sort", "tr", "sed", "which", "realpath",
)  # fmt: skip
TOP_DIRS = ("bin", "dev", "proc", "sys", "tmp", "etc", "root", "run", "usr/bin", "usr/lib", "var")
INSTALL_HINT = "apt-get install busybox-static"

_PT_INTERP = 3


def is_static_elf(path: str | os.PathLike[str]) -> bool:
    """A 64-bit ELF without a PT_INTERP program header: it needs no dynamic loader."""
    with open(path, "rb") as f:
        data = f.read(4096)
    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2:
        return False
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    for i in range(phnum):
        off = phoff + i * phentsize
        if off + 4 <= len(data) and int.from_bytes(data[off : off + 4], "little") == _PT_INTERP:
            return False
    return True


def find_static_busybox() -> str | None:
    """The first statically linked busybox of BUSYBOX_CANDIDATES, or None."""
    for candidate in BUSYBOX_CANDIDATES:
        if Path(candidate).is_file() and is_static_elf(candidate):
            return candidate
    return None


def busybox_rootfs(dest: str | os.PathLike[str], applets: Sequence[str] = DEFAULT_APPLETS) -> Path:
    """`dest`: a static busybox in /bin with a symlink per applet, the usual empty top-level directories, and
    an /etc/passwd and /etc/group with root. FileNotFoundError without a static busybox."""
    busybox = find_static_busybox()
    if busybox is None:
        raise FileNotFoundError(f"no static busybox found ({INSTALL_HINT})")
    rootfs = Path(dest)
    for sub in TOP_DIRS:
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, rootfs / "bin" / "busybox")
    for applet in applets:
        link = rootfs / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\n")
    return rootfs
