"""Bind mounts of host files into a container rootfs, done by descriptor (no path is resolved twice).

A bind mount's source must live in the caller's mount namespace, so sources are cloned with
open_tree(OPEN_TREE_CLONE) in the host's namespace first; the detached copies are attached inside the
container's namespace with move_mount onto a target descriptor resolved in the rootfs.
"""

from __future__ import annotations

import errno
import os
import stat

from gpuhook import _native
from gpuhook.errors import InjectionError
from gpuhook.inject.rootfs import RESOLVE, RootFS, creation_error

MOVE_MOUNT_T_EMPTY_PATH = getattr(_native, "MOVE_MOUNT_T_EMPTY_PATH", 0x40)
# each option: its mount(2) flag and its mount_setattr(2) attribute
_OPTION_FLAGS = {
    "ro": (_native.MS_RDONLY, _native.MOUNT_ATTR_RDONLY),
    "nosuid": (_native.MS_NOSUID, _native.MOUNT_ATTR_NOSUID),
    "nodev": (_native.MS_NODEV, _native.MOUNT_ATTR_NODEV),
    "noexec": (_native.MS_NOEXEC, _native.MOUNT_ATTR_NOEXEC),
}
# what a bind remount (MS_REMOUNT|MS_BIND) sets anew, whatever the mount had: each flag it is not given is cleared
_REMOUNT_CLEARS = (_native.MOUNT_ATTR_RDONLY | _native.MOUNT_ATTR_NOSUID | _native.MOUNT_ATTR_NODEV
                   | _native.MOUNT_ATTR_NOEXEC | _native.MOUNT_ATTR_NOSYMFOLLOW)
_setattr = {"missing": False}  # the kernel lacks mount_setattr (before 5.12): learnt once, remount from then on


class HostFileGone(InjectionError):
    """A host file the plan names is gone (ENOENT): the driver changed since the inventory was taken. Raised
    before anything in the container is touched (the sources are taken first), so the start can plan again."""


def clone_source(host_path: str) -> int:
    """A detached copy of the mount of `host_path` (submounts too for a directory), taken in the host's
    namespace before joining the container's."""
    try:
        return _native.open_tree(
            _native.AT_FDCWD, host_path, _native.OPEN_TREE_CLONE | _native.OPEN_TREE_CLOEXEC | _native.AT_RECURSIVE
        )
    except OSError as exc:
        raise InjectionError(f"cannot open host file {host_path}: {exc.strerror}") from None


def clone_sources(host_paths: list[str]) -> list[int]:
    """clone_source for each of `host_paths`, in one native call; the first that fails is clone_source's line
    (the ones cloned before it closed)."""
    try:
        return _native.open_trees(host_paths, _native.OPEN_TREE_CLONE | _native.OPEN_TREE_CLOEXEC
                                  | _native.AT_RECURSIVE)
    except OSError as exc:
        kind = HostFileGone if exc.errno == errno.ENOENT else InjectionError
        raise kind(f"cannot open host file {exc.filename}: {exc.strerror}") from None


def _remount_flags(options: tuple[str, ...]) -> int:
    flags = _native.MS_REMOUNT | _native.MS_BIND
    for opt in options:
        flags |= _OPTION_FLAGS.get(opt, (0, 0))[0]
    return flags


def set_options(fd: int, options: tuple[str, ...], private: bool) -> None:
    """Give the mount that `fd` names exactly the flags `options` (a bind remount's result: ro, nosuid, nodev,
    noexec as listed, the others cleared, atime kept), and with `private` no propagation: one mount_setattr(2)
    call, or the two mount(2) calls (MS_PRIVATE, then the remount) through /proc/self/fd before Linux 5.12. By
    descriptor: looking the path up again could land elsewhere in a hostile image. OSError as the kernel says."""
    if not _setattr["missing"]:
        wanted, clear = _attributes(options)
        try:
            _native.mount_setattr(fd, "", _native.AT_EMPTY_PATH, wanted, clear, _native.MS_PRIVATE if private else 0)
            return
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            _setattr["missing"] = True
    top = f"/proc/self/fd/{fd}"
    if private:
        _native.mount(None, top, None, _native.MS_PRIVATE, None)
    _native.mount(None, top, None, _remount_flags(options), None)


def _attributes(options: tuple[str, ...]) -> tuple[int, int]:
    """The MOUNT_ATTR_* to set and to clear: a bind remount's result of `options` (set_options)."""
    wanted = 0
    for opt in options:
        wanted |= _OPTION_FLAGS.get(opt, (0, 0))[1]
    return wanted, _REMOUNT_CLEARS & ~wanted


def bind_all(rootfs: RootFS, binds: list[tuple[int, str, tuple[str, ...]]]) -> None:
    """Every bind of an injection, in order, each as bind() makes it: (detached tree, container path, options).

    A file's tree onto a new empty file (nearly every bind: 98 for 8 GPUs with every capability) goes in runs
    of the native helper (RootFS.in_runs, _native.FileBinds); a folder's or a socket's tree, a file already
    there, a folder not the rootfs's own, is bind()'s, as is everything on a kernel before mount_setattr."""
    if _setattr["missing"]:
        for tree, path, options in binds:
            bind(rootfs, tree, path, options)
        return

    def start(first: int, places: list[tuple[int, str]]) -> _native.Run:
        return _native.FileBinds([(pfd, name, binds[first + k][0], *_attributes(binds[first + k][2]))
                                  for k, (pfd, name) in enumerate(places)], 0o644, RESOLVE, rootfs.owner)

    def settle(i: int, step: int, err: int) -> None:
        tree, path, options = binds[i]
        if step == _native.BIND_OWNER:  # created, not given to the container's root: ensure_file would keep it
            raise creation_error(path, OSError(err, os.strerror(err)))
        if step == _native.BIND_SETATTR:  # attached: its flags set_options' way (an old kernel), or its line
            _set_attached(tree, path, options)
        else:  # not a file's tree, something stands there, or what failed: bind() does it, or names why
            bind(rootfs, tree, path, options)

    rootfs.in_runs([path for _, path, _ in binds], start, settle)


def bind(rootfs: RootFS, tree_fd: int, container_path: str, options: tuple[str, ...]) -> None:
    """Attach the cloned tree `tree_fd` at `container_path` inside the rootfs, then apply the option flags."""
    is_dir = stat.S_ISDIR(os.fstat(tree_fd).st_mode)
    target = rootfs.mkdirs(container_path) if is_dir else rootfs.ensure_file(container_path)
    if is_dir:
        rootfs.mounted_folder()  # covered from here on: a folder held at or below it is no longer what paths reach
    _attach(tree_fd, target, container_path, options)


NODE_OPTIONS = ("nosuid", "noexec")  # never nodev: the mount is the node


def bind_node(rootfs: RootFS, tree_fd: int, container_path: str, owner: tuple[int, int]) -> None:
    """A device node for a container with its own user namespace: the host's node (cloned in `tree_fd`) bound
    onto an empty file, as runc and libnvidia-container do. mknod there fails (EOVERFLOW: the container's /dev
    is a tmpfs of its user namespace, which cannot represent the host's root) and a node on it could not be
    opened anyway (such a filesystem is nodev). The file is created as `owner`, the host uid/gid of the
    container's root, so that its /dev accepts it."""
    uid, gid = owner
    os.setegid(gid)
    os.seteuid(uid)  # effective capabilities drop until seteuid(0) restores them from the permitted set
    try:
        target = rootfs.ensure_file(container_path)
    finally:
        os.seteuid(0)
        os.setegid(0)
    _attach(tree_fd, target, container_path, NODE_OPTIONS)


def _attach(tree_fd: int, target: int, container_path: str, options: tuple[str, ...]) -> None:
    """move_mount the detached tree onto the `target` descriptor (closed here), then give it `options` and no
    propagation (set_options through the tree's own descriptor, which now names the attached mount)."""
    try:
        _native.move_mount(tree_fd, "", target, "", _native.MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)
    except OSError as exc:
        raise InjectionError(f"cannot mount {container_path} in container: {exc.strerror}") from None
    finally:
        os.close(target)
    _set_attached(tree_fd, container_path, options)


def _set_attached(tree_fd: int, container_path: str, options: tuple[str, ...]) -> None:
    """The attached tree's mount given `options` and no propagation, through its own descriptor."""
    try:
        set_options(tree_fd, options, private=True)
    except OSError as exc:
        raise InjectionError(f"cannot remount {container_path} ({','.join(options)}) in container: "
                             f"{exc.strerror}") from None
