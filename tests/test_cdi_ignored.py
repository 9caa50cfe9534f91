"""A runtime that ignores CDI devices is made visible. The record a hook or shim leaves (written for real into a
temp state dir) only for a marker this node's plugin sealed, and the device plugin's watcher (a real directory,
real inotify) that logs it once."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuhook.fileio.secret import ensure_secret
from gpuhook.hook import cdiignored as hook_record
from gpuhook.model import cdiignored
from gpuhook.model.contract import CDI_IGNORED_RECORD, PLUGIN_KEY, SERVICE_SOCKET, STATE_DIR
from gpuhook.plugin.cdiignored import CdiIgnoredWatch

NAMES = ("nvidia.com/gpu=GPU-a", "nvidia.com/gpu=GPU-b")


def record(state_dir: str, container_id: str, names: tuple[str, ...]) -> str:
    """hook/cdiignored.record for a marker sealed as the plugin seals it, with the node's key in `state_dir`
    (made there as the plugin makes it, in the folder a node has for it, when a folder can be had there)."""
    if state_dir:
        with contextlib.suppress(OSError):
            os.makedirs(state_dir, exist_ok=True)
    key = ensure_secret(os.path.join(state_dir, PLUGIN_KEY)) if state_dir else b""
    return hook_record.record(state_dir, container_id, names, cdiignored.seal(key, ",".join(names)))


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpuhook.plugin.cdiignored"
            and r.levelno == logging.WARNING]


# -- the record ------------------------------------------------------------------------------------------------------


def test_record_is_a_regular_file_the_plugin_parses(tmp_path: Path) -> None:
    state = tmp_path / "state"  # made by record() as a node's hostPath makes /run/gpuhook/records
    note = record(str(state), "c0ffee", NAMES)
    path = state / CDI_IGNORED_RECORD
    assert note == f"runtime ignored CDI devices {','.join(NAMES)}: recorded in {path}"
    assert path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o644
    rec = cdiignored.parse(path.read_bytes())
    assert rec is not None and (rec.container, rec.devices) == ("c0ffee", ",".join(NAMES))
    assert rec.time.endswith("Z") and len(rec.time) == 20
    assert sorted(p.name for p in state.iterdir()) == [CDI_IGNORED_RECORD, PLUGIN_KEY]  # no temp file left
    assert (state / PLUGIN_KEY).stat().st_mode & 0o777 == 0o600


def test_the_newest_record_is_kept(tmp_path: Path) -> None:
    record(str(tmp_path), "first", NAMES)
    assert record(str(tmp_path), "second", NAMES[:1]).endswith(f"recorded in {tmp_path / CDI_IGNORED_RECORD}")
    rec = cdiignored.parse((tmp_path / CDI_IGNORED_RECORD).read_bytes())
    assert rec is not None and (rec.container, rec.devices) == ("second", NAMES[0])  # one file per node


@pytest.mark.parametrize("marker", [",".join(NAMES), ",".join(NAMES) + ";" + "0" * 32, ",".join(NAMES) + ";x"],
                         ids=["unsealed", "wrong-seal", "short-seal"])
def test_a_marker_the_plugin_did_not_seal_leaves_no_record(tmp_path: Path, marker: str) -> None:
    """An image that sets GPUHOOK_CDI_DEVICES itself cannot know the node's key: no record, so none it forges
    can mask a real one; the log line says why."""
    record(str(tmp_path), "real", NAMES)
    before = (tmp_path / CDI_IGNORED_RECORD).read_bytes()
    note = hook_record.record(str(tmp_path), "forged", NAMES, marker)
    assert note.endswith("; no record: the marker is not sealed by this node's device plugin")
    assert (tmp_path / CDI_IGNORED_RECORD).read_bytes() == before
    other_key = cdiignored.seal(b"another node", ",".join(NAMES))
    assert "no record" in hook_record.record(str(tmp_path), "other", NAMES, other_key)


def test_a_key_anyone_may_read_is_no_key(tmp_path: Path) -> None:
    record(str(tmp_path), "real", NAMES)
    (tmp_path / PLUGIN_KEY).chmod(0o644)
    key = (tmp_path / PLUGIN_KEY).read_bytes().strip()
    assert "no record" in hook_record.record(str(tmp_path), "c", NAMES, cdiignored.seal(key, ",".join(NAMES)))


def test_a_link_at_the_record_is_neither_followed_nor_replaced(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("host file\n")
    link = tmp_path / "state" / CDI_IGNORED_RECORD
    link.parent.mkdir()
    link.symlink_to(target)
    note = record(str(link.parent), "c1", NAMES)
    assert note.startswith(f"runtime ignored CDI devices {','.join(NAMES)}; no record: ") and "a link" in note
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "host file\n"
    dangling = tmp_path / "state2" / CDI_IGNORED_RECORD  # a link to nothing is not written through either
    dangling.parent.mkdir()
    dangling.symlink_to(tmp_path / "nowhere")
    assert "no record" in record(str(dangling.parent), "c1", NAMES)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_something_else_at_the_record_is_a_note_not_a_failure(tmp_path: Path, kind: str) -> None:
    path = tmp_path / CDI_IGNORED_RECORD
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    assert "; no record: " in record(str(tmp_path), "c1", NAMES)  # never blocks on the FIFO, never raises


def test_an_unusable_state_dir_is_a_note(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert "; no record: " in record(str(tmp_path / "file"), "c1", NAMES)
    assert record("", "c1", NAMES) == f"runtime ignored CDI devices {','.join(NAMES)}"  # state-dir = "": none


def test_record_is_bounded_and_one_line_per_value(tmp_path: Path) -> None:
    hostile_id = "x" * 100_000 + "\nforged line"
    names = tuple(f"nvidia.com/gpu=GPU-{i}\ncontainer evil" for i in range(3000))
    record(str(tmp_path), hostile_id, names)
    data = (tmp_path / CDI_IGNORED_RECORD).read_bytes()
    assert len(data) < cdiignored.MAX_BYTES
    assert [line.split(" ", 1)[0] for line in data.decode().splitlines()] == ["container", "cdi-devices", "time"]
    rec = cdiignored.parse(data)
    assert rec is not None and rec.container.startswith("xxx") and "characters)" in rec.container
    assert "\\x0acontainer evil" in rec.devices and rec.devices.endswith("characters)")  # escaped, clipped
    assert len(rec.container) < 200 and len(rec.devices) < 1100


@pytest.mark.parametrize("data", [b"", b"container c1\n", b"cdi-devices a\n", b"\xff\xfe garbage", b"x" * 10_000])
def test_parse_refuses_what_is_not_a_record(data: bytes) -> None:
    assert cdiignored.parse(data) is None


# -- the plugin's watcher --------------------------------------------------------------------------------------------


def test_a_record_already_there_at_start_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record(str(tmp_path), "c-early", NAMES)
    watch = CdiIgnoredWatch(str(tmp_path))
    watch.start()
    try:
        wait_for(lambda: watch.reported is not None)
    finally:
        watch.stop()
    (line,) = warnings(caplog)
    assert line.startswith(f"the container runtime ignored the CDI devices of container c-early ({','.join(NAMES)})"
                           " at ")
    assert line.endswith(": its GPUs came through NVIDIA_VISIBLE_DEVICES and gpuhook's hook/shim; enable CDI in "
                         "the runtime (containerd >= 1.7: enable_cdi) or keep the hook/shim wiring")


def test_a_record_written_later_is_logged_once_not_per_container(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    watch = CdiIgnoredWatch(str(tmp_path), tick=60)  # only inotify can wake it in time
    watch.start()
    try:
        time.sleep(0.2)
        assert watch.reported is None and warnings(caplog) == []
        started = time.monotonic()
        record(str(tmp_path), "c-one", NAMES)
        wait_for(lambda: watch.reported is not None, timeout=5)
        assert time.monotonic() - started < 5
        (tmp_path / CDI_IGNORED_RECORD).unlink()  # a later container, a new record: still the one line
        record(str(tmp_path), "c-two", NAMES)
        assert watch.check() is True
        time.sleep(0.2)
    finally:
        watch.stop()
    assert len(warnings(caplog)) == 1 and "container c-one " in warnings(caplog)[0]


def test_a_state_dir_made_later_is_found(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "run" / "gpuhook"
    watch = CdiIgnoredWatch(str(state), tick=0.1)  # no directory to watch: it polls
    watch.start()
    try:
        time.sleep(0.2)
        record(str(state), "c-late", NAMES)
        wait_for(lambda: watch.reported is not None)
    finally:
        watch.stop()
    assert len(warnings(caplog)) == 1


def test_a_link_at_the_record_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "real").mkdir()
    record(str(tmp_path / "real"), "c-linked", NAMES)
    state = tmp_path / "state"
    state.mkdir()
    (state / CDI_IGNORED_RECORD).symlink_to(tmp_path / "real" / CDI_IGNORED_RECORD)
    watch = CdiIgnoredWatch(str(state))
    assert watch.check() is False and watch.reported is None
    watch.stop()
    assert warnings(caplog) == []


def test_the_defaults_meet_on_the_node() -> None:
    """The hook's state-dir and the plugin's --hook-state-dir (test_plugin_config checks the flag's default)
    default to the same folder, the one the DaemonSet mounts from the host (read-only: the plugin only reads)."""
    import yaml

    from gpuhook.hook.config import Config

    assert Config().state_dir == STATE_DIR
    daemonset = Path(__file__).parent.parent / "deploy/base/device-plugin/daemonset.yaml"
    (ds,) = yaml.safe_load_all(daemonset.read_text(encoding="utf-8"))
    pod = ds["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == STATE_DIR)
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    flag = next(a for a in container["args"] if a.startswith("--hook-state-dir="))
    assert flag.split("=", 1)[1].split("#")[0].strip() == mount["mountPath"] == STATE_DIR
    assert mount.get("readOnly", False) is False  # the plugin makes the node's key there (plugin.key)
    for beside in (SERVICE_SOCKET, Config().inventory_cache):  # what the plugin's container must not see
        assert not (os.path.dirname(beside) + "/").startswith(STATE_DIR.rstrip("/") + "/"), beside


def test_the_nodes_key_is_made_only_in_a_folder_that_exists(tmp_path: Path) -> None:
    """ensure_secret makes the key (0600, root's) in its folder, never the folder itself: a plugin run where the
    node has no state dir seals nothing and writes nothing on the host."""
    missing = tmp_path / "no-such-dir"
    assert ensure_secret(str(missing / PLUGIN_KEY)) == b"" and not missing.exists()
    key = ensure_secret(str(tmp_path / PLUGIN_KEY))
    assert len(key) == 64 and (tmp_path / PLUGIN_KEY).stat().st_mode & 0o777 == 0o600
    assert ensure_secret(str(tmp_path / PLUGIN_KEY)) == key  # made once, then read
