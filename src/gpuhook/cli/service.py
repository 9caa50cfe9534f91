"""`gpuhook service [--config FILE] [--socket PATH]`: the resident hook service (service/server.py)."""

from __future__ import annotations

import click


@click.command("service")
@click.option("--config", "config_path", default=None, help="Config file [default: /etc/gpuhook/config.toml].")
@click.option("--socket", "socket_path", default=None,
              help="Socket to listen on [default: the config's service-socket, /run/gpuhook/service.sock]; "
                   "a socket systemd passes (LISTEN_FDS) wins.")
def service(config_path: str | None, socket_path: str | None) -> None:
    """Serve the prestart hook to the native hook entry `gpuhook hook install` writes, warm: one fork per
    container start instead of a fresh interpreter; and `gpuhook generate-cdi` to the console script. Root only;
    stops on SIGTERM."""
    from gpuhook.cli import generate
    from gpuhook.service.server import main

    raise SystemExit(main(config_path, socket_path, {"generate-cdi": generate.serve}))
