"""Command-line options described once, without click (the root and cache options every discovering command
shares here, generate-cdi's in cli/generate.py), and the strict parser of the lean `generate-cdi` path.

click builds its options from these tables (app.click_options), so help, defaults and choices exist once. The
lean parser (used by cli/__init__.py before click is imported: click 8.5 alone costs ~20 ms of a 40 ms budget
for `generate-cdi`) accepts only what it fully understands: known long options (or `-o`), each given once unless
repeatable, a value that does not start with '-', a value among the option's choices. Anything else (help,
`--watch`, a typo, a bad choice, a positional argument) returns None and click answers, with its own messages,
so the lean path never changes what a command line means.
"""

from __future__ import annotations

from gpuhook.model.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any


class Option(Record):
    """One command-line option: its spellings, parameter name and how click shows and checks it."""

    flags: tuple[str, ...]  # ("--output", "-o")
    dest: str  # the parameter name
    help: str
    default: Any = None
    choices: tuple[str, ...] = ()  # a click.Choice when not empty
    multiple: bool = False
    is_flag: bool = False
    float_min: float | None = None  # a click.FloatRange(min=...) when set
    metavar: str | None = None
    show_default: bool = False
    lean: bool = True  # the lean generate-cdi parser may take it (flags and numbers go to click)
    path: bool = False  # a file or folder: a relative value is the client's (the service joins its cwd)


ROOT_OPTIONS: tuple[Option, ...] = (
    Option(("--driver-root",), "driver_root",
           "Root of the driver install [default: the hook config's driver-root, else /].", path=True),
    Option(("--dev-root",), "dev_root", "Root holding /dev [default: the hook config's, else the driver root].",
           path=True),
    Option(("--proc-root",), "proc_root", "procfs to read /driver/nvidia from [default: the hook config's, "
                                          "else /proc].", path=True),
    Option(("--discovery",), "discovery", "Where GPUs come from.", default="auto", choices=("auto", "nvml", "procfs"),
           show_default=True),
)

CACHE_OPTION = Option(
    ("--inventory-cache",), "inventory_cache",
    "Reuse a discovered inventory kept here while the driver's fingerprint (version, nodes, MIG layout, roots) "
    "holds, and refresh it when not [default: the hook's cache (config.toml inventory-cache) when the roots are "
    "the configured ones; '' for none].", metavar="FILE", path=True)

def parse_lean(args: Sequence[str], table: Sequence[Option]) -> dict[str, Any] | None:
    """The value of every lean option of `table` (defaults filled in) when `args` are only plain uses of them;
    None for anything click should answer."""
    by_flag = {flag: opt for opt in table for flag in opt.flags}
    values: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name, sep, value = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        opt = by_flag.get(name)
        if opt is None or not opt.lean:
            return None
        if not sep:
            if i + 1 >= len(args):
                return None
            i += 1
            value = args[i]
        i += 1
        if value.startswith("-") or (opt.choices and value not in opt.choices):
            return None
        if opt.multiple:
            values[opt.dest] = (*values.get(opt.dest, ()), value)
        elif opt.dest in values:
            return None
        else:
            values[opt.dest] = value
    return {opt.dest: values.get(opt.dest, opt.default) for opt in table if opt.lean}
