"""`gpuhook service [--config FILE]`, click-free: its options (the one table the click command in
cli/service.py uses too) and its start.

cli/__init__.main runs a plain command line through `lean_main`, as systemd's unit does, because whatever the
service imports stays resident and every start that touches a container forks it: click and what it loads
make the process 21 MB instead of 13 MB, and each fork (and each page the child then touches) dearer.
Anything else (help, an unknown option) goes to the click command.
"""

from __future__ import annotations

from gpuhook.cli.options import Option, parse_lean

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

SERVICE_OPTIONS: tuple[Option, ...] = (
    Option(("--config",), "config_path", "Config file [default: /etc/gpuhook/config.toml].", metavar="FILE"),
)


def run(config_path: str | None) -> int:
    """Serve until SIGTERM: the hooks, `generate-cdi` for the console script and the shim's planning
    (service/client.py)."""
    from gpuhook.cli import generate
    from gpuhook.service.protocol import GENERATE_CDI, RUNTIME_PREPARE
    from gpuhook.service.server import main
    from gpuhook.shim import runtime

    return main(config_path, {GENERATE_CDI: generate.serve, RUNTIME_PREPARE: runtime.serve})


def lean_main(args: Sequence[str]) -> int | None:
    """`gpuhook service ARGS` without click: its exit status, or None when click must answer."""
    params = parse_lean(args, SERVICE_OPTIONS)
    return None if params is None else run(**params)
