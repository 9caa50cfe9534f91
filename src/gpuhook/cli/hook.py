"""`gpuhook hook [--config FILE] [prestart|createRuntime]`: the prestart hook reached through the main CLI, and
`gpuhook hook install`, which writes the lean entry script runtimes should call (click lives here, not in
hook/prestart.py or cli/entry.py, whose import paths must stay lean)."""

from __future__ import annotations

import click

from gpuhook.hook import installed
from gpuhook.hook.prestart import STAGES, main

CONFIG_HELP = "Config file [default: /etc/gpuhook/config.toml]."


def _run(config_path: str | None, stage: str) -> None:
    args = ([f"--config={config_path}"] if config_path else []) + [stage]
    raise SystemExit(main(args))


@click.group(invoke_without_command=True, context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", default=None, help=CONFIG_HELP)
@click.pass_context
def hook(ctx: click.Context, config_path: str | None) -> None:
    """OCI hook entry (state JSON on stdin; the stage defaults to prestart); also installed as `gpuhook-hook`."""
    if ctx.invoked_subcommand is None:
        _run(config_path, "prestart")


def _stage_command(stage: str) -> click.Command:
    @click.command(stage, help=f"Run the hook at the {stage} stage (state JSON on stdin).")
    @click.option("--config", "config_path", default=None, help=CONFIG_HELP)
    @click.pass_context
    def command(ctx: click.Context, config_path: str | None) -> None:
        parent = ctx.parent.params.get("config_path") if ctx.parent else None
        _run(config_path or parent, stage)

    return command


for _stage in STAGES:
    hook.add_command(_stage_command(_stage))


@hook.command("install")
@click.option("--path", "path", default=installed.DEFAULT_PATH, show_default=True,
              help="Where to write the entry script (atomically, mode 0755).")
@click.option("--docker-gpus", is_flag=True,
              help="Also write it as nvidia-container-runtime-hook beside --path, the program `docker run --gpus` "
                   "runs (restart dockerd afterwards: it looks the name up on its PATH at start).")
def install(path: str, docker_gpus: bool) -> None:
    """Write the hook entry: the native entry (it asks `gpuhook service`, else runs PATH.py) and PATH.py, a
    script that starts this Python with -IS (no `site`); only the script where the native one was not built.

    Point the runtime's hook configuration (oci-hooks.d, config.json hooks) and `generate-cdi --hook-path` at it;
    it answers both `[--config FILE] [prestart|createRuntime]` and the CDI spec's `cdi-hook …` calls. Run it
    again after moving or reinstalling gpuhook: the script records where the package is.
    """
    from gpuhook.cli.entry import install as write_entry

    notes: list[str] = []
    for written in write_entry(path, docker_gpus=docker_gpus, notes=notes):
        click.echo(f"gpuhook: wrote {written}")
    for note in notes:
        click.echo(f"gpuhook: note: {note}")
    if docker_gpus:
        click.echo("gpuhook: restart dockerd (it finds nvidia-container-runtime-hook on its PATH only at start); "
                   "the hook reads GPUHOOK_CONFIG from dockerd's environment, else /etc/gpuhook/config.toml")


@hook.command("uninstall")
@click.option("--path", "path", default=installed.DEFAULT_PATH, show_default=True,
              help="Where `hook install` wrote the entry.")
@click.option("--docker-gpus", is_flag=True, help="Also remove it as nvidia-container-runtime-hook beside --path.")
def uninstall(path: str, docker_gpus: bool) -> None:
    """Remove what `hook install` wrote: the entry at PATH and PATH.py, only where they are gpuhook's."""
    from gpuhook.cli.entry import uninstall as remove_entry

    removed = remove_entry(path, docker_gpus=docker_gpus)
    for name in removed:
        click.echo(f"gpuhook: removed {name}")
    if not removed:
        click.echo(f"gpuhook: no entry of gpuhook's at {path}; nothing removed")
