"""Security: hostile images and faults through every door — the prestart hook (runc), the CDI
spec's createContainer hook (podman) and the runtime shim (gpuhook-runtime + runc) — see tests/support/doors.py.

Each case says what the host must show afterwards (nothing written outside the rootfs, nothing mounted, no
device node made) and what the start must do (work, or fail with one escaped line, never a traceback).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import hostile
from support.doors import DOORS, GPU_ENV, Doors, Run
from support.e2e import need_tool
from support.glibc import MULTIARCH
from support.podman import Podman
from support.runc import make_bundle

from gpuhook.cdi.spec import render_hooks
from gpuhook.discover import Roots, cache, discover
from gpuhook.fakedriver import FakeDriver
from gpuhook.model.edits import ContainerEdits, plan
from gpuhook.model.request import parse_request
from gpuhook.model.selection import resolve

pytestmark = pytest.mark.e2e
LIBDIR = "/" + MULTIARCH


@pytest.fixture(scope="module")
def fake(fake_driver_factory: Any) -> FakeDriver:
    return fake_driver_factory()


@pytest.fixture(scope="module")
def podman_world(tmp_path_factory: pytest.TempPathFactory, fake: FakeDriver) -> Iterator[list[Podman]]:
    """The podman world, made on first use only (hook- and shim-only runs never pay for it)."""
    made: list[Podman] = []
    yield made
    for world in made:
        world.close()


@pytest.fixture()
def doors(fake: FakeDriver, podman_world: list[Podman], tmp_path_factory: pytest.TempPathFactory) -> Doors:
    hostile.need_hook_e2e("gcc")

    def world() -> Podman:
        if not podman_world:
            podman_world.append(hostile.podman_with_spec(tmp_path_factory.mktemp("podman"), fake))
        return podman_world[0]

    return Doors(fake.root, world, tmp_path_factory.getbasetemp() / "probe")


# --- 6: never a traceback ------------------------------------------------------------------------------------


def gpu_edits(fake: FakeDriver) -> ContainerEdits:
    """What a GPU start with all capabilities gets (GPU_ENV)."""
    inv = discover(Roots.make(str(fake.root)))
    return plan(inv, resolve(inv, parse_request(list(GPU_ENV))))


@pytest.mark.parametrize("door", DOORS)
def test_read_only_library_folder_is_one_line(doors: Doors, fake: FakeDriver, tmp_path: Path, door: str) -> None:
    """The library folder cannot change (the mount targets are there already) and holds a libcuda.so.1 link
    that the start must replace: its unlink fails (EPERM). Every door says so in one line, none prints a
    traceback (the CDI and shim doors once printed one)."""
    planted: list[Path] = []

    def setup(rootfs: Path) -> None:
        edits = gpu_edits(fake)
        for link in edits.symlinks:  # every link already right but libcuda.so.1: only its unlink can fail
            path = rootfs / link.link.lstrip("/")
            if link.link.startswith(LIBDIR + "/") and not path.name.startswith("libcuda.so"):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.symlink_to(link.target)
        for target in (m.container_path for m in edits.mounts):
            if target.startswith(LIBDIR + "/"):
                (rootfs / target.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                (rootfs / target.lstrip("/")).touch()
        (rootfs / MULTIARCH / "libcuda.so.1").symlink_to("libcuda-elsewhere.so")
        planted.append(rootfs / MULTIARCH)

    need_tool("chattr")
    try:
        run = doors.start(door, tmp_path, setup=lambda r: (setup(r), subprocess.run(
            ["chattr", "+i", str(r / MULTIARCH)], check=True)))
    finally:
        for folder in planted:
            subprocess.run(["chattr", "-i", str(folder)], check=False)
    run.refused("cannot create link", "libcuda.so", "in container: Operation not permitted")


# --- 5: no log injection -------------------------------------------------------------------------------------

FORGED = "2026-01-01T00:00:00 forged-container inject devices=all caps=all"
HOSTILE_NAME = f"zz\n{FORGED}\x1b[2K\x1b]0;owned\x07\r{'y' * 150}.conf"


@pytest.mark.parametrize("door", DOORS)
def test_image_names_cannot_forge_log_lines(doors: Doors, tmp_path: Path, door: str) -> None:
    """An /etc/ld.so.conf.d entry whose name holds a newline, a forged log line, escape sequences and
    150 more characters, standing as a FIFO (refused): the refusal is one line on stderr and in the log, its name
    clipped and escaped (errors.clip), no raw control character anywhere."""
    run = doors.start(door, tmp_path, setup=lambda r: os.mkfifo(r / "etc/ld.so.conf.d" / HOSTILE_NAME))
    line = run.refused("not a regular file", "x0a2026-01-01")  # runc quotes it once more: \\x0a
    assert len(line) < 1500, line
    for text in (run.stderr, *run.log):
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text, repr(text[:300])
    assert not any(FORGED in ln and "zz" not in ln for ln in run.stderr.splitlines()), run.stderr
    if door != "cdi":  # the CDI hook writes no log; the hook's and the shim's are one line per start
        assert len(run.log) == 1 and not run.log[0].split(" ", 1)[1].startswith(FORGED[20:]), run.log


# --- 4: bounded reading of the image's ld.so.conf ------------------------------------------------------------


def conf_flood(rootfs: Path, count: int = 10_000) -> None:
    """`count` hard links in /etc/ld.so.conf.d to one 64 KiB file (comments: ldconfig reads them fast). (An
    include loop is bounded by gpuhook too, tests/test_ldcache_hostile.py, but glibc's ldconfig follows it
    until its alarm.)"""
    one = rootfs / "etc/flood.conf"
    one.write_text(("# " + "x" * 61 + "\n") * 1024 + "/opt/flood\n")
    for i in range(count):
        os.link(one, rootfs / f"etc/ld.so.conf.d/flood-{i:05d}.conf")


@pytest.mark.parametrize("door", DOORS)
def test_ld_so_conf_flood_starts(doors: Doors, tmp_path: Path, door: str) -> None:
    """10,000 hard links to a 64 KiB conf file: every door starts the container (gpuhook
    reads a bounded part, ldconfig the rest) and the driver's libraries are in its ld cache."""
    run = doors.start(door, tmp_path, setup=conf_flood, args=["sh", "-c", "grep -c libcuda.so.1 /etc/ld.so.cache"])
    assert run.rc == 0, run.stderr[-2000:]
    assert run.stdout.strip() != "0", run.stdout


# --- 3: the inventory cache is a hint ------------------------------------------------------------------------


def forged_cache(fake: FakeDriver, path: Path) -> None:
    """A cache with the right fingerprint that adds the host's /etc/shadow as a driver config file, left
    world-writable (as anyone could have written it)."""
    good = cache.inventory(Roots.make(str(fake.root), None, str(fake.root / "proc")), str(path.with_name("g.json")))
    data = good.to_dict()
    data["files"].append({"kind": "config", "capability": "utility", "path": "/etc/forged", "host_path": "/etc/shadow"})
    path.write_text(json.dumps(data))
    path.chmod(0o666)


@pytest.mark.parametrize("door", DOORS)
def test_a_forged_inventory_cache_is_ignored(doors: Doors, fake: FakeDriver, tmp_path: Path, door: str) -> None:
    """Hook and shim read the configured cache at every start, `generate-cdi --inventory-cache` (what the CDI door
    uses) once: a forged, world-writable cache is ignored with one note and the true inventory is used (issue
    22, item 3: it made the hook bind the host's /etc/shadow)."""
    tmp_path.mkdir(exist_ok=True)
    forged = tmp_path / "inventory.json"  # the path hostile.write_config gives the hook and the shim
    forged_cache(fake, forged)
    if door == "cdi":
        spec = tmp_path / "spec.yaml"
        result = subprocess.run([hostile.gpuhook_binary(), "generate-cdi", "--driver-root", str(fake.root),
                                 "--proc-root", str(fake.root / "proc"), "--inventory-cache", str(forged),
                                 "--output", str(spec)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        assert "/etc/shadow" not in spec.read_text() and "/etc/forged" not in spec.read_text()
        assert [ln for ln in result.stderr.splitlines() if "ignored" in ln] != [], result.stderr
        return
    run = doors.start(door, tmp_path, args=["sh", "-c", "ls /etc/forged 2>&1; ls /dev | grep -c nvidia0"])
    assert run.rc == 0, run.stderr[-2000:]
    assert "No such file" in run.stdout and run.stdout.split()[-1] == "1", run.stdout
    assert len(run.log) == 1 and "inventory cache" in run.log[0] and "ignored" in run.log[0], run.log


# --- 10: concurrency and agreement ---------------------------------------------------------------------------


def conf_via_proc(rootfs: Path) -> None:
    (rootfs / "etc/ld.so.conf").unlink()
    (rootfs / "etc/ld.so.conf").symlink_to("/proc/self/root/etc/ld.so.conf.real")
    (rootfs / "etc/ld.so.conf.real").write_text("include /etc/ld.so.conf.d/*.conf\n")


@pytest.mark.parametrize("door", DOORS)
def test_ld_so_conf_through_proc_self_root_is_one_rule(doors: Doors, tmp_path: Path, door: str) -> None:
    """/etc/ld.so.conf -> /proc/self/root/…: the hook started, the CDI and shim doors refused (the container's
    procfs is mounted at createContainer, not at prestart). One rule now: a configuration path that does not
    resolve inside the rootfs is no configuration, as ldconfig (every procfs hidden) sees it; the start works
    on every door with the driver in the ld cache, and nothing of the host's /etc/ld.so.conf is read."""
    run = doors.start(door, tmp_path, setup=conf_via_proc, args=["sh", "-c", "grep -c libcuda.so.1 /etc/ld.so.cache"])
    assert run.rc == 0, run.stderr[-2000:]
    assert run.stdout.strip() != "0", run.stdout


CONCURRENT = 8


@pytest.mark.parametrize("door", DOORS)
def test_concurrent_starts_of_one_image_directory_all_succeed(doors: Doors, fake: FakeDriver, tmp_path: Path,
                                                              door: str) -> None:
    """Eight GPU starts at once on one shared image directory: every one succeeds (a concurrent mkdir of a mount
    target's folder was an error, and two ldconfigs racing on /etc/ld.so.cache~ failed one of them), the ld
    cache holds the driver, and no temp file is left in the image's /etc. podman 4.3.1 itself hangs starting
    one --rootfs several times at once (GPU or not), so the CDI door runs its spec's createContainer hook
    command directly, eight at once, each with the OCI state of its own bundle on that image."""
    from concurrent.futures import ThreadPoolExecutor

    from support.glibc import glibc_rootfs

    image = glibc_rootfs(tmp_path / "image", probe_cache=tmp_path.parent / "probe")
    probe = ["sh", "-c", "grep -c libcuda.so.1 /etc/ld.so.cache"]
    if door == "cdi":
        hook = render_hooks(gpu_edits(fake), hostile.gpuhook_binary())[0]

        def one(i: int) -> Run:
            bundle = make_bundle(tmp_path / f"start-{i}", image, ["true"])
            state = json.dumps({"ociVersion": "1.0.2", "id": f"c{i}", "status": "creating", "pid": 1,
                                "bundle": str(bundle)})
            result = subprocess.run(hook["args"], executable=hook["path"], input=state, env={}, capture_output=True,
                                    text=True, timeout=60, check=False)
            return Run("cdi", result.returncode, "1", result.stderr, image)
    else:
        def one(i: int) -> Run:
            return doors.start(door, tmp_path / f"start-{i}", rootfs=image, args=probe)
    with ThreadPoolExecutor(CONCURRENT) as pool:
        runs = list(pool.map(one, range(CONCURRENT)))
    assert hostile.kill_leftovers(str(image)) == []
    failed = [(r.rc, r.stderr[-800:]) for r in runs if r.rc != 0]
    assert failed == [], failed
    assert all(r.stdout.strip() not in ("", "0") for r in runs), [r.stdout for r in runs]
    assert sorted(p.name for p in (image / "etc").iterdir() if p.name.startswith("ld.so.cache")) == ["ld.so.cache"]


# --- 2: nothing created on a volume through an image link --------------------------------------------------


def snapshot(top: Path) -> dict[str, str]:
    return hostile.content(top)


@pytest.mark.parametrize("door", DOORS)
def test_no_writes_into_a_host_volume_through_an_image_link(doors: Doors, tmp_path: Path, door: str) -> None:
    """A writable bind of a root-owned host directory at /data, and an image whose library folder is a link to
    /data/lib: the container itself gets EACCES there, yet a GPU start left 22 (hook, shim) or 59 (CDI)
    root-owned mount targets and links in the host directory. gpuhook now creates, writes
    and removes only on the rootfs's own mount (and the container's /dev, /proc/driver/nvidia): the hook
    refuses in one line and leaves the volume as it was; the shim, which runs before runc, follows the image's
    links as runc will and refuses before config.json changes (runc would make the mount targets there); on
    the CDI door runc itself makes the mount targets (the runtime's part, before any hook runs), and gpuhook's
    container hook refuses to add links or ld configuration there."""
    volume = tmp_path / "host-volume"
    (volume / "lib").mkdir(parents=True)
    (volume / "keep.txt").write_text("host data\n")
    for name in ("ld-linux-x86-64.so.2", "libc.so.6"):  # the image's loader and libc, on the volume
        shutil.copy2(os.path.realpath(f"/lib/x86_64-linux-gnu/{name}"), volume / "lib" / name)

    def setup(rootfs: Path) -> None:
        libdir = rootfs / MULTIARCH
        shutil.rmtree(libdir)
        libdir.symlink_to("/data/lib")
        (rootfs / "data").mkdir()

    before = snapshot(volume)
    run = doors.start(door, tmp_path / "work", setup=setup, volumes=[(str(volume), "/data", "rw")])
    run.refused("volume mounted at /data" if door == "shim" else "leads out of the container's own filesystem")
    after = snapshot(volume)
    made = {k: v for k, v in after.items() if before.get(k) != v}
    if door in ("hook", "shim"):
        assert made == {}, f"the start wrote into the host volume: {sorted(made)[:10]}"
    else:  # what runc made (empty mount targets) may be there; nothing of gpuhook's: no link, no conf, no cache
        assert not [k for k, v in made.items() if v.startswith("-> ") or not k.startswith("lib/")], sorted(made)[:10]


# --- 8: gated devices honour the unprivileged policy -------------------------------------------------------

GATED_ENV = ["NVIDIA_GDS=enabled", "NVIDIA_MOFED=enabled", "NVIDIA_NVSWITCH=enabled", "NVIDIA_GDRCOPY=enabled"]
GATED_PROBE = ("ls /dev | grep -E '^(nvidia-fs|nvidia-nvswitch|gdrdrv|infiniband)' | sort | tr '\\n' ' '; "
               "for f in /etc/cufile.json /run/udev; do [ -e $f ] && printf '%s ' $f; done; true")


@pytest.mark.parametrize("door", ["hook", "shim"])
@pytest.mark.parametrize("via", ["volume-mount", "cdi-annotation"])
@pytest.mark.parametrize("accept", [False, True], ids=["policy-false", "control-policy-true"])
def test_gated_devices_follow_the_unprivileged_policy(fake_driver_datacenter: FakeDriver, tmp_path: Path,
                                                      door: str, via: str, accept: bool) -> None:
    """accept-envvar-unprivileged = false, the GPU given by the device plugin's volume mount or a CDI
    annotation (which an image cannot set): an unprivileged image's own NVIDIA_GDS/MOFED/NVSWITCH/GDRCOPY=enabled
    added every host nvidia-fs, InfiniBand, NVSwitch and gdrdrv node plus /run/udev and /etc/cufile.json
    (NVIDIA's gated.go does too). They are ignored now, with a note in the log line; the control (policy true)
    still gets them. The CDI door never reads these variables (gated families are CDI devices of their own, named
    by the runtime's request), so there is nothing an image could widen there."""
    hostile.need_hook_e2e("gcc")
    doors = Doors(fake_driver_datacenter.root, lambda: None, tmp_path.parent / "probe")
    mounts = [("/dev/null", "/var/run/nvidia-container-devices/0", "ro")] if via == "volume-mount" else []
    annotations = {"cdi.k8s.io/gpuhook_test": "nvidia.com/gpu=0"} if via == "cdi-annotation" else None
    run = doors.start(door, tmp_path, env=GATED_ENV, gpu=False, args=["sh", "-c", GATED_PROBE], volumes=mounts,
                      annotations=annotations, config={"accept_envvar_unprivileged": accept,
                                                       "accept_volume_mounts": True})
    assert run.rc == 0, run.stderr[-2000:]
    assert len(run.log) == 1 and " inject devices=" in run.log[0], run.log
    if accept:
        assert "nvidia-fs0" in run.stdout and "gdrdrv" in run.stdout and "/run/udev" in run.stdout, run.stdout
        return
    assert run.stdout.strip() == "", f"an unprivileged image widened its device set: {run.stdout}"
    assert "NVIDIA_GDS,NVIDIA_MOFED,NVIDIA_NVSWITCH,NVIDIA_GDRCOPY ignored" in run.log[0] or \
        "ignored: unprivileged container" in run.log[0], run.log


# --- 1: the host's MPS directory and IPC sockets --------------------------------------------------------------

MPS_PROBE = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
static const char *result(int rc) { return rc == 0 ? "ok" : strerror(errno); }
int main(int argc, char **argv)
{
    int fifo = open("/tmp/nvidia-mps/control", O_WRONLY | O_NONBLOCK);  /* the host's reader waits */
    printf("FIFO-OPEN %s\n", result(fifo < 0 ? -1 : 0));
    if (fifo >= 0)
        printf("FIFO-WRITE %s\n", result(write(fifo, "hello\n", 6) == 6 ? 0 : -1));
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strcpy(addr.sun_path, "/tmp/nvidia-mps/server.sock");
    printf("CONNECT %s\n", result(connect(s, (struct sockaddr *)&addr, sizeof addr)));
    printf("CREATE %s\n", result(open("/tmp/nvidia-mps/planted", O_WRONLY | O_CREAT, 0644) < 0 ? -1 : 0));
    printf("UNLINK %s\n", result(unlink("/tmp/nvidia-mps/control")));
    printf("MKFIFO %s\n", result(mkfifo("/tmp/nvidia-mps/control2", 0600)));
    if (argc > 1) {  /* a bound socket nobody listens on, mounted like persistenced's */
        printf("SOCKET-CHMOD %s\n", result(chmod(argv[1], 0777)));
        int t = socket(AF_UNIX, SOCK_STREAM, 0);
        strcpy(addr.sun_path, argv[1]);
        printf("SOCKET-CONNECT %s\n", result(connect(t, (struct sockaddr *)&addr, sizeof addr)));
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def mps_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_tool("gcc")
    out = tmp_path_factory.mktemp("mpsprobe")
    (out / "probe.c").write_text(MPS_PROBE)
    built = subprocess.run(["gcc", "-static", "-O1", "-o", str(out / "mpsprobe"), str(out / "probe.c")],
                           capture_output=True, text=True, check=False)
    if built.returncode:
        pytest.skip(f"cannot build a static probe: {built.stderr[-300:]}")
    return out / "mpsprobe"


@pytest.mark.parametrize("door", DOORS)
def test_mps_directory_and_sockets_are_read_only_yet_usable(fake_driver_factory: Any, tmp_path: Path,
                                                            tmp_path_factory: pytest.TempPathFactory,
                                                            mps_probe: Path, door: str) -> None:
    """The host's MPS pipe directory and the persistenced socket came in writable: a container created a file in
    the host's /tmp/nvidia-mps and replaced its control pipe (NVIDIA mounts them writable too).
    They are read-only now, which stops no client: the container still opens the control FIFO for writing (the
    host reads its line) and connects to the socket (the host accepts), while creating, removing or replacing an
    entry, or changing the socket's mode, fails (EROFS) and the host's directory is unchanged."""
    import socket
    import threading

    hostile.need_hook_e2e("gcc")
    fake = fake_driver_factory(fresh=True)
    mps = fake.root / "tmp/nvidia-mps"
    mps.mkdir(parents=True, exist_ok=True)
    os.mkfifo(mps / "control")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(mps / "server.sock"))
    server.listen(1)
    server.settimeout(60)
    got: dict[str, Any] = {}

    def serve() -> None:
        with contextlib.suppress(OSError):
            got["fifo"] = open(mps / "control", "rb").readline()  # noqa: SIM115 - closed at exit of the thread
        with contextlib.suppress(OSError):
            got["conn"] = server.accept()[0]

    reader = threading.Thread(target=serve, daemon=True)
    reader.start()
    before = hostile.content(mps)
    worlds: list[Podman] = []

    def world() -> Podman:
        worlds.append(hostile.podman_with_spec(tmp_path_factory.mktemp("podman-mps"), fake))
        return worlds[0]

    doors = Doors(fake.root, world, tmp_path.parent / "probe")
    try:
        run = doors.start(door, tmp_path / "work", args=["/usr/bin/mpsprobe", *fake.ipc],
                          setup=lambda r: shutil.copy2(mps_probe, r / "usr/bin/mpsprobe"))
        reader.join(30)
    finally:
        for w in worlds:
            w.close()
        server.close()
        with contextlib.suppress(OSError):  # free the reader if the container never opened the FIFO
            os.close(os.open(mps / "control", os.O_WRONLY | os.O_NONBLOCK))
    assert run.rc == 0, run.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    assert (lines["FIFO-OPEN"], lines["FIFO-WRITE"], lines["CONNECT"]) == ("ok", "ok", "ok"), run.stdout
    assert got.get("fifo") == b"hello\n" and "conn" in got, got
    for what in ("CREATE", "UNLINK", "MKFIFO", "SOCKET-CHMOD"):
        assert lines[what] == "Read-only file system", run.stdout
    assert lines["SOCKET-CONNECT"] == "Connection refused", run.stdout  # reached: only nobody listens there
    assert hostile.content(mps) == before
