"""The record a hook or shim leaves when the container runtime ignored a container's CDI devices, and its parser.

Written by `hook/cdiignored.py` (one per node, `contract.CDI_IGNORED_RECORD` in the state directory) and read by
the device plugin (`plugin/cdiignored.py`) and doctor, which cannot import each other (nor the plugin the hook):
so the format, and the sentence both say about it, live here, once. Plain
`key value` lines, each value escaped and clipped (errors.clip) when the record is made, so the file is bounded
and a container id or pod env cannot forge a line of it, nor of the plugin's log. Pure: no I/O.
"""

from __future__ import annotations

from gpuhook.errors import clip
from gpuhook.model.record import Record

MAX_BYTES = 4096  # what the reader reads at most; a record is made well under it
ID_LIMIT = 128  # containerd and CRI-O ids are 64 hex digits
NAMES_LIMIT = 1024  # the CDI names, joined: a few GPUs' worth, and the clip says how many characters were cut
_KEYS = {"container": "container", "cdi-devices": "devices", "time": "time"}
_CLIP_NOTE = 32  # what clip() adds to a cut value ("… (N characters)"): a rendered record parses back unchanged


class CdiIgnored(Record):
    container: str
    devices: str  # the CDI names the runtime left out, comma-joined, as clipped when recorded
    time: str = ""  # when the hook or shim saw it (UTC, ISO 8601)


SEAL = ";"  # the marker is "<CDI names>;<MAC>": the names, then what proves this node's plugin wrote them
MAC_HEX = 32


def _mac(key: bytes, names: str) -> str:
    import hashlib
    import hmac

    return hmac.new(key, names.encode(), hashlib.sha256).hexdigest()[:MAC_HEX]


def seal(key: bytes, names: str) -> str:
    """The marker's value for `names`: sealed with the node's key (contract.PLUGIN_KEY), or the names alone
    without one (no state directory: no record can be written anyway)."""
    return f"{names}{SEAL}{_mac(key, names)}" if key else names


def names_of(marker: str) -> str:
    """The CDI names of a marker, sealed or not."""
    return marker.partition(SEAL)[0]


def sealed_by(key: bytes, marker: str) -> bool:
    """Whether `marker` carries the MAC `key` makes for its names (constant time)."""
    import hmac

    names, _, mac = marker.partition(SEAL)
    return bool(key) and len(mac) == MAC_HEX and hmac.compare_digest(mac, _mac(key, names))


def render(container_id: str, devices: tuple[str, ...], when: str) -> bytes:
    """The record's bytes: every value one escaped, clipped line."""
    lines = {"container": clip(container_id, ID_LIMIT, quote=False) or "?",
             "cdi-devices": clip(",".join(devices), NAMES_LIMIT, quote=False),
             "time": clip(when, 64, quote=False)}
    return "".join(f"{key} {value}\n" for key, value in lines.items()).encode()


def parse(data: bytes) -> CdiIgnored | None:
    """The record in `data` (at most MAX_BYTES of it are looked at), or None when it is not one (empty, half
    written by hand, something else): unknown lines are skipped, a container and its devices are required.
    Values are clipped again: the file is only as trustworthy as whoever could write the state directory."""
    values: dict[str, str] = {}
    for line in data[:MAX_BYTES].decode(errors="replace").splitlines():
        key, _, value = line.partition(" ")
        if key in _KEYS:
            limit = NAMES_LIMIT if key == "cdi-devices" else ID_LIMIT
            values[_KEYS[key]] = clip(value, limit + _CLIP_NOTE, quote=False)
    if not values.get("container") or not values.get("devices"):
        return None
    return CdiIgnored(values["container"], values["devices"], values.get("time", ""))


def message(rec: CdiIgnored) -> str:
    """What the record means, in one line: the plugin's warning, doctor's finding."""
    when = f" at {rec.time}" if rec.time else ""
    return (f"the container runtime ignored the CDI devices of container {rec.container} ({rec.devices}){when}: "
            "its GPUs came through NVIDIA_VISIBLE_DEVICES and gpuhook's hook/shim; enable CDI in the runtime "
            "(containerd >= 1.7: enable_cdi) or keep the hook/shim wiring")
