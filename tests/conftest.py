"""Shared fixtures: the simulated driver (tests/support/fakefix.py), NVIDIA's real driver roots
(tests/support/realfix.py) and the end-to-end gate."""

from support.fakefix import *  # noqa: F401,F403
from support.kubeletfix import *  # noqa: F401,F403
from support.realfix import *  # noqa: F401,F403
