"""The driver's user-space files on a host: libraries (through the root's ld.so.cache, with a directory scan
as fallback), binaries, firmware, IPC sockets and graphics configuration files, each tagged with the
capability that brings it into a container.
"""

from __future__ import annotations

import glob
import os
import posixpath
import stat

from gpuhook import _native
from gpuhook.discover.roots import join, resolve_in_root
from gpuhook.errors import DiscoveryError
from gpuhook.model import catalogue
from gpuhook.model.inventory import DriverFile

LIB64_SCAN_DIRS: tuple[str, ...] = (catalogue.LIB_DIR, "/usr/lib64", "/lib64", "/usr/lib", "/lib/x86_64-linux-gnu")
LIB32_SCAN_DIRS: tuple[str, ...] = (catalogue.LIB32_DIR, "/usr/lib32", "/lib32", "/usr/lib/i386-linux-gnu")
ELF_MACHINE = {64: 62, 32: 3}  # EM_X86_64, EM_386


def ldcache_index(driver_root: str) -> dict[tuple[str, int], str]:
    """(soname, bits) -> canonical path from the root's /etc/ld.so.cache; empty when there is none."""
    path = join(driver_root, "/etc/ld.so.cache")
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


def _check_elf(host_path: str, bits: int) -> bool:
    """True for an ELF library of the wanted class and machine; raise on a file that is not ELF at all."""
    try:
        info = _native.elf_info(host_path)
    except ValueError as exc:
        raise DiscoveryError(str(exc)) from None
    except OSError as exc:
        raise DiscoveryError(f"cannot read {host_path}: {exc.strerror}") from None
    return info.elf_class == bits and info.machine == ELF_MACHINE[bits]


def _library(
    root: str, spec: catalogue.LibrarySpec, version: str, bits: int, cache: dict[tuple[str, int], str]
) -> DriverFile | None:
    wanted = spec.file_name(version)
    candidates: list[str] = []
    cached = cache.get((spec.soname(version), bits))
    if cached:
        candidates.append(cached)
    for d in LIB64_SCAN_DIRS if bits == 64 else LIB32_SCAN_DIRS:
        candidates.append(posixpath.join(d, spec.subdir, wanted) if spec.subdir else posixpath.join(d, wanted))
    for candidate in candidates:
        canonical = resolve_in_root(root, candidate)
        host = join(root, canonical)
        if posixpath.basename(canonical) != wanted or not os.path.isfile(host):
            continue  # a soname pointing at another driver version's file is not ours
        if not _check_elf(host, bits):
            continue
        return DriverFile(
            kind="lib" if bits == 64 else "lib32",
            capability=spec.capability,
            path=canonical,
            host_path=host,
            soname=spec.soname(version),
        )
    return None


def libraries(root: str, version: str) -> list[DriverFile]:
    cache = ldcache_index(root)
    found: list[DriverFile] = []
    for bits in (64, 32):
        for spec in catalogue.LIBRARIES:
            lib = _library(root, spec, version, bits, cache)
            if lib is not None:
                found.append(lib)
    return found


def binaries(root: str) -> list[DriverFile]:
    found: list[DriverFile] = []
    for spec in catalogue.BINARIES:
        for d in catalogue.BINARY_DIRS:
            canonical = resolve_in_root(root, posixpath.join(d, spec.name))
            host = join(root, canonical)
            if os.path.isfile(host) and os.access(host, os.X_OK):
                found.append(DriverFile("bin", spec.capability, posixpath.join("/usr/bin", spec.name), host))
                break
    return found


def firmware(root: str, version: str) -> list[DriverFile]:
    found: list[DriverFile] = []
    for base in (catalogue.FIRMWARE_DIR, "/usr/lib/firmware/nvidia"):
        pattern = join(root, posixpath.join(base, version, catalogue.FIRMWARE_GLOB))
        for host in sorted(glob.glob(pattern)):
            canonical = posixpath.join(catalogue.FIRMWARE_DIR, version, posixpath.basename(host))
            found.append(DriverFile("firmware", "utility", canonical, host))
        if found:
            break
    return found


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def ipc(root: str, mps_pipe_dir: str | None = None) -> list[DriverFile]:
    found: list[DriverFile] = []
    for spec in catalogue.IPC:
        path = spec.path
        if spec.is_dir and mps_pipe_dir:
            path = mps_pipe_dir
        host = join(root, resolve_in_root(root, path))
        present = os.path.isdir(host) if spec.is_dir else _is_socket(host)
        if present:
            found.append(DriverFile("ipc", spec.capability, path, host))
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
                found.append(DriverFile("config", "graphics", canonical, os.path.realpath(host)))
            if hits:
                break
    return found


def all_files(root: str, version: str, mps_pipe_dir: str | None = None) -> list[DriverFile]:
    return libraries(root, version) + binaries(root) + firmware(root, version) + ipc(root, mps_pipe_dir) + configs(root)
