"""A private containerd (Debian 12's 1.6, which has no CDI) for end-to-end tests: its own root, state, sockets
and config under a temp dir, the CRI plugin off, stopped by its PID. Containers start with `ctr run --rootfs`
(no image store, no registry) and, for GPUs, gpuhook's shim as the runc binary, as a containerd 1.6 node is
wired (runtime-config/containerd-1.6-shim.toml)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from .daemon import HOST_PATH, daemon_process, wait_ready
from .e2e import need_root, need_tool


class Containerd:
    def __init__(self, root: Path, pid: int) -> None:
        self.root, self.pid = root, pid
        self.socket = root / "containerd.sock"

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ctr", "--address", str(self.socket), *args], capture_output=True, text=True,
                              timeout=timeout, check=False)

    def run(self, rootfs: Path, cid: str, env: Mapping[str, str], argv: Sequence[str],
            runc_binary: str | None = None) -> subprocess.CompletedProcess[str]:
        """`ctr run --rm --rootfs` with exactly `env` (plus a PATH when it has none)."""
        envs = [a for k, v in {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", **env}.items() for a in ("--env", f"{k}={v}")]
        runc = ["--runc-binary", runc_binary] if runc_binary else []
        return self.ctr("run", "--rm", "--rootfs", *runc, *envs, str(rootfs), cid, *argv)


@contextlib.contextmanager
def private_containerd(root: Path, env: Mapping[str, str] | None = None) -> Iterator[Containerd]:
    """containerd with everything of its own under `root`; `env` reaches its shims and so the runtime."""
    need_root()
    binary = need_tool("containerd")
    need_tool("ctr")
    root.mkdir(parents=True, exist_ok=True)
    config = root / "config.toml"
    config.write_text(f'version = 2\nroot = "{root}/root"\nstate = "{root}/state"\n'
                      'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                      f'[grpc]\n  address = "{root}/containerd.sock"\n'
                      f'[ttrpc]\n  address = "{root}/containerd.sock.ttrpc"\n')
    environ = {"PATH": ":".join(HOST_PATH), **(env or {})}
    with daemon_process([binary, "--config", str(config)], environ, root, "containerd.log") as proc:
        daemon = Containerd(root, proc.pid)
        wait_ready(proc, lambda: daemon.ctr("version", timeout=10).returncode == 0, "containerd",
                   root / "containerd.log", 30)
        yield daemon
