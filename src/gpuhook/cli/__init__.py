"""The faces of gpuhook: the `gpuhook` click command line (app.py and one module per front door's commands) and
the lean entry script the runtimes run at every container start (entry.py, no click).

Nothing is imported here, so the lean entry pays only for itself. `main` loads the click application on call,
except for a `generate-cdi` command line: `gpuhook service` answers it when one runs (service/client.py, one
round trip), else cli/generate.py runs a plain one without click (the same work; click answers whatever that
path does not fully understand); and `service`, started without click so the resident process stays small
(cli/serve.py).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """`gpuhook …` (the console script)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["generate-cdi"]:
        from gpuhook.service.client import forward

        code = forward(args)  # the resident service's answer, when one runs and takes it
        if code is not None:
            return code
        from gpuhook.cli.generate import lean_main

        code = lean_main(args[1:])
        if code is not None:
            return code
    if args[:1] == ["service"]:
        from gpuhook.cli.serve import lean_main as serve_main

        code = serve_main(args[1:])
        if code is not None:
            return code
    from gpuhook.cli.app import main as app_main

    return app_main(args)


def run() -> None:
    """The console script `gpuhook`: main(), ended by cli/leave.py (at once after a click-free command)."""
    from gpuhook.cli.leave import leave

    leave(main())
