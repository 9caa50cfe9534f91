"""`gpuhook hook prestart|createRuntime`: the prestart hook reached through the main CLI (click lives here,
not in hook.py, whose import path must stay lean)."""

from __future__ import annotations

import click

from .hook import STAGES, main


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", default=None, help="Config file [default: /etc/gpuhook/config.toml].")
@click.argument("stage", type=click.Choice(STAGES), default="prestart")
def hook(config_path: str | None, stage: str) -> None:
    """OCI hook entry (state JSON on stdin); also installed as `gpuhook-hook`."""
    args = ([f"--config={config_path}"] if config_path else []) + [stage]
    raise SystemExit(main(args))
