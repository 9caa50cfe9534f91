"""Session fixtures for real-driver roots (tests/support/realdriver.py): NVIDIA's 535 user-space files from
Debian's non-free packages over gpuhook's simulated kernel side.

`real_driver_runfile` and `real_driver_debian` are built once per session (about a second each once the
.deb cache is warm). They skip when the packages cannot be had (no archive, no root) and fail instead when
GPUHOOK_REQUIRE_E2E=1, as in CI. The roots share inodes with the unpacked-package cache: never write to
their files. Use them from a test module with `from support.realfix import *` or by name via
`request.getfixturevalue`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from .e2e import need
from .realdriver import LAYOUTS, Deb, RealDriverUnavailable, RealRoot, fetch_debs, host_nvidia_nodes, real_driver_root

__all__ = ["no_host_nodes", "real_driver_debs", "real_driver_debian", "real_driver_runfile", "real_root"]


@pytest.fixture(scope="session")
def real_driver_debs() -> dict[str, Deb]:
    """The NVIDIA driver .debs in the persistent cache ($GPUHOOK_DEB_CACHE), downloaded when missing."""
    need(os.geteuid() == 0, "real driver roots need root (mknod, ldconfig -r)")
    for tool in ("dpkg-deb", "ldconfig", "gcc"):
        need(shutil.which(tool) is not None, f"real driver roots need {tool} on PATH")
    try:
        return fetch_debs()
    except RealDriverUnavailable as e:
        need(False, f"the real NVIDIA driver packages cannot be had: {e}")
        raise  # unreachable: need() skipped or failed


def _build(layout: str, tmp_path_factory: pytest.TempPathFactory, debs: dict[str, Deb]) -> RealRoot:
    out = tmp_path_factory.mktemp(f"realdriver-{layout}") / "root"
    try:
        return real_driver_root(layout, out, debs=debs)
    except RealDriverUnavailable as e:
        need(False, f"cannot build the {layout} real driver root: {e}")
        raise


@pytest.fixture(scope="session")
def real_driver_runfile(tmp_path_factory: pytest.TempPathFactory, real_driver_debs: dict[str, Deb]) -> RealRoot:
    """NVIDIA's files as the .run installer lays them out (flat /usr/lib/x86_64-linux-gnu), 2 simulated GPUs."""
    return _build("runfile", tmp_path_factory, real_driver_debs)


@pytest.fixture(scope="session")
def real_driver_debian(tmp_path_factory: pytest.TempPathFactory, real_driver_debs: dict[str, Deb]) -> RealRoot:
    """NVIDIA's files as Debian's packages install them (nvidia/current + alternatives), 2 simulated GPUs."""
    return _build("debian", tmp_path_factory, real_driver_debs)


@pytest.fixture(params=LAYOUTS)
def real_root(request: pytest.FixtureRequest) -> RealRoot:
    """Each real layout in turn."""
    return request.getfixturevalue(f"real_driver_{request.param}")


@pytest.fixture()
def no_host_nodes() -> Iterator[None]:
    """NVIDIA's real libraries, run as root, create /dev/nvidia* on the host when they find no driver: nothing
    gpuhook does in the test may let them. Use with `pytestmark = pytest.mark.usefixtures("no_host_nodes")`."""
    before = host_nvidia_nodes()
    yield
    appeared = host_nvidia_nodes() - before
    for node in appeared:
        Path(node).unlink()
    assert not appeared, f"{sorted(appeared)} appeared on the host (removed)"
