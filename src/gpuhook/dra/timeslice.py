"""Time-slicing through NVML: a GPU shared by a claim's pods must be in compute mode DEFAULT (several processes
at once, time-sliced); EXCLUSIVE_PROCESS or PROHIBITED would refuse the second pod. NVIDIA's driver does the same
first (cmd/gpu-kubelet-plugin/sharing.go `SetTimeSlice`: compute mode DEFAULT, then the interval through
nvidia-smi). Where the driver does not offer the call (NOT_SUPPORTED, no such function) the GPU is left as it is.

The health monitor holds this process's NVML for its lifetime, so the calls run in a short-lived child
(`python -m gpuhook.dra.timeslice LIBRARY UUID...`), which only a claim asking for time-slicing pays for.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Sequence

from gpuhook.dra.config import ConfigError
from gpuhook.errors import clip
from gpuhook.model.inventory import Gpu

log = logging.getLogger("gpuhook.dra.timeslice")

COMPUTEMODE_DEFAULT = 0  # NVML_COMPUTEMODE_DEFAULT
CHILD_TIMEOUT_S = 30.0


def apply(library: str | None, gpus: Sequence[Gpu]) -> list[str]:
    """Put `gpus` in compute mode DEFAULT; returns what was done (for the log). ConfigError when NVML refuses."""
    if not gpus:
        return []
    if library is None:
        raise ConfigError("time-slicing needs NVML, and the driver root has no libnvidia-ml.so.1")
    try:
        out = subprocess.run([sys.executable, "-m", "gpuhook.dra.timeslice", library, *(g.uuid for g in gpus)],
                             capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"time-slicing: NVML's child failed: {exc}") from None
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(f"time-slicing: NVML's child said {clip(out.stderr.strip() or out.stdout, quote=False)}"
                          ) from None
    for warning in answer.get("warnings", []):
        log.warning("time-slicing: %s", warning)
    if answer.get("error"):
        raise ConfigError(f"time-slicing: {answer['error']}")
    return list(answer.get("done", []))


def _set_default(library: str, uuids: Sequence[str]) -> dict[str, object]:
    from gpuhook.discover.nvml import bound_nvml
    from gpuhook.errors import DiscoveryError

    done: list[str] = []
    warnings: list[str] = []
    try:
        with bound_nvml(library) as nv:
            unsupported = {getattr(nv, n, None) for n in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")}
            for uuid in uuids:
                try:
                    handle = nv.nvmlDeviceGetHandleByUUID(uuid)
                    mode = nv.nvmlDeviceGetComputeMode(handle)
                    if mode != COMPUTEMODE_DEFAULT:
                        nv.nvmlDeviceSetComputeMode(handle, COMPUTEMODE_DEFAULT)
                        done.append(f"{uuid}: compute mode {mode} -> DEFAULT")
                except nv.NVMLError as exc:
                    if getattr(exc, "value", None) in unsupported:
                        warnings.append(f"{uuid}: the driver does not offer the compute mode ({exc}); left as it is")
                        continue
                    return {"error": f"{uuid}: NVML refused the compute mode: {exc}", "warnings": warnings}
    except DiscoveryError as exc:
        return {"error": f"needs NVML: {exc}", "warnings": warnings}
    return {"done": done, "warnings": warnings}


if __name__ == "__main__":
    print(json.dumps(_set_default(sys.argv[1], sys.argv[2:])))
