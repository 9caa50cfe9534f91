"""Which container runtime a node runs, what node-setup changes in its configuration, and how the daemon is
made to read it again.

Changes (all through runtimeconfig, which already edits these files, and all recorded for the undo):
- containerd >= 1.7: CDI on, in a drop-in `<config dir>/conf.d/99-gpuhook.toml` the main config imports (the
  main config gains only the `imports` entry). containerd 2.x merges an imported file into the main config key
  by key, so the drop-in holds only CDI's two settings and later edits of the main config's CRI table keep
  working. containerd 1.x replaces a plugin's whole table with an imported file's table (it does not merge
  inside a plugin), so there the drop-in has to carry the main config's CRI table with CDI added.
- containerd 1.6 (no CDI): the prestart hook in the default runtime's `base_runtime_spec`, as `runtime configure
  --mode hook` writes it, with the base spec made from the host's `ctr oci spec`.
- CRI-O: its drop-in `/etc/crio/crio.conf.d/99-gpuhook.conf` (CDI directories).

Reload: containerd and CRI-O read their configuration at start only, so the daemon is restarted: `systemd`
(`systemctl restart <unit>` run in the host's mount namespace, through the host's own systemctl and D-Bus), or
`signal` (SIGTERM to the daemon found in the host's PID namespace; its supervisor starts it again, as
systemd's `Restart=always` units of both do), or `none`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import tomlkit

from gpuhook.errors import GpuhookError, clip
from gpuhook.model.record import Record
from gpuhook.nodesetup.journal import host_path
from gpuhook.runtimeconfig import runtimes
from gpuhook.runtimeconfig.files import FileChange
from gpuhook.runtimeconfig.tomledit import add_items, check

DROPIN = "99-gpuhook.toml"
RESTART_MODES = ("systemd", "signal", "none")
CONFIGS = {"containerd": runtimes.CONTAINERD_CONFIG, "crio": runtimes.CRIO_CONFIG}
MAX_CMDLINE = 1 << 16


class Daemon(Record):
    pid: int
    exe: str  # the binary's host path
    version: tuple[int, ...] | None


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read(MAX_CMDLINE).split(b"\0") if a]


def find_daemon(name: str, real_config: str, host_config: str) -> Daemon | None:
    """The `name` daemon (containerd or crio) that reads `real_config` (that file as seen from here), found in
    the PID namespace we share with the host: its config argument resolved through its own root must be the
    same file. None when no such daemon runs."""
    try:
        want = os.stat(real_config)
    except FileNotFoundError:
        want = None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != name:
                    continue
            args = _cmdline(pid)
            config = runtimes.option_value(args[1:], runtimes.CONFIG_OPTIONS[name]) or host_config
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        try:
            st = os.stat(f"/proc/{pid}/root/{config.lstrip('/')}" if os.path.isabs(config)
                         else f"/proc/{pid}/cwd/{config}")
        except OSError:
            st = None
        same = (st is not None and want is not None and (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino))
        if same or (want is None and os.path.normpath(config) == os.path.normpath(host_config)):
            return Daemon(pid, exe, _version(pid, exe))
    return None


def in_host(pid: int, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a host program in `pid`'s mount namespace (the host's files and libraries, not this image's)."""
    try:
        return subprocess.run(["nsenter", f"--target={pid}", "--mount", "--", *argv], capture_output=True,
                              text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpuhookError(f"cannot run {argv[0]} on the host: {exc}") from None


def _version(pid: int, exe: str) -> tuple[int, ...] | None:
    out = in_host(pid, [exe.removesuffix(" (deleted)"), "--version"])
    match = re.search(r"\bv?(\d+)\.(\d+)(?:\.(\d+))?", out.stdout)
    return tuple(int(g) for g in match.groups() if g is not None) if match else None


class Change(Record):
    runtime: str
    files: list[FileChange]  # host paths in FileChange.path
    notes: list[str]


def plan(runtime: str, daemon: Daemon | None, root: str, config: str, hook: str, hook_config: str) -> Change:
    """What to write for `runtime` (its main config at host path `config`)."""
    if runtime == "crio":
        result = runtimes.plan(runtimes.Options("crio", "cdi", runtimes.CRIO_DROPIN, root=root))
        return Change("crio", [_host(c, root) for c in result.changes], result.notes)
    version = daemon.version if daemon else None
    if version is not None and version < (1, 7):
        spec = None
        if daemon is not None:
            out = in_host(daemon.pid, [os.path.join(os.path.dirname(daemon.exe), "ctr"), "oci", "spec"])
            if out.returncode != 0:
                raise GpuhookError(f"`ctr oci spec` on the host failed: {clip(out.stderr.strip())}")
            spec = out.stdout
        result = runtimes.plan(runtimes.Options("containerd", "hook", config, hook_path=hook,
                                                hook_config=hook_config, root=root, default_spec=spec))
        return Change("containerd", [_host(c, root) for c in result.changes], result.notes)
    whole = version is None or version < (2,)  # containerd 1.x (or unknown): it replaces the table
    notes = ["containerd 1.x replaces a plugin's whole table with an imported one, so the drop-in carries a copy "
             "of the main config's CRI table: after editing that table, restart node-setup's pod to copy it "
             "again"] if whole else []
    return Change("containerd", containerd_dropin(root, config, whole), notes)


def _host(change: FileChange, root: str) -> FileChange:
    """A runtimeconfig change (paths through the host mount) with the host's own path."""
    return FileChange(host_path(root, change.path), change.old, change.new)


def containerd_dropin(root: str, config: str, whole: bool = True) -> list[FileChange]:
    """The drop-in (CDI on; with `whole`, over a copy of the main config's CRI table) and the main config's
    `imports` entry for it."""
    real = runtimes.under(root, config)
    old = runtimes.read_text(real)
    doc = runtimes.parse_toml(config, old or "")
    version = runtimes.containerd_version(config, doc)
    dropin = os.path.join(os.path.dirname(config), "conf.d", DROPIN)
    cri_keys = runtimes.CONTAINERD_CRI[version]
    seed = tomlkit.document()
    seed["version"] = version
    cri = runtimes.lookup(doc.unwrap(), cri_keys) if whole else None
    if cri is not None:
        table = tomlkit.table(is_super_table=True)
        table[cri_keys[1]] = cri
        seed[cri_keys[0]] = table
    dropin_text = runtimes.containerd_cdi(dropin, tomlkit.parse(tomlkit.dumps(seed)), version)
    add_items(config, doc, ("imports",), (dropin,), ())
    new = tomlkit.dumps(doc)
    check(config, new, ("imports",), lambda v: isinstance(v, list) and dropin in v)
    return [FileChange(dropin, runtimes.read_text(runtimes.under(root, dropin)), dropin_text),
            FileChange(config, old, new)]


# --- making the daemon read it ---------------------------------------------------------------------------


def restart(mode: str, runtime: str, unit: str, daemon: Daemon | None, real_config: str, host_config: str,
            timeout: float = 60) -> str:
    """Restart the runtime so it reads its configuration; returns what was done."""
    if mode == "none":
        return f"{runtime} not restarted (--restart none): restart it to apply"
    if mode == "systemd":
        out = in_host(1, ["systemctl", "restart", unit], timeout)
        if out.returncode != 0:
            raise GpuhookError(f"systemctl restart {unit} failed: {clip(out.stderr.strip() or out.stdout.strip())}")
        return f"restarted {unit} (systemd)"
    if daemon is None:
        raise GpuhookError(f"no running {runtime} reads {host_config}: nothing to signal (--restart none?)")
    os.kill(daemon.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        again = find_daemon(runtime, real_config, host_config)
        if again is not None and again.pid != daemon.pid:
            return f"restarted {runtime} (SIGTERM to pid {daemon.pid}; pid {again.pid} now)"
    raise GpuhookError(f"{runtime} (pid {daemon.pid}) was stopped but did not come back within {timeout:.0f} s: "
                       "is it supervised (systemd Restart=always)?")
