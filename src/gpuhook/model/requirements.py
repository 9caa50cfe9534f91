"""NVIDIA_REQUIRE_* constraints: `cuda>=12.0 brand=tesla,brand=nvidia` (space = AND, comma = OR).

Evaluated per selected device (arch and brand are per device; cuda and driver are the host's).
"""

from __future__ import annotations

import re

from gpuhook.errors import RequestError, RequirementError, clip
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record

KEYS = ("cuda", "driver", "arch", "brand")
# Patterns as text: `re` compiles (and caches) them at first use, so importing costs nothing (the hook's path).
_COND_RE = r"^([a-z]+)(<=|>=|=|<|>)(.+)$"
_VERSION_RE = r"[0-9]{1,9}(\.[0-9]{1,9}){0,3}"  # ASCII and bounded: int() of any of it is safe


class Condition(Record):
    key: str
    op: str
    value: str

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value}"


def parse_condition(text: str) -> Condition:
    match = re.match(_COND_RE, text.strip())
    if not match or match.group(1) not in KEYS:
        raise RequestError(f"invalid requirement {clip(text)} (expected cuda|driver|arch|brand with =,<,<=,>,>=)")
    key, op, value = match.groups()
    if key == "brand" and op != "=":
        raise RequestError(f"invalid requirement {clip(text)}: brand only takes '='")
    if key != "brand" and not re.fullmatch(_VERSION_RE, value):
        raise RequestError(f"invalid requirement {clip(text)}: {clip(value)} is not a version")
    return Condition(key, op, value)


def parse_constraint(text: str) -> list[list[Condition]]:
    """AND of ORs."""
    return [[parse_condition(c) for c in word.split(",") if c] for word in text.split()]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"[0-9]{1,18}", text))


def _compare(actual: str, op: str, wanted: str) -> bool:
    a, w = _version(actual), _version(wanted)
    width = max(len(a), len(w))
    a, w = a + (0,) * (width - len(a)), w + (0,) * (width - len(w))
    return {"=": a == w, "<": a < w, "<=": a <= w, ">": a > w, ">=": a >= w}[op]


def host_value(inv: Inventory, gpu: Gpu | None, key: str) -> str | None:
    if key == "cuda":
        return inv.cuda_version or None
    if key == "driver":
        return inv.driver_version
    if gpu is None:
        return None
    return gpu.compute_capability or None if key == "arch" else gpu.brand or None


# The host's own values: a constraint on them that cannot be checked refuses the start, never passes.
HOST_KEYS = ("cuda", "driver")


def _holds(cond: Condition, actual: str | None) -> bool:
    if actual is None:
        return True  # a per-device value the host cannot say (no device, or procfs discovery)
    if cond.key == "brand":
        return actual.lower() == cond.value.lower()
    return _compare(actual, cond.op, cond.value)


def check(inv: Inventory, constraints: tuple[str, ...], devices: tuple[Gpu | MigDevice, ...]) -> None:
    """Raise RequirementError naming the first unmet constraint and the host's value."""
    gpus: list[Gpu | None] = [d if isinstance(d, Gpu) else inv.gpus[d.gpu_index] for d in devices] or [None]
    for text in constraints:
        parsed = parse_constraint(text)
        for alternatives in parsed:
            for c in alternatives:
                if c.key in HOST_KEYS and host_value(inv, None, c.key) is None:
                    raise RequirementError(
                        f"cannot check requirement {clip(text)}: the host's {c.key} version is unknown"
                    )
        for gpu in gpus:
            for alternatives in parsed:
                if not any(_holds(c, host_value(inv, gpu, c.key)) for c in alternatives):
                    c = alternatives[0]
                    where = f" on GPU {gpu.index}" if gpu is not None and c.key in ("arch", "brand") else ""
                    raise RequirementError(
                        f"unsatisfied requirement {clip(text)}: {clip(','.join(map(str, alternatives)), quote=False)} "
                        f"but the host has {c.key} {host_value(inv, gpu, c.key)}{where}"
                    )
