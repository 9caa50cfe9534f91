"""Containers for the benchmarks: a static-busybox rootfs, runc bundles, and a private podman.

Self-contained on purpose (the test helpers under tests/support need pytest): the base runc config is what
`runc spec` writes, so nothing of it is restated here. Every timed start gets a fresh copy of the rootfs,
because the hooks create files in it (mount points, links, the ld cache) and a reused one would make
later starts cheaper than a real one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import BenchError, timed

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
APPLETS = ("sh", "true", "ls", "cat", "echo")
HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


def _is_static(path: Path) -> bool:
    """An ELF without PT_INTERP needs no dynamic loader, so it runs in an otherwise empty rootfs."""
    data = path.read_bytes()[:4096]
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    phoff, phentsize, phnum = (int.from_bytes(data[a:b], "little") for a, b in ((32, 40), (54, 56), (56, 58)))
    return all(int.from_bytes(data[phoff + i * phentsize: phoff + i * phentsize + 4], "little") != 3
               for i in range(phnum))


def busybox_template(dest: Path) -> Path:
    """`dest`: a rootfs of a static busybox, a few applets and the usual empty directories."""
    busybox = next((Path(p) for p in BUSYBOX_CANDIDATES if Path(p).is_file() and _is_static(Path(p))), None)
    if busybox is None:
        raise BenchError("needs a static busybox (apt-get install busybox-static)")
    for sub in ("bin", "dev", "proc", "sys", "tmp", "etc", "root", "run", "usr/bin", "usr/lib", "var"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, dest / "bin/busybox")
    for applet in APPLETS:
        (dest / "bin" / applet).symlink_to("busybox")
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc/group").write_text("root:x:0:\n")
    return dest


def fresh_rootfs(template: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(template, dest, symlinks=True)
    return dest


def runc_base_config(workdir: Path) -> dict[str, Any]:
    """`runc spec`'s default config.json, made non-interactive and with a writable root (the hook writes)."""
    spec_dir = workdir / "runc-spec"
    spec_dir.mkdir(exist_ok=True)
    result = subprocess.run(["runc", "spec", "--bundle", str(spec_dir)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchError(f"runc spec failed: {result.stderr.strip()}")
    config = json.loads((spec_dir / "config.json").read_text())
    config["process"]["terminal"] = False
    config["root"]["readonly"] = False
    return config


def hook_entry(hook: str, config_file: Path) -> dict[str, Any]:
    """A prestart hook entry as the README and oci-hooks.d configure it (fixed env, explicit config)."""
    return {"path": hook, "args": ["gpuhook-hook", "--config", str(config_file), "prestart"], "env": HOOK_ENV}


def write_bundle(bundle: Path, base: Mapping[str, Any], rootfs: Path, args: Sequence[str], env: Sequence[str] = (),
                 hooks: Mapping[str, Any] | None = None) -> Path:
    config = json.loads(json.dumps(base))
    config["root"]["path"] = os.path.relpath(rootfs, bundle)
    config["process"]["args"] = list(args)
    config["process"]["env"] = config["process"]["env"] + list(env)
    if hooks:
        config["hooks"] = hooks
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def runc_run(bundle: Path, container_id: str) -> float:
    """Milliseconds of `runc run` (foreground: create, hooks, start, wait, delete); BenchError on failure."""
    try:
        ms, result = timed(["runc", "run", "--bundle", str(bundle), container_id], timeout=60)
    finally:
        subprocess.run(["runc", "delete", "-f", container_id], capture_output=True, check=False)
    if result.returncode != 0:
        raise BenchError(f"runc run {container_id} failed ({result.returncode}): {result.stderr.strip()[-800:]}")
    return ms


# podman 4.3.1 reads CDI specs only from /etc/cdi and /var/run/cdi: each command runs in a private mount namespace
# where our spec directory covers /etc/cdi (an overlay on /etc first when there is none) and /run/cdi is hidden.
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
PODMAN_GLOBAL = ("--cgroup-manager", "cgroupfs", "--events-backend", "file")
PODMAN_RUN = ("--rm", "--runtime", "runc", "--network", "none", "--ulimit", "nofile=1024:1024",
              "--ulimit", "nproc=1024:1024")  # fmt: skip


@dataclass(frozen=True)
class Podman:
    """podman with storage of its own under `base` (the host's containers and images are never touched)."""

    base: Path

    @property
    def spec_dir(self) -> Path:
        return self.base / "cdi"

    @classmethod
    def create(cls, base: Path) -> Podman:
        for sub in ("cdi", "storage", "run", "tmp", "etc-overlay"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        if len(str(base / "run")) > 50:
            raise BenchError(f"podman refuses a runroot longer than 50 characters: {base / 'run'}")
        return cls(base)

    def command(self, *args: str) -> list[str]:
        podman = ["podman", "--root", str(self.base / "storage"), "--runroot", str(self.base / "run"),
                  "--tmpdir", str(self.base / "tmp"), *PODMAN_GLOBAL, *args]  # fmt: skip
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", _PRIVATE_CDI, "sh", str(self.spec_dir),
                str(self.base / "etc-overlay"), *podman]  # fmt: skip

    def run(self, rootfs: Path, devices: Sequence[str], argv: Sequence[str]) -> float:
        """Milliseconds of `podman run --rm` of `argv` in `rootfs` with CDI `devices`; BenchError on failure."""
        flags = [*PODMAN_RUN]
        for device in devices:
            flags += ["--device", device]
        ms, result = timed(self.command("run", *flags, "--rootfs", str(rootfs), *argv), timeout=120)
        if result.returncode != 0:
            raise BenchError(f"podman run with {list(devices)} failed ({result.returncode}): "
                             f"{result.stderr.strip()[-800:]}")
        return ms


def install_lean_entry(path: Path) -> str:
    """`gpuhook hook install --path PATH`, in-process: the -IS entry script the hook benchmarks run."""
    from gpuhook.hook_entry import install

    return install(str(path))


def write_hook_config(path: Path, fake_root: Path, workdir: Path) -> Path:
    """The hook's config.toml for a simulated driver: its roots, a log and an inventory cache in `workdir`."""
    path.write_text(
        f'driver-root = "{fake_root}"\nproc-root = "{fake_root}/proc"\n'
        f'log-file = "{workdir}/gpuhook.log"\ninventory-cache = "{workdir}/inventory.json"\n'
    )
    return path
