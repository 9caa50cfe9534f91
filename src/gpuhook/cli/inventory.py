"""The inventory a command works on: discovered, or read from the inventory cache while it is true (click-free,
so the lean `generate-cdi` path shares it with every click command)."""

from __future__ import annotations

from gpuhook.errors import GpuhookError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuhook.discover.roots import Roots
    from gpuhook.model.inventory import Inventory


def load_inventory(driver_root: str, dev_root: str | None, proc_root: str | None,
                   discovery: str = "auto", inventory_cache: str | None = "") -> Inventory:
    """Discover, or with a cache (only for --discovery auto, what the cache holds) load it while it is true."""
    from gpuhook.discover.roots import Roots

    roots = Roots.make(driver_root, dev_root, proc_root)
    path = _cache_path(inventory_cache, roots) if discovery == "auto" else ""
    if path:
        import sys

        from gpuhook.discover.cache import inventory

        notes: list[str] = []
        inv = inventory(roots, path, notes)  # the scan (discover/scan.py) loads only when the cache is stale
        for note in notes:
            print(f"gpuhook: {note}", file=sys.stderr)
        return inv
    from gpuhook.discover.scan import discover

    return discover(roots, method=discovery)


def _cache_path(option: str | None, roots: Roots) -> str:
    """The cache a command uses: the one given, else the hook's own when it describes these very roots."""
    if option is not None:
        return option
    from gpuhook.discover.roots import Roots
    from gpuhook.hook.config import load_config

    try:
        config = load_config(None)
    except GpuhookError:
        return ""
    configured = Roots.make(config.driver_root, config.dev_root or None, config.proc_root)
    return config.inventory_cache if configured == roots else ""
