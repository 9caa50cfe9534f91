"""Helpers for the security and fault suites: planted artefacts, host snapshots, hook configs, inotify.

A hostile image is a rootfs the test corrupts on purpose. What must never happen is observed from the host:
- a *marker* file at an absolute host path, written by a planted library's constructor (or audit entry) or a
  planted `ldconfig`/`sitecustomize`, which only runs if the container's environment reached a host process;
- a change to a watched host directory (metadata signature of every entry, content hash of small files);
- a change to the host's mount table, or a process left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil
from inotify_simple import INotify, flags

from .e2e import need_root, need_tool
from .runc import need_busybox

MARKER_SOURCE = r"""
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
static void mark(const char *why)
{
    int fd = open(MARKER, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        (void)!write(fd, why, strlen(why));
        close(fd);
    }
}
__attribute__((constructor)) static void on_load(void) { mark("constructor\n"); }
unsigned int la_version(unsigned int version) { mark("la_version\n"); return version; }
"""

HOST_WATCH = ("/usr/lib/x86_64-linux-gnu", "/usr/bin", "/dev", "/etc/ld.so.conf.d", "/etc/ld.so.cache",
              "/proc/driver/nvidia", "/lib/firmware", "/etc")
# Not descended into: churn that has nothing to do with us (ptys, POSIX shm of other processes).
SHALLOW = ("/dev", "/etc")
SMALL_FILE = 1 << 20


def hook_binary() -> str:
    """The installed `gpuhook-hook` beside this interpreter (what a runtime config names); GPUHOOK_TEST_HOOK
    names another build to check (e.g. an older one, to see these tests fail on it)."""
    if os.environ.get("GPUHOOK_TEST_HOOK"):
        return os.environ["GPUHOOK_TEST_HOOK"]
    path = Path(sys.executable).with_name("gpuhook-hook")
    return str(path) if path.exists() else shutil.which("gpuhook-hook") or ""


HOOK_PATH = "PATH=/usr/sbin:/usr/bin:/sbin:/bin"


def hook_env() -> list[str]:
    """The fixed environment of an OCI hook entry in the tests: PATH, and in the suite's service mode
    (support/service.py) the socket of the session's service, which the native entry then talks to."""
    from support.service import service_env

    return [HOOK_PATH, *(f"{k}={v}" for k, v in service_env().items())]


def need_hook_e2e(*tools: str) -> None:
    """The gate of a test that starts runc containers with the installed hook: root, runc, `tools` (e.g.
    gcc for planted libraries), a static busybox, and gpuhook-hook (hook_binary())."""
    need_root()
    need_tool("runc")
    for tool in tools:
        need_tool(tool)
    need_busybox()
    assert hook_binary(), "gpuhook-hook is not installed next to the test interpreter"


def gpuhook_binary() -> str:
    path = Path(sys.executable).with_name("gpuhook")
    return str(path) if path.exists() else shutil.which("gpuhook") or ""


def write_config(directory: Path, driver_root: Path, **extra: Any) -> Path:
    """A hook config for a fake driver root; `extra` keys use underscores and override the defaults here."""
    values: dict[str, Any] = {
        "driver_root": str(driver_root),
        "proc_root": f"{driver_root}/proc",
        "log_file": f"{directory}/gpuhook.log",
        "inventory_cache": f"{directory}/inventory.json",
        **extra,
    }
    path = directory / "config.toml"
    path.write_text("".join(f"{key.replace('_', '-')} = {json.dumps(value)}\n" for key, value in values.items()))
    return path


def prestart_hooks(config: Path, timeout: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """OCI hooks object running gpuhook-hook at prestart with a fixed, minimal environment."""
    hook: dict[str, Any] = {"path": hook_binary(), "args": ["gpuhook-hook", "--config", str(config), "prestart"],
                            "env": hook_env()}
    if timeout is not None:
        hook["timeout"] = timeout
    return {"prestart": [hook]}


def log_lines(directory: Path) -> list[str]:
    path = directory / "gpuhook.log"
    return path.read_text().splitlines() if path.exists() else []


# --- planted artefacts -------------------------------------------------------------------------------------


def build_marker_library(out: Path, marker: Path) -> Path:
    """A shared library that appends to `marker` (an absolute host path) when loaded or used for auditing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text(MARKER_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f'-DMARKER="{marker}"', "-o", str(out), str(src)],
                   check=True, capture_output=True)
    return out


def plant(rootfs: Path, host_dir: Path, marker: Path) -> list[str]:
    """Plant a marker library, `ldconfig` look-alikes and a `sitecustomize` both in the image and on the host,
    and return the hostile image environment that points at them. Every planted thing appends to `marker`
    (host) or creates /planted-ran (image) when run, so running it anywhere is visible."""
    lib = build_marker_library(host_dir / "lib" / "libmarker.so", marker)
    image_lib = rootfs / "planted/lib/libmarker.so"
    image_lib.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(lib, image_lib)
    script = (f"#!/bin/sh\necho planted-ldconfig >> {marker}\n"
              "[ -e /planted/lib/libmarker.so ] && echo ran > /planted-ran\nexit 0\n")  # only inside the image
    for folder in (host_dir / "bin", rootfs / "planted/bin", rootfs / "sbin", rootfs / "usr/sbin",
                   rootfs / "usr/local/sbin", rootfs / "usr/local/bin"):
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("ldconfig", "ldconfig.real"):
            (folder / name).write_text(script)
            (folder / name).chmod(0o755)
    for folder in (host_dir / "py", rootfs / "planted/py"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write('sitecustomize\\n')\n")
    return [
        f"LD_PRELOAD={lib}:/planted/lib/libmarker.so",
        f"LD_LIBRARY_PATH=/planted/lib:{lib.parent}",
        f"LD_AUDIT={lib}:/planted/lib/libmarker.so",
        f"PATH=/planted/bin:{host_dir / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        f"PYTHONPATH=/planted/py:{host_dir / 'py'}",
        f"PYTHONSTARTUP={host_dir / 'py' / 'sitecustomize.py'}",
    ]


def marker_check(marker: Path, rootfs: Path) -> None:
    """Fail if anything planted ran on the host (marker) or a planted ldconfig ran inside the image."""
    assert not marker.exists(), f"planted code ran on the host: {marker.read_text()!r}"
    assert not (rootfs / "planted-ran").exists(), "the image's planted ldconfig was run"


# --- host snapshots ----------------------------------------------------------------------------------------


def _entry(path: str, st: os.stat_result) -> tuple[Any, ...]:
    kind = stat.S_IFMT(st.st_mode)
    extra: Any = None
    if stat.S_ISLNK(st.st_mode):
        extra = os.readlink(path)
    elif stat.S_ISREG(st.st_mode) and st.st_size <= SMALL_FILE:
        try:
            with open(path, "rb") as f:
                extra = hashlib.sha256(f.read()).hexdigest()
        except OSError as exc:
            extra = f"unreadable: {exc.errno}"
    if stat.S_ISDIR(st.st_mode):  # its entries speak for it (and /dev/shm's mtime moves with other processes)
        return (kind, stat.S_IMODE(st.st_mode), st.st_ino, st.st_dev)
    return (kind, stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_rdev, extra)


def signature(paths: Iterable[str | os.PathLike[str]], skip: Iterable[str | os.PathLike[str]] = ()) -> dict[str, Any]:
    """Path -> (type, mode, size, mtime, inode, device, rdev, link target or content hash) for every entry
    under `paths` (not following symlinks; SHALLOW dirs one level only; directories by type, mode and
    identity). A bind mount over an entry changes its inode/device, a write its mtime and hash, a new file
    adds a key."""
    skipped = {os.fspath(s) for s in skip}
    out: dict[str, Any] = {}
    for top in map(os.fspath, paths):
        try:
            st = os.lstat(top)
        except OSError:
            out[top] = "absent"
            continue
        out[top] = _entry(top, st)
        if not stat.S_ISDIR(st.st_mode):
            continue
        if top in SHALLOW:
            for name in sorted(os.listdir(top)):
                full = os.path.join(top, name)
                try:
                    out[full] = _entry(full, os.lstat(full))
                except OSError:
                    continue
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skipped]
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                try:
                    out[full] = _entry(full, os.lstat(full))
                except OSError:
                    continue
    return out


def diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two signatures (empty when equal)."""
    lines = [f"+ {k}" for k in sorted(after.keys() - before.keys())]
    lines += [f"- {k}" for k in sorted(before.keys() - after.keys())]
    lines += [f"~ {k}: {before[k]} -> {after[k]}" for k in sorted(before.keys() & after.keys())
              if before[k] != after[k]]
    return lines


def content(top: Path) -> dict[str, str]:
    """Relative name -> link target, content hash or "dir": what a directory holds, not when it was made."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = str(full.relative_to(top))
            if full.is_symlink():
                out[rel] = "-> " + os.readlink(full)
            elif full.is_file():
                out[rel] = hashlib.sha256(full.read_bytes()).hexdigest()
            else:
                out[rel] = "dir" if full.is_dir() else f"special {stat.S_IFMT(full.lstat().st_mode):o}"
    return out


def host_mounts() -> list[str]:
    """The host's mount table as (root, mount point, options, fs type, source, super options) lines, ids and
    peers dropped. Whole, it changes whenever anything on the machine mounts: compare own_mounts() instead."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append(" ".join([fields[3], fields[4], fields[5], *fields[sep + 1 :]]))
    return sorted(out)


def own_mounts(*paths: str | os.PathLike[str]) -> list[str]:
    """host_mounts() limited to what a test's own code could touch: mount points at or below `paths` (the test's
    temporary folder, its fake driver) or the host folders a start could bind over (HOST_WATCH), the mounts of
    the folders above them, and a mount anywhere whose source lies in `paths` (a driver file bound elsewhere).
    Another runtime, an image build or a second service mounting elsewhere on the machine does not show; a start
    that leaks a mount into any of these places does."""
    own = [os.path.realpath(os.fspath(p)).rstrip("/") or "/" for p in paths]
    watched = [*own, *HOST_WATCH]
    # a bind's root field is its source's path inside that file system: the last two names of a test's own
    # folder (pytest-N/test_x0) name it whichever file system holds it
    tails = ["/" + "/".join(p.split("/")[-2:]) + "/" for p in own if p.count("/") >= 2]

    def touches(root: str, point: str) -> bool:
        return any(point == w or point.startswith(w.rstrip("/") + "/") or w.startswith(point.rstrip("/") + "/")
                   for w in watched) or any(t in root + "/" for t in tails)

    return [line for line in host_mounts() if touches(*line.split()[:2])]


def mounts_under(prefix: str | os.PathLike[str]) -> list[str]:
    """Host mount points at or below `prefix`."""
    p = os.fspath(prefix).rstrip("/")
    return [line.split()[1] for line in host_mounts() if line.split()[1] == p or line.split()[1].startswith(p + "/")]


def kill_leftovers(needle: str) -> list[str]:
    """SIGKILL processes whose command line mentions `needle` (a test's own config path); return them.

    A hook stuck in a hostile image outlives the runc that started it; tests clean up and report it.
    """
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if needle in cmdline and proc.pid != os.getpid():
            found.append(f"{proc.pid} {cmdline}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    return found


# --- inotify (to see an open of a device node or FIFO without owning its driver) ----------------------------

IN_ACCESS, IN_MODIFY, IN_OPEN = int(flags.ACCESS), int(flags.MODIFY), int(flags.OPEN)


class Inotify:
    """inotify_simple, as the tests use it: watch paths (never through a final symlink), then collect
    (path, mask) events without blocking."""

    def __init__(self) -> None:
        self._inotify = INotify(nonblocking=True)
        self.fd = self._inotify.fileno()
        self.watches: dict[int, str] = {}

    def watch(self, path: str | os.PathLike[str], mask: int = IN_OPEN | IN_MODIFY | IN_ACCESS) -> None:
        wd = self._inotify.add_watch(os.fsencode(path), mask | flags.DONT_FOLLOW)
        self.watches[wd] = os.fspath(path)

    def events(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        while True:
            batch = self._inotify.read(timeout=0)
            if not batch:
                return out
            out += [(self.watches.get(e.wd, "?"), e.mask) for e in batch]

    def close(self) -> None:
        self._inotify.close()


def podman_with_spec(directory: Path, fake: Any) -> Any:
    """A private podman world whose /etc/cdi holds the spec `gpuhook generate-cdi` writes for `fake`, its hooks
    through the installed `gpuhook` (what the hostile-image runs start containers with); in the suite's service
    mode through the native entry (hook_binary()) with the session's socket in the hooks' environment, so the
    createContainer hook goes to the service (its state sent after its header) or to the entry's fallback."""
    from .podman import Podman, need_podman
    from .service import service_env, spec_with_hook_env

    podman = need_podman()
    need_busybox()
    world = Podman.create(directory, podman)
    spec = world.spec_dir / "nvidia.yaml"
    served = service_env()
    subprocess.run([gpuhook_binary(), "generate-cdi", "--driver-root", str(fake.root), "--proc-root",
                    str(fake.root / "proc"), "--hook-path", hook_binary() if served else gpuhook_binary(),
                    "--output", str(spec)], check=True, capture_output=True, text=True)
    if served:
        spec.write_text(spec_with_hook_env(spec.read_text(), served))
    return world
