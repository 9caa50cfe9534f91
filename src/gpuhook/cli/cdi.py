"""`gpuhook generate-cdi`, `gpuhook cdi validate|list` and `gpuhook cdi-hook …` (what a CDI spec's hooks run).

Thin: parse options, call one function, print. Heavy modules (YAML, jsonschema, discovery, injection) are
imported inside the commands, so `cdi-hook`, which the runtime runs at every container start, stays cheap.
"""

from __future__ import annotations

import click

from gpuhook.cdi.errors import CdiError
from gpuhook.cli.app import apply_options
from gpuhook.cli.generate import GENERATE_OPTIONS, generate, hook_for, renderer


@click.command("generate-cdi")
@apply_options(GENERATE_OPTIONS)
def generate_cdi(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str,
                 output: str | None, fmt: str | None, mode: str, vendor: str, cls: str | None,
                 strategies: tuple[str, ...], hook_path: str | None, cdi_version: str | None, watch: bool,
                 poll_interval: float, inventory_cache: str | None) -> None:
    """Write a CDI spec for every GPU and MIG device the driver offers (plus `all`), or with --mode for the IMEX
    channels or a gated device family."""
    if not watch:
        generate(driver_root, dev_root, proc_root, discovery, output, fmt, mode, vendor, cls, strategies,
                 hook_path, cdi_version, inventory_cache)
        return
    render = renderer(output, fmt, mode, vendor, cls, strategies, hook_for(mode, hook_path), cdi_version)
    if output is None:
        raise click.UsageError("--watch needs --output FILE")
    from gpuhook.cdi.watch import watch_spec
    from gpuhook.cli.inventory import resolve_roots

    roots = resolve_roots(driver_root, dev_root, proc_root)
    raise SystemExit(watch_spec(roots, output, render, method=discovery, poll_interval=poll_interval))


@click.group()
def cdi() -> None:
    """Check and list CDI specs."""


@cdi.command("validate")
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def validate_cmd(files: tuple[str, ...]) -> None:
    """Check specs against the CDI schema and the loader's rules; one line per problem (stdout), exit 1 if any."""
    from gpuhook.cdi.validate import validate_file

    count = bad_files = 0
    for path in files:
        problems = validate_file(path)
        for line in problems:
            click.echo(line)
        if not problems:
            click.echo(f"{path}: ok")
        count += len(problems)
        bad_files += bool(problems)
    if count:
        raise CdiError(f"{count} problem(s) in {bad_files} of {len(files)} spec file(s)")


@cdi.command("list")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR",
              help="Spec directory, lowest priority first; repeatable [default: /etc/cdi /var/run/cdi].")
def list_cmd(spec_dirs: tuple[str, ...]) -> None:
    """Qualified device names a runtime resolves; conflicts and broken specs on stderr (then exit 1)."""
    from gpuhook.cdi.registry import DEFAULT_SPEC_DIRS, scan

    dirs = spec_dirs or DEFAULT_SPEC_DIRS
    reg = scan(dirs)
    for name in reg.names():
        click.echo(name)
    if not reg.names() and not reg.errors:
        click.echo(f"gpuhook: no CDI spec in {', '.join(dirs)} (gpuhook generate-cdi --output "
                   f"{dirs[0]}/nvidia.yaml writes one)", err=True)
    for name, paths in sorted(reg.conflicts.items()):
        click.echo(f"gpuhook: conflict: {name} defined at one priority by {', '.join(paths)} (unresolvable)",
                   err=True)
    for line in reg.errors:
        click.echo(f"gpuhook: invalid spec: {line}", err=True)
    if reg.conflicts or reg.errors:
        raise CdiError(f"{len(reg.conflicts)} conflicting device name(s), {len(reg.errors)} spec(s) that do not load")


@click.group("cdi-hook")
def cdi_hook() -> None:
    """Run by the container runtime as a CDI createContainer hook (OCI state JSON on stdin)."""


def _parse_link(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> list[tuple[str, str]]:
    from gpuhook.inject.containerhooks import parse_link

    links = []
    for value in values:
        parsed = parse_link(value)
        if parsed is None:
            raise click.BadParameter(f"{value!r}: expected TARGET::/absolute/link")
        links.append(parsed)
    return links


def _check_folders(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> list[str]:
    for folder in values:
        if not folder.startswith("/"):
            raise click.BadParameter(f"{folder!r} is not an absolute path")
    return list(values)


_LINK_OPTION = click.option("--link", "links", multiple=True, callback=_parse_link, metavar="TARGET::LINK",
                            help="Create LINK (absolute, in the container) pointing at TARGET; repeatable.")
_PRESENT_LINK_OPTION = click.option(
    "--link-if-present", "present", multiple=True, callback=_parse_link, metavar="TARGET::LINK",
    help="Create LINK only if TARGET (resolved beside it in the container) exists; repeatable.")
_FOLDER_OPTION = click.option("--folder", "folders", multiple=True, callback=_check_folders, metavar="DIR",
                              help="Container folder holding injected libraries; repeatable.")
_LDCONFIG_OPTION = click.option("--ldconfig-path", default="/sbin/ldconfig", show_default=True,
                                help="The host's ldconfig (never the image's).")


def _check_driver_version(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    from gpuhook.inject.containerhooks import valid_driver_version

    if value and not valid_driver_version(value):
        raise click.BadParameter(f"{value[:40]!r} is not a driver version like 535.309.01")
    return value


_DRIVER_VERSION_OPTION = click.option(
    "--host-driver-version", default="", callback=_check_driver_version, metavar="VERSION",
    help="The host driver's version: an image's CUDA compat libcuda of a newer major goes first in its ld cache.")


def _run(links: list[tuple[str, str]], folders: list[str], ldconfig_path: str, host_driver_version: str = "",
         present: list[tuple[str, str]] | None = None) -> None:
    from gpuhook.inject.containerhooks import run_hook
    from gpuhook.oci.bundle import read_stdin_state

    run_hook((links, folders, ldconfig_path, host_driver_version, present or []), read_stdin_state())


@cdi_hook.command("update-container")
@_LINK_OPTION
@_PRESENT_LINK_OPTION
@_FOLDER_OPTION
@_LDCONFIG_OPTION
@_DRIVER_VERSION_OPTION
def update_container_cmd(links: list[tuple[str, str]], present: list[tuple[str, str]], folders: list[str],
                         ldconfig_path: str, host_driver_version: str) -> None:
    """Links, then the ld cache, in one start (what gpuhook's specs call)."""
    _run(links, folders, ldconfig_path, host_driver_version, present)


@cdi_hook.command("create-symlinks")
@_LINK_OPTION
@_PRESENT_LINK_OPTION
def create_symlinks(links: list[tuple[str, str]], present: list[tuple[str, str]]) -> None:
    """Create symlinks in the container rootfs (an existing file or directory at LINK is left alone)."""
    _run(links, [], "/sbin/ldconfig", "", present)


@cdi_hook.command("update-ldcache")
@_FOLDER_OPTION
@_LDCONFIG_OPTION
@_DRIVER_VERSION_OPTION
def update_ldcache_cmd(folders: list[str], ldconfig_path: str, host_driver_version: str) -> None:
    """Add FOLDERs to the container's ld.so.conf.d and rebuild its ld cache with the host's ldconfig."""
    _run([], folders, ldconfig_path, host_driver_version)
