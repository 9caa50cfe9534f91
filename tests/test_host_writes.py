"""Files the user names are written without harming what is at the path.

`generate-cdi` with its output set to the host's null device once turned /dev/null into a 0644 file holding a
spec. Every special file here is made in a temporary directory (a char device 1:3 like /dev/null, a FIFO, a unix
socket, a directory): the host's /dev is never written.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.e2e import need_root

from gpuhook.cli.app import main
from gpuhook.fakedriver import FakeDriver
from gpuhook.fileio.atomic import WriteError, write_atomic

SPEC_ARGS = ("--hook-path", "/usr/local/bin/gpuhook-hook")


def null_node(folder: Path) -> Path:
    """A character device 1:3 (what /dev/null is), mode 0666, in `folder`."""
    need_root()
    node = folder / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.chmod(node, 0o666)
    return node


def same_node(path: Path) -> None:
    st = os.lstat(path)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3), "the node was replaced"
    assert stat.S_IMODE(st.st_mode) == 0o666, "the node was chmodded"


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    yield path
    sock.close()


def only(folder: Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names), "a temp file was left behind"


# --- write_atomic ------------------------------------------------------------------------------------------------

def test_a_character_device_is_written_in_place(tmp_path: Path) -> None:
    node = null_node(tmp_path)
    assert write_atomic(str(node), b"spec\n") is False
    same_node(node)
    only(tmp_path, "null")


def test_a_symlink_to_a_character_device_is_written_through(tmp_path: Path) -> None:
    node = null_node(tmp_path)
    link = tmp_path / "out.yaml"
    link.symlink_to(node)
    write_atomic(str(link), b"spec\n")
    assert link.is_symlink() and os.readlink(link) == str(node)
    same_node(node)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(WriteError, match=rf"^cannot write {fifo}: it is a FIFO"):
        write_atomic(str(fifo), b"spec\n")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    only(tmp_path, "fifo")


def test_a_socket_is_refused(tmp_path: Path, unix_socket: Path) -> None:
    with pytest.raises(WriteError, match=rf"^cannot write {unix_socket}: it is a socket"):
        write_atomic(str(unix_socket), b"spec\n")
    assert stat.S_ISSOCK(os.lstat(unix_socket).st_mode)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "out.yaml"
    folder.mkdir()
    with pytest.raises(WriteError, match=rf"^cannot write {folder}: it is a directory"):
        write_atomic(str(folder), b"spec\n")
    assert folder.is_dir() and not any(folder.iterdir())
    only(tmp_path, "out.yaml")


def test_a_symlink_is_replaced_never_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real.yaml"
    real.write_text("old\n")
    real.chmod(0o600)
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert write_atomic(str(link), b"new\n", 0o644) is True
    assert not link.is_symlink() and link.read_text() == "new\n"
    assert real.read_text() == "old\n" and stat.S_IMODE(real.stat().st_mode) == 0o600


def test_own_descriptor_paths_write_to_that_descriptor(tmp_path: Path) -> None:
    # only paths whose directory is procfs: a writer that renames over the path cannot create anything there
    for alias in ("/proc/self/fd/{}", f"/proc/{os.getpid()}/fd/{{}}", "/proc/thread-self/fd/{}"):
        read_end, write_end = os.pipe()
        try:
            assert write_atomic(alias.format(write_end), b"through the pipe\n") is False
        finally:
            os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            assert pipe.read() == b"through the pipe\n"
    only(tmp_path)


def test_temp_files_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    child.wait()  # its pid has exited: the temp file it "left" is stale
    stale = tmp_path / f".spec.yaml.{child.pid}.0123456789ab.tmp"
    stale.write_bytes(b"")
    other = tmp_path / ".other.yaml.1.0123456789ab.tmp"  # another file's temp: not ours to remove
    other.write_bytes(b"")
    write_atomic(str(tmp_path / "spec.yaml"), b"x\n")
    only(tmp_path, "spec.yaml", other.name)


# --- the commands that write a file the user names ---------------------------------------------------------------

def gpuhook(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuhook.cli", *args], capture_output=True, text=True, check=False)


def generate(fake: FakeDriver, output: str) -> subprocess.CompletedProcess[str]:
    return gpuhook("generate-cdi", "--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc"),
                   *SPEC_ARGS, "--output", output)


def test_generate_cdi_output_to_a_device_node(fake_driver: FakeDriver, tmp_path: Path) -> None:
    node = null_node(tmp_path)
    result = generate(fake_driver, str(node))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    same_node(node)


def test_generate_cdi_output_to_a_fifo_is_one_line(fake_driver: FakeDriver, tmp_path: Path) -> None:
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    result = generate(fake_driver, str(fifo))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"gpuhook: cannot write {fifo}: it is a FIFO, not a regular file"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_generate_cdi_output_to_stdout(fake_driver: FakeDriver, tmp_path: Path) -> None:
    """An output path that is the stdout link writes to the command's stdout (here a pipe), as no --output does.
    The path is a link of our own made like /dev/stdout (-> /proc/self/fd/1): a writer that replaces the path (the
    bug this guards against) must replace that link, never the host's /dev/stdout."""
    stdout = tmp_path / "stdout"
    stdout.symlink_to("/proc/self/fd/1")
    result = generate(fake_driver, str(stdout))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cdiVersion:") and result.stderr == ""
    assert os.readlink(stdout) == "/proc/self/fd/1"


def test_hook_install_to_a_device_node(tmp_path: Path) -> None:
    node = null_node(tmp_path)
    assert main(["hook", "install", "--path", str(node)]) == 0
    same_node(node)


def test_runtime_configure_refuses_special_files(tmp_path: Path, unix_socket: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    node = null_node(tmp_path)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    folder = tmp_path / "dir.json"
    folder.mkdir()
    for path, kind in ((node, "a character device"), (fifo, "a FIFO"), (unix_socket, "a socket"),
                       (folder, "a directory")):
        runtime = "docker" if path.suffix == ".json" else "containerd"
        code = main(["runtime", "configure", "--runtime", runtime, "--mode", "cdi", "--config", str(path)])
        err = capsys.readouterr().err
        assert code == 1 and err.splitlines() == [f"gpuhook: cannot use {path}: it is {kind}, not a regular file"], err
    same_node(node)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and folder.is_dir()
    only(tmp_path, "null", "fifo.toml", "dir.json", "sock")


def test_the_session_check_sees_every_kind_of_change(tmp_path: Path) -> None:
    """tests/conftest.py fails the suite when a watched host path changes (support/hostpaths.py): a file
    created, appended to or removed, an entry added below a folder."""
    from support.hostpaths import host_changes, host_snapshot

    log, folder = tmp_path / "gpuhook.log", tmp_path / "docker"
    folder.mkdir()
    watched = (str(log), str(folder))
    before = host_snapshot(watched)
    assert host_changes(before, host_snapshot(watched)) == []
    log.write_text("x\n")
    assert host_changes(before, host_snapshot(watched)) == [f"{log} created"]
    (folder / "key.json").write_text("{}")
    changed = host_changes(before, host_snapshot(watched))
    assert f"{folder}/key.json created" in changed and f"{folder} changed" in changed
    before = host_snapshot(watched)
    with log.open("a") as f:
        f.write("more\n")
    log_changed = host_changes(before, host_snapshot(watched))
    assert log_changed == [f"{log} changed"]
    log.unlink()
    assert host_changes(before, host_snapshot(watched)) == [f"{log} removed"]
