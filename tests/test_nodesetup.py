"""`gpuhook node-setup` (the node-setup DaemonSet's entry point) against a stand-in host root: a temp
dir used as the host mount. Install writes gpuhook's payload (the image's own Python, loader and libraries)
under one prefix, the runtime's drop-in or config, the hook's config and the /dev/char links; uninstall puts
the stand-in root back to the byte (file tree, modes, link targets, contents).

The end-to-end cases run a private containerd (Debian 12's 1.6, and trixie's 1.7 from .ci/fetch-docker-cdi)
under a supervisor that starts it again when it exits, as systemd's `Restart=always` does: node-setup's
`--restart signal` must leave a new daemon running the new configuration (`containerd config dump`), a GPU
container must start through the installed hook (the payload's interpreter, run by its own loader): on 1.6
through the restarted daemon from the base spec node-setup wrote; on 1.7, whose CDI only its CRI applies, by
runc here and through the CRI in tests/test_nodesetup_cri.py -- and the uninstall must restart the daemon on its
old configuration."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.daemon import HOST_PATH, unmount_below
from support.e2e import need_root, need_tool
from support.runc import busybox_rootfs, make_bundle, runc_run, unique_id

from gpuhook.cli.entry import entry_script, native_entry
from gpuhook.errors import GpuhookError
from gpuhook.nodesetup import payload
from gpuhook.nodesetup.setup import Options, install, uninstall

GPUHOOK = str(Path(sys.executable).with_name("gpuhook"))
TRIXIE = Path(os.environ.get("GPUHOOK_DOCKER_CDI_CACHE",
                             os.environ.get("GPUHOOK_DEB_CACHE", "/var/cache/gpuhook-test-debs") + "/docker-trixie"))
MAIN_CONFIG = """\
# the node's own containerd config: comments and settings must come back as they were
version = 2

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
"""


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path below `root`: type, permission bits, and content (files) or target (links)."""
    out: dict[str, tuple[Any, ...]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                out[str(path.relative_to(root))] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes(),
                                                    st.st_mtime_ns)
            else:
                out[str(path.relative_to(root))] = ("dir" if stat.S_ISDIR(st.st_mode) else st.st_mode,
                                                    stat.S_IMODE(st.st_mode))
    return out


def source() -> payload.Source:
    return payload.Source.this(native_entry())


def stand_in_host(tmp_path: Path) -> Path:
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    config = host / "etc/containerd/config.toml"
    config.write_text(MAIN_CONFIG)
    os.chmod(config, 0o600)
    (host / "dev/char").mkdir(parents=True)
    (host / "dev/char/195:0").symlink_to("/dev/somebody-elses")  # in the way: kept, never replaced
    (host / "usr/local").mkdir(parents=True)
    return host


def test_install_and_uninstall_through_a_host_mount_leave_the_host_as_it_was(tmp_path: Path) -> None:
    host = stand_in_host(tmp_path)
    before = snapshot(host)
    links = [("/dev/char/195:0", "/dev/nvidia0"), ("/dev/char/195:255", "/dev/nvidiactl")]
    opts = Options(str(host), "/usr/local/gpuhook", runtime="containerd", restart="none", links=links)
    report = install(opts, source(), entry_script)
    prefix = host / "usr/local/gpuhook"
    release = payload.release_id(source())
    here = f"/usr/local/gpuhook/releases/{release}"
    assert os.readlink(prefix / "bin") == f"releases/{release}/bin"
    # The hook entry names its release's interpreter by its host path, and that wrapper runs it by its own loader.
    assert (prefix / "bin/gpuhook-hook.py").read_text().startswith(f"#!{here}/bin/python3 -IS\n")
    wrapper = (prefix / "bin/python3").read_text()
    assert f"exec {here}/lib/ld/ld-linux-x86-64.so.2 --argv0 {here}/bin/python3 --library-path " in wrapper
    assert (prefix / f"releases/{release}/lib/ld/ld-linux-x86-64.so.2").is_file()
    site = prefix / f"releases/{release}/lib/python3.{sys.version_info[1]}/site-packages"
    assert (site / "gpuhook/__init__.py").is_file()
    assert not (site / "grpc").exists()  # the plugin's gRPC stays in the image
    # containerd >= 1.7 (or unknown): a drop-in with the main config's CRI table plus CDI, imported by the main one
    dropin = (host / "etc/containerd/conf.d/99-gpuhook.toml").read_text()
    assert 'sandbox_image = "registry.k8s.io/pause:3.9"' in dropin and "enable_cdi = true" in dropin
    assert 'cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]' in dropin
    main = (host / "etc/containerd/config.toml").read_text()
    imports = 'imports = ["/etc/containerd/conf.d/99-gpuhook.toml"]\n'
    assert main == MAIN_CONFIG.replace("version = 2\n", "version = 2\n" + imports)
    assert os.readlink(host / "dev/char/195:255") == "/dev/nvidiactl"
    assert os.readlink(host / "dev/char/195:0") == "/dev/somebody-elses"
    assert any("in the way" in line for line in report.lines)
    assert (prefix / "etc/config.toml").read_text().endswith('driver-root = "/"\n')
    # A second install of the same image (a restarted pod) changes nothing and restarts nothing.
    installed = snapshot(host)
    again = install(opts, source(), entry_script)
    assert snapshot(host) == installed
    assert again.lines[-1] == "containerd's configuration is already gpuhook's: not restarted", again.lines
    lines = uninstall(opts).lines
    assert lines[0] == "removed /usr/local/gpuhook and put back 8 recorded path(s)"
    assert snapshot(host) == before
    assert uninstall(opts).lines == ["nothing to undo: no node-setup journal at /usr/local/gpuhook/node-setup.json"]


def test_an_upgrade_publishes_the_new_release_by_one_rename_and_keeps_the_one_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = stand_in_host(tmp_path)
    before = snapshot(host)
    opts = Options(str(host), "/usr/local/gpuhook", runtime="containerd", restart="none")
    prefix = host / "usr/local/gpuhook"
    first = install(opts, source(), entry_script)
    assert any(line.startswith("wrote /etc/containerd/") for line in first.lines)
    config = (host / "etc/containerd/config.toml").read_bytes()
    renames: list[tuple[str, str]] = []
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((str(a), str(b))), real_rename(a, b))[1])
    releases = []
    for image in ("new-image", "newer-image"):
        monkeypatch.setattr(payload, "release_id", lambda _source, image=image: image)
        report = install(opts, source(), entry_script)
        releases.append(os.readlink(prefix / "bin"))
        assert report.lines[-1] == "containerd's configuration is already gpuhook's: not restarted"
        assert f"/usr/local/gpuhook/bin now runs release {image}" in " ".join(report.lines)
    assert releases == ["releases/new-image/bin", "releases/newer-image/bin"]
    assert sorted(os.listdir(prefix / "releases")) == ["new-image", "newer-image"]  # the oldest is gone
    # bin/ was replaced by renaming a finished link over it, never removed first
    assert [b for _a, b in renames if b == str(prefix / "bin")] == [str(prefix / "bin")] * 2
    assert (prefix / "releases/newer-image/bin/gpuhook-hook.py").read_text().startswith(
        "#!/usr/local/gpuhook/releases/newer-image/bin/python3 -IS\n")
    assert (host / "etc/containerd/config.toml").read_bytes() == config
    uninstall(opts)
    assert snapshot(host) == before


def test_crio_gets_its_drop_in_and_loses_it_again(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "etc/crio").mkdir(parents=True)
    (host / "etc/crio/crio.conf").write_text("[crio.runtime]\nconmon_cgroup = \"pod\"\n")
    before = snapshot(host)
    opts = Options(str(host), "/opt/gpuhook", runtime="crio", restart="none")
    install(opts, source(), entry_script)
    assert "cdi_spec_dirs" in (host / "etc/crio/crio.conf.d/99-gpuhook.conf").read_text()
    assert (host / "etc/crio/crio.conf").read_text() == before["etc/crio/crio.conf"][2].decode()
    uninstall(opts)
    assert snapshot(host) == before


def test_an_empty_prefix_is_used_and_left_as_it_was_found(tmp_path: Path) -> None:
    """The device plugin's hostPath volume (DirectoryOrCreate) makes the prefix when its pod starts first."""
    host = stand_in_host(tmp_path)
    (host / "usr/local/gpuhook").mkdir()
    before = snapshot(host)
    opts = Options(str(host), "/usr/local/gpuhook", runtime="containerd", restart="none")
    install(opts, source(), entry_script)
    assert (host / "usr/local/gpuhook/bin/gpuhook-hook").is_file()
    uninstall(opts)
    assert snapshot(host) == before


def test_a_prefix_that_is_not_ours_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    host = stand_in_host(tmp_path)
    (host / "usr/local/gpuhook").mkdir()
    (host / "usr/local/gpuhook/somebody-elses").write_text("")
    before = snapshot(host)
    opts = Options(str(host), "/usr/local/gpuhook", runtime="containerd", restart="none")
    with pytest.raises(GpuhookError, match="exists on the host and is not node-setup's"):
        install(opts, source(), entry_script)
    assert snapshot(host) == before


def test_a_failed_install_undoes_what_it_did(tmp_path: Path) -> None:
    host = stand_in_host(tmp_path)
    (host / "etc/containerd/config.toml").write_text("version = 1\n")  # refused by runtimeconfig, after the payload
    before = snapshot(host)
    opts = Options(str(host), "/usr/local/gpuhook", runtime="containerd", restart="none")
    with pytest.raises(GpuhookError, match="containerd config version 1"):
        install(opts, source(), entry_script)
    assert snapshot(host) == before


@pytest.mark.parametrize("value", ["relative/prefix", "/"])
def test_a_bad_prefix_is_one_line(value: str, tmp_path: Path) -> None:
    result = subprocess.run([GPUHOOK, "node-setup", "install", "--host-root", str(tmp_path), "--prefix", value,
                             "--runtime", "containerd", "--restart", "none"], capture_output=True, text=True,
                            check=False)  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"gpuhook: --prefix must be an absolute path below /, not {value!r}"]


# --- end to end: a supervised private containerd ----------------------------------------------------------


@contextlib.contextmanager
def supervised_containerd(binary: str, config: Path, state: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`binary --config config`, started again whenever it exits (systemd's Restart=always), in its own session;
    the whole session is stopped at the end. `state`: its root, state and log."""
    env = {"PATH": ":".join([os.path.dirname(binary), *HOST_PATH])}
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "containerd.log", "ab") as out:
        proc = subprocess.Popen(["sh", "-c", 'while :; do "$0" --config "$1"; sleep 0.1; done', binary, str(config)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        unmount_below(state)


def containerd_pid(config: Path) -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/comm").read_text().strip() == "containerd" and \
                        str(config) in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    return int(entry)
    return None


def wait_for(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def dump(binary: str, config: Path) -> str:
    result = subprocess.run([binary, "--config", str(config), "config", "dump"], capture_output=True, text=True,
                            timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


CONTAINERDS = {"1.6": "/usr/bin/containerd", "1.7": str(TRIXIE / "root/usr/bin/containerd"),
               "2.x": os.path.join(os.environ.get("GPUHOOK_CONTAINERD_BIN", "/nonexistent"), "containerd")}


@pytest.mark.e2e
@pytest.mark.parametrize("version", sorted(CONTAINERDS))
def test_node_setup_configures_and_restarts_a_containerd_then_puts_it_back(
        version: str, fake_driver: Any, tmp_path: Path) -> None:
    need_root()
    need_tool("runc")
    need_tool("nsenter")
    binary = CONTAINERDS[version]
    if not os.access(binary, os.X_OK):
        if version != "1.6" and os.environ.get("GPUHOOK_REQUIRE_E2E") != "1":
            pytest.skip(f"{binary} missing: run .ci/fetch-docker-cdi and .ci/build-k8s")
        raise AssertionError(f"{binary} missing (.ci/run installs containerd and runs .ci/fetch-docker-cdi)")
    host = tmp_path / "host"  # the stand-in: containerd's config and state, the prefix and the links live here
    etc = host / "etc/containerd"
    etc.mkdir(parents=True)
    config = etc / "config.toml"
    state = tmp_path / "daemon"  # containerd's own root, state and sockets: outside the stand-in
    config.write_text(MAIN_CONFIG + f'\nroot = "{state}/root"\nstate = "{state}/state"\n'
                      f'[grpc]\n  address = "{state}/containerd.sock"\n'
                      f'[ttrpc]\n  address = "{state}/containerd.sock.ttrpc"\n')
    (host / "dev/char").mkdir(parents=True)
    before_dump = dump(binary, config)
    before = snapshot(host)
    prefix = host / "opt/gpuhook"
    args = ["--prefix", str(prefix), "--runtime", "containerd", "--runtime-config", str(config), "--restart",
            "signal", "--driver-root", str(fake_driver.root), "--dev-root", str(fake_driver.root),
            "--proc-root", f"{fake_driver.root}/proc", "--dev-char-path", str(host / "dev/char")]
    with supervised_containerd(binary, config, state):
        first = wait_for("containerd", lambda: containerd_pid(config))
        wait_for("containerd's socket", lambda: (state / "containerd.sock").exists())
        started = time.monotonic()
        result = subprocess.run([GPUHOOK, "node-setup", "install", *args], capture_output=True, text=True,
                                timeout=300, check=False)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        second = containerd_pid(config)
        assert second not in (None, first), result.stdout  # restarted by node-setup, started again by its supervisor
        ready = time.monotonic() - started
        running = dump(binary, config)
        if version == "1.7":
            assert "enable_cdi = true" in running and "/etc/cdi" in running
            assert 'sandbox_image = "registry.k8s.io/pause:3.9"' in running  # the main config's CRI table kept
        elif version == "2.x":  # merged key by key: the drop-in holds CDI's two settings and nothing else
            assert "enable_cdi = true" in running and "'/var/run/cdi'" in running, running
            assert "sandbox = 'registry.k8s.io/pause:3.9'" in running  # the main config's CRI setting, kept
            dropin = (etc / "conf.d/99-gpuhook.toml").read_text()
            assert "pause" not in dropin and "snapshotter" not in dropin, dropin
        else:
            base = etc / "gpuhook-base-spec.json"
            assert f'base_runtime_spec = "{base}"' in running
            spec = json.loads(base.read_text())
            (hook,) = spec["hooks"]["prestart"]
            assert hook["path"] == str(prefix / "bin/gpuhook-hook")
            assert hook["args"] == ["gpuhook-hook", "--config", str(prefix / "etc/config.toml"), "prestart"]
            assert "rlimits" not in spec["process"]
        links = sorted(os.listdir(host / "dev/char"))
        assert "195:255" in links and "195:0" in links
        # A GPU container started through the installed hook: the payload's Python, by its own loader.
        rootfs = busybox_rootfs(tmp_path / "image")
        hook = {"path": str(prefix / "bin/gpuhook-hook"),
                "args": ["gpuhook-hook", "--config", str(prefix / "etc/config.toml"), "prestart"],
                "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
        (prefix / "etc/config.toml").write_text(f'driver-root = "{fake_driver.root}"\n'
                                                f'proc-root = "{fake_driver.root}/proc"\ninventory-cache = ""\n'
                                                f'log-file = "{tmp_path}/gpuhook.log"\n')
        probe = ["sh", "-c", "ls /dev | grep nvidia | sort"]
        if version == "1.6":
            # through the restarted daemon, from the base spec node-setup wrote (what CRI builds a container
            # from), given the process CRI would add: `ctr run --config` takes a whole spec
            spec["process"].update(args=probe, env=["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=1"])
            spec["root"] = {"path": str(rootfs)}
            (tmp_path / "run.json").write_text(json.dumps(spec))
            ran = subprocess.run([os.path.join(os.path.dirname(binary), "ctr"), "--address",
                                  str(state / "containerd.sock"), "run", "--rm", "--config", str(tmp_path / "run.json"),
                                  unique_id("nodesetup")], capture_output=True, text=True, timeout=120,
                                 check=False)  # fmt: skip
        else:  # containerd >= 1.7 gives GPUs through CDI, which only its CRI reads: the installed hook by runc
            bundle = make_bundle(tmp_path / "bundle", rootfs, probe, env=["NVIDIA_VISIBLE_DEVICES=1"],
                                 hooks={"prestart": [hook]})
            ran = runc_run(bundle, unique_id("nodesetup"))
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
        result = subprocess.run([GPUHOOK, "node-setup", "uninstall", *args], capture_output=True, text=True,
                                timeout=300, check=False)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        third = containerd_pid(config)
        assert third not in (None, second)
        assert dump(binary, config) == before_dump
    assert snapshot(host) == before
    print(f"containerd {version}: node ready {ready:.2f} s after node-setup started")
