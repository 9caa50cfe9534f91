"""A cheap digest of what would change an inventory: driver version, device node set, MIG layout, and the
driver's files (the identity and mtime of the ld cache and of each folder discovery searches for libraries: a
package manager's add, remove, replace or relink changes a folder, and runs ldconfig).

Computed on every hook run to decide whether the cached inventory is still true, so it reads no library,
loads no NVML and costs a handful of syscalls. SHA-256 comes from CPython's built-in module where there is one:
`hashlib` would load OpenSSL's libcrypto (about 2 ms per container start) for the same digest.
"""

from __future__ import annotations

import os

from gpuhook.discover.roots import Roots, join
from gpuhook.model.catalogue import LD_CACHE, LIB32_SCAN_DIRS, LIB64_SCAN_DIRS

try:
    from _sha256 import sha256  # CPython <= 3.11
except ImportError:
    try:
        from _sha2 import sha256  # type: ignore[import-not-found, no-redef]  # CPython >= 3.12
    except ImportError:
        from hashlib import sha256  # type: ignore[assignment]


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _version_text(roots: Roots) -> str:
    try:
        with open(os.path.join(roots.proc_root, "driver/nvidia/version"), "rb") as f:
            return f.read(200).decode(errors="replace")
    except OSError:
        pass
    # No procfs view: the NVML library's real file name carries the version.
    lib = join(roots.driver_root, "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
    try:
        return os.readlink(lib)
    except OSError:
        return ""


def _mig_layout(proc_root: str) -> list[str]:
    caps = os.path.join(proc_root, "driver/nvidia/capabilities")
    layout: list[str] = []
    for gpu in _listdir(caps):
        mig = os.path.join(caps, gpu, "mig")
        for gi in _listdir(mig):
            layout.append(f"{gpu}/{gi}:" + ",".join(_listdir(os.path.join(mig, gi))))
    return layout


def _stamp(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def fingerprint(roots: Roots) -> str:
    h = sha256()
    h.update(_version_text(roots).encode())
    dev = join(roots.dev_root, "/dev")
    h.update(("|".join(n for n in _listdir(dev) if n.startswith("nvidia"))).encode())
    h.update(("|".join(_listdir(os.path.join(dev, "nvidia-caps")))).encode())
    # Datacenter nodes come and go without a driver change (an admin makes IMEX channels, RDMA modules load).
    h.update(("|".join(_listdir(os.path.join(dev, "nvidia-caps-imex-channels")))).encode())
    h.update(("|".join(_listdir(os.path.join(dev, "infiniband")))).encode())
    h.update(str(os.path.exists(os.path.join(dev, "gdrdrv"))).encode())
    h.update(("|".join(_listdir(os.path.join(roots.proc_root, "driver/nvidia/gpus")))).encode())
    h.update(("|".join(_mig_layout(roots.proc_root))).encode())
    h.update(f"{roots.driver_root}|{roots.dev_root}|{roots.proc_root}".encode())
    for folder in (LD_CACHE, *LIB64_SCAN_DIRS, *LIB32_SCAN_DIRS):
        h.update(f"|{_stamp(join(roots.driver_root, folder))}".encode())
    return h.hexdigest()[:32]
