"""How a click-free command ends: at once, where the interpreter's teardown has nothing left to do for it.

A Python process that returns from its script tears its interpreter down: every module, its objects, the garbage
collector's last pass. After a cold `generate-cdi` that measured 3.4-5.4 ms here (medians of 21 alternating runs,
the same spec written), about a tenth of the command. The click-free paths (the entry script's prestart hook,
cdi-hook and generate-cdi; the console script's lean generate-cdi and its service's answer) start no thread,
register no atexit callback and close every file they write before they return, so all that teardown owes them
is stdout and stderr flushed: done here, then `os._exit`. Anything else (click loaded: a command this module was
not written for; a thread still running; an atexit callback, a library's or a test's) ends the usual way.
"""

from __future__ import annotations

import atexit
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


def leave(code: int) -> NoReturn:
    """End the process with `code`: os._exit after flushing stdout and stderr when nothing else is owed (above),
    else sys.exit (a flush that fails goes that way too, to end as Python reports it)."""
    if _nothing_owed():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        else:
            os._exit(code)
    sys.exit(code)


def _nothing_owed() -> bool:
    threading = sys.modules.get("threading")
    callbacks = getattr(atexit, "_ncallbacks", None)  # CPython's count; elsewhere assume some
    return ("click" not in sys.modules and callbacks is not None and callbacks() == 0
            and (threading is None or threading.active_count() == 1))
