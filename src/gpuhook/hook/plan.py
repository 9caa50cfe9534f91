"""Request -> what one container gets, for the front doors that act on a single container (the hook, the shim).

One sequence, so the two cannot drift: the configured roots, the (cached) inventory, device resolution, the
NVIDIA_REQUIRE_* checks and the edits plan.
"""

from __future__ import annotations

from gpuhook.model.edits import ContainerEdits, Selection, plan
from gpuhook.model.inventory import Inventory
from gpuhook.model.record import Record
from gpuhook.model.request import Request

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.hook.config import Config


class Planned(Record):
    inventory: Inventory
    selection: Selection
    edits: ContainerEdits
    notes: tuple[str, ...] = ()  # e.g. an inventory cache that was refused: said once in the log line

    def summary(self) -> str:
        """The log line's middle part: which devices and capabilities, how much was injected."""
        names = ",".join(d.uuid or str(d.index) for d in self.selection.devices) or "none"
        caps = ",".join(sorted(self.selection.capabilities))
        e = self.edits
        extra = ""
        if self.selection.imex_channels:
            extra += " imex=" + ",".join(n.path.rsplit("channel", 1)[-1] for n in self.selection.imex_channels)
        if self.selection.gated:
            extra += " gated=" + ",".join(self.selection.gated)
        notes = "".join(f" ({n})" for n in self.notes)
        return (f"devices={names} caps={caps} nodes={len(e.device_nodes)} mounts={len(e.mounts)} "
                f"links={len(e.symlinks)}{extra}{notes}")


class Decided(Record):
    """What was decided for a container that gets GPUs, everything its injection needs and no more (the service's
    worker takes it as the service made it, rather than reading the state, config.json and the request again;
    the plan's inventory stays behind: it was 29 KB of every hand-off for 1 GPU of 8)."""

    state_id: str
    pid: int
    rootfs: str
    edits: ContainerEdits
    summary: str  # the plan's summary, the log line's middle part (Planned.summary)
    notes: str  # the request's notes, as the log line words them
    cdi_ignored: tuple[str, ...]  # CDI names the runtime did not apply, recorded for the plugin (hook/cdiignored.py)
    cdi_marker: str = ""  # the plugin's sealed marker they came in (recorded only when this node's plugin made it)


def plan_request(config: Config, request: Request, inv: Inventory | None = None,
                 notes: list[str] | None = None) -> Planned:
    """Everything `request` gets on the host `config` describes; RequestError/DiscoveryError on refusal. `inv` is
    the inventory when the caller has just taken it (the service's memo), `notes` what that step said."""
    from gpuhook.model.selection import resolve

    notes = [] if notes is None else notes
    if inv is None:
        from gpuhook.discover.cache import inventory

        inv = inventory(config.roots(), config.inventory_cache, notes)
    selection = resolve(inv, request)
    if request.requirements:  # model/requirements.py (its parsers) is only loaded for a container that has constraints
        from gpuhook.model import requirements as require

        require.check(inv, request.requirements, selection.devices)
    return Planned(inv, selection, plan(inv, selection), tuple(notes))
