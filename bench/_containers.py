"""Containers for the benchmarks: the tests' own (tests/support), timed.

A static-busybox rootfs (gpuhook.fakedriver.rootfs), runc bundles and commands (support.runc, whose base
config is what `runc spec` writes, made non-interactive with a writable root) and a private podman
(support.podman). Every timed start gets a fresh copy of the rootfs, because the hooks create files in it
(mount points, links, the ld cache) and a reused one would make later starts cheaper than a real one.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import support.service as support_service
from _common import BenchError, gpuhook_command, timed
from support.hostile import write_config as write_hook_config
from support.podman import Podman
from support.runc import make_bundle, runc_cmd, runc_delete, unique_id

from gpuhook.fakedriver.rootfs import INSTALL_HINT, busybox_rootfs, find_static_busybox

__all__ = [
    "HOOK_ENV",
    "Podman",
    "busybox_template",
    "fresh_rootfs",
    "hook_entry",
    "install_lean_entry",
    "install_native_entry",
    "make_bundle",
    "noop_hook",
    "podman_run",
    "runc_run",
    "start_service",
    "unique_id",
    "write_hook_config",
]

APPLETS = ("sh", "true", "ls", "cat", "echo")
HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


def busybox_template(dest: Path) -> Path:
    """`dest`: a rootfs of a static busybox, a few applets and the usual empty directories."""
    if find_static_busybox() is None:
        raise BenchError(f"needs a static busybox ({INSTALL_HINT})")
    return busybox_rootfs(dest, APPLETS)


_SPENT = itertools.count()


def fresh_rootfs(template: Path, dest: Path) -> Path:
    """A copy of `template` at `dest`; a previous copy there is moved into `<dest's folder>/.spent/`, not deleted
    (the work directory goes when the script ends).

    Deleting it there, a moment before the next timed start, timed the script's own clean-up: ext4 allocates no
    inode freed in the last one to six minutes (the kernel's `recently_deleted`), so each file, link or folder
    the next start created scanned past the hundreds freed by the rounds before (a profile of the hook put half
    its CPU in that scan; ~100 µs a create instead of ~6). The busybox binary is hard-linked, not copied:
    nothing writes it, and a few MB a round would have the disk writing back while the hooks run."""
    if dest.exists():
        spent = dest.parent / ".spent"
        spent.mkdir(exist_ok=True)
        dest.rename(spent / str(next(_SPENT)))
    shutil.copytree(template, dest, symlinks=True, copy_function=_link_programs)
    return dest


def _link_programs(src: str, dst: str) -> None:
    """copytree's copy_function: an executable is hard-linked, anything else copied (a file a runtime or hook might
    write stays each copy's own)."""
    if os.access(src, os.X_OK):
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def hook_entry(hook: str, config_file: Path, sock: Path | None = None) -> dict[str, Any]:
    """A prestart hook entry as the README and oci-hooks.d configure it (fixed env, explicit config); with `sock`,
    the service socket the native entry talks to (GPUHOOK_SERVICE_SOCKET)."""
    env = [*HOOK_ENV, *([f"GPUHOOK_SERVICE_SOCKET={sock}"] if sock else [])]
    return {"path": hook, "args": ["gpuhook-hook", "--config", str(config_file), "prestart"], "env": env}


def noop_hook() -> dict[str, Any]:
    """A hook that only reads its state (busybox `wc -c`): what the runtime charges for running any hook, the
    baseline a hook's own share is measured against. BenchError without a static busybox."""
    busybox = find_static_busybox()
    if busybox is None:
        raise BenchError(f"needs a static busybox ({INSTALL_HINT})")
    return {"path": busybox, "args": ["busybox", "wc", "-c"]}


def runc_run(bundle: Path, container_id: str) -> float:
    """Milliseconds of `runc run` (foreground: create, hooks, start, wait; not the delete after); BenchError
    on failure."""
    try:
        ms, result = timed(runc_cmd("run", "--bundle", str(bundle), container_id), timeout=60)
    finally:
        runc_delete(container_id)
    if result.returncode != 0:
        raise BenchError(f"runc run {container_id} failed ({result.returncode}): {result.stderr.strip()[-800:]}")
    return ms


def podman_run(podman: Podman, rootfs: Path, devices: Sequence[str], argv: Sequence[str]) -> float:
    """Milliseconds of `podman run --rm` of `argv` in `rootfs` with CDI `devices`; BenchError on failure."""
    ms, result = timed(podman.run_command(rootfs, devices, argv), timeout=120)
    if result.returncode != 0:
        raise BenchError(f"podman run with {list(devices)} failed ({result.returncode}): "
                         f"{result.stderr.strip()[-800:]}")
    return ms


def install_native_entry(path: Path) -> tuple[Path, Path]:
    """`gpuhook hook install --path PATH`: (the native entry, its Python fallback PATH.py); BenchError without a
    native entry (support.service.install_native_entry)."""
    try:
        native, script = support_service.install_native_entry(path)
    except AssertionError as exc:
        raise BenchError(f"{exc}: nothing to compare") from None
    return Path(native), Path(script)


def start_service(sock: Path, config: Path | None, log: Path) -> support_service.Running:
    """`gpuhook service` (the installed console script) on `sock`; BenchError, its stderr quoted, if it does not
    come up (support.service.start)."""
    try:
        return support_service.start(sock, config, log, gpuhook_command())
    except AssertionError as exc:
        raise BenchError(str(exc)) from None


def install_lean_entry(path: Path) -> str:
    """`gpuhook hook install --path PATH`, in-process: the -IS entry script the hook benchmarks run."""
    from gpuhook.cli.entry import install

    return install(str(path), native=False)[0]  # the script itself (bench/service.py times the native entry)
