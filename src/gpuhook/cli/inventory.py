"""The inventory a command works on: discovered, or read from the inventory cache while it is true (click-free,
so the lean `generate-cdi` path shares it with every click command)."""

from __future__ import annotations

from gpuhook.errors import GpuhookError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuhook.discover.roots import Roots
    from gpuhook.hook.config import Config
    from gpuhook.model.inventory import Inventory


def resolve_roots(driver_root: str | None, dev_root: str | None, proc_root: str | None,
                  config: Config | None = None) -> Roots:
    """The roots every command works on, resolved one way: a flag, else the hook config's value (what the hook
    itself will use), else the default (/, the driver root, /proc). A driver root with its own proc/driver/nvidia
    read with the host's /proc (a simulated driver, most likely) gets one note on stderr: the MIG and GPU errors
    that follow would not say why."""
    import os
    import sys

    from gpuhook.discover.roots import Roots

    if config is None:
        from gpuhook.hook.config import Config

        config = hook_config() or Config()
    roots = Roots.make(driver_root or config.driver_root, dev_root or (None if driver_root else config.dev_root)
                       or None, proc_root or config.proc_root)
    own = os.path.join(roots.driver_root, "proc", "driver", "nvidia")
    if roots.driver_root != "/" and roots.proc_root == "/proc" and os.path.isdir(own):
        print(f"gpuhook: note: {roots.driver_root} has its own proc/driver/nvidia but the host's /proc is read; "
              f"pass --proc-root {os.path.join(roots.driver_root, 'proc')} to read the driver root's",
              file=sys.stderr)
    return roots


def load_inventory(driver_root: str | None, dev_root: str | None, proc_root: str | None,
                   discovery: str = "auto", inventory_cache: str | None = "",
                   meanwhile: Callable[[], None] | None = None) -> Inventory:
    """Discover, or with a cache (only for --discovery auto, what the cache holds) load it while it is true.
    `meanwhile` (the caller's own preparation: its imports) runs while NVML's child starts, or first."""
    from gpuhook.hook.config import Config

    config = hook_config()
    roots = resolve_roots(driver_root, dev_root, proc_root, config or Config())
    path = _cache_path(inventory_cache, roots, config) if discovery == "auto" else ""
    child = None
    if not path and discovery in ("auto", "nvml"):
        from gpuhook.discover.nvml import Child

        child = Child()  # first: it imports pynvml (~10 ms) while the scan's modules (~9 ms) load here
    try:
        if meanwhile is not None:
            meanwhile()
        if path:
            import sys

            from gpuhook.discover.cache import inventory

            notes: list[str] = []
            inv = inventory(roots, path, notes)  # the scan (discover/scan.py) loads only when the cache is stale
            for note in notes:
                print(f"gpuhook: {note}", file=sys.stderr)
            return inv
        from gpuhook.discover.scan import discover
    except BaseException:
        if child is not None:
            child.cancel()
        raise
    return discover(roots, method=discovery, nvml_child=child)


def hook_config() -> Config | None:
    """The hook's own config file (/etc/gpuhook/config.toml), read once per command; None if it does not load
    (doctor reports why; every other command then works from the defaults and uses no cache of the hook's)."""
    from gpuhook.hook.config import load_config

    try:
        return load_config(None)
    except GpuhookError:
        return None


def _cache_path(option: str | None, roots: Roots, config: Config | None) -> str:
    """The cache a command uses: the one given, else the hook's own when it describes these very roots."""
    if option is not None:
        return option
    if config is None:
        return ""

    configured = config.roots()
    return config.inventory_cache if configured == roots else ""
