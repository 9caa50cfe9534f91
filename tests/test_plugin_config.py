"""NVIDIA's config file, environment and precedence: NVIDIA's own api/config/v1 test tables run through
gpuhook's loader (tests/data), then the plugin driven by a test kubelet over real gRPC with those settings."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from support.kubelet import PluginProcess, TestKubelet
from test_plugin import plugin_args, running, uuids

from gpuhook.errors import ConfigError
from gpuhook.plugin import config
from gpuhook.plugin.devices import Options, SharedResource
from gpuhook.plugin.settings import parse_go_bool, resolve

DATA = Path(__file__).parent / "data" / "nvidia_device_plugin_v0.20.0_config.yaml"
TABLE = yaml.safe_load(DATA.read_text(encoding="utf-8"))
GPU = "nvidia.com/gpu"
KIND = "k8s.device-plugin.nvidia.com/gpu"  # the plugin's CDI kind, NVIDIA's
WARNING_WORDS = ("rename", "devices", "resources")


def embedded(case: dict[str, Any]) -> str:
    """The config file a case's input stands in, as the data file's `embed` table says."""
    text, where = case["input"], case["embed"]
    if where == "file":
        return text
    if where == "device_ref":
        text, where = json.dumps([text]), "devices"
    if where == "devices":
        text = f'{{"name": "nvidia.com/gpu", "replicas": 2, "devices": {text}}}'
        where = "resource"
    if where == "resource":
        text, where = f'{{"resources": [{text}]}}', "time_slicing"
    if where == "time_slicing":
        return f'{{"version": "v1", "sharing": {{"timeSlicing": {text}}}}}'
    if where == "flags":
        return f'{{"version": "v1", "flags": {text}}}'
    if where == "resource_pattern":
        return json.dumps({"version": "v1", "resources": {"gpus": [{"pattern": text, "name": "gpu"}]}})
    raise AssertionError(f"unknown embedding {where}")


@pytest.mark.parametrize("case", TABLE["cases"], ids=[c["nvidia"] for c in TABLE["cases"]])
def test_nvidia_config_cases(case: dict[str, Any]) -> None:
    text = embedded(case)
    expect = case["expect"]
    if "error" in expect:
        with pytest.raises(ConfigError) as err:
            config.parse(text, "config.yaml")
        message = str(err.value)
        assert expect["error"] in message and message.startswith("config.yaml: ") and "\n" not in message
        return
    got = config.parse(text, "config.yaml")
    want = expect["ok"]
    if "shared" in want:
        assert got.sharing is not None
        assert [[s.name, s.replicas, s.rename] for s in got.sharing.resources] == want["shared"]
    else:
        assert got.sharing is None
    assert got.list_strategies == (tuple(want["list_strategies"]) if "list_strategies" in want else None)
    words = [w for w in WARNING_WORDS for line in got.warnings if f"'{w}'" in line]
    assert words == want.get("warnings", []), got.warnings


def test_the_table_covers_every_nvidia_test() -> None:
    tests = {c["nvidia"].rsplit(" ", 1)[0] if "TestResourcePattern" not in c["nvidia"] else
             "resources_test.go TestResourcePatternMatches" for c in TABLE["cases"]}
    tests |= {n["nvidia"] for n in TABLE["not_ported"]}
    assert {t.split()[0] for t in tests} == {"replicas_test.go", "flags_test.go", "resources_test.go",
                                             "config_test.go"}
    assert len(TABLE["cases"]) == 74


# -- the loader's own rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("version: v2\n", "version: unknown version 'v2' (expected v1)"),
    ("version: v1\nflags:\n  gfd:\n    oneshoot: true\n", "flags.gfd: unknown key flags.gfd.oneshoot"),
    ("bogus: 1\nother: 2\n", "unknown keys bogus, other"),
    ("flags:\n  migStrategy: half\n", "flags.migStrategy: 'half' is not one of none, single, mixed"),
    ("flags:\n  failOnInitError: maybe\n", "flags.failOnInitError: 'maybe' is not a boolean"),
    ("flags:\n  plugin:\n    deviceListStrategy: envvar,cdi-cri\n",  # one string is one strategy, as NVIDIA's
     "flags.plugin.deviceListStrategy[0]: 'envvar,cdi-cri' is not one of"),
    ("sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2.5\n",
     "resources[0].replicas: 2.5 is not an integer"),
    ("sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
     "resources[0].replicas: the number of replicas must be >= 2, not 1"),
    ("flags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n", "distributed) only"),
    ("flags: [\n", "not YAML or JSON"),
])
def test_bad_files_are_one_line_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.parse(text, "/etc/config/config.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("/etc/config/config.yaml: ")


def test_unknown_plugin_flags_are_a_warning_and_the_rest_is_read() -> None:
    """NVIDIA's plugin ignores an unknown key under flags.plugin (a later release's, or a typo): the file is
    accepted with one warning naming it, and what it does say still counts."""
    got = config.parse("version: v1\nflags:\n  plugin:\n    deviceListStratgy: envvar\n    futureKey: 1\n"
                       "    deviceIDStrategy: index\n", "/etc/config/config.yaml")
    assert got.id_strategy == "index"
    assert got.warnings == ("unknown keys flags.plugin.deviceListStratgy, flags.plugin.futureKey ignored (not in "
                            "NVIDIA's v1 schema; NVIDIA's plugin ignores it too)",)


# nvidia.com/gpu time-sliced 3 ways, renamed nvidia.com/gpu.shared, one replica per container
RENAMED = """
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 3
"""


def test_an_nvidia_chart_config_reads_as_nvidia_means_it() -> None:
    text = RENAMED + """
flags:
  migStrategy: mixed
  failOnInitError: false
  nvidiaDriverRoot: /run/nvidia/driver
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
    containerDriverRoot: /driver-root
  gfd:
    oneshot: false
    sleepInterval: 60s
"""
    got = config.parse(text)
    assert (got.mig_strategy, got.fail_on_init_error, got.host_driver_root, got.driver_root) == (
        "mixed", False, "/run/nvidia/driver", "/driver-root")
    assert (got.pass_device_specs, got.list_strategies, got.id_strategy) == (True, ("envvar", "cdi-cri"), "index")
    assert got.sharing == config.Sharing((SharedResource(GPU, 3, "nvidia.com/gpu.shared"),), True)
    assert got.warnings == ()


def test_empty_file_is_every_default(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert config.load(str(path)) == config.FileConfig()
    with pytest.raises(ConfigError, match="missing.yaml: No such file"):
        config.load(str(tmp_path / "missing.yaml"))


def test_go_bool() -> None:
    assert [parse_go_bool(v) for v in ("1", "t", "TRUE", "True", "0", "f", "False")] == [True] * 4 + [False] * 3
    for bad in ("yes", "", "on", "tRuE"):
        with pytest.raises(ValueError):
            parse_go_bool(bad)


def test_precedence_is_command_line_then_environment_then_file_then_default() -> None:
    file = config.parse("flags:\n  migStrategy: mixed\n  plugin:\n    deviceIDStrategy: index\n")
    defaults = {"mig_strategy": "none", "id_strategy": "uuid", "pass_device_specs": False}
    assert resolve({}, file, defaults) == {"mig_strategy": "mixed", "id_strategy": "index", "pass_device_specs": False}
    assert resolve({"mig_strategy": "single"}, file, defaults)["mig_strategy"] == "single"
    assert resolve({}, None, defaults) == defaults


# -- through the CLI: flags, environment, file ---------------------------------------------------------------------


def cli_options(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str]) -> Any:
    """The PluginConfig `gpuhook device-plugin` builds from `args` and `env` (serve_forever replaced)."""
    from click.testing import CliRunner

    import gpuhook.cli.plugin as cli

    seen: dict[str, Any] = {}

    def capture(cfg: Any, load: Any, node_configs: Any = None) -> None:
        seen["config"] = cfg
        load()  # (load_inventory replaced: it records the roots the plugin would read)

    monkeypatch.setattr(cli, "serve_forever", capture)
    monkeypatch.setattr(cli, "load_inventory", lambda *args: READ.__setitem__(0, args[:2]))
    result = CliRunner().invoke(cli.device_plugin, ["--hook-path", "/bin/true", *args], env=env)
    if result.exit_code != 0:
        return result
    return seen["config"]


def test_environment_beats_file_and_flags_beat_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("flags:\n  migStrategy: single\n  failOnInitError: true\n  plugin:\n    passDeviceSpecs: false\n"
                    "    deviceListStrategy: volume-mounts\n")
    cfg = cli_options(monkeypatch, [], {"CONFIG_FILE": str(path)})
    assert cfg.options.mig_strategy == "single" and cfg.options.list_strategies == ("volume-mounts",)
    assert cfg.fail_on_init_error is True and cfg.options.pass_device_specs is False
    env = {"CONFIG_FILE": str(path), "MIG_STRATEGY": "mixed", "FAIL_ON_INIT_ERROR": "false",
           "PASS_DEVICE_SPECS": "t", "DEVICE_LIST_STRATEGY": "envvar,cdi-annotations", "DEVICE_ID_STRATEGY": "index"}
    cfg = cli_options(monkeypatch, [], env)
    assert (cfg.options.mig_strategy, cfg.fail_on_init_error, cfg.options.pass_device_specs) == ("mixed", False, True)
    assert cfg.options.list_strategies == ("envvar", "cdi-annotations") and cfg.options.id_strategy == "index"
    cfg = cli_options(monkeypatch, ["--mig-strategy", "none", "--fail-on-init-error", "--device-list-strategy",
                                    "cdi-cri"], env)
    assert (cfg.options.mig_strategy, cfg.fail_on_init_error, cfg.options.list_strategies) == (
        "none", True, ("cdi-cri",))


def test_defaults_without_file_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cli_options(monkeypatch, [], {})
    assert cfg.options.list_strategies == ("cdi-cri", "envvar")
    assert (cfg.fail_on_init_error, cfg.options.pass_device_specs, cfg.options.mig_strategy) == (True, False, "none")
    assert cfg.host_driver_root is None


READ: list[Any] = [None]  # the (driver root, dev root) the last cli_options run would read


@pytest.mark.parametrize(("args", "env", "read", "host"), [
    # on the host itself (no /driver-root): read where the runtime finds it, nothing rebased
    ([], {}, (None, None), (None, None)),
    ([], {"NVIDIA_DRIVER_ROOT": "/run/nvidia/driver"}, ("/run/nvidia/driver", None), (None, None)),
    (["--driver-root", "/run/nvidia/driver"], {"NVIDIA_DRIVER_ROOT": "/elsewhere"},  # the flag wins
     ("/run/nvidia/driver", None), (None, None)),
    # NVIDIA's chart: the host's root mounted at a path of the container's
    ([], {"NVIDIA_DRIVER_ROOT": "/run/nvidia/driver", "DRIVER_ROOT_CTR_PATH": "{tmp}/mnt"},
     ("{tmp}/mnt", "/"), ("/run/nvidia/driver", "/run/nvidia/driver")),
    (["--nvidia-driver-root", "/", "--container-driver-root", "{tmp}/mnt"], {"NVIDIA_DEV_ROOT": "/"},
     ("{tmp}/mnt", "/"), ("/", "/")),
    (["--driver-root-ctr-path", "{tmp}/withdev"], {"CONTAINER_DRIVER_ROOT": "/ignored"},  # a dev folder: its nodes
     ("{tmp}/withdev", "{tmp}/withdev"), ("/", "/")),
])  # fmt: skip
def test_driver_roots_mean_what_nvidia_means(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str],
                                             env: dict[str, str], read: tuple[Any, Any], host: tuple[Any, Any]
                                             ) -> None:
    """--driver-root/NVIDIA_DRIVER_ROOT and --dev-root/NVIDIA_DEV_ROOT are the host's roots (what the spec
    names); --driver-root-ctr-path/DRIVER_ROOT_CTR_PATH is where this process reads the driver, its dev folder
    read when it has one, else / (NVIDIA v0.20.0 plugin-manager.go, root.go)."""
    (tmp_path / "mnt").mkdir()
    (tmp_path / "withdev" / "dev").mkdir(parents=True)

    def fill(value: Any) -> Any:
        return value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value

    cfg = cli_options(monkeypatch, [fill(a) for a in args], {k: fill(v) for k, v in env.items()})
    assert READ[0] == tuple(fill(v) for v in read)
    assert (cfg.host_driver_root, cfg.host_dev_root) == host


def test_the_old_host_driver_root_flag_names_its_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    result = cli_options(monkeypatch, ["--host-driver-root", "/"], {})
    assert result.exit_code == 2 and "--host-driver-root is now --driver-root" in result.output
    assert "--driver-root-ctr-path" in result.output


def test_bad_environment_is_one_usage_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = cli_options(monkeypatch, [], {"FAIL_ON_INIT_ERROR": "yes"})
    assert result.exit_code == 2 and "FAIL_ON_INIT_ERROR" in result.output and "'yes' is not a boolean" in result.output
    path = tmp_path / "c.yaml"
    path.write_text("sharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n")
    result = cli_options(monkeypatch, ["--replicas", "3", "--config-file", str(path)], {})
    assert isinstance(result.exception, ConfigError) and "give time-slicing once" in str(result.exception)


# -- the plugin, driven by a test kubelet --------------------------------------------------------------------------


def options_from(text: str, **extra: Any) -> Options:
    """Options as the CLI builds them from a file alone (the plugin's own tests start it in-process)."""
    file = config.parse(text)
    kwargs = file.options_fields()
    for name in ("mig_strategy", "id_strategy", "list_strategies", "pass_device_specs"):
        if getattr(file, name) is not None:
            kwargs[name] = getattr(file, name)
    return Options(**kwargs, **extra)


def test_time_slicing_renamed_with_replica_ids_and_fail_over_one(fake_driver: Any, kubelet: TestKubelet) -> None:
    from gpuhook.plugin.labels import labels

    options = options_from(RENAMED)
    with running(fake_driver, kubelet, options) as plugin:
        (reg,) = kubelet.wait_registrations(1)
        assert reg.request.resource_name == "nvidia.com/gpu.shared"
        assert reg.request.endpoint == "gpuhook-nvidia.com-gpu.shared.sock"
        u = uuids(plugin)
        stream = kubelet.stream("nvidia.com/gpu.shared")
        ids = [d.ID for d in stream.first().devices]
        assert ids == [f"{g}::{n}" for g in u for n in range(3)]
        client = kubelet.client("nvidia.com/gpu.shared")
        one = client.allocate([f"{u[1]}::2"]).container_responses[0]
        assert [c.name for c in one.cdi_devices] == [f"{KIND}={u[1]}"]
        with pytest.raises(grpc.RpcError) as err:
            client.allocate([f"{u[0]}::0", f"{u[1]}::0"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "maximum request size for shared resources is 1; found 2" in err.value.details()
        with pytest.raises(grpc.RpcError):  # two replicas of one GPU: also more than one
            client.allocate([f"{u[0]}::0", f"{u[0]}::1"])
        got = labels(plugin.inventory, options)
        # GFD: renamed resources carry no -SHARED suffix; the count is the GPUs, replicas the sharing
        assert (got["nvidia.com/gpu.count"], got["nvidia.com/gpu.replicas"]) == ("2", "3")
        assert got["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
        assert got["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert int(got["nvidia.com/gpu.count"]) * int(got["nvidia.com/gpu.replicas"]) == len(ids)


def test_time_slicing_without_rename_allows_several_replicas(fake_driver: Any, kubelet: TestKubelet) -> None:
    from gpuhook.plugin.labels import labels

    text = RENAMED.replace("renameByDefault: true", "renameByDefault: false").replace(
        "failRequestsGreaterThanOne: true", "failRequestsGreaterThanOne: false")
    options = options_from(text)
    with running(fake_driver, kubelet, options) as plugin:
        (reg,) = kubelet.wait_registrations(1)
        assert reg.request.resource_name == GPU
        u = uuids(plugin)
        resp = kubelet.client().allocate([f"{u[0]}::0", f"{u[1]}::0"]).container_responses[0]
        assert [c.name for c in resp.cdi_devices] == [f"{KIND}={u[0]}", f"{KIND}={u[1]}"]
        assert labels(plugin.inventory, options)["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"


def test_mixed_time_slicing_of_one_mig_profile(fake_driver_mig: Any, kubelet: TestKubelet) -> None:
    from gpuhook.plugin.labels import labels

    text = ("version: v1\nflags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
            "    resources:\n    - {name: nvidia.com/mig-1g.10gb, replicas: 2}\n")
    options = options_from(text, id_strategy="index")
    with running(fake_driver_mig, kubelet, options) as plugin:
        regs = kubelet.wait_registrations(3)
        names = sorted(r.request.resource_name for r in regs)
        assert names == [GPU, "nvidia.com/mig-1g.10gb.shared", "nvidia.com/mig-2g.20gb"]
        small = [d.ID for d in kubelet.stream("nvidia.com/mig-1g.10gb.shared").first().devices]
        assert len(small) == 4 and all("::" in i for i in small)
        got = labels(plugin.inventory, options)
        assert (got["nvidia.com/mig-1g.10gb.count"], got["nvidia.com/mig-1g.10gb.replicas"]) == ("2", "2")
        assert got["nvidia.com/mig-1g.10gb.product"].endswith("-MIG-1g.10gb")  # renamed: no -SHARED
        assert got["nvidia.com/mig-2g.20gb.replicas"] == "1"
        assert got["nvidia.com/gpu.count"] == str(len(kubelet.stream(GPU).first().devices))


@pytest.mark.parametrize("strategy, whole", [("none", 4), ("single", 0), ("mixed", 3)])
def test_labels_agree_with_what_is_advertised(fake_driver_mig: Any, fake_driver_factory: Any, kubelet: TestKubelet,
                                              strategy: str, whole: int) -> None:
    """Every advertised resource's label count x replicas is what kubelet is offered (single: a node whose every
    GPU is MIG-enabled with one profile, the MIG devices as nvidia.com/gpu)."""
    from gpuhook.plugin.labels import labels

    fake = (fake_driver_factory(gpus=2, mig={0: ["1g.10gb", "1g.10gb"], 1: ["1g.10gb"]}) if strategy == "single"
            else fake_driver_mig)
    options = Options(mig_strategy=strategy, replicas=2)
    with running(fake, kubelet, options) as plugin:
        regs = kubelet.wait_registrations(3 if strategy == "mixed" else 1)
        got = labels(plugin.inventory, options)
        assert got["nvidia.com/gpu.present"] == "true"
        for reg in regs:
            name = reg.request.resource_name
            advertised = len(kubelet.stream(name).first().devices)
            assert int(got[f"{name}.count"]) * int(got[f"{name}.replicas"]) == advertised, name
            assert got[f"{name}.sharing-strategy"] == "time-slicing"
        if strategy == "single":
            assert got["nvidia.com/gpu.count"] == "3" and got["nvidia.com/gpu.product"].endswith("-MIG-1g.10gb-SHARED")
        else:
            assert got["nvidia.com/gpu.count"] == str(whole)


def test_device_list_strategy_from_the_file(fake_driver: Any, kubelet: TestKubelet) -> None:
    options = options_from("flags:\n  plugin:\n    deviceListStrategy: [envvar, volume-mounts]\n"
                           "    deviceIDStrategy: index\n")
    with running(fake_driver, kubelet, options):
        kubelet.wait_registrations(1)
        resp = kubelet.client().allocate(["1"]).container_responses[0]
        assert list(resp.cdi_devices) == [] and resp.envs["NVIDIA_VISIBLE_DEVICES"] == "1"
        assert [m.container_path for m in resp.mounts] == ["/var/run/nvidia-container-devices/1"]


def test_pass_device_specs(fake_driver: Any, kubelet: TestKubelet) -> None:
    options = Options(id_strategy="index", list_strategies=("cdi-cri", "envvar"), pass_device_specs=True)
    with running(fake_driver, kubelet, options) as plugin:
        kubelet.wait_registrations(1)
        resp = kubelet.client().allocate(["1"]).container_responses[0]
        specs = [(d.container_path, d.host_path, d.permissions) for d in resp.devices]
        inv = plugin.inventory
        assert inv is not None
        control = [n for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
                   if n in inv.control_nodes]
        assert specs[:len(control)] == [(f"/dev/{n}", inv.control_nodes[n].host_path, "rw") for n in control]
        assert ("/dev/nvidia1", inv.gpus[1].node.host_path, "rw") in specs
        assert all(not p.startswith("/dev/nvidia0") for p, _, _ in specs)
        assert all(os.path.exists(h) for _, h, _ in specs)  # host paths name real nodes
    # CDI alone names the nodes itself: NVIDIA passes no DeviceSpecs then, and neither does gpuhook
    with running(fake_driver, kubelet, Options(list_strategies=("cdi-cri",), pass_device_specs=True)) as plugin:
        kubelet.wait_registrations(2)
        ids = [d.ID for d in kubelet.stream().first().devices]
        assert list(kubelet.client().allocate(ids[:1]).container_responses[0].devices) == []


def test_pass_device_specs_of_a_mig_device(fake_driver_mig: Any, kubelet: TestKubelet) -> None:
    options = Options(mig_strategy="mixed", id_strategy="index", list_strategies=("envvar",), pass_device_specs=True)
    with running(fake_driver_mig, kubelet, options) as plugin:
        kubelet.wait_registrations(3)
        inv = plugin.inventory
        assert inv is not None
        mig = next(m for m in inv.gpus[1].mig_devices if m.profile == "1g.10gb")
        resp = kubelet.client("nvidia.com/mig-1g.10gb").allocate([mig.name]).container_responses[0]
        paths = [d.container_path for d in resp.devices]
        assert "/dev/nvidia1" in paths
        assert {n.path for n in mig.cap_nodes} <= set(paths)


def test_fail_on_init_error_false_keeps_running_without_devices(workdir: str, kubelet: TestKubelet,
                                                                tmp_path: Path) -> None:
    """A GPU-less root: exit 1 by default; with failOnInitError false (here from the file) the process stays up,
    says why, serves and registers nothing (NVIDIA: "No devices found. Waiting indefinitely."), and SIGTERM
    still ends it with 0."""
    import signal
    import time

    root = tmp_path / "no-gpu"
    (root / "proc").mkdir(parents=True)
    (root / "dev").mkdir()
    args = ["--driver-root", str(root), "--proc-root", str(root / "proc"), "--kubelet-dir", kubelet.directory,
            "--cdi-spec-dir", os.path.join(workdir, "cdi"), "--hook-path", "/bin/true"]
    with PluginProcess(args, os.path.join(workdir, "log1")) as proc:
        assert proc.wait(20) == 1
        assert "Traceback" not in proc.log() and proc.log().strip().splitlines()[-1].startswith("gpuhook: ")
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nflags:\n  failOnInitError: false\n")
    with PluginProcess([*args, "--config-file", str(cfg)], os.path.join(workdir, "log2")) as proc:
        deadline = time.monotonic() + 20
        while "failOnInitError is false" not in proc.log():
            assert proc.proc.poll() is None, proc.log()
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.proc.poll() is None
        assert kubelet.registrations == []
        assert os.listdir(kubelet.directory) == ["kubelet.sock"]
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.log()


def test_mig_strategy_from_the_environment(fake_driver_mig: Any, kubelet: TestKubelet, workdir: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    monkeypatch.setenv("MIG_STRATEGY", "mixed")
    monkeypatch.setenv("DEVICE_ID_STRATEGY", "index")
    with PluginProcess(plugin_args(fake_driver_mig, kubelet), os.path.join(workdir, "log")) as proc:
        regs = kubelet.wait_registrations(3, timeout=20)
        assert {r.request.resource_name for r in regs} == {GPU, "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb"}
        assert [d.ID for d in kubelet.stream(GPU).first().devices] == ["0", "2", "3"]
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.log()


def test_config_file_warnings_are_logged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuhook.plugin")
    path = tmp_path / "c.yaml"
    path.write_text("resources:\n  gpus: [{pattern: '*', name: gpu}]\n")
    cli_options(monkeypatch, ["--config-file", str(path)], {})
    assert "Customizing the 'resources' field is not yet supported in the config. Ignoring..." in caplog.text


# -- item 0: the default list strategy gives the GPU on runtimes with and without CDI -------------------------------


def container_env(image_env: list[str], resp: Any, spec: dict[str, Any] | None) -> dict[str, str]:
    """The OCI process env a CRI runtime builds: the image's, kubelet's Allocate envs on top; a runtime with CDI
    (spec given) then applies the spec's env edits for the cdi_devices, replacing variables of the same name
    (the CDI library's AddProcessEnv); containerd 1.6 has no CDI and ignores cdi_devices."""
    env = dict(e.split("=", 1) for e in image_env)
    env.update(resp.envs)
    if spec is not None and resp.cdi_devices:
        names = {c.name.split("=", 1)[1] for c in resp.cdi_devices}
        edits = [spec.get("containerEdits", {})] + [d["containerEdits"] for d in spec["devices"] if d["name"] in names]
        for edit in edits:
            env.update(e.split("=", 1) for e in edit.get("env", []))
    return env


def test_default_strategy_gives_the_gpu_once_with_or_without_cdi(fake_driver: Any, kubelet: TestKubelet) -> None:
    """kubelet's device manager allocates one GPU with the default strategies. On containerd 1.6 (no CDI) the
    env names exactly that GPU for gpuhook's hook; on a CDI runtime the spec's edits give the device and the
    spec's NVIDIA_VISIBLE_DEVICES=void keeps the hook from injecting it a second time."""
    from gpuhook.cdi import codec
    from gpuhook.model.request import parse_request, visible_devices

    with running(fake_driver, kubelet, Options()) as plugin:
        kubelet.wait_registrations(1)
        ids = [d.ID for d in kubelet.stream().first().devices]
        resp = kubelet.client().allocate(ids[1:]).container_responses[0]
        spec = codec.read(plugin.spec_path)
        image = ["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=all"]  # a CUDA image's own default
        assert visible_devices(container_env(image, resp, None)) == ("list", (ids[1],))
        assert visible_devices(container_env(image, resp, spec)) == ("void", ())
        # and the hook or shim can tell which of the two happened (the record for the plugin: test_cdi_ignored.py)
        names = tuple(c.name for c in resp.cdi_devices)
        assert parse_request([f"{k}={v}" for k, v in container_env(image, resp, None).items()]).cdi_ignored == names
        assert parse_request([f"{k}={v}" for k, v in container_env(image, resp, spec).items()]).cdi_ignored == ()
        device = next(d for d in spec["devices"] if d["name"] == ids[1])
        assert [n["path"] for n in device["containerEdits"]["deviceNodes"]][:1] == ["/dev/nvidia1"]
        assert [c.name for c in resp.cdi_devices] == [f"{KIND}={ids[1]}"]


# -- item 6: the deployment ------------------------------------------------------------------------------------------


def test_daemonset_reads_the_config_map_where_it_mounts_it() -> None:
    base = Path(__file__).parent.parent / "deploy/base/device-plugin"
    (ds,) = yaml.safe_load_all((base / "daemonset.yaml").read_text(encoding="utf-8"))
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == "nvidia-device-plugin-config"
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    (item,) = volume["configMap"]["items"]
    assert env["CONFIG_FILE"] == f"{mount['mountPath']}/{item['path']}" and item["key"] == "config.yaml"
    # the file's settings must not be overridden by flags (command line beats the file)
    flags = {a.split("=")[0] for a in container["args"][1:]}
    assert not flags & {"--mig-strategy", "--device-list-strategy", "--device-id-strategy", "--replicas",
                        "--pass-device-specs", "--fail-on-init-error"}
    example = config.load(str(base / "config.yaml"))
    assert example.list_strategies == Options().list_strategies and example.mig_strategy == Options().mig_strategy


def test_the_hook_state_dir_flag_defaults_to_the_hooks_state_dir() -> None:
    """--hook-state-dir's default is the folder the hooks write their record to (model/contract.STATE_DIR, the
    DaemonSet's mount: test_cdi_ignored); here because the plugin's command line needs grpc."""
    from click.testing import CliRunner

    from gpuhook.cli.plugin import device_plugin
    from gpuhook.model.contract import STATE_DIR

    help_text = CliRunner().invoke(device_plugin, ["--help"]).output
    assert f"[default: {STATE_DIR}]" in " ".join(help_text.split())
