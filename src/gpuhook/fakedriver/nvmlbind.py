"""Pointing pynvml at one fake's NVML mock, and undoing it: pynvml keeps process-wide state.

pynvml holds the loaded library (`nvmlLib`), a per-name function-pointer cache and an init refcount; a
test that binds it to one fake must leave all three as it found them, or the next test talks to the
wrong library.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from gpuhook.fakedriver.model import FakeDriver

_LOCK = threading.RLock()
_NVML_ERROR_UNINITIALIZED = 1


def reset_pynvml(pynvml: ModuleType) -> None:
    """Forget any loaded NVML library so the next nvmlInit loads afresh."""
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0


def _shutdown_all(lib: ctypes.CDLL) -> None:
    """Drop every init the test left open, so the library starts uninitialised next time."""
    for _ in range(1000):
        if lib.nvmlShutdown() == _NVML_ERROR_UNINITIALIZED:
            return


@contextmanager
def pynvml_bound(fake: FakeDriver) -> Iterator[ModuleType]:
    """Yield pynvml with `nvmlLib` bound to this fake's libnvidia-ml.so.1 (not initialised).

    Serialised process-wide; on exit every nvmlInit is balanced and pynvml is reset.
    """
    from gpuhook.discover.nvml import import_pynvml

    pynvml = import_pynvml()

    with _LOCK:
        lib = ctypes.CDLL(str(fake.nvml_library))
        _shutdown_all(lib)
        reset_pynvml(pynvml)
        pynvml.nvmlLib = lib
        try:
            yield pynvml
        finally:
            _shutdown_all(lib)
            reset_pynvml(pynvml)
