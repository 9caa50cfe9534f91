"""`runtime unconfigure`: put a runtime's config files back as they were before `runtime configure`.

Every file configure writes is either one it changed, whose content before gpuhook's first change is in its
backup (files.apply keeps the first backup), or one it created. So for each file configure may have written for a
runtime (its config or drop-in, the hooks.d entry, containerd's base spec): a backup there is put back byte for
byte (mode and owner of the file as it is now) and removed; without one, a file only gpuhook could have made (its
own drop-in or hooks.d file or base spec by name, or a config whose text is exactly what configure makes from
nothing) is removed; anything else is left, with a note. As for configure, everything is read and decided before
the first write.
"""

from __future__ import annotations

import json
import os
import tempfile

from gpuhook.errors import ConfigError
from gpuhook.fileio.atomic import write_atomic
from gpuhook.model.record import Record, field
from gpuhook.runtimeconfig import hookspec
from gpuhook.runtimeconfig import runtimes as rt
from gpuhook.runtimeconfig.files import BACKUP_SUFFIX, read_text, target
from gpuhook.runtimeconfig.runtimes import BASE_SPEC_NAME, CONTAINERD_CRI, MODES, RUNTIMES, Options, _crio_backup, plan
from gpuhook.runtimeconfig.tomledit import lookup


class Undo(Record):
    """One file put back: `restore` (its backup's text to `path`, then the backup removed) or `remove`."""

    path: str
    action: str
    backup: str | None = None
    text: str | None = None  # what `restore` writes


class UndoPlan(Record, frozen=False):
    runtime: str
    undos: list[Undo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_unconfigure(runtime: str, config: str | None = None, hooks_dir: str | None = None) -> UndoPlan:
    """What puts `runtime`'s files back; ConfigError for an unknown runtime or a relative path."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}")
    for name, value in (("--config", config), ("--hooks-dir", hooks_dir)):
        if value is not None and not os.path.isabs(value):
            raise ConfigError(f"{name} must be an absolute path, not {value!r}")
    result = UndoPlan(runtime)
    main = _main_config(runtime, config)
    path = target(main)
    backup = _crio_backup(path) if runtime == "crio" else None
    extra: list[tuple[str, str | None, bool]] = []  # (path, backup, ours by name)
    if runtime == "containerd":
        spec = _base_spec(path)
        if spec:
            extra.append((target(spec), None, os.path.basename(spec) == BASE_SPEC_NAME))
    if runtime in ("crio", "podman"):
        hooks_file = target(os.path.join(hooks_dir or rt.DEFAULT_HOOKS_DIR, hookspec.HOOKS_D_FILE))
        extra.append((hooks_file, None, _is_gpuhook_hooks_file(hooks_file)))
    own_dropin = os.path.basename(path) == os.path.basename(rt.CRIO_DROPIN if runtime == "crio" else rt.PODMAN_DROPIN)
    for where, backup_path, ours in [(path, backup, own_dropin or _made_from_nothing(runtime, path, hooks_dir)),
                                     *extra]:
        undo = _undo(where, backup_path or where + BACKUP_SUFFIX, ours)
        if undo:
            result.undos.append(undo)
        elif where == path and _configured(runtime, path, hooks_dir):
            result.notes.append(f"{where} has no backup ({os.path.basename(where)}{BACKUP_SUFFIX}) and is not as "
                                "`runtime configure` made it: left as it is, remove gpuhook's settings by hand")
    return result


def apply_undo(undo: Undo) -> None:
    """Put one file back: its backup's text (the file's present mode), then the backup removed; or remove it."""
    if undo.action == "restore" and undo.backup and undo.text is not None:
        try:
            mode = os.stat(undo.path).st_mode & 0o7777
        except FileNotFoundError:
            mode = os.stat(undo.backup).st_mode & 0o7777
        write_atomic(undo.path, undo.text.encode(), mode)
        os.unlink(undo.backup)
    elif undo.action == "remove":
        os.unlink(undo.path)


def _main_config(runtime: str, config: str | None) -> str:
    """The file configure edits for `runtime` (runtimes.py's choice, made the same way)."""
    if config:
        return config
    if runtime == "containerd":
        return rt.CONTAINERD_CONFIG
    if runtime == "docker":
        return rt.DOCKER_CONFIG
    main, dropin = (rt.CRIO_CONFIG, rt.CRIO_DROPIN) if runtime == "crio" else (rt.PODMAN_CONFIG, rt.PODMAN_DROPIN)
    # configure wrote the drop-in where the main file did not exist: the drop-in (or its backup) tells
    dropin_backup = _crio_backup(target(dropin)) if runtime == "crio" else dropin + BACKUP_SUFFIX
    if os.path.lexists(dropin) or os.path.lexists(dropin_backup or ""):
        return dropin
    return main


def _undo(path: str, backup: str, ours: bool) -> Undo | None:
    """The backup put back when there is one; else `path` removed when it is gpuhook's (`ours`)."""
    saved = read_text(backup)
    if saved is not None:
        return Undo(path, "restore", backup, saved)
    if ours and read_text(path) is not None:
        return Undo(path, "remove")
    return None


def _base_spec(config: str) -> str | None:
    """containerd's base_runtime_spec of any runtime in `config` that is gpuhook's (by name), or of the default
    runtime's when its backup exists (configure edited a spec the user had)."""
    from gpuhook.fileio.tomlfile import tomllib

    text = read_text(config)
    if not text:
        return None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    for keys in CONTAINERD_CRI.values():
        runtimes = lookup(data, (*keys, "containerd", "runtimes"))
        if not isinstance(runtimes, dict):
            continue
        for entry in runtimes.values():
            spec = entry.get("base_runtime_spec") if isinstance(entry, dict) else None
            if isinstance(spec, str) and spec and (os.path.basename(spec) == BASE_SPEC_NAME or
                                                   os.path.lexists(spec + BACKUP_SUFFIX)):
                return spec
    return None


def _is_gpuhook_hooks_file(path: str) -> bool:
    text = read_text(path)
    if text is None:
        return False
    try:
        hook = json.loads(text).get("hook", {})
    except (ValueError, AttributeError):
        return False
    args = hook.get("args") if isinstance(hook, dict) else None
    return isinstance(args, list) and args[:1] == [hookspec.HOOK_NAME]


def _configured(runtime: str, path: str, hooks_dir: str | None) -> bool:
    """Whether configure, in either mode, would leave `path` as it is: gpuhook's settings are in it."""
    if read_text(path) is None:
        return False
    for mode in MODES:
        try:
            made = plan(Options(runtime, mode, path, hooks_dir if mode == "hook" and runtime in ("crio", "podman")
                                else None))
        except ConfigError:
            continue
        if all(c.new == c.old for c in made.changes if c.path == target(path)):
            return True
    return False


def _made_from_nothing(runtime: str, path: str, hooks_dir: str | None) -> bool:
    """Whether `path` holds exactly what configure writes when the file did not exist, in either mode."""
    current = read_text(path)
    if current is None:
        return False
    with tempfile.TemporaryDirectory(prefix="gpuhook-unconfigure-") as tmp:
        fresh = os.path.join(tmp, os.path.basename(path))
        for mode in MODES:
            try:
                made = plan(Options(runtime, mode, fresh, hooks_dir if mode == "hook" and runtime in
                                    ("crio", "podman") else None))
            except ConfigError:  # e.g. containerd's hook mode without `ctr` to make a base spec
                continue
            # what names the file's folder (containerd's base spec beside it) names the real one
            here = os.path.dirname(target(fresh))
            if any(c.path == target(fresh) and c.new.replace(here, os.path.dirname(path)) == current
                   for c in made.changes):
                return True
    return False
