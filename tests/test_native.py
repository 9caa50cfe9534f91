"""gpuhook._native: ld.so.cache and ELF parsing checked against glibc's ldconfig and binutils' readelf,
hostile input, and the syscall/bpf wrappers exercised for real (root) in throwaway namespaces."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support.e2e import need_root
from support.runc import run_in_child

from gpuhook import _native as nat

LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"
READELF = shutil.which("readelf")
GCC = shutil.which("gcc")
HOST_CACHE = Path("/etc/ld.so.cache")
EM_386, EM_X86_64 = 3, 62

needs_gcc = pytest.mark.skipif(GCC is None, reason="needs gcc")
needs_readelf = pytest.mark.skipif(READELF is None, reason="needs readelf (binutils)")
needs_ldconfig = pytest.mark.skipif(not os.path.exists(LDCONFIG), reason="needs glibc's ldconfig")


# --- helpers --------------------------------------------------------------------------------------------


def ldconfig_print(cache: Path) -> list[tuple[str, str, str]]:
    """(key, label without hwcap, value) for each entry, as `ldconfig -p -C cache` prints them."""
    out = subprocess.run([LDCONFIG, "-p", "-C", str(cache)], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"^\t(.*) \((.*)\) => (.*)$", line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3)))
    return rows


def as_rows(entries: list[nat.LdCacheEntry]) -> list[tuple[str, str, str]]:
    return [(e.key, nat.flags_label(e.flags) + (", hwcap" if e.hwcap else ""), e.value) for e in entries]


def strip_hwcap(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return [(k, label.split(", hwcap:")[0] + (", hwcap" if ", hwcap:" in label else ""), v) for k, label, v in rows]


def gcc(*args: str) -> None:
    subprocess.run([GCC or "gcc", *args], check=True, capture_output=True)


def gcc_m32_works(tmp: Path) -> bool:
    src = tmp / "probe32.c"
    src.write_text("int probe(void) { return 32; }\n")
    r = subprocess.run([GCC or "gcc", "-m32", "-shared", "-nostdlib", "-fPIC", "-o", str(tmp / "probe32.so"),
                        str(src)], capture_output=True)  # fmt: skip
    return r.returncode == 0


def readelf_soname(path: Path) -> str | None:
    out = subprocess.run([READELF or "readelf", "-d", str(path)], capture_output=True, text=True).stdout
    m = re.search(r"Library soname: \[(.*)\]", out)
    return m.group(1) if m else None


# --- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """gcc-built libraries in a fake root, plus the ld.so.cache ldconfig writes for it."""
    if GCC is None or not os.path.exists(LDCONFIG):
        pytest.skip("needs gcc and ldconfig")
    tmp = tmp_path_factory.mktemp("native-libs")
    root = tmp / "root"
    lib64, lib32 = root / "opt/gh/lib64", root / "opt/gh/lib32"
    lib64.mkdir(parents=True)
    (root / "etc").mkdir()
    src = tmp / "f.c"
    src.write_text("int gh_answer(void) { return 42; }\n")
    out = {"root": root}
    out["soname64"] = lib64 / "libgh_a.so.1.2.3"
    gcc("-shared", "-fPIC", "-Wl,-soname,libgh_a.so.1", "-o", str(out["soname64"]), str(src))
    out["nosoname64"] = lib64 / "libgh_nosoname.so"
    gcc("-shared", "-fPIC", "-o", str(out["nosoname64"]), str(src))
    exe_src = tmp / "main.c"
    exe_src.write_text("int main(void) { return 0; }\n")
    out["exe"] = tmp / "exe"
    gcc("-o", str(out["exe"]), str(exe_src))
    dirs = [str(lib64)]
    if gcc_m32_works(tmp):
        lib32.mkdir(parents=True)
        out["soname32"] = lib32 / "libgh32.so.1.0"
        gcc("-m32", "-shared", "-nostdlib", "-fPIC", "-Wl,-soname,libgh32.so.1", "-o", str(out["soname32"]), str(src))
        out["nosoname32"] = lib32 / "libgh32_nosoname.so"
        gcc("-m32", "-shared", "-nostdlib", "-fPIC", "-o", str(out["nosoname32"]), str(src))
        dirs.append(str(lib32))
    (root / "etc/ld.so.conf").write_text("".join(d[len(str(root)) :] + "\n" for d in dirs))
    subprocess.run([LDCONFIG, "-r", str(root)], check=True, capture_output=True)
    out["cache"] = root / "etc/ld.so.cache"
    return out


# --- ld.so.cache ----------------------------------------------------------------------------------------


@needs_ldconfig
@pytest.mark.skipif(not HOST_CACHE.exists(), reason="host has no /etc/ld.so.cache")
def test_host_cache_matches_ldconfig() -> None:
    data = HOST_CACHE.read_bytes()  # one snapshot: apt may rewrite the cache meanwhile
    snapshot = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpuhook-test-cache-{os.getpid()}"
    snapshot.write_bytes(data)
    try:
        expected = strip_hwcap(ldconfig_print(snapshot))
    finally:
        snapshot.unlink()
    entries = nat.parse_ldcache(data, str(HOST_CACHE))
    assert expected, "ldconfig printed no entries"
    assert as_rows(entries) == expected


@needs_ldconfig
def test_read_ldcache_on_host_has_libc() -> None:
    entries = nat.read_ldcache(HOST_CACHE)
    libc = [e for e in entries if e.key == "libc.so.6" and nat.is_64bit_x86_64(e.flags)]
    if os.uname().machine == "x86_64":
        assert libc and os.path.exists(libc[0].value)


def test_built_cache_matches_ldconfig(libs: dict[str, Path]) -> None:
    entries = nat.read_ldcache(libs["cache"])
    assert as_rows(entries) == strip_hwcap(ldconfig_print(libs["cache"]))
    by_key = {e.key: e for e in entries}
    a = by_key["libgh_a.so.1"]
    assert a.value == "/opt/gh/lib64/libgh_a.so.1"
    assert nat.is_64bit_x86_64(a.flags) and not nat.is_32bit_i386(a.flags)
    assert nat.flags_label(a.flags) == "libc6,x86-64"
    assert by_key["libgh_nosoname.so"].value == "/opt/gh/lib64/libgh_nosoname.so"
    if "soname32" in libs:
        e32 = by_key["libgh32.so.1"]
        assert e32.value == "/opt/gh/lib32/libgh32.so.1"
        assert nat.is_32bit_i386(e32.flags) and not nat.is_64bit_x86_64(e32.flags)


def _ldconfig_format(libs: dict[str, Path], fmt: str, name: str) -> Path | None:
    r = subprocess.run([LDCONFIG, "-r", str(libs["root"]), "-c", fmt, "-C", f"/etc/{name}"], capture_output=True)
    path = libs["root"] / "etc" / name
    return path if r.returncode == 0 and path.exists() else None


@pytest.mark.parametrize("fmt", ["compat", "old"])
def test_ldconfig_legacy_formats(libs: dict[str, Path], fmt: str) -> None:
    """`ldconfig -c compat` (old table, then the new format aligned) and `-c old` where glibc still has them."""
    cache = _ldconfig_format(libs, fmt, f"ld.so.cache.{fmt}")
    if cache is None:
        pytest.skip(f"this ldconfig cannot write the {fmt} format")
    data = cache.read_bytes()
    assert data.startswith(b"ld.so-1.7.0")
    entries = nat.parse_ldcache(data, str(cache))
    assert as_rows(entries) == strip_hwcap(ldconfig_print(cache))
    assert [(e.key, e.value) for e in entries] == [(e.key, e.value) for e in nat.read_ldcache(libs["cache"])]


def old_format(rows: list[tuple[int, str, str]]) -> bytes:
    """An ld.so-1.7.0 cache: header, 12-byte entries, then strings addressed from the end of the entries."""
    strings = b""
    table = b""
    for flags, key, value in rows:
        koff = len(strings)
        strings += key.encode() + b"\0"
        voff = len(strings)
        strings += value.encode() + b"\0"
        table += struct.pack("<iII", flags, koff, voff)
    return b"ld.so-1.7.0\0" + struct.pack("<I", len(rows)) + table + strings


def compat_format(old_rows: list[tuple[int, str, str]], new: bytes) -> bytes:
    """Old-format entries followed (8-byte aligned) by a complete new-format cache, as glibc's compat."""
    head = old_format([])[:12] + struct.pack("<I", len(old_rows))
    table = b"".join(struct.pack("<iII", f, 0, 0) for f, _, _ in old_rows)
    pad = b"\0" * (-(len(head) + len(table)) % 8)
    return head + table + pad + new


def test_synthetic_old_and_compat(libs: dict[str, Path]) -> None:
    rows = [(0x0303, "libx.so.1", "/usr/lib/libx.so.1"), (0x0003, "liby.so.2", "/usr/lib32/liby.so.2")]
    old = nat.parse_ldcache(old_format(rows))
    assert [(e.flags, e.key, e.value) for e in old] == rows
    assert all(e.hwcap == 0 for e in old)
    new = libs["cache"].read_bytes()
    for n_old in (0, 1, 2, 3):  # every padding length in front of the new header
        compat = nat.parse_ldcache(compat_format(rows[:1] * n_old, new))
        assert compat == nat.parse_ldcache(new)


def test_empty_old_format() -> None:
    assert nat.parse_ldcache(old_format([])) == []


def test_truncated_cache_is_valueerror_or_unchanged(libs: dict[str, Path]) -> None:
    """Every prefix either fails cleanly or (cut only past the strings) parses to the very same entries."""
    data = libs["cache"].read_bytes()
    full = nat.parse_ldcache(data)
    ok = 0
    for n in range(len(data)):
        try:
            got = nat.parse_ldcache(data[:n], "cut")
        except ValueError as e:
            assert str(e).startswith("cut: ")
            continue
        assert got == full
        ok += 1
    assert ok < len(data) // 2


def test_mutated_cache_never_crashes(libs: dict[str, Path]) -> None:
    data = libs["cache"].read_bytes()
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(5000):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        try:
            for e in nat.parse_ldcache(bytes(buf), "mutated"):
                assert isinstance(e.key, str) and isinstance(e.value, str)
            outcomes["ok"] += 1
        except ValueError as e:
            assert str(e).startswith("mutated: ")
            outcomes["error"] += 1
    assert outcomes["error"] > 0 and outcomes["ok"] > 0


def _set32(data: bytes, off: int, value: int) -> bytes:
    return data[:off] + struct.pack("<I", value) + data[off + 4 :]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"", "unknown magic"),
        (lambda d: b"\0" * 64, "unknown magic"),
        (lambda d: d[:30], "truncated"),
        (lambda d: d[:17] + b"9.9" + d[20:], "unsupported cache version"),
        (lambda d: _set32(d, 20, 0xFFFFFFFF), "header claims 4294967295 entries"),
        (lambda d: _set32(d, 48 + 4, 0xFFFFFFF0), "entry 0: key offset"),
        (lambda d: _set32(d, 48 + 8, 0), "entry 0: value offset"),  # points into the header
        (lambda d: d[:28] + b"\x03" + d[29:], "big-endian"),
        (lambda d: d[:28] + b"\x07" + d[29:], "invalid endianness"),
        (lambda d: _set32(d, 48 + 4, len(d)) + b"X", "unterminated"),  # key runs into the end of the file
    ],
)
def test_corrupt_cache_messages(libs: dict[str, Path], mutate: Callable[[bytes], bytes], message: str) -> None:
    data = libs["cache"].read_bytes()
    with pytest.raises(ValueError, match=rf"^bad\.cache: .*{re.escape(message)}"):
        nat.parse_ldcache(mutate(data), "bad.cache")


def test_old_format_bounds() -> None:
    good = old_format([(0x0303, "liba.so.1", "/lib/liba.so.1")])
    assert len(nat.parse_ldcache(good)) == 1
    with pytest.raises(ValueError, match="claims 1000 entries"):
        nat.parse_ldcache(_set32(good, 12, 1000))
    with pytest.raises(ValueError, match="entry 1: key offset"):  # room for 2, but the second is strings
        nat.parse_ldcache(_set32(good, 12, 2))
    with pytest.raises(ValueError, match="key offset"):
        nat.parse_ldcache(good[:16] + struct.pack("<iII", 0x0303, 999, 0) + good[28:])
    with pytest.raises(ValueError, match="truncated"):
        nat.parse_ldcache(good[:13])


def test_read_ldcache_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        nat.read_ldcache(tmp_path / "missing")
    garbage = tmp_path / "garbage"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(garbage))}: not an ld.so cache"):
        nat.read_ldcache(garbage)


def test_random_bytes_never_crash() -> None:
    rng = random.Random(99)
    prefixes = [b"", b"ld.so-1.7.0\0", b"glibc-ld.so.cache1.1"]
    for _ in range(3000):
        blob = rng.choice(prefixes) + rng.randbytes(rng.randrange(200))
        with contextlib.suppress(ValueError):
            nat.parse_ldcache(blob)


# --- ELF ------------------------------------------------------------------------------------------------


@needs_readelf
@needs_ldconfig
def test_soname_matches_readelf_on_host_libs() -> None:
    seen: set[str] = set()
    paths = []
    for e in nat.read_ldcache(HOST_CACHE):
        real = os.path.realpath(e.value)
        if real not in seen and os.path.isfile(real):
            seen.add(real)
            paths.append(Path(real))
    rng = random.Random(7)
    sample = rng.sample(paths, min(40, len(paths)))
    sample += [Path(p) for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libm.so.6")
               if os.path.exists(p)]  # fmt: skip
    assert sample
    for path in sample:
        info = nat.elf_info(path)
        assert info.soname == readelf_soname(path), path
        assert info.elf_class in (32, 64)


def test_host_libc() -> None:
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    if not libc.exists():
        pytest.skip("not an x86-64 Debian-style host")
    assert nat.elf_info(libc) == nat.ElfInfo(64, EM_X86_64, "libc.so.6")


@needs_readelf
def test_built_libs(libs: dict[str, Path]) -> None:
    assert nat.elf_info(libs["soname64"]) == nat.ElfInfo(64, EM_X86_64, "libgh_a.so.1")
    assert nat.elf_info(libs["nosoname64"]) == nat.ElfInfo(64, EM_X86_64, None)
    assert nat.elf_info(libs["exe"]).soname is None
    for key in ("soname64", "nosoname64", "exe", "soname32", "nosoname32"):
        if key in libs:
            assert nat.elf_info(libs[key]).soname == readelf_soname(libs[key])
            assert nat.elf_info_bytes(libs[key].read_bytes()) == nat.elf_info(libs[key])
    if "soname32" in libs:
        assert nat.elf_info(libs["soname32"]) == nat.ElfInfo(32, EM_386, "libgh32.so.1")
        assert nat.elf_info(libs["nosoname32"]) == nat.ElfInfo(32, EM_386, None)


def test_static_binary_has_no_soname() -> None:
    for candidate in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.exists(candidate):
            assert nat.elf_info(candidate).soname is None
            return
    pytest.skip("no busybox")


def test_not_elf(tmp_path: Path) -> None:
    text = tmp_path / "text"
    text.write_text("hello, not an ELF file\n")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    for path in (text, empty):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not an ELF file$"):
            nat.elf_info(path)
    with pytest.raises(ValueError, match="not a regular file"):
        nat.elf_info(tmp_path)
    with pytest.raises(FileNotFoundError) as exc:
        nat.elf_info(tmp_path / "missing")
    assert exc.value.filename == str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"^<bytes>: not an ELF file$"):
        nat.elf_info_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="data encoding 2"):
        nat.elf_info_bytes(b"\x7fELF\x02\x02\x01" + b"\0" * 57)
    with pytest.raises(ValueError, match="unsupported ELF class 9"):
        nat.elf_info_bytes(b"\x7fELF\x09\x01\x01" + b"\0" * 57)


def test_truncated_elf_is_valueerror_or_unchanged(libs: dict[str, Path]) -> None:
    data = libs["soname64"].read_bytes()
    full = nat.elf_info_bytes(data)
    for n in range(len(data)):
        try:
            got = nat.elf_info_bytes(data[:n], "cut")
        except ValueError as e:
            assert str(e).startswith("cut: ")
            continue
        assert got == full, n


def test_mutated_elf_never_crashes(libs: dict[str, Path]) -> None:
    data = libs["soname64"].read_bytes()
    # Mutate where it matters: the ELF header, program headers and the dynamic section's neighbourhood.
    hot = list(range(0, 64)) + list(range(64, 64 + 56 * 12))
    rng = random.Random(4321)
    errors = 0
    for _ in range(4000):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            buf[rng.choice(hot) if rng.random() < 0.7 else rng.randrange(len(buf))] = rng.randrange(256)
        try:
            info = nat.elf_info_bytes(bytes(buf))
            assert info.soname is None or isinstance(info.soname, str)
        except ValueError:
            errors += 1
    assert errors > 0


def test_elf32_soname_bounds() -> None:
    """A hand-made ELF32 whose DT_STRTAB points outside every PT_LOAD, then one with a good mapping."""

    def elf32(strtab_vaddr: int, soname_off: int, strsz: int) -> bytes:
        ehdr = b"\x7fELF\x01\x01\x01" + b"\0" * 9
        ehdr += struct.pack("<HHIIIIIHHHHHH", 3, EM_386, 1, 0, 52, 0, 0, 52, 32, 2, 0, 0, 0)
        strings = b"\0libfake.so.7\0"
        dyn_off = 52 + 2 * 32
        dyn = struct.pack("<iIiIiIiI", 5, strtab_vaddr, 10, strsz, 14, soname_off, 0, 0)
        str_off = dyn_off + len(dyn)
        size = str_off + len(strings)
        load = struct.pack("<IIIIIIII", 1, 0, 0x1000, 0x1000, size, size, 5, 0x1000)
        dynamic = struct.pack("<IIIIIIII", 2, dyn_off, 0x1000 + dyn_off, 0, len(dyn), len(dyn), 6, 4)
        return ehdr + load + dynamic + dyn + strings

    good = elf32(0x1000 + 52 + 64 + 32, 1, 14)
    assert nat.elf_info_bytes(good) == nat.ElfInfo(32, EM_386, "libfake.so.7")
    with pytest.raises(ValueError, match="not inside any PT_LOAD"):
        nat.elf_info_bytes(elf32(0x9000, 1, 14))
    with pytest.raises(ValueError, match="beyond DT_STRSZ"):
        nat.elf_info_bytes(elf32(0x1000 + 52 + 64 + 32, 20, 14))
    with pytest.raises(ValueError, match="unterminated"):
        nat.elf_info_bytes(elf32(0x1000 + 52 + 64 + 32, 1, 5))


# --- syscalls -------------------------------------------------------------------------------------------


def test_constants() -> None:
    assert nat.MS_BIND == 4096 and nat.MS_REC == 16384 and nat.MNT_DETACH == 2
    assert nat.CLONE_NEWNS == 0x20000 and nat.O_PATH == os.O_PATH
    assert (nat.OPEN_TREE_CLONE, nat.AT_RECURSIVE, nat.MOVE_MOUNT_F_EMPTY_PATH) == (1, 0x8000, 4)
    assert (nat.RESOLVE_NO_XDEV, nat.RESOLVE_NO_MAGICLINKS, nat.RESOLVE_NO_SYMLINKS, nat.RESOLVE_BENEATH,
            nat.RESOLVE_IN_ROOT) == (1, 2, 4, 8, 16)  # fmt: skip
    assert nat.BPF_CGROUP_DEVICE == 6 and nat.BPF_PROG_TYPE_CGROUP_DEVICE == 15
    assert (nat.BPF_F_ALLOW_OVERRIDE, nat.BPF_F_ALLOW_MULTI, nat.BPF_F_REPLACE) == (1, 2, 4)


def test_openat2_in_root_keeps_symlinks_inside(tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "secret"
    outside.parent.mkdir()
    outside.write_text("outside")
    root = tmp_path / "root"
    inside = root / str(outside).lstrip("/")  # the same absolute path, but under the root
    inside.parent.mkdir(parents=True)
    inside.write_text("inside")
    (root / "sub").mkdir()
    (root / "abs").symlink_to(outside)  # absolute symlink
    (root / "sub" / "up").symlink_to("../../../../../../../.." + str(outside))  # climbs with ".."
    (root / "dotdot").symlink_to("..")
    rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        for path in ("abs", "sub/up", "/abs", "../../abs", "dotdot/dotdot/abs"):
            fd = nat.openat2(rootfd, path, os.O_RDONLY)
            try:
                assert os.read(fd, 100) == b"inside", path
                assert os.get_inheritable(fd) is False
            finally:
                os.close(fd)
        with pytest.raises(OSError) as exc:
            nat.openat2(rootfd, "abs", os.O_RDONLY, resolve=nat.RESOLVE_BENEATH)
        assert exc.value.errno == errno.EXDEV and exc.value.filename == "abs"
        with pytest.raises(OSError) as exc:
            nat.openat2(rootfd, "abs", os.O_RDONLY, resolve=nat.RESOLVE_IN_ROOT | nat.RESOLVE_NO_SYMLINKS)
        assert exc.value.errno == errno.ELOOP
        with pytest.raises(FileNotFoundError):
            nat.openat2(rootfd, "missing", os.O_RDONLY)
        fd = nat.openat2(rootfd, "new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        os.close(fd)
        assert stat.S_IMODE((root / "new").stat().st_mode) == 0o640 & ~_umask()
    finally:
        os.close(rootfd)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_mknodat_char_node(tmp_path: Path) -> None:
    need_root()
    dfd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        nat.mknodat(dfd, "nvidia3", stat.S_IFCHR | 0o666, 195, 3)
        with pytest.raises(FileExistsError):
            nat.mknodat(dfd, "nvidia3", stat.S_IFCHR | 0o666, 195, 3)
    finally:
        os.close(dfd)
    st = os.lstat(tmp_path / "nvidia3")
    assert stat.S_ISCHR(st.st_mode)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 3)


def test_mount_errors_name_paths(tmp_path: Path) -> None:
    with pytest.raises(OSError) as exc:
        nat.mount(str(tmp_path / "nope"), str(tmp_path), None, nat.MS_BIND)
    assert exc.value.errno in (errno.ENOENT, errno.EPERM)
    assert exc.value.filename == str(tmp_path / "nope") and exc.value.filename2 == str(tmp_path)
    with pytest.raises(OSError) as exc:
        nat.umount2(tmp_path)
    assert exc.value.errno in (errno.EINVAL, errno.EPERM) and exc.value.filename == str(tmp_path)


def test_unshare_mount_umount_in_child(tmp_path: Path) -> None:
    need_root()
    mnt, ro = tmp_path / "mnt", tmp_path / "ro"
    mnt.mkdir()
    ro.mkdir()

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE)
        nat.mount("tmpfs", mnt, "tmpfs", nat.MS_NOSUID | nat.MS_NODEV, "size=1m,mode=755")
        assert os.path.ismount(mnt)
        (mnt / "file").write_text("x")
        nat.mount(str(mnt), ro, None, nat.MS_BIND)
        nat.mount(None, ro, None, nat.MS_REMOUNT | nat.MS_BIND | nat.MS_RDONLY | nat.MS_NOSUID | nat.MS_NODEV)
        assert (ro / "file").read_text() == "x"
        try:
            (ro / "other").write_text("y")
            raise AssertionError("read-only bind mount was writable")
        except OSError as e:
            assert e.errno == errno.EROFS
        nat.umount2(ro, nat.MNT_DETACH)
        nat.umount2(mnt)
        assert not os.path.ismount(mnt)

    run_in_child(child)
    assert not os.path.ismount(mnt) and not (mnt / "file").exists()


def test_setns_enters_another_mount_namespace(tmp_path: Path) -> None:
    need_root()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=1m gh-setns {mnt} && echo marker > {mnt}/marker && echo ready && exec sleep 60"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert not os.path.ismount(mnt)

        def child() -> None:
            fd = os.open(f"/proc/{holder.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            nat.setns(fd, nat.CLONE_NEWNS)
            os.close(fd)
            assert os.path.ismount(mnt)
            assert (mnt / "marker").read_text() == "marker\n"
            nat.umount2(mnt)
            assert not os.path.ismount(mnt)

        run_in_child(child)
        fd = os.open(f"/proc/{holder.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with pytest.raises(OSError) as exc:
                nat.setns(fd, nat.CLONE_NEWNET)  # not a network namespace
            assert exc.value.errno == errno.EINVAL
        finally:
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def test_open_tree_move_mount_binds_across_namespaces(tmp_path: Path) -> None:
    """A host file bound into another mount namespace: mount(MS_BIND) of a source from the old namespace
    fails with EINVAL, an open_tree() clone taken before setns() attaches fine with move_mount()."""
    need_root()
    source, target = tmp_path / "source", tmp_path / "target"
    source.write_text("from the host\n")
    target.write_text("")
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "echo ready; exec sleep 60"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"

        def child() -> None:
            tree = nat.open_tree(nat.AT_FDCWD, source)  # cloned while still in the host's namespace
            path_fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
            ns = os.open(f"/proc/{holder.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            nat.setns(ns, nat.CLONE_NEWNS)
            try:
                nat.mount(f"/proc/self/fd/{path_fd}", target, None, nat.MS_BIND)
                raise AssertionError("bind mount from a foreign mount namespace unexpectedly worked")
            except OSError as e:
                assert e.errno == errno.EINVAL
            nat.move_mount(tree, "", nat.AT_FDCWD, target, nat.MOVE_MOUNT_F_EMPTY_PATH)
            assert target.read_text() == "from the host\n"
            nat.mount(None, target, None, nat.MS_REMOUNT | nat.MS_BIND | nat.MS_RDONLY)
            with pytest.raises(OSError) as exc:
                target.write_text("x")
            assert exc.value.errno == errno.EROFS

        run_in_child(child)
        assert target.read_text() == ""  # nothing leaked into the host's namespace
        with pytest.raises(OSError) as exc:
            nat.open_tree(nat.AT_FDCWD, tmp_path / "missing")
        assert exc.value.errno == errno.ENOENT
    finally:
        holder.kill()
        holder.wait()


# --- bpf ------------------------------------------------------------------------------------------------

RET1 = bytes.fromhex("b700000001000000" "9500000000000000")  # r0 = 1; exit
RET0 = bytes.fromhex("b700000000000000" "9500000000000000")  # r0 = 0; exit


def test_bpf_prog_load_info_and_verifier_log() -> None:
    need_root()
    fd = nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, RET1, "GPL", "gh_test")
    try:
        info = nat.bpf_prog_info(fd)
        assert info.type == nat.BPF_PROG_TYPE_CGROUP_DEVICE and info.name == "gh_test" and info.id > 0
        assert info.gpl_compatible is True
        assert nat.bpf_prog_xlated_insns(fd) == RET1
        again = nat.bpf_prog_get_fd_by_id(info.id)
        assert nat.bpf_prog_info(again).id == info.id
        os.close(again)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as exc:  # exit without setting r0
        nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, bytes.fromhex("9500000000000000"), "GPL")
    assert exc.value.errno == errno.EACCES
    assert "verifier:" in str(exc.value) and "R0" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(OSError) as exc:
        nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, b"\x95\0\0", "GPL")
    assert exc.value.errno == errno.EINVAL


def test_bpf_attach_query_replace_on_cgroup2(tmp_path: Path) -> None:
    """Query/attach/replace/detach on a private cgroup2 mount, in a child with its own mount namespace."""
    need_root()
    cgroot = tmp_path / "cg2"
    cgroot.mkdir()

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE)
        nat.mount("none", cgroot, "cgroup2", 0)
        group = cgroot / f"gpuhook-native-test-{os.getpid()}"
        group.mkdir()
        cg = os.open(group, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert nat.bpf_prog_query(cg, nat.BPF_CGROUP_DEVICE) == []
            first = nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, RET1, "GPL")
            nat.bpf_prog_attach(cg, first, nat.BPF_CGROUP_DEVICE, nat.BPF_F_ALLOW_MULTI)
            ids, flags = nat.bpf_prog_query_flags(cg, nat.BPF_CGROUP_DEVICE)
            assert ids == [nat.bpf_prog_info(first).id] and flags == nat.BPF_F_ALLOW_MULTI
            second = nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, RET0, "GPL")
            nat.bpf_prog_attach(cg, second, nat.BPF_CGROUP_DEVICE, nat.BPF_F_ALLOW_MULTI | nat.BPF_F_REPLACE, first)
            assert nat.bpf_prog_query(cg, nat.BPF_CGROUP_DEVICE) == [nat.bpf_prog_info(second).id]
            extra = [nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, RET1, "GPL") for _ in range(10)]
            for fd in extra:  # more than the first query's buffer: exercises the ENOSPC retry
                nat.bpf_prog_attach(cg, fd, nat.BPF_CGROUP_DEVICE, nat.BPF_F_ALLOW_MULTI)
            assert len(nat.bpf_prog_query(cg, nat.BPF_CGROUP_DEVICE)) == 11
            for fd in [second, *extra]:
                nat.bpf_prog_detach(cg, fd, nat.BPF_CGROUP_DEVICE)
                os.close(fd)
            os.close(first)
            assert nat.bpf_prog_query(cg, nat.BPF_CGROUP_DEVICE) == []
        finally:
            os.close(cg)
            group.rmdir()

    run_in_child(child)


def test_import_is_lean() -> None:
    """The hook imports gpuhook._native on every container start: no heavy modules come with it."""
    code = ("import sys; import gpuhook._native; "
            "print(','.join(sorted(m for m in ('json', 'subprocess', 'asyncio', 'yaml', 'click', 'grpc', "
            "'jsonschema', 'inspect', 'dataclasses') if m in sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_openat2_in_root_survives_concurrent_renames(tmp_path: Path) -> None:
    """RESOLVE_IN_ROOT answers EAGAIN when any rename races a '..' walk; openat2 retries, so a lookup never fails
    for a reason that has nothing to do with the rootfs (seen as 'Resource temporarily unavailable' at starts)."""
    import threading

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "lib").mkdir()
    (tmp_path / "spin").mkdir()
    stop = threading.Event()

    def rename_loop() -> None:
        src, dst = tmp_path / "spin" / "x", tmp_path / "spin" / "y"
        src.mkdir()
        while not stop.is_set():
            os.rename(src, dst)
            os.rename(dst, src)

    thread = threading.Thread(target=rename_loop)
    thread.start()
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        for _ in range(20000):
            fd = nat.openat2(root, "a/b/../../a/b/../../lib", os.O_PATH | os.O_DIRECTORY)
            os.close(fd)
    finally:
        stop.set()
        thread.join()
        os.close(root)


def test_mount_id_is_the_one_fdinfo_and_mountinfo_name(tmp_path: Path) -> None:
    """statx's STATX_MNT_ID (rootfs.mount_id's fast path) says what /proc/self/fdinfo says, for / and /proc."""
    for path in ("/", "/proc", str(tmp_path)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                fdinfo = next(int(line.split()[1]) for line in f if line.startswith("mnt_id:"))
            assert nat.mount_id(fd) == fdinfo, path
        finally:
            os.close(fd)


def test_is_mount_root_tells_a_mount_from_a_folder(tmp_path: Path) -> None:
    """STATX_ATTR_MOUNT_ROOT (ldconfig's view restricts the whole tree at once only from a mount's root): / and
    /proc are roots of their mounts, a folder is not, and is one once something is mounted on it."""
    need_root()
    folder = tmp_path / "folder"
    folder.mkdir()

    def roots() -> dict[str, bool | None]:
        found = {}
        for path in ("/", "/proc", str(folder)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                found[path] = nat.is_mount_root(fd)
            finally:
                os.close(fd)
        return found

    assert roots() == {"/": True, "/proc": True, str(folder): False}

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE, None)
        nat.mount("tmpfs", str(folder), "tmpfs", 0, "size=4k")
        assert roots()[str(folder)] is True

    run_in_child(child)


def test_mount_setattr_sets_and_clears_over_a_tree(tmp_path: Path) -> None:
    """mount_setattr with AT_RECURSIVE reaches every mount below, without it only the one named; a clear undoes
    a set; a bad descriptor is an OSError naming it."""
    need_root()
    top, sub = tmp_path / "top", tmp_path / "top" / "sub"

    def flags(path: Path) -> int:
        return os.statvfs(path).f_flag & (os.ST_RDONLY | os.ST_NODEV)

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE, None)
        top.mkdir()
        nat.mount("tmpfs", str(top), "tmpfs", 0, "size=64k")
        sub.mkdir()
        nat.mount("tmpfs", str(sub), "tmpfs", 0, "size=64k")
        fd = os.open(top, os.O_PATH | os.O_CLOEXEC)
        try:
            both = nat.MOUNT_ATTR_RDONLY | nat.MOUNT_ATTR_NODEV
            nat.mount_setattr(fd, "", nat.AT_EMPTY_PATH | nat.AT_RECURSIVE, both)
            assert (flags(top), flags(sub)) == (os.ST_RDONLY | os.ST_NODEV, os.ST_RDONLY | os.ST_NODEV)
            nat.mount_setattr(fd, "", nat.AT_EMPTY_PATH, 0, nat.MOUNT_ATTR_RDONLY)
            assert (flags(top), flags(sub)) == (os.ST_NODEV, os.ST_RDONLY | os.ST_NODEV)
        finally:
            os.close(fd)
        with pytest.raises(OSError) as caught:
            nat.mount_setattr(-1, "", nat.AT_EMPTY_PATH, nat.MOUNT_ATTR_RDONLY)
        assert caught.value.errno == errno.EBADF

    run_in_child(child)


def test_file_binds_run_stops_at_each_failure_and_goes_on_past_it(tmp_path: Path) -> None:
    """gh_bind_files (FileBinds): each item a new file, given to the owner, with the tree attached on it and the
    attributes set; a run stops at the item that cannot be done with its step and errno (a name that exists:
    CREATE/EEXIST; a folder's tree: TREE/ENOTSUP; nothing made for either) and run(at) goes on past it."""
    need_root()
    host, root = tmp_path / "host", tmp_path / "root"

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE, None)
        for folder in (host, root):
            folder.mkdir()
            nat.mount("tmpfs", str(folder), "tmpfs", 0, "size=64k")
        for name in ("a", "b", "c"):
            (host / name).write_bytes(name.encode())
        (host / "dir").mkdir()
        (root / "taken").write_bytes(b"image's")
        flags = nat.OPEN_TREE_CLONE | nat.OPEN_TREE_CLOEXEC | nat.AT_RECURSIVE
        trees = nat.open_trees([str(host / n) for n in ("a", "dir", "b", "c")], flags)
        dfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            ro = (nat.MOUNT_ATTR_RDONLY | nat.MOUNT_ATTR_NOEXEC, 0)
            items = [(dfd, "a", trees[0], *ro), (dfd, "dir", trees[1], *ro), (dfd, "taken", trees[2], *ro),
                     (dfd, "c", trees[3], 0, nat.MOUNT_ATTR_RDONLY)]
            run = nat.FileBinds(items, 0o640, nat.RESOLVE_IN_ROOT | nat.RESOLVE_NO_MAGICLINKS, (1234, 4321))
            assert run.run(0) == (1, nat.BIND_TREE, errno.ENOTSUP)
            assert not (root / "dir").exists()
            assert run.run(2) == (2, nat.BIND_CREATE, errno.EEXIST)
            assert (root / "taken").read_bytes() == b"image's"
            assert run.run(3) == (4, 0, 0)
            assert run.run(4) == (4, 0, 0)
        finally:
            os.close(dfd)
            for fd in trees:
                os.close(fd)
        assert [(root / n).read_bytes() for n in ("a", "c")] == [b"a", b"c"]
        assert os.statvfs(root / "a").f_flag & (os.ST_RDONLY | os.ST_NOEXEC) == os.ST_RDONLY | os.ST_NOEXEC
        assert not os.statvfs(root / "c").f_flag & os.ST_RDONLY
        nat.umount2(str(root / "a"))
        st = os.stat(root / "a")  # the new file under the bind: empty, the mode asked for, the owner's
        assert (st.st_size, stat.S_IMODE(st.st_mode) & ~0o022, st.st_uid, st.st_gid) == (0, 0o640, 1234, 4321)

    run_in_child(child)


def test_new_links_run_and_open_trees_failure(tmp_path: Path) -> None:
    """gh_symlinks (NewLinks): links made and given to the owner, a run stopped where a name exists (CREATE,
    EEXIST) and resumed past it; open_trees names the path it could not open and keeps nothing open."""
    need_root()
    dfd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    (tmp_path / "taken").write_text("x")
    try:
        run = nat.NewLinks([(dfd, "one", "libx.so.1"), (dfd, "taken", "t"), (dfd, "two", "../y")], (1234, 4321))
        assert run.run(0) == (1, nat.LINK_CREATE, errno.EEXIST)
        assert run.run(2) == (3, 0, 0)
    finally:
        os.close(dfd)
    assert [os.readlink(tmp_path / n) for n in ("one", "two")] == ["libx.so.1", "../y"]
    assert {(os.lstat(tmp_path / n).st_uid, os.lstat(tmp_path / n).st_gid) for n in ("one", "two")} == {(1234, 4321)}
    assert (tmp_path / "taken").read_text() == "x"
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as caught:
        nat.open_trees([str(tmp_path), str(tmp_path / "missing")], nat.OPEN_TREE_CLONE | nat.OPEN_TREE_CLOEXEC)
    assert (caught.value.errno, caught.value.filename) == (errno.ENOENT, str(tmp_path / "missing"))
    assert len(os.listdir("/proc/self/fd")) == before


# --- the extension runs on glibc 2.17 and later (the wheel's manylinux_2_17 tag) ------------------------------


def test_the_extension_needs_no_glibc_newer_than_2_17() -> None:
    """fstat and mknodat (real symbols from glibc 2.33) and pthread_sigmask (a new version in 2.32, called by
    confine.c) are raw system calls in the extension: no symbol version above GLIBC_2.17 is referenced, so the
    one wheel installs on RHEL 8, Ubuntu 20.04 and Debian 11 as auditwheel tags it."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump (binutils)")
    import gpuhook._native._gpuhook_native as ext

    table = subprocess.run([objdump, "-T", ext.__file__], capture_output=True, text=True, check=True).stdout
    versions = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"\(GLIBC_([0-9.]+)\)", table)}
    assert versions and max(versions) <= (2, 17), sorted(versions)
    assert not re.search(r"\b(fstat|mknodat|pthread_sigmask)\b", table), table


def test_mknodat_by_raw_system_call_keeps_the_device_number(tmp_path: Path) -> None:
    """The kernel takes mknodat's device in its 32-bit encoding: large majors and minors come out whole, and a
    number that does not fit is EINVAL, as glibc's own wrapper says."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, (major, minor) in enumerate([(195, 0), (195, 255), (511, 70000), (4095, (1 << 20) - 1)]):
            nat.mknodat(fd, f"node{i}", stat.S_IFCHR | 0o600, major, minor)
            rdev = os.stat(tmp_path / f"node{i}").st_rdev
            assert (os.major(rdev), os.minor(rdev)) == (major, minor)
        with pytest.raises(OSError) as raised:
            nat.mknodat(fd, "too-big", stat.S_IFCHR | 0o600, 4096, 0)
        assert raised.value.errno == errno.EINVAL
    finally:
        os.close(fd)
