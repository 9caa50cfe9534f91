"""The host paths the suite must leave as it found them (tests/conftest.py checks them around the session)."""

from __future__ import annotations

import os

# Host paths no test may change (each test writes only under its temp dirs): the default log, Docker's and CDI's
# config folders, gpuhook's state folder. Compared before and after the session; a change fails the suite.
WATCHED_HOST_PATHS = ("/var/log/gpuhook.log", "/etc/docker", "/etc/cdi", "/run/gpuhook")


def host_snapshot(paths: tuple[str, ...] = WATCHED_HOST_PATHS) -> dict[str, object]:
    """Each path's kind, size and mtime, and for a folder the same of every entry below it."""
    out: dict[str, object] = {}
    for top in paths:
        try:
            st = os.lstat(top)
        except FileNotFoundError:
            out[top] = None
            continue
        out[top] = (st.st_mode, st.st_size, st.st_mtime_ns)
        if os.path.isdir(top) and not os.path.islink(top):
            for folder, dirs, files in os.walk(top):
                for name in dirs + files:
                    path = os.path.join(folder, name)
                    try:
                        sub = os.lstat(path)
                    except FileNotFoundError:
                        continue
                    out[path] = (sub.st_mode, sub.st_size, sub.st_mtime_ns)
    return out


def host_changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """One word per changed path: created, removed or changed."""
    words = []
    for path in sorted(set(before) | set(after)):
        was, now = before.get(path), after.get(path)
        if was != now:
            words.append(f"{path} {'created' if was is None else 'removed' if now is None else 'changed'}")
    return words


