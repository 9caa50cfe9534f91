"""NVIDIA's own config.toml read as gpuhook's config (hook/config.py, hook/nvidiaconfig.py).

tests/data/nvidia_config_toml_v1.20.0.yaml holds NVIDIA's default file, the files its packages shipped and the
variants its tests and install guide write, each with what gpuhook takes from it and what it names as ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhook.errors import ConfigError
from gpuhook.hook import nvidiaconfig
from gpuhook.hook.config import Config, load_config, parse_config
from gpuhook.shim import runtime as shim

DATA = Path(__file__).resolve().parent / "data" / "nvidia_config_toml_v1.20.0.yaml"
CASES: list[dict[str, Any]] = yaml.safe_load(DATA.read_text())["cases"]


def _value(config: Config, attr: str) -> object:
    value = getattr(config, attr)
    if attr == "supported_capabilities":
        return sorted(value)
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("case", CASES, ids=[f"{c['file']}:{c['case']}" for c in CASES])
def test_nvidias_file(case: dict[str, Any]) -> None:
    if "error" in case:
        with pytest.raises(ConfigError) as raised:
            parse_config(case["toml"], "/etc/nvidia-container-runtime/config.toml")
        assert case["error"] in str(raised.value)
        return
    config = parse_config(case["toml"], "/etc/nvidia-container-runtime/config.toml")
    assert {attr: _value(config, attr) for attr in case["expect"]} == case["expect"]
    assert [line.split(" = ")[0] for line in config.ignored] == case["ignored"]


def test_every_key_of_nvidias_config_is_sorted() -> None:
    """Every key NVIDIA's v1.20.0 Config struct has (api/config/v1: config.go, cli.go, runtime.go, hook.go,
    features.go; transcribed here) is either mapped or has a reason to be ignored."""
    nvidia = {
        "nvidia-container-cli": ["root", "path", "environment", "debug", "ldcache", "load-kmods", "no-pivot",
                                 "no-cgroups", "user", "ldconfig"],
        "nvidia-container-runtime": ["debug", "log-level", "runtimes", "mode", "modes.cdi.spec-dirs",
                                     "modes.cdi.default-kind", "modes.cdi.annotation-prefixes",
                                     "modes.jit-cdi.nvcdi-feature-flags", "modes.jit-cdi.nvcdi-disable-hooks",
                                     "modes.csv.mount-spec-path", "modes.csv.compat-container-root",
                                     "modes.legacy.cuda-compat-mode"],
        "nvidia-container-runtime-hook": ["path", "skip-mode-detection"],
        "nvidia-ctk": ["path"],
        "features": ["allow-cuda-compat-libs-from-container", "allow-ldconfig-from-container",
                     "allow-unknown-oci-spec-fields", "disable-cuda-compat-lib-hook",
                     "disable-imex-channel-creation", "ignore-imex-channel-requests",
                     "no-additional-gids-for-device-nodes"],
    }
    keys = {f"{table}.{key}" for table, names in nvidia.items() for key in names}
    assert keys == set(nvidiaconfig.MAPPED) | set(nvidiaconfig.UNMAPPED)
    assert set(nvidia) == set(nvidiaconfig.TABLES)


def test_ignored_keys_are_named_once_with_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[nvidia-container-cli]\nno-cgroups = true\nroot = "/run/nvidia/driver"\n'
                    '[features]\ndisable-imex-channel-creation = true\n')
    for _ in range(3):
        config = load_config(str(path))
    assert config.driver_root == "/run/nvidia/driver"
    err = capsys.readouterr().err.splitlines()
    assert err == [f"gpuhook: warning: {path}: ignored: nvidia-container-cli.no-cgroups = true (gpuhook always "
                   "allows the devices it injects in the container's device cgroup); "
                   "features.disable-imex-channel-creation = true (gpuhook creates the IMEX channels a container "
                   "asks for)"]
    load_config(str(path), warn=False)
    assert capsys.readouterr().err == ""
    assert config == parse_config('driver-root = "/run/nvidia/driver"\n')  # `ignored` is no setting


@pytest.mark.parametrize(("text", "message"), [
    ('driver-root = "/a"\n[nvidia-container-cli]\nroot = "/b"\n', "driver-root \"/a\" and nvidia-container-cli.root"),
    ('supported-capabilities = ["compute"]\nsupported-driver-capabilities = "utility"\n', "both set"),
    ("[somebody-else]\nkey = 1\n", "unknown key 'somebody-else'"),
    ('[nvidia-container-runtime]\nruntimes = "runc"\n', "runtimes must be a list of strings"),
])
def test_conflicts_and_strangers_are_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text, "/etc/gpuhook/config.toml")


def test_the_same_setting_twice_with_one_value_is_fine() -> None:
    config = parse_config('driver-root = "/a"\n[nvidia-container-cli]\nroot = "/a"\n')
    assert config.driver_root == "/a" and config.ignored == ()


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_shims_runtime_is_the_first_of_runtimes_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVIDIA's runtimes: processed in order, each a path or a name searched on PATH; $GPUHOOK_RUNTIME wins."""
    crun = _executable(tmp_path / "bin" / "crun")
    env = {"PATH": str(crun.parent)}
    assert shim.real_runtime(env, ("docker-runc", "crun")) == str(crun)
    assert shim.real_runtime(env, (str(tmp_path / "absent"), str(crun))) == str(crun)
    assert shim.real_runtime({**env, "GPUHOOK_RUNTIME": "/opt/runc"}, ("crun",)) == "/opt/runc"
    with pytest.raises(shim.ShimError, match="any of the config's runtimes docker-runc, runc"):
        shim.real_runtime(env, ("docker-runc", "runc"))
    config = tmp_path / "config.toml"
    config.write_text('[nvidia-container-runtime]\nruntimes = ["docker-runc", "crun"]\n')
    monkeypatch.delenv("GPUHOOK_RUNTIME", raising=False)
    assert shim.configured_runtimes(str(config)) == ("docker-runc", "crun")
    config.write_text("not toml = = \n")
    assert shim.configured_runtimes(str(config)) == ("runc",)  # an unreadable config fails GPU containers only
    monkeypatch.setenv("GPUHOOK_RUNTIME", "runc")
    assert shim.configured_runtimes(os.devnull) == ("runc",)


def test_doctor_names_what_nvidias_config_sets_that_gpuhook_ignores(tmp_path: Path, fake_driver: Any) -> None:
    """doctor reads NVIDIA's file like every door, and says (INFO, not on stderr) what of it has no effect."""
    import json

    from click.testing import CliRunner

    from gpuhook.cli.app import cli

    config = tmp_path / "config.toml"
    config.write_text(f'[nvidia-container-cli]\nroot = "{fake_driver.root}"\nno-cgroups = true\n')
    result = CliRunner().invoke(cli, ["doctor", "--config", str(config), "--proc-root", str(fake_driver.root / "proc"),
                                      "--spec-dir", str(tmp_path), "--runtime", "none", "--json"])
    report = json.loads(result.stdout)
    infos = [f["message"] for f in report["findings"] if f["status"] == "info" and "ignores" in f["message"]]
    assert infos == [f"hook config {config}: NVIDIA settings gpuhook ignores: nvidia-container-cli.no-cgroups = "
                     "true (gpuhook always allows the devices it injects in the container's device cgroup)"]
    assert any("driver 550.54.15" in f["message"] for f in report["findings"])  # the root came from NVIDIA's key
