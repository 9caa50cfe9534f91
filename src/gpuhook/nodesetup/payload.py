"""The files node-setup puts under the host prefix: this image's own Python (interpreter, standard library, the
site-packages gpuhook runs from, and every shared library they load, with the image's dynamic loader), so the
host needs no Python of its own and no host upgrade can strand the hook.

Each image's payload is a release of its own, P/releases/<id> (the id a digest of what it holds), and P/bin
is a link to the current release's bin/, replaced by one rename: a hook that starts during an upgrade runs
wholly the old release or wholly the new one, because every script names its own release's files. Layout
under a release R (all host paths):
  R/libexec/pythonX.Y      the image's interpreter binary, never run directly
  R/lib/ld/                the image's loader (ld-linux-*.so.*) and the libraries the payload links against
  R/lib/pythonX.Y/         the standard library; site-packages/ inside it holds gpuhook and its dependencies
  R/bin/python3            `exec R/lib/ld/<loader> --argv0 R/bin/python3 --library-path R/lib/ld R/libexec/pythonX.Y`:
                           the loader runs the interpreter against the payload's libraries only (the host's
                           ld.so.cache is never consulted for them), and Python finds its prefix R from argv0
                           (its release's own path, also when run as P/bin/python3 through the link)
  R/bin/gpuhook            the command line, a `#!R/bin/python3 -IS` script
  R/bin/gpuhook-hook(.py)  the hook entry, as `gpuhook hook install` writes it, for R/bin/python3
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence

from gpuhook.errors import GpuhookError
from gpuhook.model.record import Record

# Parts of the standard library and of the image's environment the host never runs (about half the size).
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "site-packages",
               "dist-packages", "venv", "unittest", "distutils"}
SITE_SKIP = re.compile(r"^(pip|setuptools|_distutils_hack|wheel|pkg_resources|grpc\w*|google|protobuf|"
                       r"__editable__\w*|distutils-precedence\.pth|(pip|setuptools|wheel|grpc\w*|protobuf)-.*\.dist-info)$")
PT_INTERP = 3


class Source(Record):
    """Where this image's Python and gpuhook are."""

    interpreter: str  # the real interpreter binary
    stdlib: str  # the standard library folder (lib-dynload inside it, as Debian and python.org lay it out)
    dynload: str  # the extension modules of the standard library
    site: tuple[str, ...]  # site-packages folders of the environment gpuhook runs from
    package: str  # the gpuhook package folder (a source tree for an editable install)
    native_entry: str | None  # the static native hook entry, when built
    version: str  # "3.11"

    @classmethod
    def this(cls, native_entry: str | None) -> Source:
        import gpuhook

        paths = sysconfig.get_paths()
        site = tuple(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"]) if os.path.isdir(p)))
        return cls(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable),
                   paths["stdlib"], sysconfig.get_config_var("DESTSHARED") or os.path.join(paths["stdlib"],
                                                                                           "lib-dynload"),
                   site, os.path.dirname(os.path.abspath(gpuhook.__file__ or "")), native_entry,
                   f"{sys.version_info[0]}.{sys.version_info[1]}")


def release_id(source: Source) -> str:
    """What names this image's payload: a digest of gpuhook's files, the names of its dependencies' folders
    (their versions) and the interpreter's version and size, so a restarted pod of the same image finds its
    release already there and an upgrade gets a new one."""
    digest = hashlib.sha256(f"{source.version}\0{os.path.getsize(source.interpreter)}\0".encode())
    for folder, dirs, files in os.walk(source.package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so", ".json", ".proto")) or name == "gpuhook-entry":
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, source.package).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
    for folder in source.site:
        digest.update("\0".join(sorted(n for n in os.listdir(folder) if n.endswith(".dist-info"))).encode())
    if source.native_entry:
        with open(source.native_entry, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()[:16]


class Layout(Record):
    prefix: str  # host path

    def path(self, *parts: str) -> str:
        return os.path.join(self.prefix, *parts)

    def python(self) -> str:
        return self.path("bin", "python3")

    def hook(self) -> str:
        return self.path("bin", "gpuhook-hook")

    def gpuhook(self) -> str:
        return self.path("bin", "gpuhook")

    def site(self, version: str) -> str:
        return self.path("lib", f"python{version}", "site-packages")

    def hook_config(self) -> str:
        return self.path("etc", "config.toml")


def interp_of(path: str) -> str:
    """An ELF executable's PT_INTERP (its dynamic loader)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            raise GpuhookError(f"{path} is not a 64-bit ELF executable")
        end = "<" if head[5] == 1 else ">"
        phoff, = struct.unpack_from(end + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
        for i in range(min(phnum, 64)):
            f.seek(phoff + i * phentsize)
            ptype, _flags, offset, _va, _pa, filesz = struct.unpack(end + "IIQQQQ", f.read(40))
            if ptype == PT_INTERP and 0 < filesz < 4096:
                f.seek(offset)
                return f.read(filesz).rstrip(b"\0").decode()
    raise GpuhookError(f"{path} has no dynamic loader (PT_INTERP)")


_LIST_LINE = re.compile(r"^\s*(\S+) => (/\S+) \(0x[0-9a-f]+\)$")


def libraries(loader: str, elves: Sequence[str]) -> dict[str, str]:
    """name -> real path of every shared library `elves` load, as the image's loader resolves them."""
    found: dict[str, str] = {}
    for elf in elves:
        out = subprocess.run([loader, "--list", elf], capture_output=True, text=True, timeout=60, check=False)
        if out.returncode != 0:
            raise GpuhookError(f"{loader} --list {elf} failed: {(out.stderr.strip() or out.stdout.strip())[-300:]}")
        for line in out.stdout.splitlines():
            match = _LIST_LINE.match(line)
            if match:
                found.setdefault(match.group(1), os.path.realpath(match.group(2)))
    return found


def _walk(top: str, skip: Callable[[str], bool]) -> Iterator[tuple[str, list[str]]]:
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not skip(d))
        yield folder, sorted(f for f in files if not skip(f))


def copy_tree(src: str, dest: str, skip: Callable[[str], bool]) -> list[str]:
    """Copy `src` into `dest` (links kept as links), leaving out names `skip` says; returns the ELF files."""
    elves = []
    for folder, files in _walk(src, skip):
        out = os.path.join(dest, os.path.relpath(folder, src))
        os.makedirs(out, exist_ok=True)
        for name in files:
            source, target = os.path.join(folder, name), os.path.join(out, name)
            if os.path.islink(source):
                os.symlink(os.readlink(source), target)
                continue
            shutil.copy2(source, target)
            if name.endswith(".so") or ".so." in name:
                elves.append(target)
    return elves


def wrapper(layout: Layout, loader_name: str, version: str) -> str:
    ld = layout.path("lib", "ld")
    return ("#!/bin/sh\n"
            "# gpuhook's own Python, run by its own loader against its own libraries (node-setup, docs/deploy.md)\n"
            f'exec {ld}/{loader_name} --argv0 {layout.python()} --library-path {ld} '
            f'{layout.path("libexec", "python" + version)} "$@"\n')


def cli_script(layout: Layout, version: str) -> str:
    return (f"#!{layout.python()} -IS\n"
            "import sys\n"
            f"sys.path += [{layout.site(version)!r}]\n"
            "from gpuhook.cli import run\n"
            "run()\n")


def build(source: Source, layout: Layout, real_prefix: str,
          entry_script: Callable[[str, Sequence[str]], str]) -> dict[str, int]:
    """Write the payload into `real_prefix` (where the host's prefix is seen from here); returns the disk
    used in bytes per part ("total": all of it, each part counted once)."""
    v = source.version
    lib = os.path.join(real_prefix, "lib")
    os.makedirs(os.path.join(real_prefix, "libexec"), exist_ok=True)
    interpreter = os.path.join(real_prefix, "libexec", "python" + v)
    shutil.copy2(source.interpreter, interpreter)
    stdlib = os.path.join(lib, "python" + v)
    elves = copy_tree(source.stdlib, stdlib, lambda n: n in STDLIB_SKIP)
    if not source.dynload.startswith(source.stdlib.rstrip("/") + "/"):  # a distribution that keeps them apart
        elves += copy_tree(source.dynload, os.path.join(stdlib, "lib-dynload"), lambda n: False)
    site = os.path.join(stdlib, "site-packages")
    for folder in source.site:
        elves += copy_tree(folder, site, lambda n: bool(SITE_SKIP.match(n)) or n == "gpuhook")
    elves += copy_tree(source.package, os.path.join(site, "gpuhook"),
                       lambda n: n == "__pycache__" or n.endswith(".c") or n.endswith(".h") or n == "csrc")
    loader = interp_of(source.interpreter)
    ld = os.path.join(lib, "ld")
    os.makedirs(ld)
    shutil.copy2(os.path.realpath(loader), os.path.join(ld, os.path.basename(loader)))
    for name, path in libraries(loader, [source.interpreter, *elves]).items():
        if not os.path.exists(os.path.join(ld, name)):
            shutil.copy2(path, os.path.join(ld, name))
    bindir = os.path.join(real_prefix, "bin")
    os.makedirs(bindir)
    _write(os.path.join(bindir, "python3"), wrapper(layout, os.path.basename(loader), v))
    _write(os.path.join(bindir, "gpuhook"), cli_script(layout, v))
    text = entry_script(layout.python(), [layout.site(v)])
    hook = os.path.join(bindir, "gpuhook-hook")
    if source.native_entry:
        _write(hook + ".py", text)
        shutil.copyfile(source.native_entry, hook)
        os.chmod(hook, 0o755)
    else:
        _write(hook, text)
    sizes = {part: du(os.path.join(real_prefix, *part.split("/")))
             for part in ("libexec", f"lib/python{v}", f"lib/python{v}/site-packages", "lib/ld", "bin")}
    sizes["total"] = du(real_prefix)
    return sizes


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


def du(path: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            total += st.st_blocks * 512
    return total
