"""`gpuhook labels`: the GPU feature labels (as NVIDIA's gpu-feature-discovery names them), printed or written."""

from __future__ import annotations

import click

from gpuhook.cli.app import root_options
from gpuhook.cli.inventory import load_inventory
from gpuhook.plugin.devices import MIG_STRATEGIES, Options


@click.command("labels")
@root_options
@click.option("--mig-strategy", type=click.Choice(MIG_STRATEGIES), default="none", show_default=True,
              help="As the device plugin's: single/mixed add MIG labels.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="As the device plugin's time-slicing replicas (gpu.replicas, gpu.sharing-strategy).")
@click.option("--output-file", "-o", default=None,
              help="Write an NFD feature file (features.d) atomically instead of printing.")
def labels(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str, mig_strategy: str,
           replicas: int, output_file: str | None) -> None:
    """Node labels for GPU scheduling, in node-feature-discovery's local feature file format (name=value)."""
    from gpuhook.plugin.featurefile import FeatureFile
    from gpuhook.plugin.labels import labels as compute
    from gpuhook.plugin.labels import render

    options = Options(mig_strategy=mig_strategy, replicas=replicas)
    inv = load_inventory(driver_root, dev_root, proc_root, discovery)
    if output_file is None:
        click.echo(render(compute(inv, options).items()), nl=False)
        return
    FeatureFile(output_file, options).write(inv, ())
