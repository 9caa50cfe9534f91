"""Install, uninstall and check gpuhook on a node from the node-setup image, through the host mount.

Everything written is recorded first in the journal (`<prefix>/node-setup.json`), which is the only thing the
uninstall trusts: it puts back each file it changed (bytes, mode, owner, times), removes what it created, and
restarts the runtime again. An install over an earlier one (a restarted pod, a rolling update) refreshes it in
place: the journal keeps describing the state before gpuhook, and the runtime is restarted only when its
configuration changes."""

from __future__ import annotations

import os
import shutil
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
RELEASES = "releases"
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
    proc_root: str = "/proc"  # host path of the procfs with driver/nvidia (a simulated driver's own)


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
    """The whole node set-up; on any failure what was done so far is undone. Over an earlier install (a
    restarted pod, a rolling update) it refreshes that one in place: see `refresh`."""
    check_options(opts)
    start = time.monotonic()
    if os.path.lexists(real(opts, journal_path(opts))):
        if os.path.isdir(real(opts, os.path.join(opts.prefix, RELEASES))):
            report = refresh(opts, source, entry_script)
            report.seconds = time.monotonic() - start
            return report
        report = Report(["an earlier install of another layout is there: undoing it first", *uninstall(opts).lines])
    else:
        report = Report()
    if _occupied(real(opts, opts.prefix)):
        raise GpuhookError(f"{opts.prefix} exists on the host and is not node-setup's (no journal in it): "
                           "pass another --prefix or remove it")
    name, config, daemon = find_runtime(opts)
    journal = Journal(real(opts, journal_path(opts)), opts.host_root)
    layout = payload.Layout(opts.prefix)
    try:
        journal.makedirs(opts.prefix)
        journal.save()
        for part in (RELEASES, "bin", "etc"):
            journal.tree(layout.path(part))
        os.makedirs(real(opts, layout.path(RELEASES)))
        report.sizes = _unpack(opts, source, entry_script, report)
        os.makedirs(real(opts, layout.path("etc")))
        write_atomic(real(opts, layout.hook_config()), hook_config(opts).encode(), 0o644)
        changed = _configure(opts, journal, name, config, daemon, report)
        report.lines += _links(opts, journal)
        if changed:
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


def refresh(opts: Options, source: payload.Source, entry_script: Callable[[str, Sequence[str]], str]) -> Report:
    """An install over an earlier one: this image's release unpacked beside the running one (when it is not
    there yet) and published by one rename, the hook's config and the runtime's configuration rewritten only
    where they differ, and the runtime restarted only when its configuration changed. A restarted pod of the
    same image changes nothing; an upgrade never leaves a moment without a working hook."""
    journal = Journal.load(real(opts, journal_path(opts)), opts.host_root)
    assert journal is not None
    report = Report()
    name, config, daemon = find_runtime(opts)
    report.sizes = _unpack(opts, source, entry_script, report)
    hook_conf = real(opts, payload.Layout(opts.prefix).hook_config())
    if _read(hook_conf) != hook_config(opts).encode():
        write_atomic(hook_conf, hook_config(opts).encode(), 0o644)
        report.lines.append(f"rewrote {payload.Layout(opts.prefix).hook_config()}")
    changed = _configure(opts, journal, name, config, daemon, report)
    report.lines += _links(opts, journal)
    if changed:
        report.lines.append(runtime.restart(opts.restart, name, opts.unit or name, daemon, real(opts, config),
                                            config))
    else:
        report.lines.append(f"{name}'s configuration is already gpuhook's: not restarted")
    return report


def _unpack(opts: Options, source: payload.Source, entry_script: Callable[[str, Sequence[str]], str],
            report: Report) -> dict[str, int]:
    """This image's release under the prefix (built in a temporary folder, renamed into place), P/bin pointed
    at it by one rename, and every release but it and the one it replaced removed."""
    release = payload.release_id(source)
    releases = os.path.join(opts.prefix, RELEASES)
    layout = payload.Layout(os.path.join(releases, release))
    where = real(opts, layout.prefix)
    sizes: dict[str, int] = {}
    if not os.path.isdir(where):
        building = real(opts, os.path.join(releases, f".{release}.{os.getpid()}"))
        shutil.rmtree(building, ignore_errors=True)
        os.makedirs(building)
        try:
            sizes = payload.build(source, layout, building, entry_script)
            os.rename(building, where)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        report.lines.append(f"installed gpuhook under {opts.prefix} as release {release} "
                            f"({sizes['total'] >> 20} MiB, Python {source.version} with its own loader and libraries)")
    link = real(opts, os.path.join(opts.prefix, "bin"))
    target = os.path.join(RELEASES, release, "bin")
    previous = os.readlink(link) if os.path.islink(link) else None
    if previous != target:
        fresh = f"{link}.{os.getpid()}"
        if os.path.lexists(fresh):
            os.unlink(fresh)
        os.symlink(target, fresh)
        os.rename(fresh, link)  # one rename: every start sees the old bin or the new one
        if previous:
            report.lines.append(f"{opts.prefix}/bin now runs release {release} (was {previous.split('/')[1]})")
    keep = {release, previous.split("/")[1] if previous else release}
    for entry in os.listdir(real(opts, releases)):
        if entry not in keep:  # a release two upgrades old: no start can still be running it
            shutil.rmtree(os.path.join(real(opts, releases), entry), ignore_errors=True)
    return sizes


def _configure(opts: Options, journal: Journal, name: str, config: str, daemon: runtime.Daemon | None,
               report: Report) -> bool:
    """The runtime's configuration files written where they differ from gpuhook's; whether any did."""
    layout = payload.Layout(opts.prefix)
    change = runtime.plan(name, daemon, opts.host_root, config, layout.hook(), layout.hook_config())
    changed = False
    for file in change.files:
        if file.changed:
            journal.write(file.path, file.new.encode())
            report.lines.append(f"wrote {file.path}")
            changed = True
    report.lines += [f"note: {n}" for n in change.notes]
    return changed


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16)
    except OSError:
        return None


def _occupied(path: str) -> bool:
    """Whether `path` holds anything: an empty folder is fine (the device plugin's hostPath volume makes the
    prefix when its pod starts first) and is left as it was found."""
    if not os.path.lexists(path):
        return False
    return os.path.islink(path) or not os.path.isdir(path) or bool(os.listdir(path))


def hook_config(opts: Options) -> str:
    """The hook's config file under the prefix (the base spec's hook names it with --config)."""
    proc = f'proc-root = "{opts.proc_root}"\n' if opts.proc_root != "/proc" else ""
    return ("# written by gpuhook node-setup\n"
            f'driver-root = "{opts.driver_root}"\n' + proc)


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
