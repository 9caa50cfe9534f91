"""A cached Inventory on disk, so the hook skips NVML and file-system scans on every container start.

The cache records the fingerprint of what it describes (driver version, node set, MIG layout, roots);
a hook that computes a different fingerprint rediscovers and rewrites it.

The cache is a hint, never an authority: whatever is at its path (a FIFO, a pty, a link, a directory, a forged,
truncated or huge file, one a driver change raced) must cost at most a rediscovery. A forged cache with the right
fingerprint would make the hook bind any host file and make any node, so it is used only when only root could
have written it: a regular file owned by root (or the caller), not group- or world-writable, opened with
O_NOFOLLOW|O_NONBLOCK, at most MAX_BYTES, in a folder whose every ancestor is a directory owned by root (or the
caller) that no one else can write to (a sticky one like /tmp is fine: others cannot replace what is in it),
links on the way included (their folders are checked the same way). It is loaded only when whole
(`Inventory.incomplete`), and written only from a scan whose fingerprint was the same before and after it, only
into such a folder and only over a regular file (fileio.atomic.write_regular: never through a link, never to a
device). Anything else is one note (the hook's log line, the CLI's stderr) and a rediscovery.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from gpuhook.discover.fingerprint import fingerprint
from gpuhook.discover.roots import Roots
from gpuhook.errors import GpuhookError, clip
from gpuhook.model.inventory import Inventory

SCAN_TRIES = 2  # a driver that changes under two scans in a row is still changing: use the last, store nothing
MAX_BYTES = 16 << 20  # a big inventory (8 GPUs, every MIG slice, every driver file) is well under 1 MiB


class Untrusted(Exception):
    """The cache, or a folder on its way, could have been written by someone else than root: the reason."""


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _check_chain(folder: str) -> None:
    """`folder` (a real path: no links) and each of its ancestors: a directory owned by root (or us) that no one
    else can write to, or a sticky one (only the owner of an entry can replace it)."""
    path = folder
    while True:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise Untrusted(f"{path} is not a directory")
        if not _trusted_owner(st.st_uid):
            raise Untrusted(f"{path} is owned by uid {st.st_uid}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise Untrusted(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        if path == "/":
            return
        path = os.path.dirname(path)


def trusted_folder(folder: str) -> str:
    """The real path of `folder` once it and every folder on the way to it is trusted (_check_chain), each link
    on the way owned by root (or us) in a trusted folder; Untrusted (or OSError) otherwise."""
    folder = os.path.abspath(folder)
    prefix = "/"
    for part in folder.strip("/").split("/"):
        if not part:
            continue
        prefix = os.path.join(prefix, part)
        st = os.lstat(prefix)
        if stat.S_ISLNK(st.st_mode):
            if not _trusted_owner(st.st_uid):
                raise Untrusted(f"{prefix} is a link owned by uid {st.st_uid}")
            _check_chain(os.path.realpath(os.path.dirname(prefix)))
    real = os.path.realpath(folder)
    _check_chain(real)
    return real


def read_trusted(path: str) -> bytes:
    """The cache's bytes under the rules of this module's docstring; Untrusted or OSError otherwise."""
    folder = trusted_folder(os.path.dirname(os.path.abspath(path)))
    fd = os.open(os.path.join(folder, os.path.basename(path)),
                 os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted("not a regular file")
        if not _trusted_owner(st.st_uid):
            raise Untrusted(f"owned by uid {st.st_uid}")
        if st.st_mode & 0o022:
            raise Untrusted(f"writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_size > MAX_BYTES:
            raise Untrusted(f"{st.st_size} bytes (at most {MAX_BYTES})")
        data = os.read(fd, MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise Untrusted(f"over {MAX_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def _note(notes: list[str] | None, path: str, why: str) -> None:
    if notes is not None:
        notes.append(f"inventory cache {clip(path, quote=False)} ignored: {clip(why, quote=False)}")


def load_fresh(path: str, roots: Roots, notes: list[str] | None = None) -> Inventory | None:
    """The cached inventory if trusted (see above), whole and still true for `roots`; None otherwise, with a
    note in `notes` when something stands at the path that is not a cache gpuhook wrote."""
    if not path:
        return None
    try:
        data = read_trusted(path)
    except FileNotFoundError:
        return None
    except Untrusted as exc:
        _note(notes, path, str(exc))
        return None
    except OSError as exc:
        _note(notes, path, "a link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc)))
        return None
    try:
        inv = Inventory.from_dict(json.loads(data))
    # any damaged cache (deep nesting included) only means: rediscover
    except (GpuhookError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    if inv.fingerprint != fingerprint(roots) or inv.incomplete():
        return None
    return inv


def _make_folder(folder: str) -> str:
    """`folder`'s real path, its missing levels created (0755) below the deepest existing, trusted one; a level
    another start created meanwhile is fine."""
    folder = os.path.abspath(folder)
    missing: list[str] = []
    top = folder
    while not os.path.lexists(top):
        missing.append(top)
        top = os.path.dirname(top)
    real = trusted_folder(top)
    for level in reversed(missing):
        real = os.path.join(real, os.path.basename(level))
        try:
            os.mkdir(real, 0o755)
        except FileExistsError:  # a concurrent start made it: it is checked below like any other
            continue
    return trusted_folder(folder) if missing else real


def store(path: str, inv: Inventory, notes: list[str] | None = None) -> None:
    """Best effort: a cache that cannot be written only costs speed (and one note when refused)."""
    if not path:
        return
    from gpuhook.fileio.atomic import write_regular

    try:
        folder = _make_folder(os.path.dirname(os.path.abspath(path)))
        write_regular(os.path.join(folder, os.path.basename(path)), json.dumps(inv.to_dict()).encode(), 0o644)
    except (Untrusted, OSError, GpuhookError) as exc:
        _note(notes, path, f"not written: {exc}")


def scan(roots: Roots) -> tuple[Inventory, bool]:
    """A fresh inventory and whether it is stable: the fingerprint taken before the scan equals the one taken
    after it (discover's own), so nothing it describes changed while it was being read."""
    from gpuhook.discover.scan import discover

    for _ in range(SCAN_TRIES):
        before = fingerprint(roots)
        inv = discover(roots)
        if inv.fingerprint == before:
            return inv, True
    return inv, False


# A resident process (`gpuhook service`) keeps each whole inventory it loaded here, keyed by roots and cache path,
# and reuses it while its fingerprint is current: the same check the file cache gets, without reading and
# decoding the file at every start. None (every short-lived hook): off, the file is the only cache.
_WARM: dict[tuple[Roots, str], Inventory] | None = None


def keep_warm() -> None:
    """Keep inventories in memory from now on (the service calls this once, before its first fork)."""
    global _WARM
    if _WARM is None:
        _WARM = {}


def rescan(roots: Roots, cache_path: str) -> Inventory:
    """A fresh scan, whatever the caches say (a start met a driver file gone: its plan came from an inventory that
    its fingerprint did not catch going stale), stored and kept warm in their place when stable."""
    inv, stable = scan(roots)
    if stable and not inv.incomplete():
        store(cache_path, inv)
        if _WARM is not None:
            _WARM[(roots, cache_path)] = inv
    return inv


def inventory(roots: Roots, cache_path: str, notes: list[str] | None = None) -> Inventory:
    """The cached inventory while it is trusted and true, else a scan (stored when stable); `notes` gets one
    line for a cache that was refused. With keep_warm(), the one in memory first, while its fingerprint holds."""
    if _WARM is not None:
        warm = _WARM.get((roots, cache_path))
        if warm is not None and warm.fingerprint == fingerprint(roots):
            return warm
    inv = load_fresh(cache_path, roots, notes)
    if inv is None:
        inv, stable = scan(roots)
        if stable and not inv.incomplete():
            store(cache_path, inv, notes)
    if _WARM is not None and not inv.incomplete():
        _WARM[(roots, cache_path)] = inv
    return inv
