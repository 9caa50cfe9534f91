"""`python -m gpuhook.cli …` is `gpuhook …`."""

from gpuhook.cli import run

run()
