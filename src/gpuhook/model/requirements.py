"""NVIDIA_REQUIRE_* constraints, evaluated as nvidia-container-cli evaluates them (libnvidia-container's dsl.c,
which NVIDIA's legacy hook hands every value to; the toolkit's internal/requirements/constraints agrees on the
structure).

A value is an OR of terms separated by spaces; a term is an AND of factors separated by commas:
`cuda>=12.2 brand=tesla,driver>=525,driver<526` holds on CUDA >= 12.2, or on a Tesla board with a 525 driver (CUDA
forward compatibility). Separate variables are ANDed. Terms are evaluated left to right and the first one that
holds decides; inside a term the first factor that fails ends it. A factor is parsed only when it is reached, so
`cuda>=11.6 foo=bar` starts on CUDA 12 while `foo=45` alone is an invalid requirement, as with NVIDIA.

Evaluated per selected device (a MIG device by its GPU), since arch and brand are per device; with no device, or
a value the host cannot tell (procfs discovery), arch and brand hold, as nvidia-container-cli assumes without a
device. cuda and driver are the host's: a factor on one the host cannot tell refuses the start, never passes.

Cost is linear in the input: each value is split once, devices with the same arch and brand share one evaluation,
and request.requirements bounds the sizes before anything here runs.
"""

from __future__ import annotations

from gpuhook.errors import RequestError, RequirementError, clip
from gpuhook.model.contract import DISABLE_REQUIRE
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path)
if TYPE_CHECKING:
    from collections.abc import Iterator

KEYS = ("cuda", "driver", "arch", "brand")
HOST_KEYS = ("cuda", "driver")  # the host's own values; arch and brand are the device's
OPERATOR_CHARS = "<>=!"
# dsl.c matches the run of operator characters against this table by its first len(run) characters, so a lone
# "!" is "!=" there too; every other run must be one of these exactly.
OPERATORS = ("=", "!=", "<", "<=", ">", ">=")
OR_SEPARATOR, AND_SEPARATOR = " ", ","  # dsl.c splits on these two characters and no other whitespace
_ULONG_DIGITS = 20  # strtoul saturates past 2**64 - 1: a longer number is invalid in dsl.c too


class Condition(Record):
    """One factor, as written (`text`) and parsed."""

    key: str
    op: str
    value: str
    text: str

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value}"


class Outcome(Record):
    """How one constraint fared on one device: `term` is the index of the term that held (None: none did, or
    the value has no term, which holds as in dsl.c), `unmet` the last factor that failed, `values` the host's
    values for that device (known ones only)."""

    constraint: str
    held: bool
    term: int | None
    terms: tuple[str, ...]
    unmet: Condition | None
    values: tuple[tuple[str, str], ...]
    gpu: int | None = None

    @property
    def deciding_term(self) -> str:
        return self.terms[self.term] if self.term is not None else ""

    def host(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.values) or "no known values"


def terms(constraint: str) -> list[list[str]]:
    """The constraint's terms (OR) and their factors (AND) as text, empty pieces dropped. A term whose factors are
    all empty (`,`) holds in dsl.c; it is kept here as an empty list, which holds too."""
    out: list[list[str]] = []
    for term in constraint.split(OR_SEPARATOR):
        if term:
            out.append([f for f in term.split(AND_SEPARATOR) if f])
    return out


def count_conditions(constraint: str) -> int:
    """Factors in a value (request.requirements bounds them before anything parses one; the value itself is
    bounded in size first, so splitting it here is)."""
    return sum(len(factors) for factors in terms(constraint))


def _invalid(constraint: str, factor: str, why: str) -> RequestError:
    where = f" in {clip(constraint)}" if constraint != factor else ""
    return RequestError(f"invalid requirement {clip(factor)}{where}: {why}")


def parse_condition(factor: str, constraint: str | None = None) -> Condition:
    """`key op value` as dsl.c's evaluate_rule reads it: the key (case-insensitive) up to the first operator
    character, one of the six operators, a non-empty value. Raises RequestError naming the factor."""
    whole = factor if constraint is None else constraint
    end = next((i for i, ch in enumerate(factor) if ch in OPERATOR_CHARS), -1)
    if end <= 0:
        raise _invalid(whole, factor, "expected KEY OP VALUE (cuda, driver, arch, brand; =, !=, <, <=, >, >=)")
    key = factor[:end].lower()
    run_end = end
    while run_end < len(factor) and factor[run_end] in OPERATOR_CHARS:
        run_end += 1
    run = factor[end:run_end]
    op = "!=" if run == "!" else run
    value = factor[run_end:]
    if op not in OPERATORS:
        raise _invalid(whole, factor, f"unknown operator {clip(run)}")
    if not value:
        raise _invalid(whole, factor, "no value")
    if key not in KEYS:
        raise _invalid(whole, factor, f"unknown key {clip(factor[:end])} (cuda, driver, arch, brand)")
    if key == "brand":
        if op not in ("=", "!="):
            raise _invalid(whole, factor, "brand takes only = and !=")
    elif _numbers(value) is None:
        raise _invalid(whole, factor, f"{clip(value)} is not a version")
    return Condition(key, op, value, factor)


def _numbers(version: str) -> tuple[int, ...] | None:
    """A version's numbers as dsl_compare_version reads them (digits and dots only, runs of dots are one
    separator); None if it is not one. Each number is bounded before int() sees it."""
    if not version or version.strip("0123456789.") or version[0] == ".":
        return None
    out = []
    for part in version.split("."):
        if not part:
            continue
        digits = part.lstrip("0") or "0"
        if len(digits) > _ULONG_DIGITS or int(digits) >= 2**64 - 1:
            return None
        out.append(int(digits))
    return tuple(out)


def compare_versions(actual: str, op: str, wanted: str) -> bool:
    """dsl_compare_version: number by number; when one side runs out, the other's remaining numbers count only if
    one is non-zero (`525.147.05 >= 525`, `12.0 = 12`). A host value that is not a version compares as unknown."""
    a, w = _numbers(actual), _numbers(wanted)
    if a is None or w is None:
        raise RequestError(f"cannot compare {clip(actual)} with {clip(wanted)}: not a version")
    width = max(len(a), len(w))
    a, w = a + (0,) * (width - len(a)), w + (0,) * (width - len(w))
    return {"=": a == w, "!=": a != w, "<": a < w, "<=": a <= w, ">": a > w, ">=": a >= w}[op]


def host_value(inv: Inventory, gpu: Gpu | None, key: str) -> str | None:
    if key == "cuda":
        return inv.cuda_version or None
    if key == "driver":
        return inv.driver_version or None
    if gpu is None:
        return None
    return (gpu.compute_capability if key == "arch" else gpu.brand) or None


def _holds(cond: Condition, actual: str) -> bool:
    if cond.key == "brand":
        equal = actual.lower() == cond.value.lower()
        return equal if cond.op == "=" else not equal
    return compare_versions(actual, cond.op, cond.value)


def evaluate(inv: Inventory, constraint: str, gpu: Gpu | None) -> Outcome:
    """One constraint on one device (None: no device). Raises RequestError for an invalid factor it reaches and
    RequirementError for a host value it needs and the host cannot tell."""
    pieces = terms(constraint)
    texts = tuple(",".join(t) for t in pieces)
    values = tuple((k, v) for k in KEYS if (v := host_value(inv, gpu, k)) is not None)
    index_of = gpu.index if gpu is not None else None
    unmet: Condition | None = None
    for index, factors in enumerate(pieces):
        held = True
        for factor in factors:
            cond = parse_condition(factor, constraint)
            actual = host_value(inv, gpu, cond.key)
            if actual is None:
                if cond.key in HOST_KEYS:
                    raise RequirementError(
                        f"cannot check requirement {clip(constraint)}: the host's {cond.key} version is unknown")
                continue  # a per-device value nobody can tell: it holds, as without a device
            if not _holds(cond, actual):
                held, unmet = False, cond
                break
        if held:
            return Outcome(constraint, True, index, texts, None, values, index_of)
    return Outcome(constraint, not pieces, None, texts, unmet, values, index_of)


def _profiles(inv: Inventory, devices: tuple[Gpu | MigDevice, ...]) -> list[Gpu | None]:
    """One GPU per distinct (arch, brand) among the devices (a MIG device counts as its GPU): the outcome
    depends on nothing else, so 8 identical GPUs cost one evaluation."""
    seen: dict[tuple[str, str], Gpu] = {}
    for d in devices:
        gpu = d if isinstance(d, Gpu) else inv.gpus[d.gpu_index]
        seen.setdefault((gpu.compute_capability or "", gpu.brand or ""), gpu)
    return list(seen.values()) or [None]


def outcomes(inv: Inventory, constraints: tuple[str, ...], devices: tuple[Gpu | MigDevice, ...]
             ) -> Iterator[Outcome]:
    """Each constraint's outcome on each device profile, in order, one at a time (check stops at the first that
    fails; doctor shows them all)."""
    for gpu in _profiles(inv, devices):
        for text in constraints:
            yield evaluate(inv, text, gpu)


def check(inv: Inventory, constraints: tuple[str, ...], devices: tuple[Gpu | MigDevice, ...]) -> list[Outcome]:
    """Raise RequirementError naming the first constraint that no term satisfies, with the host's values; else
    every outcome, which held (doctor says which term decided each)."""
    held = []
    for outcome in outcomes(inv, constraints, devices):
        if not outcome.held:
            raise RequirementError(unsatisfied_message(outcome))
        held.append(outcome)
    return held


def unsatisfied_message(outcome: Outcome) -> str:
    where = f" on GPU {outcome.gpu}" if outcome.gpu is not None else ""
    last = f"; last unmet: {clip(str(outcome.unmet), quote=False)}" if outcome.unmet else ""
    return (f"unsatisfied requirement {clip(outcome.constraint)}: no term holds with {outcome.host()}{where}{last}; "
            f"{way_out(outcome)}")


def way_out(outcome: Outcome) -> str:
    """What the user can do about an unmet requirement: the driver it asks for, or starting without the check."""
    unmet = outcome.unmet
    if unmet is not None and unmet.key in ("cuda", "driver") and unmet.op in (">", ">=", "="):
        need = "a newer NVIDIA driver (one with CUDA " if unmet.key == "cuda" else "NVIDIA driver "
        need += clip(f"{unmet.op}{unmet.value}", 64, quote=False) + (")" if unmet.key == "cuda" else "")
        where = f"install {need}"
    else:
        where = "run it on a host whose GPU and driver meet it"
    return f"{where}, or set {DISABLE_REQUIRE}=true to start it without the check"
