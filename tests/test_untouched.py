"""Non-GPU containers are untouched: with gpuhook-hook configured for every container (as `gpuhook runtime
configure` or an oci-hooks `always` entry does), a container without a GPU request sees exactly what it sees
without the hook (mount table, /dev, environment, capabilities), and its rootfs is left exactly as runc leaves it.

Both starts use the same bundle path, rootfs path and container id, each with a freshly built rootfs, so
the only difference is the hook; mount ids, device numbers of anonymous file systems and peer groups differ
between any two starts and are dropped.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from support import hostile
from support.glibc import glibc_rootfs
from support.runc import make_bundle, runc_run, unique_id

from gpuhook.fakedriver import FakeDriver

pytestmark = pytest.mark.e2e

SEPARATOR = "=====\n"
PROBE = "; echo =====; ".join([
    "cat /proc/self/mountinfo",
    "find /dev | sort | while read f; do stat -c '%n %F %a %u:%g %t:%T %s' \"$f\"; done",
    "env | sort",
    "grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status",
    # mode and name (and a link's target) only: owner, size and time differ between two copies of the image
    "ls -la /etc /usr/lib/x86_64-linux-gnu | grep -v '^total' | awk '{$2=$3=$4=$5=$6=$7=$8=\"\"; print}'",
])


def normalise_mountinfo(text: str) -> list[str]:
    """Mount table lines without mount id, parent id, device number and peer groups (they differ per start)."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        sep = fields.index("-")
        optional = [f for f in fields[6:sep] if not re.fullmatch(r"(shared|master|propagate_from):\d+", f)]
        out.append(" ".join([fields[3], fields[4], fields[5], *optional, *fields[sep:]]))
    return out


def view(stdout: str) -> list[Any]:
    parts = stdout.split(SEPARATOR)
    assert len(parts) == 5, stdout
    return [normalise_mountinfo(parts[0]), *parts[1:]]


@pytest.fixture()
def e2e() -> None:
    hostile.need_hook_e2e()


def starts(tmp_path: Path, fake: FakeDriver, env: list[str], caps: list[str] | None) -> list[tuple[Any, Any]]:
    """(view, rootfs content) of the same start without and with the hook."""
    config = hostile.write_config(tmp_path, fake.root)
    cid = unique_id("untouched")
    bundle_dir = tmp_path / "bundle"
    seen = []
    for hooked in (False, True):
        shutil.rmtree(bundle_dir, ignore_errors=True)
        rootfs = glibc_rootfs(bundle_dir, probe_cache=tmp_path / "probe")
        bundle = make_bundle(bundle_dir, rootfs, ["sh", "-c", PROBE], env=env, capabilities=caps,
                             hooks=hostile.prestart_hooks(config) if hooked else None)
        result = runc_run(bundle, cid)
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        seen.append((view(result.stdout), hostile.content(rootfs)))
    log = hostile.log_lines(tmp_path)
    assert len(log) == 1 and f" {cid} " in log[0], log
    return seen


@pytest.mark.parametrize("env", [
    [],
    ["NVIDIA_VISIBLE_DEVICES=void"],
    ["NVIDIA_VISIBLE_DEVICES="],
    ["NVIDIA_VISIBLE_DEVICES= , ,"],
    ["NVIDIA_DRIVER_CAPABILITIES=all", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"],  # options without a request
    ["LD_PRELOAD=/nonexistent.so", "PATH=/planted:/bin"],
], ids=["no-env", "void", "empty", "blank-items", "options-only", "odd-env"])
@pytest.mark.parametrize("privileged", [False, True], ids=["unprivileged", "privileged"])
def test_non_gpu_container_is_untouched(e2e: None, fake_driver: FakeDriver, tmp_path: Path, env: list[str],
                                        privileged: bool) -> None:
    caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_SYS_ADMIN"] if privileged else None
    (plain_view, plain_rootfs), (hooked_view, hooked_rootfs) = starts(tmp_path, fake_driver, env, caps)
    for name, a, b in zip(("mountinfo", "/dev", "env", "capabilities", "files"), plain_view, hooked_view):
        assert b == a, f"{name} differs with the hook"
    assert hooked_rootfs == plain_rootfs
    assert " skip request=" in hostile.log_lines(tmp_path)[0]


def test_the_comparison_sees_a_gpu_container(e2e: None, fake_driver: FakeDriver, tmp_path: Path) -> None:
    """The control: the same comparison tells a GPU start apart, in every part it looks at but the env."""
    (plain_view, plain_rootfs), (hooked_view, hooked_rootfs) = starts(tmp_path, fake_driver,
                                                                      ["NVIDIA_VISIBLE_DEVICES=0"], None)
    differs = [name for name, a, b in zip(("mountinfo", "/dev", "env", "capabilities", "files"), plain_view,
                                          hooked_view) if a != b]
    assert differs == ["mountinfo", "/dev", "files"]
    assert hooked_rootfs != plain_rootfs
