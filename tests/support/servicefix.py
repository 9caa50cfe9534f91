"""Fixtures of the service's tests (test_service.py, test_service_safety.py): a root-only temp dir, and the native
entry installed there with its Python entry beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhook.cli import entry as hook_entry

from .e2e import need_root

__all__ = ["native", "root_tmp"]


@pytest.fixture()
def root_tmp(tmp_path: Path) -> Path:
    need_root()
    return tmp_path


@pytest.fixture()
def native(root_tmp: Path) -> Path:
    """The native entry at bin/gpuhook-hook with its Python entry at bin/gpuhook-hook.py."""
    if hook_entry.native_entry() is None:
        pytest.skip("the native entry was not built")
    return Path(hook_entry.install(str(root_tmp / "bin" / "gpuhook-hook"))[0])
