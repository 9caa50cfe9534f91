"""`gpuhook fake-driver`: build a simulated driver root from the command line (demos, manual testing)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import click

from gpuhook.fakedriver.build import build_fake_driver
from gpuhook.fakedriver.compile import CompileError
from gpuhook.fakedriver.datacenter import MAX_HCAS, MAX_NVSWITCHES, Datacenter
from gpuhook.fakedriver.model import (
    CUDA_VERSION_RE,
    DEFAULT_CUDA_VERSION,
    DEFAULT_DRIVER_VERSION,
    DRIVER_VERSION_RE,
    MAX_GPUS,
    MIG_PROFILES,
    NVLINK_LAYOUTS,
    FakeDriver,
)


def _parse_mig_one(value: str) -> tuple[int, list[str]]:
    gpu, sep, rest = value.partition(":")
    if not sep or not gpu.strip().isdigit():
        raise click.BadParameter(f"{value!r} is not GPU:PROFILE[,PROFILE...] (e.g. 0:1g.10gb,2g.20gb)")
    profiles = [p.strip() for p in rest.split(",") if p.strip()]
    unknown = [p for p in profiles if p not in MIG_PROFILES]
    if unknown:
        raise click.BadParameter(f"{value!r}: unknown MIG profile {unknown[0]!r}; known: {', '.join(MIG_PROFILES)}")
    return int(gpu), profiles


def _parse_mig(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[int, list[str]]:
    result: dict[int, list[str]] = {}
    for value in values:
        gpu, profiles = _parse_mig_one(value)
        if gpu in result:
            raise click.BadParameter(f"{value!r}: GPU {gpu} is given more than once")
        result[gpu] = profiles
    return result


def _parse_channels(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    items = [i.strip() for i in value.split(",") if i.strip()]
    if not all(i.isascii() and i.isdigit() and len(i) <= 8 for i in items):
        raise click.BadParameter(f"{value!r} is not a comma list of channel numbers (e.g. 0,3)")
    return tuple(int(i) for i in items)


def _version(pattern: re.Pattern[str], example: str) -> Callable[[click.Context, click.Parameter, str], str]:
    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        if not pattern.fullmatch(value):
            raise click.BadParameter(f"{value!r} is not a version like {example}")
        return value

    return check


def summary(fake: FakeDriver) -> str:
    libs64 = sum(1 for lib in fake.libraries if lib.bits == 64)
    extra = " + 32-bit copies" if fake.compat32 else ""
    lines = [
        f"fake NVIDIA driver {fake.driver_version} (CUDA {fake.cuda_version}) at {fake.root}",
        f"  {len(fake.gpus)} GPUs, {len(fake.mig_devices)} MIG devices, {libs64} libraries{extra}, "
        f"{len(fake.binaries)} binaries, {len(fake.nodes)} device nodes",
    ]
    extra = [n.path for n in fake.nodes if not n.path.startswith(("/dev/nvidia", "/dev/dri/"))
             or n.path.startswith(("/dev/nvidia-caps-imex", "/dev/nvidia-nvswitch", "/dev/nvidia-fs"))]
    if extra:
        lines.append(f"  datacenter nodes: {', '.join(extra)}")
    for g in fake.gpus:
        mig = "  MIG enabled" if g.mig_enabled else ""
        lines.append(f"  GPU {g.index}  /dev/nvidia{g.minor}  {g.pci_bus_id}  {g.uuid}{mig}")
        lines += [
            f"    MIG {g.index}:{m.index}  {m.profile:<8} gi {m.gi:<2} ci {m.ci}  {m.uuid}" for m in g.mig_devices
        ]
    flags = f"--driver-root {fake.root} --proc-root {fake.root}/proc"
    lines += ["use it with these flags (the simulated driver has its own /proc):",
              f"  gpuhook info {flags}",
              # a spec folder of its own: a spec in /etc/cdi would give every container on the host fake GPUs
              f"  gpuhook generate-cdi {flags} --output {fake.root}-cdi/nvidia.yaml",
              f'  hook config: driver-root = "{fake.root}"  proc-root = "{fake.root}/proc"']
    return "\n".join(lines)


@click.group("fake-driver")
def fake_driver() -> None:
    """Build simulated NVIDIA driver roots (device nodes, libraries, NVML mock, /proc) for tests and demos."""


@fake_driver.command("create")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--gpus", type=click.IntRange(0, MAX_GPUS), default=2, show_default=True, help="Number of GPUs.")
@click.option(
    "--driver-version",
    default=DEFAULT_DRIVER_VERSION,
    show_default=True,
    callback=_version(DRIVER_VERSION_RE, "550.54.15"),
)
@click.option(
    "--cuda-version", default=DEFAULT_CUDA_VERSION, show_default=True, callback=_version(CUDA_VERSION_RE, "12.4")
)
@click.option(
    "--mig",
    "mig",
    multiple=True,
    metavar="GPU:PROFILE[,PROFILE...]",
    callback=_parse_mig,
    help=f"Enable MIG on a GPU with these devices (repeatable). Profiles: {', '.join(MIG_PROFILES)}.",
)
@click.option("--compat32/--no-compat32", default=None, help="Build the 32-bit libraries [default: if gcc -m32 works].")
@click.option("--nvlink", type=click.Choice(NVLINK_LAYOUTS), default="none", show_default=True,
              help="NVLink layout: none, bridge (pairs 0-1, 2-3, ... NV12), nvswitch (all-to-all, NV18).")
@click.option("--imex-channels", default="", metavar="N[,N...]", callback=_parse_channels,
              help="Make these IMEX channel nodes (/dev/nvidia-caps-imex-channels/channel<N>).")
@click.option("--nvswitches", type=click.IntRange(0, MAX_NVSWITCHES), default=0, show_default=True,
              help="NVSwitch nodes: /dev/nvidia-nvswitchctl and /dev/nvidia-nvswitch0..N-1.")
@click.option("--gds", is_flag=True, help="GPUDirect Storage: /dev/nvidia-fs0..15, /etc/cufile.json, /run/udev.")
@click.option("--rdma-hcas", "hcas", type=click.IntRange(0, MAX_HCAS), default=0, show_default=True,
              help="RDMA (MOFED): /dev/infiniband/uverbs0..N-1 and /dev/infiniband/rdma_cm.")
@click.option("--gdrcopy", is_flag=True, help="gdrcopy: /dev/gdrdrv.")
def create(
    directory: Path, gpus: int, driver_version: str, cuda_version: str, mig: dict[int, list[str]],
    compat32: bool | None, nvlink: str, imex_channels: tuple[int, ...], nvswitches: int, gds: bool, hcas: int,
    gdrcopy: bool,
) -> None:
    """Build a fake driver root in DIRECTORY (absent or empty).

    Its NVML library looks for the root where it was built; mounted elsewhere (a device plugin's pod sees it at
    /driver-root), set GPUHOOK_FAKE_DRIVER_ROOT to that path in the process that loads it."""
    for gpu in mig:
        if gpu >= gpus:
            raise click.BadParameter(f"GPU {gpu} does not exist (--gpus {gpus})", param_hint="--mig")
    try:
        datacenter = Datacenter(imex_channels, nvswitches, gds, hcas, gdrcopy)
        fake = build_fake_driver(directory, gpus, driver_version, cuda_version, mig, compat32, nvlink=nvlink,
                                 datacenter=datacenter)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    except (PermissionError, CompileError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(summary(fake))
