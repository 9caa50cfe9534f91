"""What a CDI spec's createContainer hook does inside a starting container: links and the ld cache.

Click-free and import-light: the runtime runs this at every start of a container that uses the spec, through
the click CLI (`gpuhook cdi-hook …`) or the lean entry script (cli/entry.py); both parse into these functions.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Sequence

LINK_SEPARATOR = "::"
DEFAULT_LDCONFIG = "/sbin/ldconfig"
_DRIVER_VERSION = r"[0-9]{1,6}(\.[0-9]{1,6}){0,3}"  # compiled at first use: importing costs nothing


def valid_driver_version(value: str) -> bool:
    """`--host-driver-version`: digits and dots (535.309.01), bounded."""
    return re.fullmatch(_DRIVER_VERSION, value) is not None


def parse_link(value: str) -> tuple[str, str] | None:
    """`TARGET::/absolute/link` -> (target, link); None when malformed."""
    target, sep, link = value.partition(LINK_SEPARATOR)
    if not sep or not target or not link.startswith("/"):
        return None
    return target, link


def update_container(rootfs_path: str, links: Iterable[tuple[str, str]], folders: list[str],
                     ldconfig_path: str = DEFAULT_LDCONFIG, host_driver_version: str = "",
                     links_if_present: Iterable[tuple[str, str]] = (),
                     owner: tuple[int, int] | None = None, disposable: bool = False, ldconfig_fd: int = -1) -> None:
    """Create the links (an existing file or directory at a link is left alone), then, if `folders`, register
    them and rebuild the ld cache with the host's ldconfig. One rootfs descriptor for both steps.
    `links_if_present` are made only when their target, resolved beside the link inside the rootfs, exists (a
    device's /dev/dri/by-path link when the runtime gave that device's node).
    With `host_driver_version`, an image's newer CUDA compat libcuda goes first (inject/cudacompat.py). With
    `owner` (run_hook: the host ids of the container's root in its own user namespace), what is created belongs
    to the container's root. `disposable`: ldcache.running's (this process exists for this container).
    `ldconfig_fd`: ldconfig already opened (open_hook_ldconfig) where the caller's namespace is the host's, the
    caller's to close; else `ldconfig_path` is opened here."""
    from gpuhook.inject.rootfs import RootFS

    fd = -1
    if folders and ldconfig_fd < 0:
        from gpuhook.inject.ldcache import open_ldconfig

        fd = ldconfig_fd = open_ldconfig(ldconfig_path)
    try:
        with RootFS(rootfs_path, owner=owner) as rootfs:
            rootfs.symlinks(list(links))
            for target, link in links_if_present:
                # lexically: the link's folder need not exist yet ('..' at the rootfs's top stays there)
                if rootfs.exists(posixpath.normpath(posixpath.join(posixpath.dirname(link), target))):
                    rootfs.symlink(target, link)
            if folders:
                from gpuhook.inject.cudacompat import update_ldcache

                update_ldcache(rootfs, folders, ldconfig_fd, host_driver_version, disposable)
    finally:
        if fd >= 0:
            os.close(fd)


# --- the click-free command line: what the lean entry and `gpuhook service` take --------------------------------

HookArgs = tuple[list[tuple[str, str]], list[str], str, str, list[tuple[str, str]]]
_COMMANDS = {"create-symlinks": ("--link", "--link-if-present"),
             "update-ldcache": ("--folder", "--ldconfig-path", "--host-driver-version"),
             "update-container": ("--link", "--link-if-present", "--folder", "--ldconfig-path",
                                  "--host-driver-version")}


def _options(args: Sequence[str], names: tuple[str, ...]) -> list[tuple[str, str]] | None:
    """(name, value) for `--name value` / `--name=value` pairs; None for anything else."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, sep, value = arg.partition("=")
        if name not in names:
            return None
        if not sep:
            if i + 1 >= len(args):
                return None
            value = args[i + 1]
            i += 1
        if value.startswith("-"):
            return None
        out.append((name, value))
        i += 1
    return out


def parse_hook_args(args: Sequence[str]) -> HookArgs | None:
    """`cdi-hook COMMAND OPTIONS…` (the words after `cdi-hook`) -> (links, folders, ldconfig, host driver
    version, links if present); None for anything the click command should answer (help, and every malformed
    value: click says what is wrong), so the lean paths never word an error of their own."""
    command, rest = (args[0], args[1:]) if args else ("", [])
    allowed = _COMMANDS.get(command)
    pairs = _options(rest, allowed) if allowed else None
    if pairs is None:
        return None
    parsed = {n: [link for v in (v for k, v in pairs if k == n) if (link := parse_link(v)) is not None]
              for n in ("--link", "--link-if-present")}
    links, present = parsed["--link"], parsed["--link-if-present"]
    folders = [v for n, v in pairs if n == "--folder"]
    ldconfig = [v for n, v in pairs if n == "--ldconfig-path"]
    versions = [v for n, v in pairs if n == "--host-driver-version"]
    malformed = len(links) + len(present) < sum(1 for n, _ in pairs if n in parsed)
    if malformed or len(ldconfig) > 1 or not all(f.startswith("/") for f in folders):
        return None
    if len(versions) > 1 or not all(valid_driver_version(v) for v in versions):
        return None
    return links, folders, (ldconfig[0] if ldconfig else DEFAULT_LDCONFIG), versions[0] if versions else "", present


def open_hook_ldconfig(parsed: HookArgs) -> int:
    """The ldconfig a parsed hook call runs (its `--ldconfig-path`), opened by descriptor and checked static, or
    -1 for a call with no folder (it runs none): for a caller that opens it in its own namespace, then joins the
    container's (the service: nothing is looked up in the client's files)."""
    if not parsed[1]:
        return -1
    from gpuhook.inject.ldcache import open_ldconfig

    return open_ldconfig(parsed[2])


def run_hook(parsed: HookArgs, state_text: bytes, ldconfig_fd: int = -1) -> None:
    """One createContainer hook call: the parsed command line applied to the container the state names, its
    rootfs from config.json through oci.bundle (the one parser of both inputs, the state parsed once). The
    state's pid is the container's init process at createContainer: with its own user namespace, what is
    created is given to the host ids of its root. Its caller is that hook's own process (the CLI's, or the
    service's child for it), which exists for this one call: disposable (ldcache.running). `ldconfig_fd`:
    open_hook_ldconfig's, the caller's to close."""
    from gpuhook.inject.apply import user_namespace_root
    from gpuhook.oci.bundle import load_bundle, parse_state

    state = parse_state(state_text)
    rootfs = load_bundle(state.bundle).rootfs
    update_container(rootfs, *parsed, owner=user_namespace_root(state.pid) if state.pid > 0 else None,
                     disposable=True, ldconfig_fd=ldconfig_fd)
