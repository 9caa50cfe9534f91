"""`runtime unconfigure`, `hook uninstall` and `gpuhook uninstall`: a host put back as it was before gpuhook, to
the byte (content and mode of every file), and nothing removed that gpuhook did not write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from test_runtimeconfig import CASES, Case, configure, fake_ctr, host_files  # noqa: F401 - fixtures

from gpuhook.cli import entry
from gpuhook.cli.app import main
from gpuhook.runtimeconfig import runtimes


def snapshot(top: Path, skip: tuple[str, ...] = ("fakebin",)) -> dict[str, tuple[int, bytes | str]]:
    """Every path under `top`: its mode and content (a link's target)."""
    found: dict[str, tuple[int, bytes | str]] = {}
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            body: bytes | str = os.readlink(path) if stat.S_ISLNK(st.st_mode) else Path(path).read_bytes()
            found[os.path.relpath(path, top)] = (st.st_mode, body)
    return found


def unconfigure(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["runtime", "unconfigure", *args])
    out, err = capsys.readouterr()
    return code, out, err


def undo_args(case: Case, tmp: Path) -> list[str]:
    args = ["--runtime", case.runtime, "--config", str(tmp / case.name)]
    return args + (["--hooks-dir", str(tmp / "hooks.d")] if case.runtime in ("crio", "podman") else [])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_unconfigure_puts_every_file_back_to_the_byte(case: Case, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str], fake_ctr: Path) -> None:  # noqa: F811
    config = tmp_path / case.name
    config.write_text(case.original)
    config.chmod(0o640)
    (tmp_path / "hooks.d").mkdir()
    (tmp_path / "hooks.d" / "other.json").write_text('{"someone": "else"}\n')
    before = snapshot(tmp_path)
    code, _, err = configure(capsys, *case.args(tmp_path))
    assert code == 0, err
    assert snapshot(tmp_path) != before
    # a second configure (the other mode where there is one) must not make the first edit the backup
    other = [c for c in CASES if c.runtime == case.runtime and c.mode != case.mode]
    if other and case.runtime != "podman":
        code, _, err = configure(capsys, *other[0].args(tmp_path))
        assert code == 0, err

    code, out, err = unconfigure(capsys, *undo_args(case, tmp_path))
    assert code == 0, err
    assert f"restored {config} from {config}.gpuhook.bak" in out
    assert snapshot(tmp_path) == before
    code, out, _ = unconfigure(capsys, *undo_args(case, tmp_path))  # nothing left to put back
    assert code == 0 and "nothing of gpuhook's to put back" in out
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("runtime", ["docker", "crio", "podman", "containerd"])
def test_files_configure_created_are_removed(runtime: str, tmp_path: Path, host_files: Path,  # noqa: F811
                                             capsys: pytest.CaptureFixture[str], fake_ctr: Path) -> None:  # noqa: F811
    """No config before: configure creates one (and the hooks.d file, the base spec); unconfigure removes them."""
    host_files.mkdir(parents=True, exist_ok=True)
    before = snapshot(tmp_path)
    mode = "cdi" if runtime == "docker" else "hook"
    code, _, err = configure(capsys, "--runtime", runtime, "--mode", mode,
                             *(["--hook-path", "/usr/local/bin/gpuhook-hook"] if mode == "hook" else []))
    assert code == 0, err
    assert snapshot(tmp_path) != before
    code, out, err = unconfigure(capsys, "--runtime", runtime)
    assert code == 0, err
    assert "removed " in out
    assert snapshot(tmp_path) == before


def test_a_file_edited_without_a_backup_is_left_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            host_files: Path) -> None:  # noqa: F811
    daemon = Path(runtimes.DOCKER_CONFIG)
    daemon.parent.mkdir(parents=True)
    daemon.write_text('{"features": {"cdi": true}, "debug": true}\n')  # configured by hand, no backup
    code, out, err = unconfigure(capsys, "--runtime", "docker")
    assert code == 0
    assert "nothing of gpuhook's to put back" in out and "no backup" in err
    assert daemon.read_text() == '{"features": {"cdi": true}, "debug": true}\n'


def test_dry_run_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = next(c for c in CASES if c.id == "docker-cdi")
    config = tmp_path / case.name
    config.write_text(case.original)
    assert configure(capsys, *case.args(tmp_path))[0] == 0
    configured = snapshot(tmp_path)
    code, out, _ = unconfigure(capsys, *undo_args(case, tmp_path), "--dry-run")
    assert code == 0 and f"dry run: would restore {config}" in out
    assert snapshot(tmp_path) == configured


def test_hook_uninstall_removes_only_what_install_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hook = tmp_path / "bin" / "gpuhook-hook"
    hook.parent.mkdir()
    before = snapshot(tmp_path)
    written = entry.install(str(hook), docker_gpus=True)
    assert len(written) >= 2
    foreign = tmp_path / "bin" / "other-hook"
    foreign.write_text("#!/bin/sh\n")
    before_with_foreign = snapshot(tmp_path)
    assert main(["hook", "uninstall", "--path", str(hook), "--docker-gpus"]) == 0
    out = capsys.readouterr().out
    assert sorted(out.splitlines()) == sorted(f"gpuhook: removed {w}" for w in written)
    assert snapshot(tmp_path) == {k: v for k, v in before_with_foreign.items()
                                  if not any(k == os.path.relpath(w, tmp_path) for w in written)}
    foreign.unlink()
    assert snapshot(tmp_path) == before
    # a file at the path that gpuhook did not write is never removed
    hook.write_text("#!/bin/sh\necho someone else's\n")
    assert main(["hook", "uninstall", "--path", str(hook)]) == 0
    assert "nothing removed" in capsys.readouterr().out and hook.exists()


def test_gpuhook_uninstall_puts_a_host_back(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            host_files: Path, fake_ctr: Path) -> None:  # noqa: F811
    """Every runtime at its default path, configured, and the hook installed: `gpuhook uninstall` undoes all."""
    daemon = Path(runtimes.DOCKER_CONFIG)
    daemon.parent.mkdir(parents=True)
    daemon.write_text('{\n\t"debug": true\n}')  # a tab indent and no final newline: kept to the byte
    daemon.chmod(0o600)
    containerd = Path(runtimes.CONTAINERD_CONFIG)
    containerd.parent.mkdir(parents=True)
    containerd.write_text("version = 2\n# mine\n")
    hook = tmp_path / "bin" / "gpuhook-hook"
    hook.parent.mkdir()
    before = snapshot(tmp_path)
    entry.install(str(hook))
    for args in (["--runtime", "docker", "--mode", "cdi"], ["--runtime", "containerd", "--mode", "cdi"],
                 ["--runtime", "crio", "--mode", "hook", "--hook-path", str(hook)],
                 ["--runtime", "podman", "--mode", "hook", "--hook-path", str(hook)]):
        code, _, err = configure(capsys, *args)
        assert code == 0, err
    assert main(["uninstall", "--hook-path", str(hook), "--dry-run"]) == 0
    capsys.readouterr()
    assert snapshot(tmp_path) != before
    assert main(["uninstall", "--hook-path", str(hook)]) == 0
    out = capsys.readouterr().out
    assert f"removed {hook}" in out
    assert snapshot(tmp_path) == before


def test_gpuhook_uninstall_disables_the_enabled_units(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      host_files: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The CDI refresh and the service's socket, enabled by the package (or by hand): disabled and stopped by
    `gpuhook uninstall` through systemctl (here a fake that records its calls), said first by --dry-run."""
    (host_files / "run/systemd/system").mkdir(parents=True)
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    calls = tmp_path / "calls"
    systemctl = fakebin / "systemctl"
    systemctl.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                         'case "$1 $2" in "is-enabled gpuhook.service") echo static;; "is-enabled "*) echo enabled;; '
                         "esac\n")
    systemctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    hook = tmp_path / "gpuhook-hook"
    assert main(["uninstall", "--hook-path", str(hook), "--dry-run"]) == 0
    assert "dry run: would disable and stop gpuhook-cdi-refresh.service\n" in capsys.readouterr().out
    assert "disable" not in calls.read_text().replace("is-enabled", "")
    assert main(["uninstall", "--hook-path", str(hook)]) == 0
    out = capsys.readouterr().out
    assert "disabled and stopped gpuhook-cdi-refresh.service\ndisabled and stopped gpuhook.socket\n" in out
    assert [c for c in calls.read_text().splitlines() if c.startswith("disable")] == [
        "disable --now gpuhook-cdi-refresh.service", "disable --now gpuhook.socket"]
    calls.unlink()
    assert main(["uninstall", "--runtime", "docker", "--hook-path", str(hook)]) == 0  # one runtime: units stay
    assert not calls.exists() or "disable" not in calls.read_text().replace("is-enabled", "")
