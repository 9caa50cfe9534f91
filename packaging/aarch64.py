"""The aarch64 wheel (NVIDIA's Grace systems: GH200, GB200), cross-built on x86-64 with Debian's cross compiler.

gpuhook's Python is the same on every architecture; only two files of the wheel are machine code: the cffi
extension `gpuhook/_native/_gpuhook_native.abi3.so` and the static native hook entry `gpuhook/_native/gpuhook-entry`.
Both are compiled with Debian 12's aarch64-linux-gnu-gcc (the extension from the C source cffi emits, against the
headers of Debian's arm64 libpython3.11-dev), put in place of the x86-64 ones in a copy of the x86-64 wheel, and
`auditwheel repair` tags the result (manylinux_2_17_aarch64: glibc's aarch64 baseline). tests/test_packaging.py
loads it under qemu-user in an arm64 root.

Debian's cross compilers conflict with gcc-multilib (which the simulated driver's 32-bit libraries need), so the
compiler is never installed on the build machine: mmdebstrap unpacks it (and the arm64 headers) into a toolchain
root of its own, without running any package's code, kept under $GPUHOOK_CROSS_CACHE (default
/var/cache/gpuhook-cross) for later builds, and the compiler runs chrooted there.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CC = "/usr/bin/aarch64-linux-gnu-gcc"
PYTHON = "3.11"  # the headers' Python (any >= 3.9 builds the same abi3 extension)
PLATFORM = "manylinux_2_17_aarch64"
NATIVE = "gpuhook/_native/"
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
# what the toolchain root holds; its folder is named after it, so a change makes a new one
PACKAGES = ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", f"libpython{PYTHON}-dev:arm64")
MIRROR = "http://deb.debian.org/debian"


def toolchain_root() -> Path:
    """Debian 12's aarch64 cross compiler and arm64 Python headers, unpacked once into the cache."""
    cache = Path(os.environ.get("GPUHOOK_CROSS_CACHE", "/var/cache/gpuhook-cross"))
    key = hashlib.sha256(" ".join(("bookworm", *PACKAGES)).encode()).hexdigest()[:12]
    root = cache / f"bookworm-arm64-{key}"
    if not (root / CC.lstrip("/")).exists():
        if shutil.which("mmdebstrap") is None:
            raise SystemExit("packaging/build: the aarch64 wheel needs mmdebstrap (apt-get install mmdebstrap), "
                             "or --no-aarch64")
        part = root.with_name(root.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mmdebstrap", "--quiet", "--variant=extract", "--architectures=amd64,arm64",
                        f"--include={','.join(PACKAGES)}", "--format=directory", "bookworm", str(part),
                        f"deb {MIRROR} bookworm main"], check=True)
        part.rename(root)
    return root


def compile_native(repo: Path, root: Path) -> tuple[Path, Path]:
    """(the extension, the entry) for aarch64, compiled in the toolchain root `root`."""
    native = repo / "src" / "gpuhook" / "_native"
    sys.path.insert(0, str(native))
    try:
        import _build
    finally:
        sys.path.remove(str(native))
    build = root / "build"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    for path in [*native.glob("*.c"), *native.glob("*.h")]:
        shutil.copyfile(path, build / path.name)
    _build.make_builder(absolute=True).emit_c_code(str(build / "_cffi_module.c"))
    chroot = ["chroot", str(root)] if os.geteuid() == 0 else ["unshare", "--map-root-user", "chroot", str(root)]
    # the cross sysroot's libc headers first; only the arm64 pyconfig.h comes from /usr/include
    includes = [f"-I/usr/include/python{PYTHON}", "-I/build", "-idirafter", "/usr/include"]
    subprocess.run([*chroot, CC, "-shared", "-fPIC", *CFLAGS, *includes, "/build/_cffi_module.c",
                    *(f"/build/{name}" for name in _build.SOURCES), "-Wl,--wrap=pthread_sigmask", "-s",
                    "-o", "/build/_gpuhook_native.abi3.so"], check=True)
    subprocess.run([*chroot, CC, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-fPIE", "-static-pie", "-s",
                    "/build/entry.c", "-o", "/build/gpuhook-entry"], check=True)
    return build / "_gpuhook_native.abi3.so", build / "gpuhook-entry"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def retarget(wheel: Path, binaries: dict[str, Path], dest: Path) -> Path:
    """A copy of `wheel` with `binaries` (name in the wheel -> file) replaced, tagged linux_aarch64."""
    name = wheel.name.split("-")
    target = dest / ("-".join(name[:4]) + "-linux_aarch64.whl")
    records: list[str] = []
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        record = next(n for n in old.namelist() if n.endswith(".dist-info/RECORD"))
        for item in old.infolist():
            if item.filename == record or item.is_dir():  # folders are implied by their files
                continue
            data = binaries[item.filename].read_bytes() if item.filename in binaries else old.read(item)
            if item.filename.endswith(".dist-info/WHEEL"):
                lines = [line for line in data.decode().splitlines() if not line.startswith("Tag:")]
                data = ("\n".join(lines) + "\nTag: cp39-abi3-linux_aarch64\n").encode()
            info = zipfile.ZipInfo(item.filename, date_time=item.date_time)
            info.external_attr = item.external_attr
            new.writestr(info, data, zipfile.ZIP_DEFLATED)
            records.append(_record_line(item.filename, data))
        new.writestr(record, "\n".join([*records, f"{record},,"]) + "\n")
    return target


def build_wheel(x86_wheel: Path, out: Path, work: Path, repo: Path, run: object) -> Path:
    """The aarch64 wheel beside the x86-64 one in `out`. `run`: packaging/build's tool runner."""
    root = toolchain_root()
    extension, entry = compile_native(repo, root)
    raw = work / "aarch64-raw"
    raw.mkdir()
    linux = retarget(x86_wheel, {NATIVE + "_gpuhook_native.abi3.so": extension, NATIVE + "gpuhook-entry": entry}, raw)
    shutil.rmtree(root / "build")
    # --plat names only this machine's architecture's tags; auto takes the wheel's (and must come to PLATFORM)
    run(sys.executable, "-m", "auditwheel", "repair", "--plat", "auto", "--wheel-dir", out, linux)  # type: ignore[operator]
    repaired = list(out.glob(f"gpuhook-*-abi3-*{PLATFORM}.whl"))
    if len(repaired) != 1:
        raise SystemExit(f"packaging/build: auditwheel did not tag the aarch64 wheel {PLATFORM}: "
                         f"{sorted(p.name for p in out.glob('*aarch64*.whl'))}")
    return repaired[0]
