"""Every flag and environment variable of NVIDIA's k8s-device-plugin v0.20.0, table-driven from
plugin/nvidiaflags.py (its cmd/nvidia-device-plugin/main.go, internal/rm/health.go and Helm chart): taken with
NVIDIA's meaning, or refused with one line naming what to use instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from test_plugin_config import cli_options

from gpuhook.cli.plugin import device_plugin
from gpuhook.plugin.health import DEFAULT_IGNORED_XIDS
from gpuhook.plugin.nvidiaflags import FLAGS, health_settings

# A value NVIDIA takes for each setting, and what gpuhook's parameter then holds.
SAMPLE: dict[str, tuple[str, Any]] = {
    "mig_strategy": ("mixed", "mixed"), "fail_on_init_error": ("false", False),
    "driver_root": ("/run/nvidia/driver", "/run/nvidia/driver"), "dev_root": ("/", "/"),
    "pass_device_specs": ("true", True), "device_list_strategy": ("envvar", "envvar"),
    "device_id_strategy": ("index", "index"), "gdrcopy_enabled": ("true", True), "gds_enabled": ("1", True),
    "mofed_enabled": ("t", True), "cdi_annotation_prefix": ("cdi.k8s.io/", "cdi.k8s.io/"),
    "driver_root_ctr_path": ("/driver-root", "/driver-root"), "mps_root": ("/run/nvidia/mps", "/run/nvidia/mps"),
    "shared_devices_allocation_policy": ("distributed", "distributed"), "discovery": ("nvml", "nvml"),
    "imex_required": ("false", "false"), "kubelet_socket": ("/var/lib/kubelet/device-plugins/kubelet.sock",) * 2,
    "config_file": ("/config/config.yaml", "/config/config.yaml"),
}
# A value NVIDIA takes that gpuhook refuses, for each setting gpuhook limits.
REFUSED = {"cdi_annotation_prefix": "nvidia.cdi.k8s.io/", "nvidia_cdi_hook_path": "/usr/bin/nvidia-cdi-hook",
           "shared_devices_allocation_policy": "packed", "discovery": "tegra", "imex_channel_ids": "0,1",
           "imex_required": "true", "cdi_feature_flags": "disable-multiple-csv-devices", "cdi_disable_hooks": "all"}


def parse(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """The parameters `gpuhook device-plugin` parses from `args` and `env` (callbacks run, the command not)."""
    ctx = device_plugin.make_context("device-plugin", list(args), auto_envvar_prefix=None)
    return dict(ctx.params)


def cases() -> list[Any]:
    out = []
    for flag in FLAGS:
        for name in flag.names:
            out.append(pytest.param(flag, f"--{name}", None, id=f"--{name}"))
        for env in flag.env:
            out.append(pytest.param(flag, None, env, id=env))
    return out


def test_the_table_is_nvidias_list() -> None:
    """v0.20.0 main.go's c.Flags: 22 flags, 4 aliases, 24 variables, each once."""
    names = [n for f in FLAGS for n in f.names]
    assert len(names) == len(set(names)) == 26 and len(FLAGS) == 22
    env = [e for f in FLAGS for e in f.env]
    assert len(env) == len(set(env)) == 24


@pytest.mark.parametrize(("flag", "option", "env"), cases())
def test_every_nvidia_name_is_an_option(flag: Any, option: str | None, env: str | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    params = {p.name: p for p in device_plugin.params}
    param = params[flag.param]
    assert isinstance(param, click.Option)
    if option is not None:
        assert option in param.opts
    else:
        assert env in ([param.envvar] if isinstance(param.envvar, str) else list(param.envvar or []))
    if flag.accepted == ():  # refused whenever set: nothing to take
        value = REFUSED[flag.param]
    else:
        value, want = SAMPLE[flag.param]
    for name in {e for e in flag.env}:
        monkeypatch.delenv(name, raising=False)
    if option is not None:
        args = [option, value]
    else:
        monkeypatch.setenv(env, value)
        args = []
    if flag.accepted == ():
        with pytest.raises(click.BadParameter) as err:
            parse(args)
        assert "is not taken by gpuhook: " + flag.instead in str(err.value.format_message())
        return
    got = parse(args)[flag.param]
    assert got == want


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.accepted], ids=lambda f: f.names[0])
def test_limited_flags_refuse_the_rest_naming_what_to_do(flag: Any) -> None:
    with pytest.raises(click.BadParameter) as err:
        parse([f"--{flag.names[0]}", REFUSED[flag.param]])
    message = err.value.format_message()
    assert message.endswith(flag.instead) and "\n" not in message


def test_nvidias_chart_environment_runs_unchanged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What v0.20.0's daemonset-device-plugin.yml sets, every optional value set: accepted as a whole."""
    env = {"MPS_ROOT": "/run/nvidia/mps", "MIG_STRATEGY": "single", "FAIL_ON_INIT_ERROR": "true",
           "PASS_DEVICE_SPECS": "false", "DEVICE_LIST_STRATEGY": "cdi-cri", "DEVICE_ID_STRATEGY": "uuid",
           "NVIDIA_DRIVER_ROOT": "/", "NVIDIA_DEV_ROOT": "/", "GDRCOPY_ENABLED": "false", "GDS_ENABLED": "true",
           "MOFED_ENABLED": "false", "NVIDIA_MIG_MONITOR_DEVICES": "all", "DEVICE_DISCOVERY_STRATEGY": "auto",
           "NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
    cfg = cli_options(monkeypatch, [], env)
    assert cfg.options.mig_strategy == "single" and cfg.options.list_strategies == ("cdi-cri",)
    assert cfg.options.gated_env == ("NVIDIA_GDS",)


@pytest.mark.parametrize(("env", "gated"), [
    ({"NVIDIA_GDS": "enabled", "NVIDIA_MOFED": "enabled"}, ("NVIDIA_GDS", "NVIDIA_MOFED")),
    ({"GDS_ENABLED": "true", "MOFED_ENABLED": "1", "GDRCOPY_ENABLED": "t"},
     ("NVIDIA_GDRCOPY", "NVIDIA_GDS", "NVIDIA_MOFED")),
    ({"GDS_ENABLED": "false", "NVIDIA_GDS": "enabled"}, ()),  # the flag's variable wins
    ({"NVIDIA_MOFED": "disabled"}, ()),
])  # fmt: skip
def test_gated_families_from_either_name(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                         gated: tuple[str, ...]) -> None:
    for name in ("NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_GDRCOPY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        if name.startswith("NVIDIA_"):
            monkeypatch.setenv(name, value)  # the process's own environment, where the plugin reads them
    cfg = cli_options(monkeypatch, [], env)
    assert cfg.options.gated_env == gated


@pytest.mark.parametrize(("disable", "enable", "on", "ignored"), [
    ("", "", True, DEFAULT_IGNORED_XIDS),
    ("all", "", False, DEFAULT_IGNORED_XIDS),
    ("XIDS", "", False, DEFAULT_IGNORED_XIDS),  # lower-cased, as NVIDIA's
    ("all", "all", True, frozenset()),
    ("", "all", True, frozenset()),  # every XID counts, the default-ignored too
    (" 48, 79 ,bogus,", "", True, DEFAULT_IGNORED_XIDS | {48, 79}),
    ("48", "13,48", True, (DEFAULT_IGNORED_XIDS | {48}) - {13, 48}),
    ("all", "13", False, DEFAULT_IGNORED_XIDS),  # NVIDIA: all disabled stops the checks unless all is enabled
])  # fmt: skip
def test_dp_health_variables(disable: str, enable: str, on: bool, ignored: frozenset[int]) -> None:
    """internal/rm/health.go getDisabledHealthCheckXids and its IsAllDisabled/IsDisabled."""
    env = {"DP_DISABLE_HEALTHCHECKS": disable, "DP_ENABLE_HEALTHCHECKS": enable}
    assert health_settings(DEFAULT_IGNORED_XIDS, env) == (on, ignored)


def test_dp_disable_healthchecks_turns_the_plugins_checks_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP_DISABLE_HEALTHCHECKS", "all")
    assert cli_options(monkeypatch, [], {}).health.enabled is False
    monkeypatch.setenv("DP_DISABLE_HEALTHCHECKS", "109")
    cfg = cli_options(monkeypatch, [], {})
    assert cfg.health.enabled and 109 in cfg.health.ignored_xids


def test_kubelet_socket_names_the_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = cli_options(monkeypatch, ["--kubelet-socket", f"{tmp_path}/dp/kubelet.sock"], {})
    assert cfg.kubelet_dir == f"{tmp_path}/dp"
    result = cli_options(monkeypatch, [], {"KUBELET_SOCKET": f"{tmp_path}/other.sock"})
    assert "gpuhook registers through kubelet.sock" in str(result.exception)
