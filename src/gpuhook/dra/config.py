"""Opaque device configuration from a claim or its DeviceClass: NVIDIA's own kinds, parsed strictly.

The kinds are those of NVIDIA's DRA driver (api/nvidia.com/resource/v1beta1: group `resource.nvidia.com`, version
`v1beta1`, kinds `GpuConfig` and `MigDeviceConfig`, `sharing.strategy` `TimeSlicing` or `MPS`,
`timeSlicingConfig.interval` `Default`/`Short`/`Medium`/`Long`), so a claim written for NVIDIA's driver means the
same here. As NVIDIA's strict decoder does, an unknown field is an error. What gpuhook does with them:
- TimeSlicing on a GPU: the GPU's compute mode is set to DEFAULT through NVML (several processes, and so several
  pods sharing the claim, time-share it), with interval `Default`; the other intervals need nvidia-smi's
  compute-policy, which NVML does not offer publicly, and are refused with that reason.
- TimeSlicing on a MIG device: nothing to set (NVIDIA's `MigDeviceSharing.GetTimeSlicingConfig` returns none).
- MPS: refused (not supported yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuhook.errors import clip
from gpuhook.model.record import Record

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG = "GpuConfig"
MIG_CONFIG = "MigDeviceConfig"
KINDS = (GPU_CONFIG, MIG_CONFIG)
TIME_SLICING = "TimeSlicing"
MPS = "MPS"
INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}  # TimeSliceInterval.Int()
SUPPORTED_INTERVALS = ("Default",)


class ConfigError(ValueError):
    """One claim's opaque configuration is refused (the message is that claim's prepare error)."""


class DeviceConfig(Record):
    """What one device of a claim is to be set up with."""

    kind: str  # GpuConfig / MigDeviceConfig
    time_slicing: bool = False
    interval: str = "Default"


def _fields(obj: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown field {clip(unknown[0])} (known: {', '.join(allowed)})")


def parse(parameters: Any, source: str) -> DeviceConfig:
    """One opaque `parameters` object; ConfigError naming the offending value and `source` (where it came from)."""
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"{source}: parameters must be an object, got {clip(parameters)}")
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != API_VERSION or kind not in KINDS:
        raise ConfigError(f"{source}: unknown opaque config kind {clip(f'{api_version}/{kind}', quote=False)} "
                          f"(known: {', '.join(f'{API_VERSION} {k}' for k in KINDS)})")
    _fields(parameters, ("apiVersion", "kind", "sharing"), f"{source} {kind}")
    sharing = parameters.get("sharing")
    if sharing is None:
        return DeviceConfig(kind)
    where = f"{source} {kind}.sharing"
    if not isinstance(sharing, Mapping):
        raise ConfigError(f"{where}: must be an object, got {clip(sharing)}")
    allowed = ("strategy", "timeSlicingConfig", "mpsConfig") if kind == GPU_CONFIG else ("strategy", "mpsConfig")
    _fields(sharing, allowed, where)
    strategy = sharing.get("strategy")
    if strategy == MPS:
        raise ConfigError(f"{where}: strategy MPS is not supported by gpuhook yet (use TimeSlicing)")
    if strategy != TIME_SLICING:
        raise ConfigError(f"{where}: unknown strategy {clip(strategy)} (known: {TIME_SLICING}, {MPS})")
    if sharing.get("mpsConfig") is not None:
        raise ConfigError(f"{where}: mpsConfig cannot be used with the TimeSlicing strategy")
    slicing = sharing.get("timeSlicingConfig") or {}
    if not isinstance(slicing, Mapping):
        raise ConfigError(f"{where}.timeSlicingConfig: must be an object, got {clip(slicing)}")
    _fields(slicing, ("interval",), f"{where}.timeSlicingConfig")
    interval = slicing.get("interval", "Default")
    if interval not in INTERVALS:
        raise ConfigError(f"{where}.timeSlicingConfig: unknown interval {clip(interval)} "
                          f"(known: {', '.join(INTERVALS)})")
    if interval not in SUPPORTED_INTERVALS:
        raise ConfigError(f"{where}.timeSlicingConfig: interval {interval} is not supported by gpuhook yet: NVML "
                          "has no public call for the time-slice length (use Default)")
    return DeviceConfig(kind, time_slicing=True, interval=interval)


def check_target(config: DeviceConfig, device_type: str, device: str) -> None:
    """A GpuConfig configures whole GPUs, a MigDeviceConfig MIG devices (as NVIDIA's driver requires)."""
    wanted = GPU_CONFIG if device_type == "gpu" else MIG_CONFIG
    if config.kind != wanted:
        raise ConfigError(f"device {device} is a {device_type}: it takes a {wanted}, not a {config.kind}")
