"""The record of everything node-setup changed on a host, kept on the host beside what it installed, so that
an uninstall (from this pod, a later one, or by hand) puts each path back exactly: a file's old bytes, mode,
owner and times; a directory or link that was absent is removed again.

The journal is written (atomically) before each change it records, so a crash between the two leaves a record
of a change that may not have happened, which the undo tolerates, never a change without a record."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat

from gpuhook.errors import GpuhookError
from gpuhook.fileio.atomic import read_regular, write_atomic
from gpuhook.runtimeconfig.runtimes import under

VERSION = 1
MAX_SAVED = 1 << 20  # a runtime config is a few KiB; anything larger is not one


def host_path(root: str, seen: str) -> str:
    """The host's own path of `seen`, a path under the host mount at `root` (runtimeconfig.runtimes.under's
    inverse)."""
    host = os.path.realpath(root)
    return seen if host == "/" else "/" + os.path.relpath(seen, host)


class Journal:
    """Entries in the order made; `undo()` walks them backwards. `root` is where the host's `/` is mounted;
    every path in the journal is the host's own."""

    def __init__(self, path: str, root: str, entries: list[dict] | None = None) -> None:
        self.path, self.root, self.entries = path, root, entries or []

    def real(self, host_path: str) -> str:
        return under(self.root, host_path)

    @classmethod
    def load(cls, path: str, root: str) -> Journal | None:
        try:
            data = json.loads(read_regular(path, limit=64 * MAX_SAVED))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, GpuhookError) as exc:
            raise GpuhookError(f"cannot read node-setup's journal {path}: {exc}; remove the install by hand "
                               "(docs/deploy.md lists what it changes)") from None
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), list):
            raise GpuhookError(f"{path} is not a node-setup journal of version {VERSION}")
        return cls(path, root, data["entries"])

    def save(self) -> None:
        text = json.dumps({"version": VERSION, "entries": self.entries}, indent=1) + "\n"
        write_atomic(self.path, text.encode(), 0o600)

    def _add(self, entry: dict) -> None:
        self.entries.append(entry)
        if os.path.isdir(os.path.dirname(self.path)):
            self.save()

    # --- recording, each before its change --------------------------------------------------------------

    def makedirs(self, host_path: str, mode: int = 0o755) -> None:
        """Create `host_path` and its missing parents, each recorded as ours."""
        missing = []
        path = os.path.abspath(host_path)
        while not os.path.lexists(self.real(path)):
            missing.append(path)
            path = os.path.dirname(path)
        for path in reversed(missing):
            self._add({"kind": "dir", "path": path})
            os.mkdir(self.real(path), mode)

    def tree(self, host_path: str) -> None:
        """A directory (or a link) that is wholly ours (the payload): removed with everything in it."""
        self._add({"kind": "tree", "path": host_path})

    def write(self, host_path: str, data: bytes, mode: int | None = None) -> bool:
        """Write a file, its old content saved first (once: a later write keeps the first saved state)."""
        real = self.real(host_path)
        self.makedirs(os.path.dirname(host_path))
        if not any(e["kind"] == "file" and e["path"] == host_path for e in self.entries):
            self._add({"kind": "file", "path": host_path, "old": _saved(real)})
        try:
            st = os.stat(real)
            old_mode = stat.S_IMODE(st.st_mode)
        except FileNotFoundError:
            old_mode = 0o644
        return write_atomic(real, data, old_mode if mode is None else mode)

    def link(self, host_path: str, target: str) -> None:
        self._add({"kind": "link", "path": host_path, "target": target})
        os.symlink(target, self.real(host_path))

    # --- undoing ------------------------------------------------------------------------------------------

    def undo(self) -> list[str]:
        """Put back every recorded path, newest first; returns what could not be (kept, never forced)."""
        problems: list[str] = []
        for entry in reversed(self.entries):
            try:
                _UNDO[entry["kind"]](self.real(entry["path"]), entry)
            except OSError as exc:
                problems.append(f"{entry['path']}: {exc.strerror or exc}")
        return problems


def _saved(real: str) -> dict | None:
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise GpuhookError(f"{real} is not a regular file: node-setup does not replace it")
    if st.st_size > MAX_SAVED:
        raise GpuhookError(f"{real} is {st.st_size} bytes, more than a runtime config ({MAX_SAVED}): not changed")
    data = read_regular(real, follow_links=False, limit=MAX_SAVED)
    return {"data": base64.b64encode(data).decode(), "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
            "gid": st.st_gid, "atime_ns": st.st_atime_ns, "mtime_ns": st.st_mtime_ns}


def _undo_file(real: str, entry: dict) -> None:
    old = entry.get("old")
    if old is None:
        if os.path.lexists(real):
            os.unlink(real)
        return
    write_atomic(real, base64.b64decode(old["data"]), old["mode"])
    os.chown(real, old["uid"], old["gid"])
    os.chmod(real, old["mode"])
    os.utime(real, ns=(old["atime_ns"], old["mtime_ns"]))


def _undo_link(real: str, entry: dict) -> None:
    if os.path.islink(real) and os.readlink(real) == entry["target"]:
        os.unlink(real)


def _undo_dir(real: str, entry: dict) -> None:
    if os.path.isdir(real) and not os.path.islink(real):
        os.rmdir(real)  # not empty: something not ours is in it, so it stays (OSError reported)


def _undo_tree(real: str, entry: dict) -> None:
    if os.path.islink(real):  # the prefix's bin/, a link to the current release
        os.unlink(real)
    elif os.path.isdir(real):
        shutil.rmtree(real)


_UNDO = {"file": _undo_file, "link": _undo_link, "dir": _undo_dir, "tree": _undo_tree}
