"""`gpuhook generate-cdi`, `gpuhook cdi validate|list` and `gpuhook cdi-hook …` (what a CDI spec's hooks run).

Thin: parse options, call one function, print. Heavy modules (YAML, jsonschema, discovery, injection) are
imported inside the commands, so `cdi-hook`, which the runtime runs at every container start, stays cheap.
"""

from __future__ import annotations

import os
import shutil
import sys

import click

from ..cli import load_inventory, root_options
from .errors import CdiError
from .names import DEFAULT_NAME_STRATEGIES, NAME_STRATEGIES

LINK_SEPARATOR = "::"


def default_hook_path() -> str:
    """The installed `gpuhook`: next to this interpreter (a venv's bin), else on PATH; always absolute."""
    beside = os.path.join(os.path.dirname(sys.executable), "gpuhook")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return os.path.abspath(beside)
    found = shutil.which("gpuhook")
    if found:
        return os.path.abspath(found)
    raise CdiError(f"cannot find the gpuhook executable next to {sys.executable} or on PATH; pass --hook-path")


@click.command("generate-cdi")
@root_options
@click.option("--output", "-o", default=None, metavar="FILE",
              help="Write the spec here (atomically, mode 0644, directory created) instead of stdout.")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default=None,
              help="Output format [default: json for a .json output file, else yaml].")
@click.option("--vendor", default="nvidia.com", show_default=True, help="Vendor part of the CDI kind.")
@click.option("--class", "cls", default="gpu", show_default=True, help="Class part of the CDI kind.")
@click.option("--device-name-strategy", "strategies", multiple=True, type=click.Choice(NAME_STRATEGIES),
              help="How devices are named; repeatable [default: index and uuid].")
@click.option("--hook-path", default=None, metavar="PATH",
              help="gpuhook executable the spec's hooks run [default: the installed gpuhook].")
@click.option("--cdi-version", default=None, metavar="X.Y.Z",
              help="Claim this cdiVersion (may raise the computed minimum, never lower it).")
@click.option("--watch", is_flag=True,
              help="Keep running: rewrite --output (atomically) whenever the driver version, GPU set or MIG layout "
                   "changes; SIGTERM/SIGINT stop, SIGHUP regenerates now.")
@click.option("--poll-interval", type=click.FloatRange(min=0.05), default=10.0, show_default=True, metavar="S",
              help="With --watch: also check every S seconds (procfs changes send no inotify events).")
def generate_cdi(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str,
                 output: str | None, fmt: str | None, vendor: str, cls: str, strategies: tuple[str, ...],
                 hook_path: str | None, cdi_version: str | None, watch: bool, poll_interval: float) -> None:
    """Write a CDI spec for every GPU and MIG device the driver offers (plus `all`)."""
    from . import codec
    from .spec import build_spec
    from .validate import validate_spec

    hook = os.path.abspath(hook_path) if hook_path else default_hook_path()

    def render(inv, devices=None) -> str:  # type: ignore[no-untyped-def]
        spec = build_spec(inv, vendor=vendor, cls=cls, name_strategies=strategies or DEFAULT_NAME_STRATEGIES,
                          hook_path=hook, devices=devices, cdi_version=cdi_version)
        problems = validate_spec(spec, "generated spec", schema=False)
        if problems:  # a bug here, never the user's: refuse to write a spec runtimes would reject
            raise CdiError(f"refusing to write an invalid spec: {problems[0]}")
        return codec.dumps(spec, codec.format_for(output, fmt))

    if watch:
        if output is None:
            raise click.UsageError("--watch needs --output FILE")
        from ..discover import Roots
        from ..watch import watch_spec

        roots = Roots.make(driver_root, dev_root, proc_root)
        raise SystemExit(watch_spec(roots, output, render, method=discovery, poll_interval=poll_interval))
    text = render(load_inventory(driver_root, dev_root, proc_root, discovery))
    if output is None:
        click.echo(text, nl=False)
        return
    from ..atomic import write_atomic

    write_atomic(output, text.encode(), 0o644)
    if not codec.has_spec_extension(output):
        click.echo(f"gpuhook: note: CDI loaders read only *.yaml and *.json files; {output} will be ignored",
                   err=True)


@click.group()
def cdi() -> None:
    """Check and list CDI specs."""


@cdi.command("validate")
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def validate_cmd(files: tuple[str, ...]) -> None:
    """Check specs against the CDI schema and the loader's rules; one line per problem (stdout), exit 1 if any."""
    from .validate import validate_file

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
    from .registry import DEFAULT_SPEC_DIRS, scan

    reg = scan(spec_dirs or DEFAULT_SPEC_DIRS)
    for name in reg.names():
        click.echo(name)
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


def _container_rootfs() -> str:
    """The starting container's rootfs, from the OCI state on stdin and its bundle's config.json."""
    from ..oci.bundle import load_bundle, parse_state

    state = parse_state(sys.stdin.buffer.read())
    return load_bundle(state.bundle).rootfs


def _parse_link(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> list[tuple[str, str]]:
    links = []
    for value in values:
        target, sep, link = value.partition(LINK_SEPARATOR)
        if not sep or not target or not link.startswith("/"):
            raise click.BadParameter(f"{value!r}: expected TARGET::/absolute/link")
        links.append((target, link))
    return links


@cdi_hook.command("create-symlinks")
@click.option("--link", "links", multiple=True, callback=_parse_link, metavar="TARGET::LINK",
              help="Create LINK (absolute, in the container) pointing at TARGET; repeatable.")
def create_symlinks(links: list[tuple[str, str]]) -> None:
    """Create symlinks in the container rootfs (an existing file or directory at LINK is left alone)."""
    from ..inject.rootfs import RootFS

    rootfs_path = _container_rootfs()
    with RootFS(rootfs_path) as rootfs:
        for target, link in links:
            rootfs.symlink(target, link)


@cdi_hook.command("update-ldcache")
@click.option("--folder", "folders", multiple=True, metavar="DIR",
              help="Container folder holding injected libraries; repeatable.")
@click.option("--ldconfig-path", default="/sbin/ldconfig", show_default=True,
              help="The host's ldconfig (never the image's).")
def update_ldcache_cmd(folders: tuple[str, ...], ldconfig_path: str) -> None:
    """Add FOLDERs to the container's ld.so.conf.d and rebuild its ld cache with the host's ldconfig."""
    from ..inject.ldcache import open_ldconfig, update_ldcache
    from ..inject.rootfs import RootFS

    for folder in folders:
        if not folder.startswith("/"):
            raise click.BadParameter(f"{folder!r} is not an absolute path", param_hint="--folder")
    rootfs_path = _container_rootfs()
    fd = open_ldconfig(ldconfig_path)
    try:
        with RootFS(rootfs_path) as rootfs:
            update_ldcache(rootfs, list(folders), fd)
    finally:
        os.close(fd)
