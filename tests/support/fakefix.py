"""Shared fixtures for simulated driver roots (`from support.fakefix import *` in conftest.py).

Fakes are built once per session per distinct request and shared. The NVML test controls (XID queue, lost
GPUs, failing init) are reset whenever a fixture hands a shared fake out; a test that changes anything else
in the tree (deletes a node, rewrites a /proc file) must ask the factory for its own with `fresh=True`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import pytest

from gpuhook.fakedriver import (
    DEFAULT_CUDA_VERSION,
    DEFAULT_DRIVER_VERSION,
    DEFAULT_UUID_SALT,
    Datacenter,
    FakeDriver,
    build_fake_driver,
    pynvml_bound,
)

from .e2e import need

__all__ = [
    "FAKE_MIG_LAYOUT",
    "FakeDriverFactory",
    "FAKE_DATACENTER",
    "fake_driver",
    "fake_driver_datacenter",
    "fake_driver_factory",
    "fake_driver_mig",
    "fake_nvml",
]

# fake_driver_mig: 4 GPUs, MIG on GPU 1 only (GPU 0 and 2-3 whole), three MIG devices of two sizes.
FAKE_MIG_LAYOUT: dict[int, list[str]] = {1: ["1g.10gb", "1g.10gb", "2g.20gb"]}

# fake_driver_datacenter: IMEX channels 0 and 3 (no 1: a missing channel), 2 NVSwitches, GDS, one HCA, gdrcopy.
FAKE_DATACENTER = Datacenter(imex_channels=(0, 3), nvswitches=2, gds=True, hcas=1, gdrcopy=True)

FakeDriverFactory = Callable[..., FakeDriver]


def _key(
    gpus: int,
    driver_version: str,
    cuda_version: str,
    mig: Mapping[int, Sequence[str]] | None,
    compat32: bool | None,
    options: dict[str, Any],
) -> tuple[Any, ...]:
    frozen_mig = tuple(sorted((k, tuple(v)) for k, v in (mig or {}).items()))
    minors = options.get("minors")
    frozen_options = tuple(sorted({**options, "minors": tuple(minors) if minors else None}.items()))
    return (gpus, driver_version, cuda_version, frozen_mig, compat32, frozen_options)


@pytest.fixture(scope="session")
def fake_driver_factory(tmp_path_factory: pytest.TempPathFactory) -> FakeDriverFactory:
    """factory(gpus=2, driver_version=..., cuda_version=..., mig=None, compat32=None, *, minors=None,
    uuid_salt=..., merged_usr=False, nvlink="none", datacenter=Datacenter(), fresh=False) -> FakeDriver;
    identical requests share one build."""
    need(os.geteuid() == 0, "the fake driver needs root (mknod, ldconfig -r)")
    built: dict[tuple[Any, ...], FakeDriver] = {}

    def make(
        gpus: int = 2,
        driver_version: str = DEFAULT_DRIVER_VERSION,
        cuda_version: str = DEFAULT_CUDA_VERSION,
        mig: Mapping[int, Sequence[str]] | None = None,
        compat32: bool | None = None,
        *,
        minors: Sequence[int] | None = None,
        uuid_salt: str = DEFAULT_UUID_SALT,
        merged_usr: bool = False,
        nvlink: str = "none",
        datacenter: Datacenter = Datacenter(),
        fresh: bool = False,
    ) -> FakeDriver:
        options = {"minors": minors, "uuid_salt": uuid_salt, "merged_usr": merged_usr, "nvlink": nvlink,
                   "datacenter": datacenter}
        key = _key(gpus, driver_version, cuda_version, mig, compat32, options)
        if not fresh and key in built:
            built[key].reset_controls()
            return built[key]
        root = tmp_path_factory.mktemp("fakedriver") / "root"
        fake = build_fake_driver(
            root,
            gpus,
            driver_version,
            cuda_version,
            mig,
            compat32,
            minors=minors,
            uuid_salt=uuid_salt,
            merged_usr=merged_usr,
            nvlink=nvlink,
            datacenter=datacenter,
        )
        if not fresh:
            built[key] = fake
        return fake

    return make


@pytest.fixture
def fake_driver(fake_driver_factory: FakeDriverFactory) -> FakeDriver:
    """2 H100 GPUs, no MIG, driver 550.54.15 / CUDA 12.4 (shared; controls reset)."""
    return fake_driver_factory()


@pytest.fixture
def fake_driver_mig(fake_driver_factory: FakeDriverFactory) -> FakeDriver:
    """4 GPUs, GPU 1 in MIG mode with FAKE_MIG_LAYOUT (shared; controls reset)."""
    return fake_driver_factory(gpus=4, mig=FAKE_MIG_LAYOUT)


@pytest.fixture
def fake_driver_datacenter(fake_driver_factory: FakeDriverFactory) -> FakeDriver:
    """2 GPUs plus FAKE_DATACENTER's nodes (shared; controls reset)."""
    return fake_driver_factory(datacenter=FAKE_DATACENTER)


@pytest.fixture
def fake_nvml(fake_driver: FakeDriver) -> Iterator[ModuleType]:
    """pynvml bound to fake_driver's NVML mock and initialised; fully reset afterwards."""
    with pynvml_bound(fake_driver) as pynvml:
        pynvml.nvmlInit()
        yield pynvml
