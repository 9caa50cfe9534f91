"""TOML reading on every supported Python: the standard tomllib (3.11+), else tomli, the same parser under its
earlier name (RHEL 9 ships 3.9, Ubuntu 22.04 3.10). Everything in gpuhook that reads TOML imports it from here."""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["tomllib"]
