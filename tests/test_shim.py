"""`gpuhook-runtime`, the OCI runtime shim: argv parsing, the config.json rewrite, pass-through, and real runc
containers started through it on cgroup v1 and (in a private cgroup2 mount namespace) v2."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.cdi_inventory import synthetic_inventory
from support.e2e import need_root, need_tool
from support.glibc import glibc_rootfs
from support.runc import cgroup2_namespace, make_bundle, need_busybox, runc_cmd, runc_delete, unique_id

from gpuhook import _native
from gpuhook.cdi.spec import build_spec, render_hooks
from gpuhook.model.edits import Selection, plan
from gpuhook.model.request import parse_request
from gpuhook.model.selection import resolve
from gpuhook.shim import runtime as shim

HOOK = "/opt/gpuhook/bin/gpuhook"
SHIM = str(Path(sys.executable).with_name("gpuhook-runtime"))


# --- argv ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "command", "bundle", "cid"), [
    (["--root", "/run/containerd/runc/k8s.io", "--log", "/x/log.json", "--log-format", "json", "--systemd-cgroup",
      "create", "--bundle", "/b", "--pid-file", "/b/init.pid", "c1"], "create", "/b", "c1"),
    (["create", "-b", "/b", "--console-socket", "/s.sock", "c2"], "create", "/b", "c2"),
    (["--root=/r", "create", "--bundle=/b", "c3"], "create", "/b", "c3"),
    (["-root", "/r", "create", "-bundle", "/b", "c4"], "create", "/b", "c4"),
    (["run", "-d", "--bundle", "rel", "c5"], "run", "/cwd/rel", "c5"),
    (["run", "--pid-file", "-b", "c6"], "run", "/cwd", "c6"),  # -b is the pid file's value, not an option
    (["create", "c7"], "create", "/cwd", "c7"),
    (["--rootless", "auto", "state", "c8"], "state", "", ""),
    (["delete", "-f", "c9"], "delete", "", ""),
    (["--version"], None, "", ""),
])  # fmt: skip
def test_parse_argv(argv: list[str], command: str | None, bundle: str, cid: str) -> None:
    inv = shim.parse_argv(argv, cwd="/cwd")
    assert inv.command == command
    if command in ("create", "run"):
        assert (inv.bundle, inv.container_id) == (bundle or "/cwd", cid)


def test_help_is_not_a_create() -> None:
    assert shim.parse_argv(["create", "--help"]).help


# --- config.json rewrite --------------------------------------------------------------------------------------


def edits_for(devices: str, caps: str = "all") -> Any:
    inv = synthetic_inventory(gpus=2)
    request = parse_request([f"NVIDIA_VISIBLE_DEVICES={devices}", f"NVIDIA_DRIVER_CAPABILITIES={caps}"])
    return plan(inv, resolve(inv, request))


def test_rewrite_matches_the_cdi_rendering() -> None:
    """Nodes, rules, mounts and hooks as a CDI runtime writes them for the spec's device `0` + common edits."""
    config: dict[str, Any] = {"process": {"env": ["A=1"]}, "mounts": [], "linux": {"resources": {"devices": [
        {"allow": False, "access": "rwm"}]}}}
    out = shim.apply_edits(config, edits_for("0"), HOOK)
    spec = build_spec(synthetic_inventory(gpus=2), hook_path=HOOK)
    device0 = next(d["containerEdits"] for d in spec["devices"] if d["name"] == "0")
    common = spec["containerEdits"]
    want_nodes = [(n["path"], n["type"], n["major"], n["minor"], n["fileMode"])
                  for n in device0["deviceNodes"] + common["deviceNodes"]]
    assert [(d["path"], d["type"], d["major"], d["minor"], d["fileMode"]) for d in out["linux"]["devices"]] \
        == want_nodes
    assert all(d["uid"] == 0 and d["gid"] == 0 for d in out["linux"]["devices"])
    rules = out["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    assert rules[1:] == [{"allow": True, "type": "c", "major": n[2], "minor": n[3], "access": "rw"} for n in want_nodes]
    assert [(m["source"], m["destination"], m["options"]) for m in out["mounts"]] == \
        [(m["hostPath"], m["containerPath"], m["options"]) for m in common["mounts"]]
    assert all(m["type"] == "bind" for m in out["mounts"])
    # One process per start. The spec's hook carries every GPU's /dev/dri/by-path links as --link-if-present (the
    # runtime picks the devices later); the shim knows the device, so its hook makes that device's links outright.
    assert "hooks" not in device0
    (cdi_hook,) = common["hooks"]
    (shim_hook,) = out["hooks"]["createContainer"]
    assert {k: v for k, v in shim_hook.items() if k != "args"} == {k: v for k, v in cdi_hook.items()
                                                                   if k not in ("args", "hookName")}

    def pairs(args: list[str], option: str) -> list[str]:
        return [v for k, v in zip(args, args[1:]) if k == option]

    def rest(args: list[str]) -> list[str]:
        drop = {i for i, a in enumerate(args) if a in ("--link", "--link-if-present")}
        return [a for i, a in enumerate(args) if i not in drop and i - 1 not in drop]

    device_links = [f"{s.target}::{s.link}" for s in edits_for("0").symlinks if s.link.startswith("/dev/")]
    assert device_links and set(device_links) <= set(pairs(cdi_hook["args"], "--link-if-present"))
    assert sorted(pairs(shim_hook["args"], "--link")) == sorted(pairs(cdi_hook["args"], "--link") + device_links)
    assert not pairs(shim_hook["args"], "--link-if-present")
    assert rest(shim_hook["args"]) == rest(cdi_hook["args"])
    assert out["process"]["env"] == ["A=1"]  # no env of its own: the request stays visible to the user


def test_rewrite_is_idempotent() -> None:
    edits = edits_for("all")
    once = shim.apply_edits({"linux": {}}, edits, HOOK)
    twice = shim.apply_edits(copy.deepcopy(once), edits, HOOK)
    assert twice == once


def test_existing_device_entry_is_kept() -> None:
    mine = {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o600}
    out = shim.apply_edits({"linux": {"devices": [dict(mine)]}}, edits_for("0", "utility"), HOOK)
    assert [d for d in out["linux"]["devices"] if d["path"] == "/dev/nvidia0"] == [mine]


def test_no_hooks_without_links_or_libraries() -> None:
    edits = plan(synthetic_inventory(), Selection(capabilities=frozenset()))
    assert render_hooks(edits, HOOK) == []
    assert "hooks" not in shim.apply_edits({}, edits, HOOK)


def test_gpuhook_hook_detection() -> None:
    assert shim.has_gpuhook_hook({"hooks": {"prestart": [{"path": "/usr/local/bin/gpuhook-hook"}]}})
    assert shim.has_gpuhook_hook({"hooks": {"createRuntime": [{"path": "/x/gpuhook", "args": ["gpuhook", "hook"]}]}})
    assert not shim.has_gpuhook_hook({"hooks": {"createContainer": [{"path": "/x/gpuhook",
                                                                     "args": ["gpuhook", "cdi-hook"]}]}})
    assert not shim.has_gpuhook_hook({})


def test_real_runtime_never_the_shim_itself(tmp_path: Path) -> None:
    other = tmp_path / "bin" / "runc"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    assert shim.real_runtime({"PATH": str(other.parent)}) == str(other)
    assert shim.real_runtime({"GPUHOOK_RUNTIME": "/opt/crun"}) == "/opt/crun"
    with pytest.raises(shim.ShimError, match="itself"):
        shim.real_runtime({"GPUHOOK_RUNTIME": SHIM})
    with pytest.raises(shim.ShimError, match="cannot find the runtime 'nope'"):
        shim.real_runtime({"GPUHOOK_RUNTIME": "nope", "PATH": str(tmp_path)})


# --- the command, with a recording stand-in runtime ------------------------------------------------------------


def recorder(tmp: Path) -> Path:
    """A runtime that records its argv and the bundle's config.json hash (what the real one would read)."""
    script = tmp / "fake-runc"
    script.write_text(
        "#!/bin/sh\n"
        f"printf '%s\\n' \"$@\" > {tmp}/argv\n"
        f"sha256sum {tmp}/bundle/config.json > {tmp}/seen 2>/dev/null\n"
        "exit 7\n"
    )
    script.chmod(0o755)
    return script


def hook_config(tmp: Path, root: Path | None = None, **extra: Any) -> Path:
    lines = [f'log-file = "{tmp}/gpuhook.log"', f'inventory-cache = "{tmp}/inventory.json"']
    if root is not None:
        lines += [f'driver-root = "{root}"', f'proc-root = "{root}/proc"']
    lines += [f"{k.replace('_', '-')} = {json.dumps(v)}" for k, v in extra.items()]
    path = tmp / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_shim(tmp: Path, args: list[str], config: Path, runtime: str | None = None,
             prefix: list[str] | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUHOOK_CONFIG=str(config), GPUHOOK_RUNTIME=runtime or str(recorder(tmp)))
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([*(prefix or []), SHIM, *args], text=True, env=env, timeout=60, check=False, **kw)


def bundle_with(tmp: Path, env: list[str]) -> Path:
    bundle = tmp / "bundle"
    bundle.mkdir(exist_ok=True)
    config = {"ociVersion": "1.0.2", "process": {"args": ["true"], "env": env}, "root": {"path": "rootfs"},
              "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}}}
    (bundle / "config.json").write_text(json.dumps(config, indent=4))
    return bundle


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("args", [["state", "x"], ["--root", "/r", "delete", "-f", "x"], ["--version"],
                                  ["create", "--help"]])
def test_other_subcommands_pass_straight_through(tmp_path: Path, args: list[str]) -> None:
    result = run_shim(tmp_path, args, hook_config(tmp_path))
    assert result.returncode == 7, result.stderr  # the runtime's own exit status
    assert (tmp_path / "argv").read_text().splitlines() == args


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="]])
def test_no_gpu_request_leaves_config_json_byte_for_byte(tmp_path: Path, env: list[str]) -> None:
    bundle = bundle_with(tmp_path, env)
    before = digest(bundle / "config.json")
    args = ["--root", "/r", "create", "--bundle", str(bundle), "c1"]
    result = run_shim(tmp_path, args, hook_config(tmp_path))
    assert result.returncode == 7, result.stderr
    assert digest(bundle / "config.json") == before
    assert (tmp_path / "argv").read_text().splitlines() == args
    assert "c1 runtime skip request=" in (tmp_path / "gpuhook.log").read_text()


def test_bundle_is_the_cwd_by_default(tmp_path: Path) -> None:
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=void"])
    result = run_shim(tmp_path, ["create", "c1"], hook_config(tmp_path), cwd=bundle)
    assert result.returncode == 7, result.stderr
    assert "c1 runtime skip request=void" in (tmp_path / "gpuhook.log").read_text()


def test_unreadable_bundle_is_one_line_and_no_exec(tmp_path: Path) -> None:
    result = run_shim(tmp_path, ["create", "--bundle", str(tmp_path / "nowhere"), "c1"], hook_config(tmp_path))
    assert result.returncode == 1
    assert result.stderr.startswith("gpuhook-runtime: cannot read ") and result.stderr.count("\n") == 1
    assert not (tmp_path / "argv").exists()


@pytest.mark.parametrize(("env", "message"), [
    (["NVIDIA_VISIBLE_DEVICES=7"], "unknown device '7'"),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"], "unsatisfied requirement 'cuda>=99.0'"),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=warp"], "unknown driver capability 'warp'"),
])  # fmt: skip
def test_refused_request_changes_nothing(tmp_path: Path, fake_driver: Any, env: list[str], message: str) -> None:
    bundle = bundle_with(tmp_path, env)
    before = digest(bundle / "config.json")
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], hook_config(tmp_path, fake_driver.root))
    assert result.returncode == 1
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert digest(bundle / "config.json") == before
    assert not (tmp_path / "argv").exists()
    assert sorted(p.name for p in bundle.iterdir()) == ["config.json"]  # no temp file left behind
    logged = (tmp_path / "gpuhook.log").read_text()  # one line per container, a refusal too
    assert logged.count("\n") == 1 and f"c1 runtime error: {message}" in logged


@pytest.mark.parametrize(("env", "annotations", "names"), [
    ([f"NVIDIA_VISIBLE_DEVICES={','.join(str(i) for i in range(150_000))}"], {}, "NVIDIA_VISIBLE_DEVICES is "),
    ([], {"cdi.k8s.io/x": ",".join(f"nvidia.com/gpu={i}" for i in range(200_000))}, "annotation 'cdi.k8s.io/x' "),
], ids=["env-150k", "annotation-200k"])  # fmt: skip
def test_huge_request_is_refused_in_one_bounded_line(tmp_path: Path, fake_driver: Any, env: list[str],
                                                     annotations: dict[str, str], names: str) -> None:
    """The request is bounded before any per-item work; the refusal names the variable, clipped."""
    bundle = bundle_with(tmp_path, env)
    config = json.loads((bundle / "config.json").read_text())
    config["annotations"] = annotations
    (bundle / "config.json").write_text(json.dumps(config))
    before = digest(bundle / "config.json")
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], hook_config(tmp_path, fake_driver.root))
    assert result.returncode == 1
    assert result.stderr.startswith(f"gpuhook-runtime: {names}"), result.stderr[:500]
    assert result.stderr.count("\n") == 1 and len(result.stderr) < 600
    assert digest(bundle / "config.json") == before
    assert not (tmp_path / "argv").exists()


@pytest.mark.parametrize(("driver", "cuda", "starts"), [("525.147.05", "12.0", True), ("510.108.03", "11.6", False)])
def test_published_cuda_image_through_the_shim(tmp_path: Path, fake_driver_factory: Any, driver: str, cuda: str,
                                               starts: bool) -> None:
    """The CUDA 12.2.2 image's NVIDIA_REQUIRE_CUDA decides at the shim's door as at the hook's (forward
    compatibility on a 525 driver; refused on 510), its GPU asked for by a CDI annotation without a kind."""
    import yaml

    images = yaml.safe_load((Path(__file__).parent / "data" / "cuda_images.yaml").read_text())["images"]
    image = next(i for i in images if i["image"] == "nvidia/cuda:12.2.2-base-ubuntu22.04")
    fake = fake_driver_factory(1, driver_version=driver, cuda_version=cuda)
    bundle = bundle_with(tmp_path, [f"{k}={v}" for k, v in image["env"].items()])
    config = json.loads((bundle / "config.json").read_text())
    config["annotations"] = {"cdi.k8s.io/gpuhook_gpu": "0"}
    (bundle / "config.json").write_text(json.dumps(config))
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], hook_config(tmp_path, fake.root))
    if starts:
        assert result.returncode == 7, result.stderr  # the real runtime was exec'd
        paths = [d["path"] for d in json.loads((bundle / "config.json").read_text())["linux"]["devices"]]
        assert "/dev/nvidia0" in paths
    else:
        assert result.returncode == 1 and result.stderr.count("\n") == 1
        assert f"no term holds with cuda {cuda}, driver {driver}" in result.stderr


@pytest.mark.parametrize("hook", [
    {"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["nvidia-container-runtime-hook", "prestart"]},
    {"path": "/usr/local/bin/gpuhook-hook", "args": ["gpuhook-hook", "prestart"]},
    {"path": "/opt/x/hook", "args": ["nvidia-container-runtime-hook", "prestart"]},  # by args[0]
])  # fmt: skip
def test_one_injection_beside_a_gpu_prestart_hook(tmp_path: Path, fake_driver: Any, hook: dict[str, Any]) -> None:
    """`docker run --runtime gpuhook --gpus all`: Docker adds its --gpus hook (NVIDIA's name) to config.json; the
    shim must not inject a second time."""
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])
    config = json.loads((bundle / "config.json").read_text())
    config["hooks"] = {"prestart": [hook]}
    (bundle / "config.json").write_text(json.dumps(config))
    before = digest(bundle / "config.json")
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], hook_config(tmp_path, fake_driver.root))
    assert result.returncode == 7, result.stderr
    assert digest(bundle / "config.json") == before
    who = "gpuhook's prestart hook" if "gpuhook" in hook["path"] else \
        "NVIDIA's prestart hook (nvidia-container-runtime-hook)"
    assert f"c1 runtime skip: {who} gives this container its GPUs" in (tmp_path / "gpuhook.log").read_text()


@pytest.mark.parametrize(("hooks", "words"), [
    ("prestart", "'hooks' is not an object"),
    ({"prestart": {"path": "/x"}}, "'hooks.prestart' is not a list"),
])  # fmt: skip
def test_malformed_hooks_are_one_line(tmp_path: Path, fake_driver: Any, hooks: Any, words: str) -> None:
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    config = json.loads((bundle / "config.json").read_text())
    config["hooks"] = hooks
    (bundle / "config.json").write_text(json.dumps(config))
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], hook_config(tmp_path, fake_driver.root))
    assert result.returncode == 1 and result.stderr == f"gpuhook-runtime: config.json: {words}\n"


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_errors_reach_the_runtime_log(tmp_path: Path, fake_driver: Any, log_format: str) -> None:
    """Docker and containerd read a failed create's reason from runc's --log file, in its --log-format: the
    shim's refusal must be there, or `docker run --runtime gpuhook` says "unable to retrieve OCI runtime error"."""
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=7"])
    log = tmp_path / "log.json"
    args = ["--root", "/run/x", "--log", str(log), "--log-format", log_format, "create", "--bundle", str(bundle), "c1"]
    result = run_shim(tmp_path, args, hook_config(tmp_path, fake_driver.root))
    assert result.returncode == 1
    line = log.read_text().splitlines()[-1]
    if log_format == "json":
        entry = json.loads(line)
        assert entry["level"] == "error" and entry["msg"].startswith("gpuhook-runtime: unknown device '7'")
        assert entry["time"].endswith("Z")
    else:
        assert line.startswith('time="') and 'level=error msg="gpuhook-runtime: unknown device \'7\'' in line
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # never written into anything but a regular file (and never blocks on a FIFO)
    args[args.index(str(log))] = str(fifo)
    assert run_shim(tmp_path, args, hook_config(tmp_path, fake_driver.root)).returncode == 1


def test_gpu_request_rewrites_then_execs_with_the_same_argv(tmp_path: Path, fake_driver: Any) -> None:
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=1"])
    mode = 0o600
    (bundle / "config.json").chmod(mode)
    args = ["--log", "/x", "create", "--bundle", str(bundle), "--pid-file", "/p", "c1"]
    result = run_shim(tmp_path, args, hook_config(tmp_path, fake_driver.root))
    assert result.returncode == 7, result.stderr
    assert (tmp_path / "argv").read_text().splitlines() == args
    assert (tmp_path / "seen").read_text().split()[0] == digest(bundle / "config.json")  # written before the exec
    assert (bundle / "config.json").stat().st_mode & 0o777 == mode
    config = json.loads((bundle / "config.json").read_text())
    paths = [d["path"] for d in config["linux"]["devices"]]
    assert "/dev/nvidia1" in paths and "/dev/nvidia0" not in paths
    assert config["hooks"]["createContainer"][0]["args"][1:3] == ["cdi-hook", "update-container"]
    assert " runtime inject devices=" in (tmp_path / "gpuhook.log").read_text()


def test_bundle_with_gpuhook_prestart_hook_is_left_to_the_hook(tmp_path: Path, fake_driver: Any) -> None:
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    config = json.loads((bundle / "config.json").read_text())
    config["hooks"] = {"prestart": [{"path": "/usr/local/bin/gpuhook-hook", "args": ["gpuhook-hook", "prestart"]}]}
    (bundle / "config.json").write_text(json.dumps(config))
    before = digest(bundle / "config.json")
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], hook_config(tmp_path, fake_driver.root))
    assert result.returncode == 7, result.stderr
    assert digest(bundle / "config.json") == before


MARKER = "GPUHOOK_CDI_DEVICES=nvidia.com/gpu=1"  # what the device plugin's Allocate sets beside the variable


def test_a_runtime_that_ignored_cdi_devices_is_recorded_for_the_plugin(tmp_path: Path, fake_driver: Any) -> None:
    from gpuhook.fileio.secret import ensure_secret
    from gpuhook.model import cdiignored
    from gpuhook.model.contract import PLUGIN_KEY

    state = tmp_path / "state"
    state.mkdir()  # the plugin's, where its key is made
    sealed = "GPUHOOK_CDI_DEVICES=" + cdiignored.seal(ensure_secret(str(state / PLUGIN_KEY)), "nvidia.com/gpu=1")
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=1", sealed])  # containerd 1.6: the spec not applied
    config = hook_config(tmp_path, fake_driver.root, state_dir=str(state))
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], config)
    assert result.returncode == 7, result.stderr
    paths = [d["path"] for d in json.loads((bundle / "config.json").read_text())["linux"]["devices"]]
    assert "/dev/nvidia1" in paths  # the container still gets its GPU
    rec = cdiignored.parse((state / "cdi-ignored").read_bytes())
    assert rec is not None and (rec.container, rec.devices) == ("c1", "nvidia.com/gpu=1")
    log = (tmp_path / "gpuhook.log").read_text()
    assert " runtime inject devices=" in log and "(runtime ignored CDI devices nvidia.com/gpu=1: recorded in " in log


def test_cdi_devices_the_runtime_applied_leave_no_record(tmp_path: Path, fake_driver: Any) -> None:
    state = tmp_path / "state"
    # a CDI runtime: the spec's NVIDIA_VISIBLE_DEVICES=void replaced Allocate's
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=void", MARKER])
    before = digest(bundle / "config.json")
    config = hook_config(tmp_path, fake_driver.root, state_dir=str(state))
    assert run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], config).returncode == 7
    assert digest(bundle / "config.json") == before and not state.exists()
    assert " runtime skip request=void" in (tmp_path / "gpuhook.log").read_text()


def test_an_unwritable_record_never_fails_the_start(tmp_path: Path, fake_driver: Any) -> None:
    (tmp_path / "state").write_text("a file, not a directory\n")
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=1", MARKER])
    config = hook_config(tmp_path, fake_driver.root, state_dir=str(tmp_path / "state"))
    result = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], config)
    assert result.returncode == 7, result.stderr  # the real runtime ran
    assert "(runtime ignored CDI devices nvidia.com/gpu=1; no record: " in (tmp_path / "gpuhook.log").read_text()


# --- end to end with runc -------------------------------------------------------------------------------------

PROBE = (
    "ls /dev | grep nvidia | sort | tr '\\n' ' '; echo; "
    "for n in /dev/nvidia[0-9]*; do stat -c 'NODE %n %t:%T' $n; cat $n 2>&1 | head -1; done; "
    "/usr/bin/gpuprobe; true"
)


@pytest.fixture()
def e2e(tmp_path: Path) -> Path:
    need_root()
    need_tool("runc")
    need_busybox()
    assert Path(SHIM).exists(), "gpuhook-runtime is not installed next to the test interpreter"
    return tmp_path


def check_probe(stdout: str) -> None:
    lines = stdout.splitlines()
    assert lines[0].split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"], stdout
    assert "NODE /dev/nvidia1 c3:1" in stdout
    assert "No such device or address" in stdout and "Operation not permitted" not in stdout, stdout
    assert "cuInit=0 count=1 version=12040" in stdout


def test_runc_run_through_the_shim_cgroup_v1(e2e: Path, fake_driver: Any) -> None:
    rootfs = glibc_rootfs(e2e / "bundle", probe_cache=e2e.parent / "probe")
    bundle = make_bundle(e2e / "bundle", rootfs, ["sh", "-c", PROBE], env=["NVIDIA_VISIBLE_DEVICES=1"])
    cid = unique_id("shim")
    try:
        result = run_shim(e2e, ["run", "--bundle", str(bundle), cid], hook_config(e2e, fake_driver.root),
                          runtime="runc")
    finally:
        runc_delete(cid)
    assert result.returncode == 0, result.stderr
    check_probe(result.stdout)
    entries = {e.key for e in _native.read_ldcache(str(rootfs / "etc/ld.so.cache"))}
    assert {"libcuda.so.1", "libnvidia-ml.so.1"} <= entries


def test_runc_create_start_through_the_shim_cgroup_v2(e2e: Path, fake_driver: Any) -> None:
    """`create` then `start` (as containerd does), inside a mount namespace where runc sees cgroup v2 and builds
    its eBPF device filter from config.json: the shim's allow rules make the node usable (ENXIO, not EPERM)."""
    need_tool("unshare")
    need_tool("nsenter")
    rootfs = glibc_rootfs(e2e / "bundle", probe_cache=e2e.parent / "probe")
    bundle = make_bundle(e2e / "bundle", rootfs, ["sh", "-c", PROBE], env=["NVIDIA_VISIBLE_DEVICES=1"])
    cid = unique_id("shim2")
    config = hook_config(e2e, fake_driver.root)
    with cgroup2_namespace() as prefix:
        check = subprocess.run([*prefix, "stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True,
                               check=True)
        assert check.stdout.strip() == "cgroup2fs"
        try:
            with open(e2e / "out.log", "wb") as out:
                created = run_shim(e2e, ["create", "--bundle", str(bundle), cid], config, runtime="runc",
                                   prefix=prefix, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            assert created.returncode == 0, (e2e / "out.log").read_text()
            started = run_shim(e2e, ["start", cid], config, runtime="runc", prefix=prefix)
            assert started.returncode == 0, started.stderr
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = subprocess.run(runc_cmd("state", cid, prefix=prefix), capture_output=True, text=True)
                if state.returncode != 0 or json.loads(state.stdout)["status"] == "stopped":
                    break
                time.sleep(0.05)
        finally:
            runc_delete(cid, prefix=prefix)
    check_probe((e2e / "out.log").read_text())


# --- the shim's planning through gpuhook service -----------------------------------------------------

# The shim's main with its exec replaced by a line saying whether the planning modules were loaded here (the
# create was prepared in-process) or not (the service prepared it).
SHIM_CLIENT = ("import os, sys; import gpuhook.shim.runtime as r; "
               "os.execv = lambda path, argv: (print('IN-PROCESS' if 'gpuhook.hook.plan' in sys.modules else "
               "'SERVED', flush=True), os._exit(0)); sys.exit(r.main(sys.argv[1:]))")


def test_the_service_prepares_a_create_as_the_shim_does(tmp_path: Path, fake_driver: Any) -> None:
    """With `gpuhook service` running, the shim asks it to plan a create. config.json and the
    log line are what the in-process shim writes; an error is the shim's own line, and the create does not go
    ahead; with nothing listening the shim plans itself."""
    need_root()
    from support.service import start

    config = hook_config(tmp_path, fake_driver.root)
    sock = tmp_path / "run" / "service.sock"
    running = start(sock, config, tmp_path / "service.err")
    results, texts = {}, {}
    try:
        for name, socket_path in (("local", tmp_path / "none.sock"), ("served", sock)):
            (tmp_path / name).mkdir()
            bundle = bundle_with(tmp_path / name, ["NVIDIA_VISIBLE_DEVICES=1"])
            env = dict(os.environ, GPUHOOK_CONFIG=str(config), GPUHOOK_RUNTIME="/bin/true",
                       GPUHOOK_SERVICE_SOCKET=str(socket_path))
            results[name] = subprocess.run([sys.executable, "-c", SHIM_CLIENT, "create", "--bundle", str(bundle),
                                            f"c-{name}"], env=env, capture_output=True, text=True, timeout=60)
            texts[name] = (bundle / "config.json").read_text()
        (tmp_path / "refused").mkdir()
        refused = bundle_with(tmp_path / "refused", ["NVIDIA_VISIBLE_DEVICES=7"])
        before = digest(refused / "config.json")
        env = dict(os.environ, GPUHOOK_CONFIG=str(config), GPUHOOK_RUNTIME="/bin/true",
                   GPUHOOK_SERVICE_SOCKET=str(sock))
        bad = subprocess.run([sys.executable, "-c", SHIM_CLIENT, "create", "--bundle", str(refused), "c-bad"], env=env,
                             capture_output=True, text=True, timeout=60)
    finally:
        running.stop()
    assert results["local"].stdout == "IN-PROCESS\n" and results["served"].stdout == "SERVED\n", results
    assert texts["served"] == texts["local"] and '"/dev/nvidia1"' in texts["served"]
    log = (tmp_path / "gpuhook.log").read_text().splitlines()
    lines = {cid: line.split(" ", 1)[1] for line in log for cid in ("c-local", "c-served") if f" {cid} " in line}
    assert lines["c-served"].replace("c-served", "c-local") == lines["c-local"]
    assert " runtime inject devices=" in lines["c-served"]
    assert bad.returncode == 1 and bad.stdout == "" and bad.stderr.startswith("gpuhook-runtime: "), bad
    assert "7" in bad.stderr and digest(refused / "config.json") == before


@pytest.mark.parametrize("broken", ["driver-root = \n", "no-such-key = true\n"], ids=["invalid-toml", "unknown-key"])
def test_a_broken_config_fails_only_gpu_containers(tmp_path: Path, broken: str) -> None:
    """A broken config never stops a container that asks for no GPU (the runtime runs it as it is); a GPU
    container fails naming the config; neither writes the host's default log (the config was named)."""
    config = tmp_path / "broken.toml"
    config.write_text(broken)
    bundle = bundle_with(tmp_path, [])
    before = digest(bundle / "config.json")
    plain = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c1"], config)
    assert plain.returncode == 7 and plain.stderr == "", plain.stderr
    assert digest(bundle / "config.json") == before
    bundle = bundle_with(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])
    gpu = run_shim(tmp_path, ["create", "--bundle", str(bundle), "c2"], config)
    assert gpu.returncode == 1 and gpu.stderr.startswith(f"gpuhook-runtime: {config}: "), gpu.stderr
