"""`gpuhook runtime configure`: thin click wrapper around runtimes.plan() and files.apply()."""

from __future__ import annotations

import click

from gpuhook.runtimeconfig.files import apply, unified_diff
from gpuhook.runtimeconfig.runtimes import MODES, RESTART, RUNTIMES, Options, Plan, plan

GPUS_MODE = "gpus"  # Docker's --gpus route: no config file, the hook under NVIDIA's name (cli/entry)


@click.group()
def runtime() -> None:
    """Configure a container runtime for gpuhook (CDI or the prestart hook)."""


@runtime.command()
@click.option("--runtime", "runtime_name", type=click.Choice(RUNTIMES), required=True, help="Runtime to configure.")
@click.option("--config", "config_path", default=None, metavar="PATH",
              help="Config file [default: the runtime's usual one, see runtime-config/README.md].")
@click.option("--mode", type=click.Choice((*MODES, GPUS_MODE)), default=None,
              help="cdi: the runtime reads gpuhook's CDI spec; hook: the runtime runs gpuhook-hook at prestart; "
                   "gpus (docker): `docker run --gpus` runs gpuhook, installed as nvidia-container-runtime-hook "
                   "[default: cdi where the installed runtime's version has CDI, else hook].")
@click.option("--hooks-dir", default=None, metavar="DIR",
              help="crio/podman hook mode: where gpuhook.json goes [default: /etc/containers/oci/hooks.d].")
@click.option("--hook-path", default=None, metavar="PATH",
              help="Hook program to register [default: /usr/local/bin/gpuhook-hook, where `gpuhook hook install` "
                   "writes it].")
@click.option("--hook-config", default=None, metavar="FILE",
              help="Hook mode: the hook's own config file, passed to it as --config FILE [default: none, the hook "
                   "reads /etc/gpuhook/config.toml].")
@click.option("--dry-run", is_flag=True, help="Print the diff; change nothing.")
def configure(runtime_name: str, config_path: str | None, mode: str | None, hooks_dir: str | None,
              hook_path: str | None, hook_config: str | None, dry_run: bool) -> None:
    """Edit the runtime's config in place (comments and other settings kept, backup <file>.gpuhook.bak)."""
    if mode is None:
        mode, why = auto_mode(runtime_name)
        click.echo(f"note: --mode {mode}: {why}", err=True)
    if mode == GPUS_MODE:
        _docker_gpus(runtime_name, config_path, hooks_dir, hook_config, hook_path, dry_run)
        return
    result = plan(Options(runtime_name, mode, config_path, hooks_dir, hook_path, hook_config))
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    _report(result, dry_run)


def auto_mode(runtime_name: str) -> tuple[str, str]:
    """cdi where the installed runtime can read CDI specs, else hook (Docker < 25 and containerd 1.6 cannot)."""
    from gpuhook.doctor.runtimes import BINARIES, CDI_SINCE, version_of

    since = CDI_SINCE.get(runtime_name)
    if since is None:
        return "cdi", f"{runtime_name} reads CDI specs"
    found = version_of(BINARIES[runtime_name])
    shown = ".".join(map(str, found)) if found else "not found"
    if found is not None and found < since:
        return "hook", (f"{runtime_name} {shown} has no CDI (it came in {'.'.join(map(str, since))}); "
                        "pass --mode cdi to configure it anyway")
    return "cdi", f"{runtime_name} {shown}" + (" (version unknown: assuming CDI)" if found is None else " reads CDI")


def _docker_gpus(runtime_name: str, config_path: str | None, hooks_dir: str | None, hook_config: str | None,
                 hook_path: str | None, dry_run: bool) -> None:
    """Docker's own --gpus route: no daemon.json change, only the hook under NVIDIA's name on dockerd's PATH."""
    from gpuhook.cli.entry import docker_gpus_path, install
    from gpuhook.errors import ConfigError
    from gpuhook.hook.installed import DEFAULT_PATH

    if runtime_name != "docker":
        raise ConfigError(f"--mode gpus is Docker's --gpus route; {runtime_name} has none (use cdi or hook)")
    if config_path or hooks_dir or hook_config:
        raise ConfigError("--mode gpus changes no config file: --config, --hooks-dir and --hook-config do not apply "
                          "(the hook reads GPUHOOK_CONFIG from dockerd's environment, else /etc/gpuhook/config.toml)")
    path = hook_path or DEFAULT_PATH
    if dry_run:
        click.echo(f"dry run: would write {path} and {docker_gpus_path(path)}; nothing written")
        return
    for written in install(path, docker_gpus=True):
        click.echo(f"wrote {written}")
    click.echo(f"configured docker (--gpus); restart dockerd to apply (it looks {docker_gpus_path(path)} up on its "
               "PATH only at start): systemctl restart docker")


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


@runtime.command()
@click.option("--runtime", "runtime_name", type=click.Choice(RUNTIMES), required=True, help="Runtime to put back.")
@click.option("--config", "config_path", default=None, metavar="PATH",
              help="Config file, as given to configure [default: the one configure picks].")
@click.option("--hooks-dir", default=None, metavar="DIR",
              help="crio/podman: the hooks dir given to configure [default: /etc/containers/oci/hooks.d].")
@click.option("--dry-run", is_flag=True, help="Say what would be put back; change nothing.")
def unconfigure(runtime_name: str, config_path: str | None, hooks_dir: str | None, dry_run: bool) -> None:
    """Put the runtime's config back as it was before `runtime configure` (from its <file>.gpuhook.bak backups;
    files configure created are removed)."""
    unconfigure_runtime(runtime_name, config_path, hooks_dir, dry_run)


def unconfigure_runtime(runtime_name: str, config_path: str | None, hooks_dir: str | None, dry_run: bool) -> int:
    """Print and (unless `dry_run`) apply runtimeconfig.unconfigure's plan; returns how many files it touches."""
    from gpuhook.runtimeconfig.unconfigure import apply_undo, plan_unconfigure

    result = plan_unconfigure(runtime_name, config_path, hooks_dir)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    for undo in result.undos:
        what = f"restore {undo.path} from {undo.backup}" if undo.action == "restore" else f"remove {undo.path}"
        if dry_run:
            click.echo(f"dry run: would {what}")
            continue
        apply_undo(undo)
        click.echo(f"restored {undo.path} from {undo.backup}" if undo.action == "restore" else f"removed {undo.path}")
    if not result.undos:
        click.echo(f"{runtime_name}: nothing of gpuhook's to put back")
    elif not dry_run:
        click.echo(f"unconfigured {runtime_name}; {RESTART[runtime_name]}")
    return len(result.undos)
