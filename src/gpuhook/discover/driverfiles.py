"""The driver's user-space files on a host, found from the files themselves (as nvidia-ctk does).

Libraries: every `*.so.<driver version>` in the folders that hold the driver's libcuda / libnvidia-ml (found
through the root's ld.so.cache, every link followed inside the root, so Debian's alternatives links lead to
nvidia/current), plus their vdpau/ subfolder; each one's soname is its ELF DT_SONAME, and the catalogue only
classifies it (a name it does not know is `unclassified`). Catalogued libraries that live elsewhere (Debian
puts libnvidia-glcore & co beside, not in, nvidia/current; libnvidia-api.so.1 has no version in its name)
are looked up by name. Then the files of other versions or places: the EGL platform libraries the
egl_external_platform.d JSON files name, the X server modules, the GBM backend link. Binaries, firmware,
IPC sockets (under /run and /var/run) and graphics configuration files complete the list.
"""

from __future__ import annotations

import glob
import json
import os
import posixpath
import stat

from gpuhook import _native
from gpuhook.discover.roots import join, resolve_in_root
from gpuhook.errors import DiscoveryError
from gpuhook.model import catalogue
from gpuhook.model.inventory import DriverFile

ELF_MACHINE = {64: 62, 32: 3}  # EM_X86_64, EM_386
# The libraries whose folders are the driver's library folders.
ANCHORS: tuple[str, ...] = ("libcuda", "libnvidia-ml")
ANCHOR_SONAME_VERSION = "1"
SUBFOLDERS: tuple[str, ...] = ("", "vdpau")
JSON_LIMIT = 1 << 16


def _scan_dirs(bits: int) -> tuple[str, ...]:
    """The folders searched for a `bits`-bit library (catalogue's, the fingerprint's too)."""
    return catalogue.LIB64_SCAN_DIRS if bits == 64 else catalogue.LIB32_SCAN_DIRS


def ldcache_index(driver_root: str) -> dict[tuple[str, int], str]:
    """(soname, bits) -> canonical path from the root's /etc/ld.so.cache; empty when there is none."""
    path = join(driver_root, catalogue.LD_CACHE)
    if not os.path.exists(path):
        return {}
    try:
        entries = _native.read_ldcache(path)
    except (OSError, ValueError) as exc:
        raise DiscoveryError(f"cannot read {path}: {exc}") from None
    index: dict[tuple[str, int], str] = {}
    for e in entries:
        if _native.is_64bit_x86_64(e.flags):
            index.setdefault((e.key, 64), e.value)
        elif _native.is_32bit_i386(e.flags):
            index.setdefault((e.key, 32), e.value)
    return index


def _elf(host_path: str, bits: int) -> _native.ElfInfo | None:
    """The ELF header of a library of the wanted class and machine; None for another class; raise on a file
    that is not ELF at all (one line naming it)."""
    try:
        info = _native.elf_info(host_path)
    except ValueError as exc:
        raise DiscoveryError(str(exc)) from None
    except OSError as exc:
        raise DiscoveryError(f"cannot read {host_path}: {exc.strerror}") from None
    if info.elf_class == bits and info.machine == ELF_MACHINE[bits]:
        return info
    return None


def _kind(bits: int) -> str:
    return "lib" if bits == 64 else "lib32"


def _regular(root: str, canonical: str) -> str | None:
    """Host path of a regular file at `canonical` (already resolved), None when there is none."""
    host = join(root, canonical)
    try:
        st = os.lstat(host)
    except OSError:
        return None
    return host if stat.S_ISREG(st.st_mode) else None


def _found(root: str, candidate: str) -> tuple[str, str] | None:
    """(canonical, host) of the regular file `candidate` leads to inside the root."""
    try:
        canonical = resolve_in_root(root, candidate)
    except OSError:
        return None
    host = _regular(root, canonical)
    return (canonical, host) if host else None


class _Libraries:
    """Collects library files once each (by canonical path), reading each one's soname from its ELF."""

    def __init__(self, root: str, version: str, cache: dict[tuple[str, int], str]) -> None:
        self.root, self.version, self.cache = root, version, cache
        self.files: dict[str, DriverFile] = {}

    def add(self, canonical: str, host: str, bits: int, capability: str) -> DriverFile | None:
        if canonical in self.files:
            return self.files[canonical]
        info = _elf(host, bits)
        if info is None:
            return None
        f = DriverFile(_kind(bits), capability, canonical, host, soname=info.soname or "")
        self.files[canonical] = f
        return f

    def anchor_folders(self, bits: int) -> list[str]:
        """Canonical folders of the real libcuda.so.<ver> / libnvidia-ml.so.<ver> files."""
        folders: list[str] = []
        for name in ANCHORS:
            wanted = f"{name}.so.{self.version}"
            candidates = [self.cache.get((f"{name}.so.{ANCHOR_SONAME_VERSION}", bits), "")]
            candidates += [posixpath.join(d, wanted) for d in _scan_dirs(bits)]
            for candidate in filter(None, candidates):
                hit = _found(self.root, candidate)
                if hit is None or posixpath.basename(hit[0]) != wanted or _elf(hit[1], bits) is None:
                    continue  # a soname pointing at another driver version's file is not ours
                folder = posixpath.dirname(hit[0])
                if folder not in folders:
                    folders.append(folder)
                break
        return folders

    def scan(self, folder: str, bits: int) -> None:
        """Every regular `*.so.<driver version>` in `folder` and its vdpau/, classified by the catalogue."""
        suffix = f".so.{self.version}"
        for sub in SUBFOLDERS:
            canonical_dir = posixpath.join(folder, sub) if sub else folder
            try:
                names = sorted(os.listdir(join(self.root, canonical_dir)))
            except OSError:
                continue
            for name in names:
                if not name.endswith(suffix):
                    continue
                canonical = posixpath.join(canonical_dir, name)
                host = _regular(self.root, canonical)
                if host is None:
                    continue  # links are the loader's business; their targets are what gets mounted
                spec = catalogue.library_by_name(name[: -len(suffix)])
                self.add(canonical, host, bits, spec.capability if spec else catalogue.UNCLASSIFIED)

    def catalogued(self, spec: catalogue.LibrarySpec, bits: int, folders: list[str]) -> None:
        """A catalogued library outside the anchor folders: by its names in the ld cache, then by folder."""
        wanted = spec.file_name(self.version)
        if any(posixpath.basename(p) == wanted for p, f in self.files.items() if f.kind == _kind(bits)):
            return
        keys = [k for k in (wanted, spec.soname(self.version)) if k]
        candidates = [self.cache.get((k, bits), "") for k in keys]
        dirs = [*folders, *_scan_dirs(bits)]
        candidates += [posixpath.join(d, spec.subdir, wanted) for d in dirs]
        for candidate in filter(None, candidates):
            hit = _found(self.root, candidate)
            if hit is not None and posixpath.basename(hit[0]) == wanted and self.add(*hit, bits, spec.capability):
                return

    def by_soname(self, soname: str, bits: int, folders: list[str], capability: str) -> DriverFile | None:
        """The file a soname (or an absolute path) names: through the ld cache, else in the library folders."""
        if soname.startswith("/"):
            candidates = [soname]
        else:
            candidates = [self.cache.get((soname, bits), "")]
            candidates += [posixpath.join(d, soname) for d in [*folders, *catalogue.LIB64_SCAN_DIRS]]
        for candidate in filter(None, candidates):
            hit = _found(self.root, candidate)
            if hit is not None:
                return self.add(*hit, bits, capability)
        return None


def _egl_platform_libraries(root: str) -> list[str]:
    """The library_path each NVIDIA EGL external platform JSON names (gbm, wayland, xcb, xlib)."""
    names: list[str] = []
    for folder in catalogue.EGL_PLATFORM_DIRS:
        for host in sorted(glob.glob(join(root, posixpath.join(folder, "*.json")))):
            try:
                with open(host, "rb") as f:
                    data = json.loads(f.read(JSON_LIMIT))
                library = data["ICD"]["library_path"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a platform JSON we can read: nothing of ours to add
            if isinstance(library, str) and "nvidia" in library and library not in names:
                names.append(library)
    return names


def libraries(root: str, version: str) -> list[DriverFile]:
    cache = ldcache_index(root)
    found = _Libraries(root, version, cache)
    folders64: list[str] = []
    for bits in (64, 32):
        folders = found.anchor_folders(bits)
        if bits == 64:
            folders64 = folders
        for folder in folders:
            found.scan(folder, bits)
        for spec in catalogue.LIBRARIES:
            found.catalogued(spec, bits, folders)
    for soname in _egl_platform_libraries(root):
        found.by_soname(soname, 64, folders64, catalogue.EGL_PLATFORM_CAPABILITY)
    return list(found.files.values())


def links(libs: list[DriverFile]) -> list[DriverFile]:
    """Links NVIDIA's graphics discoverer makes in a container: the GBM backend beside the allocator."""
    out: list[DriverFile] = []
    for f in libs:
        name = posixpath.basename(f.path)
        if f.kind == "lib" and name.startswith(catalogue.GBM_ALLOCATOR + ".so.") and f.soname:
            link = posixpath.join(posixpath.dirname(f.path), catalogue.GBM_BACKEND_LINK)
            out.append(DriverFile("link", "graphics", link, "", target=f"../{f.soname}"))
    return out


def xorg_modules(root: str, version: str) -> list[DriverFile]:
    """The X driver and GLX server module (display), at the first folder that has each; an unversioned
    link there (Debian's alternatives) leads to the versioned file."""
    found: list[DriverFile] = []
    for spec in catalogue.XORG_MODULES:
        name = spec.name.format(version=version)
        for pattern in catalogue.XORG_MODULE_DIRS:
            folder = pattern.format(folder=spec.folder)
            hit = None
            for candidate in (name, spec.link):
                if candidate:
                    hit = _found(root, posixpath.join(folder, candidate))
                    if hit is not None and posixpath.basename(hit[0]) == name:
                        break
                    hit = None
            if hit is None:
                continue
            found.append(DriverFile("xorg", spec.capability, posixpath.join(folder, name), hit[1]))
            if spec.link:
                found.append(DriverFile("link", spec.capability, posixpath.join(folder, spec.link), "", target=name))
            break
    return found


def binaries(root: str) -> list[DriverFile]:
    """Each tool at the first bin folder that has it, mounted at that same path (as nvidia-ctk does)."""
    found: list[DriverFile] = []
    for spec in catalogue.BINARIES:
        for d in catalogue.BINARY_DIRS:
            path = posixpath.join(d, spec.name)
            canonical = resolve_in_root(root, path)
            host = join(root, canonical)
            if os.path.isfile(host) and os.access(host, os.X_OK):
                found.append(DriverFile("bin", spec.capability, path, host))
                break
    return found


def firmware(root: str, version: str) -> list[DriverFile]:
    found: list[DriverFile] = []
    for base in (catalogue.FIRMWARE_DIR, "/usr/lib/firmware/nvidia"):
        pattern = join(root, posixpath.join(base, version, catalogue.FIRMWARE_GLOB))
        for host in sorted(glob.glob(pattern)):
            name = posixpath.basename(host)
            real = join(root, resolve_in_root(root, posixpath.join(base, version, name)))  # /lib -> usr/lib
            found.append(DriverFile("firmware", "utility", posixpath.join(catalogue.FIRMWARE_DIR, version, name), real))
        if found:
            break
    return found


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _ipc_paths(path: str) -> list[str]:
    """A socket path and its /run <-> /var/run twin."""
    paths = [path]
    for a, b in catalogue.RUN_ALIASES:
        if path.startswith(a):
            paths.append(b + path[len(a) :])
        elif path.startswith(b):
            paths.append(a + path[len(b) :])
    return paths


def ipc(root: str, mps_pipe_dir: str | None = None) -> list[DriverFile]:
    found: list[DriverFile] = []
    seen: set[str] = set()
    for spec in catalogue.IPC:
        paths = [mps_pipe_dir] if spec.is_dir and mps_pipe_dir else _ipc_paths(spec.path)
        for path in paths:
            canonical = resolve_in_root(root, path)
            host = join(root, canonical)
            present = os.path.isdir(host) if spec.is_dir else _is_socket(host)
            if present and canonical not in seen:
                seen.add(canonical)
                found.append(DriverFile("ipc", spec.capability, path, host))
                break
    return found


def configs(root: str) -> list[DriverFile]:
    found: list[DriverFile] = []
    for pattern in catalogue.GRAPHICS_CONFIGS:
        variants = [pattern]
        for prefix, alternate in catalogue.CONFIG_ALTERNATE_PREFIXES.items():
            if pattern.startswith(prefix):
                variants.append(alternate + pattern[len(prefix) :])
        for variant in variants:
            hits = sorted(glob.glob(join(root, variant)))
            for host in hits:
                canonical = posixpath.join(posixpath.dirname(pattern), posixpath.basename(host))
                found_at = posixpath.join(posixpath.dirname(variant), posixpath.basename(host))
                # Followed inside the root: Debian's alternatives links are absolute (nvoptix.bin).
                real = join(root, resolve_in_root(root, found_at))
                found.append(DriverFile("config", "graphics", canonical, real))
            if hits:
                break
    return found


def all_files(root: str, version: str, mps_pipe_dir: str | None = None) -> list[DriverFile]:
    libs = libraries(root, version)
    return (
        libs
        + links(libs)
        + xorg_modules(root, version)
        + binaries(root)
        + firmware(root, version)
        + ipc(root, mps_pipe_dir)
        + configs(root)
    )
