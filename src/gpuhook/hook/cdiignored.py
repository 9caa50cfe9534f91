"""Leave the device plugin a record that the container runtime ignored a container's CDI devices.

The hook and the shim are the only ones that can see it (Request.cdi_ignored: Allocate's marker beside a
NVIDIA_VISIBLE_DEVICES the CDI spec did not turn to void); the plugin, which watches the state directory, says so
once in its log (plugin/cdiignored.py). One file per node, written only when absent: one lstat per such start
after the first, the count and size bounded whatever the node runs, and the plugin needs only the first.

Best effort: the container still gets its GPUs whatever happens here; a record that cannot be written (no state
directory configured is not that) is a note in the start's log line. Written through fileio.atomic.write_regular:
only ever a regular file, never through or over a link, never to a device or FIFO.
"""

from __future__ import annotations

import os
import stat
import time

from gpuhook.errors import GpuhookError, clip
from gpuhook.model import cdiignored
from gpuhook.model.contract import CDI_IGNORED_RECORD


def note(state_dir: str, container_id: str, devices: tuple[str, ...]) -> str:
    """The start's log-line note (` (…)`), the record written on the way (record())."""
    return f" ({record(state_dir, container_id, devices)})"


def record(state_dir: str, container_id: str, devices: tuple[str, ...]) -> str:
    """Write the record into `state_dir` unless one is there already; returns what to note in the log line."""
    said = f"runtime ignored CDI devices {clip(','.join(devices), 200, quote=False)}"
    if not state_dir:
        return said
    path = os.path.join(state_dir, CDI_IGNORED_RECORD)
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            return said
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"{said}; no record: {clip(str(exc), quote=False)}"
    from gpuhook.fileio.atomic import write_regular

    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        write_regular(path, cdiignored.render(container_id, devices, when), 0o644)
    except (GpuhookError, OSError) as exc:
        return f"{said}; no record: {clip(str(exc), quote=False)}"
    return f"{said}: recorded in {clip(path, quote=False)}"
