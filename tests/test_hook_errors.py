"""The hook's last line of defence: malformed input to gpuhook-hook is one line on stderr, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HOOK = str(Path(sys.executable).with_name("gpuhook-hook"))


@pytest.mark.parametrize(
    "stdin",
    [b"", b"not json", b"[" * 100_000, b'{"id": "x", "bundle": "relative"}', b'{"id": "x", "bundle": "/nonexistent"}'],
    ids=["empty", "garbage", "deeply-nested", "relative-bundle", "missing-bundle"],
)
def test_bad_state_is_one_line(tmp_path: Path, stdin: bytes) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'log-file = "{tmp_path}/log"\n')
    result = subprocess.run([HOOK, "--config", str(config)], input=stdin, capture_output=True, timeout=60)
    assert result.returncode == 1
    err = result.stderr.decode()
    assert err.startswith("gpuhook-hook: ") and err.count("\n") == 1 and "Traceback" not in err
    assert " error: " in (tmp_path / "log").read_text()
