"""The hosts users run (issue 23): Ubuntu's ldconfig wrapper script, simulated in temp dirs (never the host's
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
