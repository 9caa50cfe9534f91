"""What ships, used where it ships: packaging/build's wheel and .debs installed into clean Debian 12 and 13 roots
(.ci/fetch-debian-roots: Debian's packages only, no compiler) and a GPU container started through them there with
runc on the simulated driver; the .deb removed and purged (nothing of gpuhook's left but what the user configured),
the wheel pip-installed into a venv of the root's python3 and its native entry written by `gpuhook hook install`
(in a Debian 11 root too: glibc 2.31, older than the build machine's).

The roots are entered with chroot in a private mount namespace (the host's /proc, /sys and /dev bound in, the
simulated driver bound at its own path), so nothing here touches the host's /usr, /etc or /var. The artefacts
come from $GPUHOOK_DIST (.ci/packaging builds them once) or are built here by packaging/build.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.e2e import need, need_root, need_tool
from support.runc import busybox_rootfs, make_bundle, need_busybox

from gpuhook.hook.installed import MARKER

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
ROOTS = Path(os.environ.get("GPUHOOK_DEBIAN_ROOTS",
                            os.environ.get("GPUHOOK_DEB_CACHE", "/var/cache/gpuhook-test-debs") + "/roots"))
RELEASES = {"bookworm": "12", "trixie": "13"}
# where the wheel is installed: the .debs' releases, and Debian 11 (glibc 2.31: the manylinux_2_17 wheel, built on
# a newer glibc, must run there); each root's python3 -> the newest glibc its dependencies' wheels may need
WHEEL_RELEASES = (*RELEASES, "bullseye")
GLIBC = {"3.9": 31, "3.11": 36, "3.13": 41}
# Paths that change on their own in a root (apt's and dpkg's bookkeeping, logs, caches, the run and tmp dirs).
VOLATILE = ("proc", "sys", "dev", "run", "tmp", "var/log", "var/cache/apt", "var/lib/apt", "var/lib/dpkg",
            "var/cache/debconf", "var/cache/ldconfig", "etc/ld.so.cache")
FIX = "reinstall gpuhook, then run `gpuhook hook install`"


def build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpuhook_packaging_build", REPO / "packaging" / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the wheel and the .debs: $GPUHOOK_DIST, else a fresh packaging/build."""
    need_root()
    if os.environ.get("GPUHOOK_DIST"):
        return Path(os.environ["GPUHOOK_DIST"])
    need(shutil.which("dpkg-deb") is not None and importlib.util.find_spec("auditwheel") is not None,
         "packaging/build needs dpkg-deb and the `package` extra")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([str(REPO / "packaging" / "build"), "--out", str(out)], check=True,
                   env={**os.environ, "GPUHOOK_BUILD_PYTHON": sys.executable})
    return out


class Root:
    """A clean Debian root unpacked from its cached tarball, and commands run in it."""

    def __init__(self, release: str, top: Path, binds: tuple[str, ...]) -> None:
        tarball = ROOTS / f"{release}.tar"
        need(tarball.is_file(), f"no Debian {release} root at {tarball}: run .ci/fetch-debian-roots")
        self.release = release
        self.path = top / "root"
        self.path.mkdir()
        subprocess.run(["tar", "-xf", str(tarball), "--numeric-owner", "-C", str(self.path)], check=True)
        self.binds = binds

    def run(self, command: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`command` (sh) in the root: a private mount namespace whose root it is, the host's /proc, /sys and /dev
    bound in."""
        root = shlex.quote(str(self.path))
        # the root a mount point of its own: runc makes `/` a slave mount, which only a mount point can be
        mounts = [f"mount --bind {root} {root}", *(f"mount --rbind /{d} {root}/{d}" for d in ("proc", "sys", "dev"))]
        for bind in self.binds:
            mounts += [f"mkdir -p {root}{shlex.quote(bind)}", f"mount --bind {shlex.quote(bind)} {root}{bind}"]
        # pivot_root, not only chroot: the hook joins the container's mount namespace, whose root is the real one
        mounts += [f"mkdir -p {root}/tmp/.oldroot", f"cd {root}", "pivot_root . tmp/.oldroot"]
        script = " && ".join([*mounts, f"exec chroot . /bin/sh -c {shlex.quote(command)}"])
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8",
               "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
        result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                capture_output=True, text=True, env=env, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{command!r} in the {self.release} root: exit {result.returncode}\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def listing(self) -> set[str]:
        """Every path in the root but the volatile ones."""
        found: set[str] = set()
        for folder, dirs, files in os.walk(self.path):
            rel = os.path.relpath(folder, self.path)
            rel = "" if rel == "." else rel
            dirs[:] = [d for d in dirs if os.path.join(rel, d) not in VOLATILE]
            found.update(os.path.join(rel, name) for name in (*dirs, *files)
                         if os.path.join(rel, name) not in VOLATILE)
        return found

    def no_compiler(self) -> None:
        result = self.run("command -v gcc cc c99 tcc clang || true")
        assert result.stdout.strip() == "", f"a compiler is in the {self.release} root: {result.stdout}"

    def python_version(self) -> str:
        return self.run("python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.strip()


@pytest.fixture()
def make_root(tmp_path: Path, fake_driver: Any) -> Iterator[Any]:
    need_root()
    need_tool("unshare")
    need_busybox()

    made: list[Root] = []

    def make(release: str) -> Root:
        made.append(Root(release, tmp_path, (str(fake_driver.root),)))
        return made[-1]

    yield make
    # ~250 MB each: not kept in pytest's retained temp dirs (never while anything is still mounted below it)
    for root in made:
        with open("/proc/self/mountinfo") as f:
            if not any(f" {root.path}/" in line or f" {root.path} " in line for line in f):
                shutil.rmtree(root.path, ignore_errors=True)


def gpu_start(root: Root, fake: Any, hook: str, env: list[str], work: str = "/tmp/gpu",
              service: bool = False) -> subprocess.CompletedProcess[str]:
    """One runc container in the root with `hook` at prestart on the simulated driver; its probe lists the
    container's NVIDIA nodes and driver library mounts. With `service`, the installed `gpuhook service` answers
    the native entry, and the Python entry is moved away for the start, so that only the service can serve it."""
    host_work = root.path / work.lstrip("/")
    if host_work.exists():
        shutil.rmtree(host_work)
    host_work.mkdir(parents=True)
    (host_work / "config.toml").write_text(
        f'driver-root = "{fake.root}"\nproc-root = "{fake.root}/proc"\nlog-file = "{work}/gpuhook.log"\n'
        f'inventory-cache = "{work}/inventory.json"\n')
    rootfs = busybox_rootfs(host_work / "bundle")
    hooks = {"prestart": [{"path": hook, "args": ["gpuhook-hook", "--config", f"{work}/config.toml", "prestart"],
                           "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                                   f"GPUHOOK_SERVICE_SOCKET={work}/no-service.sock"]}]}
    probe = "ls /dev | grep nvidia | sort | tr '\\n' ' '; echo; grep -c libcuda /proc/self/mountinfo || true"
    bundle = make_bundle(host_work / "bundle", rootfs, ["sh", "-c", probe], env=env, hooks=hooks)
    assert os.path.relpath(rootfs, bundle) == "rootfs"
    cid = f"pkg-{os.getpid()}-{time.monotonic_ns() % 100000}"
    start = f"runc run --bundle {work}/bundle {cid}; rc=$?; runc delete -f {cid} 2>/dev/null"
    if service:
        sock = f"{work}/no-service.sock"  # the socket the hook's environment names
        start = (f"GPUHOOK_SERVICE_SOCKET={sock} gpuhook service --config {work}/config.toml "
                 f"2>{work}/service.err & s=$!; i=0; "
                 f"while [ ! -S {sock} ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; "
                 f"mv {hook}.py {hook}.py.away; {start}; mv {hook}.py.away {hook}.py; kill $s; wait $s")
    return root.run(f"{start}; exit $rc", check=False, timeout=120)


def assert_gpu_container(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"], result.stdout
    assert int(lines[1]) >= 1  # libcuda mounted


def deb_for(dist: Path, release: str) -> Path:
    debs = sorted(dist.glob(f"gpuhook_*+deb{RELEASES[release]}_amd64.deb"))
    assert len(debs) == 1, f"expected one .deb for Debian {RELEASES[release]} in {dist}: {debs}"
    return debs[0]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_deb_installs_starts_a_gpu_container_and_purges_clean(make_root: Any, fake_driver: Any, dist: Path,
                                                               release: str) -> None:
    root = make_root(release)
    root.no_compiler()
    # what the user configured before: kept through remove and purge
    (root.path / "etc/gpuhook").mkdir()
    (root.path / "etc/gpuhook/config.toml").write_text("# the user's\n")
    before = root.listing()
    deb = deb_for(dist, release)
    shutil.copy(deb, root.path / "tmp")
    control = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True, check=True)
    assert f"python{root.python_version()}" in [d.strip() for d in control.stdout.split(",")]

    root.run(f"apt-get install -y -q --no-install-recommends /tmp/{deb.name}")
    assert root.run("gpuhook --version").stdout.startswith("gpuhook, version ")
    hook = root.path / "usr/bin/gpuhook-hook"
    assert hook.read_bytes()[:4] == b"\x7fELF" and MARKER.encode() in hook.read_bytes()
    assert (root.path / "usr/bin/gpuhook-hook.py").read_text().startswith("#!/usr/lib/gpuhook/bin/python3 -IS\n")
    assert os.readlink(root.path / "usr/lib/gpuhook/bin/python3") == f"/usr/bin/python{root.python_version()}"
    wants = root.path / "etc/systemd/system/sockets.target.wants/gpuhook.socket"
    assert os.readlink(wants) in ("/usr/lib/systemd/system/gpuhook.socket", "/lib/systemd/system/gpuhook.socket")
    refresh = root.path / "etc/systemd/system/multi-user.target.wants/gpuhook-cdi-refresh.service"
    assert os.readlink(refresh).endswith("/systemd/system/gpuhook-cdi-refresh.service")  # as NVIDIA's: on
    assert "Source install" not in (root.path / "usr/lib/systemd/system/gpuhook-cdi-refresh.service").read_text()
    unit = (root.path / "usr/lib/systemd/system/gpuhook.service").read_text()
    assert "ExecStart=/usr/bin/gpuhook service" in unit
    assert "License: Apache-2.0" in (root.path / "usr/share/doc/gpuhook/copyright").read_text()
    for page in ("gpuhook", "gpuhook-hook", "gpuhook-runtime"):
        assert (root.path / f"usr/share/man/man1/{page}.1.gz").is_file(), page
    root.run("apt-get install -y -q --reinstall /tmp/" + deb.name)  # the maintainer scripts are idempotent

    assert_gpu_container(gpu_start(root, fake_driver, "/usr/bin/gpuhook-hook", ["NVIDIA_VISIBLE_DEVICES=0"]))
    assert_gpu_container(gpu_start(root, fake_driver, "/usr/bin/gpuhook-hook", ["NVIDIA_VISIBLE_DEVICES=0"],
                                   service=True))
    assert (root.path / "usr/bin/gpuhook-hook.py").exists()
    plain = gpu_start(root, fake_driver, "/usr/bin/gpuhook-hook", [])
    assert plain.returncode == 0 and plain.stdout.splitlines()[0] == "", plain.stderr

    root.run("apt-get remove -y -q gpuhook")
    assert not (root.path / "usr/bin/gpuhook").exists() and not (root.path / "usr/lib/gpuhook/lib").exists()
    (root.path / "var/log/gpuhook.log").write_text("a start\n")  # the hook's default log: gpuhook's
    (root.path / "run/gpuhook").mkdir()
    (root.path / "run/gpuhook/inventory.json").write_text("{}")
    root.run("apt-get purge -y -q gpuhook")
    assert not (root.path / "var/log/gpuhook.log").exists() and not (root.path / "run/gpuhook").exists()
    shutil.rmtree(root.path / "tmp/gpu")
    (root.path / "tmp" / deb.name).unlink()
    after = root.listing()
    assert sorted(after - before) == [] and sorted(before - after) == []
    assert (root.path / "etc/gpuhook/config.toml").read_text() == "# the user's\n"


@pytest.mark.parametrize("release", sorted(WHEEL_RELEASES))
def test_wheel_in_a_venv_writes_the_native_entry_without_a_compiler(make_root: Any, fake_driver: Any, dist: Path,
                                                                   release: str) -> None:
    root = make_root(release)
    root.no_compiler()
    (wheel,) = dist.glob("gpuhook-*-cp39-abi3-*manylinux_2_17_x86_64.whl")
    wheels = root.path / "tmp/wheels"
    build = build_module()
    python = root.python_version()
    glibc = GLIBC[python]
    build.dependency_wheels(wheel, python, glibc, wheels)
    shutil.copy(wheel, wheels)
    root.run("python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-index --find-links /tmp/wheels "
             f"/tmp/wheels/{wheel.name}")
    out = root.run("/opt/venv/bin/gpuhook hook install --path /usr/local/bin/gpuhook-hook").stdout
    assert out.splitlines() == ["gpuhook: wrote /usr/local/bin/gpuhook-hook",
                                "gpuhook: wrote /usr/local/bin/gpuhook-hook.py"]
    assert (root.path / "usr/local/bin/gpuhook-hook").read_bytes()[:4] == b"\x7fELF"
    assert_gpu_container(gpu_start(root, fake_driver, "/usr/local/bin/gpuhook-hook", ["NVIDIA_VISIBLE_DEVICES=0"]))

    # the venv deleted (an upgrade gone wrong): GPU starts fail in one line naming the fix, others still run
    shutil.rmtree(root.path / "opt/venv")
    refused = gpu_start(root, fake_driver, "/usr/local/bin/gpuhook-hook", ["NVIDIA_VISIBLE_DEVICES=0"])
    assert refused.returncode != 0 and FIX in refused.stderr
    plain = gpu_start(root, fake_driver, "/usr/local/bin/gpuhook-hook", ["PATH=/bin"])
    assert plain.returncode == 0, plain.stderr
    assert json.loads((root.path / "tmp/gpu/bundle/config.json").read_text())["hooks"]["prestart"]


PYENV = Path("/root/.pyenv/versions")


@pytest.mark.parametrize("minor", [9, 10, 11, 12, 13])
def test_one_abi3_wheel_serves_every_python(dist: Path, tmp_path: Path, minor: int) -> None:
    """The one cp39-abi3 wheel installs on CPython 3.9 to 3.13 as it is (nothing compiled: the venv's pip is
    given no compiler on PATH), its C helper loads, and `hook install` writes the native entry from it."""
    pythons = sorted(PYENV.glob(f"3.{minor}.*/bin/python3"))
    need(bool(pythons), f"no CPython 3.{minor} under {PYENV}")
    (wheel,) = dist.glob("gpuhook-*-cp39-abi3-*manylinux_2_17_x86_64.whl")
    with zipfile.ZipFile(wheel) as z:  # the licence, in the metadata and as the file
        info = next(n.rpartition("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in z.read(f"{info}/METADATA").decode()
        assert z.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
    venv = tmp_path / "venv"
    subprocess.run([str(pythons[-1]), "-m", "venv", str(venv)], check=True)
    no_cc = {**os.environ, "PATH": f"{venv}/bin:/usr/bin:/bin", "CC": "/nonexistent/cc"}
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--only-binary=:all:", str(wheel)], check=True, env=no_cc)
    probe = subprocess.run([str(venv / "bin/python"), "-c", "import gpuhook._native as n, sys; "
                            "print(n.__file__, sys.version_info[:2])"], capture_output=True, text=True, check=True)
    assert f"(3, {minor})" in probe.stdout
    out = subprocess.run([str(venv / "bin/gpuhook"), "hook", "install", "--path", str(tmp_path / "hook")],
                         capture_output=True, text=True, check=True, env=no_cc).stdout
    assert "note:" not in out
    assert (tmp_path / "hook").read_bytes()[:4] == b"\x7fELF"


def test_rpm_files_scripts_and_dependencies_then_installs_and_runs(make_root: Any, fake_driver: Any,
                                                                   dist: Path) -> None:
    """The RPM (RHEL 8/9: Python 3.9) checked as rpm reads it (its requirements, files, scriptlets), then
    installed with rpm into a Debian 11 root, which has the Python 3.9 it names but no rpm database of it (hence
    --nodeps, after the requirements were checked here): the commands run, the hook entry starts a GPU container on
    the simulated driver, and an erase leaves nothing of the package."""
    need_tool("rpm")
    (rpm,) = dist.glob("gpuhook-*-1.x86_64.rpm")
    query = lambda *q: subprocess.run(["rpm", "-qp", *q, str(rpm)], capture_output=True, text=True,  # noqa: E731
                                      check=True).stdout
    requires = {line.split(" ")[0] for line in query("--requires").splitlines() if not line.startswith("rpmlib(")}
    assert requires == {"/bin/sh", "/usr/bin/python3.9", "glibc"}, requires
    files = set(query("--list").splitlines())
    for path in ("/usr/bin/gpuhook", "/usr/bin/gpuhook-hook", "/usr/bin/gpuhook-hook.py", "/usr/bin/gpuhook-runtime",
                 "/usr/lib/systemd/system/gpuhook.socket", "/usr/lib/systemd/system/gpuhook-cdi-refresh.service",
                 "/usr/share/licenses/gpuhook/LICENSE", "/usr/share/man/man1/gpuhook.1.gz", "/usr/lib/gpuhook"):
        assert path in files, path
    assert not any(f in ("/usr", "/usr/bin", "/usr/lib", "/etc") or f.startswith("/etc/") for f in files)
    assert "License     : Apache-2.0" in query("--info")
    scripts = query("--scripts")
    assert "systemctl enable gpuhook.socket gpuhook-cdi-refresh.service" in scripts
    assert "systemctl disable --now gpuhook.socket gpuhook.service gpuhook-cdi-refresh.service" in scripts

    root = make_root("bullseye")
    root.no_compiler()
    assert root.python_version() == "3.9"
    subprocess.run(["rpm", "--root", str(root.path), "--initdb"], check=True)
    for folder in ("usr/lib/systemd/system", "usr/share/licenses"):  # a RHEL host's filesystem and systemd own these
        (root.path / folder).mkdir(parents=True, exist_ok=True)
    before = root.listing()
    installed = subprocess.run(["rpm", "--root", str(root.path), "-i", "--nodeps", str(rpm)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert root.run("gpuhook --version").stdout.startswith("gpuhook, version ")
    hook = root.path / "usr/bin/gpuhook-hook"
    assert hook.read_bytes()[:4] == b"\x7fELF" and MARKER.encode() in hook.read_bytes()
    assert os.readlink(root.path / "usr/lib/gpuhook/bin/python3") == "/usr/bin/python3.9"
    assert_gpu_container(gpu_start(root, fake_driver, "/usr/bin/gpuhook-hook", ["NVIDIA_VISIBLE_DEVICES=0"]))
    plain = gpu_start(root, fake_driver, "/usr/bin/gpuhook-hook", [])
    assert plain.returncode == 0, plain.stderr

    (root.path / "var/log/gpuhook.log").write_text("a start\n")  # the hook's default log: gpuhook's
    erased = subprocess.run(["rpm", "--root", str(root.path), "-e", "gpuhook"], capture_output=True, text=True)
    assert erased.returncode == 0, erased.stderr
    shutil.rmtree(root.path / "tmp/gpu")
    after = root.listing()
    assert sorted(after - before) == [] and sorted(before - after) == []


def test_aarch64_wheel_runs_its_native_code_under_qemu(dist: Path, tmp_path: Path) -> None:
    """The aarch64 wheel (cross-built, packaging/aarch64.py) is tagged manylinux_2_17_aarch64, and in an arm64
    root (Debian 12's Python, unpacked) run by qemu-user its C helper loads and works (an ELF read, a device node
    made by raw mknodat), its Python reads NVIDIA's config, and its static native entry runs and, with no Python
    entry beside it, says so in one line. Not covered here: an arm64 .deb, and a container start under emulation."""
    need_root()
    qemu = shutil.which("qemu-aarch64-static")
    need(qemu is not None, "needs qemu-user-static")
    arm = sorted(dist.glob("gpuhook-*-cp39-abi3-*manylinux_2_17_aarch64.whl"))
    assert len(arm) == 1, sorted(p.name for p in dist.iterdir())
    tarball = ROOTS / "bookworm-arm64.tar"
    need(tarball.is_file(), f"no arm64 root at {tarball}: run .ci/fetch-debian-roots")
    if importlib.util.find_spec("auditwheel") is not None:
        shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(arm[0])], capture_output=True,
                               text=True, check=True).stdout
        assert '"manylinux_2_17_aarch64"' in " ".join(shown.split())
    root, site = tmp_path / "arm64", tmp_path / "site"
    root.mkdir()
    subprocess.run(["tar", "-xf", str(tarball), "-C", str(root)], check=True)
    with zipfile.ZipFile(arm[0]) as z:
        z.extractall(site)
    entry = site / "gpuhook/_native/gpuhook-entry"
    entry.chmod(0o755)
    probe = f"""
import os, platform, stat, tempfile
from gpuhook import _native as nat
from gpuhook.hook.config import parse_config
info = nat.elf_info("{root}/lib/aarch64-linux-gnu/libc.so.6")
folder = tempfile.mkdtemp(dir="{tmp_path}")
fd = os.open(folder, os.O_RDONLY)
nat.mknodat(fd, "node", stat.S_IFCHR | 0o600, 511, 70000)
rdev = os.stat(folder + "/node").st_rdev
config = parse_config('[nvidia-container-cli]\\nroot = "/run/nvidia/driver"\\n')
print(platform.machine(), info.machine, info.soname, os.major(rdev), os.minor(rdev), config.driver_root)
"""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{root}/usr/lib/python3/dist-packages"}
    ran = subprocess.run([qemu, "-L", str(root), str(root / "usr/bin/python3.11"), "-c", probe],
                         capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["aarch64", "183", "libc.so.6", "511", "70000", "/run/nvidia/driver"]
    stranded = subprocess.run([qemu, str(entry), "--version"], capture_output=True, text=True, timeout=60,
                              env={"GPUHOOK_SERVICE_SOCKET": str(tmp_path / "none.sock")})
    assert stranded.returncode == 1
    assert stranded.stderr.splitlines() == [f"gpuhook-hook: cannot run the Python entry {entry}.py (No such file or "
                                            f"directory): {FIX}"], stranded.stderr


def test_arm64_deb_unpacked_in_an_arm64_root_runs_under_qemu(dist: Path, tmp_path: Path) -> None:
    """Debian 12's arm64 .deb (the aarch64 wheel and its dependencies' aarch64 wheels, vendored) unpacked into an
    arm64 root with its Python: under qemu-user the vendored binary modules load, `gpuhook --version` answers, and
    the package's native entry is arm64 and runs. apt, the maintainer scripts and a container start are not run:
    without binfmt_misc only the program qemu is handed runs emulated, nothing it execs."""
    need_root()
    qemu = shutil.which("qemu-aarch64-static")
    need(qemu is not None, "needs qemu-user-static")
    (deb,) = dist.glob("gpuhook_*+deb12_arm64.deb")
    control = subprocess.run(["dpkg-deb", "-f", str(deb), "Architecture", "Depends"], capture_output=True,
                             text=True, check=True).stdout
    assert control.splitlines() == ["Architecture: arm64", "Depends: python3.11, libc6"]
    tarball = ROOTS / "bookworm-arm64.tar"
    need(tarball.is_file(), f"no arm64 root at {tarball}: run .ci/fetch-debian-roots")
    root = tmp_path / "arm64"
    root.mkdir()
    subprocess.run(["tar", "-xf", str(tarball), "-C", str(root)], check=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    site = root / "usr/lib/gpuhook/lib/python3.11/site-packages"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}

    def python(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([qemu, "-L", str(root), str(root / "usr/bin/python3.11"), *args],
                              capture_output=True, text=True, env=env, timeout=180)

    loaded = python("-c", "import platform, psutil, yaml, _cffi_backend, rpds, gpuhook._native; "
                          "print(platform.machine(), yaml.__with_libyaml__ or 'pure', psutil.cpu_count() > 0)")
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split()[0] == "aarch64" and loaded.stdout.split()[2] == "True"
    version = python("-m", "gpuhook.cli", "--version")
    assert version.returncode == 0 and version.stdout.startswith("gpuhook, version "), version.stderr
    hook = root / "usr/bin/gpuhook-hook"  # the package's native entry: arm64, and it runs
    elf = hook.read_bytes()
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183 and MARKER.encode() in elf
    ran = subprocess.run([qemu, str(hook), "--version"], capture_output=True, text=True, timeout=60,
                         env={"GPUHOOK_SERVICE_SOCKET": str(tmp_path / "none.sock")})
    # its Python entry's interpreter is the package's /usr/lib/gpuhook/bin/python3, which only an arm64 host has
    assert ran.returncode == 1 and ran.stderr.startswith(f"gpuhook-hook: cannot run the Python entry {hook}.py ")
    assert FIX in ran.stderr
