"""CDI name syntax: kind = `vendor/class`, qualified device name = `vendor/class=name`.

The rules are the Go loader's (tags.cncf.io/container-device-interface/pkg/parser): vendor and class start with
a letter, end with a letter or digit, and use [A-Za-z0-9_.-] in between; a device name starts and ends with a
letter or digit and may also use ':' in between.
"""

from __future__ import annotations

from gpuhook.cdi.errors import InvalidName

# How a spec names each device (see spec.device_names): "0"/"0:1", "GPU-…"/"MIG-…", "gpu0"/"mig0:1".
NAME_STRATEGIES: tuple[str, ...] = ("index", "uuid", "type-index")
DEFAULT_NAME_STRATEGIES: tuple[str, ...] = ("index", "uuid")

_VENDOR_OR_CLASS = r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_DEVICE = r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?"


def _matches(pattern: str, name: str) -> bool:
    """`name` is all of `pattern`. `re` is imported at the first check, not with this module: `generate-cdi`'s
    command line loads this module (its strategies), and a cold run loads `re` only while NVML's child works."""
    import re

    return re.fullmatch(pattern, name) is not None  # re keeps the compiled pattern in its own cache


def vendor_problem(vendor: str) -> str | None:
    """Why `vendor` is not a valid CDI vendor name, or None."""
    return _vendor_or_class_problem("vendor", vendor)


def class_problem(cls: str) -> str | None:
    """Why `cls` is not a valid CDI class name, or None."""
    return _vendor_or_class_problem("class", cls)


def _vendor_or_class_problem(what: str, name: str) -> str | None:
    if not name:
        return f"empty {what} name"
    if _matches(_VENDOR_OR_CLASS, name):
        return None
    return (f"invalid {what} name {name!r}: must start with a letter, end with a letter or digit, "
            "and contain only letters, digits, '_', '.' and '-'")


def device_name_problem(name: str) -> str | None:
    """Why `name` is not a valid CDI device name, or None."""
    if not name:
        return "empty device name"
    if _matches(_DEVICE, name):
        return None
    return (f"invalid device name {name!r}: must start and end with a letter or digit, "
            "and contain only letters, digits, '_', '.', ':' and '-'")


def kind_problem(kind: str) -> str | None:
    """Why `kind` is not a valid `vendor/class`, or None."""
    vendor, sep, cls = kind.partition("/")
    if not sep or not vendor or not cls:
        return f"invalid kind {kind!r}: expected vendor/class"
    return vendor_problem(vendor) or class_problem(cls)


def make_kind(vendor: str, cls: str) -> str:
    """`vendor/class`, raising InvalidName if either part is malformed."""
    problem = vendor_problem(vendor) or class_problem(cls)
    if problem:
        raise InvalidName(problem)
    return f"{vendor}/{cls}"


def parse_kind(kind: str) -> tuple[str, str]:
    problem = kind_problem(kind)
    if problem:
        raise InvalidName(problem)
    vendor, _, cls = kind.partition("/")
    return vendor, cls


def qualified_name(vendor: str, cls: str, name: str) -> str:
    """`vendor/class=name`, raising InvalidName if any part is malformed."""
    kind = make_kind(vendor, cls)
    problem = device_name_problem(name)
    if problem:
        raise InvalidName(problem)
    return f"{kind}={name}"


def parse_qualified_name(text: str) -> tuple[str, str, str]:
    """(vendor, class, name) of `vendor/class=name`; InvalidName if it is not one."""
    kind, sep, name = text.partition("=")
    if not sep or not kind or not name or text.startswith("/"):
        raise InvalidName(f"{text!r} is not a qualified CDI device name (vendor/class=name)")
    vendor, cls = parse_kind(kind)
    problem = device_name_problem(name)
    if problem:
        raise InvalidName(problem)
    return vendor, cls, name


def is_qualified_name(text: str) -> bool:
    try:
        parse_qualified_name(text)
    except InvalidName:
        return False
    return True
