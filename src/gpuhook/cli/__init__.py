"""The faces of gpuhook: the `gpuhook` click command line (app.py and one module per front door's commands) and
the lean entry script the runtimes run at every container start (entry.py, no click).

Nothing is imported here, so the lean entry pays only for itself; `main` loads the click application on call.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """`gpuhook …` (the console script)."""
    from gpuhook.cli.app import main as app_main

    return app_main(argv)
