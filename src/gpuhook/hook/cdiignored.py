"""Leave the device plugin a record that the container runtime ignored a container's CDI devices.

The hook and the shim are the only ones that can see it (Request.cdi_ignored: Allocate's marker beside a
NVIDIA_VISIBLE_DEVICES the CDI spec did not turn to void); the plugin, which watches the state directory, says so
once in its log (plugin/cdiignored.py). One file per node, the newest start's: the count and size bounded whatever
the node runs.

Only a marker this node's plugin made is recorded: Allocate seals it with the node's key (contract.PLUGIN_KEY in
the state directory, root's alone; model/cdiignored.seal), which no image can read, so an image that sets the
marker in its own environment leaves no record and masks no real one.

Best effort: the container still gets its GPUs whatever happens here; a record that cannot be written (no state
directory configured is not that) is a note in the start's log line. Written through fileio.atomic.write_regular:
only ever a regular file, never through or over a link, never to a device or FIFO.
"""

from __future__ import annotations

import os
import time

from gpuhook.errors import GpuhookError, clip
from gpuhook.model import cdiignored
from gpuhook.model.contract import CDI_IGNORED_RECORD, PLUGIN_KEY


def note(state_dir: str, container_id: str, devices: tuple[str, ...], marker: str) -> str:
    """The start's log-line note (` (…)`), the record written on the way (record())."""
    return f" ({record(state_dir, container_id, devices, marker)})"


def record(state_dir: str, container_id: str, devices: tuple[str, ...], marker: str) -> str:
    """Write the record into `state_dir` (replacing an older one) when this node's plugin sealed `marker`;
    returns what to note in the log line."""
    said = f"runtime ignored CDI devices {clip(','.join(devices), 200, quote=False)}"
    if not state_dir:
        return said
    from gpuhook.fileio.secret import read_secret

    if not cdiignored.sealed_by(read_secret(os.path.join(state_dir, PLUGIN_KEY)), marker):
        return f"{said}; no record: the marker is not sealed by this node's device plugin"
    path = os.path.join(state_dir, CDI_IGNORED_RECORD)
    from gpuhook.fileio.atomic import write_regular

    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        write_regular(path, cdiignored.render(container_id, devices, when), 0o644)
    except (GpuhookError, OSError) as exc:
        return f"{said}; no record: {clip(str(exc), quote=False)}"
    return f"{said}: recorded in {clip(path, quote=False)}"
