"""Run the real podman against a private CDI spec directory, leaving the host's podman state and CDI dirs alone.

What works on these machines (podman 4.3.1, runc 1.1.5, cgroup v1, no systemd in the test environment):
- storage of our own: `--root`, `--runroot` and `--tmpdir` in temp dirs (no image needed: `--rootfs DIR`), so
  the host's containers, images and locks are never touched; podman refuses a runroot path longer than 50
  characters, so that one lives in a short /tmp directory (call `close()`);
- `--cgroup-manager cgroupfs` (no systemd) and `--events-backend file` (no journald);
- run flags `--rm --runtime runc --network none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024`
  (podman otherwise copies the runner's huge limits, which runc refuses here; `none` avoids netavark/CNI);
- CDI dirs: podman 4.3.1 has no option for them and reads `/etc/cdi` then `/var/run/cdi`. The command runs in
  a private mount namespace (`unshare -m`, propagation private): our spec dir is bind-mounted on `/etc/cdi`
  (when the host has no `/etc/cdi`, `/etc` first gets a throwaway overlay so the directory can be made) and
  an existing `/var/run/cdi` is hidden under an empty tmpfs. Everything vanishes with the namespace.
- `--rootfs` uses the directory itself (no copy): podman and the spec's hooks write into it, so each test
  gets its own rootfs.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .e2e import need_root, need_tool

GLOBAL_FLAGS: tuple[str, ...] = ("--cgroup-manager", "cgroupfs", "--events-backend", "file")
RUN_FLAGS: tuple[str, ...] = (
    "--rm", "--runtime", "runc", "--network", "none",
    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
)  # fmt: skip

# $1 = spec dir, $2 = scratch dir for the /etc overlay, then the podman command line.
_PRIVATE_CDI = r"""
set -e
spec=$1; scratch=$2; shift 2
if [ ! -d /etc/cdi ]; then
    mkdir -p "$scratch/upper" "$scratch/work"
    mount -t overlay overlay -o "lowerdir=/etc,upperdir=$scratch/upper,workdir=$scratch/work" /etc
    mkdir -p /etc/cdi
fi
mount --bind "$spec" /etc/cdi
if [ -d /run/cdi ]; then mount -t tmpfs -o size=16k,mode=755 tmpfs /run/cdi; fi
exec "$@"
"""


def need_podman() -> str:
    """The e2e gate for podman tests: root, podman, runc and unshare (skip locally, fail in CI)."""
    need_root()
    need_tool("runc")
    need_tool("unshare")
    return need_tool("podman")


@dataclass(frozen=True)
class Podman:
    """A private podman world under `base`; specs written to `spec_dir` are what podman sees in /etc/cdi."""

    base: Path
    runroot: Path
    podman: str = "podman"

    MAX_RUNROOT = 50  # podman: "the specified runroot is longer than 50 characters"

    @property
    def spec_dir(self) -> Path:
        return self.base / "cdi"

    @classmethod
    def create(cls, base: Path, podman: str = "podman") -> Podman:
        for sub in ("cdi", "storage", "tmp", "etc-overlay"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        runroot = Path(tempfile.mkdtemp(prefix="gpuhook-", dir="/tmp"))
        assert len(str(runroot)) <= cls.MAX_RUNROOT, runroot
        return cls(base, runroot, podman)

    def close(self) -> None:
        shutil.rmtree(self.runroot, ignore_errors=True)

    def __enter__(self) -> Podman:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def command(self, *args: str) -> list[str]:
        """podman with this world's storage and the flags that work here, inside the private CDI namespace."""
        podman = [
            self.podman, "--root", str(self.base / "storage"), "--runroot", str(self.runroot),
            "--tmpdir", str(self.base / "tmp"), *GLOBAL_FLAGS, *args,
        ]  # fmt: skip
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", _PRIVATE_CDI, "sh",
                str(self.spec_dir), str(self.base / "etc-overlay"), *podman]

    def run_command(self, rootfs: Path, devices: Sequence[str], argv: Sequence[str], *, env: Sequence[str] = (),
                    global_flags: Sequence[str] = ()) -> list[str]:
        """The command line of `podman run --rm` of `argv` in `rootfs` with CDI `devices` (qualified names) and
        `env` items; `global_flags` go before `run` (e.g. `--hooks-dir DIR`)."""
        flags = [*RUN_FLAGS]
        for device in devices:
            flags += ["--device", device]
        for item in env:
            flags += ["--env", item]
        return self.command(*global_flags, "run", *flags, "--rootfs", str(rootfs), *argv)

    def run(self, rootfs: Path, devices: Sequence[str], argv: Sequence[str], *, env: Sequence[str] = (),
            global_flags: Sequence[str] = (), timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`podman run` of `argv` in `rootfs` with CDI `devices` (see run_command); never raises on failure."""
        cmd = self.run_command(rootfs, devices, argv, env=env, global_flags=global_flags)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)

    def sh(self, rootfs: Path, devices: Sequence[str], script: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return self.run(rootfs, devices, ["sh", "-c", script], **kw)  # type: ignore[arg-type]


# A busybox script printing "<path> <major>:<minor>" for each NVIDIA-ish node in the container's /dev.
LIST_NODES = (
    "for f in /dev/nvidia* /dev/nvidia-caps/* /dev/dri/*; do "
    "[ -c \"$f\" ] && echo \"$f $(stat -c '%t %T' \"$f\")\"; done; true"
)


def parse_nodes(output: str) -> dict[str, tuple[int, int]]:
    """LIST_NODES output -> {path: (major, minor)} (stat prints the numbers in hex)."""
    nodes: dict[str, tuple[int, int]] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].startswith("/dev/"):
            nodes[parts[0]] = (int(parts[1], 16), int(parts[2], 16))
    return nodes
