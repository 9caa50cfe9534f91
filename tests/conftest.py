"""Shared fixtures: the simulated driver (tests/support/fakefix.py) and the end-to-end gate."""

from support.fakefix import *  # noqa: F401,F403
