"""Which value wins: NVIDIA's precedence between the command line, the environment and the config file.

NVIDIA's NewConfig starts from the file, then lets every flag that urfave/cli reports as set override it, and a
flag is "set" when given on the command line or through its environment variable (the command line winning).
So: command line > environment > config file > the flag's default. The CLI (click, which also puts the command
line before the environment) passes the values it was given explicitly; everything else comes from the file or
the default. Booleans in the environment are read as Go's strconv.ParseBool, as urfave/cli reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuhook.model.request import TRUE_WORDS as GO_TRUE
from gpuhook.plugin.config import FileConfig

# gpuhook's names of the settings the config file can carry (FileConfig's fields), each also a flag.
SETTINGS = ("mig_strategy", "fail_on_init_error", "host_driver_root", "driver_root", "discovery",
            "pass_device_specs", "list_strategies", "id_strategy")
GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def parse_go_bool(text: str) -> bool:
    """strconv.ParseBool: anything but its twelve words is an error (ValueError), never a silent false."""
    if text in GO_TRUE:
        return True
    if text in GO_FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (expected one of {', '.join(GO_TRUE + GO_FALSE)})")


def resolve(explicit: Mapping[str, Any], file: FileConfig | None, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Each setting's value: given on the command line or in the environment (`explicit`), else set in the
    file, else the default. Settings absent from all three are absent from the result."""
    out: dict[str, Any] = {}
    for name in SETTINGS:
        from_file = getattr(file, name) if file is not None else None
        if name in explicit:
            out[name] = explicit[name]
        elif from_file is not None:
            out[name] = from_file
        elif name in defaults:
            out[name] = defaults[name]
    return out
