"""`gpuhook runtime configure`, the shipped oci-hooks(5) file and the runtime-config snippets.

Each runtime gets a config with comments and unrelated settings: after configuring, the new keys parse as
intended, every comment is still there and nothing else changed; a second run is a no-op; the backup is the
original byte for byte; --dry-run and malformed input change nothing. The end-to-end tests have podman 4.3.1
run the hook file (and a configured containers.conf) for real.
"""

from __future__ import annotations

import copy
import json
import os
import re
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuhook.cli.app import main
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.runtimeconfig import hookspec, runtimes

ROOT = Path(__file__).resolve().parent.parent
HOOK_FILE = ROOT / "oci-hooks.d" / "gpuhook.json"
SNIPPETS = ROOT / "runtime-config"
CRI_V2 = ("plugins", "io.containerd.grpc.v1.cri")
CRI_V3 = ("plugins", "io.containerd.cri.v1.runtime")
CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]
HOOK = "/opt/gpuhook/bin/gpuhook-hook"

CONTAINERD_V2 = """\
# containerd config, kept by hand
version = 2
root = "/var/lib/containerd"   # images live here
oom_score = -999

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    # the pause image comes from our mirror
    sandbox_image = "mirror.local/pause:3.9"
    enable_cdi = false # turned off during the 1.7 upgrade
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        base_runtime_spec = ""
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true  # systemd cgroup driver
"""

CONTAINERD_V3 = """\
version = 3
# containerd 2.x
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'  # default

[plugins.'io.containerd.cri.v1.runtime']
  # keep ports privileged
  enable_unprivileged_ports = false
  cdi_spec_dirs = ['/opt/cdi']
"""

CRIO = """\
# The CRI-O configuration file specifies all of the available configuration
# options and command-line flags for the crio(8) OCI Kubernetes Container Runtime
[crio]
log_dir = "/var/log/crio/pods"

[crio.runtime]
# default runtime
default_runtime = "runc"
conmon_cgroup = "pod"

# Path to OCI hooks directories for automatically executed hooks.
#hooks_dir = [
#	"/usr/share/containers/oci/hooks.d",
#]

[crio.network]
# CNI configuration
network_dir = "/etc/cni/net.d/"
"""

DOCKER = """\
{
  "log-level": "warn",
  "storage-driver": "overlay2",
  "features": {
    "containerd-snapshotter": true
  },
  "registry-mirrors": [
    "https://mirror.local"
  ]
}
"""

PODMAN = """\
# containers.conf for this host
[containers]
log_size_max = 1048576  # one MiB

[engine]
# crun is faster here
runtime = "runc"
events_logger = "file"
"""


@dataclass(frozen=True)
class Case:
    """One runtime configuration: the file, its content, the CLI flags and what the result must parse to."""

    id: str
    runtime: str
    mode: str
    name: str
    original: str
    expect: Callable[[dict[str, Any], Path], dict[str, Any]]  # original parsed, tmp dir -> wanted parsed
    malformed: str
    extra: tuple[str, ...] = ()

    def args(self, tmp: Path) -> list[str]:
        args = ["--runtime", self.runtime, "--mode", self.mode, "--config", str(tmp / self.name), *self.extra]
        if self.mode == "hook":
            args += ["--hook-path", HOOK]
            if self.runtime in ("crio", "podman"):
                args += ["--hooks-dir", str(tmp / "hooks.d")]
        return args

    def parse(self, text: str) -> dict[str, Any]:
        return json.loads(text) if self.name.endswith(".json") else tomllib.loads(text)


def at(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    for key in keys:
        data = data.setdefault(key, {})
    return data


def with_changes(edit: Callable[[dict[str, Any], Path], None]) -> Callable[[dict[str, Any], Path], dict[str, Any]]:
    def expect(original: dict[str, Any], tmp: Path) -> dict[str, Any]:
        wanted = copy.deepcopy(original)
        edit(wanted, tmp)
        return wanted

    return expect


def _containerd_v2_cdi(d: dict[str, Any], _tmp: Path) -> None:
    at(d, CRI_V2).update(enable_cdi=True, cdi_spec_dirs=CDI_DIRS)


def _containerd_v2_hook(d: dict[str, Any], tmp: Path) -> None:
    at(d, (*CRI_V2, "containerd", "runtimes", "runc"))["base_runtime_spec"] = str(tmp / "gpuhook-base-spec.json")


def _containerd_v3_cdi(d: dict[str, Any], _tmp: Path) -> None:
    at(d, CRI_V3).update(enable_cdi=True, cdi_spec_dirs=["/opt/cdi", *CDI_DIRS])


def _crio_cdi(d: dict[str, Any], _tmp: Path) -> None:
    at(d, ("crio", "runtime"))["cdi_spec_dirs"] = CDI_DIRS


def _crio_hook(d: dict[str, Any], tmp: Path) -> None:
    at(d, ("crio", "runtime"))["hooks_dir"] = [runtimes.BUILTIN_HOOKS_DIR, str(tmp / "hooks.d")]


def _docker_cdi(d: dict[str, Any], _tmp: Path) -> None:
    d["features"]["cdi"] = True


def _docker_hook(d: dict[str, Any], _tmp: Path) -> None:
    d["runtimes"] = {"gpuhook": {"path": os.path.join(os.path.dirname(HOOK), "gpuhook-runtime")}}


def _podman_hook(d: dict[str, Any], tmp: Path) -> None:
    d["engine"]["hooks_dir"] = [runtimes.BUILTIN_HOOKS_DIR, str(tmp / "hooks.d")]


CASES = [
    Case("containerd-v2-cdi", "containerd", "cdi", "config.toml", CONTAINERD_V2, with_changes(_containerd_v2_cdi),
         "version = 2\n[plugins\n"),
    Case("containerd-v2-hook", "containerd", "hook", "config.toml", CONTAINERD_V2,
         with_changes(_containerd_v2_hook), 'version = 2\nroot = "unterminated\n'),
    Case("containerd-v3-cdi", "containerd", "cdi", "config.toml", CONTAINERD_V3, with_changes(_containerd_v3_cdi),
         "version = 3\nversion = 3\n"),
    Case("crio-cdi", "crio", "cdi", "crio.conf", CRIO, with_changes(_crio_cdi), "[crio.runtime]\nhooks_dir = [\n"),
    Case("crio-hook", "crio", "hook", "crio.conf", CRIO, with_changes(_crio_hook), "[crio\n"),
    Case("docker-cdi", "docker", "cdi", "daemon.json", DOCKER, with_changes(_docker_cdi), '{"features": {"cdi": }'),
    Case("docker-hook", "docker", "hook", "daemon.json", DOCKER, with_changes(_docker_hook), '{"a": 1,}'),
    Case("podman-hook", "podman", "hook", "containers.conf", PODMAN, with_changes(_podman_hook),
         "[engine]\nhooks_dir = /x\n"),
]  # fmt: skip


@pytest.fixture(autouse=True)
def host_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runtimes' default and vendor files, moved under tmp_path/host (absent unless a test writes them), so
    no test reads or writes the real /etc or /usr/share."""
    host = tmp_path / "host"
    for name, default in [("CONTAINERD_CONFIG", "etc/containerd/config.toml"), ("CRIO_CONFIG", "etc/crio/crio.conf"),
                          ("CRIO_DROPIN", "etc/crio/crio.conf.d/99-gpuhook.conf"),
                          ("DOCKER_CONFIG", "etc/docker/daemon.json"),
                          ("PODMAN_CONFIG", "etc/containers/containers.conf"),
                          ("PODMAN_DROPIN", "etc/containers/containers.conf.d/99-gpuhook.conf"),
                          ("PODMAN_VENDOR_CONFIG", "usr/share/containers/containers.conf"),
                          ("DEFAULT_HOOKS_DIR", "etc/containers/oci/hooks.d")]:
        monkeypatch.setattr(runtimes, name, str(host / default))
    from gpuhook.system import units  # no test asks the host's systemd (`gpuhook uninstall` disables units)

    monkeypatch.setattr(units, "SYSTEMD_RUNNING", str(host / "run/systemd/system"))
    return host


def configure(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`runtime configure ARGS`, in CDI mode unless ARGS say otherwise: the default follows the installed
    runtime's version (test_mode_follows_the_installed_version), which these tests must not depend on."""
    mode = [] if "--mode" in args else ["--mode", "cdi"]
    code = main(["runtime", "configure", *args, *mode])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("runtime", "binary", "says", "mode"), [
    ("docker", "dockerd", "Docker version 20.10.24+dfsg1, build 5d6db84", "hook"),
    ("docker", "dockerd", "Docker version 25.0.3, build 4debf41", "cdi"),
    ("containerd", "containerd", "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1", "hook"),
    ("containerd", "containerd", "containerd containerd.io v1.7.2 0cae528dd6cb557f7201036e9f43420650207b58", "cdi"),
])  # fmt: skip
def test_mode_follows_the_installed_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str], runtime: str, binary: str, says: str,
                                            mode: str) -> None:
    """Docker < 25 and containerd 1.6 have no CDI, so `runtime configure` without --mode picks hook."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / binary).write_text(f"#!/bin/sh\necho '{says}'\n")
    (bin_dir / binary).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    config = tmp_path / ("daemon.json" if runtime == "docker" else "config.toml")
    code = main(["runtime", "configure", "--runtime", runtime, "--config", str(config), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 0 and f"note: --mode {mode}: " in err, err


@pytest.fixture
def fake_ctr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `ctr` on PATH whose `ctr oci spec` prints a small default spec (containerd is not installed here)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    ctr = bin_dir / "ctr"
    ctr.write_text('#!/bin/sh\n[ "$1 $2" = "oci spec" ] || exit 2\n'
                   'echo \'{"ociVersion": "1.1.0", "process": {"args": ["sh"]}, "root": {"path": "rootfs"}}\'\n')
    ctr.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return ctr


def comments(text: str) -> list[str]:
    """Every comment (from `#` to the end of the line); values before it may change."""
    return [line[line.index("#"):] for line in text.splitlines() if "#" in line]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- behaviour common to every runtime --------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_configure_keeps_everything_else(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         fake_ctr: Path) -> None:
    config = tmp_path / case.name
    config.write_text(case.original)
    config.chmod(0o640)

    code, out, err = configure(capsys, *case.args(tmp_path))
    assert code == 0, err
    new = config.read_text()
    assert case.parse(new) == case.expect(case.parse(case.original), tmp_path)
    for comment in comments(case.original):
        assert comment in new
    assert f"updated {config} (backup: {config}.gpuhook.bak)" in out
    assert "restart" in out.splitlines()[-1]
    backup = Path(f"{config}.gpuhook.bak")
    assert backup.read_bytes() == case.original.encode()
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    assert stat.S_IMODE(backup.stat().st_mode) == 0o640
    assert not list(tmp_path.glob(f".{case.name}.*")), "no temp file left behind"
    if case.name.endswith(".json"):
        assert new == json.dumps(json.loads(new), indent=2) + "\n", "2-space indent, key order as parsed"
        assert list(json.loads(new))[: len(json.loads(case.original))] == list(json.loads(case.original))

    # A second run finds everything in place: nothing written, no new backup.
    backup.unlink()
    before = tree(tmp_path)
    code, out, err = configure(capsys, *case.args(tmp_path))
    assert code == 0, err
    assert "already configured" in out
    assert tree(tmp_path) == before


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_dry_run_changes_nothing(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 fake_ctr: Path) -> None:
    config = tmp_path / case.name
    config.write_text(case.original)
    before = tree(tmp_path)
    code, out, err = configure(capsys, *case.args(tmp_path), "--dry-run")
    assert code == 0, err
    assert tree(tmp_path) == before
    assert f"--- {config}\n+++ {config}\n" in out
    assert re.search(r"^\+.*(cdi|hooks_dir|base_runtime_spec|gpuhook-runtime)", out, re.M)
    assert "nothing written" in out.splitlines()[-1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_malformed_config_is_one_line_and_untouched(case: Case, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str], fake_ctr: Path) -> None:
    config = tmp_path / case.name
    config.write_text(case.malformed)
    before = tree(tmp_path)
    code, out, err = configure(capsys, *case.args(tmp_path))
    assert code == 1
    assert out == ""
    lines = [line for line in err.splitlines() if not line.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith(f"gpuhook: cannot parse {config}: "), err
    assert tree(tmp_path) == before


# --- containerd -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ['root = "/var/lib/containerd"\n[plugins.cri]\n  enable_selinux = false\n',
                                  "version = 1\n[plugins.cri]\n"])
def test_containerd_version_1_is_refused(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    code, out, err = configure(capsys, "--runtime", "containerd", "--config", str(config))
    assert code == 1
    assert err.startswith(f"gpuhook: {config} is containerd config version 1") and "upgrade" in err
    assert len(err.splitlines()) == 1
    assert config.read_text() == text and not Path(f"{config}.gpuhook.bak").exists()


def test_containerd_hook_mode_writes_the_base_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   fake_ctr: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CONTAINERD_V2)
    code, out, err = configure(capsys, "--runtime", "containerd", "--mode", "hook", "--config", str(config),
                               "--hook-path", HOOK)
    assert code == 0, err
    base = tmp_path / "gpuhook-base-spec.json"
    assert f"created {base}" in out
    assert out.index(str(base)) < out.index(f"updated {config}"), "the spec exists before the config names it"
    spec = json.loads(base.read_text())
    assert spec["process"] == {"args": ["sh"]}, "starts from `ctr oci spec`"
    assert spec["hooks"]["prestart"] == [hookspec.oci_hook(HOOK)]
    assert "containers created before the restart keep their old spec" in err


def test_containerd_hook_mode_extends_an_existing_base_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "my-spec.json"
    other = {"path": "/usr/bin/other-hook"}
    base.write_text(json.dumps({"ociVersion": "1.0.2", "hooks": {"prestart": [other]}}))
    config = tmp_path / "config.toml"
    config.write_text(f'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd]\n'
                      f'  default_runtime_name = "crun"\n'
                      f'[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.crun]\n'
                      f'  runtime_type = "io.containerd.runc.v2"\n  base_runtime_spec = "{base}"\n')
    original = config.read_text()
    code, out, err = configure(capsys, "--runtime", "containerd", "--mode", "hook", "--config", str(config),
                               "--hook-path", HOOK)
    assert code == 0, err
    assert config.read_text() == original, "base_runtime_spec already names a spec: the config stays as it is"
    assert json.loads(base.read_text())["hooks"]["prestart"] == [other, hookspec.oci_hook(HOOK)]
    assert Path(f"{base}.gpuhook.bak").exists()


def test_containerd_hook_mode_without_ctr_says_how(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    code, _, err = configure(capsys, "--runtime", "containerd", "--mode", "hook", "--config", str(config),
                             "--hook-path", HOOK)
    assert code == 1
    assert "ctr oci spec >" in err and config.read_text() == "version = 2\n"


def test_containerd_absent_config_becomes_version_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "containerd" / "config.toml"
    code, out, err = configure(capsys, "--runtime", "containerd", "--config", str(config))
    assert code == 0, err
    assert f"created {config}" in out
    data = tomllib.loads(config.read_text())
    assert data["version"] == 2
    assert data["plugins"]["io.containerd.grpc.v1.cri"] == {"enable_cdi": True, "cdi_spec_dirs": CDI_DIRS}


def test_added_keys_line_up_with_their_neighbours(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CONTAINERD_V2)
    assert configure(capsys, "--runtime", "containerd", "--config", str(config))[0] == 0
    assert '\n    enable_cdi = true # turned off during the 1.7 upgrade\n    cdi_spec_dirs = [' in config.read_text()


# --- CRI-O, podman, Docker specifics ----------------------------------------------------------------------


def test_hook_mode_installs_the_hooks_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "containers.conf"
    hooks = tmp_path / "hooks.d"
    code, out, err = configure(capsys, "--runtime", "podman", "--mode", "hook", "--config", str(config),
                               "--hooks-dir", str(hooks), "--hook-path", HOOK)
    assert code == 0, err
    assert f"created {hooks / 'gpuhook.json'}" in out and f"created {config}" in out
    assert json.loads((hooks / "gpuhook.json").read_text()) == hookspec.hooks_d_config(HOOK)
    assert f"{HOOK} does not exist" in err, "podman would skip the hook silently: say so"
    assert "no restart needed" in out


def test_crio_uses_a_drop_in_when_crio_conf_is_absent(host_files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dropin = Path(runtimes.CRIO_DROPIN)
    dropin.parent.mkdir(parents=True)
    (dropin.parent / "50-site.conf").write_text('[crio.runtime]\ncdi_spec_dirs = ["/site/cdi"]\n')
    code, out, err = configure(capsys, "--runtime", "crio")
    assert code == 0, err
    assert f"created {dropin}" in out
    assert tomllib.loads(dropin.read_text()) == {"crio": {"runtime": {"cdi_spec_dirs": CDI_DIRS}}}
    assert "50-site.conf" not in err, "an earlier drop-in is overridden by ours, not the other way round"

    # Changing an existing drop-in: its backup must not land in crio.conf.d, where CRI-O would read it last.
    code, out, err = configure(capsys, "--runtime", "crio", "--mode", "hook", "--hooks-dir", str(host_files / "h"),
                               "--hook-path", HOOK)
    assert code == 0, err
    assert sorted(p.name for p in dropin.parent.iterdir()) == ["50-site.conf", "99-gpuhook.conf"]
    assert (dropin.parent.parent / "99-gpuhook.conf.gpuhook.bak").is_file()


def test_crio_drop_in_keeps_the_hooks_dirs_of_crio_conf(host_files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main_conf = Path(runtimes.CRIO_CONFIG)
    main_conf.parent.mkdir(parents=True)
    main_conf.write_text('[crio.runtime]\nhooks_dir = ["/usr/share/containers/oci/hooks.d", "/vendor/hooks"]\n')
    dropin = main_conf.parent / "crio.conf.d" / "50-gpu.conf"
    code, _, err = configure(capsys, "--runtime", "crio", "--mode", "hook", "--config", str(dropin),
                             "--hooks-dir", str(host_files / "h"), "--hook-path", HOOK)
    assert code == 0, err
    hooks_dir = tomllib.loads(dropin.read_text())["crio"]["runtime"]["hooks_dir"]
    wanted = ["/usr/share/containers/oci/hooks.d", "/vendor/hooks", str(host_files / "h")]
    assert hooks_dir == wanted, "a drop-in replaces the list, so it must repeat the earlier entries"


def test_podman_uses_a_drop_in_and_keeps_the_vendor_hooks_dirs(host_files: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    vendor = Path(runtimes.PODMAN_VENDOR_CONFIG)
    vendor.parent.mkdir(parents=True)
    vendor.write_text('[engine]\nhooks_dir = ["/usr/share/containers/oci/hooks.d", "/usr/libexec/oci/hooks.d"]\n')
    code, out, err = configure(capsys, "--runtime", "podman", "--mode", "hook", "--hooks-dir", str(host_files / "h"),
                               "--hook-path", HOOK)
    assert code == 0, err
    dropin = Path(runtimes.PODMAN_DROPIN)
    assert f"created {dropin}" in out
    assert not Path(runtimes.PODMAN_CONFIG).exists(), "creating it could hide the vendor file from newer podman"
    assert tomllib.loads(dropin.read_text()) == {
        "engine": {"hooks_dir": ["/usr/share/containers/oci/hooks.d", "/usr/libexec/oci/hooks.d",
                                  str(host_files / "h")]}}


def test_later_drop_in_setting_the_key_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "crio.conf"
    config.write_text(CRIO)
    later = tmp_path / "crio.conf.d" / "10-hooks.conf"
    later.parent.mkdir()
    later.write_text('[crio.runtime]\nhooks_dir = ["/elsewhere"]\n')
    code, _, err = configure(capsys, "--runtime", "crio", "--mode", "hook", "--config", str(config),
                             "--hooks-dir", str(tmp_path / "h"), "--hook-path", HOOK)
    assert code == 0
    assert f"note: {later} also sets crio.runtime.hooks_dir and is read later, so it wins" in err


def test_podman_cdi_needs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "containers.conf"
    code, out, err = configure(capsys, "--runtime", "podman", "--config", str(config))
    assert code == 0
    assert "already configured" in out and "/etc/cdi" in err
    assert not config.exists()


def test_docker_absent_daemon_json_is_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "docker" / "daemon.json"
    code, out, err = configure(capsys, "--runtime", "docker", "--config", str(config))
    assert code == 0, err
    assert config.read_text() == '{\n  "features": {\n    "cdi": true\n  }\n}\n'
    assert stat.S_IMODE(config.stat().st_mode) == 0o644
    assert "Docker >= 25" in err and "systemctl restart docker" in out


def test_docker_features_must_be_an_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "daemon.json"
    config.write_text('{"features": ["cdi"]}\n')
    code, _, err = configure(capsys, "--runtime", "docker", "--config", str(config))
    assert code == 1 and "'features' must be a JSON object" in err
    assert config.read_text() == '{"features": ["cdi"]}\n'


def test_symlinked_config_stays_a_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "real.json"
    real.write_text("{}\n")
    link = tmp_path / "daemon.json"
    link.symlink_to(real)
    assert configure(capsys, "--runtime", "docker", "--config", str(link))[0] == 0
    assert link.is_symlink() and json.loads(real.read_text()) == {"features": {"cdi": True}}


@pytest.mark.parametrize(("args", "message"), [
    (["--runtime", "docker", "--mode", "hook", "--hooks-dir", "/x"], "--hooks-dir only applies to crio and podman"),
    (["--runtime", "podman", "--hook-path", "/x"], "only apply to --mode hook"),
    (["--runtime", "crio", "--mode", "hook", "--hook-path", "bin/hook"], "--hook-path must be an absolute path"),
])  # fmt: skip
def test_option_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = configure(capsys, *args)
    assert code == 1 and out == ""
    assert err.startswith("gpuhook: ") and message in err


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert configure(capsys, "--runtime", "lxc")[0] == 2


# --- the shipped files ------------------------------------------------------------------------------------

OCI_STAGES = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
WHEN_KEYS = {"always", "annotations", "commands", "hasBindMounts"}


def check_oci_hook_file(data: dict[str, Any]) -> None:
    """oci-hooks(5), schema 1.0.0: the fields, an absolute hook path, known stages, at least one condition."""
    assert set(data) == {"version", "hook", "when", "stages"}
    assert data["version"] == "1.0.0"
    hook = data["hook"]
    assert set(hook) <= {"path", "args", "env", "timeout"}
    assert isinstance(hook["path"], str) and os.path.isabs(hook["path"])
    assert all(isinstance(a, str) for a in hook.get("args", []))
    assert all(isinstance(e, str) and "=" in e for e in hook.get("env", []))
    assert "timeout" not in hook or (isinstance(hook["timeout"], int) and hook["timeout"] > 0)
    when = data["when"]
    assert isinstance(when, dict) and when and set(when) <= WHEN_KEYS
    assert any(when[k] not in (None, False, {}, []) for k in when), "at least one condition"
    assert isinstance(data["stages"], list) and data["stages"] and set(data["stages"]) <= OCI_STAGES


def test_shipped_hook_file_follows_oci_hooks_5() -> None:
    data = json.loads(HOOK_FILE.read_text())
    check_oci_hook_file(data)
    assert data["when"] == {"always": True}
    assert data["stages"] == ["prestart"]
    assert data["hook"]["args"] == ["gpuhook-hook", "prestart"]
    assert data["hook"]["env"] == ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    # The file a user copies is exactly what `runtime configure` installs for the default path.
    assert HOOK_FILE.read_text() == hookspec.render_json(hookspec.hooks_d_config(hookspec.DEFAULT_HOOK_PATH))


def test_runtime_config_snippets_say_what_configure_does() -> None:
    def toml(name: str) -> dict[str, Any]:
        return tomllib.loads((SNIPPETS / name).read_text())

    def js(name: str) -> dict[str, Any]:
        return json.loads((SNIPPETS / name).read_text())

    prestart = [hookspec.oci_hook(hookspec.DEFAULT_HOOK_PATH)]
    assert js("runc-config-hooks.json") == {"hooks": {"prestart": prestart}}
    assert js("containerd-1.6-base-spec-hooks.json") == {"hooks": {"prestart": prestart}}
    v16 = toml("containerd-1.6.toml")
    assert v16["version"] == 2
    runc = v16["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"]
    assert runc == {"runtime_type": "io.containerd.runc.v2",
                    "base_runtime_spec": "/etc/containerd/gpuhook-base-spec.json"}
    v17 = toml("containerd-1.7.toml")
    assert v17["version"] == 2 and v17["plugins"]["io.containerd.grpc.v1.cri"] == {
        "enable_cdi": True, "cdi_spec_dirs": CDI_DIRS}
    v2 = toml("containerd-2.toml")
    assert v2["version"] == 3 and v2["plugins"]["io.containerd.cri.v1.runtime"] == {
        "enable_cdi": True, "cdi_spec_dirs": CDI_DIRS}
    hooks_dirs = ["/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d"]
    assert toml("crio-99-gpuhook.conf") == {"crio": {"runtime": {"cdi_spec_dirs": CDI_DIRS, "hooks_dir": hooks_dirs}}}
    assert toml("podman-containers.conf") == {"engine": {"hooks_dir": hooks_dirs}}
    assert js("docker-daemon-cdi.json") == {"features": {"cdi": True}}
    assert js("docker-daemon-runtimes.json") == {"runtimes": {"gpuhook": {"path": "/usr/local/bin/gpuhook-runtime"}}}


# --- podman 4.3.1 runs it ---------------------------------------------------------------------------------

RECORDER = """#!/bin/sh
# Stand-in for gpuhook-hook: record that podman ran it, with what.
out={out}
cat > "$out/state.json"
echo "$*" > "$out/args"  # argv[0] is lost: the kernel runs "sh <script> <args>"
env > "$out/env"
"""


@pytest.fixture
def podman_world(tmp_path: Path):  # type: ignore[no-untyped-def]
    from support.podman import Podman, need_podman
    from support.runc import busybox_rootfs, need_busybox

    podman = need_podman()
    need_busybox()
    world = Podman.create(tmp_path / "world", podman)
    try:
        yield world, busybox_rootfs(tmp_path / "image")
    finally:
        world.close()


def recorder(folder: Path) -> tuple[Path, Path]:
    """A hook script that writes what it got into `folder`/out; returns (script, out)."""
    out = folder / "out"
    out.mkdir(parents=True)
    script = folder / "record-hook"
    script.write_text(RECORDER.format(out=out))
    script.chmod(0o755)
    return script, out


def podman_true(world: Any, rootfs: Path, *global_flags: str, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    cmd = world.run_command(rootfs, [], ["true"], global_flags=global_flags)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})


def assert_recorded(out: Path) -> None:
    assert (out / "args").read_text().split() == ["prestart"]
    state = json.loads((out / "state.json").read_text())
    assert state["pid"] > 0 and os.path.isabs(state["bundle"]) and state["id"]
    env = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines() if "=" in line)
    env.pop("PWD", None)  # set by the shell itself
    env.pop("SHLVL", None)
    assert env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, "only the hook's env"


@pytest.mark.e2e
def test_podman_runs_the_shipped_hook_file(podman_world: Any, tmp_path: Path) -> None:
    world, rootfs = podman_world
    script, out = recorder(tmp_path / "rec")
    hooks = tmp_path / "hooks.d"
    hooks.mkdir()
    data = json.loads(HOOK_FILE.read_text())
    data["hook"]["path"] = str(script)
    (hooks / "gpuhook.json").write_text(json.dumps(data))

    result = podman_true(world, rootfs, "--hooks-dir", str(hooks), env={"LEAKME": "1"})
    assert result.returncode == 0, result.stderr
    assert_recorded(out)


@pytest.mark.e2e
def test_podman_follows_a_configured_containers_conf(podman_world: Any, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    world, rootfs = podman_world
    script, out = recorder(tmp_path / "rec")
    conf = tmp_path / "containers.conf"
    conf.write_text(PODMAN)
    only_this = {"CONTAINERS_CONF": str(conf)}  # podman then reads this file and no other

    assert podman_true(world, rootfs, env=only_this).returncode == 0
    assert not (out / "args").exists(), "not configured yet: no hook"

    code, _, err = configure(capsys, "--runtime", "podman", "--mode", "hook", "--config", str(conf),
                             "--hooks-dir", str(tmp_path / "hooks.d"), "--hook-path", str(script))
    assert code == 0, err
    result = podman_true(world, rootfs, env=only_this)
    assert result.returncode == 0, result.stderr
    assert_recorded(out)


def test_recorder_needs_no_podman(tmp_path: Path) -> None:
    """The recorder itself works (so a failing e2e test points at podman, not at the stand-in)."""
    script, out = recorder(tmp_path)
    subprocess.run([str(script), "prestart"], input='{"pid": 1, "bundle": "/b", "id": "x"}', text=True,
                   check=True, env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    assert_recorded(out)


# --- containerd's base spec carries only what CRI applies anyway ---------------

# `ctr oci spec` of containerd 1.7 (oci.populateDefaultUnixSpec), capabilities and paths shortened.
CTR_OCI_SPEC = {
    "ociVersion": "1.1.0",
    "process": {"user": {"uid": 0, "gid": 0}, "cwd": "/",
                "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL"], "effective": ["CAP_CHOWN", "CAP_KILL"],
                                 "permitted": ["CAP_CHOWN", "CAP_KILL"]},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}], "noNewPrivileges": True},
    "root": {"path": "rootfs"},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
               {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
               {"destination": "/run", "type": "tmpfs", "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}],
    "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]},
              "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                             {"type": "network"}],
              "maskedPaths": ["/proc/acpi", "/proc/kcore"], "readonlyPaths": ["/proc/bus", "/proc/sys"]},
}


@pytest.fixture
def containerd_ctr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "ctrbin"
    bin_dir.mkdir()
    ctr = bin_dir / "ctr"
    ctr.write_text(f'#!/bin/sh\n[ "$1 $2" = "oci spec" ] || exit 2\ncat <<\'END\'\n{json.dumps(CTR_OCI_SPEC)}\nEND\n')
    ctr.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return ctr


def test_containerd_base_spec_changes_nothing_but_the_hook(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           containerd_ctr: Path) -> None:
    """CRI drops the default spec's rlimits (containerd/cri#515) and /run mount; a base spec that kept them
    would cap every container on the node at 1024 open files (kubernetes-sigs/kind#2532)."""
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    code, _, err = configure(capsys, "--runtime", "containerd", "--mode", "hook", "--config", str(config),
                             "--hook-path", HOOK)
    assert code == 0, err
    spec = json.loads((tmp_path / "gpuhook-base-spec.json").read_text())
    wanted = copy.deepcopy(CTR_OCI_SPEC)
    del wanted["process"]["rlimits"]  # type: ignore[attr-defined]
    wanted["mounts"] = [m for m in wanted["mounts"] if m["destination"] != "/run"]  # type: ignore[index,union-attr]
    wanted["hooks"] = {"prestart": [hookspec.oci_hook(HOOK)]}
    assert spec == wanted


def test_hook_mode_passes_the_hooks_config(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           containerd_ctr: Path) -> None:
    hook_config = "/etc/gpuhook/site.toml"
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    code, _, err = configure(capsys, "--runtime", "containerd", "--mode", "hook", "--config", str(config),
                             "--hook-path", HOOK, "--hook-config", hook_config)
    assert code == 0, err
    entry = json.loads((tmp_path / "gpuhook-base-spec.json").read_text())["hooks"]["prestart"]
    assert entry == [{"path": HOOK, "args": ["gpuhook-hook", "--config", hook_config, "prestart"],
                      "env": list(hookspec.HOOK_ENV)}]
    # configuring again with another config updates the one entry, never adds a second
    code, _, err = configure(capsys, "--runtime", "containerd", "--mode", "hook", "--config", str(config),
                             "--hook-path", HOOK)
    assert code == 0, err
    assert json.loads((tmp_path / "gpuhook-base-spec.json").read_text())["hooks"]["prestart"] == [
        hookspec.oci_hook(HOOK)]

    hooks = tmp_path / "hooks.d"
    code, _, err = configure(capsys, "--runtime", "podman", "--mode", "hook", "--config", str(tmp_path / "c.conf"),
                             "--hooks-dir", str(hooks), "--hook-path", HOOK, "--hook-config", hook_config)
    assert code == 0, err
    assert json.loads((hooks / "gpuhook.json").read_text())["hook"]["args"] == [
        "gpuhook-hook", "--config", hook_config, "prestart"]

    code, _, err = configure(capsys, "--runtime", "docker", "--mode", "hook", "--config", str(tmp_path / "d.json"),
                             "--hook-config", hook_config)
    assert code == 1 and "GPUHOOK_CONFIG" in err and not (tmp_path / "d.json").exists()
    code, _, err = configure(capsys, "--runtime", "podman", "--mode", "hook", "--config", str(tmp_path / "c.conf"),
                             "--hooks-dir", str(hooks), "--hook-config", "site.toml")
    assert code == 1 and "--hook-config must be an absolute path" in err


def test_hook_mode_defaults_to_the_installed_entry_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --hook-path the hook is where `gpuhook hook install` writes it."""
    hooks = tmp_path / "hooks.d"
    code, _, err = configure(capsys, "--runtime", "podman", "--mode", "hook", "--config", str(tmp_path / "c.conf"),
                             "--hooks-dir", str(hooks))
    assert code == 0, err
    assert json.loads((hooks / "gpuhook.json").read_text())["hook"]["path"] == "/usr/local/bin/gpuhook-hook"


# --- daemon.json keeps its layout ---------------------------------------------

@pytest.mark.parametrize("indent", ["    ", "\t", None], ids=["4-spaces", "tab", "one-line"])
def test_docker_edit_keeps_indent_and_key_order(indent: str | None, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    original_data = {"storage-driver": "overlay2", "log-level": "warn", "registry-mirrors": ["https://m.local"],
                     "data-root": "/srv/docker"}
    original = json.dumps(original_data, indent=indent) + "\n"
    config = tmp_path / "daemon.json"
    config.write_text(original)
    code, out, err = configure(capsys, "--runtime", "docker", "--config", str(config), "--dry-run")
    assert code == 0, err
    removed = [line for line in out.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")]
    if indent is None:
        assert len(removed) == 1 and len(added) == 1  # one line, rewritten
    else:
        assert removed == [f'-{indent}"data-root": "/srv/docker"'], out  # only the comma it gains
        assert added == [f'+{indent}"data-root": "/srv/docker",', f'+{indent}"features": {{',
                         f'+{indent}{indent}"cdi": true', f'+{indent}}}'], out
    code, out, err = configure(capsys, "--runtime", "docker", "--config", str(config))
    assert code == 0, err
    assert config.read_text() == json.dumps({**original_data, "features": {"cdi": True}}, indent=indent) + "\n"


def test_docker_notes_a_default_runtime_it_leaves_in_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = tmp_path / "daemon.json"
    daemon.write_text('{"default-runtime": "nvidia", "runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}')
    code, _, err = configure(capsys, "--runtime", "docker", "--config", str(daemon))
    assert code == 0
    assert "\"default-runtime\": \"nvidia\" left in place: every container still goes through 'nvidia' (NVIDIA's" in err
    assert json.loads(daemon.read_text())["default-runtime"] == "nvidia"


@pytest.mark.parametrize(("runtime", "args", "expected"), [
    ("containerd", ["--config", "/a.toml", "-c", "/b.toml"], "/b.toml"),  # the last one wins, as Go's flags do
    ("containerd", ["-c=/a.toml", "--log-level", "debug"], "/a.toml"),
    ("crio", ["--config=/etc/crio/x.conf"], "/etc/crio/x.conf"),
    ("docker", ["--config-file", "/d.json", "--config", "/not-dockerd's"], "/d.json"),
    ("containerd", ["--config"], None),  # a flag with no value names nothing
    ("crio", [], None),
])
def test_a_daemons_config_option_is_read_as_it_reads_it(runtime: str, args: list[str], expected: str | None) -> None:
    """doctor and node-setup find a running daemon's config file with one reading of its command line."""
    from gpuhook.runtimeconfig.runtimes import CONFIG_OPTIONS, option_value

    assert option_value(args, CONFIG_OPTIONS[runtime]) == expected
