"""A command whose optional extra is not installed says in one line which extra to install (the host install,
.ci/python-matrix's, has no `plugin` extra); gRPC is hidden from a child interpreter so that the test runs with
or without the extra installed."""

from __future__ import annotations

import subprocess
import sys

HIDE_GRPC = """
import sys, importlib.abc
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == h or name.startswith(h + '.') for h in ('grpc', 'google')):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, Hide())
from gpuhook.cli import main
sys.exit(main(sys.argv[1:]))
"""


def gpuhook_without_grpc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE_GRPC, *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_device_plugin_names_the_extra() -> None:
    for args in (["device-plugin"], ["device-plugin", "--kubelet-dir", "/x"], ["device-plugin", "--help"]):
        result = gpuhook_without_grpc(*args)
        assert result.returncode == 1, result
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("gpuhook: `gpuhook device-plugin` needs the 'plugin' extra")
        assert "pip install 'gpuhook[plugin]'" in lines[0]


def test_help_lists_every_command_without_the_extra() -> None:
    result = gpuhook_without_grpc("--help")
    assert result.returncode == 0, result.stderr
    assert "device-plugin  (needs pip install 'gpuhook[plugin]')" in result.stdout
    assert "generate-cdi" in result.stdout


def test_other_missing_modules_are_not_blamed_on_the_extra() -> None:
    """Only the extra's own modules make the stand-in: any other missing module stays the error it is."""
    code = HIDE_GRPC.replace("('grpc', 'google')", "('gpuhook.plugin.lifecycle',)")
    result = subprocess.run([sys.executable, "-c", code, "device-plugin", "--help"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert "extra" not in result.stderr
    assert result.returncode == 1 and "gpuhook.plugin.lifecycle" in result.stderr
