"""Apply ContainerEdits to a starting container from a prestart hook.

Host files (mount sources, ldconfig) are opened by descriptor in the hook's own namespace; a forked child
then joins the container's mount namespace once (the hook process itself never switches), makes the mounts
and links there, then the ld cache with the device nodes made while ldconfig runs, and reports one line back
through a pipe. The device cgroup is widened from the parent, on the host side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from gpuhook import _native
from gpuhook.errors import InjectionError, render
from gpuhook.inject import cudacompat, ldcache, mounts
from gpuhook.inject.rootfs import RootFS
from gpuhook.model.edits import ContainerEdits

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path loads none)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _T = TypeVar("_T", bound="tuple[Any, ...]")


def _params_without_modify(host_params: str) -> bytes:
    """The driver's params with ModifyDeviceFiles: 0, so the driver inside never creates device nodes."""
    with open(host_params, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    out = [("ModifyDeviceFiles: 0" if line.startswith("ModifyDeviceFiles:") else line) for line in lines]
    return ("\n".join(out) + "\n").encode()


def _mask_proc(root: RootFS, edits: ContainerEdits, proc_root: str) -> None:
    """With a real driver the container's procfs shows every GPU: cover /proc/driver/nvidia with a tmpfs
    holding the version, a params copy with ModifyDeviceFiles: 0, the selected GPUs' directories and the
    capability files (as libnvidia-container does).

    Nothing to do where the container's /proc has no driver directory (no kernel module, as on a simulation).
    """
    if not root.exists("/proc/driver/nvidia/gpus"):
        return
    host_dir = os.path.join(proc_root, "driver/nvidia")
    sources = {d: mounts.clone_source(os.path.join(proc_root, d.removeprefix("/proc/"))) for d in edits.proc_gpu_dirs}
    caps = os.path.join(host_dir, "capabilities")
    if os.path.isdir(caps):
        sources["/proc/driver/nvidia/capabilities"] = mounts.clone_source(caps)
    with open(os.path.join(host_dir, "version"), "rb") as f:
        version = f.read()
    params = _params_without_modify(edits.params_host_path) if edits.params_host_path else b""
    dfd = root.open("/proc/driver/nvidia", os.O_PATH | os.O_DIRECTORY)
    root.mounted_folder()  # covered by the tmpfs from here on
    try:
        _native.mount(
            "tmpfs",
            f"/proc/self/fd/{dfd}",
            "tmpfs",
            _native.MS_NOSUID | _native.MS_NODEV | _native.MS_NOEXEC,
            "mode=0555,size=64k",
        )
    finally:
        os.close(dfd)
    root.write_file("/proc/driver/nvidia/version", version, 0o444)
    if params:
        root.write_file("/proc/driver/nvidia/params", params, 0o444)
    os.close(root.mkdirs("/proc/driver/nvidia/gpus", 0o555))
    for path, fd in sources.items():
        mounts.bind(root, fd, path, ("ro", "nosuid", "nodev", "noexec"))
        os.close(fd)
    top = root.open("/proc/driver/nvidia", os.O_PATH | os.O_DIRECTORY)
    try:
        mounts.set_options(top, ("ro", "nosuid", "nodev", "noexec"), private=False)
    finally:
        os.close(top)


def _mapped_root(map_file: str) -> int:
    """The host id that a user namespace's uid_map/gid_map maps the container's 0 to."""
    try:
        with open(map_file, encoding="ascii") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError) as exc:
        raise InjectionError(f"cannot read {map_file}: {getattr(exc, 'strerror', None) or exc}") from None
    for line in lines:
        fields = line.split()
        if len(fields) == 3 and all(x.isdigit() for x in fields):
            inside, outside, count = map(int, fields)
            if inside <= 0 < inside + count:
                return outside - inside
    raise InjectionError(f"the container's user namespace maps no root ({map_file})")


def user_namespace_root(pid: int, host_proc_root: str = "/proc") -> tuple[int, int] | None:
    """(uid, gid) on the host of the container's root when the container has its own user namespace (OCI
    linux.namespaces "user" with uid/gid mappings), else None: then device nodes are bind mounts, not mknod."""
    try:
        theirs = os.stat(f"{host_proc_root}/{pid}/ns/user")
        ours = os.stat("/proc/self/ns/user")  # (host_proc_root may be /proc/self/fd: the pid is a descriptor)
    except OSError:
        return None
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return None
    return _mapped_root(f"{host_proc_root}/{pid}/uid_map"), _mapped_root(f"{host_proc_root}/{pid}/gid_map")


def apply_in_namespace(
    rootfs_path: str,
    edits: ContainerEdits,
    sources: dict[str, int],
    ldconfig_fd: int,
    proc_root: str,
    userns_root: tuple[int, int] | None = None,
    beside: Callable[[], None] | None = None,
) -> None:
    """Everything that happens inside the container's mount namespace (the caller has joined it).

    With `userns_root` (a container with its own user namespace), `sources` also holds a clone of each device
    node's host node, keyed by its container path, bound instead of made with mknod. `beside` runs while
    ldconfig does, before the binds and links ldconfig does not read and the nodes (the device cgroup's grant,
    opened on the host: devcgroup.Grant.apply)."""
    os.umask(0)
    # ldconfig needs the libraries and their links (ldcache.read_by_ldconfig); every other bind and link, the
    # cgroup's grant, the device nodes and /proc/driver/nvidia are made while it runs (a process that joined a
    # container's namespace is there for that container alone, so it may leave it for ldconfig's view: disposable)
    binds, binds_beside = _before_ldconfig([(sources[m.container_path], m.container_path, m.options)
                                            for m in edits.mounts])
    links, links_beside = _before_ldconfig([(link.target, link.link) for link in edits.symlinks])
    with RootFS(rootfs_path, owner=userns_root) as root:
        mounts.bind_all(root, binds)
        root.symlinks(links)
        with _ldconfig_running(root, edits, ldconfig_fd):
            if beside is not None:
                beside()
            mounts.bind_all(root, binds_beside)
            root.symlinks(links_beside)
            for node in edits.device_nodes:
                if userns_root is None:
                    root.mknod(node.path, node.mode, node.major, node.minor, node.type)
                else:
                    mounts.bind_node(root, sources[node.path], node.path, userns_root)
            _mask_proc(root, edits, proc_root)


def _before_ldconfig(items: list[_T]) -> tuple[list[_T], list[_T]]:
    """`items` (each a tuple whose second element is a container path) split, in order, into those ldconfig
    reads (ldcache.read_by_ldconfig) and the rest."""
    before: list[_T] = []
    rest: list[_T] = []
    for item in items:
        (before if ldcache.read_by_ldconfig(item[1]) else rest).append(item)
    return before, rest


def _ldconfig_running(root: RootFS, edits: ContainerEdits, ldconfig_fd: int) -> contextlib.AbstractContextManager[None]:
    """cudacompat.running over the edits' ld folders; nothing where the edits have none."""
    if not edits.ld_dirs:
        return contextlib.nullcontext()
    return cudacompat.running(root, edits.ld_dirs, ldconfig_fd, edits.cuda_compat_driver, disposable=True)


def run_in_mount_namespace(pid: int, work: Callable[[], None], proc_root: str = "/proc", fork: bool = True) -> None:
    """Run `work` in a forked child that joined /proc/<pid>/ns/mnt; re-raise its failure as one line here.

    With `fork=False` the calling process joins the namespace itself and does not come back to its own: only a
    single-threaded process that may leave it may ask so (the service's child or worker for one start, which
    goes back by itself: service/server.py _Home), which saves a fork."""
    try:
        ns_fd = os.open(f"{proc_root}/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InjectionError(f"cannot open mount namespace of container process {pid}: {exc.strerror}") from None
    if not fork:
        try:
            _native.setns(ns_fd, _native.CLONE_NEWNS)
        finally:
            os.close(ns_fd)
        work()
        return
    r, w = os.pipe()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(r)
        _native.die_with_parent(parent)
        code = 0
        try:
            _native.setns(ns_fd, _native.CLONE_NEWNS)
            work()
        except BaseException as exc:  # noqa: BLE001 - everything becomes one line for the parent
            os.write(w, render(exc).encode()[:4000])  # one escaped, bounded line, whatever failed
            code = 1
        os._exit(code)
    os.close(w)
    os.close(ns_fd)
    with os.fdopen(r, "rb") as pipe:
        message = pipe.read().decode(errors="replace").strip()
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise InjectionError(message or f"injection child died ({os.waitstatus_to_exitcode(status)})")


def inject(
    pid: int,
    rootfs_path: str,
    edits: ContainerEdits,
    ldconfig_path: str,
    proc_root: str = "/proc",
    host_proc_root: str = "/proc",
    fork: bool = True,
    beside: Callable[[], None] | None = None,
) -> None:
    """Apply `edits` to the container whose init process is `pid` (prestart: namespaces exist, no pivot yet);
    `fork=False`: run_in_mount_namespace's, for a caller that may leave its own namespace (the service's child or
    worker);
    `beside`: apply_in_namespace's, run in the container's namespace while ldconfig runs."""
    userns_root = user_namespace_root(pid, host_proc_root)
    sources = dict(zip([m.container_path for m in edits.mounts],
                       mounts.clone_sources([m.host_path for m in edits.mounts])))
    if userns_root is not None:  # bind sources are taken here, in the host's namespace, before setns
        try:
            sources.update(zip([n.path for n in edits.device_nodes],
                               mounts.clone_sources([n.host_path for n in edits.device_nodes])))
        except BaseException:
            for fd in sources.values():
                os.close(fd)
            raise
    ldconfig_fd = ldcache.open_ldconfig(ldconfig_path) if edits.ld_dirs else -1
    try:
        run_in_mount_namespace(
            pid,
            lambda: apply_in_namespace(rootfs_path, edits, sources, ldconfig_fd, proc_root, userns_root, beside),
            host_proc_root,
            fork,
        )
    finally:
        for fd in sources.values():
            os.close(fd)
        if ldconfig_fd >= 0:
            os.close(ldconfig_fd)
