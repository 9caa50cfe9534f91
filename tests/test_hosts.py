"""The hosts users run: Ubuntu's ldconfig wrapper script, simulated in temp dirs (never the host's
/sbin); a start through it with runc; doctor's same check."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_hook_e2e import e2e, nodes, run  # noqa: F401 - e2e is the fixture

from gpuhook.errors import InjectionError
from gpuhook.inject.ldcache import host_ldconfig, open_ldconfig

HOST_LDCONFIG = "/sbin/ldconfig"


def ubuntu_sbin(tmp: Path, real: bool = True) -> Path:
    """Ubuntu's layout: /sbin/ldconfig is `#!/bin/sh` exec'ing /sbin/ldconfig.real, the static ELF."""
    sbin = tmp / "sbin"
    sbin.mkdir()
    script = sbin / "ldconfig"
    script.write_text(f'#!/bin/sh\nif test "$(id -u)" = 0; then :; fi\nexec {sbin}/ldconfig.real "$@"\n')
    script.chmod(0o755)
    if real:
        shutil.copy2(os.path.realpath(HOST_LDCONFIG), sbin / "ldconfig.real")
    return script


def test_ubuntu_wrapper_script_resolves_to_ldconfig_real(tmp_path: Path) -> None:
    script = ubuntu_sbin(tmp_path)
    assert host_ldconfig(f"@{script}") == f"{script}.real"
    os.close(open_ldconfig(f"@{script}"))
    assert host_ldconfig(HOST_LDCONFIG) == HOST_LDCONFIG  # an ELF is taken as it is


def test_a_script_without_real_fails_naming_the_path(tmp_path: Path) -> None:
    script = ubuntu_sbin(tmp_path, real=False)
    with pytest.raises(InjectionError, match=f"ldconfig {script} is not an ELF executable"):
        open_ldconfig(f"@{script}")


def test_doctor_runs_the_same_check(tmp_path: Path, fake_driver: Any) -> None:
    from gpuhook.doctor.host import check_ldconfig

    script = ubuntu_sbin(tmp_path)
    [ok] = check_ldconfig(f"@{script}")
    assert ok.status == "ok" and f"{script}.real is a static executable (the script {script} execs it)" in ok.message
    (tmp_path / "sbin" / "ldconfig.real").unlink()
    [bad] = check_ldconfig(f"@{script}")
    assert bad.status == "problem" and "every GPU start would fail" in bad.message


def test_gpu_start_on_an_ubuntu_host(e2e: Path, fake_driver: Any) -> None:  # noqa: F811 - the fixture
    """The hook with Ubuntu's ldconfig layout: the container's ld cache is built by ldconfig.real."""
    script = ubuntu_sbin(e2e)
    result, rootfs = run(e2e, fake_driver, ["NVIDIA_VISIBLE_DEVICES=0"], {"ldconfig": f"@{script}"})
    assert result.returncode == 0, result.stderr
    assert "nvidia0" in nodes(result.stdout)
    assert (rootfs / "etc/ld.so.cache").stat().st_size > 0


# --- systemd daemon-reload: /dev/char links ---------------------------------------------------------------------


def test_create_dev_char_symlinks_is_idempotent_and_never_replaces(tmp_path: Path, fake_driver_mig: Any) -> None:
    from gpuhook.cli.app import main
    from gpuhook.discover import Roots, discover
    from gpuhook.system.devchar import nvidia_nodes

    inv = discover(Roots.make(str(fake_driver_mig.root), None, f"{fake_driver_mig.root}/proc"))
    dev_char = tmp_path / "char"
    args = ["system", "create-dev-char-symlinks", "--driver-root", str(fake_driver_mig.root), "--proc-root",
            f"{fake_driver_mig.root}/proc", "--dev-char-path", str(dev_char)]
    assert main(args) == 0
    nodes = nvidia_nodes(inv)
    assert {p.name for p in dev_char.iterdir()} == {f"{n.major}:{n.minor}" for n in nodes}
    gpu0 = inv.gpus[0].node
    link = dev_char / f"{gpu0.major}:{gpu0.minor}"
    assert os.readlink(link) == gpu0.host_path and os.stat(link).st_rdev == os.stat(gpu0.host_path).st_rdev
    caps = [n for n in nodes if "nvidia-caps" in n.path]
    assert caps and all((dev_char / f"{n.major}:{n.minor}").is_symlink() for n in caps)
    link.unlink()
    link.symlink_to("/dev/null")  # someone else's link: kept, warned about
    assert main(args) == 0
    assert os.readlink(link) == "/dev/null"
    assert len(list(dev_char.iterdir())) == len(nodes)


def test_doctor_finds_missing_links_under_systemd(tmp_path: Path, fake_driver: Any) -> None:
    from gpuhook.discover import Roots, discover
    from gpuhook.doctor.runtimes import Paths
    from gpuhook.doctor.systemd import check_dev_char
    from gpuhook.system.devchar import create_links

    inv = discover(Roots.make(str(fake_driver.root), None, f"{fake_driver.root}/proc"))
    containerd = tmp_path / "config.toml"
    containerd.write_text('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
                          "SystemdCgroup = true\n")
    docker = tmp_path / "daemon.json"
    docker.write_text('{"exec-opts": ["native.cgroupdriver=systemd"]}')
    dev_char, none = tmp_path / "char", str(tmp_path / "no-systemd")
    plain = Paths(containerd_config=str(tmp_path / "x.toml"), docker_config=str(tmp_path / "x.json"))
    assert check_dev_char(inv, plain, none, str(dev_char)) == []  # no systemd cgroup driver: nothing to say
    for paths in (Paths(containerd_config=str(containerd), docker_config=str(tmp_path / "x.json")),
                  Paths(containerd_config=str(tmp_path / "x.toml"), docker_config=str(docker))):
        [finding] = check_dev_char(inv, paths, none, str(dev_char))
        assert finding.status == "warn" and "daemon-reload" in finding.message
        assert finding.fix == "gpuhook system create-dev-char-symlinks"
    create_links(inv, str(dev_char))
    [ok] = check_dev_char(inv, Paths(containerd_config=str(containerd)), none, str(dev_char))
    assert ok.status == "ok"
    tmp_systemd = tmp_path / "run-systemd"
    tmp_systemd.mkdir()
    assert "systemd is the init system" in check_dev_char(inv, plain, str(tmp_systemd), str(dev_char))[0].message


# --- a new user's first run -------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> Any:
    import subprocess
    import sys

    gpuhook = str(Path(sys.executable).with_name("gpuhook"))
    return subprocess.run([gpuhook, *args], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})


def test_fake_driver_create_prints_the_flags_that_use_it(tmp_path: Path) -> None:
    from test_hook_e2e import need_root

    need_root()
    result = _cli("fake-driver", "create", str(tmp_path / "r"), "--gpus", "1")
    assert result.returncode == 0, result.stderr
    flags = f"--driver-root {tmp_path / 'r'} --proc-root {tmp_path / 'r'}/proc"
    assert f"gpuhook info {flags}" in result.stdout
    info = _cli("info", *flags.split(), "--json")
    assert info.returncode == 0 and info.stderr == ""


def test_a_driver_root_read_with_the_hosts_proc_gets_one_note(fake_driver_mig: Any) -> None:
    result = _cli("generate-cdi", "--driver-root", str(fake_driver_mig.root))
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"gpuhook: note: {fake_driver_mig.root} has its own proc/driver/nvidia")
    assert f"--proc-root {fake_driver_mig.root}/proc" in lines[0]
    assert len(lines) == 2 and lines[1].count("MIG device 1:0") == 1  # the error names the device once


def test_every_command_takes_the_roots_from_the_hook_config(tmp_path: Path, fake_driver: Any) -> None:
    """A flag, else the hook config's value (what the hook uses), else the default: info, list and generate-cdi
    as doctor (the config named by GPUHOOK_CONFIG is the shim's and the hook's too)."""
    config = tmp_path / "config.toml"
    config.write_text(f'driver-root = "{fake_driver.root}"\nproc-root = "{fake_driver.root}/proc"\n'
                      f'inventory-cache = ""\n')
    import json

    from gpuhook.hook.config import DEFAULT_PATH

    assert not os.path.exists(DEFAULT_PATH)  # the host's own config would decide otherwise
    # load_config(None) reads only the default path: point it at ours through a patched module in a child
    code = ("import sys, gpuhook.hook.config as c; c.DEFAULT_PATH = sys.argv[1]; "
            "from gpuhook.cli import main; sys.exit(main(sys.argv[2:]))")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code, str(config), "info", "--json"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["driver_root"] == str(fake_driver.root)


def test_hook_and_shim_answer_help_and_version() -> None:
    import subprocess
    import sys

    hook = str(Path(sys.executable).with_name("gpuhook-hook"))
    shim = str(Path(sys.executable).with_name("gpuhook-runtime"))
    for args in (["--help"], ["-h"]):
        result = subprocess.run([hook, *args], input="", capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0 and result.stdout.startswith("usage: gpuhook-hook") and "GPUHOOK_CONFIG" in (
            result.stdout)
    result = subprocess.run([hook, "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.startswith("gpuhook-hook 0.")
    result = subprocess.run([shim, "--version"], capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "GPUHOOK_RUNTIME": shutil.which("runc") or "runc"})
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[0].startswith("gpuhook-runtime 0.") and lines[1].startswith("runc")


def test_cdi_list_says_when_it_finds_no_spec(tmp_path: Path) -> None:
    result = _cli("cdi", "list", "--spec-dir", str(tmp_path / "none"))
    assert result.returncode == 0 and result.stdout == ""
    assert result.stderr == (f"gpuhook: no CDI spec in {tmp_path / 'none'} (gpuhook generate-cdi --output "
                             f"{tmp_path / 'none'}/nvidia.yaml writes one)\n")


def test_info_json_keys_are_all_documented(fake_driver_mig: Any) -> None:
    import json
    import re

    result = _cli("info", "--driver-root", str(fake_driver_mig.root), "--proc-root", f"{fake_driver_mig.root}/proc",
                  "--json")
    keys: set[str] = set()

    def walk(value: Any, parent: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if parent not in ("control_nodes", "gated_nodes", "gated_mounts", "matrix", "legend"):
                    keys.add(k)
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, parent)

    walk(json.loads(result.stdout))
    page = (Path(__file__).parent.parent / "docs" / "discovery.md").read_text()
    section = page[page.index("## `gpuhook info --json`"):page.index("## Discovery")]
    missing = [k for k in sorted(keys) if not re.search(rf"`{re.escape(k)}(\[\])?`", section)]
    assert missing == []
