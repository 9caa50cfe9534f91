"""The kernel driver's view in /proc/driver/nvidia: version, GPUs, MIG capability files.

Used on its own when NVML is missing or fails, and always for what only procfs knows (cap node minors).
"""

from __future__ import annotations

import os
import re

from gpuhook.errors import DiscoveryError
from gpuhook.model.record import Record

NVIDIA_PROC = "driver/nvidia"
_VERSION_RE = r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+\.\d+(?:\.\d+)?)"  # compiled at first use


class ProcGpu(Record):
    bus_id: str
    minor: int
    uuid: str
    model: str
    excluded: bool


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        raise DiscoveryError(f"cannot read {path}: {exc.strerror}") from None


def parse_key_values(text: str) -> dict[str, str]:
    """'Key:   value' lines (information, params, access files) into a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def driver_version(proc_root: str) -> str:
    path = os.path.join(proc_root, NVIDIA_PROC, "version")
    text = _read(path)
    match = re.search(_VERSION_RE, text)
    if not match:
        raise DiscoveryError(f"{path}: no driver version in it")
    return match.group(1)


def gpus(proc_root: str) -> list[ProcGpu]:
    """GPUs from gpus/<bus>/information, in PCI bus order (the order NVML indexes them in)."""
    base = os.path.join(proc_root, NVIDIA_PROC, "gpus")
    try:
        entries = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise DiscoveryError(f"cannot list {base}: {exc.strerror}") from None
    found: list[ProcGpu] = []
    for bus in entries:
        path = os.path.join(base, bus, "information")
        info = parse_key_values(_read(path))
        try:
            minor = int(info["Device Minor"])
        except (KeyError, ValueError):
            raise DiscoveryError(f"{path}: no valid 'Device Minor'") from None
        found.append(
            ProcGpu(
                bus_id=bus.lower(),
                minor=minor,
                uuid=info.get("GPU UUID", ""),
                model=info.get("Model", ""),
                excluded=info.get("GPU Excluded", "No").lower() == "yes",
            )
        )
    return found


def cap_minor(access_file: str) -> int:
    """The nvidia-caps node minor an access file names ('DeviceFileMinor: N')."""
    info = parse_key_values(_read(access_file))
    try:
        return int(info["DeviceFileMinor"])
    except (KeyError, ValueError):
        raise DiscoveryError(f"{access_file}: no valid 'DeviceFileMinor'") from None


def mig_instances(proc_root: str, gpu_minor: int) -> list[tuple[int, int]]:
    """(gi, ci) pairs that have capability files for a GPU: the MIG devices procfs alone can see."""
    base = os.path.join(proc_root, NVIDIA_PROC, "capabilities", f"gpu{gpu_minor}", "mig")
    pairs: list[tuple[int, int]] = []
    try:
        gis = os.listdir(base)
    except OSError:
        return []
    for gi_name in gis:
        if not re.fullmatch(r"gi\d+", gi_name):
            continue
        for ci_name in os.listdir(os.path.join(base, gi_name)):
            if re.fullmatch(r"ci\d+", ci_name):
                pairs.append((int(gi_name[2:]), int(ci_name[2:])))
    return sorted(pairs)


def mig_access_paths(gpu_minor: int, gi: int, ci: int) -> tuple[str, str]:
    """Canonical /proc paths of a MIG device's gi and ci access files."""
    base = f"/proc/{NVIDIA_PROC}/capabilities/gpu{gpu_minor}/mig/gi{gi}"
    return f"{base}/access", f"{base}/ci{ci}/access"


def mig_access_files(proc_root: str) -> list[str]:
    """Canonical paths of the gi and ci access files of every MIG device procfs shows, on every GPU that has a
    capabilities folder (each gi file once): what discovery reads while NVML's child answers."""
    base = os.path.join(proc_root, NVIDIA_PROC, "capabilities")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found: dict[str, None] = {}
    for name in names:
        if re.fullmatch(r"gpu\d+", name):
            minor = int(name[3:])
            try:
                pairs = mig_instances(proc_root, minor)
            except OSError:
                continue
            for gi, ci in pairs:
                found.update(dict.fromkeys(mig_access_paths(minor, gi, ci)))
    return list(found)


def proc_host_path(proc_root: str, canonical: str) -> str:
    """Map a canonical /proc/... path onto the proc root that discovery reads."""
    return os.path.join(proc_root, canonical.removeprefix("/proc/"))
