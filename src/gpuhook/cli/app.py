"""The `gpuhook` command: thin click wrappers that parse options, call one function and print.

Expected failures (GpuhookError) become one line on stderr and exit 1; usage errors exit 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from gpuhook.cli.inventory import load_inventory
from gpuhook.cli.options import CACHE_OPTION as CACHE_OPTION_SPEC
from gpuhook.cli.options import ROOT_OPTIONS, Option
from gpuhook.errors import render


def click_option(opt: Option) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A click option from its one description (cli/options.py)."""
    kind: Any = None
    if opt.choices:
        kind = click.Choice(opt.choices)
    elif opt.float_min is not None:
        kind = click.FloatRange(min=opt.float_min)
    return click.option(*opt.flags, opt.dest, type=kind, default=opt.default, multiple=opt.multiple,
                        is_flag=opt.is_flag, metavar=opt.metavar, show_default=opt.show_default, help=opt.help)


def apply_options(table: Sequence[Option]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Every option of `table` on a command, in the table's order in --help."""
    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for opt in reversed(table):
            func = click_option(opt)(func)
        return func

    return decorate


root_options = apply_options(ROOT_OPTIONS)  # --driver-root/--dev-root/--proc-root/--discovery
CACHE_OPTION = click_option(CACHE_OPTION_SPEC)


class LazyGroup(click.Group):
    """Sub-commands living in other modules, imported only when invoked (keeps every start cheap)."""

    LAZY: dict[str, str] = {
        "fake-driver": "gpuhook.cli.fakedriver:fake_driver",
        "demo": "gpuhook.cli.demo:demo",
        "generate-cdi": "gpuhook.cli.cdi:generate_cdi",
        "cdi": "gpuhook.cli.cdi:cdi",
        "cdi-hook": "gpuhook.cli.cdi:cdi_hook",
        "hook": "gpuhook.cli.hook:hook",
        "runtime": "gpuhook.cli.runtime:runtime",
        "device-plugin": "gpuhook.cli.plugin:device_plugin",
        "dra-plugin": "gpuhook.cli.dra:dra_plugin",
        "labels": "gpuhook.cli.labels:labels",
        "doctor": "gpuhook.cli.doctor:doctor",
        "system": "gpuhook.cli.system:system",
        "service": "gpuhook.cli.service:service",
        "node-setup": "gpuhook.cli.nodesetup:node_setup",
        "uninstall": "gpuhook.cli.uninstall:uninstall",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    # Commands whose modules need an optional extra (pyproject.toml), and the top-level modules it brings: without
    # them the command is a stand-in that says which extra to install, and `gpuhook --help` still lists it.
    EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {"device-plugin": ("plugin", ("grpc", "google")),
                                                       "dra-plugin": ("dra", ("grpc", "google", "lightkube"))}

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY:
            import importlib

            module, _, attr = self.LAZY[cmd_name].partition(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError as exc:
                extra, modules = self.EXTRAS.get(cmd_name, ("", ()))
                if not extra or (exc.name or "").partition(".")[0] not in modules:
                    raise
                return _needs_extra(cmd_name, extra, exc.name or "")
        return super().get_command(ctx, cmd_name)


def _needs_extra(cmd_name: str, extra: str, missing: str) -> click.Command:
    """A stand-in for a command whose extra is not installed: any invocation is one line naming the extra."""
    line = (f"`gpuhook {cmd_name}` needs the {extra!r} extra, which is not installed (no module {missing!r}): "
            f"pip install 'gpuhook[{extra}]' into gpuhook's environment")

    def refuse() -> None:
        from gpuhook.errors import ConfigError

        raise ConfigError(line)

    return click.Command(cmd_name, callback=refuse, help=f"(needs pip install 'gpuhook[{extra}]')",
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                           "help_option_names": []})


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpuhook")
def cli() -> None:
    """Put NVIDIA GPUs into containers: CDI specs, an OCI prestart hook and a kubelet device plugin."""


@cli.command()
@root_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable, see docs/discovery.md).")
def info(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str, as_json: bool) -> None:
    """What the host's driver offers: versions, GPUs, MIG devices, nodes and files per capability."""
    from gpuhook.model.report import format_inventory, topology_to_dict

    inv = load_inventory(driver_root, dev_root, proc_root, discovery)
    if as_json:
        click.echo(json.dumps({**inv.to_dict(), "topology": topology_to_dict(inv)}, indent=2, sort_keys=True))
    else:
        click.echo(format_inventory(inv))


@cli.command("list")
@root_options
@click.option("--devices", default="all", show_default=True, help="As NVIDIA_VISIBLE_DEVICES.")
@click.option("--capabilities", default="", help="As NVIDIA_DRIVER_CAPABILITIES [default: utility,compute].")
@click.option("--env", "extra_env", multiple=True, metavar="NAME=VALUE",
              help="More of the container's environment, e.g. NVIDIA_IMEX_CHANNELS=3 or NVIDIA_GDS=enabled.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_cmd(
    driver_root: str,
    dev_root: str | None,
    proc_root: str | None,
    discovery: str,
    devices: str,
    capabilities: str,
    extra_env: tuple[str, ...],
    as_json: bool,
) -> None:
    """Exactly what a container asking for --devices/--capabilities would receive.

    The hook's own decision: `void` or an empty list leaves a container untouched, so nothing is listed (not the
    driver files `none` gets)."""
    from gpuhook.errors import clip
    from gpuhook.model.contract import VISIBLE_DEVICES
    from gpuhook.model.edits import ContainerEdits, plan
    from gpuhook.model.report import edits_to_dict, format_edits
    from gpuhook.model.request import parse_request
    from gpuhook.model.selection import resolve

    inv = load_inventory(driver_root, dev_root, proc_root, discovery)
    env = [f"{VISIBLE_DEVICES}={devices}"]
    if capabilities:
        env.append(f"NVIDIA_DRIVER_CAPABILITIES={capabilities}")
    env += extra_env
    request = parse_request(env, privileged=True)
    request = type(request)(**{**{n: getattr(request, n) for n in request._fields}, "source": "--devices"})
    if not request.wants_gpu_setup:
        if as_json:
            click.echo(json.dumps(edits_to_dict(ContainerEdits()), indent=2))
        else:
            click.echo(f"nothing: a container with {VISIBLE_DEVICES}={clip(devices)} is left untouched")
        return
    edits = plan(inv, resolve(inv, request))
    click.echo(json.dumps(edits_to_dict(edits), indent=2) if as_json else format_edits(edits))


def main(argv: list[str] | None = None) -> int:
    try:
        rc = cli.main(args=argv, prog_name="gpuhook", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("gpuhook: aborted", err=True)
        return 1
    except BrokenPipeError:
        return 1
    except Exception as exc:  # noqa: BLE001 - GpuhookError, a stray OSError or a bug: one line, never a traceback
        click.echo(f"gpuhook: {render(exc)}", err=True)
        return 1
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
