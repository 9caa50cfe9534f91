"""`gpuhook generate-cdi`: its options (the one table click and the lean path both use) and its work, click-free.

`gpuhook generate-cdi …` first tries `lean_main` (cli/__init__.py), which parses with options.parse_lean and
runs `generate` without importing click; any command line it does not fully understand goes to the click
command (cli/cdi.py), which calls the same `generate`. Measured with the inventory cache (bench/generate.py),
the lean path saves click's import, about 20 ms of a 40 ms target.
"""

from __future__ import annotations

import os
import sys

from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.modes import MODES as KIND_MODES
from gpuhook.cdi.names import DEFAULT_NAME_STRATEGIES, NAME_STRATEGIES
from gpuhook.cli.inventory import load_inventory
from gpuhook.cli.options import CACHE_OPTION, ROOT_OPTIONS, Option, parse_lean

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuhook.model.inventory import Inventory

GENERATE_OPTIONS: tuple[Option, ...] = (
    *ROOT_OPTIONS,
    Option(("--output", "-o"), "output",
           "Write the spec here (atomically, mode 0644, directory created) instead of stdout.", metavar="FILE",
           path=True),
    Option(("--format",), "fmt", "Output format [default: json for a .json output file, else yaml].",
           choices=("yaml", "json")),
    Option(("--vendor",), "vendor", "Vendor part of the CDI kind.", default="nvidia.com", show_default=True),
    Option(("--mode",), "mode", "Which kind of spec (one spec per kind, as nvidia-ctk's --mode): GPUs, IMEX "
           "channels (nvidia.com/imex-channel), or a gated family (nvidia.com/<mode>=all).", default="gpu",
           choices=KIND_MODES, show_default=True),
    Option(("--class",), "cls", "Class part of the CDI kind [default: gpu, imex-channel or the mode's name]."),
    Option(("--device-name-strategy",), "strategies", "How devices are named; repeatable [default: index and uuid].",
           default=(), choices=NAME_STRATEGIES, multiple=True),
    Option(("--hook-path",), "hook_path", "gpuhook executable the spec's hooks run [default: the installed gpuhook].",
           metavar="PATH", path=True),
    Option(("--cdi-version",), "cdi_version", "Claim this cdiVersion (may raise the computed minimum, never lower "
           "it).", metavar="X.Y.Z"),
    Option(("--watch",), "watch", "Keep running: rewrite --output (atomically) whenever the driver version, GPU set "
           "or MIG layout changes; SIGTERM/SIGINT stop, SIGHUP regenerates now.", default=False, is_flag=True,
           lean=False),
    Option(("--poll-interval",), "poll_interval", "With --watch: also check every S seconds (procfs changes send "
           "no inotify events).", default=10.0, float_min=0.05, metavar="S", show_default=True, lean=False),
    CACHE_OPTION,
)


def default_hook_path() -> str:
    """What the spec's hooks call: the lean entry `gpuhook hook install` writes, else the Debian package's, when
    it is there (the install prefix every shipped file names, and the fastest hook); else the installed `gpuhook`
    (discover/executables.py). Absolute."""
    from gpuhook.discover.executables import gpuhook_executable
    from gpuhook.hook.installed import DEFAULT_PATH, is_ours
    from gpuhook.model.contract import PACKAGED_HOOK_PATH

    for entry in (DEFAULT_PATH, PACKAGED_HOOK_PATH):  # `hook install`'s, then the Debian package's
        if is_ours(entry) and os.access(entry, os.X_OK):
            return entry
    found = gpuhook_executable()
    if found is None:
        raise CdiError(f"cannot find the gpuhook executable next to {sys.executable} or on PATH; pass --hook-path")
    return found


def hook_for(mode: str, hook_path: str | None) -> str:
    """The program a spec of `mode` has its hooks run: none but for GPUs; --hook-path, else default_hook_path."""
    return "" if mode != "gpu" else os.path.abspath(hook_path) if hook_path else default_hook_path()


def renderer(output: str | None, fmt: str | None, mode: str, vendor: str, cls: str | None, strategies: Sequence[str],
             hook: str, cdi_version: str | None) -> Callable[[Inventory, list[str] | None], str]:
    """What turns an inventory (and, for --watch, the devices to keep) into the spec's text; `hook`: hook_for's."""
    from gpuhook.cdi import codec
    from gpuhook.cdi.kinds import build_mode_spec
    from gpuhook.cdi.modes import DEFAULT_CLASS
    from gpuhook.cdi.spec import build_spec
    from gpuhook.cdi.validate import validate_spec

    fmt = codec.format_for(output, fmt)

    def render(inv: Inventory, devices: list[str] | None = None) -> str:
        if mode != "gpu":
            spec = build_mode_spec(inv, mode, vendor=vendor, cls=cls, cdi_version=cdi_version)
        else:
            spec = build_spec(inv, vendor=vendor, cls=cls or DEFAULT_CLASS[mode],
                              name_strategies=tuple(strategies) or DEFAULT_NAME_STRATEGIES, hook_path=hook,
                              devices=devices, cdi_version=cdi_version)
        problems = validate_spec(spec, "generated spec", schema=False)
        if problems:  # a bug here, never the user's: refuse to write an invalid spec runtimes would reject
            raise CdiError(f"refusing to write an invalid spec: {problems[0]}")
        return codec.dumps(spec, fmt)

    return render


def write_spec(text: str, output: str | None) -> None:
    """The spec to stdout, or atomically to `output` (with a note when no CDI loader would read that name)."""
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from gpuhook.cdi.codec import has_spec_extension
    from gpuhook.fileio.atomic import write_atomic

    if write_atomic(output, text.encode(), 0o644) and not has_spec_extension(output):
        print(f"gpuhook: note: CDI loaders read only *.yaml and *.json files; {output} will be ignored",
              file=sys.stderr)


MAX_SERVED = 16  # specs `gpuhook service` keeps rendered (serve), then it starts over
_served: dict[tuple[object, ...], tuple[Inventory, str]] = {}


def generate(driver_root: str, dev_root: str | None, proc_root: str | None, discovery: str, output: str | None,
             fmt: str | None, mode: str, vendor: str, cls: str | None, strategies: Sequence[str],
             hook_path: str | None, cdi_version: str | None, inventory_cache: str | None,
             remember: bool = False) -> None:
    """One spec, written once (the click command's, the lean path's and the service's work; --watch is
    cdi/watch.py). `remember` (the service): the text is kept per command line, hook program and inventory, so
    a warm service renders a spec once while the inventory's fingerprint holds (discover/cache keeps the same
    inventory object for it)."""
    hook = hook_for(mode, hook_path)
    # the renderer is made (its modules, `re` with them, ~5 ms) while NVML's child starts: a cold run's critical
    # path is that child's (load_inventory's `meanwhile`)
    made: list[Callable[[Inventory, list[str] | None], str]] = []
    inv = load_inventory(driver_root, dev_root, proc_root, discovery, inventory_cache, meanwhile=lambda: made.append(
        renderer(output, fmt, mode, vendor, cls, strategies, hook, cdi_version)))
    key = (output, fmt, mode, vendor, cls, tuple(strategies), hook, cdi_version, id(inv))
    hit = _served.get(key) if remember else None
    if hit is not None and hit[0] is inv:
        text = hit[1]
    else:
        text = made[0](inv)
        if remember:
            if len(_served) >= MAX_SERVED:
                _served.clear()
            _served[key] = (inv, text)
    write_spec(text, output)


def lean_main(args: Sequence[str]) -> int | None:
    """`gpuhook generate-cdi ARGS` without click: the exit status, or None when click must answer."""
    params = parse_lean(args, GENERATE_OPTIONS)
    if params is None:
        return None
    from gpuhook.cli.entry import run_lean

    return run_lean(lambda: generate(**params))  # --watch and --poll-interval are never lean: not in params


def serve(args: list[str], cwd: str, take: Callable[[], None] = lambda: None) -> tuple[int, str, bytes] | None:
    """`generate-cdi ARGS` for `gpuhook service` (service/client.py): what lean_main does for a client in `cwd`, as
    (exit status, stderr, stdout); None when click must answer (service/server.py declines: the client runs it).
    `take()` is called before anything is written (the service's TAKING and the client's GO, protocol.py).
    The service runs it in its own process, warm: the spec modules loaded once, the inventory in discover/cache's
    memory while its fingerprint holds."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from gpuhook.cli.entry import run_lean

    params = parse_lean(args, GENERATE_OPTIONS)
    if params is None:
        return None
    take()
    for opt in GENERATE_OPTIONS:
        if opt.path and params.get(opt.dest):
            params[opt.dest] = os.path.join(cwd, params[opt.dest])
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run_lean(lambda: generate(**params, remember=True))
    return code, err.getvalue(), out.getvalue().encode()
