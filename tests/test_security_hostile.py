"""Hostile images against the prestart hook (runc) and the CDI hooks (podman): nothing may escape the rootfs.

The anchors are the NVIDIA toolkit's advisories: CVE-2024-0132 (an image's symlinks made the toolkit mount
host paths into the container) and CVE-2025-23266 (the container's LD_PRELOAD reached a hook running with
host privileges). Each case corrupts an image, starts it once without a GPU request and once with one (both
with a hostile environment: LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH, PATH and PYTHONPATH pointing at planted
code), and checks from the host:

- no marker: no planted library, ldconfig or sitecustomize ran anywhere on the host, nor the image's ldconfig;
- the watched host directories and the driver root are identical after the GPU start and the plain start
  (runc itself may act through an image symlink, e.g. /dev; the hook must add nothing), and the host mount
  table is unchanged;
- the start either succeeded with the driver files inside the rootfs, or failed with one `gpuhook-hook:` line
  (never a traceback, never a hang).

Special files (FIFOs, device nodes) matter because the hook and the host's ldconfig run outside the
container's device cgroup: opening an image's device node there is opening the host's device.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import hostile
from support.e2e import need_root, need_tool
from support.glibc import MULTIARCH, glibc_rootfs
from support.podman import Podman
from support.runc import make_bundle, runc_run, unique_id
from support.service import service_mode

from gpuhook.discover import Roots, discover
from gpuhook.errors import InjectionError
from gpuhook.fakedriver import FakeDriver
from gpuhook.inject.rootfs import RootFS
from gpuhook.model.edits import plan
from gpuhook.model.request import is_privileged, parse_request
from gpuhook.model.selection import resolve

pytestmark = pytest.mark.e2e

LIBDIR = "/" + MULTIARCH
UP = "../" * 24  # from anywhere in a rootfs, enough `..` to reach the host's / when followed on the host
PROBE = (  # {root}: the driver root, whose files must all be mounted read-only
    "echo NODES $(ls /dev | grep nvidia | sort | tr '\\n' ' '); "
    f"echo LINK $(readlink {LIBDIR}/libcuda.so.1); "
    "echo MOUNTS $(grep -c 'libcuda.so' /proc/self/mountinfo); "
    "grep ' {root}/' /proc/self/mountinfo | cut -d' ' -f5,6 | grep -v ' ro,' | sed 's/^/WRITABLE /'; true"
)
HOOK_TIMEOUT = 60  # seconds a start may take before it counts as a hang


# --- the building blocks, without a container -------------------------------------------------------------


class _Alarm(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Turn a hang (a FIFO opened without a peer) into a test failure instead of a stuck suite."""
    def ring(_signum: int, _frame: object) -> None:
        raise _Alarm(f"still blocked after {seconds}s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_rootfs_lookups_agree_on_links(tmp_path: Path) -> None:
    """Creating and opening a path must resolve an absolute or `..` link the same way (from the rootfs's /):
    the mount is attached where one lookup says and remounted read-only where the other says."""
    (tmp_path / "real").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a/abs").symlink_to("/real")
    (tmp_path / "a/up").symlink_to("../../../real")
    with RootFS(str(tmp_path)) as root:
        for via in ("abs", "up"):
            os.close(root.mkdirs(f"/a/{via}/made-{via}"))
            assert (tmp_path / f"real/made-{via}").is_dir()
            made = root.ensure_file(f"/a/{via}/file-{via}")
            opened = root.open(f"/a/{via}/file-{via}")
            try:
                assert os.fstat(made).st_ino == os.fstat(opened).st_ino == (tmp_path / f"real/file-{via}").stat().st_ino
            finally:
                os.close(made)
                os.close(opened)


def test_rootfs_leads_to_follows_links_as_a_runtime_would(tmp_path: Path) -> None:
    """Where a runtime that creates missing mount targets would create them: links followed inside the rootfs
    (absolute, relative, dangling, through /proc names lexically), the missing rest appended."""
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "usr/lib/abs").symlink_to("/data/lib")  # dangling: /data/lib does not exist yet
    (tmp_path / "usr/lib/up").symlink_to("../../etc")
    (tmp_path / "usr/lib/loop").symlink_to("loop")
    with RootFS(str(tmp_path)) as root:
        assert root.leads_to("/usr/lib/abs/libcuda.so.1") == "/data/lib/libcuda.so.1"
        assert root.leads_to("/usr/lib/up/x") == "/etc/x"
        assert root.leads_to("/usr/bin/nvidia-smi") == "/usr/bin/nvidia-smi"
        assert root.leads_to("/") == "/"
        with pytest.raises(InjectionError, match="too many links"):
            root.leads_to("/usr/lib/loop/x")


@pytest.mark.parametrize("kind", ["fifo", "device", "symlink-to-device"])
def test_rootfs_never_opens_special_files(tmp_path: Path, kind: str) -> None:
    """read_file/write_file refuse a FIFO (blocks) or a device node (the host's device: the hook runs outside
    the container's device cgroup) without opening it."""
    need_root()
    (tmp_path / "etc").mkdir()
    for name in ("conf", "out"):
        path = tmp_path / "etc" / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "device":
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        else:
            os.mknod(tmp_path / f"etc/{name}.node", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            path.symlink_to(f"/etc/{name}.node")
    watcher = hostile.Inotify()
    try:
        for path in (tmp_path / "etc").iterdir():
            if not path.is_symlink():
                watcher.watch(path)
        with RootFS(str(tmp_path)) as root, deadline(10):
            with pytest.raises(InjectionError, match="not a regular file"):
                root.read_file("/etc/conf", 100)
            with pytest.raises(InjectionError, match="not a regular file"):
                root.write_file("/etc/out", b"x")
            assert root.read_file("/etc/missing", 100) is None
        assert watcher.events() == []
        if kind == "device":  # the control: an open of the node is what the watch would have seen
            os.close(os.open(tmp_path / "etc/conf", os.O_RDONLY))
            assert watcher.events()
    finally:
        watcher.close()


def test_rootfs_files_are_replaced_and_read_through_links(tmp_path: Path) -> None:
    """The regular cases next to the refusals: rewrite an existing file, read one through a link in the root."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/out").write_text("a much longer old content\n")
    (tmp_path / "etc/real.conf").write_text("/opt/lib\n")
    (tmp_path / "etc/ld.so.conf").symlink_to("/etc/real.conf")
    with RootFS(str(tmp_path)) as root:
        root.write_file("/etc/out", b"new\n")
        root.write_file("/etc/new", b"created\n", 0o600)
        assert root.read_file("/etc/ld.so.conf", 100) == b"/opt/lib\n"
        assert root.read_file("/etc/out", 2) == b"ne"
    assert (tmp_path / "etc/out").read_text() == "new\n"
    assert stat.S_IMODE((tmp_path / "etc/new").stat().st_mode) == 0o600 & ~_umask()


def test_rootfs_mkdirs_walks_from_held_folders_and_names_what_fails(tmp_path: Path) -> None:
    """Folders made below folders made or looked up before (the walk starts at the deepest one held), siblings
    included; a link on the way is followed inside the rootfs; a file on the way fails in one line naming it."""
    (tmp_path / "usr").mkdir()
    (tmp_path / "usr/share").symlink_to("/opt/share")
    (tmp_path / "opt/share").mkdir(parents=True)
    (tmp_path / "opt/file").write_text("x")
    with RootFS(str(tmp_path)) as root:
        for path in ("/usr/share/vulkan/icd.d", "/usr/share/vulkan/implicit_layer.d", "/usr/share/glvnd/a/b",
                     "/usr/share/vulkan/icd.d"):
            fd = root.mkdirs(path)
            try:
                assert os.fstat(fd).st_ino == (tmp_path / "opt" / path[len("/usr/"):]).stat().st_ino
            finally:
                os.close(fd)
        with pytest.raises(InjectionError, match=r"^/opt/file/x in container: 'file' is Not a directory$"):
            root.mkdirs("/opt/file/x")
    assert sorted(p.name for p in (tmp_path / "opt/share/vulkan").iterdir()) == ["icd.d", "implicit_layer.d"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_planted_artefacts_do_mark(tmp_path: Path) -> None:
    """The control for every marker check: each planted thing leaves the marker when it does run on the host."""
    need_tool("gcc")
    marker = tmp_path / "MARKER"
    rootfs = tmp_path / "rootfs"
    env = dict(line.split("=", 1) for line in hostile.plant(rootfs, tmp_path / "host", marker))
    host_lib = env["LD_PRELOAD"].split(":")[0]
    for var in ("LD_PRELOAD", "LD_AUDIT"):
        subprocess.run(["/bin/true"], env={var: host_lib}, check=True)
    subprocess.run([sys.executable, "-c", "pass"], env={"PYTHONPATH": env["PYTHONPATH"]}, check=True)
    subprocess.run(["sh", "-c", "ldconfig"], env={"PATH": env["PATH"]}, check=True, cwd=tmp_path)
    assert marker.read_text().split() == ["constructor", "constructor", "la_version", "sitecustomize",
                                          "planted-ldconfig"]


def test_is_privileged_means_sys_admin_in_bounding() -> None:
    """The toolkit's definition: an effective CAP_SYS_ADMIN without the bounding set does not count."""
    assert not is_privileged({"capabilities": {"effective": ["CAP_SYS_ADMIN"], "permitted": ["CAP_SYS_ADMIN"],
                                               "bounding": ["CAP_KILL"]}})
    assert not is_privileged({"capabilities": {"bounding": "CAP_SYS_ADMIN"}})
    assert not is_privileged(None)
    assert is_privileged({"capabilities": {"bounding": ["CAP_KILL", "CAP_SYS_ADMIN"]}})


# --- the hostile image matrix -----------------------------------------------------------------------------


Setup = Callable[[Path, Path, FakeDriver], None]


@dataclass(frozen=True)
class Case:
    """`setup(rootfs, victim, fake)` corrupts a fresh image; `expect` is "ok" (the GPU start works), "fail"
    (the hook refuses with one clear line) or "either" (runc itself may refuse the image)."""

    id: str
    setup: Setup
    expect: str
    inotify: tuple[str, ...] = ()  # image paths whose opening (from any process) fails the test
    via_cdi: str = ""  # the outcome through podman when it differs: runc makes the CDI mounts (securejoin)

    @property
    def cdi_expect(self) -> str:
        return self.via_cdi or self.expect


def _clear(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)


def link(rel: str, target: str | Callable[[Path], str]) -> Setup:
    def setup(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
        path = rootfs / rel
        _clear(path)
        path.symlink_to(target(victim) if callable(target) else target)
    return setup


def regular_file(rel: str) -> Setup:
    def setup(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
        path = rootfs / rel
        _clear(path)
        path.write_text("not a directory\n")
    return setup


def fifo(rel: str) -> Setup:
    def setup(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
        path = rootfs / rel
        _clear(path)
        os.mkfifo(path)
    return setup


def null_device(rel: str) -> Setup:
    """A character node with /dev/null's numbers: harmless to open, but an open is visible to inotify."""
    def setup(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
        path = rootfs / rel
        _clear(path)
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))
    return setup


def both(*setups: Setup) -> Setup:
    def setup(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
        for s in setups:
            s(rootfs, victim, fake)
    return setup


def split_libdir(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
    """An image without merged /usr: the real library dir is /lib/x86_64-linux-gnu (the host's /lib is a link
    to usr/lib, so an absolute link to /lib/x86_64-linux-gnu means the host's library dir on the host)."""
    (rootfs / "lib").unlink()
    (rootfs / "lib").mkdir()
    shutil.move(rootfs / MULTIARCH, rootfs / "lib/x86_64-linux-gnu")


def victim_file(rel: str, content: str) -> Setup:
    def setup(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
        if not (victim / rel).exists():  # once: the plain and the GPU start share the victim
            (victim / rel).write_text(content)
    return setup


def lib_link(name: str, target: str | Callable[[Path], str]) -> Setup:
    """The versioned file of driver library `name` (a mount target) replaced by a link."""
    def setup(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
        link(fake.library(name).path.lstrip("/"), target)(rootfs, victim, fake)
    return setup


def chatty_libraries(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
    """Enough files that look like libraries but are not for ldconfig's warnings to overflow a pipe buffer."""
    for i in range(800):
        (rootfs / MULTIARCH / f"libjunk-{'x' * 100}-{i}.so.1").write_bytes(b"\x7fELF\x02\x01\x01\x00")


def mount_order(fake: FakeDriver) -> list[str]:
    """Container paths of the driver files the hook mounts, in its order (the planning functions it uses)."""
    inv = discover(Roots.make(str(fake.root)))
    request = parse_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"])
    return [m.container_path for m in plan(inv, resolve(inv, request)).mounts]


def retarget_onto_earlier_mount(rootfs: Path, victim: Path, fake: FakeDriver) -> None:
    """The second mount target links (absolutely) to the first one, and a decoy file sits where that link
    leads when resolved from the target's own folder instead of the rootfs. A hook that attaches the mount
    where one lookup says and remounts it read-only where another says leaves the host file writable."""
    first, second = mount_order(fake)[:2]
    path = rootfs / second.lstrip("/")
    _clear(path)
    path.symlink_to(first)
    decoy = path.parent / first.lstrip("/")
    decoy.parent.mkdir(parents=True, exist_ok=True)
    decoy.write_text("decoy\n")


CASES: list[Case] = [
    # the driver library folder
    Case("libdir-abs-self", link(MULTIARCH, LIBDIR), "fail"),
    Case("libdir-abs-host-lib", both(split_libdir, link(MULTIARCH, "/lib/x86_64-linux-gnu")), "ok"),
    Case("libdir-dotdot-self", link(MULTIARCH, UP + MULTIARCH), "fail"),
    Case("libdir-dotdot-host-lib", both(split_libdir, link(MULTIARCH, UP + "lib/x86_64-linux-gnu")), "ok"),
    Case("libdir-proc-self-root", link(MULTIARCH, "/proc/self/root" + LIBDIR), "fail"),
    Case("libdir-proc-1-root", link(MULTIARCH, "/proc/1/root" + LIBDIR), "fail"),
    Case("libdir-dangling-to-host", link(MULTIARCH, lambda v: f"{v}/libdir"), "fail", via_cdi="ok"),
    Case("libdir-is-a-file", regular_file(MULTIARCH), "fail"),
    # binaries, /dev, procfs, firmware
    Case("bindir-abs-self", link("usr/bin", "/usr/bin"), "fail"),
    Case("bindir-abs-host-bin", link("usr/bin", "/bin"), "ok"),
    Case("dev-abs-self", link("dev", "/dev"), "either"),
    Case("dev-proc-self-root", link("dev", "/proc/self/root/dev"), "either"),
    Case("dev-to-host-victim", link("dev", lambda v: str(v)), "either"),
    Case("proc-driver-nvidia", link("proc/driver/nvidia", "/proc/driver/nvidia"), "ok"),
    Case("firmware-abs-self", link("usr/lib/firmware", "/lib/firmware"), "fail"),
    Case("firmware-dotdot", link("usr/lib/firmware", UP + "lib/firmware"), "fail"),
    Case("firmware-to-host-victim", link("usr/lib/firmware", lambda v: str(v)), "fail", via_cdi="ok"),
    Case("firmware-is-a-file", regular_file("usr/lib/firmware"), "fail"),
    # the ld.so configuration and cache
    Case("confd-abs-self", link("etc/ld.so.conf.d", "/etc/ld.so.conf.d"), "fail"),
    Case("confd-proc-1-root", link("etc/ld.so.conf.d", "/proc/1/root/etc/ld.so.conf.d"), "fail"),
    Case("confd-dangling-to-host", link("etc/ld.so.conf.d", lambda v: f"{v}/confd"), "fail"),
    Case("confd-is-a-file", regular_file("etc/ld.so.conf.d"), "fail"),
    Case("own-conf-dangling-to-host", link("etc/ld.so.conf.d/00-gpuhook.conf", lambda v: f"{v}/created"), "fail"),
    Case("own-conf-to-host-file", both(victim_file("conf", "host data\n"),
                                       link("etc/ld.so.conf.d/00-gpuhook.conf", lambda v: f"{v}/conf")), "fail"),
    Case("cache-abs-self", link("etc/ld.so.cache", "/etc/ld.so.cache"), "ok"),
    Case("cache-proc-self-root", link("etc/ld.so.cache", "/proc/self/root/etc/ld.so.cache"), "ok"),
    Case("cache-proc-1-root", link("etc/ld.so.cache", "/proc/1/root/etc/ld.so.cache"), "ok"),
    Case("cache-to-host-file", both(victim_file("cache", "host cache\n"),
                                    link("etc/ld.so.cache", lambda v: f"{v}/cache")), "ok"),
    Case("cache-tmp-dangling-to-host", link("etc/ld.so.cache~", lambda v: f"{v}/cache-tmp"), "fail"),
    # mount targets and links the hook creates
    Case("mount-target-dangling-to-host", lib_link("libcuda", lambda v: f"{v}/libcuda"), "fail", via_cdi="ok"),
    Case("mount-target-to-host-file", lib_link("libnvidia-ml", "/etc/passwd"), "ok"),
    Case("mount-target-retargeted", retarget_onto_earlier_mount, "ok"),
    Case("soname-link-preplanted", link(MULTIARCH + "/libcuda.so.1", "/proc/self/root/etc/shadow"), "ok"),
    # special files: FIFOs hang an opener, device nodes are the host's devices outside the device cgroup
    Case("conf-fifo", fifo("etc/ld.so.conf"), "fail"),
    Case("confd-entry-fifo", fifo("etc/ld.so.conf.d/zz-image.conf"), "fail"),
    Case("own-conf-fifo", fifo("etc/ld.so.conf.d/00-gpuhook.conf"), "fail"),
    Case("conf-device", null_device("etc/ld.so.conf"), "fail", inotify=("etc/ld.so.conf",)),
    Case("own-conf-device", null_device("etc/ld.so.conf.d/00-gpuhook.conf"), "fail",
         inotify=("etc/ld.so.conf.d/00-gpuhook.conf",)),
    Case("cache-tmp-device", null_device("etc/ld.so.cache~"), "fail", inotify=("etc/ld.so.cache~",)),
    Case("lib-link-to-device", both(null_device("planted/nulldev"), link(MULTIARCH + "/libevil.so.1",
                                                                         "/planted/nulldev")),
         "ok", inotify=("planted/nulldev",)),
    Case("lib-link-to-fifo", both(fifo("planted/fifo"), link(MULTIARCH + "/libevil.so.2", "/planted/fifo")), "fail"),
    Case("ldconfig-chatter", chatty_libraries, "ok"),
    # nothing but the hostile environment
    Case("clean-image", lambda r, v, f: None, "ok"),
]


@pytest.fixture(scope="module")
def fake(fake_driver_factory: Any) -> FakeDriver:
    return fake_driver_factory()


@pytest.fixture()
def e2e() -> None:
    hostile.need_hook_e2e("gcc")


@dataclass
class Start:
    rc: int | None  # None: hung past HOOK_TIMEOUT
    stdout: str
    stderr: str
    rootfs: Path
    opened: list[tuple[str, int]]


def start(work: Path, fake: FakeDriver, case: Case, gpu: bool, victim: Path, marker: Path,
          probe_cache: Path) -> Start:
    work.mkdir(parents=True)
    rootfs = glibc_rootfs(work / "bundle", probe_cache=probe_cache)
    env = hostile.plant(rootfs, work / "planted-host", marker)
    case.setup(rootfs, victim, fake)
    config = hostile.write_config(work, fake.root)
    env += ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"] if gpu else []
    bundle = make_bundle(work / "bundle", rootfs, ["sh", "-c", PROBE.format(root=fake.root)], env=env,
                         hooks=hostile.prestart_hooks(config))
    return watched_start(rootfs, case, lambda: runc_run(bundle, unique_id("hostile"), timeout=HOOK_TIMEOUT),
                         str(config))


def watched_start(rootfs: Path, case: Case, run: Callable[[], subprocess.CompletedProcess[str]],
                  leftover_key: str) -> Start:
    """`run()` the start with `case.inotify`'s files of `rootfs` watched; a timeout is a hang (rc None). No
    process whose command line has `leftover_key` may outlive a start that did not hang."""
    watcher = hostile.Inotify()
    try:
        for rel in case.inotify:
            watcher.watch(rootfs / rel)
        try:
            result = run()
            rc, out, err = result.returncode, result.stdout, result.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = None, str(exc.stdout or ""), str(exc.stderr or "")
        leftovers = hostile.kill_leftovers(leftover_key)
        opened = watcher.events()
    finally:
        watcher.close()
    assert not leftovers or rc is None, f"processes left behind: {leftovers}"
    return Start(rc, out, err, rootfs, opened)


def check_view(run: Start, fake: FakeDriver) -> None:
    """A GPU start that worked: the GPU's node, the driver files and their links inside, all read-only."""
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    assert "nvidia0" in lines["NODES"].split()
    assert lines["LINK"].startswith("libcuda.so."), run.stdout
    assert int(lines["MOUNTS"]) >= 1
    writable = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("WRITABLE ")]
    assert set(writable) <= set(fake.ipc), f"a host driver file is mounted read-write: {writable}"


@pytest.fixture()
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "MARKER"
    yield path


def plain_and_gpu(fake: FakeDriver, tmp_path: Path, marker: Path,
                  start_one: Callable[[Path, bool, Path], Start]) -> tuple[Start, Start]:
    """The plain start and the GPU start of one case (`start_one(work, gpu, victim)`, each with its own victim
    dir holding host data), then what the host must show whatever came of them: nothing planted ran for the
    GPU start, the watched directories, the victims and the mounts it could touch as the plain start left them, no
    special file of the image opened, no hang, no traceback."""
    watched = [*hostile.HOST_WATCH, str(fake.root)]
    skip = [str(fake.root / "run")]  # the NVML mock's control files
    mounts_before = hostile.own_mounts(tmp_path, fake.root)
    before = hostile.signature(watched, skip)
    runs = {}
    for gpu in (False, True):
        victim = tmp_path / f"host-victim-{gpu}"  # where an image link points on the host; one per start
        victim.mkdir()
        (victim / "keep.txt").write_text("host data\n")
        runs[gpu] = start_one(tmp_path / f"start-{gpu}", gpu, victim)
    plain, gpu = runs[False], runs[True]

    hostile.marker_check(marker, gpu.rootfs)
    assert hostile.diff(before, hostile.signature(watched, skip)) == [], "a watched host directory changed"
    # runc itself acts through some links (it makes /dev's ptmx, fd, stdio links in a /dev -> victim): the GPU
    # start may do exactly what the plain start did there, nothing more
    assert hostile.content(tmp_path / "host-victim-True") == hostile.content(tmp_path / "host-victim-False")
    assert hostile.own_mounts(tmp_path, fake.root) == mounts_before
    assert gpu.opened == [], f"a special file of the image was opened from the host: {gpu.opened}"
    assert gpu.rc is not None, f"the start hung (>{HOOK_TIMEOUT}s): {gpu.stderr}"
    assert "Traceback" not in gpu.stderr
    return plain, gpu


def check_outcome(plain: Start, gpu: Start, expect: str, fake: FakeDriver, refused: Callable[[Start], None]) -> None:
    """The GPU start did what `expect` says: "ok" (the view inside checked), "fail" (a refusal, as `refused`
    checks) or "either". When the plain start failed, the runtime refuses the image by itself: then only
    "either" is right, and the GPU start must fail too."""
    if plain.rc != 0:  # the runtime itself refuses this image; the hook has nothing to prove
        assert expect == "either", plain.stderr
        assert gpu.rc != 0
        return
    if expect == "ok" or (expect == "either" and gpu.rc == 0):
        assert gpu.rc == 0, gpu.stderr
        check_view(gpu, fake)
    else:
        assert gpu.rc != 0, f"expected a refusal, the start worked: {gpu.stdout}"
        refused(gpu)


def hook_refused(run: Start) -> None:
    """Refused by the prestart hook: runc relays its `gpuhook-hook: ...` line."""
    hook_lines = [line for line in run.stderr.splitlines() if "gpuhook-hook:" in line]
    assert hook_lines, run.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_image_runc(e2e: None, fake: FakeDriver, tmp_path: Path, marker: Path, case: Case) -> None:
    plain, gpu = plain_and_gpu(fake, tmp_path, marker, lambda work, gpu, victim: start(
        work, fake, case, gpu, victim, marker, tmp_path.parent / "probe"))
    hostile.marker_check(marker, plain.rootfs)
    check_outcome(plain, gpu, case.expect, fake, hook_refused)


# --- the unprivileged policy -------------------------------------------------------------------------------


UNPRIVILEGED_NOTE = "NVIDIA_VISIBLE_DEVICES ignored: unprivileged container and accept-envvar-unprivileged is false"


@pytest.mark.parametrize(("env", "annotations", "gets_gpu"), [
    (["NVIDIA_VISIBLE_DEVICES=all"], {}, False),
    (["CUDA_VERSION=12.0.0"], {}, False),  # a legacy CUDA image asks for `all` as loudly as the env var
    (["NVIDIA_VISIBLE_DEVICES=all"], {"cdi.k8s.io/gpuhook_test": "nvidia.com/gpu=1"}, True),
], ids=["envvar", "legacy-image", "cdi-annotation"])
def test_unprivileged_policy_leaves_the_image_alone(e2e: None, fake: FakeDriver, tmp_path: Path, env: list[str],
                                                    annotations: dict[str, str], gets_gpu: bool) -> None:
    """accept-envvar-unprivileged = false, complementing tests/test_hook_e2e.py::test_unprivileged_policy (the
    env var ignored with a log line; privileged and volume-mount requests still served): an ignored request
    leaves the image exactly as a plain start does (no node, mount, link, ld cache) and logs why in the
    container's one line; a CDI annotation, which the runtime sets and the image cannot, is still served."""
    config = hostile.write_config(tmp_path, fake.root, accept_envvar_unprivileged=False)
    views = []
    for run_env in ([], env):
        work = tmp_path / f"run-{len(views)}"
        rootfs = glibc_rootfs(work, probe_cache=tmp_path.parent / "probe")
        bundle = make_bundle(work, rootfs, ["sh", "-c", PROBE.format(root=fake.root)], env=run_env,
                             hooks=hostile.prestart_hooks(config), annotations=annotations if run_env else None)
        cid = unique_id("unpriv")
        result = runc_run(bundle, cid)
        assert result.returncode == 0, result.stderr
        views.append((hostile.content(rootfs), result.stdout, cid))
    log = hostile.log_lines(tmp_path)
    assert len(log) == 2 and all(views[i][2] in log[i] for i in range(2)), log
    if gets_gpu:
        assert "nvidia1" in views[1][1] and "nvidia0" not in views[1][1]
        assert " inject devices=" in log[1]
        return
    assert views[1][0] == views[0][0], "an ignored request changed the image"
    assert views[1][1] == views[0][1]
    assert log[1].split(" ", 1)[1].startswith(f"{views[1][2]} skip request=unset ({UNPRIVILEGED_NOTE})"), log[1]


# --- hostile request sizes ------------------------------------------------------------------------------------


HUGE_REQUESTS = {  # each once took minutes through a list membership test per id
    "env-150k-ids": ([f"NVIDIA_VISIBLE_DEVICES={','.join(str(i) for i in range(150_000))}"], None,
                     "NVIDIA_VISIBLE_DEVICES is "),
    "env-10k-ids": ([f"NVIDIA_VISIBLE_DEVICES={','.join('GPU-x' for _ in range(10_000))}"], None,
                    "NVIDIA_VISIBLE_DEVICES names 10000 devices"),
    "annotation-200k-names": ([], {"cdi.k8s.io/gpuhook_x": ",".join(f"nvidia.com/gpu={i}" for i in range(200_000))},
                              "annotation 'cdi.k8s.io/gpuhook_x' "),
}


@pytest.mark.parametrize("name", sorted(HUGE_REQUESTS))
def test_huge_request_is_refused_in_one_bounded_line(e2e: None, fake: FakeDriver, tmp_path: Path, name: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A real runc start through the prestart hook: refused before any per-item work, with one stderr line and
    one log line that name the variable and stay short (the value is clipped), and the image left alone.
    (podman cannot carry such an annotation: one argument is at most 128 KiB, MAX_ARG_STRLEN; the CDI spec's
    hooks never read annotations, the prestart hook and the shim do.) The 200k-name annotation makes a state
    over the service's 1 MiB, which the native entry hands to its fallback by design: in the suite's service
    mode that case gets an entry whose fallback is the real one."""
    env, annotations, names = HUGE_REQUESTS[name]
    if service_mode() == "running" and annotations:
        from gpuhook.cli.entry import install

        monkeypatch.setenv("GPUHOOK_TEST_HOOK", install(str(tmp_path / "bin" / "gpuhook-hook"))[0])
    config = hostile.write_config(tmp_path, fake.root)
    rootfs = glibc_rootfs(tmp_path / "bundle", probe_cache=tmp_path.parent / "probe")
    before = hostile.content(rootfs)
    bundle = make_bundle(tmp_path / "bundle", rootfs, ["true"], env=env, hooks=hostile.prestart_hooks(config),
                         annotations=annotations)
    result = runc_run(bundle, unique_id("huge"), timeout=HOOK_TIMEOUT)
    assert result.returncode != 0
    hook_lines = [line for line in result.stderr.splitlines() if "gpuhook-hook:" in line]
    assert len(hook_lines) == 1 and names in hook_lines[0], result.stderr[:2000]
    assert len(result.stderr) < 2000, result.stderr[:2000]
    log = hostile.log_lines(tmp_path)
    assert len(log) == 1 and names in log[0] and len(log[0]) < 1000, log
    assert hostile.content(rootfs) == before


# --- the same images through podman and the CDI spec's hooks -----------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, fake: FakeDriver) -> Iterator[Podman]:
    """A private podman whose /etc/cdi holds the spec `gpuhook generate-cdi` writes for `fake`."""
    world = hostile.podman_with_spec(tmp_path_factory.mktemp("podman"), fake)
    yield world
    world.close()


def podman_start(world: Podman, work: Path, fake: FakeDriver, case: Case, gpu: bool, victim: Path, marker: Path,
                 probe_cache: Path) -> Start:
    work.mkdir(parents=True)
    rootfs = glibc_rootfs(work, probe_cache=probe_cache)
    env = hostile.plant(rootfs, work / "planted-host", marker)
    case.setup(rootfs, victim, fake)
    devices = ["nvidia.com/gpu=0"] if gpu else []
    return watched_start(rootfs, case, lambda: world.sh(rootfs, devices, PROBE.format(root=fake.root), env=env,
                                                        timeout=HOOK_TIMEOUT), str(rootfs))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_image_podman_cdi(world: Podman, fake: FakeDriver, tmp_path: Path, marker: Path, case: Case) -> None:
    plain, gpu = plain_and_gpu(fake, tmp_path, marker, lambda work, gpu, victim: podman_start(
        world, work, fake, case, gpu, victim, marker, tmp_path.parent / "probe"))
    check_outcome(plain, gpu, case.cdi_expect, fake, podman_refused)


def podman_refused(run: Start) -> None:
    """Refused by runc (securejoin) or by our cdi-hook (`gpuhook: ...`), in one line."""
    assert "Error: " in run.stderr
