"""The host's ldconfig sees nothing but the container's filesystem.

glibc 2.36's `ldconfig -r ROOT DIR` resolves DIR inside ROOT but then opens `ROOT/DIR/glibc-hwcaps` as a plain
host path before it chroots: an image whose /usr/lib/x86_64-linux-gnu/glibc-hwcaps is a link to a host directory
(absolute, or a chain of `..`) made the host's ldconfig list that directory, and the names of its
subdirectories landed in the container's /etc/ld.so.cache. gpuhook now enters the container's root before the
exec, so every path ldconfig opens is the container's.

Each case plants a host *canary* directory holding `hostonly-<random>/` and points the image's glibc-hwcaps at
it, then starts the container (prestart hook under runc, the CDI spec's hook under podman, the runtime shim's
CDI hooks under runc) or calls the module directly, and checks from the host: the canary name is not in the
container's cache, and inotify saw no open of the canary directory. A control shows the watch sees an open.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import hostile
from support.e2e import need_root, need_tool
from support.glibc import MULTIARCH, glibc_rootfs
from support.podman import Podman
from support.runc import make_bundle, need_busybox, run_in_child, runc_delete, runc_run, unique_id

from gpuhook import _native
from gpuhook.errors import InjectionError
from gpuhook.fakedriver import FakeDriver
from gpuhook.inject import ldcache
from gpuhook.inject.rootfs import RootFS

UP = "../" * 24  # from anywhere in a rootfs, enough `..` to reach the host's / when followed on the host
HWCAPS = f"{MULTIARCH}/glibc-hwcaps"
LDCONFIG = "/sbin/ldconfig"
WATCH = hostile.IN_OPEN | hostile.IN_ACCESS | hostile.IN_MODIFY
IN_CREATE = 0x100


@dataclass
class Canary:
    """A host directory an image must never make the host's ldconfig open: `dir`/`name`/ (plus a library)."""

    dir: Path
    name: str

    @classmethod
    def make(cls, parent: Path) -> Canary:
        canary = cls(parent / "host-canary", f"hostonly-{uuid.uuid4().hex[:12]}")
        (canary.dir / canary.name).mkdir(parents=True)
        shutil.copy2(os.path.realpath("/lib/x86_64-linux-gnu/libm.so.6"), canary.dir / canary.name / "libm.so.6")
        return canary

    def watcher(self) -> hostile.Inotify:
        watcher = hostile.Inotify()
        watcher.watch(self.dir, WATCH | IN_CREATE)
        watcher.watch(self.dir / self.name, WATCH | IN_CREATE)
        return watcher

    def assert_untouched(self, cache: Path, opened: list[tuple[str, int]]) -> None:
        """Nothing of the canary in the container's cache, no open of it seen, nothing written into it."""
        data = cache.read_bytes() if cache.exists() else b""
        problems = []
        if self.name.encode() in data or str(self.dir).encode() in data:
            problems.append(f"the host directory {self.dir} was listed into the container's cache")
        if opened:
            problems.append(f"the host canary directory was opened: {opened}")
        if sorted(p.name for p in self.dir.iterdir()) != [self.name]:
            problems.append(f"something was written into the host canary directory: {list(self.dir.iterdir())}")
        assert problems == []


LINKS: dict[str, Callable[[Canary], str]] = {
    "absolute": lambda c: str(c.dir),
    "dotdot": lambda c: UP + str(c.dir).lstrip("/"),
}


def plant_hwcaps(rootfs: Path, canary: Canary, kind: str) -> None:
    link = rootfs / HWCAPS
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(LINKS[kind](canary))


def watched(canary: Canary, run: Callable[[], Any]) -> tuple[Any, list[tuple[str, int]]]:
    watcher = canary.watcher()
    try:
        result = run()
        return result, watcher.events()
    finally:
        watcher.close()


def test_canary_watch_sees_an_open(tmp_path: Path) -> None:
    """The control for every `opened == []` here: listing the canary (what ldconfig does) is seen."""
    canary = Canary.make(tmp_path)
    _, opened = watched(canary, lambda: os.listdir(canary.dir))
    assert any(path == str(canary.dir) and mask & hostile.IN_OPEN for path, mask in opened), opened


# --- the module, without a container ----------------------------------------------------------------------


def small_rootfs(tmp_path: Path) -> Path:
    """An image with a library folder (libc inside), an ld.so.conf, and nothing else."""
    rootfs = tmp_path / "rootfs"
    (rootfs / MULTIARCH).mkdir(parents=True)
    (rootfs / "etc").mkdir()
    (rootfs / "etc/ld.so.conf").write_text("")
    shutil.copy2(os.path.realpath("/lib/x86_64-linux-gnu/libc.so.6"), rootfs / MULTIARCH / "libc.so.6")
    return rootfs


def update_ldcache(root: RootFS, folders: list[str], fd: int) -> None:
    """ldcache.running to ldconfig's end, nothing done beside it, from a forked child (not disposable)."""
    with ldcache.running(root, folders, fd):
        pass


def run_ldconfig(rootfs: Path, folders: list[str]) -> None:
    fd = ldcache.open_ldconfig(f"@{LDCONFIG}")
    try:
        with RootFS(str(rootfs)) as root:
            update_ldcache(root, folders, fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", sorted(LINKS))
def test_update_ldcache_never_opens_host_hwcaps(tmp_path: Path, kind: str) -> None:
    need_root()
    rootfs = small_rootfs(tmp_path)
    canary = Canary.make(tmp_path)
    plant_hwcaps(rootfs, canary, kind)
    _, opened = watched(canary, lambda: run_ldconfig(rootfs, ["/" + MULTIARCH]))
    cache = rootfs / "etc/ld.so.cache"
    assert {e.key for e in _native.read_ldcache(str(cache))} >= {"libc.so.6"}  # ldconfig did run over the folder
    canary.assert_untouched(cache, opened)


def test_update_ldcache_hides_every_procfs_in_the_rootfs(tmp_path: Path) -> None:
    """A procfs mounted elsewhere in the rootfs (a runtime's `-v /proc:/host/proc`) has magic links that leave
    any chroot: an ld.so.conf folder through /host/proc/<pid>/root must not make ldconfig scan (and write soname
    links into) a host directory."""
    need_root()
    rootfs = small_rootfs(tmp_path)
    canary = Canary.make(tmp_path)
    (canary.dir / canary.name / "libm.so.6").rename(canary.dir / canary.name / "libhost.so.6.0")  # link bait
    (rootfs / "host/proc").mkdir(parents=True)
    escape = f"/host/proc/{os.getpid()}/root{canary.dir}/{canary.name}"
    (rootfs / "etc/ld.so.conf").write_text(f"{escape}\n")

    def child() -> None:
        _native.unshare(_native.CLONE_NEWNS)
        _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
        _native.mount("proc", str(rootfs / "host/proc"), "proc", _native.MS_NOSUID | _native.MS_NODEV, None)
        assert os.path.isdir(str(rootfs / "host/proc") + escape.removeprefix("/host/proc"))  # the way out exists
        run_ldconfig(rootfs, ["/" + MULTIARCH])

    _, opened = watched(canary, lambda: run_in_child(child))
    written = sorted(p.name for p in (canary.dir / canary.name).iterdir() if p.name != "libhost.so.6.0")
    data = (rootfs / "etc/ld.so.cache").read_bytes()
    assert (written, b"libhost" in data, canary.name.encode() in data, opened) == ([], False, False, []), \
        "ldconfig reached the host directory through the procfs (links written, cache entries, opens)"


ROOTFS_KINDS = ["own-mount", "plain-folder"]  # bound onto itself as runc and crun leave it, or a folder of a mount


def mount_hostile_extras(rootfs: Path, rootfs_kind: str, volume: Path) -> None:
    """In a forked child's own namespace: the rootfs made a mount of its own ("own-mount": ldconfig's view is
    then restricted by mount_setattr over the whole tree at once) or left a folder on the mount that holds it
    ("plain-folder": mount by mount, as before Linux 5.12); `volume` bound at /data, a procfs at /host/proc."""
    _native.unshare(_native.CLONE_NEWNS)
    _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
    if rootfs_kind == "own-mount":
        _native.mount(str(rootfs), str(rootfs), None, _native.MS_BIND | _native.MS_REC, None)
    _native.mount(str(volume), str(rootfs / "data"), None, _native.MS_BIND, None)
    _native.mount("proc", str(rootfs / "host/proc"), "proc", _native.MS_NOSUID | _native.MS_NODEV, None)
    fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
    try:
        assert _native.is_mount_root(fd) is (rootfs_kind == "own-mount")
    finally:
        os.close(fd)


def extras_rootfs(tmp_path: Path) -> tuple[Path, Path]:
    rootfs, volume = small_rootfs(tmp_path), tmp_path / "host-volume"
    volume.mkdir()
    (rootfs / "data").mkdir()
    (rootfs / "host/proc").mkdir(parents=True)
    return rootfs, volume


@pytest.mark.parametrize("rootfs_kind", ROOTFS_KINDS)
def test_ldconfig_view_is_read_only_below_the_rootfs(tmp_path: Path, rootfs_kind: str) -> None:
    """The private view ldconfig runs in: every mount nodev, those below the rootfs read-only, the rootfs's own
    still writable, each procfs in it under an empty tmpfs; the mount table read before (a start's own_mounts)
    names the procfs. The namespace the rootfs was opened in ends at unshare() here (nothing else is in it),
    unlike a container's: the rootfs's path must be read before."""
    need_root()
    rootfs, volume = extras_rootfs(tmp_path)

    def child() -> None:
        mount_hostile_extras(rootfs, rootfs_kind, volume)
        with RootFS(str(rootfs)) as root:
            root.own_mounts()  # the start's reading, in the container's namespace, before ldconfig's view
            view = ldcache._private_view(root)
            try:
                flags = {p: os.statvfs(rootfs / p).f_flag for p in (".", "data", "host/proc")}
                assert os.listdir(rootfs / "host/proc") == [], "a procfs in the rootfs was left visible"
                assert os.listdir(rootfs / "proc") == []
            finally:
                view.close()
        own = os.ST_NODEV if rootfs_kind == "own-mount" else 0  # a folder's holding mount is left as it is
        assert flags["."] & (os.ST_NODEV | os.ST_RDONLY) == own, flags
        assert flags["data"] & (os.ST_NODEV | os.ST_RDONLY) == os.ST_NODEV | os.ST_RDONLY, flags

    (rootfs / "proc").mkdir()
    run_in_child(child)


def test_mount_table_is_read_again_after_a_folder_mount(tmp_path: Path) -> None:
    """RootFS.mount_table keeps own_mounts' reading (ldconfig's view names each procfs from it) until a folder is
    mounted on in the rootfs (mounted_folder: a recursive bind may bring a procfs with it)."""
    need_root()
    rootfs, volume = extras_rootfs(tmp_path)

    def child() -> None:
        _native.unshare(_native.CLONE_NEWNS)
        _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
        with RootFS(str(rootfs)) as root:
            root.own_mounts()
            before = root.mount_table()
            _native.mount("proc", str(rootfs / "host/proc"), "proc", _native.MS_NOSUID | _native.MS_NODEV, None)
            assert root.mount_table() is before  # no folder mount of gpuhook's since: the reading stands
            root.mounted_folder()
            points = [m.mountpoint for m in root.mount_table()]
        assert str(rootfs / "host/proc") in points and str(rootfs / "host/proc") not in [m.mountpoint for m in before]

    run_in_child(child)


@pytest.mark.parametrize("rootfs_kind", ROOTFS_KINDS)
def test_ldconfig_writes_nothing_onto_a_volume(tmp_path: Path, rootfs_kind: str) -> None:
    """A volume (a host directory) that an ld.so.conf line names gets no soname link and no write from ldconfig,
    and the rootfs's own mount still takes the cache."""
    need_root()
    rootfs, volume = extras_rootfs(tmp_path)
    shutil.copy2(os.path.realpath("/lib/x86_64-linux-gnu/libm.so.6"), volume / "libm.so.6.0.bait")  # no soname link
    (rootfs / "etc/ld.so.conf").write_text("/data\n")

    def child() -> None:
        mount_hostile_extras(rootfs, rootfs_kind, volume)
        run_ldconfig(rootfs, ["/" + MULTIARCH])

    run_in_child(child)
    assert "libc.so.6" in {e.key for e in _native.read_ldcache(str(rootfs / "etc/ld.so.cache"))}
    assert sorted(p.name for p in volume.iterdir()) == ["libm.so.6.0.bait"], "ldconfig wrote into the volume"


def hard_link_flood(rootfs: Path, count: int) -> None:
    """`count` hard links in /etc/ld.so.conf.d to one 64 KiB file of distinct folders (30,000
    of them took 1.9 GiB and 5.5 s of the hook), plus an include loop in /etc/ld.so.conf."""
    confd = rootfs / "etc/ld.so.conf.d"
    confd.mkdir(parents=True, exist_ok=True)
    one = rootfs / "etc/flood.conf"
    one.write_text("".join(f"/opt/flood/{i:06d}\n" for i in range(1 << 16 >> 4)))
    for i in range(count):
        os.link(one, confd / f"flood-{i:05d}.conf")
    (rootfs / "etc/ld.so.conf").write_text("include /etc/ld.so.conf\ninclude /etc/ld.so.conf.d/*.conf\n")


def test_ld_so_conf_reading_is_bounded(tmp_path: Path) -> None:
    """configured_folders reads at most MAX_CONF_FILES files and MAX_CONF_TOTAL bytes, in constant memory,
    whatever the image holds; an include loop ends at MAX_INCLUDE_DEPTH."""
    import time
    import tracemalloc

    rootfs = small_rootfs(tmp_path)
    hard_link_flood(rootfs, 30_000)
    tracemalloc.start()
    began = time.monotonic()
    with RootFS(str(rootfs)) as root:
        found = ldcache.configured_folders(root)
    took = time.monotonic() - began
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(found) <= ldcache.MAX_FOLDERS + len(ldcache.TRUSTED_DIRS)
    assert "/opt/flood/000000" in found
    assert peak < 8 << 20, f"{peak} bytes at the peak"
    assert took < 2.0, f"{took:.1f}s"


def test_ld_so_conf_includes_are_followed(tmp_path: Path) -> None:
    """`include` lines (relative to the including file, a glob in the last component) are read, nested."""
    rootfs = small_rootfs(tmp_path)
    (rootfs / "etc/ld.so.conf").write_text("include conf.a/*.conf\n/top\n")
    (rootfs / "etc/conf.a").mkdir()
    (rootfs / "etc/conf.a/1.conf").write_text("/one\ninclude /etc/conf.b/two.conf\n")
    (rootfs / "etc/conf.b").mkdir()
    (rootfs / "etc/conf.b/two.conf").write_text("/two # a comment\n")
    with RootFS(str(rootfs)) as root:
        assert {"/top", "/one", "/two"} <= ldcache.configured_folders(root)


def test_ldconfig_must_be_static(tmp_path: Path) -> None:
    """Exec'd inside the container's root, a dynamic ldconfig would load the image's ld.so and libc, and a
    script the image's interpreter: both are refused before anything happens; the host's static one is fine."""
    need_tool("gcc")
    src = tmp_path / "main.c"
    src.write_text("int main(void) { return 0; }\n")
    dynamic, static = tmp_path / "dynamic", tmp_path / "static"
    subprocess.run(["gcc", "-o", str(dynamic), str(src)], check=True, capture_output=True)
    built = subprocess.run(["gcc", "-static", "-o", str(static), str(src)], capture_output=True, check=False)
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(InjectionError, match="dynamically linked"):
        ldcache.open_ldconfig(str(dynamic))
    with pytest.raises(InjectionError, match="not an ELF"):
        ldcache.open_ldconfig(str(script))
    for ok in ([static] if built.returncode == 0 else []) + [Path(LDCONFIG)]:  # -static needs libc.a
        os.close(ldcache.open_ldconfig(f"@{ok}"))
    fd = os.open(dynamic, os.O_RDONLY)  # the guard before the fork, for a descriptor from anywhere
    try:
        with RootFS(str(small_rootfs(tmp_path))) as root, pytest.raises(InjectionError, match="dynamically"):
            update_ldcache(root, [], fd)
    finally:
        os.close(fd)


PROBE_LDCONFIG = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void)
{
    char out[8192];
    int n = snprintf(out, sizeof out, "fds=");
    for (int fd = 0; fd < 4096; fd++)
        if (fcntl(fd, F_GETFD) >= 0)
            n += snprintf(out + n, sizeof out - n, "%d,", fd);
    long r = syscall(SYS_getppid);  /* always allowed without a filter */
    n += snprintf(out + n, sizeof out - n, " getppid=%s", r < 0 && errno == EPERM ? "EPERM" : "ok");
    r = syscall(SYS_setuid, 0);
    n += snprintf(out + n, sizeof out - n, " setuid=%s", r < 0 && errno == EPERM ? "EPERM" : "ok");
    r = syscall(SYS_fsync, 1);  /* stdout is a pipe: EINVAL, unless the filter answers without running it */
    n += snprintf(out + n, sizeof out - n, " fsync=%s\n", r == 0 ? "skipped" : "ran");
    (void)!write(1, out, n);
    return 1;
}
"""


def test_ldconfig_runs_confined(tmp_path: Path) -> None:
    """The host's ldconfig inherits no descriptor but stdin/stdout/stderr (not runc's
    exec.fifo, not the mount sources), and system calls outside its allow-list fail (EPERM); fsync succeeds
    without running (the cache is rebuilt at every start: no start waits for the disk). A static program in
    ldconfig's place reports what it got."""
    need_root()
    probe = static_probe(tmp_path, "probe", PROBE_LDCONFIG)
    leak = os.open("/dev/null", os.O_RDONLY)  # inheritable, as the runtime's descriptors are
    os.set_inheritable(leak, True)
    fd = ldcache.open_ldconfig(str(probe))
    try:
        with RootFS(str(small_rootfs(tmp_path))) as root, pytest.raises(InjectionError) as failed:
            update_ldcache(root, [], fd)
    finally:
        os.close(fd)
        os.close(leak)
    assert str(failed.value).endswith("fds=0,1,2, getppid=EPERM setuid=EPERM fsync=skipped"), failed.value


def test_ldconfig_alarm_survives_the_confinement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The alarm that ends an ldconfig blocked on an image's FIFO is set before the seccomp filter (which does
    not allow alarm()): a static program in ldconfig's place that opens a FIFO is stopped, not waited for."""
    need_root()
    rootfs = small_rootfs(tmp_path)
    fd = blocking_ldconfig(tmp_path, rootfs)
    monkeypatch.setattr(ldcache, "LDCONFIG_TIMEOUT_S", 1)

    def ring(_signum: int, _frame: object) -> None:  # a regression must fail, not hang the suite
        os.close(os.open(rootfs / "fifo", os.O_WRONLY | os.O_NONBLOCK))  # releases the blocked child
        raise AssertionError("ldconfig's alarm did not fire")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(15)
    try:
        with RootFS(str(rootfs)) as root, pytest.raises(InjectionError, match="did not finish in 1s"):
            update_ldcache(root, [], fd)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.close(fd)


def test_ldconfig_output_is_read_to_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image whose library folder makes ldconfig warn for pages (2,000 `lib*.so.1` files that are no ELF:
    ~200 KB, three pipe buffers) still gets its cache: the output is read to ldconfig's end, the tail kept,
    rather than a first chunk read and ldconfig left blocked on a full pipe until its alarm."""
    need_root()
    rootfs = small_rootfs(tmp_path)
    for i in range(2000):
        (rootfs / MULTIARCH / f"libjunk{i}.so.1").write_bytes(b"a" * 200)
    monkeypatch.setattr(ldcache, "LDCONFIG_TIMEOUT_S", 10)
    run_ldconfig(rootfs, ["/" + MULTIARCH])
    assert "libc.so.6" in {e.key for e in _native.read_ldcache(str(rootfs / "etc/ld.so.cache"))}


def static_probe(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    """`source` built static as tmp_path/`name`, a program to put in ldconfig's place; skips without a static
    libc to build it with."""
    need_tool("gcc")
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    probe = tmp_path / name
    if subprocess.run(["gcc", "-static", "-O1", *flags, "-o", str(probe), str(src)], capture_output=True).returncode:
        pytest.skip("no static libc to build the probe with")
    return probe


def blocking_ldconfig(tmp_path: Path, rootfs: Path) -> int:
    """A static program in ldconfig's place that blocks on the image's /fifo until it is killed (or its alarm)."""
    probe = static_probe(tmp_path, "block",
                         '#include <fcntl.h>\nint main(void) { return open("/fifo", O_RDONLY) < 0; }\n')
    os.mkfifo(rootfs / "fifo")
    return ldcache.open_ldconfig(str(probe))


@pytest.mark.parametrize("disposable", [True, False])
def test_work_beside_ldconfig_runs_in_the_callers_namespace(tmp_path: Path, disposable: bool) -> None:
    """ldcache.running: the with-block runs while ldconfig does, in the caller's mount namespace (a disposable
    caller left it for ldconfig's private view and came back), where a mount below the rootfs is writable as
    the container has it (in the view it is read-only); ldconfig has written its cache once the block ends."""
    need_root()
    rootfs, volume = extras_rootfs(tmp_path)

    def child() -> None:
        mount_hostile_extras(rootfs, "own-mount", volume)
        before = os.stat("/proc/self/ns/mnt").st_ino
        fd = ldcache.open_ldconfig(f"@{LDCONFIG}")
        try:
            with RootFS(str(rootfs)) as root, ldcache.running(root, ["/" + MULTIARCH], fd, disposable):
                assert os.stat("/proc/self/ns/mnt").st_ino == before
                (rootfs / "data/written-beside").write_text("x")  # read-only in ldconfig's view
        finally:
            os.close(fd)
        assert "libc.so.6" in {e.key for e in _native.read_ldcache(str(rootfs / "etc/ld.so.cache"))}

    run_in_child(child)
    assert (volume / "written-beside").read_text() == "x"


VIEW_PROBE = r"""
#include <stdio.h>
#include <sys/stat.h>
static long long size(const char *path) { struct stat st; return stat(path, &st) == 0 ? st.st_size : -1; }
int main(void) {
    printf("lib=%lld bin=%lld\n", size(LIB), size("/usr/bin/nvidia-smi"));
    return 1;
}
"""


def test_only_what_ldconfig_reads_is_bound_before_it_starts(fake: FakeDriver, tmp_path: Path) -> None:
    """inject/apply: the libraries (ldcache.read_by_ldconfig) are bound before ldconfig starts, so its view has
    them whole; a program (any name ldconfig never reads) is bound while it runs, in the container's namespace
    and not in ldconfig's view, which was copied before. A static probe in ldconfig's place reports what its
    view holds (and fails, so its words come back); the caller's namespace has the program afterwards."""
    need_root()
    from gpuhook.discover import Roots, discover
    from gpuhook.inject import mounts
    from gpuhook.inject.apply import apply_in_namespace
    from gpuhook.model.edits import Selection, plan

    root = Path(fake.root)
    inv = discover(Roots.make(str(root), None, str(root / "proc")))
    edits = plan(inv, Selection(devices=(inv.gpus[0],)))
    lib = next(m.container_path for m in edits.mounts if m.container_path.rpartition("/")[2].startswith("libcuda.so"))
    assert ldcache.read_by_ldconfig(lib) and not ldcache.read_by_ldconfig("/usr/bin/nvidia-smi")
    assert "/usr/bin/nvidia-smi" in {m.container_path for m in edits.mounts}
    probe = static_probe(tmp_path, "probe", VIEW_PROBE, f'-DLIB="{lib}"')
    rootfs = small_rootfs(tmp_path)

    def child() -> None:
        _native.unshare(_native.CLONE_NEWNS)
        _native.mount(None, "/", None, _native.MS_REC | _native.MS_PRIVATE, None)
        sources = dict(zip([m.container_path for m in edits.mounts],
                           mounts.clone_sources([m.host_path for m in edits.mounts])))
        fd = ldcache.open_ldconfig(str(probe))
        try:
            with pytest.raises(InjectionError) as failed:
                apply_in_namespace(str(rootfs), edits, sources, fd, str(root / "proc"))
        finally:
            os.close(fd)
        seen = dict(part.split("=") for part in str(failed.value).rpartition(": ")[2].split())
        assert int(seen["lib"]) == os.stat(root / lib.lstrip("/")).st_size > 0, failed.value
        assert int(seen["bin"]) in (-1, 0), failed.value  # the target file at most: the bind came after the copy
        assert (rootfs / "usr/bin/nvidia-smi").stat().st_size > 0  # bound all the same, in this namespace

    run_in_child(child)


@pytest.mark.parametrize("disposable", [True, False])
def test_failed_work_beside_ldconfig_kills_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              disposable: bool) -> None:
    """A with-block that fails (a device node refused) fails the start at once: ldconfig is killed and reaped,
    not waited for (here it would block on a FIFO for its whole alarm), and the block's error is what is said."""
    need_root()
    rootfs = small_rootfs(tmp_path)
    fd = blocking_ldconfig(tmp_path, rootfs)
    monkeypatch.setattr(ldcache, "LDCONFIG_TIMEOUT_S", 60)

    def ring(_signum: int, _frame: object) -> None:  # a regression must fail, not hang the suite
        os.close(os.open(rootfs / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError("ldconfig was waited for, not killed")

    def child() -> None:
        signal.signal(signal.SIGALRM, ring)
        signal.alarm(15)
        root = RootFS(str(rootfs))
        try:
            with pytest.raises(InjectionError, match="^the block's own failure$"), \
                    ldcache.running(root, [], fd, disposable):
                raise InjectionError("the block's own failure")
        finally:
            root.close()
        signal.alarm(0)
        with pytest.raises(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)  # nothing left to reap: ldconfig (and a forked helper) are gone

    try:
        run_in_child(child)
    finally:
        os.close(fd)


def test_ldconfig_keeps_only_the_capabilities_it_needs() -> None:
    """The confinement's first steps, seen in /proc before the filter (which then refuses what is not listed)."""
    need_root()

    def child() -> None:
        _native.confine_ldconfig(ldcache.LDCONFIG_CAPABILITIES)
        try:
            os.getpgid(0)  # not on ldconfig's list
        except PermissionError:
            pass
        else:
            raise AssertionError("getpgid was allowed")

    def check() -> None:
        _native.keep_capabilities(ldcache.LDCONFIG_CAPABILITIES)
        _native.no_new_privs()
        status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines()
                      if ":\t" in line)
        want = f"{ldcache.LDCONFIG_CAPABILITIES:016x}"
        got = (status["CapEff"].strip(), status["CapPrm"].strip(), status["CapBnd"].strip(), status["CapInh"].strip(),
               status["NoNewPrivs"].strip())
        assert got == (want, want, want, "0" * 16, "1"), got

    run_in_child(check)
    run_in_child(child)


# --- real starts ------------------------------------------------------------------------------------------

HOOK_TIMEOUT = 60
# The cache as the container reads it (`grep -c` prints 0 when the name is absent), then a check that the
# driver's libraries are in it (the hook did run ldconfig over the folder).
PROBE = "echo LEAK $(grep -c '{name}' /etc/ld.so.cache); echo CACHED $(grep -c libcuda.so.1 /etc/ld.so.cache)"


@pytest.fixture(scope="module")
def fake(fake_driver_factory: Any) -> FakeDriver:
    return fake_driver_factory()


def check_start(result: subprocess.CompletedProcess[str], rootfs: Path, canary: Canary,
                opened: list[tuple[str, int]]) -> None:
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines.get("CACHED", "0") != "0", f"no ld cache was built: {result.stdout}"
    assert "libcuda.so.1" in {e.key for e in _native.read_ldcache(str(rootfs / "etc/ld.so.cache"))}
    canary.assert_untouched(rootfs / "etc/ld.so.cache", opened)
    assert lines.get("LEAK") == "0", f"the container reads the host directory's entries: {result.stdout}"


@pytest.mark.e2e
@pytest.mark.parametrize("kind", sorted(LINKS))
def test_prestart_hook_runc(fake: FakeDriver, tmp_path: Path, kind: str) -> None:
    hostile.need_hook_e2e("gcc")
    canary = Canary.make(tmp_path)
    rootfs = glibc_rootfs(tmp_path / "bundle", probe_cache=tmp_path.parent / "probe")
    plant_hwcaps(rootfs, canary, kind)
    config = hostile.write_config(tmp_path, fake.root)
    bundle = make_bundle(tmp_path / "bundle", rootfs, ["sh", "-c", PROBE.format(name=canary.name)],
                         env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"],
                         hooks=hostile.prestart_hooks(config))
    result, opened = watched(canary, lambda: runc_run(bundle, unique_id("ldc"), timeout=HOOK_TIMEOUT))
    assert hostile.kill_leftovers(str(config)) == []
    check_start(result, rootfs, canary, opened)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, fake: FakeDriver) -> Iterator[Podman]:
    """A private podman whose /etc/cdi holds the spec `gpuhook generate-cdi` writes for `fake`."""
    world = hostile.podman_with_spec(tmp_path_factory.mktemp("podman"), fake)
    yield world
    world.close()


@pytest.mark.e2e
@pytest.mark.parametrize("kind", sorted(LINKS))
def test_cdi_hook_podman(world: Podman, tmp_path: Path, kind: str) -> None:
    canary = Canary.make(tmp_path)
    rootfs = glibc_rootfs(tmp_path, probe_cache=tmp_path.parent / "probe")
    plant_hwcaps(rootfs, canary, kind)
    result, opened = watched(canary, lambda: world.sh(rootfs, ["nvidia.com/gpu=0"], PROBE.format(name=canary.name),
                                                      timeout=HOOK_TIMEOUT))
    check_start(result, rootfs, canary, opened)


SHIM = str(Path(sys.executable).with_name("gpuhook-runtime"))


@pytest.mark.e2e
@pytest.mark.parametrize("kind", sorted(LINKS))
def test_runtime_shim_runc(fake: FakeDriver, tmp_path: Path, kind: str) -> None:
    """gpuhook-runtime rewrites config.json with the CDI edits (createContainer: `gpuhook cdi-hook
    update-container`), then execs runc."""
    need_root()
    need_tool("runc")
    need_busybox()
    assert Path(SHIM).exists(), "gpuhook-runtime is not installed next to the test interpreter"
    canary = Canary.make(tmp_path)
    rootfs = glibc_rootfs(tmp_path / "bundle", probe_cache=tmp_path.parent / "probe")
    plant_hwcaps(rootfs, canary, kind)
    bundle = make_bundle(tmp_path / "bundle", rootfs, ["sh", "-c", PROBE.format(name=canary.name)],
                         env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"])
    config = hostile.write_config(tmp_path, fake.root)
    cid = unique_id("ldc-shim")
    env = dict(os.environ, GPUHOOK_CONFIG=str(config), GPUHOOK_RUNTIME="runc")

    def start() -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run([SHIM, "run", "--bundle", str(bundle), cid], env=env, capture_output=True,
                                  text=True, timeout=HOOK_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
        finally:
            runc_delete(cid)

    result, opened = watched(canary, start)
    assert "cdi-hook" in (bundle / "config.json").read_text()  # the start went through the CDI hooks
    check_start(result, rootfs, canary, opened)
