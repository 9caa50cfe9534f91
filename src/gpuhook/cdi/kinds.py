"""Specs for the datacenter kinds, one spec per kind as `nvidia-ctk cdi generate --mode=<mode>` writes them.

`imex`: kind nvidia.com/imex-channel, a device per channel node present (named by its number, as nvidia-ctk's
pkg/nvcdi/lib-imex.go) plus `all` (gpuhook's addition), and spec-wide `NVIDIA_VISIBLE_DEVICES=void`, as NVIDIA's:
a container that asks for a channel alone must not get GPUs from a hook or runtime reading its environment (a
legacy CUDA image asks for every GPU without that variable). `nvswitch`, `gds`, `mofed`, `gdrcopy`: kind
nvidia.com/<mode>, one device `all` (nvidia-ctk's pkg/nvcdi/gated.go), no spec-wide edits: these are asked for
next to a GPU, whose spec carries the driver files. The content comes from the planning model (edits.imex_edits,
edits.gated_edits).
"""

from __future__ import annotations

from gpuhook.cdi import names, version
from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.modes import DEFAULT_CLASS, IMEX_MODE, MODES
from gpuhook.cdi.spec import ALL_DEVICE, choose_version, render_edits
from gpuhook.model import catalogue
from gpuhook.model.contract import IMEX_CDI_CLASS, VISIBLE_DEVICES
from gpuhook.model.edits import ContainerEdits, gated_edits, imex_edits
from gpuhook.model.inventory import Inventory

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (generate-cdi's path)
if TYPE_CHECKING:
    from typing import Any



def _spec(kind: str, devices: list[tuple[str, ContainerEdits]], cdi_version: str | None,
          env: tuple[str, ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "cdiVersion": version.EARLIEST,
        "kind": kind,
        # rendered afresh for each device: a shared object would come out as a YAML alias
        "devices": [{"name": name, "containerEdits": render_edits(edits, "/")} for name, edits in devices],
    }
    if env:
        spec["containerEdits"] = {"env": list(env)}
    spec["cdiVersion"] = choose_version(spec, cdi_version)
    return spec


def build_imex_spec(inv: Inventory, *, vendor: str = "nvidia.com", cls: str = IMEX_CDI_CLASS,
                    cdi_version: str | None = None) -> dict[str, Any]:
    """A device per IMEX channel node present (name: its number) and `all`; no channel is an error."""
    kind = names.make_kind(vendor, cls)
    if not inv.imex_channels:
        why = "the driver has no IMEX support" if inv.imex_major is None else "no channel node"
        raise CdiError(f"no IMEX channels under {inv.dev_root}{catalogue.IMEX_CHANNEL_DIR} ({why}): "
                       "a CDI spec needs at least one device")
    devices = [(n.path.rsplit(catalogue.IMEX_CHANNEL_PREFIX, 1)[-1], imex_edits([n])) for n in inv.imex_channels]
    return _spec(kind, [*devices, (ALL_DEVICE, imex_edits(inv.imex_channels))], cdi_version,
                 (f"{VISIBLE_DEVICES}=void",))


def build_gated_spec(inv: Inventory, mode: str, *, vendor: str = "nvidia.com", cls: str | None = None,
                     cdi_version: str | None = None) -> dict[str, Any]:
    """The one device `all` of a gated family: the nodes the host has and the mounts that go with them."""
    family = next((f for f in catalogue.GATED if f.name == mode), None)
    if family is None:
        raise CdiError(f"unknown mode {mode!r} (expected one of {', '.join(MODES)})")
    kind = names.make_kind(vendor, cls or DEFAULT_CLASS[mode])
    edits = gated_edits(inv, mode)
    if not edits.device_nodes:
        raise CdiError(f"no {mode} device nodes ({', '.join(family.node_globs)}) under {inv.dev_root}: "
                       "a CDI spec needs at least one device")
    return _spec(kind, [(ALL_DEVICE, edits)], cdi_version)


def build_mode_spec(inv: Inventory, mode: str, *, vendor: str, cls: str | None,
                    cdi_version: str | None) -> dict[str, Any]:
    """The spec of a non-GPU mode (`imex` or a gated family)."""
    if mode == IMEX_MODE:
        return build_imex_spec(inv, vendor=vendor, cls=cls or IMEX_CDI_CLASS, cdi_version=cdi_version)
    return build_gated_spec(inv, mode, vendor=vendor, cls=cls, cdi_version=cdi_version)
