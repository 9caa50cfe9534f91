"""A small Debian-like glibc rootfs for end-to-end tests: busybox applets, the host's loader and libc, and
`gpuprobe` (dlopen("libcuda.so.1") + cuDeviceGetCount), with no ld.so.cache until a hook builds one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .runc import busybox_rootfs

MULTIARCH = "usr/lib/x86_64-linux-gnu"
PROBE_SOURCE = Path(__file__).with_name("csrc") / "gpuprobe.c"
_HOST_LIBS = ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6")


def build_probe(out_dir: Path) -> Path:
    out = out_dir / "gpuprobe"
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-O1", "-o", str(out), str(PROBE_SOURCE)], check=True, capture_output=True)
    return out


def glibc_rootfs(dir: str | os.PathLike[str], probe_cache: Path | None = None) -> Path:
    """`dir`/rootfs laid out like a merged-/usr Debian image (/lib -> usr/lib, ld.so.conf.d)."""
    rootfs = busybox_rootfs(dir)
    (rootfs / MULTIARCH).mkdir(parents=True, exist_ok=True)
    for link, target in (("lib", "usr/lib"), ("lib64", "usr/lib64")):
        if not (rootfs / link).exists():
            (rootfs / link).symlink_to(target)
    (rootfs / "usr/lib64").mkdir(parents=True, exist_ok=True)
    for host in _HOST_LIBS:
        real = Path(os.path.realpath(host))
        shutil.copy2(real, rootfs / MULTIARCH / Path(host).name)
    (rootfs / "usr/lib64/ld-linux-x86-64.so.2").symlink_to("../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    (rootfs / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (rootfs / "etc/ld.so.conf.d").mkdir(exist_ok=True)
    (rootfs / "etc/ld.so.conf.d/libc.conf").write_text("/usr/local/lib\n")
    probe = build_probe(probe_cache or Path(dir) / "probe-build")
    shutil.copy2(probe, rootfs / "usr/bin/gpuprobe")
    return rootfs
