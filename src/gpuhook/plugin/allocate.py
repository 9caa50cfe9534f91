"""Allocate: kubelet device ids -> the container's CDI device names, plus the fallbacks the strategy list names.

Pure and table-driven (no NVML, no filesystem): the plugin names devices, the runtime (through CDI) or the hook
(through the env, mounts or annotations) puts them in. Replicas map back to their GPU; a GPU named twice (two
replicas of it) is named once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuhook.model.cdiignored import seal
from gpuhook.model.contract import CDI_DEVICES_MARKER, VISIBLE_DEVICES, VOLUME_MOUNT_DIR
from gpuhook.model.record import Record
from gpuhook.plugin import api_pb2 as pb
from gpuhook.plugin.devices import CDI_STRATEGIES, REPLICA_SEP, Options, PluginDevice, annotation_key
from gpuhook.plugin.devicespecs import DeviceSpecs


class AllocationError(ValueError):
    """Unknown or unhealthy ids in a request: becomes gRPC INVALID_ARGUMENT with this message."""


class Bad(Record):
    unknown: tuple[str, ...]
    unhealthy: tuple[str, ...]

    def message(self) -> str:
        parts = []
        if self.unknown:
            parts.append("unknown device ids: " + ", ".join(self.unknown))
        if self.unhealthy:
            parts.append("unhealthy device ids: " + ", ".join(self.unhealthy))
        return "; ".join(parts)


def resolve(ids: Sequence[str], by_id: Mapping[str, PluginDevice], unhealthy: Mapping[tuple[int, int], str],
            one_replica: bool = False) -> list[PluginDevice]:
    """The devices for one container's ids, duplicates (by underlying device) removed, in request order.
    `one_replica` (failRequestsGreaterThanOne): a request naming a replica may name nothing else, as NVIDIA's
    ValidateRequest refuses it."""
    if one_replica and len(ids) > 1 and any(REPLICA_SEP in i for i in ids):
        raise AllocationError(f"maximum request size for shared resources is 1; found {len(ids)}")
    unknown = [i for i in ids if i not in by_id]
    sick = [i for i in ids if i in by_id and by_id[i].key in unhealthy]
    if unknown or sick:
        raise AllocationError(Bad(tuple(unknown), tuple(sick)).message())
    out: list[PluginDevice] = []
    seen: set[tuple[int, int]] = set()
    for i in ids:
        d = by_id[i]
        if d.key not in seen:
            seen.add(d.key)
            out.append(d)
    return out


def container_response(devices: Sequence[PluginDevice], options: Options,
                       specs: DeviceSpecs | None = None, key: bytes = b"") -> pb.ContainerAllocateResponse:
    """One container's answer. As NVIDIA's getAllocateResponse (plus gpuhook's CDI_DEVICES_MARKER beside CDI
    names and NVIDIA_VISIBLE_DEVICES): the gated variables always, DeviceSpecs
    (`specs`, built only with passDeviceSpecs) only with a non-CDI strategy in the list (with CDI the spec gives
    the nodes)."""
    strategies = options.list_strategies
    resp = pb.ContainerAllocateResponse()
    for name in options.gated_env:
        resp.envs[name] = "enabled"
    if "cdi-cri" in strategies:
        resp.cdi_devices.extend(pb.CDIDevice(name=d.cdi_name) for d in devices)
    if "envvar" in strategies:
        resp.envs[VISIBLE_DEVICES] = ",".join(d.base_id for d in devices)
    if "volume-mounts" in strategies:
        if "envvar" not in strategies:
            resp.envs[VISIBLE_DEVICES] = VOLUME_MOUNT_DIR  # marks a GPU container; the mounts name the devices
        resp.mounts.extend(pb.Mount(container_path=f"{VOLUME_MOUNT_DIR}/{d.base_id}", host_path="/dev/null",
                                    read_only=True) for d in devices)
    if "cdi-annotations" in strategies:
        for d in devices:
            resp.annotations[annotation_key(d.base_id)] = d.cdi_name
    if resp.cdi_devices and VISIBLE_DEVICES in resp.envs:
        # Both ways at once: the marker lets gpuhook's hook or shim tell that the runtime ignored the CDI names
        # (the variable is still not void) and leave the record the plugin reports (plugin/cdiignored.py).
        # Sealed with the node's key (model/cdiignored.seal), so that an image setting it leaves no record.
        resp.envs[CDI_DEVICES_MARKER] = seal(key, ",".join(c.name for c in resp.cdi_devices))
    if specs is not None and any(s not in CDI_STRATEGIES for s in strategies):
        resp.devices.extend(specs.for_devices(devices))
    return resp


def allocate(request: pb.AllocateRequest, by_id: Mapping[str, PluginDevice],
             unhealthy: Mapping[tuple[int, int], str], options: Options, specs: DeviceSpecs | None = None,
             key: bytes = b"") -> tuple[pb.AllocateResponse, list[list[PluginDevice]]]:
    """The whole AllocateResponse and each container's devices (for the log); raises AllocationError naming
    every bad id of the first bad container."""
    out = pb.AllocateResponse()
    chosen = [resolve(creq.devices_ids, by_id, unhealthy, options.fail_requests_greater_than_one)
              for creq in request.container_requests]
    for devices in chosen:
        out.container_responses.append(container_response(devices, options, specs, key))
    return out, chosen
