"""Helpers for end-to-end tests that run real containers with runc.

Typical use (after the gate in tests.support.e2e: need_root(), need_tool("runc"), need_busybox()):

    rootfs = busybox_rootfs(tmp_path)
    bundle = make_bundle(tmp_path, rootfs, ["sh", "-c", "cat /proc/self/status"])
    result = runc_run(bundle, unique_id("t"))            # foreground; the container is always deleted

    with runc_detached(bundle, cid) as pid:               # long-running container; deleted on exit
        runc_exec(cid, ["ls", "/dev"])

cgroup v2 on a cgroup v1 host: run runc (and whatever must see the same cgroup mount) inside a private mount
namespace with cgroup2 mounted at /sys/fs/cgroup, either per command (cgroup2_namespace_prefix()) or for a
whole test, with several commands sharing one namespace (`with cgroup2_namespace() as prefix:`). Pass the
prefix to every runc_* helper of that container.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuhook.fakedriver import rootfs as _rootfs
from gpuhook.fakedriver.rootfs import BUSYBOX_CANDIDATES as BUSYBOX_CANDIDATES  # re-exported
from gpuhook.fakedriver.rootfs import DEFAULT_APPLETS

from .e2e import need

# `runc spec` (runc 1.1) defaults, adjusted for tests: no terminal, writable root.
_BASE_CONFIG: dict[str, Any] = {
    "ociVersion": "1.0.2-dev",
    "process": {
        "terminal": False,
        "user": {"uid": 0, "gid": 0},
        "args": ["sh"],
        "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"],
        "cwd": "/",
        "capabilities": {
            key: ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
            for key in ("bounding", "effective", "permitted", "ambient")
        },
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        "noNewPrivileges": True,
    },
    "root": {"path": "rootfs", "readonly": False},
    "hostname": "runc",
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ],
    "linux": {
        "resources": {"devices": [{"allow": False, "access": "rwm"}]},
        "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
        "maskedPaths": [
            "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi",
        ],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    },
}  # fmt: skip

ALL_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP",
)  # fmt: skip


def unique_id(prefix: str = "gpuhook-test") -> str:
    """A container id no concurrent test run will reuse."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def find_busybox() -> str | None:
    """A statically linked busybox (busybox-static), which runs in an otherwise empty rootfs."""
    return _rootfs.find_static_busybox()


def need_busybox() -> str:
    """Gate: skip (or fail under GPUHOOK_REQUIRE_E2E) without a static busybox."""
    path = find_busybox()
    need(path is not None, f"needs a static busybox ({_rootfs.INSTALL_HINT})")
    return path or ""


def busybox_rootfs(dir: str | os.PathLike[str], applets: Sequence[str] = DEFAULT_APPLETS) -> Path:
    """`dir`/rootfs: a static busybox plus applet symlinks in /bin, and the usual empty top-level dirs
    (gpuhook.fakedriver.rootfs.busybox_rootfs)."""
    return _rootfs.busybox_rootfs(Path(dir) / "rootfs", applets)


def base_config() -> dict[str, Any]:
    """A fresh copy of the default config (runc spec, terminal off, writable root)."""
    return copy.deepcopy(_BASE_CONFIG)


def make_bundle(
    dir: str | os.PathLike[str],
    rootfs: str | os.PathLike[str],
    args: Sequence[str],
    env: Sequence[str] = (),
    hooks: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    mounts: Sequence[Mapping[str, Any]] = (),
    devices: Sequence[Mapping[str, Any]] = (),
    capabilities: Sequence[str] | None = None,
    device_rules: Sequence[Mapping[str, Any]] | None = None,
    annotations: Mapping[str, str] | None = None,
    readonly_root: bool = False,
    cgroups_path: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write `dir`/config.json for `rootfs` and return the bundle dir.

    `env` adds to the default PATH/TERM; `hooks` is the OCI hooks object ({"prestart": [{"path": ...}]});
    `mounts` are appended to the default mounts; `devices` go to linux.devices; `capabilities` replaces all
    five capability sets (ALL_CAPABILITIES for a "privileged" process); `device_rules`, when given, replaces
    linux.resources.devices (default: deny all, runc then adds its defaults such as /dev/null);
    `extra` is merged last, key by key at the top level.
    """
    bundle = Path(dir)
    bundle.mkdir(parents=True, exist_ok=True)
    config = base_config()
    process = config["process"]
    process["args"] = list(args)
    process["env"] = process["env"] + list(env)
    if capabilities is not None:
        process["capabilities"] = {key: list(capabilities) for key in process["capabilities"]}
    root = Path(rootfs)
    config["root"] = {
        "path": os.path.relpath(root, bundle) if root.is_relative_to(bundle) else str(root),
        "readonly": readonly_root,
    }
    config["mounts"] += [dict(m) for m in mounts]
    if hooks:
        config["hooks"] = {stage: [dict(h) for h in entries] for stage, entries in hooks.items()}
    if devices:
        config["linux"]["devices"] = [dict(d) for d in devices]
    if device_rules is not None:
        config["linux"]["resources"]["devices"] = [dict(r) for r in device_rules]
    if annotations:
        config["annotations"] = dict(annotations)
    if cgroups_path is not None:
        config["linux"]["cgroupsPath"] = cgroups_path
    for key, value in (extra or {}).items():
        config[key] = value
    (bundle / "config.json").write_text(json.dumps(config, indent=2))
    return bundle


def runc_cmd(*args: str, prefix: Sequence[str] = (), root: str | None = None) -> list[str]:
    """A runc command line; `root` is runc's state dir (--root), `prefix` e.g. a cgroup2 namespace."""
    global_opts = ["--root", root] if root else []
    return [*prefix, "runc", *global_opts, *args]


def runc_delete(container_id: str, prefix: Sequence[str] = (), root: str | None = None) -> None:
    """Force-delete (kill and remove) a container; quiet if it is already gone."""
    subprocess.run(runc_cmd("delete", "-f", container_id, prefix=prefix, root=root),
                   stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False)  # fmt: skip


def runc_run(
    bundle: str | os.PathLike[str],
    container_id: str,
    timeout: float = 30,
    extra: Sequence[str] = (),
    prefix: Sequence[str] = (),
    root: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a container in the foreground and capture its output; the container is deleted afterwards,
    also on timeout (which raises subprocess.TimeoutExpired)."""
    cmd = runc_cmd("run", *extra, "--bundle", os.fspath(bundle), container_id, prefix=prefix, root=root)
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
    finally:
        runc_delete(container_id, prefix=prefix, root=root)


def runc_state(container_id: str, prefix: Sequence[str] = (), root: str | None = None) -> dict[str, Any]:
    result = subprocess.run(runc_cmd("state", container_id, prefix=prefix, root=root),
                            capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    return json.loads(result.stdout)


@contextlib.contextmanager
def runc_detached(
    bundle: str | os.PathLike[str],
    container_id: str,
    timeout: float = 30,
    extra: Sequence[str] = (),
    prefix: Sequence[str] = (),
    root: str | None = None,
) -> Iterator[int]:
    """Start a container detached (`runc run -d`) and yield its init's host pid; always delete it after.

    The container's stdout/stderr go to `bundle`/container.log (a pipe would never reach EOF).
    Start failures raise RuntimeError with runc's output.
    """
    bundle = Path(bundle)
    log = bundle / "container.log"
    cmd = runc_cmd("run", "-d", *extra, "--bundle", os.fspath(bundle), container_id, prefix=prefix, root=root)
    try:
        with open(log, "ab") as out:
            result = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=timeout,
                                    check=False)  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"runc run -d failed ({result.returncode}): {log.read_text(errors='replace')}")
        yield int(runc_state(container_id, prefix=prefix, root=root)["pid"])
    finally:
        runc_delete(container_id, prefix=prefix, root=root)


def runc_exec(
    container_id: str,
    args: Sequence[str],
    timeout: float = 30,
    extra: Sequence[str] = (),
    prefix: Sequence[str] = (),
    root: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a process in a running container (no terminal) and capture its output."""
    cmd = runc_cmd("exec", *extra, container_id, *args, prefix=prefix, root=root)
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          check=False)  # fmt: skip


# --- cgroup v2 on a v1 (or hybrid) host -------------------------------------------------------------------

_CGROUP2_SCRIPT = "mount -t cgroup2 none /sys/fs/cgroup && exec \"$0\" \"$@\""


def cgroup2_namespace_prefix() -> list[str]:
    """Prefix one command so that it runs in a fresh private mount namespace with cgroup2 mounted over
    /sys/fs/cgroup (runc then uses its cgroup v2 manager and eBPF device filter). Each use gets its own
    namespace, so use cgroup2_namespace() when several commands must share the mount (runc run -d, exec,
    delete, the code under test)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _CGROUP2_SCRIPT]


@contextlib.contextmanager
def cgroup2_namespace(ready_timeout: float = 10) -> Iterator[list[str]]:
    """Keep one private mount namespace with cgroup2 at /sys/fs/cgroup alive (held by a sleeping process)
    and yield a prefix (`nsenter --mount=/proc/<holder>/ns/mnt --wd=<cwd> --`) that runs a command inside it
    (entering a mount namespace resets the working directory, hence --wd)."""
    holder = subprocess.Popen(
        [*cgroup2_namespace_prefix(), "sh", "-c", "echo ready; exec sleep 3600"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if line.strip() != "ready":
            _, err = holder.communicate(timeout=ready_timeout)
            raise RuntimeError(f"could not set up a cgroup2 mount namespace: {err.strip()}")
        ns = f"/proc/{holder.pid}/ns/mnt"
        deadline = time.monotonic() + ready_timeout
        while os.readlink(ns) == os.readlink("/proc/self/ns/mnt") and time.monotonic() < deadline:
            time.sleep(0.01)
        yield ["nsenter", f"--mount={ns}", f"--wd={os.getcwd()}", "--"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=10)


def in_namespace_python(prefix: Sequence[str], code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `python -c code` (this interpreter, this sys.path) under `prefix`, e.g. a cgroup2 namespace,
    for code under test that must see the same mounts as runc did."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path if p))
    return subprocess.run([*prefix, sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)  # fmt: skip


def run_in_child(fn: Callable[[], None]) -> None:
    """Run `fn` in a forked child, so namespace changes (unshare, setns, mounts) stay there; raise
    AssertionError if it raised (its traceback goes to stderr)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError("forked child failed (traceback above)")
