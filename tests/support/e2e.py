"""Gate for end-to-end tests: skip on a machine without root/runc/podman, fail instead in CI."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_E2E = os.environ.get("GPUHOOK_REQUIRE_E2E", "") not in ("", "0", "false", "no")


def need(condition: bool, why: str) -> None:
    """Skip (or, with GPUHOOK_REQUIRE_E2E=1 as .ci/run sets, fail) when an end-to-end prerequisite is missing."""
    if condition:
        return
    if REQUIRE_E2E:
        pytest.fail(f"end-to-end prerequisite missing (GPUHOOK_REQUIRE_E2E is set): {why}")
    pytest.skip(why)


def need_root() -> None:
    need(os.geteuid() == 0, "needs root")


def need_tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, f"needs {name} on PATH")
    return path or ""
