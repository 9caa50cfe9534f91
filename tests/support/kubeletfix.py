"""The kubelet fixtures the device-plugin tests share (conftest.py imports them): a short temp dir (a socket path
must stay under 108 bytes) and a test kubelet in it. TestKubelet is imported only when a test asks for one, so
collecting the suite needs no grpc (the host install on older Pythons has none)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.kubelet import TestKubelet


@pytest.fixture
def workdir() -> Iterator[str]:
    from support.processes import short_tempdir

    path = short_tempdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(workdir: str) -> Iterator[TestKubelet]:
    from support.kubelet import TestKubelet

    with TestKubelet(os.path.join(workdir, "dp")) as k:
        yield k
