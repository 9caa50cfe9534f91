"""Real NVIDIA user-space driver roots for tests, built from Debian's non-free driver packages (535 series).

Two layouts of the same files:

* ``runfile``: what NVIDIA's .run installer leaves on a Debian-like host. Every driver library lies flat in
  /usr/lib/x86_64-linux-gnu with the soname links the installer makes (read from each library's DT_SONAME),
  the X driver and GLX server module under /usr/lib/xorg/modules, nvoptix.bin in /usr/share/nvidia, the GBM
  backend link gbm/nvidia-drm_gbm.so -> ../libnvidia-allocator.so.1, the tools in /usr/bin.
* ``debian``: the packages as dpkg unpacks them (most libraries in /usr/lib/x86_64-linux-gnu/nvidia/current,
  the tools in /usr/lib/nvidia/current), plus the alternatives links their maintainer scripts register
  (/usr/lib/x86_64-linux-gnu/libcuda.so.1 -> /etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu ->
  .../nvidia/current/libcuda.so.1 and so on). The slave lists are read from the packages' own postinst
  scripts, not restated here. Debian adds no ld.so.conf.d entry: the loader finds the libraries through
  those links.

Beside NVIDIA's files each root holds gpuhook's simulated kernel side, built with the same driver version:
real character device nodes under /dev, the kernel module's /proc/driver/nvidia text, /sys PCI entries and
the persistenced socket. The simulated libraries and tools are removed first, so every library and binary
in a root is NVIDIA's own. Each root has its own etc/ld.so.cache made by `ldconfig -r`.

The .debs are downloaded once into a cache that persists between runs ($GPUHOOK_DEB_CACHE, default
/var/cache/gpuhook-test-debs) with a private apt state under it: the host's Debian sources with the
contrib, non-free and non-free-firmware components added. Nothing under /etc/apt is changed. Unpacked
packages are cached there too, and roots are built from them with hard links, so a root's files share
inodes with the cache: treat them as read-only.

Run as a script to fill the cache (CI does this): ``python3 tests/support/realdriver.py fetch``.
This module imports gpuhook only to build the simulated kernel side, and only when a root is built.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuhook.fakedriver import FakeDriver

DEB_CACHE_ENV = "GPUHOOK_DEB_CACHE"
DEFAULT_DEB_CACHE = Path("/var/cache/gpuhook-test-debs")
LAYOUTS = ("runfile", "debian")
DEB_ARCH = "amd64"
MULTIARCH = "x86_64-linux-gnu"
LIB_DIR = f"/usr/lib/{MULTIARCH}"
DEBIAN_LIB_DIR = f"{LIB_DIR}/nvidia/current"  # where libcuda1 & co put their libraries
DEBIAN_PRIVATE_DIR = "/usr/lib/nvidia/current"  # nvidia-smi, nvidia_drv.so, libglxserver_nvidia.so.<ver>
NONFREE_COMPONENTS = ("main", "contrib", "non-free", "non-free-firmware")

# Built from the nvidia-graphics-drivers source: every one carries the driver version as its own.
DRIVER_PACKAGES: tuple[str, ...] = (
    "libcuda1",
    "libcudadebugger1",
    "libnvidia-ml1",
    "nvidia-smi",
    "libnvidia-ptxjitcompiler1",
    "libnvidia-nvvm4",
    "libnvidia-pkcs11-openssl3",
    "nvidia-opencl-icd",
    "nvidia-opencl-common",
    "nvidia-cuda-mps",
    "nvidia-driver-bin",
    "nvidia-modprobe",
    "libnvcuvid1",
    "libnvidia-encode1",
    "libnvidia-opticalflow1",
    "nvidia-vdpau-driver",
    "firmware-nvidia-gsp",
    "libnvidia-glcore",
    "libglx-nvidia0",
    "libegl-nvidia0",
    "libgles-nvidia1",
    "libgles-nvidia2",
    "libnvidia-eglcore",
    "libnvidia-glvkspirv",
    "libnvidia-rtcore",
    "libnvidia-cfg1",
    "libnvidia-allocator1",
    "libnvidia-api1",
    "libnvoptix1",
    "libnvidia-fbc1",
    "libnvidia-ngx1",
    "nvidia-egl-common",
    "nvidia-vulkan-common",
    "xserver-xorg-video-nvidia",
    "nvidia-kernel-support",
    "nvidia-alternative",
)
# Other sources, other versions: the EGL platform libraries, persistenced, the GLX alternative scripts.
OTHER_PACKAGES: tuple[str, ...] = (
    "libnvidia-egl-gbm1",
    "libnvidia-egl-wayland1",
    "nvidia-persistenced",
    "glx-alternative-nvidia",
)
PACKAGES: tuple[str, ...] = DRIVER_PACKAGES + OTHER_PACKAGES

# Directories that other packages of a Debian desktop install provide. The alternatives scripts add a slave
# link only where its directory exists, so these decide which links a real system gets. Checked against
# bookworm: xserver-xorg-core ships the xorg module and xorg.conf.d folders, libvdpau1 the vdpau folder;
# libgbm1 (mesa 22.3) ships no gbm/ folder, so a bookworm system gets no gbm/nvidia-drm_gbm.so link.
DEBIAN_SYSTEM_DIRS: tuple[str, ...] = (
    "/usr/bin",
    "/usr/sbin",
    "/usr/lib/xorg/modules/drivers",
    "/usr/lib/xorg/modules/extensions",
    "/usr/share/X11/xorg.conf.d",
    f"{LIB_DIR}/vdpau",
    "/usr/share/man/man1",
    "/etc/modprobe.d",
    "/etc/modules-load.d",
)

# Packaging debris that neither layout keeps.
_SKIP_PREFIXES = ("usr/share/doc/", "usr/share/bug/", "usr/share/lintian/")
_SKIP_PREFIXES_RUNFILE = _SKIP_PREFIXES + (
    "usr/share/initramfs-tools/",
    "etc/nvidia/",  # Debian's modprobe/outputclass store; the outputclass file is placed below
    "etc/init.d/",
    "lib/systemd/",
    "usr/lib/nvidia/check-",
)

_DEB_NAME = re.compile(r"^(?P<package>[^_]+)_(?P<version>[^_]+)_(?P<arch>[^_.]+)\.deb$")


class RealDriverUnavailable(RuntimeError):
    """The packages cannot be had (no apt, no archive, no network): tests should skip, or fail in CI."""


# ---- ELF ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElfDynamic:
    soname: str | None
    needed: tuple[str, ...]


def elf_dynamic(path: str | os.PathLike[str]) -> ElfDynamic | None:
    """DT_SONAME and DT_NEEDED of a little-endian ELF file; None when `path` is not ELF."""
    with open(path, "rb") as f:
        data = f.read(64)
        if len(data) < 52 or data[:4] != b"\x7fELF" or data[5] != 1:
            return None
        is64 = data[4] == 2
        if is64:
            phoff, phentsize, phnum = struct.unpack_from("<Q", data, 32)[0], *struct.unpack_from("<HH", data, 54)
        else:
            phoff, phentsize, phnum = struct.unpack_from("<I", data, 28)[0], *struct.unpack_from("<HH", data, 42)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
        dynamic: tuple[int, int] | None = None
        for i in range(phnum):
            if is64:
                p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            else:
                p_type, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIIII", table, i * phentsize)
            if p_type == 1:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == 2:
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            return ElfDynamic(None, ())
        f.seek(dynamic[0])
        raw = f.read(dynamic[1])
        fmt, size = ("<qQ", 16) if is64 else ("<iI", 8)
        strtab = 0
        soname_off: int | None = None
        needed_offs: list[int] = []
        for i in range(len(raw) // size):
            tag, val = struct.unpack_from(fmt, raw, i * size)
            if tag == 0:
                break
            if tag == 5:
                strtab = val
            elif tag == 14:
                soname_off = val
            elif tag == 1:
                needed_offs.append(val)
        base = next((off + strtab - va for va, off, sz in loads if va <= strtab < va + sz), strtab)

        def string(offset: int) -> str:
            f.seek(base + offset)
            chunk = f.read(256)
            return chunk.split(b"\0", 1)[0].decode()

        return ElfDynamic(string(soname_off) if soname_off is not None else None, tuple(string(o) for o in needed_offs))


# ---- the .deb cache -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deb:
    package: str
    version: str  # Debian version: 535.309.01-0+deb12u1
    path: Path

    @property
    def upstream_version(self) -> str:
        """535.309.01 for 535.309.01-0+deb12u1; 1.1.10 for 1:1.1.10-1."""
        version = self.version.split(":", 1)[-1]
        return version.rsplit("-", 1)[0] if "-" in version else version


def deb_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(DEB_CACHE_ENV) or DEFAULT_DEB_CACHE)


@contextlib.contextmanager
def _locked(cache_dir: Path) -> Iterator[None]:
    """One builder at a time per cache (a CI fetch and a test session may overlap)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _version_key(a: str, b: str) -> int:
    if a == b:
        return 0
    lt = subprocess.run(["dpkg", "--compare-versions", a, "lt", b], check=False).returncode == 0
    return -1 if lt else 1


def _cached_debs(cache_dir: Path) -> dict[str, dict[str, Path]]:
    """package -> {version: path} for every .deb in the cache."""
    found: dict[str, dict[str, Path]] = {}
    for path in cache_dir.glob("*.deb"):
        m = _DEB_NAME.match(path.name)
        if m and m["arch"] in (DEB_ARCH, "all"):
            found.setdefault(m["package"], {})[urllib.parse.unquote(m["version"])] = path
    return found


def _choose(found: Mapping[str, Mapping[str, Path]], packages: Iterable[str]) -> dict[str, Deb] | None:
    """The newest driver version present for every driver package, and the newest of each other package."""
    packages = tuple(packages)
    driver = [p for p in packages if p in DRIVER_PACKAGES]
    other = [p for p in packages if p not in DRIVER_PACKAGES]
    if any(p not in found for p in packages):
        return None
    chosen: dict[str, Deb] = {}
    if driver:
        common = set.intersection(*(set(found[p]) for p in driver))
        if not common:
            return None
        version = max(common, key=functools.cmp_to_key(_version_key))
        chosen.update({p: Deb(p, version, found[p][version]) for p in driver})
    for p in other:
        version = max(found[p], key=functools.cmp_to_key(_version_key))
        chosen[p] = Deb(p, version, found[p][version])
    return chosen


def fetch_debs(
    cache_dir: str | os.PathLike[str] | None = None,
    packages: Iterable[str] = PACKAGES,
    *,
    download: bool = True,
) -> dict[str, Deb]:
    """The driver packages in the cache, downloading whatever is missing; raises RealDriverUnavailable."""
    cache = deb_cache_dir(cache_dir)
    packages = tuple(packages)
    with _locked(cache):
        chosen = _choose(_cached_debs(cache), packages)
        if chosen is not None:
            return chosen
        if not download:
            raise RealDriverUnavailable(f"the NVIDIA driver .debs are not all in {cache} (downloads disabled)")
        found = _cached_debs(cache)
        missing = [p for p in packages if p not in found]
        driver = [p for p in packages if p in DRIVER_PACKAGES]
        if driver and not set.intersection(*(set(found.get(p, {})) for p in driver)):
            missing = sorted(set(missing) | set(driver))  # versions disagree: fetch one consistent set
        _apt_download(cache, missing)
        chosen = _choose(_cached_debs(cache), packages)
        if chosen is None:
            raise RealDriverUnavailable(f"apt-get download left packages missing or mixed in {cache}")
        return chosen


def _nonfree_sources() -> tuple[str, str]:
    """(deb822 text, one-line text): the host's Debian sources with all four components."""
    etc = Path("/etc/apt")
    paragraphs: list[str] = []
    for path in sorted((etc / "sources.list.d").glob("*.sources")):
        for para in re.split(r"\n\s*\n", path.read_text()):
            fields = {m[1].lower(): m[2].strip() for m in re.finditer(r"^([A-Za-z-]+):[ \t]*(.*)$", para, re.M)}
            if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
                continue
            if "main" not in fields.get("components", "").split() or "debian" not in fields.get("uris", ""):
                continue
            lines = ["Types: deb", f"URIs: {fields['uris']}", f"Suites: {fields.get('suites', '')}"]
            lines.append(f"Components: {' '.join(NONFREE_COMPONENTS)}")
            if "signed-by" in fields:
                lines.append(f"Signed-By: {fields['signed-by']}")
            paragraphs.append("\n".join(lines))
    one_line: list[str] = []
    for path in [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) < 4 or words[0] != "deb" or "main" not in words or "debian" not in line:
                continue
            i = 1
            if words[1].startswith("["):  # deb [signed-by=... arch=...] URI SUITE COMPONENTS
                while i < len(words) and not words[i].endswith("]"):
                    i += 1
                i += 1
            if i + 1 < len(words):
                one_line.append(" ".join([*words[: i + 2], *NONFREE_COMPONENTS]))
    if not paragraphs and not one_line:
        raise RealDriverUnavailable("no Debian apt source on this host to take the non-free components from")
    return "\n\n".join(paragraphs) + "\n", "\n".join(one_line) + "\n"


def _apt_download(cache: Path, packages: list[str]) -> None:
    """apt-get update + download with a private state under cache/.apt; /etc/apt is only read."""
    if not packages:
        return
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RealDriverUnavailable("apt-get and dpkg-deb are needed to fetch the NVIDIA driver packages")
    state = cache / ".apt"
    for sub in ("lists/partial", "cache/archives/partial", "sources.list.d"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    deb822, one_line = _nonfree_sources()
    (state / "sources.list.d" / "nonfree.sources").write_text(deb822)
    (state / "sources.list").write_text(one_line)
    opts = [
        f"-oDir::Etc::SourceList={state / 'sources.list'}",
        f"-oDir::Etc::SourceParts={state / 'sources.list.d'}",
        f"-oDir::State::Lists={state / 'lists'}",
        f"-oDir::Cache={state / 'cache'}",
        "-oAPT::Sandbox::User=root",
        "-oAcquire::Retries=1",
        "-oAcquire::http::Timeout=30",
        "-oAcquire::https::Timeout=30",
        "-q",
    ]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    notes: list[str] = []
    for step in (["update"], ["download", *packages]):
        try:
            proc = subprocess.run(
                ["apt-get", *opts, *step], cwd=cache, env=env, capture_output=True, text=True, timeout=900
            )
        except subprocess.TimeoutExpired as e:
            raise RealDriverUnavailable(f"apt-get {step[0]} timed out") from e
        notes += [line for line in proc.stderr.splitlines() if line.startswith(("W:", "E:"))][-3:]
        if proc.returncode != 0:
            raise RealDriverUnavailable(f"apt-get {step[0]} failed: {' | '.join(notes) or proc.stdout[-300:]}")


# ---- unpacking (cached) ---------------------------------------------------------------------------------


def _unpack(deb: Deb, cache: Path) -> Path:
    """cache/unpacked/<deb stem>/{data,control}, made once (atomically) and reused."""
    target = cache / "unpacked" / deb.path.stem
    if (target / ".done").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{deb.path.stem}.", dir=target.parent))
    try:
        subprocess.run(["dpkg-deb", "-x", str(deb.path), str(tmp / "data")], check=True, capture_output=True)
        subprocess.run(["dpkg-deb", "-e", str(deb.path), str(tmp / "control")], check=True, capture_output=True)
        (tmp / ".done").touch()
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def unpack_all(debs: Mapping[str, Deb], cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """package -> unpacked folder (with data/ and control/)."""
    cache = deb_cache_dir(cache_dir)
    with _locked(cache), ThreadPoolExecutor(max_workers=2) as pool:
        # Biggest first, so the two workers finish together.
        order = sorted(debs.values(), key=lambda d: -d.path.stat().st_size)
        done = dict(zip([d.package for d in order], pool.map(lambda d: _unpack(d, cache), order)))
    return {p: done[p] for p in debs}


_PR_CAPBSET_DROP = 24
_CAP_SYS_MODULE = 16
_CAP_MKNOD = 27


def without_device_powers() -> None:
    """preexec_fn for NVIDIA's own code run as root: drop CAP_MKNOD and CAP_SYS_MODULE from the bounding set.

    Finding no driver, libcuda and libnvidia-ml running as root mknod /dev/nvidiactl (and friends) on the
    host and try to load the kernel module. Without those capabilities after exec they cannot, and fail
    exactly as on a host whose driver is not loaded.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_MKNOD, _CAP_SYS_MODULE):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: unknown cap
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def host_nvidia_nodes() -> set[str]:
    """The host's /dev/nvidia* paths (there must be none that a test made)."""
    return {str(p) for p in Path("/dev").glob("nvidia*")}


def run_nvidia(
    argv: list[str], *, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a command that executes NVIDIA's code, unable to create device nodes or load modules on the host.

    Raises RuntimeError (after removing them) if /dev/nvidia* nodes appeared on the host all the same.
    """
    before = host_nvidia_nodes()
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env) if env is not None else None,
        preexec_fn=without_device_powers if os.geteuid() == 0 else None,
        check=False,
    )
    appeared = host_nvidia_nodes() - before
    if appeared:
        for node in appeared:
            with contextlib.suppress(OSError):
                os.unlink(node)
        raise RuntimeError(f"{argv[0]} created {sorted(appeared)} on the host (removed)")
    return proc


def _cuda_driver_version(libcuda: Path) -> int:
    """cuDriverGetVersion of the real library, in a child (works without a kernel driver)."""
    code = (
        "import ctypes,sys\n"
        "lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int()\n"
        "rc = lib.cuDriverGetVersion(ctypes.byref(v)); print(rc, v.value)\n"
    )
    proc = run_nvidia([sys.executable, "-c", code, str(libcuda)], timeout=60)
    rc, value = (proc.stdout.split() + ["?", "?"])[:2]
    if proc.returncode != 0 or rc != "0":
        raise RuntimeError(f"cuDriverGetVersion from {libcuda} failed: {proc.stderr.strip() or proc.stdout}")
    return int(value)


# ---- roots ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RealRoot:
    """A built root. Paths in `canonical` form are as seen from inside the root (/usr/lib/...)."""

    layout: str
    root: Path
    driver_version: str  # 535.309.01
    cuda_driver_version: int  # 12020, from the real libcuda
    debs: Mapping[str, Deb] = field(repr=False)
    unpacked: Mapping[str, Path] = field(repr=False)  # package -> cached folder with data/ and control/
    fake: FakeDriver = field(repr=False)  # the simulated kernel side (its nodes, /proc, /sys, socket)
    build_seconds: float = 0.0

    @property
    def dev_root(self) -> Path:
        """The folder whose dev/ holds the device nodes (gpuhook's and nvidia-ctk's --dev-root)."""
        return self.root

    @property
    def proc_root(self) -> Path:
        """The simulated /proc (gpuhook's --proc-root): proc_root / "driver/nvidia/version"."""
        return self.root / "proc"

    @property
    def cuda_version(self) -> str:
        return f"{self.cuda_driver_version // 1000}.{self.cuda_driver_version % 1000 // 10}"

    @property
    def lib_dir(self) -> str:
        """Canonical folder of libcuda.so.<version>."""
        return DEBIAN_LIB_DIR if self.layout == "debian" else LIB_DIR

    def host_path(self, canonical: str) -> Path:
        return self.root / canonical.lstrip("/")

    def resolve(self, canonical: str) -> Path:
        """Host path of `canonical` with every link followed inside the root (absolute targets included)."""
        return self.host_path(resolve_in_root(self.root, canonical))

    @property
    def ld_library_path(self) -> str:
        """For a host process to load the root's libraries by soname (LD_LIBRARY_PATH)."""
        return ":".join(str(self.host_path(d)) for d in dict.fromkeys((self.lib_dir, LIB_DIR)))

    @property
    def nvidia_smi(self) -> Path:
        return self.resolve("/usr/bin/nvidia-smi")

    def package_files(self) -> dict[str, Path]:
        """Canonical path in this layout -> unpacked source, for every regular file the packages put here."""
        place = _runfile_path if self.layout == "runfile" else _debian_path
        out: dict[str, Path] = {}
        for tree in self.unpacked.values():
            for rel, src in _walk(tree / "data"):
                canonical = place(rel)
                if canonical and not src.is_symlink():
                    out[canonical] = src
        return dict(sorted(out.items()))

    def libraries(self) -> dict[str, str]:
        """Canonical path -> DT_SONAME ("" without one) of every ELF library file the packages put here."""
        out: dict[str, str] = {}
        for canonical, src in self.package_files().items():
            info = elf_dynamic(src) if ".so" in src.name else None
            if info is not None:
                out[canonical] = info.soname or ""
        return out


def resolve_in_root(root: Path, canonical: str) -> str:
    """`canonical` with each symlink followed as the root would see it (gpuhook's own resolver, the one discovery
    uses); `..` never climbs above the root."""
    from gpuhook.discover.roots import resolve_in_root as resolve

    return resolve(str(root), canonical)


def real_driver_root(
    layout: str,
    out_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    gpus: int = 2,
    merged_usr: bool = True,
    debs: Mapping[str, Deb] | None = None,
) -> RealRoot:
    """Build a real-driver root of `layout` at `out_dir` (absent or empty). Needs root (mknod, ldconfig -r).

    Raises RealDriverUnavailable when the packages cannot be had. `merged_usr` (Debian 12's /lib -> usr/lib)
    is the default, as on the distribution the packages come from.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    started = time.monotonic()
    cache = deb_cache_dir(cache_dir)
    debs = dict(debs) if debs is not None else fetch_debs(cache)
    trees = unpack_all(debs, cache)
    version = debs["libcuda1"].upstream_version
    libcuda = trees["libcuda1"] / "data" / DEBIAN_LIB_DIR.lstrip("/") / f"libcuda.so.{version}"
    if not libcuda.is_file():
        raise RealDriverUnavailable(f"{debs['libcuda1'].path.name} has no libcuda.so.{version}")
    cuda_int = _cuda_driver_version(libcuda)

    from gpuhook.fakedriver import build_fake_driver  # here: fetching and unpacking need no gpuhook

    root = Path(out_dir).absolute()
    cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
    fake = build_fake_driver(root, gpus, version, cuda, compat32=False, merged_usr=merged_usr)
    _strip_simulated_userspace(fake)
    if layout == "debian":
        _install_debian(root, debs, trees)
    else:
        _install_runfile(root, debs, trees)
    _ldconfig(root)
    return RealRoot(layout, root, version, cuda_int, debs, trees, fake, time.monotonic() - started)


def _strip_simulated_userspace(fake: FakeDriver) -> None:
    """Remove the fake's libraries, links, tools, firmware, configs and NVML controls; keep the kernel side."""
    libraries = [*fake.libraries, *fake.others]
    paths = [lib.path for lib in libraries] + [lib.soname_path for lib in libraries]
    paths += [link for link, _ in fake.dev_links]
    paths += [*fake.binaries, *fake.firmware, *fake.configs, "/etc/ld.so.cache"]
    parents: set[Path] = set()
    for canonical in paths:
        host = fake.host_path(canonical)
        if host.is_symlink() or host.exists():
            host.unlink()
            parents.add(host.parent)
    shutil.rmtree(fake.control_dir, ignore_errors=True)
    for parent in sorted(parents, key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):  # not empty, or already gone
            while parent != fake.root and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent


def _place(src: Path, dest: Path) -> None:
    """Hard link (same file system) or copy one unpacked file or link into a root."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_symlink() or dest.exists():
        dest.unlink()
    if src.is_symlink():
        os.symlink(os.readlink(src), dest)
        return
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _walk(data: Path) -> Iterator[tuple[str, Path]]:
    """(relative path, host path) of every file and link under an unpacked data/ folder."""
    for dirpath, dirnames, filenames in os.walk(data):
        base = Path(dirpath)
        for name in filenames + [d for d in dirnames if (base / d).is_symlink()]:
            path = base / name
            yield path.relative_to(data).as_posix(), path


def _install_debian(root: Path, debs: Mapping[str, Deb], trees: Mapping[str, Path]) -> None:
    for d in DEBIAN_SYSTEM_DIRS:
        (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for package in debs:
        for rel, src in _walk(trees[package] / "data"):
            target = _debian_path(rel)
            if target is not None:
                _place(src, root / target.lstrip("/"))
    # Triggers run in this order: nvidia-alternative's pings glx-alternative-nvidia's.
    for package in ("nvidia-alternative", "glx-alternative-nvidia"):
        if package in trees:
            apply_alternatives(root, (trees[package] / "control" / "postinst").read_text())


def _debian_path(rel: str) -> str | None:
    """Canonical path of a package file at `rel` in the debian layout; None: packaging debris, left out."""
    return None if rel.startswith(_SKIP_PREFIXES) else "/" + rel


def _runfile_path(rel: str) -> str | None:
    """Where the .run installer puts what the packages install at `rel`; None: the installer has no such file."""
    if rel == "etc/nvidia/current/nvidia-drm-outputclass.conf":
        return "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"
    if rel.startswith(_SKIP_PREFIXES_RUNFILE):
        return None
    name = rel.rsplit("/", 1)[-1]
    deb_lib = DEBIAN_LIB_DIR.lstrip("/") + "/"
    deb_private = DEBIAN_PRIVATE_DIR.lstrip("/") + "/"
    if rel.startswith(deb_lib):
        sub = rel[len(deb_lib) :]
        if sub == "nvoptix.bin":
            return "/usr/share/nvidia/nvoptix.bin"
        if sub.startswith("nvidia/wine/"):
            return f"{LIB_DIR}/{sub}"
        if name.startswith("libvdpau_nvidia"):
            return f"{LIB_DIR}/vdpau/{name}"
        if name == "nvidia-drm_gbm.so":
            return None  # made as gbm/nvidia-drm_gbm.so below
        return f"{LIB_DIR}/{sub}"
    if rel.startswith(deb_private):
        if name == "nvidia_drv.so":
            return "/usr/lib/xorg/modules/drivers/nvidia_drv.so"
        if name.startswith("libglxserver_nvidia"):
            return f"/usr/lib/xorg/modules/extensions/{name}"
        if name.endswith(".1.gz"):
            return f"/usr/share/man/man1/{name}"
        if name == "nvidia.ids":
            return None
        return f"/usr/bin/{name}"
    if rel.startswith("usr/lib/nvidia/"):
        return None
    if rel.startswith("usr/sbin/"):
        return f"/usr/bin/{name}"
    return "/" + rel


def _install_runfile(root: Path, debs: Mapping[str, Deb], trees: Mapping[str, Path]) -> None:
    for package in debs:
        for rel, src in _walk(trees[package] / "data"):
            target = _runfile_path(rel)
            # Of the packages' links keep the unversioned development ones (libcuda.so -> libcuda.so.1,
            # libglxserver_nvidia.so) and man page links; soname links are made below from the ELF files.
            if target is None or (src.is_symlink() and not target.endswith((".so", ".gz"))):
                continue
            _place(src, root / target.lstrip("/"))
    for folder in (LIB_DIR, f"{LIB_DIR}/vdpau"):
        make_soname_links(root / folder.lstrip("/"))
    gbm = root / LIB_DIR.lstrip("/") / "gbm"
    gbm.mkdir(parents=True, exist_ok=True)
    os.symlink("../libnvidia-allocator.so.1", gbm / "nvidia-drm_gbm.so")


def make_soname_links(folder: Path) -> list[tuple[str, str]]:
    """soname -> file links for every regular ELF library in `folder` whose DT_SONAME is not its name."""
    made: list[tuple[str, str]] = []
    for path in sorted(folder.iterdir()):
        if path.is_symlink() or not path.is_file() or ".so" not in path.name:
            continue
        info = elf_dynamic(path)
        if info is None or not info.soname or info.soname == path.name:
            continue
        link = folder / info.soname
        if not (link.is_symlink() or link.exists()):
            os.symlink(path.name, link)
            made.append((info.soname, path.name))
    return made


def _ldconfig(root: Path) -> None:
    conf = root / "etc/ld.so.conf"
    if not conf.exists():
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("include /etc/ld.so.conf.d/*.conf\n\n")
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    proc = subprocess.run([ldconfig, "-r", str(root)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (root / "etc/ld.so.cache").exists():
        raise RuntimeError(f"ldconfig -r {root} failed: {proc.stderr.strip()}")


# ---- Debian alternatives, read from the maintainer scripts ----------------------------------------------

_BLOCK = re.compile(r'^\s*(\w+)="\n(.*?)\n\s*"\s*$', re.S | re.M)
_TOKEN = re.compile(r"\$\((add_slave|add_multiarch_slave|search_multiarch_slave)\s+([^)]*)\)|\$(\w+)")


@dataclass(frozen=True)
class Alternative:
    link: str
    name: str
    path: str
    slaves: tuple[tuple[str, str, str], ...]  # (link, name, path)


def parse_alternatives(root: Path, postinst: str) -> Alternative:
    """The `update-alternatives --install` a postinst's trigger would run on this root (its first, normal one).

    Evaluates the script's add_slave/add_multiarch_slave/search_multiarch_slave calls with its own rule: a
    slave is added when its source is a file and its link's folder exists, both looked up inside `root`.
    """
    text = postinst.replace("\\\n", " ")
    triplets = re.search(r'^TRIPLETS="([^"]*)"', text, re.M)
    prefix = re.search(r'prefix="([\w-]+--)"', text)
    install = re.search(r"update-alternatives --install (\S+) (\S+) (\S+) \S+ (.*)", text)
    if not (triplets and prefix and install):
        raise ValueError("not an alternatives postinst of the NVIDIA packages")
    blocks = {m[1]: m[2] for m in _BLOCK.finditer(text)}
    slave_prefix = prefix[1]

    def is_file(path: str) -> bool:
        return (root / resolve_in_root(root, path).lstrip("/")).is_file()

    def is_dir(path: str) -> bool:
        return (root / resolve_in_root(root, path).lstrip("/")).is_dir()

    def add_slave(link: str, name: str, source: str) -> list[tuple[str, str, str]]:
        if is_file(source) and is_dir(link.rsplit("/", 1)[0] or "/"):
            return [(link, slave_prefix + name, source)]
        return []

    def add_multiarch(
        tdir: str, tsub: str, file: str, sdir: str, ssub: str = "", pfx: str = "", src: str = ""
    ) -> list[tuple[str, str, str]]:
        out = []
        for triplet in triplets[1].split():
            suffix = "-" + triplet.strip("/") if triplet.strip("/") else ""
            link, source = f"{tdir}{triplet}{tsub}{file}", f"{sdir}{triplet}{ssub}{src or file}"
            out += add_slave(link, f"{pfx}{file}{suffix}", source)
        return out

    def search(library: str, vendor: str = "") -> list[tuple[str, str, str]]:
        if vendor:
            found = add_multiarch("/usr/lib", "", library, "/usr/lib", f"{vendor}/")
            if found:
                return found
        return add_multiarch("/usr/lib", "", library, "/usr/lib/mesa-diverted")

    functions: dict[str, Any] = {
        "add_slave": add_slave,
        "add_multiarch_slave": add_multiarch,
        "search_multiarch_slave": search,
    }

    def expand(name: str, depth: int = 0) -> list[tuple[str, str, str]]:
        if name not in blocks or depth > 8:
            return []
        out: list[tuple[str, str, str]] = []
        for m in _TOKEN.finditer(blocks[name]):
            out += expand(m[3], depth + 1) if m[3] else functions[m[1]](*shlex.split(m[2]))
        return out

    slaves: list[tuple[str, str, str]] = []
    for var in re.findall(r"\$(\w+)", install[4]):
        for slave in expand(var):
            if slave[0] not in {s[0] for s in slaves}:
                slaves.append(slave)
    return Alternative(install[1], install[2], install[3], tuple(slaves))


def apply_alternatives(root: Path, postinst: str) -> Alternative:
    """Make the links update-alternatives would: link -> /etc/alternatives/<name> -> path, for each.

    Like update-alternatives without --force, a real file already at a link's place is left alone.
    """
    alt = parse_alternatives(root, postinst)
    for link, name, path in [(alt.link, alt.name, alt.path), *alt.slaves]:
        host = root / link.lstrip("/")
        if host.exists() and not host.is_symlink():
            continue
        admin = root / "etc/alternatives" / name
        admin.parent.mkdir(parents=True, exist_ok=True)
        if admin.is_symlink() or admin.exists():
            admin.unlink()
        os.symlink(path, admin)
        if host.is_symlink():
            host.unlink()
        host.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(f"/etc/alternatives/{name}", host)
    return alt


# ---- command line: fill the cache (CI) ------------------------------------------------------------------


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="realdriver.py", description=__doc__.split("\n", 1)[0])
    parser.add_argument("command", choices=("fetch", "packages", "build"))
    cache_help = f"the .deb cache (default ${DEB_CACHE_ENV} or {DEFAULT_DEB_CACHE})"
    parser.add_argument("--cache", default=None, help=cache_help)
    parser.add_argument("--layout", choices=LAYOUTS, default="runfile", help="build: which layout")
    parser.add_argument("--out", help="build: where to build the root (absent or empty)")
    args = parser.parse_args(argv)
    if args.command == "packages":
        print("\n".join(PACKAGES))
        return 0
    try:
        debs = fetch_debs(args.cache)
        unpack_all(debs, args.cache)
    except RealDriverUnavailable as e:
        print(f"realdriver: {e}", file=sys.stderr)
        return 2
    if args.command == "fetch":
        versions = sorted({d.version for d in debs.values() if d.package in DRIVER_PACKAGES})
        print(json.dumps({"cache": str(deb_cache_dir(args.cache)), "driver": versions, "packages": len(debs)}))
        return 0
    if not args.out:
        parser.error("build needs --out")
    real = real_driver_root(args.layout, args.out, args.cache, debs=debs)
    print(
        f"{real.layout} root of NVIDIA {real.driver_version} (CUDA {real.cuda_version}) at {real.root} "
        f"in {real.build_seconds:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
