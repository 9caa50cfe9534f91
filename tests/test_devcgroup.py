"""gpuhook.inject.devcgroup: the eBPF allow prefix (run through a small interpreter), cgroup discovery from
/proc/<pid>/cgroup + mountinfo, and end to end in running runc containers on cgroup v1 and cgroup v2."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import stat
import struct
import subprocess
import textwrap
from pathlib import Path

import pytest
from support.e2e import need_root, need_tool
from support.runc import (
    busybox_rootfs,
    cgroup2_namespace,
    in_namespace_python,
    make_bundle,
    need_busybox,
    run_in_child,
    runc_detached,
    runc_exec,
    unique_id,
)

from gpuhook.inject import devcgroup as dc
from gpuhook.inject.devcgroup import DeviceRule, allow_devices, find_cgroup

EPERM_TEXT, ENXIO_TEXT = "Operation not permitted", "No such device or address"
MASK64 = (1 << 64) - 1


# --- a tiny eBPF interpreter (only what the prefix and the test tails use) ------------------------------

CTX = object()  # r1 at entry: the context pointer


def run_bpf(code: bytes, access_type: int, major: int, minor: int, watch: int | None = None) -> int:
    """Run `code` on a bpf_cgroup_dev_ctx; with `watch`, assert r1 is still the context at that insn."""
    ctx = struct.pack("<III", access_type, major, minor)
    regs: list[object] = [0] * 11
    regs[1] = CTX
    pc, steps = 0, 0
    while True:
        steps += 1
        assert steps < 10_000 and 0 <= pc < len(code) // 8, f"ran off the program at {pc}"
        if pc == watch:
            assert regs[1] is CTX, "the prefix clobbered r1"
        op, r, off, imm = struct.unpack_from("<BBhi", code, pc * 8)
        dst, src, k = r & 0xF, r >> 4, imm & MASK64
        if op == dc.OP_LDX_MEM_W:
            assert regs[src] is CTX and off in (0, 4, 8), "load not from the context"
            regs[dst] = struct.unpack_from("<I", ctx, off)[0]
        elif op == dc.OP_MOV64_REG:
            regs[dst] = regs[src]
        elif op == dc.OP_MOV64_IMM:
            regs[dst] = k
        elif op == dc.OP_AND64_IMM:
            regs[dst] = int(regs[dst]) & k  # type: ignore[call-overload]
        elif op == dc.OP_RSH64_IMM:
            regs[dst] = int(regs[dst]) >> imm  # type: ignore[call-overload]
        elif op == dc.OP_JNE_IMM:
            pc += off if regs[dst] != k else 0
        elif op == 0x15:  # JEQ imm
            pc += off if regs[dst] == k else 0
        elif op == dc.OP_JSET_IMM:
            pc += off if int(regs[dst]) & k else 0  # type: ignore[call-overload]
        elif op == 0x05:  # JA
            pc += off
        elif op == dc.OP_EXIT:
            return int(regs[0])  # type: ignore[call-overload]
        else:
            raise AssertionError(f"opcode {op:#x} not modelled")
        pc += 1


def deny_all() -> bytes:
    return dc.insn(dc.OP_MOV64_IMM, dst=0, imm=0) + dc.insn(dc.OP_EXIT)


def allow_dev_null_tail() -> bytes:
    """Like runc's filter: reload everything from r1, allow c 1:3 (any access), deny the rest."""
    i = dc.insn
    return b"".join([
        i(dc.OP_LDX_MEM_W, dst=2, src=1, off=0),
        i(dc.OP_AND64_IMM, dst=2, imm=0xFFFF),
        i(dc.OP_LDX_MEM_W, dst=4, src=1, off=4),
        i(dc.OP_LDX_MEM_W, dst=5, src=1, off=8),
        i(dc.OP_JNE_IMM, dst=2, off=4, imm=2),
        i(dc.OP_JNE_IMM, dst=4, off=3, imm=1),
        i(dc.OP_JNE_IMM, dst=5, off=2, imm=3),
        i(dc.OP_MOV64_IMM, dst=0, imm=1),
        i(dc.OP_EXIT),
        i(dc.OP_MOV64_IMM, dst=0, imm=0),
        i(dc.OP_EXIT),
    ])  # fmt: skip


def access_type(dev_type: str, bits: int) -> int:
    return {"b": 1, "c": 2}[dev_type] | bits << 16


# --- prefix -----------------------------------------------------------------------------------------------


def test_instruction_encoding() -> None:
    assert dc.insn(dc.OP_LDX_MEM_W, dst=2, src=1, off=4) == bytes.fromhex("6112040000000000")
    assert dc.insn(dc.OP_JNE_IMM, dst=4, off=3, imm=195) == bytes.fromhex("55040300c3000000")
    assert dc.insn(dc.OP_JSET_IMM, dst=2, off=2, imm=0xFFF9) == bytes.fromhex("45020200f9ff0000")
    assert dc.insn(dc.OP_EXIT) == bytes.fromhex("9500000000000000")


def test_prefix_never_writes_r1() -> None:
    prefix = dc.assemble_allow_prefix([DeviceRule("c", 195, 0), DeviceRule("b", 8, 1, "r")])
    assert len(prefix) % 8 == 0
    for pc in range(0, len(prefix), 8):
        op, regs = prefix[pc], prefix[pc + 1]
        cls = op & 0x07
        if cls in (0x01, 0x04, 0x07):  # LDX, ALU, ALU64 write dst
            assert regs & 0xF != 1, f"insn {pc // 8} writes r1"


RULES = [DeviceRule("c", 195, 0), DeviceRule("c", 195, 255, "rwm"), DeviceRule("b", 8, 1, "r"),
         DeviceRule("c", 4095, 1048575, "w")]  # fmt: skip


def rule_allows(rules: list[DeviceRule], dev_type: str, major: int, minor: int, bits: int) -> bool:
    return any(r.type == dev_type and r.major == major and r.minor == minor and bits & ~r.access_bits == 0
               for r in rules)  # fmt: skip


@pytest.mark.parametrize("tail_name", ["deny_all", "allow_dev_null"])
def test_prefix_semantics_exhaustive(tail_name: str) -> None:
    tail = deny_all() if tail_name == "deny_all" else allow_dev_null_tail()
    prefix = dc.assemble_allow_prefix(RULES)
    program = prefix + tail
    watch = len(prefix) // 8
    majors, minors = (0, 1, 8, 195, 4095), (0, 1, 3, 255, 1048575)
    for dev_type, major, minor, bits in itertools.product("bc", majors, minors, range(1, 8)):
        expected = rule_allows(RULES, dev_type, major, minor, bits)
        if tail_name == "allow_dev_null":
            expected = expected or (dev_type, major, minor) == ("c", 1, 3)
        got = run_bpf(program, access_type(dev_type, bits), major, minor, watch=watch)
        assert got == int(expected), (dev_type, major, minor, bits)


def test_unknown_access_bits_fall_through() -> None:
    program = dc.assemble_allow_prefix([DeviceRule("c", 195, 0, "rwm")]) + deny_all()
    assert run_bpf(program, access_type("c", 0x7), 195, 0) == 1
    assert run_bpf(program, access_type("c", 0x8 | 0x2), 195, 0) == 0


def test_empty_prefix_only_loads() -> None:
    prefix = dc.assemble_allow_prefix([])
    assert run_bpf(prefix + deny_all(), access_type("c", 2), 195, 0) == 0


def test_check_relocatable() -> None:
    dc.check_relocatable(dc.assemble_allow_prefix(RULES) + allow_dev_null_tail())
    with pytest.raises(RuntimeError, match="helper"):
        dc.check_relocatable(dc.insn(dc.OP_CALL, imm=1) + deny_all())
    with pytest.raises(RuntimeError, match="map"):
        dc.check_relocatable(dc.insn(dc.OP_LD_IMM64, dst=1, src=1, imm=5) + dc.insn(0) + deny_all())
    dc.check_relocatable(dc.insn(dc.OP_LD_IMM64, dst=2, imm=5) + dc.insn(0) + deny_all())  # a plain constant
    with pytest.raises(RuntimeError, match="hidden register"):
        dc.check_relocatable(dc.insn(dc.OP_MOV64_REG, dst=11, src=2) + deny_all())
    with pytest.raises(RuntimeError, match="malformed"):
        dc.check_relocatable(b"\x95\0\0")


def test_device_rule_validation() -> None:
    assert DeviceRule("c", 195, 7).v1_line == "c 195:7 rw"
    assert DeviceRule("b", 8, 0, "rwm").access_bits == 7
    for bad in [("x", 1, 1, "rw"), ("c", -1, 0, "rw"), ("c", 4096, 0, "rw"), ("c", 1, 1 << 20, "rw"),
                ("c", 1, 1, ""), ("c", 1, 1, "rx")]:  # fmt: skip
        with pytest.raises(ValueError):
            DeviceRule(*bad)  # type: ignore[arg-type]


# --- finding the cgroup -----------------------------------------------------------------------------------

V1_MOUNTS = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime shared:9 - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
"""
HYBRID_EXTRA = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
SHADOWING_CGROUP2 = "63 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 none rw\n"
V2_MOUNTS = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""
PROC_V1 = "5:devices:/ctr-1\n4:memory:/x/ctr-1\n1:name=systemd:/ctr-1\n0::/ctr-1\n"
PROC_V2 = "0::/system.slice/ctr-2.scope\n"


def write_fake(tmp_path: Path, proc_cgroup: str, mountinfo: str, pid: int = 4242) -> tuple[str, str]:
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(proc_cgroup)
    mi = tmp_path / "mountinfo"
    mi.write_text(mountinfo)
    return str(proc), str(mi)


@pytest.mark.parametrize(
    ("proc_cgroup", "mountinfo", "expected"),
    [
        (PROC_V1, V1_MOUNTS, ("v1", "/sys/fs/cgroup/devices/ctr-1")),
        (PROC_V1, V1_MOUNTS + HYBRID_EXTRA, ("v1", "/sys/fs/cgroup/devices/ctr-1")),
        (PROC_V2, V2_MOUNTS, ("v2", "/sys/fs/cgroup/system.slice/ctr-2.scope")),
        # cgroup2 mounted over the v1 tmpfs (a private namespace on a v1 host): the v1 mounts are hidden
        (PROC_V1, V1_MOUNTS + HYBRID_EXTRA + SHADOWING_CGROUP2, ("v2", "/sys/fs/cgroup/ctr-1")),
        # a v1 hierarchy mounted from a sub-directory (as inside a container): the root is stripped
        ("5:devices:/docker/abc/ctr-1\n",
         "36 31 0:33 /docker/abc /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n",
         ("v1", "/sys/fs/cgroup/devices/ctr-1")),
        ("5:devices:/docker/abc\n",
         "36 31 0:33 /docker/abc /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n",
         ("v1", "/sys/fs/cgroup/devices")),
        # octal escapes in the mount point
        ("0::/a b\n", "30 1 0:26 / /mnt/cg\\0402 rw - cgroup2 cgroup2 rw\n", ("v2", "/mnt/cg 2/a b")),
    ],
)  # fmt: skip
def test_find_cgroup(tmp_path: Path, proc_cgroup: str, mountinfo: str, expected: tuple[str, str]) -> None:
    proc, mi = write_fake(tmp_path, proc_cgroup, mountinfo)
    assert tuple(find_cgroup(4242, proc, mi)) == expected


def test_find_cgroup_failures(tmp_path: Path) -> None:
    proc, mi = write_fake(tmp_path, "3:cpu:/x\n", V1_MOUNTS)
    with pytest.raises(RuntimeError, match="neither a 'devices'"):
        find_cgroup(4242, proc, mi)
    proc, mi = write_fake(tmp_path, PROC_V1, V1_MOUNTS.replace("rw,devices", "rw,freezer"))
    with pytest.raises(RuntimeError, match="no visible cgroup 'devices' or cgroup2 mount"):
        find_cgroup(4242, proc, mi)
    proc, mi = write_fake(tmp_path, "5:devices:/elsewhere\n",
                          "36 31 0:33 /docker /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n")  # fmt: skip
    with pytest.raises(RuntimeError):
        find_cgroup(4242, proc, mi)
    with pytest.raises(FileNotFoundError):
        find_cgroup(999999, proc, mi)


# A node's mountinfo with thousands of pod mounts: find_cgroup parses only the lines at the cgroup mounts' points
# and the folders above them (mountinfo.points_above), never the pods'.
POD_MOUNTS = "".join(f"{1000 + i} 27 0:{200 + i} / /var/lib/kubelet/pods/p{i}/volumes/kubernetes.io~secret/t rw "
                     f"shared:{i} - tmpfs tmpfs rw\n" for i in range(300))
COVERING_TMPFS = "70 27 0:50 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw\n"  # mounted over the v1 tree later


@pytest.mark.parametrize(("proc_cgroup", "mountinfo", "expected"), [
    (PROC_V1, POD_MOUNTS + V1_MOUNTS + POD_MOUNTS, ("v1", "/sys/fs/cgroup/devices/ctr-1")),
    (PROC_V2, V2_MOUNTS + POD_MOUNTS, ("v2", "/sys/fs/cgroup/system.slice/ctr-2.scope")),
    (PROC_V1, V1_MOUNTS + HYBRID_EXTRA + POD_MOUNTS + SHADOWING_CGROUP2, ("v2", "/sys/fs/cgroup/ctr-1")),
    # a later tmpfs (no cgroup line) over /sys/fs/cgroup hides the v1 tree: a filter on the cgroup types alone
    # would lose it and answer the hidden v1 folder
    (PROC_V1, V1_MOUNTS + POD_MOUNTS + COVERING_TMPFS, None),
])  # fmt: skip
def test_find_cgroup_among_pod_mounts(tmp_path: Path, proc_cgroup: str, mountinfo: str,
                                      expected: tuple[str, str] | None) -> None:
    proc, mi = write_fake(tmp_path, proc_cgroup, mountinfo)
    if expected is None:
        with pytest.raises(RuntimeError, match="no visible cgroup 'devices' or cgroup2 mount"):
            find_cgroup(4242, proc, mi)
    else:
        assert tuple(find_cgroup(4242, proc, mi)) == expected


def test_only_the_lines_above_cgroup_mounts_are_parsed() -> None:
    from gpuhook.inject.mountinfo import parse_mountinfo, points_above

    text = V1_MOUNTS + POD_MOUNTS + COVERING_TMPFS + "80 27 0:60 / /mnt/cg\\040x rw - cgroup2 cgroup2 rw\n"
    points = points_above(text, ("cgroup", "cgroup2"))
    assert points == {"/", "/sys", "/sys/fs", "/sys/fs/cgroup", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/devices",
                      "/sys/fs/cgroup/cpu,cpuacct", "/mnt", "/mnt/cg\\040x"}
    every = parse_mountinfo(text)
    kept = parse_mountinfo(text, points)
    # /sys, the root, the v1 tree, the tmpfs over it, the escaped cgroup2; not /proc, not a pod's
    assert [m.mount_id for m in kept] == [23, 27, 31, 35, 36, 37, 70, 80]
    assert kept == [m for m in every if m.mount_id in {23, 27, 31, 35, 36, 37, 70, 80}]  # indices, paths unchanged
    assert kept[-1].mountpoint == "/mnt/cg x"


def test_allow_v1_writes_one_rule_per_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "devices.allow").write_text("")
    writes: list[bytes] = []
    real_write = os.write
    monkeypatch.setattr(dc.os, "write", lambda fd, data: writes.append(data) or real_write(fd, data))
    dc.allow_v1(str(tmp_path), [DeviceRule("c", 195, 7), DeviceRule("c", 195, 255, "rwm")])
    assert writes == [b"c 195:7 rw", b"c 195:255 rwm"]


def test_allow_devices_v1_on_fake_hierarchy(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    (cg / "ctr-1").mkdir(parents=True)
    (cg / "ctr-1" / "devices.allow").write_text("")
    mountinfo = f"36 31 0:33 / {cg} rw - cgroup cgroup rw,devices\n"
    proc, mi = write_fake(tmp_path, PROC_V1, mountinfo)
    assert allow_devices(4242, [DeviceRule("c", 195, 7)], proc_root=proc, mountinfo=mi) == "v1"
    assert (cg / "ctr-1" / "devices.allow").read_text() == "c 195:7 rw"
    assert allow_devices(4242, [], proc_root=proc, mountinfo=mi) == "v1"
    (cg / "ctr-1" / "devices.allow").unlink()
    with pytest.raises(FileNotFoundError, match="devices.allow"):
        allow_devices(4242, [DeviceRule("c", 195, 7)], proc_root=proc, mountinfo=mi)


def test_a_grant_opened_on_the_host_is_applied_from_where_its_path_is_hidden(tmp_path: Path) -> None:
    """devcgroup.open_grant opens the cgroup where it is visible; Grant.apply widens it from wherever the caller
    is by then (the injecting process: the container's mount namespace, while ldconfig runs). Here the hierarchy
    is covered by a tmpfs in a private mount namespace before apply, and the rule still reaches it; a grant
    without rules opens nothing."""
    from support.e2e import need_root

    need_root()
    cg = tmp_path / "cg"
    (cg / "ctr-1").mkdir(parents=True)
    (cg / "ctr-1" / "devices.allow").write_text("")
    proc, mi = write_fake(tmp_path, PROC_V1, f"36 31 0:33 / {cg} rw - cgroup cgroup rw,devices\n")
    assert dc.open_grant(4242, [], proc_root=proc, mountinfo=mi).fd == -1
    grant = dc.open_grant(4242, [DeviceRule("c", 195, 7), DeviceRule("c", 195, 255, "rwm")], proc_root=proc,
                          mountinfo=mi)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from gpuhook import _native

            _native.unshare(_native.CLONE_NEWNS)
            subprocess.run(["mount", "--make-rprivate", "/"], check=True)
            subprocess.run(["mount", "-t", "tmpfs", "none", str(cg)], check=True)
            code = 0 if not (cg / "ctr-1").exists() else 2  # hidden here
            grant.apply()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    grant.close()
    assert os.waitstatus_to_exitcode(status) == 0
    assert (cg / "ctr-1" / "devices.allow").read_text() == "c 195:7 rwc 195:255 rwm" and grant.fd == -1


def test_module_imports_are_lean() -> None:
    import subprocess
    import sys

    code = ("import sys; import gpuhook.inject.devcgroup; "
            "print(','.join(m for m in ('json', 'subprocess', 'yaml', 'click', 'grpc', 'jsonschema', "
            "'gpuhook._native') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


# --- allow_v2 on a private cgroup2 mount (no runc) ---------------------------------------------------------

CALL_HELPER_THEN_ALLOW = (dc.insn(dc.OP_CALL, imm=15)  # bpf_get_current_uid_gid
                          + dc.insn(dc.OP_MOV64_IMM, dst=0, imm=1) + dc.insn(dc.OP_EXIT))  # fmt: skip


def test_allow_v2_replaces_each_program(tmp_path: Path) -> None:
    """Single-program and multi-program cgroups: every program is swapped for prefix + its own code, in the
    cgroup's attach mode; programs we cannot rebuild are refused with a clear error."""
    need_root()
    from gpuhook import _native as nat

    mnt = tmp_path / "cg2"
    mnt.mkdir()
    rules = [DeviceRule("c", 195, 0)]
    prefix = dc.assemble_allow_prefix(rules)

    def attached(group: Path) -> list[bytes]:
        fd = os.open(group, os.O_RDONLY | os.O_DIRECTORY)
        try:
            codes = []
            for prog_id in nat.bpf_prog_query(fd, nat.BPF_CGROUP_DEVICE):
                pfd = nat.bpf_prog_get_fd_by_id(prog_id)
                codes.append(nat.bpf_prog_xlated_insns(pfd))
                os.close(pfd)
            return codes
        finally:
            os.close(fd)

    def attach(group: Path, code: bytes, flags: int) -> None:
        fd = os.open(group, os.O_RDONLY | os.O_DIRECTORY)
        prog = nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, code, "GPL")
        nat.bpf_prog_attach(fd, prog, nat.BPF_CGROUP_DEVICE, flags)
        os.close(prog)
        os.close(fd)

    def child() -> None:
        nat.unshare(nat.CLONE_NEWNS)
        nat.mount(None, "/", None, nat.MS_REC | nat.MS_PRIVATE)
        nat.mount("none", mnt, "cgroup2", 0)
        groups = [mnt / f"gpuhook-devcg-{os.getpid()}-{i}" for i in range(3)]
        for g in groups:
            g.mkdir()
        try:
            single, multi, helper = groups
            dc.allow_v2(str(single), rules)  # no program: no filter, nothing to do
            assert attached(single) == []
            attach(single, deny_all(), 0)
            dc.allow_v2(str(single), rules)
            assert attached(single) == [prefix + deny_all()]
            attach(multi, deny_all(), nat.BPF_F_ALLOW_MULTI)
            attach(multi, allow_dev_null_tail(), nat.BPF_F_ALLOW_MULTI)
            dc.allow_v2(str(multi), rules)
            assert sorted(attached(multi)) == sorted([prefix + deny_all(), prefix + allow_dev_null_tail()])
            attach(helper, CALL_HELPER_THEN_ALLOW, nat.BPF_F_ALLOW_MULTI)
            with pytest.raises(RuntimeError, match="calls a helper"):
                dc.allow_v2(str(helper), rules)
        finally:
            for g in groups:
                g.rmdir()

    run_in_child(child)


# --- end to end with runc ---------------------------------------------------------------------------------

GPU_NODES = {"nvidia7": 7, "nvidia8": 8, "nvidia9": 9}


def open_result(cid: str, path: str, prefix: list[str], write: bool = False) -> str:
    """"ok", or the error busybox printed, for reading (cat) or writing (sh redirection) `path`."""
    args = ["sh", "-c", f"echo x > {path}"] if write else ["cat", path]
    result = runc_exec(cid, args, prefix=prefix)
    return "ok" if result.returncode == 0 else result.stderr.strip()


def gpu_bundle(tmp_path: Path) -> Path:
    """A busybox container that sleeps, with char nodes 195:N in /gpu (a plain directory of the rootfs,
    which runc leaves without nodev): only the device cgroup stands between the container and them."""
    rootfs = busybox_rootfs(tmp_path)
    (rootfs / "gpu").mkdir()
    for name, minor in GPU_NODES.items():
        os.mknod(rootfs / "gpu" / name, stat.S_IFCHR | 0o666, os.makedev(195, minor))
    return make_bundle(tmp_path, rootfs, ["sleep", "3600"])


def e2e_prerequisites(version: str) -> None:
    need_root()
    need_tool("runc")
    need_busybox()
    if version == "v1" and not os.path.isdir("/sys/fs/cgroup/devices"):
        pytest.skip("this host has no cgroup v1 devices hierarchy")
    if version == "v2":
        need_tool("unshare")
        need_tool("nsenter")


V2_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from gpuhook import _native as nat
    from gpuhook.inject.devcgroup import DeviceRule, allow_devices, find_cgroup
    pid, rules = int(sys.argv[1]), [DeviceRule(*r) for r in json.loads(sys.argv[2])]
    target = find_cgroup(pid)
    fd = os.open(target.path, os.O_RDONLY | os.O_DIRECTORY)
    before = nat.bpf_prog_query(fd, nat.BPF_CGROUP_DEVICE)
    mode = allow_devices(pid, rules)
    after = nat.bpf_prog_query(fd, nat.BPF_CGROUP_DEVICE)
    print(json.dumps({"mode": mode, "target": target.version, "before": before, "after": after}))
""")


def allow_in(prefix: list[str], pid: int, rules: list[DeviceRule]) -> dict[str, object]:
    """allow_devices() as the hook would run it: in the runtime's mount namespace (`prefix`)."""
    if not prefix:
        return {"mode": allow_devices(pid, rules)}
    args = json.dumps([[r.type, r.major, r.minor, r.access] for r in rules])
    code = f"import sys; sys.argv = ['x', {str(pid)!r}, {args!r}]\n" + V2_SCRIPT
    result = in_namespace_python(prefix, code)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.e2e
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_allow_devices_in_running_container(tmp_path: Path, version: str) -> None:
    e2e_prerequisites(version)
    bundle = gpu_bundle(tmp_path)
    cid = unique_id("gpuhook-devcg")
    namespace = cgroup2_namespace() if version == "v2" else contextlib.nullcontext([])
    with namespace as prefix, runc_detached(bundle, cid, prefix=prefix) as pid:
        for name in GPU_NODES:
            assert EPERM_TEXT in open_result(cid, f"/gpu/{name}", prefix)

        got = allow_in(prefix, pid, [DeviceRule("c", 195, 7), DeviceRule("c", 195, 9, "r")])
        assert got["mode"] == version
        if version == "v2":
            before, after = got["before"], got["after"]
            assert isinstance(before, list) and isinstance(after, list)
            assert len(before) == 1 and len(after) == 1 and before != after, got  # replaced, not added
        else:
            cgroup_dir = find_cgroup(pid).path
            listed = Path(cgroup_dir, "devices.list").read_text().splitlines()
            assert "c 195:7 rw" in listed and "c 195:9 r" in listed

        assert ENXIO_TEXT in open_result(cid, "/gpu/nvidia7", prefix)  # allowed: reaches the (absent) driver
        assert ENXIO_TEXT in open_result(cid, "/gpu/nvidia7", prefix, write=True)
        assert EPERM_TEXT in open_result(cid, "/gpu/nvidia8", prefix)  # no widening
        assert ENXIO_TEXT in open_result(cid, "/gpu/nvidia9", prefix)  # read-only rule: reads pass...
        assert EPERM_TEXT in open_result(cid, "/gpu/nvidia9", prefix, write=True)  # ...writes do not
        assert open_result(cid, "/dev/null", prefix) == "ok"  # runc's own rules are kept
        assert open_result(cid, "/dev/null", prefix, write=True) == "ok"

        # A second grant works on top of the first (v2: runc's program already carries our prefix).
        assert allow_in(prefix, pid, [DeviceRule("c", 195, 8)])["mode"] == version
        assert ENXIO_TEXT in open_result(cid, "/gpu/nvidia8", prefix)
        assert ENXIO_TEXT in open_result(cid, "/gpu/nvidia7", prefix)
        assert EPERM_TEXT in open_result(cid, "/gpu/nvidia9", prefix, write=True)


@pytest.mark.e2e
def test_v2_without_device_filter_is_a_no_op(tmp_path: Path) -> None:
    """A cgroup with no BPF_CGROUP_DEVICE program has no device filter: nothing to widen."""
    e2e_prerequisites("v2")
    with cgroup2_namespace() as prefix:
        code = textwrap.dedent("""
            import os, subprocess, sys
            from gpuhook.inject.devcgroup import DeviceRule, allow_devices
            group = f"/sys/fs/cgroup/gpuhook-nofilter-{os.getpid()}"
            os.mkdir(group)
            child = subprocess.Popen(["sleep", "30"])
            try:
                with open(os.path.join(group, "cgroup.procs"), "w") as f:
                    f.write(str(child.pid))
                print(allow_devices(child.pid, [DeviceRule("c", 195, 0)]))
            finally:
                child.kill(); child.wait(); os.rmdir(group)
        """)
        result = in_namespace_python(prefix, code)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "v2"
