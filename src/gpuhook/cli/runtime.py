"""`gpuhook runtime configure`: thin click wrapper around runtimes.plan() and files.apply()."""

from __future__ import annotations

import click

from gpuhook.runtimeconfig.files import apply, unified_diff
from gpuhook.runtimeconfig.runtimes import MODES, RUNTIMES, Options, Plan, plan


@click.group()
def runtime() -> None:
    """Configure a container runtime for gpuhook (CDI or the prestart hook)."""


@runtime.command()
@click.option("--runtime", "runtime_name", type=click.Choice(RUNTIMES), required=True, help="Runtime to configure.")
@click.option("--config", "config_path", default=None, metavar="PATH",
              help="Config file [default: the runtime's usual one, see runtime-config/README.md].")
@click.option("--mode", type=click.Choice(MODES), default="cdi", show_default=True,
              help="cdi: the runtime reads gpuhook's CDI spec; hook: the runtime runs gpuhook-hook at prestart.")
@click.option("--hooks-dir", default=None, metavar="DIR",
              help="crio/podman hook mode: where gpuhook.json goes [default: /etc/containers/oci/hooks.d].")
@click.option("--hook-path", default=None, metavar="PATH",
              help="Hook program to register [default: /usr/local/bin/gpuhook-hook, where `gpuhook hook install` "
                   "writes it].")
@click.option("--hook-config", default=None, metavar="FILE",
              help="Hook mode: the hook's own config file, passed to it as --config FILE [default: none, the hook "
                   "reads /etc/gpuhook/config.toml].")
@click.option("--dry-run", is_flag=True, help="Print the diff; change nothing.")
def configure(runtime_name: str, config_path: str | None, mode: str, hooks_dir: str | None, hook_path: str | None,
              hook_config: str | None, dry_run: bool) -> None:
    """Edit the runtime's config in place (comments and other settings kept, backup <file>.gpuhook.bak)."""
    result = plan(Options(runtime_name, mode, config_path, hooks_dir, hook_path, hook_config))
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    _report(result, dry_run)


def _report(result: Plan, dry_run: bool) -> None:
    changed = [c for c in result.changes if c.changed]
    what = f"{result.runtime} ({'CDI' if result.mode == 'cdi' else 'prestart hook'})"
    if not changed:
        where = ", ".join(c.path for c in result.changes) or result.config
        click.echo(f"{what} is already configured in {where}; nothing changed")
        return
    if dry_run:
        for change in changed:
            click.echo(unified_diff(change), nl=False)
        click.echo(f"dry run: {len(changed)} file(s) would change for {what}; nothing written")
        return
    for change in changed:
        backup = apply(change)
        click.echo(f"updated {change.path} (backup: {backup})" if backup else f"created {change.path}")
    click.echo(f"configured {what}; {result.restart}")
