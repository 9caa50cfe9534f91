"""Compiling the fake driver's ELF files with gcc, once: a content-addressed cache keyed by source and flags.

Only the NVML mock's GPU table is compiled per fake driver (it carries the root path); everything else is
copied from the cache, so a warm build spends its time on file system calls, not on gcc.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuhook.errors import GpuhookError
from gpuhook.model.record import Record

CSRC = Path(__file__).with_name("csrc")


class CompileError(GpuhookError):
    """gcc failed or is missing: one line saying what to install (the packages ship no compiler)."""


def cache_dir() -> Path:
    """$GPUHOOK_FAKEDRIVER_CACHE, else $XDG_CACHE_HOME/gpuhook-fakedriver, else /tmp (per user)."""
    explicit = os.environ.get("GPUHOOK_FAKEDRIVER_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "gpuhook-fakedriver"
    return Path(tempfile.gettempdir()) / f"gpuhook-fakedriver-cache-{os.getuid()}"


@functools.cache
def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _gcc() -> str:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise CompileError("the simulated driver's libraries are built here with a C compiler, and there is no gcc "
                           "(or cc) on PATH: install one (Debian, Ubuntu: apt-get install gcc libc6-dev; "
                           "RHEL: dnf install gcc)")
    return gcc


def run_gcc(args: Sequence[str]) -> None:
    proc = subprocess.run([_gcc(), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CompileError(f"gcc {' '.join(args)} failed:\n{proc.stderr.strip()}")


@functools.cache
def gcc_supports_m32() -> bool:
    """Whether `gcc -m32` can link a shared library here (gcc-multilib installed)."""
    with tempfile.TemporaryDirectory(prefix="gpuhook-m32-") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int gpuhook_probe(void) { return 32; }\n")
        try:
            run_gcc(["-m32", "-shared", "-fPIC", "-o", str(Path(tmp) / "probe.so"), str(src)])
        except CompileError:
            return False
    return True


class Artifact(Record):
    """One cached compiler output. `kind`: stub, cuda, nvml-core, tool, smi."""

    kind: str
    file_name: str
    bits: int = 64
    soname: str = ""
    defines: tuple[tuple[str, str], ...] = ()
    deps: tuple[Artifact, ...] = ()  # shared libraries linked in (DT_NEEDED their sonames)

    @functools.cached_property
    def key(self) -> str:
        parts = [_sources_digest(), self.kind, self.file_name, str(self.bits), self.soname, repr(self.defines)]
        parts += [d.key for d in self.deps]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]

    @property
    def path(self) -> Path:
        return cache_dir() / self.key[:2] / self.key / self.file_name

    def gcc_args(self, output: Path) -> list[str]:
        flags = [f"-m{self.bits}", "-O1", "-Wall", f"-I{CSRC}"]
        flags += [f"-D{name}={value}" for name, value in self.defines]
        out = ["-o", str(output)]
        if self.kind == "nvml-core":
            return [*flags, "-c", "-fPIC", "-fvisibility=hidden", str(CSRC / "nvml.c"), *out]
        if self.kind in ("tool", "smi"):
            source = "tool.c" if self.kind == "tool" else "nvidia_smi.c"
            return [*flags, "-s", str(CSRC / source), *out, "-ldl"]
        source = "cuda.c" if self.kind == "cuda" else "stub.c"
        return [
            *flags,
            "-shared",
            "-fPIC",
            "-s",
            "-fvisibility=hidden",
            *([f"-Wl,-soname,{self.soname}"] if self.soname else []),  # libnvidia-vulkan-producer has none
            "-Wl,-Bsymbolic",
            "-Wl,--no-as-needed",
            str(CSRC / source),
            *(str(d.path) for d in self.deps),
            *out,
        ]


def c_string(value: str) -> str:
    """A C string literal (for a -D define or generated source); non-ASCII bytes become octal escapes."""
    out = []
    for byte in value.encode():
        char = chr(byte)
        if char in '\\"':
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _build_one(artifact: Artifact) -> None:
    final = artifact.path
    if final.exists():
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build-") as tmp:
        out = Path(tmp) / artifact.file_name
        run_gcc(artifact.gcc_args(out))
        os.replace(out, final)  # atomic: concurrent builders race harmlessly


def ensure_built(artifacts: Iterable[Artifact]) -> None:
    """Build what the cache lacks, dependencies first, in parallel."""
    pending = {a.key: a for a in _with_deps(artifacts) if not a.path.exists()}
    with ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 2) * 2)) as pool:
        while pending:
            ready = [a for a in pending.values() if all(d.key not in pending for d in a.deps)]
            list(pool.map(_build_one, ready))
            for a in ready:
                del pending[a.key]


def _with_deps(artifacts: Iterable[Artifact]) -> list[Artifact]:
    seen: dict[str, Artifact] = {}
    stack = list(artifacts)
    while stack:
        a = stack.pop()
        if a.key not in seen:
            seen[a.key] = a
            stack.extend(a.deps)
    return list(seen.values())


def link_nvml(core: Artifact, table_source: str, output: Path) -> None:
    """Link the cached NVML core with this fake's GPU table into libnvidia-ml.so.<ver>."""
    with tempfile.TemporaryDirectory(prefix="gpuhook-nvml-") as tmp:
        table = Path(tmp) / "table.c"
        table.write_text(table_source, encoding="ascii")
        run_gcc(
            [
                f"-m{core.bits}",
                "-O1",
                f"-I{CSRC}",
                "-shared",
                "-fPIC",
                "-s",
                "-fvisibility=hidden",
                "-Wl,-soname,libnvidia-ml.so.1",
                "-Wl,-Bsymbolic",
                "-Wl,--no-as-needed",
                str(table),
                str(core.path),
                "-o",
                str(output),
                "-lpthread",
            ]
        )
