"""Install, uninstall and check gpuhook on a node from the node-setup image, through the host mount.

Everything written is recorded first in the journal (`<prefix>/node-setup.json`), which is the only thing the
uninstall trusts: it puts back each file it changed (bytes, mode, owner, times), removes what it created, and
restarts the runtime again. An install over an earlier one (a restarted pod) undoes that one first, so the
node never holds two generations and the journal always describes the state before gpuhook."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from gpuhook.errors import GpuhookError
from gpuhook.fileio.atomic import write_atomic
from gpuhook.model.record import Record, field
from gpuhook.nodesetup import payload, runtime
from gpuhook.nodesetup.journal import Journal
from gpuhook.runtimeconfig.runtimes import under

DEFAULT_PREFIX = "/usr/local/gpuhook"
JOURNAL = "node-setup.json"
RUNTIMES = ("auto", "containerd", "crio")


class Options(Record):
    host_root: str = "/"
    prefix: str = DEFAULT_PREFIX
    driver_root: str = "/"  # host path of the driver root (/run/nvidia/driver for a driver container)
    runtime: str = "auto"
    runtime_config: str | None = None  # host path of the runtime's main config [default: the runtime's own]
    restart: str = "systemd"
    unit: str | None = None  # systemd unit [default: the runtime's name]
    dev_char: str = "/dev/char"
    links: Sequence[tuple[str, str]] = ()  # (link, target) in host paths, /dev/char for the NVIDIA nodes


class Report(Record, frozen=False):
    lines: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def real(opts: Options, host_path: str) -> str:
    """`host_path` as seen from here, through the host mount at --host-root."""
    return under(opts.host_root, host_path)


def journal_path(opts: Options) -> str:
    return os.path.join(opts.prefix, JOURNAL)


def check_options(opts: Options) -> None:
    for name, value in (("--prefix", opts.prefix), ("--driver-root", opts.driver_root),
                        ("--dev-char-path", opts.dev_char)):
        if not os.path.isabs(value) or os.path.normpath(value) == "/" and name != "--driver-root":
            raise GpuhookError(f"{name} must be an absolute path below /, not {value!r}")
    if opts.runtime not in RUNTIMES or opts.restart not in runtime.RESTART_MODES:
        raise GpuhookError(f"unknown runtime {opts.runtime!r} or restart mode {opts.restart!r}")
    if not os.path.isdir(opts.host_root):
        raise GpuhookError(f"the host root {opts.host_root!r} is not a directory (mount the host's / there)")


def find_runtime(opts: Options) -> tuple[str, str, runtime.Daemon | None]:
    names = ("containerd", "crio") if opts.runtime == "auto" else (opts.runtime,)
    for name in names:
        config = opts.runtime_config or runtime.CONFIGS[name]
        daemon = runtime.find_daemon(name, real(opts, config), config)
        if daemon is not None or opts.runtime != "auto":
            return name, config, daemon
    raise GpuhookError("no containerd or CRI-O runs on this node (looked for their daemons in the host's PID "
                       "namespace: is the pod's hostPID on?); pass --runtime to configure one anyway")


def install(opts: Options, source: payload.Source, entry_script: Callable[[str, Sequence[str]], str]) -> Report:
    """The whole node set-up; on any failure what was done so far is undone."""
    check_options(opts)
    start = time.monotonic()
    report = Report()
    if os.path.lexists(real(opts, journal_path(opts))):
        report.lines += ["an earlier install is there: undoing it first", *uninstall(opts).lines]
    if _occupied(real(opts, opts.prefix)):
        raise GpuhookError(f"{opts.prefix} exists on the host and is not node-setup's (no journal in it): "
                           "pass another --prefix or remove it")
    name, config, daemon = find_runtime(opts)
    journal = Journal(real(opts, journal_path(opts)), opts.host_root)
    layout = payload.Layout(opts.prefix)
    try:
        journal.makedirs(opts.prefix)
        journal.save()
        for part in ("libexec", "lib", "bin", "etc"):
            journal.tree(layout.path(part))
        report.sizes = payload.build(source, layout, real(opts, opts.prefix), entry_script)
        os.makedirs(real(opts, layout.path("etc")))
        write_atomic(real(opts, layout.hook_config()), hook_config(opts).encode(), 0o644)
        report.lines.append(f"installed gpuhook under {opts.prefix} ({report.sizes['total'] >> 20} MiB, "
                            f"Python {source.version} with its own loader and libraries)")
        change = runtime.plan(name, daemon, opts.host_root, config, layout.hook(), layout.hook_config())
        for file in change.files:
            if file.changed:
                journal.write(file.path, file.new.encode())
                report.lines.append(f"wrote {file.path}")
        report.lines += [f"note: {n}" for n in change.notes]
        report.lines += _links(opts, journal)
        report.lines.append(runtime.restart(opts.restart, name, opts.unit or name, daemon, real(opts, config),
                                            config))
    except BaseException:
        if os.path.lexists(journal.path):
            os.unlink(journal.path)
        if journal.undo():
            journal.save()  # what could not be put back stays recorded for `node-setup uninstall`
        raise
    report.seconds = time.monotonic() - start
    return report


def _occupied(path: str) -> bool:
    """Whether `path` holds anything: an empty folder is fine (the device plugin's hostPath volume makes the
    prefix when its pod starts first) and is left as it was found."""
    if not os.path.lexists(path):
        return False
    return os.path.islink(path) or not os.path.isdir(path) or bool(os.listdir(path))


def hook_config(opts: Options) -> str:
    """The hook's config file under the prefix (the base spec's hook names it with --config)."""
    return ("# written by gpuhook node-setup\n"
            f'driver-root = "{opts.driver_root}"\n')


def _links(opts: Options, journal: Journal) -> list[str]:
    made, kept = 0, []
    if opts.links:
        journal.makedirs(opts.dev_char)
    for link, target in opts.links:
        path = os.path.join(opts.dev_char, os.path.basename(link))
        where = real(opts, path)
        if os.path.lexists(where):
            if not (os.path.islink(where) and os.readlink(where) == target):
                kept.append(f"warning: {path} is in the way of the link to {target}: kept as it is")
            continue
        journal.link(path, target)
        made += 1
    return [f"{opts.dev_char}: {made} link(s) created, {len(opts.links) - made - len(kept)} already there",
            *kept]


def uninstall(opts: Options) -> Report:
    """Undo what the journal records, then restart the runtime so it reads its old configuration."""
    check_options(opts)
    report = Report()
    path = real(opts, journal_path(opts))
    journal = Journal.load(path, opts.host_root)
    if journal is None:
        report.lines.append(f"nothing to undo: no node-setup journal at {journal_path(opts)}")
        return report
    touched_runtime = any(e["kind"] == "file" and not e["path"].startswith(opts.prefix + "/")
                          for e in journal.entries)
    os.unlink(path)
    problems = journal.undo()
    if problems:
        journal.save()
        raise GpuhookError("could not put back: " + "; ".join(problems[:5]) + f" (journal kept at {path})")
    report.lines.append(f"removed {opts.prefix} and put back {len(journal.entries)} recorded path(s)")
    if touched_runtime:
        try:
            name, config, daemon = find_runtime(opts)
            report.lines.append(runtime.restart(opts.restart, name, opts.unit or name, daemon,
                                                real(opts, config), config))
        except GpuhookError as exc:
            report.lines.append(f"warning: {exc}")
    return report
