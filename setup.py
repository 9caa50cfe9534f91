"""Build hooks: the cffi extension `gpuhook._native._gpuhook_native` and the native hook entry.

Everything else lives in pyproject.toml; setuptools' pyproject validation rejects `cffi_modules` under
[tool.setuptools], so this one keyword (registered by cffi's setuptools plugin) is passed here. The entry
(`_native/entry.c`) is an executable, not an extension: it is compiled and linked with the compiler
setuptools uses for the extension (static-pie where the static libc is installed, else dynamically) and lands
beside it as `gpuhook/_native/gpuhook-entry` (package data).
Building from source needs a C compiler and Python's headers (Debian: gcc, libc6-dev, python3-dev): the
extension is not optional. Only the entry is: where it alone fails to build, the package still installs and
`gpuhook hook install` writes the Python entry. The wheel and the .debs (packaging/build) need no compiler.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

ENTRY_SOURCE = "src/gpuhook/_native/entry.c"
ENTRY_NAME = "gpuhook-entry"


class BuildExtWithEntry(build_ext):
    """build_ext, then the native hook entry into the folder the extension went to (in place for -e)."""

    def run(self) -> None:
        super().run()
        target_dir = os.path.dirname(self.get_ext_fullpath("gpuhook._native._gpuhook_native"))
        try:
            objects = self.compiler.compile([ENTRY_SOURCE], output_dir=self.build_temp,
                                            extra_postargs=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fPIE"])
            try:  # static: no dynamic loader at each of its starts (~0.1 ms of every container's)
                self.compiler.link_executable(objects, ENTRY_NAME, output_dir=target_dir,
                                              extra_postargs=["-static-pie", "-s"])  # -s: no symbol table (~110 KB less)
            except Exception:  # noqa: BLE001 - no static libc here (RHEL's glibc-static): linked dynamically
                self.compiler.link_executable(objects, ENTRY_NAME, output_dir=target_dir)
        except Exception as exc:  # noqa: BLE001 - the Python entry still works: say so and go on
            print(f"warning: native hook entry not built ({exc}); `gpuhook hook install` writes the Python entry",
                  file=sys.stderr)


setup(cffi_modules=["src/gpuhook/_native/_build.py:ffibuilder"], cmdclass={"build_ext": BuildExtWithEntry})
