"""A ResourceClaim's allocation, read once: which of this driver's devices, for which requests, with which opaque
configuration. The one parser of the claim object; every refusal is one ClaimError line for that claim's result.

Facts used (resource.k8s.io/v1): `status.allocation.devices.results[]` = {request, driver, pool, device};
`status.allocation.devices.config[]` = {source: FromClass|FromClaim, requests: [...], opaque: {driver,
parameters}}, where a config with no requests applies to every request, the claim's own configs win over the
class's, and a later entry wins over an earlier one (the order the scheduler writes them in);
`status.allocation.nodeSelector` names the node a claim with node-local devices is bound to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuhook.dra.config import ConfigError, DeviceConfig, parse
from gpuhook.errors import clip
from gpuhook.model.record import Record

MAX_RESULTS = 128  # a claim can allocate at most 32 devices per request; bound what we read anyway


class ClaimError(ValueError):
    """This claim cannot be prepared here (the message goes into its NodePrepareResources result)."""


class Result(Record):
    request: str
    pool: str
    device: str
    config: DeviceConfig | None = None


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _node_selected(selector: Any, node: str) -> bool | None:
    """Whether a v1 NodeSelector's matchFields name `node` (None: no node-name term to judge by)."""
    if not isinstance(selector, Mapping):
        return None
    verdict: bool | None = None
    for term in selector.get("nodeSelectorTerms") or []:
        for field in _get(term, "matchFields") or []:
            if isinstance(field, Mapping) and field.get("key") == "metadata.name" and field.get("operator") == "In":
                if node in (field.get("values") or []):
                    return True
                verdict = False
    return verdict


def _requests_match(entry_requests: Any, request: str) -> bool:
    if not entry_requests:
        return True
    base = request.split("/", 1)[0]  # a firstAvailable sub-request "gpu/big" is configured by "gpu" too
    return request in entry_requests or base in entry_requests


def results(claim: Mapping[str, Any], uid: str, driver: str, node: str) -> list[Result]:
    """This driver's allocated devices of `claim` (the API's dict) with their configuration; ClaimError when the
    claim is not the one asked for, not allocated, allocated elsewhere, or configured in a way we refuse."""
    name = f"{_get(claim, 'metadata', 'namespace')}/{_get(claim, 'metadata', 'name')}"
    got_uid = _get(claim, "metadata", "uid")
    if got_uid != uid:
        raise ClaimError(f"ResourceClaim {clip(name, quote=False)} has UID {clip(got_uid)}, not {clip(uid)} "
                         "(deleted and recreated?)")
    allocation = _get(claim, "status", "allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"ResourceClaim {clip(name, quote=False)} is not allocated")
    if _node_selected(allocation.get("nodeSelector"), node) is False:
        raise ClaimError(f"ResourceClaim {clip(name, quote=False)} is allocated to another node than {clip(node)}")
    raw = _get(allocation, "devices", "results") or []
    if not isinstance(raw, list) or len(raw) > MAX_RESULTS:
        raise ClaimError(f"ResourceClaim {clip(name, quote=False)}: devices.results is not a list of at most "
                         f"{MAX_RESULTS} results")
    ours = [r for r in raw if isinstance(r, Mapping) and r.get("driver") == driver]
    if not ours:
        raise ClaimError(f"ResourceClaim {clip(name, quote=False)} has no device of driver {driver}")
    configs = _configs(_get(allocation, "devices", "config") or [], driver, name)
    out: list[Result] = []
    for r in ours:
        pool, device, request = r.get("pool"), r.get("device"), r.get("request")
        if not all(isinstance(v, str) and v for v in (pool, device, request)):
            raise ClaimError(f"ResourceClaim {clip(name, quote=False)}: malformed result {clip(dict(r))}")
        if pool != node:
            raise ClaimError(f"ResourceClaim {clip(name, quote=False)}: device {clip(device)} is allocated from "
                             f"pool {clip(pool)}, another node than {clip(node)}")
        chosen = None
        for requests, config in configs:
            if _requests_match(requests, request):
                chosen = config
        out.append(Result(request, pool, device, chosen))
    return out


def _configs(raw: Any, driver: str, name: str) -> list[tuple[list[str], DeviceConfig]]:
    """(requests, config) for this driver's opaque configs: the class's first, then the claim's, each in order."""
    if not isinstance(raw, list):
        raise ClaimError(f"ResourceClaim {clip(name, quote=False)}: devices.config is not a list")
    by_source: dict[str, list[tuple[list[str], DeviceConfig]]] = {"FromClass": [], "FromClaim": []}
    for n, entry in enumerate(raw):
        opaque = _get(entry, "opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        source = str(_get(entry, "source"))
        try:
            config = parse(opaque.get("parameters"), f"config[{n}] ({source})")
        except ConfigError as exc:
            raise ClaimError(f"ResourceClaim {clip(name, quote=False)}: {exc}") from None
        requests = _get(entry, "requests") or []
        by_source.setdefault(source, []).append(([str(r) for r in requests], config))
    return by_source.pop("FromClass") + by_source.pop("FromClaim") + [c for v in by_source.values() for c in v]
