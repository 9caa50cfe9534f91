"""Allocate's DeviceSpecs (`passDeviceSpecs`): the device nodes a container needs, named to kubelet itself.

With a non-CDI device list (NVIDIA_VISIBLE_DEVICES, volume mounts) the nodes reach the container through the OCI
hook, outside kubelet's view; the CPU manager's static policy then rewrites the container's cgroup from what
kubelet knows and the GPU nodes drop out of it. Naming them as DeviceSpecs puts them in kubelet's view (NVIDIA's
`--pass-device-specs`). The nodes come from the planning model (the same nodes the CDI spec gives), host paths
rebased as the spec's are, so Allocate only looks them up.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuhook.model import catalogue
from gpuhook.model.edits import device_edits
from gpuhook.model.inventory import DeviceNode, Inventory
from gpuhook.plugin import api_pb2 as pb
from gpuhook.plugin.cdispec import rebase
from gpuhook.plugin.devices import PluginDevice

Key = tuple[int, int]
# NVIDIA's GetDevicePaths: the control nodes every GPU container gets, where the host has them.
CONTROL = (catalogue.CTL_NODE, *catalogue.UVM_NODES, catalogue.MODESET_NODE)


class DeviceSpecs:
    """Per underlying device its own nodes, plus the control nodes every allocation carries."""

    def __init__(self, inv: Inventory, devices: Sequence[PluginDevice], host_dev_root: str | None) -> None:
        self._inside, self._outside = inv.dev_root, host_dev_root
        self.common = tuple(self._spec(inv.control_nodes[n]) for n in CONTROL if n in inv.control_nodes)
        self.by_key: dict[Key, tuple[pb.DeviceSpec, ...]] = {}
        for d in devices:
            if d.key not in self.by_key:
                nodes = device_edits(inv, d.target, frozenset({"compute", "utility"})).device_nodes
                self.by_key[d.key] = tuple(self._spec(n) for n in nodes)

    def _spec(self, node: DeviceNode) -> pb.DeviceSpec:
        host = node.host_path if self._outside is None else rebase(node.host_path, self._inside, self._outside)
        return pb.DeviceSpec(container_path=node.path, host_path=host, permissions="rw")

    def for_devices(self, devices: Sequence[PluginDevice]) -> list[pb.DeviceSpec]:
        """The control nodes, then each device's nodes; a node two devices share (a MIG parent) named once."""
        out: list[pb.DeviceSpec] = list(self.common)
        seen = {s.container_path for s in out}
        for d in devices:
            for spec in self.by_key.get(d.key, ()):
                if spec.container_path not in seen:
                    seen.add(spec.container_path)
                    out.append(spec)
        return out
