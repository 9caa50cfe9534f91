"""Request -> what one container gets, for the front doors that act on a single container (the hook, the shim).

One sequence, so the two cannot drift: the configured roots, the (cached) inventory, device resolution, the
NVIDIA_REQUIRE_* checks and the edits plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from .discover.inventory import Inventory
from .edits import ContainerEdits, Selection, plan
from .request import Request


@dataclass(frozen=True)
class Planned:
    inventory: Inventory
    selection: Selection
    edits: ContainerEdits

    def summary(self) -> str:
        """The log line's middle part: which devices and capabilities, how much was injected."""
        names = ",".join(d.uuid or str(d.index) for d in self.selection.devices) or "none"
        caps = ",".join(sorted(self.selection.capabilities))
        e = self.edits
        return (f"devices={names} caps={caps} nodes={len(e.device_nodes)} mounts={len(e.mounts)} "
                f"links={len(e.symlinks)}")


def plan_request(config, request: Request) -> Planned:  # type: ignore[no-untyped-def]
    """Everything `request` gets on the host `config` describes; RequestError/DiscoveryError on refusal."""
    from .discover.roots import Roots
    from .invcache import inventory
    from .select import resolve

    inv = inventory(Roots.make(config.driver_root, config.dev_root or None, config.proc_root), config.inventory_cache)
    selection = resolve(inv, request)
    if request.requirements:  # require.py (its parsers) is only loaded for a container that has constraints
        from . import require

        require.check(inv, request.requirements, selection.devices)
    return Planned(inv, selection, plan(inv, selection))
