"""The hook's log is best effort: a full disk or a FIFO at the log path never fails or holds
up a start, and the log never holds half a line.

The full disk is a 64 KiB tmpfs mounted in a private mount namespace (`unshare -m`), so nothing is mounted on
the host and the namespace, with its tmpfs, goes away with the child.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from support.e2e import need_root, need_tool

LINE = "x" * 99 + "\n"
KEPT = LINE * 40 + "z" * 75 + "\n"  # 4076 bytes: its page has 20 bytes free, less than one hook line


def hook_files(tmp: Path, log: Path) -> tuple[Path, str]:
    """A config logging to `log` and the state of a container without a GPU request (the hook only logs)."""
    bundle = tmp / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                                    "process": {"args": ["true"], "env": ["PATH=/bin"]}}))
    config = tmp / "config.toml"
    config.write_text(f'log-file = "{log}"\ninventory-cache = ""\n')
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1, "bundle": str(bundle)})
    return config, state


def test_a_full_disk_drops_the_line_whole(tmp_path: Path) -> None:
    need_root()
    unshare = need_tool("unshare")
    disk = tmp_path / "disk"
    disk.mkdir()
    log = disk / "gpuhook.log"
    config, state = hook_files(tmp_path, log)
    script = f"""
set -e
mount --make-rprivate / 2>/dev/null || true
mount -t tmpfs -o size=64k tmpfs {disk}
printf '%s' "$KEPT" > {log}
dd if=/dev/zero of={disk}/fill bs=1k 2>/dev/null || true
set +e
{sys.executable} -m gpuhook.hook.prestart --config {config} prestart <<'END'
{state}
END
echo "EXIT $?"
cat {log}
"""
    result = subprocess.run([unshare, "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                            check=False, env=dict(os.environ, KEPT=KEPT))
    assert result.returncode == 0, result.stderr
    out, _, log_text = result.stdout.partition("\n")
    assert out == "EXIT 0", result.stdout + result.stderr
    assert log_text == KEPT, "the line that did not fit was taken back whole"
    assert not log.exists(), "the tmpfs was private to the child's mount namespace"


def test_a_fifo_at_the_log_path_does_not_block_the_hook(tmp_path: Path) -> None:
    """Nobody reads the FIFO: an open for writing would wait for a reader until the runtime's hook timeout.
    (The subprocess timeout is a guard against hanging the suite, not a speed limit.)"""
    log = tmp_path / "gpuhook.log"
    os.mkfifo(log)
    config, state = hook_files(tmp_path, log)
    result = subprocess.run([sys.executable, "-m", "gpuhook.hook.prestart", "--config", str(config), "prestart"],
                            input=state, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert stat.S_ISFIFO(os.lstat(log).st_mode)


def test_a_log_line_is_appended_whole(tmp_path: Path) -> None:
    log = tmp_path / "gpuhook.log"
    config, state = hook_files(tmp_path, log)
    for _ in range(2):
        result = subprocess.run([sys.executable, "-m", "gpuhook.hook.prestart", "--config", str(config)],
                                input=state, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
    lines = log.read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 3 and all(" c1 skip request=unset " in line for line in lines[:2])
