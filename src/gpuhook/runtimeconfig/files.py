"""Reading, diffing and safely replacing a runtime's config files.

Every change is computed before the first write, so a malformed file (or any other refusal) leaves all files
untouched. A write backs the old content up to `<file>.gpuhook.bak` first, then replaces the file atomically
with its old mode and owner.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.toml_document import TOMLDocument

from gpuhook.errors import ConfigError
from gpuhook.fileio.atomic import FileKindError, read_regular, write_atomic
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.model.record import Record

BACKUP_SUFFIX = ".gpuhook.bak"
NEW_FILE_MODE = 0o644


class FileChange(Record):
    """One file's content before (None: absent) and after; `backup_to` overrides where the backup goes."""

    path: str
    old: str | None
    new: str
    backup_to: str | None = None

    @property
    def changed(self) -> bool:
        return self.old != self.new

    @property
    def backup(self) -> str:
        return self.backup_to or self.path + BACKUP_SUFFIX


def target(path: str) -> str:
    """The real file behind `path`: a rename must replace the file, never a symlink pointing at it."""
    return os.path.realpath(os.path.abspath(path))


def read_text(path: str) -> str | None:
    """The file's text (bytes decoded, newlines untouched so a backup is byte-exact), None when absent;
    ConfigError for anything that is not a regular file (opened non-blocking: a FIFO cannot hang the command)."""
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return None
    except FileKindError as exc:  # a device, FIFO or socket is never a config: refuse before anything is written
        raise ConfigError(f"cannot use {path}: it is {exc.kind}, not a regular file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot parse {path}: not UTF-8 text (byte {exc.start})") from None


def parse_toml(path: str, text: str) -> TOMLDocument:
    """A comment-keeping document; tomllib checks it first because its errors name line and column."""
    try:
        tomllib.loads(text)
        return tomlkit.parse(text)
    except (tomllib.TOMLDecodeError, TOMLKitError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from None


def parse_json_object(path: str, text: str) -> dict[str, Any]:
    """A JSON object (key order kept); an empty file counts as `{}`, as an absent one does."""
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"cannot parse {path}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"cannot parse {path}: the top level is not a JSON object")
    return data


def render_json_like(old: str | None, data: Any) -> str:
    """`data` as JSON laid out like the file it replaces: the same indent unit (spaces or a tab, taken from the
    first indented line; none for a one-line file) and the same final newline, keys in the order parsed, so a
    diff shows only what changed. A new or empty file gets gpuhook's layout (2-space indent, final newline)."""
    if old is None or not old.strip():
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    match = re.search(r"\n([ \t]+)\S", old)
    text = json.dumps(data, indent=match.group(1) if match else None, ensure_ascii=False)
    return text + ("\n" if old.endswith("\n") else "")


def unified_diff(change: FileChange) -> str:
    """What a write would do, as `diff -u` shows it; an absent file is /dev/null."""
    old_lines = (change.old or "").splitlines(keepends=True)
    new_lines = change.new.splitlines(keepends=True)
    fromfile = change.path if change.old is not None else "/dev/null"
    lines = difflib.unified_diff(old_lines, new_lines, fromfile=fromfile, tofile=change.path)
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def apply(change: FileChange) -> str | None:
    """Back up the old content, then replace the file atomically; returns the backup path (None: new file).

    A backup already there is kept: it holds the file as it was before gpuhook first changed it, which is what
    `runtime unconfigure` puts back (a second configure, say of another mode, must not replace it with gpuhook's
    own first edit)."""
    if change.old is None:
        write_atomic(change.path, change.new.encode(), NEW_FILE_MODE)
        return None
    st = os.stat(change.path)
    mode = st.st_mode & 0o7777
    if not os.path.lexists(change.backup):
        write_atomic(change.backup, change.old.encode(), mode)
        _keep_owner(change.backup, st)
    write_atomic(change.path, change.new.encode(), mode)
    _keep_owner(change.path, st)
    return change.backup


def _keep_owner(path: str, st: os.stat_result) -> None:
    """A rename gives the file the writer's owner; put the original one back (a no-op for root's files)."""
    if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
        try:
            os.chown(path, st.st_uid, st.st_gid)
        except OSError as exc:
            raise ConfigError(f"cannot keep the owner of {path}: {exc.strerror or exc}") from None
