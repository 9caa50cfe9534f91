"""The lean entry script `gpuhook hook install` writes, and what it runs.

A runtime starts the hook for every container. Through pip's console-script wrapper Python first runs `site`
(every .pth file of the environment); the installed script instead starts `python -IS` (isolated, no `site`) and
appends exactly two directories to sys.path, computed at install time: the one holding the `gpuhook` package
(a source tree for an editable install, site-packages otherwise) and the one holding `_cffi_backend`, which
the native helper needs. No .pth file runs, no user site and no PYTHON* variable applies, so a container start
pays only for what the hook itself imports.

The same script also answers `cdi-hook create-symlinks|update-ldcache`, the createContainer hooks of a CDI spec
generated with `--hook-path` pointing at it, without click, and `generate-cdi …` as the `gpuhook` console script
does (the native entry's fallback for it: `_native/entry.c`). Only arguments it fully understands take that
path; anything else (help, a malformed option) goes to the click command line, so results and messages are
those of `gpuhook cdi-hook`.
"""

from __future__ import annotations

import os
import sys

from gpuhook.hook.installed import DEFAULT_PATH, DOCKER_GPUS_NAME, FALLBACK_SUFFIX, MARKER, is_ours

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

SHEBANG_MAX = 255  # the kernel reads at most 256 bytes of a "#!" line (Linux >= 5.1; 127 before)


def main(argv: Sequence[str] | None = None) -> int:
    """`cdi-hook …` (a CDI spec's createContainer hooks), `generate-cdi …` (what the native entry runs here when
    no service takes it: the console script's command) or else the OCI hook's own command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["cdi-hook"]:
        return cdi_hook(args[1:])
    if args[:1] == ["generate-cdi"]:
        from gpuhook.cli import main as cli_main

        return cli_main(args)
    from gpuhook.hook.prestart import main as hook_main

    return hook_main(args)


# --- cdi-hook without click ------------------------------------------------------------------------------------


def cdi_hook(args: Sequence[str]) -> int:
    """`gpuhook cdi-hook ARGS` with the exit status and messages of the click command (cli/cdi.py)."""
    from gpuhook.inject.containerhooks import parse_hook_args, run_hook

    parsed = parse_hook_args(args)
    if parsed is None:
        from gpuhook.cli.app import main as cli_main

        return cli_main(["cdi-hook", *args])

    def work() -> None:
        from gpuhook.oci.bundle import read_stdin_state

        run_hook(parsed, read_stdin_state())

    return run_lean(work)


def run_lean(work: Callable[[], object]) -> int:
    """Run a command's work without click, ending as the click application does (cli/app.main): errors.outcome's
    one `gpuhook: ` line on stderr and its exit status."""
    from gpuhook.errors import outcome

    code, line = outcome(work)
    if line:
        print(line, file=sys.stderr)
    return code


# --- installing the entry script -------------------------------------------------------------------------------


def search_paths() -> list[str]:
    """The directories the entry script adds to sys.path: gpuhook's parent, then _cffi_backend's."""
    import importlib.util

    import gpuhook
    from gpuhook.errors import GpuhookError

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(gpuhook.__file__ or "")))
    spec = importlib.util.find_spec("_cffi_backend")
    if spec is None or not spec.origin:
        raise GpuhookError("cannot find _cffi_backend (the cffi package) for this Python: is gpuhook installed?")
    paths = [package_parent, os.path.dirname(os.path.abspath(spec.origin))]
    return list(dict.fromkeys(paths))


def entry_script(python: str, paths: Sequence[str]) -> str:
    """The text of the entry script: `python -IS`, `paths` appended to sys.path, cli.entry.main."""
    from gpuhook.errors import GpuhookError

    shebang = f"#!{python} -IS"
    if not os.path.isabs(python) or any(c.isspace() for c in python):
        raise GpuhookError(f"interpreter path {python!r} cannot go on a #! line (relative or has whitespace)")
    if len(shebang.encode()) > SHEBANG_MAX:
        raise GpuhookError(f"interpreter path {python!r} is too long for a #! line ({SHEBANG_MAX} bytes at most)")
    return (
        f"{shebang}\n"
        f"{MARKER}\n"
        "# -IS: no site and no environment variables, so a container start pays only for what the hook imports.\n"
        "import sys\n"
        f"sys.path += {list(paths)!r}\n"
        "try:\n"
        "    from gpuhook.cli.entry import main\n"
        "    from gpuhook.cli.leave import leave\n"
        "except ImportError as exc:  # gpuhook is gone from there (removed, its venv replaced): see stranded()\n"
        f"{stranded_source()}"
        "leave(main())  # a container start does not wait for the interpreter's teardown\n"
    )


# What the entry script does when gpuhook's package no longer imports (the native entry's `stranded()` when the
# script itself cannot run): a container with any sign of a GPU request fails with one line naming the fix, one
# with none starts untouched. Conservative and stdlib-only, as the package is gone: the signs are those of
# contract.has_gpu_signal, widened to every NVIDIA_* variable and any mount naming the devices folder, and anything
# unreadable counts as a request. Indented to sit in the script's `except` block.
_STRANDED = """\
    import json, os
    def wants_gpu(argv):
        if argv[:1] != [] and not argv[0].startswith("-") and argv[0] not in ("prestart", "createRuntime"):
            return True  # cdi-hook (a CDI spec's: a GPU device), generate-cdi: always said
        if any(a in ("-h", "--help", "--version") for a in argv):
            return True
        try:
            state = json.loads(sys.stdin.buffer.read({max_document}).decode())
            with open(os.path.join(state["bundle"], "config.json"), "rb") as f:
                spec = json.loads(f.read({max_document}).decode())
            env = spec.get("process", {{}}).get("env") or []
            annotations = {{**(state.get("annotations") or {{}}), **(spec.get("annotations") or {{}})}}
            mounts = spec.get("mounts") or []
            return (any(str(e).startswith({env_signs!r}) for e in env)
                    or any(str(k).startswith({annotation!r}) for k in annotations)
                    or any({folder!r} in str(m.get("destination", "")) for m in mounts))
        except Exception:  # unreadable: count it as a request
            return True
    if wants_gpu(sys.argv[1:]):
        print(f"gpuhook-hook: gpuhook cannot be imported ({{exc}}): reinstall gpuhook, then run `gpuhook hook "
              "install`; this GPU container cannot start", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
"""


def stranded_source() -> str:
    """The entry script's `except ImportError` body (_STRANDED), its signs taken from model/contract.py."""
    from gpuhook.model import contract
    from gpuhook.oci.bundle import MAX_DOCUMENT

    return _STRANDED.format(max_document=MAX_DOCUMENT, env_signs=("NVIDIA_", contract.LEGACY_CUDA_VERSION + "="),
                            annotation=contract.CDI_ANNOTATION_PREFIX,
                            folder=contract.VOLUME_MOUNT_DIR.rsplit("/", 1)[1])


def _check(python: str, paths: Sequence[str]) -> None:
    """Import the hook's modules the way the script will (-IS, only `paths`), before anything is written."""
    from gpuhook.errors import GpuhookError
    from gpuhook.hook.installed import import_problem

    last = import_problem(python, list(paths))
    if last:
        raise GpuhookError(f"{python} -IS cannot import the hook with {list(paths)}: {last}")


def docker_gpus_path(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)), DOCKER_GPUS_NAME)


def native_entry() -> str | None:
    """The native hook entry the package build compiled (`gpuhook/_native/gpuhook-entry`), None without one."""
    import gpuhook

    path = os.path.join(os.path.dirname(os.path.abspath(gpuhook.__file__ or "")), "_native", "gpuhook-entry")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def install(path: str = DEFAULT_PATH, python: str | None = None, docker_gpus: bool = False,
            native: bool = True, notes: list[str] | None = None) -> list[str]:
    """Write the hook entry at `path` (atomically, mode 0755) for `python` (default: this interpreter); with
    `docker_gpus` also as nvidia-container-runtime-hook beside it, unless a file gpuhook did not write is there
    (NVIDIA's own hook, say): then nothing is written and the error says why.

    With the native entry built (and `native`), `path` is that binary and `path` + ".py" the Python entry script
    it runs when no service listens; without one, `path` is the script itself (and `notes` says so)."""
    from gpuhook.errors import GpuhookError
    from gpuhook.fileio.atomic import write_atomic

    python = python or sys.executable
    paths = search_paths()
    text = entry_script(python, paths)
    binary_path = native_entry() if native else None
    if native and binary_path is None and notes is not None:
        notes.append("the native entry was not built (no C compiler at install time?): wrote the Python entry, "
                     "which does not use `gpuhook service`")
    targets = [os.path.abspath(path)]
    if docker_gpus:
        docker = docker_gpus_path(path)
        foreign = [p for p in (docker, docker + FALLBACK_SUFFIX) if is_ours(p) is False]
        if foreign and (binary_path or foreign[0] == docker):
            raise GpuhookError(f"{foreign[0]} exists and is not gpuhook's (NVIDIA's nvidia-container-toolkit "
                               "installs one): not replaced. Remove that toolkit's hook to let gpuhook answer "
                               "--gpus, or keep it and use gpuhook through CDI or --runtime gpuhook")
        if docker != targets[0]:
            targets.append(docker)
    if binary_path:
        for target in targets:
            script = target + FALLBACK_SUFFIX
            if is_ours(script) is False:
                raise GpuhookError(f"{script} exists and is not gpuhook's: not replaced (the native entry at "
                                   f"{target} runs it when no service listens)")
    _check(python, paths)
    written: list[str] = []
    binary = b""
    if binary_path:
        with open(binary_path, "rb") as f:
            binary = f.read()
    for target in targets:
        if binary:  # the script first: the binary is never there without what it falls back to
            write_atomic(target + FALLBACK_SUFFIX, text.encode(), 0o755)
            write_atomic(target, binary, 0o755)
            written += [target, target + FALLBACK_SUFFIX]
        else:
            write_atomic(target, text.encode(), 0o755)
            written.append(target)
    return written


def uninstall(path: str = DEFAULT_PATH, docker_gpus: bool = False) -> list[str]:
    """Remove what `install` wrote at `path` (the entry and its `.py`; with `docker_gpus` the same under NVIDIA's
    name beside it): only files gpuhook wrote (is_ours), never a link or another program, nor the Debian
    package's entry, which `apt-get remove gpuhook` owns. Returns what was removed."""
    from gpuhook.errors import GpuhookError
    from gpuhook.model.contract import PACKAGED_HOOK_PATH

    targets = [os.path.abspath(path)] + ([docker_gpus_path(path)] if docker_gpus else [])
    if PACKAGED_HOOK_PATH in targets and os.path.exists(PACKAGED_HOOK_PATH + FALLBACK_SUFFIX) and \
            _packaged(PACKAGED_HOOK_PATH):
        raise GpuhookError(f"{PACKAGED_HOOK_PATH} is the gpuhook Debian package's: `apt-get remove gpuhook` removes it")
    removed: list[str] = []
    for target in dict.fromkeys(targets):
        for name in (target, target + FALLBACK_SUFFIX):
            if is_ours(name):
                os.unlink(name)
                removed.append(name)
    return removed


def _packaged(path: str) -> bool:
    """Whether dpkg lists `path` as the gpuhook package's."""
    try:
        with open("/var/lib/dpkg/info/gpuhook.list", encoding="utf-8", errors="replace") as f:
            return path in (line.rstrip("\n") for line in f)
    except OSError:
        return False
