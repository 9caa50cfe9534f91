"""`gpuhook system …`: host set-up beside the runtimes' configuration (NVIDIA's `nvidia-ctk system`)."""

from __future__ import annotations

import click

from gpuhook.cli.app import root_options
from gpuhook.cli.inventory import load_inventory
from gpuhook.system.devchar import DEFAULT_DEV_CHAR


@click.group("system")
def system() -> None:
    """Host set-up for GPU containers."""


@system.command("create-dev-char-symlinks")
@root_options
@click.option("--dev-char-path", default=DEFAULT_DEV_CHAR, show_default=True,
              help="Where the <major>:<minor> links go.")
def create_dev_char_symlinks(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str,
                             dev_char_path: str) -> None:
    """Link /dev/char/<major>:<minor> to every NVIDIA node, so that systemd keeps them in a container's cgroup
    across `systemctl daemon-reload` (idempotent; a link or file that is in the way is kept, with a warning)."""
    from gpuhook.system.devchar import create_links

    result = create_links(load_inventory(driver_root, dev_root, proc_root, discovery), dev_char_path)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"{dev_char_path}: {len(result.created)} link(s) created, {len(result.present)} already present"
               + (f", {len(result.warnings)} in the way (kept)" if result.warnings else ""))
