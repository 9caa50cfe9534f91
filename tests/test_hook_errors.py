"""The hook's last line of defence: malformed input to gpuhook-hook is one line on stderr, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.hostpaths import host_snapshot

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


# --- a config file that cannot be read -------------------------------------------------------------------------

def bundle_state(tmp: Path, env: list[str], cid: str = "c1") -> bytes:
    bundle = tmp / cid
    (bundle / "rootfs").mkdir(parents=True)
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"env": ["PATH=/bin", *env]}}
    (bundle / "config.json").write_text(json.dumps(spec))
    return json.dumps({"ociVersion": "1.0.2", "id": cid, "pid": 1, "bundle": str(bundle)}).encode()


@pytest.mark.parametrize("broken", ["driver-root = \n", "no-such-key = true\n", None],
                         ids=["invalid-toml", "unknown-key", "missing"])
def test_a_broken_config_fails_only_gpu_containers(tmp_path: Path, broken: str | None) -> None:
    """A broken config file is read on every start on the host: a container that asks for no GPU starts anyway
    (`docker run` of any image must keep working), one that asks for a GPU fails naming the config."""
    config = tmp_path / "config.toml"
    if broken is not None:
        config.write_text(broken)
    log = Path("/var/log/gpuhook.log")
    before = host_snapshot((str(log),))
    for env, cid in (([], "plain"), (["NVIDIA_VISIBLE_DEVICES=void"], "void")):
        plain = subprocess.run([HOOK, "--config", str(config)], input=bundle_state(tmp_path, env, cid),
                               capture_output=True, timeout=60)
        assert plain.returncode == 0 and plain.stderr == b"", plain.stderr
    gpu = subprocess.run([HOOK, "--config", str(config)], input=bundle_state(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"]),
                         capture_output=True, timeout=60)
    err = gpu.stderr.decode()
    assert gpu.returncode == 1 and err.startswith("gpuhook-hook: ") and str(config) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    # a config named on the command line that cannot be read: the host's default log is not its log
    assert host_snapshot((str(log),)) == before


def test_a_broken_default_config_logs_to_the_default_log(tmp_path: Path) -> None:
    """The start itself, through prestart.handle as the entry and the service run it: with the default config
    unreadable, the line goes to the default log (the only log the host configured); a named one logs nowhere."""
    from gpuhook.errors import ConfigError
    from gpuhook.hook import prestart, unreadconfig
    from gpuhook.hook.config import DEFAULT_LOG, DEFAULT_PATH

    def broken(path: str | None) -> Any:
        raise ConfigError(f"{path or DEFAULT_PATH}: invalid TOML: x")

    state = bundle_state(tmp_path, [])
    assert unreadconfig.fallback_log(None) == unreadconfig.fallback_log(DEFAULT_PATH) == DEFAULT_LOG
    assert unreadconfig.fallback_log(str(tmp_path / "c.toml")) == ""
    code, line = prestart.handle(str(tmp_path / "c.toml"), lambda: state, 0.0, load=broken)
    assert (code, line) == (0, "")
    gpu = bundle_state(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"], "gpu")
    code, line = prestart.handle(str(tmp_path / "c.toml"), lambda: gpu, 0.0, load=broken)
    assert code == 1 and line == f"gpuhook-hook: {tmp_path / 'c.toml'}: invalid TOML: x"


def test_a_state_that_cannot_be_read_is_logged_where_the_config_says(tmp_path: Path) -> None:
    """A state over the bound fails while it is read: the config is read first, so the line goes to its
    log-file, never to the host's default log."""
    from gpuhook.hook import prestart
    from gpuhook.oci.bundle import BundleError

    config = tmp_path / "config.toml"
    config.write_text(f'log-file = "{tmp_path}/log"\n')

    def too_big() -> bytes:
        raise BundleError("OCI state on stdin is over 64 MiB")

    before = host_snapshot(("/var/log/gpuhook.log",))
    code, line = prestart.handle(str(config), too_big, 0.0)
    assert (code, line) == (1, "gpuhook-hook: OCI state on stdin is over 64 MiB")
    assert "? error: OCI state on stdin is over 64 MiB" in (tmp_path / "log").read_text()
    assert host_snapshot(("/var/log/gpuhook.log",)) == before
