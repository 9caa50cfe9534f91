"""A simulated NVIDIA driver install ("fake driver root") for tests and `gpuhook demo`.

It is faithful where gpuhook looks: real character device nodes, real ELF libraries with the catalogue's
sonames and an ld.so.cache, an NVML mock with the real ABI and error semantics, the kernel module's /proc
text. Production code never imports this package.
"""

from __future__ import annotations

from gpuhook.fakedriver.build import build_fake_driver
from gpuhook.fakedriver.compile import CompileError, cache_dir, gcc_supports_m32
from gpuhook.fakedriver.datacenter import Datacenter
from gpuhook.fakedriver.model import (
    DEFAULT_CUDA_VERSION,
    DEFAULT_DRIVER_VERSION,
    DEFAULT_UUID_SALT,
    MAX_GPUS,
    MIG_PROFILES,
    FakeDriver,
    FakeGpu,
    FakeLibrary,
    FakeMigDevice,
    FakeNode,
)
from gpuhook.fakedriver.nvmlbind import pynvml_bound, reset_pynvml

__all__ = [
    "DEFAULT_CUDA_VERSION",
    "DEFAULT_DRIVER_VERSION",
    "DEFAULT_UUID_SALT",
    "MAX_GPUS",
    "MIG_PROFILES",
    "CompileError",
    "Datacenter",
    "FakeDriver",
    "FakeGpu",
    "FakeLibrary",
    "FakeMigDevice",
    "FakeNode",
    "build_fake_driver",
    "cache_dir",
    "gcc_supports_m32",
    "pynvml_bound",
    "reset_pynvml",
]
