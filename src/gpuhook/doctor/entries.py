"""Whether each installed hook entry can still run: the native entry's Python entry beside it, that script's #!
interpreter, and gpuhook importable from the folders it names. An upgrade of Python, a deleted venv or a removed
package leaves an entry that fails every GPU start (in one line, cli/entry.py and entry.c's `stranded()`); doctor
says so before a container does."""

from __future__ import annotations

import ast
import os
import subprocess
from collections.abc import Sequence

from gpuhook.doctor.model import OK, PROBLEM, Finding
from gpuhook.hook.installed import DEFAULT_PATH, FALLBACK_SUFFIX, import_problem, is_ours
from gpuhook.model.contract import PACKAGED_HOOK_PATH

FIX = "reinstall gpuhook, then run `gpuhook hook install`"
PACKAGED_FIX = "apt-get install --reinstall gpuhook (and keep the python3.X it depends on)"


def check_entries(paths: Sequence[str] = (DEFAULT_PATH, PACKAGED_HOOK_PATH)) -> list[Finding]:
    """One finding per entry of gpuhook's at `paths`: ok, or the problem that strands it."""
    found = []
    for path in paths:
        if not is_ours(path):
            continue
        fix = PACKAGED_FIX if path == PACKAGED_HOOK_PATH else FIX
        problem = _problem(path)
        found.append(Finding("host", PROBLEM, f"hook entry {path}: {problem}; GPU containers cannot start", fix)
                     if problem else Finding("host", OK, f"hook entry {path} runs"))
    return found


def _problem(path: str) -> str:
    """What keeps the entry at `path` from running; '' when nothing does."""
    with open(path, "rb") as f:
        native = f.read(4) == b"\x7fELF"
    script = path + FALLBACK_SUFFIX if native else path
    try:
        with open(script, encoding="utf-8") as f:
            lines = f.read(1 << 16).splitlines()
    except OSError as exc:
        return f"its Python entry {script} cannot be read ({exc.strerror or exc})"
    python = lines[0][2:].split()[0] if lines and lines[0].startswith("#!") and lines[0][2:].split() else ""
    if not python or not os.access(python, os.X_OK):
        return f"its Python {python or '(none)'} is gone"
    paths = next((line.split("+=", 1)[1].strip() for line in lines if line.startswith("sys.path +=")), "[]")
    try:
        folders = ast.literal_eval(paths)
    except (ValueError, SyntaxError):
        return f"{script} is not an entry gpuhook wrote (its sys.path line does not parse)"
    try:
        last = import_problem(python, folders, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} does not run ({exc})"
    return f"gpuhook does not import with {python} from {folders} ({last})" if last else ""
