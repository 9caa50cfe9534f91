"""`gpuhook service`'s click command (help, errors); a plain command line starts without click (cli/serve.py)."""

from __future__ import annotations

import click

from gpuhook.cli.app import apply_options
from gpuhook.cli.serve import SERVICE_OPTIONS, run


@click.command("service")
@apply_options(SERVICE_OPTIONS)
def service(config_path: str | None) -> None:
    """Serve the prestart hook to the native hook entry `gpuhook hook install` writes, warm: one fork per
    container start instead of a fresh interpreter; and `gpuhook generate-cdi` to the console script. Root only;
    stops on SIGTERM. It listens on $GPUHOOK_SERVICE_SOCKET, else /run/gpuhook/service.sock (or on the socket
    systemd passes): the one place every client looks."""
    raise SystemExit(run(config_path))
