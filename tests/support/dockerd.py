"""A private Docker daemon for end-to-end tests: its own data root, exec root, socket, pidfile and daemon.json
under a temp dir, no bridge and no iptables (nothing on the host's network changes), stopped by its PID.

Debian's docker.io (20.10) is what CI installs: it has `--gpus` (the moby daemon registers its NVIDIA driver when
`nvidia-container-runtime-hook` is on its PATH at start) and `--runtime`, no CDI.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from .daemon import HOST_PATH, daemon_process, wait_ready
from .e2e import need, need_root, need_tool

DOCKER_CLIENT = "/usr/bin/docker"  # Debian's, the daemon's own version (a newer client may sit in /usr/local/bin)


class Dockerd:
    def __init__(self, root: Path, pid: int) -> None:
        self.root, self.pid = root, pid
        self.socket = root / "docker.sock"

    def docker(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([DOCKER_CLIENT, "-H", f"unix://{self.socket}", *args], capture_output=True, text=True,
                              timeout=timeout, check=False)

    def import_rootfs(self, rootfs: Path, tag: str) -> str:
        """A local image from a directory (no registry is reachable): `docker import` of its tar."""
        archive = self.root / f"{tag.replace(':', '_').replace('/', '_')}.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(rootfs, arcname=".")
        result = self.docker("import", str(archive), tag)
        assert result.returncode == 0, result.stderr
        return tag


def need_dockerd() -> str:
    need_root()
    need_tool("containerd")
    need(os.path.exists(DOCKER_CLIENT), f"{DOCKER_CLIENT} (Debian's docker.io) is not installed")
    return need_tool("dockerd")


@contextlib.contextmanager
def private_dockerd(root: Path, path_dirs: list[str], daemon_json: Mapping[str, object] | None = None,
                    env: Mapping[str, str] | None = None) -> Iterator[Dockerd]:
    """dockerd with everything of its own under `root`; `path_dirs` go first on its PATH (where it looks for
    nvidia-container-runtime-hook); `env` is added to its environment, which --gpus hooks and runtimes inherit."""
    dockerd = need_dockerd()
    root.mkdir(parents=True, exist_ok=True)
    config = root / "daemon.json"
    # dockerd 20.10 keeps its identity key in /etc/docker/key.json unless its config names another path (a
    # daemon.json key only: it has no such flag)
    config.write_text(json.dumps({"deprecated-key-path": str(root / "key.json"), **dict(daemon_json or {})}))
    environ = {"PATH": ":".join([*path_dirs, *HOST_PATH]), **(env or {})}
    argv = [dockerd, "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
            "--pidfile", str(root / "dockerd.pid"), "-H", f"unix://{root / 'docker.sock'}",
            "--config-file", str(config), "--bridge=none", "--iptables=false", "--ip6tables=false",
            "--ip-masq=false", "--storage-driver", "vfs", "--containerd-namespace", "gpuhook-test",
            "--containerd-plugins-namespace", "gpuhook-test-plugins"]
    with daemon_process(argv, environ, root, "dockerd.log") as proc:
        daemon = Dockerd(root, proc.pid)
        wait_ready(proc, lambda: daemon.docker("version", timeout=10).returncode == 0, "dockerd",
                   root / "dockerd.log", 60)
        yield daemon


