"""Build hook for the cffi extension `gpuhook._native._gpuhook_native`.

Everything else lives in pyproject.toml; setuptools' pyproject validation rejects `cffi_modules` under
[tool.setuptools], so this one keyword (registered by cffi's setuptools plugin) is passed here.
"""

from setuptools import setup

setup(cffi_modules=["src/gpuhook/_native/_build.py:ffibuilder"])
