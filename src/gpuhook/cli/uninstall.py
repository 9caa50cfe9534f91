"""`gpuhook uninstall`: a host put back as it was before gpuhook: every runtime's config restored from the backups
`runtime configure` wrote (runtimeconfig/unconfigure.py), what `hook install` wrote removed (cli/entry.py), and
gpuhook's enabled systemd units disabled and stopped (system/units.py)."""

from __future__ import annotations

import click

from gpuhook.hook.installed import DEFAULT_PATH
from gpuhook.runtimeconfig.runtimes import RUNTIMES


@click.command("uninstall")
@click.option("--runtime", "runtimes", multiple=True, type=click.Choice(RUNTIMES),
              help="Put back only these runtimes; repeatable [default: every one].")
@click.option("--hook-path", default=DEFAULT_PATH, show_default=True, help="Where `hook install` wrote the entry.")
@click.option("--dry-run", is_flag=True, help="Say what would be put back or removed; change nothing.")
def uninstall(runtimes: tuple[str, ...], hook_path: str, dry_run: bool) -> None:
    """Undo `runtime configure` (default paths) for every runtime, then `hook install` (with its --docker-gpus
    copy), and (without --runtime) disable gpuhook's systemd units (the CDI refresh, the service's socket). Then
    remove the package
    itself: `pip uninstall gpuhook`, or `apt-get purge gpuhook`."""
    from gpuhook.cli.entry import docker_gpus_path
    from gpuhook.cli.entry import uninstall as remove_entry
    from gpuhook.cli.runtime import unconfigure_runtime
    from gpuhook.hook.installed import FALLBACK_SUFFIX, is_ours
    from gpuhook.system import units

    for name in runtimes or RUNTIMES:
        unconfigure_runtime(name, None, None, dry_run)
    if dry_run:
        for path in (hook_path, docker_gpus_path(hook_path)):
            for name in (path, path + FALLBACK_SUFFIX):
                if is_ours(name):
                    click.echo(f"dry run: would remove {name}")
        for unit in units.enabled() if not runtimes else ():
            click.echo(f"dry run: would disable and stop {unit}")
        return
    for name in remove_entry(hook_path, docker_gpus=True):
        click.echo(f"removed {name}")
    on = units.enabled() if not runtimes else []  # the whole host only, not one runtime's set-up
    failed = units.disable(on)
    for unit in on:
        if not any(f.startswith(unit + ":") for f in failed):
            click.echo(f"disabled and stopped {unit}")
    if failed:
        raise click.ClickException("systemctl disable failed: " + "; ".join(failed))
