"""A private Docker >= 25 daemon with CDI on, from Debian trixie's packages unpacked by .ci/fetch-docker-cdi.

The tree under the cache ($GPUHOOK_DOCKER_CDI_CACHE, default $GPUHOOK_DEB_CACHE/docker-trixie, default
/var/cache/gpuhook-test-debs/docker-trixie) holds trixie's dockerd 26, its docker client (a 20.10 client sends
`--device nvidia.com/gpu=0` as a device path, not as a CDI request), containerd 1.7 with its shims and
docker-init (tini). Nothing of it is installed: the daemon finds them on its PATH, ahead of the host's. runc is
the host's (trixie's needs GLIBC_2.38, bookworm has 2.36).

Like tests/support/dockerd.py's private_dockerd (whose daemon is the host's dockerd and client): its own data
root, exec root, socket, pidfile and daemon.json under a temp dir, no bridge and no iptables, stopped by its PID,
and whatever it left mounted under its root unmounted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from .daemon import HOST_PATH, daemon_process, wait_ready
from .dockerd import Dockerd
from .e2e import need, need_root

CACHE_ENV = "GPUHOOK_DOCKER_CDI_CACHE"
FETCH = ".ci/fetch-docker-cdi"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("GPUHOOK_DEB_CACHE") or "/var/cache/gpuhook-test-debs") / "docker-trixie"


class DockerTree:
    """The unpacked packages: `root`/usr/sbin/dockerd and friends; `versions` maps package -> Debian version."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = dict(line.split("=", 1) for line in (root / ".done").read_text().split())

    @property
    def dockerd(self) -> Path:
        return self.root / "usr/sbin/dockerd"

    @property
    def client(self) -> Path:
        return self.root / "usr/bin/docker"

    @property
    def path_dirs(self) -> list[str]:
        """Where the daemon looks up containerd, containerd-shim-runc-v2, docker-init, docker-proxy."""
        return [str(self.root / "usr/bin"), str(self.root / "usr/sbin")]


def need_docker_cdi() -> DockerTree:
    """The fetched tree; skip (fail under GPUHOOK_REQUIRE_E2E) when it is not there, fail when it cannot run."""
    need_root()
    root = cache_dir() / "root"
    need((root / ".done").is_file(), f"no Docker >= 25 tree at {root}: run {FETCH} first")
    need(shutil.which("runc", path=":".join(HOST_PATH)) is not None, "needs the host's runc (apt-get install runc)")
    tree = DockerTree(root)
    for binary in (tree.dockerd, tree.client):
        # Present but unable to run here (another libc, another architecture): a real failure, not a skip.
        try:
            proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30,
                                  check=False)
        except OSError as exc:
            pytest.fail(f"{binary} cannot be executed on this machine: {exc}")
        if proc.returncode != 0:
            pytest.fail(f"{binary} --version failed on this machine: {(proc.stderr or proc.stdout).strip()}")
    return tree


class CdiDockerd(Dockerd):
    """A Dockerd (import_rootfs and all) whose client is the tree's."""

    def __init__(self, root: Path, pid: int, client: Path, client_config: Path) -> None:
        super().__init__(root, pid)
        self.client, self.client_config = client, client_config

    def docker(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {"PATH": ":".join(HOST_PATH), "DOCKER_CONFIG": str(self.client_config), "LC_ALL": "C"}
        return subprocess.run([str(self.client), "-H", f"unix://{self.socket}", *args], capture_output=True,
                              text=True, timeout=timeout, env=env, check=False)


@contextlib.contextmanager
def private_cdi_dockerd(tree: DockerTree, root: Path, daemon_json: Mapping[str, object],
                        env: Mapping[str, str] | None = None) -> Iterator[CdiDockerd]:
    """The tree's dockerd with everything of its own under `root` and `daemon_json` as its config file."""
    root.mkdir(parents=True, exist_ok=True)
    config = root / "daemon.json"
    config.write_text(json.dumps(dict(daemon_json)))
    client_config = root / "client"  # the client's ~/.docker (it writes nothing, but never under the host's)
    client_config.mkdir(exist_ok=True)
    environ = {"PATH": ":".join([*tree.path_dirs, *HOST_PATH]), "LC_ALL": "C", **(env or {})}
    argv = [str(tree.dockerd), "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
            "--pidfile", str(root / "dockerd.pid"), "-H", f"unix://{root / 'docker.sock'}",
            "--config-file", str(config), "--bridge=none", "--iptables=false", "--ip6tables=false",
            "--ip-masq=false", "--storage-driver", "vfs", "--containerd-namespace", "gpuhook-cdi-test",
            "--containerd-plugins-namespace", "gpuhook-cdi-test-plugins"]
    with daemon_process(argv, environ, root, "dockerd.log") as proc:
        daemon = CdiDockerd(root, proc.pid, tree.client, client_config)
        wait_ready(proc, lambda: daemon.docker("version", timeout=10).returncode == 0, str(tree.dockerd),
                   root / "dockerd.log", 90)
        yield daemon
