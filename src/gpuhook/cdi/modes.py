"""The kinds of spec `generate-cdi --mode` writes and each one's default class (built by cdi/kinds.py).

A module of its own, apart from the builders: `generate-cdi`'s command line names the modes before any spec
module loads, and a cold run loads those only while NVML's child works (cli/generate.py).
"""

from __future__ import annotations

from gpuhook.model import catalogue
from gpuhook.model.contract import IMEX_CDI_CLASS

GPU_MODE = "gpu"
IMEX_MODE = "imex"
MODES: tuple[str, ...] = (GPU_MODE, IMEX_MODE, *(family.name for family in catalogue.GATED))
# The class each mode's kind gets unless --class says otherwise (nvidia-ctk: imex-channel, gds, mofed, ...).
DEFAULT_CLASS: dict[str, str] = {GPU_MODE: "gpu", IMEX_MODE: IMEX_CDI_CLASS,
                                 **{family.name: family.name for family in catalogue.GATED}}
