"""Discovery: turn a host's driver install into an `Inventory` (the scan itself: `scan.py`).

NVML is the primary source; procfs and /dev are the fallback (and the only source of cap node minors).

The package's top imports nothing: the hook's path only reads the inventory cache (`cache.py`), and a start
should not load the scanning modules (driver files, ELF, procfs, datacenter; about 2 ms) to do so. The names
below resolve on first use (PEP 562), so `from gpuhook.discover import Roots, discover` keeps working.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path)
if TYPE_CHECKING:
    from gpuhook.discover.roots import Roots
    from gpuhook.discover.scan import METHODS, discover, nvml_library
    from gpuhook.model.inventory import DeviceNode, DriverFile, Gpu, Inventory, MigDevice

__all__ = ["METHODS", "DeviceNode", "DriverFile", "Gpu", "Inventory", "MigDevice", "Roots", "discover",
           "nvml_library"]

_HOMES = {"METHODS": "gpuhook.discover.scan", "discover": "gpuhook.discover.scan",
          "nvml_library": "gpuhook.discover.scan", "Roots": "gpuhook.discover.roots",
          **dict.fromkeys(("DeviceNode", "DriverFile", "Gpu", "Inventory", "MigDevice"), "gpuhook.model.inventory")}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gpuhook.discover' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
