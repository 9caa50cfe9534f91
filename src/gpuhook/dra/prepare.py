"""NodePrepareResources / NodeUnprepareResources for one claim each: read, check, set up, record.

Prepare: a claim already in the checkpoint gets the same answer again (the kubelet repeats prepare after its
own restart); otherwise the claim is read from the API server, its results for this driver checked (this node's
pool, devices that exist and are healthy, opaque configs we accept), time-slicing applied, the claim's CDI spec
written, then the checkpoint. Any refusal is one line in that claim's result and leaves nothing behind: the spec
is removed again when a later step fails, and the checkpoint is written last.
Unprepare: remove the spec, then the checkpoint entry; a claim we do not know is already unprepared.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from gpuhook.dra import checkpoint, claimspec
from gpuhook.dra.checkpoint import PreparedClaim, PreparedDevice
from gpuhook.dra.claim import ClaimError, Result, results
from gpuhook.dra.config import ConfigError, DeviceConfig, check_target
from gpuhook.dra.devices import DRIVER, DraDevice
from gpuhook.errors import GpuhookError, clip
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record
from gpuhook.plugin.state import HealthBoard

log = logging.getLogger("gpuhook.dra.prepare")

ClaimReader = Callable[[str, str], dict]  # (namespace, name) -> the ResourceClaim's JSON
SharingApplier = Callable[[Sequence[Gpu]], list[str]]


class PrepareConfig(Record):
    node: str
    cdi_dir: str
    checkpoint_path: str
    hook_path: str
    host_driver_root: str | None = None
    host_dev_root: str | None = None
    driver: str = DRIVER


class Devices(Record):
    """The devices of one discovery (swapped whole on rediscovery)."""

    inventory: Inventory
    by_name: dict[str, DraDevice]


class Preparer:
    def __init__(self, config: PrepareConfig, read_claim: ClaimReader, board: HealthBoard,
                 apply_sharing: SharingApplier) -> None:
        self.config = config
        self.read_claim = read_claim
        self.board = board
        self.apply_sharing = apply_sharing
        self.devices: Devices | None = None
        self._lock = threading.Lock()  # one claim set up (config, spec, checkpoint) at a time
        self.claims: dict[str, PreparedClaim] = checkpoint.load(config.checkpoint_path)

    def set_devices(self, inv: Inventory, devices: Sequence[DraDevice]) -> None:
        self.devices = Devices(inv, {d.name: d for d in devices})

    def remove_orphans(self) -> list[str]:
        """Claim specs in the CDI dir that the checkpoint does not list (a crash between the two writes)."""
        orphans = [uid for uid in claimspec.claim_uids(self.config.cdi_dir) if uid not in self.claims]
        for uid in orphans:
            claimspec.remove(self.config.cdi_dir, uid)
        return orphans

    # -- prepare ----------------------------------------------------------------------------------------------
    def prepare(self, namespace: str, uid: str, name: str) -> tuple[list[PreparedDevice], str]:
        """(devices, "") or ([], error line)."""
        start = time.monotonic()
        try:
            devices = self._prepare(namespace, uid, name)
        except (ClaimError, ConfigError, GpuhookError, ValueError) as exc:
            error = f"{namespace}/{name} ({uid}): {exc}"
            log.warning("prepare %s refused in %.1f ms", error, (time.monotonic() - start) * 1000)
            return [], error
        log.info("prepared %s/%s (%s): %s in %.1f ms", namespace, name, uid,
                 ", ".join(i for d in devices for i in d.cdi_ids), (time.monotonic() - start) * 1000)
        return devices, ""

    def _prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        known = self.claims.get(uid)
        if known is not None:
            path = claimspec.spec_path(self.config.cdi_dir, uid)
            if os.path.exists(path):
                return list(known.devices)
            # the spec went missing (a wiped /var/run): fall through and prepare afresh
        claimspec.spec_path(self.config.cdi_dir, uid)  # refuses a UID that cannot name a file
        claim = self.read_claim(namespace, name)
        allocated = results(claim, uid, self.config.driver, self.config.node)
        current = self.devices
        if current is None:
            raise ClaimError("no devices discovered on this node")
        chosen = self._devices(current, allocated)
        self._sharing(allocated, chosen)
        prepared = self._prepared(uid, allocated, chosen)
        with self._lock:
            spec = claimspec.build(current.inventory, uid, list(chosen.values()), self.config.hook_path,
                                   self.config.host_driver_root, self.config.host_dev_root)
            claimspec.write(self.config.cdi_dir, uid, spec)
            claims = {**self.claims, uid: PreparedClaim(namespace, name, tuple(prepared))}
            try:
                checkpoint.save(self.config.checkpoint_path, claims)
            except GpuhookError:
                claimspec.remove(self.config.cdi_dir, uid)
                raise
            self.claims = claims
        return prepared

    def _devices(self, current: Devices, allocated: Sequence[Result]) -> dict[str, DraDevice]:
        """The claim's devices, in allocation order, each checked to exist and be healthy."""
        chosen: dict[str, DraDevice] = {}
        unhealthy = self.board.unhealthy
        for r in allocated:
            device = current.by_name.get(r.device)
            if device is None:
                raise ClaimError(f"device {clip(r.device)} is not on this node (any more): it vanished after "
                                 "allocation; delete the pod so the claim is allocated again")
            reason = unhealthy.get(device.key)
            if reason is not None:
                raise ClaimError(f"device {r.device} is unhealthy ({reason}); delete the pod so the claim is "
                                 "allocated again")
            if r.config is not None:
                check_target(r.config, "mig" if isinstance(device.target, MigDevice) else "gpu", r.device)
            chosen.setdefault(r.device, device)
        return chosen

    def _sharing(self, allocated: Sequence[Result], chosen: dict[str, DraDevice]) -> None:
        """Time-slicing for the GPUs whose config asks for it; run only after every check passed, so a refused
        claim changes nothing on a GPU."""
        slicing = {chosen[r.device].target.index: chosen[r.device].target for r in allocated
                   if _time_slicing(r.config) and isinstance(chosen[r.device].target, Gpu)}
        if slicing:
            for line in self.apply_sharing([slicing[i] for i in sorted(slicing)]):
                log.info("time-slicing: %s", line)

    def _prepared(self, uid: str, allocated: Sequence[Result], chosen: dict[str, DraDevice]) -> list[PreparedDevice]:
        by_device: dict[str, list[str]] = {}
        for r in allocated:
            by_device.setdefault(r.device, []).append(r.request)
        return [PreparedDevice(tuple(by_device[name]), self.config.node, name, (claimspec.cdi_id(uid, name),))
                for name in chosen]

    # -- unprepare --------------------------------------------------------------------------------------------
    def unprepare(self, uid: str) -> str:
        """"" when the claim is unprepared (or was never prepared here), else the error line."""
        try:
            claimspec.spec_path(self.config.cdi_dir, uid)
        except ValueError as exc:
            return str(exc)
        try:
            with self._lock:
                claimspec.remove(self.config.cdi_dir, uid)
                if uid in self.claims:
                    claims = {k: v for k, v in self.claims.items() if k != uid}
                    checkpoint.save(self.config.checkpoint_path, claims)
                    self.claims = claims
        except (OSError, GpuhookError) as exc:
            log.warning("unprepare %s failed: %s", uid, exc)
            return f"{uid}: {exc}"
        log.info("unprepared %s", uid)
        return ""


def _time_slicing(config: DeviceConfig | None) -> bool:
    return config is not None and config.time_slicing
