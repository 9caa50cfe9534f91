"""Failures of the CDI front door, one line each (printed by `gpuhook.cli.main`, exit 1)."""

from __future__ import annotations

from gpuhook.errors import GpuhookError


class CdiError(GpuhookError):
    """A spec cannot be generated, read or applied as asked."""


class InvalidName(CdiError, ValueError):
    """A vendor, class, device or qualified name breaks the CDI name syntax."""
