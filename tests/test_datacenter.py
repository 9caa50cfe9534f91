"""Datacenter devices without starting a container: NVIDIA_IMEX_CHANNELS and the gated variables as parsed,
resolved and planned; what discovery finds of them; the CDI kinds `generate-cdi --mode` writes; `info`, `doctor`
and the fake driver's options. (tests/test_datacenter_e2e.py starts containers with them.)"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.fakefix import FAKE_DATACENTER
from test_doctor import explain

from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.kinds import build_gated_spec, build_imex_spec
from gpuhook.cdi.validate import validate_spec
from gpuhook.discover import Roots, discover
from gpuhook.discover.fingerprint import fingerprint
from gpuhook.errors import RequestError
from gpuhook.fakedriver import Datacenter, FakeDriver
from gpuhook.model import catalogue
from gpuhook.model.contract import has_gpu_signal
from gpuhook.model.edits import plan
from gpuhook.model.inventory import Inventory
from gpuhook.model.report import format_inventory
from gpuhook.model.request import Policy, parse_request
from gpuhook.model.selection import resolve

GPU = "NVIDIA_VISIBLE_DEVICES=0"
IMEX_DIR = catalogue.IMEX_CHANNEL_DIR
DATACENTER_PREFIXES = (IMEX_DIR, "/dev/nvidia-nvswitch", "/dev/nvidia-fs", "/dev/infiniband/", "/dev/gdrdrv")


def inventory(fake: FakeDriver) -> Inventory:
    return discover(Roots.make(str(fake.root), None, str(fake.root / "proc")), method="procfs")


def datacenter_paths(inv: Inventory, env: list[str], **kw: Any) -> list[str]:
    edits = plan(inv, resolve(inv, parse_request(env, **kw)))
    return [n.path for n in edits.device_nodes if n.path.startswith(DATACENTER_PREFIXES)]


# --- the request ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "channels"), [
    ("3", ("3",)),
    ("channel3", ("3",)),
    (" 3 , channel3,0", ("3", "0")),  # trimmed, duplicates collapse
    ("007", ("7",)),
    ("1048575", ("1048575",)),
    ("0,all", ("all",)),  # all wins wherever it stands
    ("", ()),
    (" , ", ()),
])  # fmt: skip
def test_imex_channels_parse(value: str, channels: tuple[str, ...]) -> None:
    assert parse_request([GPU, f"NVIDIA_IMEX_CHANNELS={value}"]).imex_channels == channels


@pytest.mark.parametrize("value", ["1048576", "-1", "x", "channel", "channelx", "3.0", "²", "none", "void",
                                   "9" * 100_000])
def test_invalid_imex_channel_fails_with_one_bounded_line(value: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request([GPU, f"NVIDIA_IMEX_CHANNELS=0,{value}"])
    message = str(exc.value)
    assert message.startswith("invalid IMEX channel ") and "NVIDIA_IMEX_CHANNELS" in message
    assert "\n" not in message and len(message) < 400


def test_imex_volume_mounts_win_when_accepted() -> None:
    def mount(dest: str, source: str = "/dev/null") -> dict[str, object]:
        return {"destination": f"/var/run/nvidia-container-devices/imex/{dest}", "source": source}

    mounts = [mount("3"), mount("channel5"), mount("9", source="/etc/passwd")]  # not /dev/null: no request
    env = [GPU, "NVIDIA_IMEX_CHANNELS=0"]
    assert parse_request(env, mounts, policy=Policy(accept_volume_mounts=True)).imex_channels == ("3", "5")
    assert parse_request(env, mounts, policy=Policy(accept_volume_mounts=False)).imex_channels == ("0",)
    # an imex/ mount is no GPU request of its own
    assert parse_request([GPU], mounts, policy=Policy(accept_volume_mounts=True)).devices == ("0",)


def test_imex_env_of_unprivileged_container_follows_the_policy() -> None:
    policy = Policy(accept_envvar_unprivileged=False, accept_volume_mounts=True)  # mounts are off by default
    mounts = [{"destination": "/var/run/nvidia-container-devices/0", "source": "/dev/null"}]
    request = parse_request([GPU, "NVIDIA_IMEX_CHANNELS=3"], mounts, policy=policy)
    assert request.devices == ("0",) and request.imex_channels == ()
    assert any("NVIDIA_IMEX_CHANNELS ignored" in note for note in request.notes)
    assert parse_request([GPU, "NVIDIA_IMEX_CHANNELS=3"], privileged=True, policy=policy).imex_channels == ("3",)


def test_gated_variables_must_be_exactly_enabled() -> None:
    env = [GPU, "NVIDIA_NVSWITCH=enabled", "NVIDIA_GDS=Enabled", "NVIDIA_MOFED=true", "NVIDIA_GDRCOPY=enabled "]
    assert parse_request(env).gated == ("nvswitch",)
    every = [GPU, *(f"{v}=enabled" for v in ("NVIDIA_GDRCOPY", "NVIDIA_MOFED", "NVIDIA_GDS", "NVIDIA_NVSWITCH"))]
    assert parse_request(every).gated == ("nvswitch", "gds", "mofed", "gdrcopy")


@pytest.mark.parametrize("gpu", [[], ["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="]])
def test_datacenter_variables_alone_are_no_gpu_request(gpu: list[str]) -> None:
    """As NVIDIA's hook (and its feature-gated modifier): without a GPU request nothing is added."""
    env = [*gpu, "NVIDIA_IMEX_CHANNELS=3", "NVIDIA_NVSWITCH=enabled", "NVIDIA_GDS=enabled"]
    request = parse_request(env)
    assert not request.wants_gpu_setup
    assert request.imex_channels == () and request.gated == ()
    if not gpu:  # the hook's early skip never loads the parser for these
        assert not has_gpu_signal(env, [], {})


def test_none_still_gets_datacenter_devices(fake_driver_datacenter: FakeDriver) -> None:
    inv = inventory(fake_driver_datacenter)
    env = ["NVIDIA_VISIBLE_DEVICES=none", "NVIDIA_IMEX_CHANNELS=3", "NVIDIA_GDRCOPY=enabled"]
    assert datacenter_paths(inv, env) == [f"{IMEX_DIR}/channel3", "/dev/gdrdrv"]


# --- discovery, selection and planning -----------------------------------------------------------------------


def test_discovery_finds_the_fake_datacenter(fake_driver_datacenter: FakeDriver) -> None:
    inv = inventory(fake_driver_datacenter)
    assert inv.imex_major == 509
    assert [(n.path, n.major, n.minor) for n in inv.imex_channels] == [
        (f"{IMEX_DIR}/channel0", 509, 0), (f"{IMEX_DIR}/channel3", 509, 3)]
    assert [n.path for n in inv.gated_nodes["nvswitch"]] == [
        "/dev/nvidia-nvswitchctl", "/dev/nvidia-nvswitch0", "/dev/nvidia-nvswitch1"]
    assert [n.path for n in inv.gated_nodes["gds"]] == [f"/dev/nvidia-fs{i}" for i in range(16)]  # by minor
    assert [(n.path, n.major, n.minor) for n in inv.gated_nodes["mofed"]] == [
        ("/dev/infiniband/uverbs0", 231, 192), ("/dev/infiniband/rdma_cm", 10, 58)]
    assert [n.path for n in inv.gated_nodes["gdrcopy"]] == ["/dev/gdrdrv"]
    assert [(f.path, f.kind) for f in inv.gated_mounts["gds"]] == [("/run/udev", "dir"), ("/etc/cufile.json", "config")]
    assert Inventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv
    imex = [f.path for f in inv.files if f.kind == "bin" and "imex" in f.path]
    assert imex == ["/usr/bin/nvidia-imex", "/usr/bin/nvidia-imex-ctl"]


def test_plain_fake_has_the_imex_major_but_nothing_else(fake_driver: FakeDriver) -> None:
    inv = inventory(fake_driver)
    assert inv.imex_major == 509 and inv.imex_channels == []
    assert inv.gated_nodes == {} and inv.gated_mounts == {}
    assert datacenter_paths(inv, [GPU, "NVIDIA_NVSWITCH=enabled", "NVIDIA_GDS=enabled", "NVIDIA_IMEX_CHANNELS=all"]) \
        == []  # nothing there: nothing added, as NVIDIA's discoverers do


def test_plan_adds_exactly_what_was_asked(fake_driver_datacenter: FakeDriver) -> None:
    inv = inventory(fake_driver_datacenter)
    assert datacenter_paths(inv, [GPU]) == []
    assert datacenter_paths(inv, [GPU, "NVIDIA_IMEX_CHANNELS=3"]) == [f"{IMEX_DIR}/channel3"]
    assert datacenter_paths(inv, [GPU, "NVIDIA_IMEX_CHANNELS=all"]) == [f"{IMEX_DIR}/channel0", f"{IMEX_DIR}/channel3"]
    assert datacenter_paths(inv, [GPU, "NVIDIA_NVSWITCH=enabled"]) == [
        "/dev/nvidia-nvswitchctl", "/dev/nvidia-nvswitch0", "/dev/nvidia-nvswitch1"]
    edits = plan(inv, resolve(inv, parse_request([GPU, "NVIDIA_GDS=enabled"])))
    gds = {m.container_path: m for m in edits.mounts if m.container_path in ("/run/udev", "/etc/cufile.json")}
    assert sorted(gds) == ["/etc/cufile.json", "/run/udev"] and all(m.read_only for m in gds.values())
    plain = plan(inv, resolve(inv, parse_request([GPU])))
    assert not any(m.container_path in ("/run/udev", "/etc/cufile.json") for m in plain.mounts)


def test_missing_channel_fails_naming_it(fake_driver_datacenter: FakeDriver) -> None:
    inv = inventory(fake_driver_datacenter)
    with pytest.raises(RequestError, match=r"^IMEX channel 1 requested but /dev/nvidia-caps-imex-channels/channel1 "
                                           r"does not exist on this host \(no such channel node\)$"):
        resolve(inv, parse_request([GPU, "NVIDIA_IMEX_CHANNELS=0,1"]))
    inv.imex_major, inv.imex_channels = None, []
    with pytest.raises(RequestError, match=r"the driver has no IMEX support"):
        resolve(inv, parse_request([GPU, "NVIDIA_IMEX_CHANNELS=0"]))


def test_fingerprint_moves_when_channels_or_rdma_nodes_appear(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    roots = Roots.make(str(tmp_path), None, str(tmp_path / "proc"))
    (tmp_path / "dev/nvidia-caps-imex-channels").mkdir(parents=True)
    before = fingerprint(roots)
    os.mknod(tmp_path / "dev/nvidia-caps-imex-channels/channel2", stat.S_IFCHR | 0o666, os.makedev(509, 2))
    after_channel = fingerprint(roots)
    (tmp_path / "dev/infiniband").mkdir()
    os.mknod(tmp_path / "dev/infiniband/uverbs0", stat.S_IFCHR | 0o666, os.makedev(231, 192))
    assert len({before, after_channel, fingerprint(roots)}) == 3


# --- CDI -----------------------------------------------------------------------------------------------------


def test_imex_spec(fake_driver_datacenter: FakeDriver) -> None:
    spec = build_imex_spec(inventory(fake_driver_datacenter))
    assert spec["kind"] == "nvidia.com/imex-channel"
    assert spec["containerEdits"] == {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}  # NVIDIA lib-imex_test.go TestImexMode
    assert [d["name"] for d in spec["devices"]] == ["0", "3", "all"]
    three = spec["devices"][1]["containerEdits"]
    host = f"{fake_driver_datacenter.root}/dev/nvidia-caps-imex-channels/channel3"
    assert three == {"deviceNodes": [{
        "path": f"{IMEX_DIR}/channel3", "hostPath": host, "type": "c", "major": 509, "minor": 3, "fileMode": 0o666,
        "permissions": "rw"}]}
    assert validate_spec(spec, "imex", schema=True) == []


@pytest.mark.parametrize(("mode", "count"), [("nvswitch", 3), ("gds", 16), ("mofed", 2), ("gdrcopy", 1)])
def test_gated_specs(fake_driver_datacenter: FakeDriver, mode: str, count: int) -> None:
    spec = build_gated_spec(inventory(fake_driver_datacenter), mode)
    assert spec["kind"] == f"nvidia.com/{mode}"
    assert [d["name"] for d in spec["devices"]] == ["all"]
    edits = spec["devices"][0]["containerEdits"]
    assert len(edits["deviceNodes"]) == count
    assert [m["containerPath"] for m in edits.get("mounts", [])] == (
        ["/run/udev", "/etc/cufile.json"] if mode == "gds" else [])
    assert validate_spec(spec, mode, schema=True) == []


def test_kinds_without_nodes_refuse(fake_driver: FakeDriver) -> None:
    inv = inventory(fake_driver)
    with pytest.raises(CdiError, match="no IMEX channels under .* \\(no channel node\\)"):
        build_imex_spec(inv)
    with pytest.raises(CdiError, match="no nvswitch device nodes"):
        build_gated_spec(inv, "nvswitch")


def test_generate_cdi_mode_and_class(fake_driver_datacenter: FakeDriver, tmp_path: Path) -> None:
    root = fake_driver_datacenter.root

    def generate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpuhook.cli", "generate-cdi", "--driver-root", str(root),
                               "--proc-root", str(root / "proc"), "--format", "json", *args],
                              capture_output=True, text=True, check=False)

    imex = generate("--mode", "imex")
    assert imex.returncode == 0, imex.stderr
    assert json.loads(imex.stdout)["kind"] == "nvidia.com/imex-channel"
    named = generate("--mode", "gdrcopy", "--vendor", "example.com", "--class", "gdr")
    assert json.loads(named.stdout)["kind"] == "example.com/gdr"
    assert generate("--mode", "warp").returncode == 2


# --- info, doctor, fake driver -------------------------------------------------------------------------------


def test_info_lists_the_datacenter_devices(fake_driver_datacenter: FakeDriver) -> None:
    text = format_inventory(inventory(fake_driver_datacenter))
    assert "  IMEX channels (NVIDIA_IMEX_CHANNELS, major 509): channel0, channel3" in text
    assert "  nvswitch (NVIDIA_NVSWITCH=enabled): /dev/nvidia-nvswitchctl (c 236:255), /dev/nvidia-nvswitch0" in text
    assert "; mounts /run/udev, /etc/cufile.json" in text
    assert "  gdrcopy (NVIDIA_GDRCOPY=enabled): /dev/gdrdrv (c 234:0)" in text


def test_doctor_explains_what_the_host_lacks(fake_driver: FakeDriver, tmp_path: Path) -> None:
    code, summary, steps = explain(fake_driver, tmp_path, "--env", GPU, "--env", "NVIDIA_GDS=enabled",
                                   "--env", "NVIDIA_IMEX_CHANNELS=all")
    text = [s["message"] for s in steps]
    assert summary["outcome"] == "inject"
    assert any("IMEX channels: NVIDIA_IMEX_CHANNELS=all, but this host has none" in t for t in text)
    gds = next(s for s in steps if "NVIDIA_GDS=enabled, but this host has no /dev/nvidia-fs*" in s["message"])
    assert "load the gds kernel module" in gds["fix"]


def test_doctor_names_a_missing_channel(fake_driver_datacenter: FakeDriver, tmp_path: Path) -> None:
    code, summary, steps = explain(fake_driver_datacenter, tmp_path, "--env", GPU, "--env", "NVIDIA_IMEX_CHANNELS=1")
    assert code == 1 and summary["outcome"] == "fail"
    failing = next(s for s in steps if "the start would fail: IMEX channel 1" in s["message"])
    assert "channels this host has: channel0, channel3" in failing["fix"]


def test_doctor_says_datacenter_variables_need_a_gpu(fake_driver: FakeDriver, tmp_path: Path) -> None:
    _code, _summary, steps = explain(fake_driver, tmp_path, "--env", "NVIDIA_NVSWITCH=enabled")
    assert any("NVIDIA_NVSWITCH ignored too" in s["message"] for s in steps)


def test_fake_driver_create_options(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the fake driver needs root")
    out = subprocess.run([sys.executable, "-m", "gpuhook.cli", "fake-driver", "create", str(tmp_path / "root"),
                          "--gpus", "1", "--no-compat32", "--imex-channels", "2", "--nvswitches", "1", "--rdma-hcas",
                          "1"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "datacenter nodes: /dev/nvidia-caps-imex-channels/channel2, /dev/nvidia-nvswitchctl" in out.stdout
    devices = (tmp_path / "root/proc/devices").read_text()
    assert "509 nvidia-caps-imex-channels\n" in devices and "236 nvidia-nvswitch\n" in devices
    assert "231 infiniband_verbs\n" in devices and "nvidia-fs" not in devices
    st = os.stat(tmp_path / "root/dev/nvidia-caps-imex-channels/channel2")
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 509 and os.minor(st.st_rdev) == 2
    bad = subprocess.run([sys.executable, "-m", "gpuhook.cli", "fake-driver", "create", str(tmp_path / "b"),
                          "--imex-channels", "1,x"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "'1,x' is not a comma list of channel numbers" in bad.stderr


def test_fake_datacenter_validates() -> None:
    with pytest.raises(ValueError, match="IMEX channel 1048576 out of range"):
        Datacenter(imex_channels=(1048576,)).validate()
    assert FAKE_DATACENTER.nodes()[0].path == f"{IMEX_DIR}/channel0"
