"""Paths of a driver install seen from this host: a driver root, a dev root and a proc root.

Resolution here is for discovery (reading the host's own driver install), not for security: symlinks are
followed but clamped to the root so that a driver root built in a directory behaves like `/`.
"""

from __future__ import annotations

import os
import posixpath

from gpuhook.model.record import Record


class Roots(Record):
    driver_root: str = "/"
    dev_root: str = "/"
    proc_root: str = "/proc"

    @classmethod
    def make(cls, driver_root: str = "/", dev_root: str | None = None, proc_root: str | None = None) -> Roots:
        driver_root = os.path.abspath(driver_root)
        return cls(
            driver_root=driver_root,
            dev_root=os.path.abspath(dev_root) if dev_root else driver_root,
            proc_root=os.path.abspath(proc_root) if proc_root else "/proc",
        )


def join(root: str, path: str) -> str:
    """`root` + absolute `path`, without doubling slashes (join("/", "/usr") == "/usr")."""
    return posixpath.normpath(root.rstrip("/") + "/" + path.lstrip("/")) if root != "/" else posixpath.normpath(path)


def resolve_in_root(root: str, path: str, max_links: int = 40) -> str:
    """The canonical (root-relative) path of `path` with every symlink followed inside `root`.

    Absolute link targets are taken relative to `root`, `..` never climbs above it. Returns the canonical
    path even when the last component does not exist.
    """
    parts = [p for p in path.split("/") if p and p != "."]
    resolved: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = "/" + "/".join([*resolved, part])
        host = join(root, candidate)
        if os.path.islink(host):
            links += 1
            if links > max_links:
                raise OSError(40, "Too many levels of symbolic links", host)
            target = os.readlink(host)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)
