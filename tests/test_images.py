"""The node-setup and device-plugin images (.ci/build-images builds them on a base made from Debian's packages):
node-setup run from its image against the host through a host mount, as the DaemonSet runs it, installs a
gpuhook whose hook then starts a GPU container on the host with the image's Python (run by the image's own
loader, so the host's Python plays no part), and its uninstall leaves the stand-in folder as it was."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.e2e import need_root, need_tool
from support.runc import busybox_rootfs, make_bundle, runc_run, unique_id
from test_nodesetup import MAIN_CONFIG, snapshot

pytestmark = pytest.mark.e2e
NODE_SETUP = os.environ.get("GPUHOOK_NODE_SETUP_IMAGE", "localhost/gpuhook-node-setup:ci")
PLUGIN = os.environ.get("GPUHOOK_PLUGIN_IMAGE", "localhost/gpuhook-device-plugin:ci")
# As tests/support/podman.py runs podman here: no systemd, no journald, runc, limits a container may set.
PODMAN_RUN = ("podman", "--cgroup-manager", "cgroupfs", "--events-backend", "file", "run", "--rm", "--runtime",
              "runc", "--network=none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


def need_image(name: str) -> None:
    need_root()
    need_tool("podman")
    if subprocess.run(["podman", "image", "exists", name], check=False).returncode != 0:
        if os.environ.get("GPUHOOK_REQUIRE_E2E") == "1":
            raise AssertionError(f"image {name} missing: .ci/build-images makes it")
        pytest.skip(f"image {name} missing: run .ci/build-images")


def node_setup(*args: str) -> subprocess.CompletedProcess[str]:
    """The DaemonSet's container: privileged, the host's PID namespace, the host's / at /host."""
    return subprocess.run([*PODMAN_RUN, "--privileged", "--pid=host", "-v", "/:/host:rslave",
                           "-e", "GPUHOOK_HOST_ROOT=/host", NODE_SETUP,
                           "node-setup", *args], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_node_setup_from_its_image_installs_a_hook_that_runs_on_the_host(fake_driver: Any, tmp_path: Path) -> None:
    need_image(NODE_SETUP)
    need_tool("runc")
    host = tmp_path / "stand-in"  # every path node-setup touches on the real host lies below here
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text(MAIN_CONFIG)
    (host / "dev/char").mkdir(parents=True)
    before = snapshot(host)
    prefix = host / "opt/gpuhook"
    args = ["--prefix", str(prefix), "--runtime", "containerd", "--runtime-config",
            str(host / "etc/containerd/config.toml"), "--restart", "none", "--driver-root", str(fake_driver.root),
            "--dev-root", str(fake_driver.root), "--proc-root", f"{fake_driver.root}/proc",
            "--dev-char-path", str(host / "dev/char")]
    result = node_setup("install", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "enable_cdi = true" in (host / "etc/containerd/conf.d/99-gpuhook.toml").read_text(), result.stderr
    assert "195:255" in os.listdir(host / "dev/char"), result.stdout + result.stderr
    # The payload is the image's: its interpreter and libc, by its loader (not the host's ld.so.cache).
    version = subprocess.run([str(prefix / "bin/python3"), "-IS", "-c",
                              "import sys, os; print(sys.version.split()[0], sys.executable, sys.prefix)"],
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert version.returncode == 0, version.stderr
    release = prefix / os.path.dirname(os.readlink(prefix / "bin"))  # P/bin -> releases/<id>/bin
    assert version.stdout.split()[1:] == [str(release / "bin/python3"), str(release)]
    assert subprocess.run([str(prefix / "bin/gpuhook"), "--version"], capture_output=True, text=True,
                          check=False).stdout.startswith("gpuhook, version ")  # fmt: skip
    (prefix / "etc/config.toml").write_text(f'driver-root = "{fake_driver.root}"\n'
                                            f'proc-root = "{fake_driver.root}/proc"\ninventory-cache = ""\n'
                                            f'log-file = "{tmp_path}/gpuhook.log"\n')
    hook = {"path": str(prefix / "bin/gpuhook-hook"),
            "args": ["gpuhook-hook", "--config", str(prefix / "etc/config.toml"), "prestart"],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    bundle = make_bundle(tmp_path / "bundle", busybox_rootfs(tmp_path / "image"),
                         ["sh", "-c", "ls /dev | grep nvidia | sort"], env=["NVIDIA_VISIBLE_DEVICES=0"],
                         hooks={"prestart": [hook]})
    ran = runc_run(bundle, unique_id("image"))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"]
    result = node_setup("uninstall", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert snapshot(host) == before


def test_the_plugin_image_runs_the_device_plugin() -> None:
    need_image(PLUGIN)
    result = subprocess.run([*PODMAN_RUN, PLUGIN, "device-plugin", "--help"],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--kubelet-dir" in result.stdout
