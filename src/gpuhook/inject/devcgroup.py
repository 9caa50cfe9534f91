"""Grant a running container access to device nodes through its device cgroup.

cgroup v1: append rules to the container's `devices.allow`. cgroup v2 has no such file: runc attaches an
eBPF program (BPF_CGROUP_DEVICE) and with several attached programs *every* one must allow an access, so
attaching a second program can never widen access. Instead each attached program is rebuilt as
"allow prefix for our rules" + "its own instructions, unchanged" and swapped in atomically
(BPF_F_REPLACE). The prefix only ever returns 1 (allow) or falls through, so nothing else is widened.

On the hook's hot path: stdlib imports only, the native helper is loaded only for cgroup v2.
"""

from __future__ import annotations

import os
import struct
from collections import namedtuple

from gpuhook.inject.mountinfo import Mount, ancestor_paths, parse_mountinfo, points_above
from gpuhook.model.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the hook's path)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

__all__ = ["DeviceRule", "Grant", "allow_devices", "allow_v1", "allow_v2", "assemble_allow_prefix",
           "CgroupTarget", "find_cgroup", "open_grant"]  # fmt: skip

# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }
CTX_ACCESS_TYPE, CTX_MAJOR, CTX_MINOR = 0, 4, 8
BPF_DEVCG_DEV_BLOCK, BPF_DEVCG_DEV_CHAR = 1, 2  # low 16 bits of access_type
BPF_DEVCG_ACC_MKNOD, BPF_DEVCG_ACC_READ, BPF_DEVCG_ACC_WRITE = 1, 2, 4  # high 16 bits

_DEV_TYPES = {"b": BPF_DEVCG_DEV_BLOCK, "c": BPF_DEVCG_DEV_CHAR}
_ACCESS_BITS = {"m": BPF_DEVCG_ACC_MKNOD, "r": BPF_DEVCG_ACC_READ, "w": BPF_DEVCG_ACC_WRITE}
_MAX_MAJOR, _MAX_MINOR = (1 << 12) - 1, (1 << 20) - 1  # Linux dev_t: keeps every imm a positive s32

# eBPF opcodes used by the prefix (linux/bpf_common.h, linux/bpf.h).
OP_LDX_MEM_W = 0x61  # BPF_LDX | BPF_MEM | BPF_W
OP_MOV64_REG = 0xBF  # BPF_ALU64 | BPF_MOV | BPF_X
OP_MOV64_IMM = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K
OP_AND64_IMM = 0x57  # BPF_ALU64 | BPF_AND | BPF_K
OP_RSH64_IMM = 0x77  # BPF_ALU64 | BPF_RSH | BPF_K
OP_JNE_IMM = 0x55  # BPF_JMP | BPF_JNE | BPF_K
OP_JSET_IMM = 0x45  # BPF_JMP | BPF_JSET | BPF_K
OP_EXIT = 0x95  # BPF_JMP | BPF_EXIT
OP_CALL = 0x85  # BPF_JMP | BPF_CALL
OP_LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW
INSN_SIZE = 8
_INSN = struct.Struct("<BBhi")


class DeviceRule(Record):
    """Allow `access` (subset of "rwm") to the block ("b") or character ("c") device major:minor."""

    type: str
    major: int
    minor: int
    access: str = "rw"

    def __post_init__(self) -> None:
        if self.type not in _DEV_TYPES:
            raise ValueError(f"device rule type must be 'c' or 'b', not {self.type!r}")
        if not 0 <= self.major <= _MAX_MAJOR or not 0 <= self.minor <= _MAX_MINOR:
            raise ValueError(f"device number {self.major}:{self.minor} is out of range")
        if not self.access or set(self.access) - set(_ACCESS_BITS):
            raise ValueError(f"device rule access must be a non-empty subset of 'rwm', not {self.access!r}")

    @property
    def v1_line(self) -> str:
        """The rule as written to a cgroup v1 devices.allow, e.g. "c 195:0 rw"."""
        return f"{self.type} {self.major}:{self.minor} {self.access}"

    @property
    def access_bits(self) -> int:
        bits = 0
        for ch in self.access:
            bits |= _ACCESS_BITS[ch]
        return bits


# version: "v1" or "v2"; path: the container's cgroup directory as seen through this mount namespace.
# collections.namedtuple rather than typing.NamedTuple: `typing` costs ~4 ms on the hook's path.
CgroupTarget = namedtuple("CgroupTarget", ["version", "path"])


def allow_devices(
    pid: int,
    rules: Sequence[DeviceRule],
    proc_root: str = "/proc",
    mountinfo: str = "/proc/self/mountinfo",
) -> str:
    """Let the container whose init is `pid` use the devices in `rules`; returns "v1" or "v2" (open_grant, then
    its apply at once)."""
    return _apply_now(open_grant(pid, rules, proc_root, mountinfo))


def _apply_now(grant: Grant) -> str:
    """`grant` applied and closed; its version."""
    try:
        grant.apply()
    finally:
        grant.close()
    return grant.version


class Grant:
    """The container's device cgroup, opened where it is visible (the runtime's mount namespace), widened for
    `rules` later from wherever the caller is by then: the injecting process does it from the container's mount
    namespace while ldconfig runs. v1: its devices.allow open for writing; v2: its directory (-1: no rules)."""

    __slots__ = ("version", "path", "fd", "rules")

    def __init__(self, version: str, path: str, fd: int, rules: Sequence[DeviceRule]) -> None:
        self.version, self.path, self.fd, self.rules = version, path, fd, tuple(rules)

    def apply(self) -> None:
        """Widen the cgroup for the rules. Raises OSError (a syscall failed) or RuntimeError (a filter we cannot
        rebuild)."""
        if self.fd < 0:
            return
        if self.version == "v1":
            _write_v1(self.fd, os.path.join(self.path, "devices.allow"), self.rules)
        else:
            _rebuild_v2(self.fd, self.path, self.rules)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_grant(pid: int, rules: Sequence[DeviceRule], proc_root: str = "/proc",
               mountinfo: str = "/proc/self/mountinfo") -> Grant:
    """The device cgroup of the container whose init is `pid`, opened for a Grant of `rules`.

    The cgroup comes from `<proc_root>/<pid>/cgroup`, the mounts from `mountinfo` (the hook runs in the
    runtime's mount namespace). A v2 cgroup without a device program has no device filter: apply does nothing.
    Raises OSError (the cgroup cannot be opened) or RuntimeError (no usable cgroup)."""
    target = find_cgroup(pid, proc_root, mountinfo)
    return Grant(target.version, target.path, _open_cgroup(target.version, target.path) if rules else -1, rules)


def _open_cgroup(version: str, path: str) -> int:
    """What a Grant writes through: v1 the cgroup's devices.allow for writing, v2 its directory."""
    if version == "v1":
        return os.open(os.path.join(path, "devices.allow"), os.O_WRONLY | os.O_CLOEXEC)
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


# --- finding the cgroup -----------------------------------------------------------------------------------


def find_cgroup(pid: int, proc_root: str = "/proc", mountinfo: str = "/proc/self/mountinfo") -> CgroupTarget:
    """Where the container's device cgroup is: the v1 `devices` hierarchy when it is mounted and the process
    is in it (also on hybrid hosts with a cgroup2 mount elsewhere), else the cgroup v2 (unified) hierarchy."""
    cgroup_file = f"{proc_root}/{pid}/cgroup"
    with open(cgroup_file, encoding="utf-8", errors="surrogateescape") as f:
        v1_path, v2_path = _parse_proc_cgroup(f.read())
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        text = f.read()
    mounts = parse_mountinfo(text, points_above(text, ("cgroup", "cgroup2")))  # what _cgroup_dir looks at
    if v1_path is not None:
        found = _cgroup_dir(mounts, "cgroup", v1_path, controller="devices")
        if found is not None:
            return CgroupTarget("v1", found)
    if v2_path is not None:
        found = _cgroup_dir(mounts, "cgroup2", v2_path)
        if found is not None:
            return CgroupTarget("v2", found)
    if v1_path is None and v2_path is None:
        raise RuntimeError(f"{cgroup_file}: neither a 'devices' (v1) nor a unified (v2) cgroup line")
    raise RuntimeError(f"pid {pid}: its cgroup ({v1_path or v2_path}) is under no visible cgroup 'devices' "
                       f"or cgroup2 mount in {mountinfo}")  # fmt: skip


def _parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """(v1 devices path, v2 path) from /proc/<pid>/cgroup lines "id:controllers:path"."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "devices" in controllers.split(","):
            v1 = path
    return v1, v2


def _is_hidden(mount: Mount, by_id: dict[int, Mount], by_point: dict[str, list[Mount]]) -> bool:
    """True when a later mount covers `mount`'s mount point (or a directory above it) without being one of
    the mounts it sits on: e.g. cgroup2 mounted over a cgroup v1 tmpfs at /sys/fs/cgroup."""
    below: set[int] = set()
    parent = mount.parent_id
    while parent in by_id and parent not in below:
        below.add(parent)
        parent = by_id[parent].parent_id
    for path in ancestor_paths(mount.mountpoint):
        for other in by_point.get(path, ()):
            if other.index > mount.index and other.mount_id not in below and other.mount_id != mount.mount_id:
                return True
    return False


def _cgroup_dir(mounts: list[Mount], fstype: str, path: str, controller: str | None = None) -> str | None:
    """The directory of cgroup `path` under a visible mount of `fstype` (with `controller`, for v1)."""
    by_id = {m.mount_id: m for m in mounts}
    by_point: dict[str, list[Mount]] = {}
    for m in mounts:
        by_point.setdefault(m.mountpoint, []).append(m)
    for m in mounts:
        if m.fstype != fstype or (controller is not None and controller not in m.super_options):
            continue
        root = m.root.rstrip("/")
        if path != root and not path.startswith(root + "/"):
            continue
        if _is_hidden(m, by_id, by_point):
            continue
        rel = path[len(root) :].lstrip("/")
        return os.path.join(m.mountpoint, rel) if rel else m.mountpoint
    return None


# --- cgroup v1 ----------------------------------------------------------------------------------------------


def allow_v1(directory: str, rules: Sequence[DeviceRule]) -> None:
    """Append each rule to `directory`/devices.allow (the kernel takes one rule per write)."""
    _apply_now(Grant("v1", directory, _open_cgroup("v1", directory), rules))


def _write_v1(fd: int, path: str, rules: Sequence[DeviceRule]) -> None:
    """Each rule to the devices.allow open at `fd`, one rule per write."""
    for rule in rules:
        try:
            os.write(fd, rule.v1_line.encode())
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} (writing {rule.v1_line!r})", path) from None


# --- cgroup v2 ----------------------------------------------------------------------------------------------


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One eBPF instruction (struct bpf_insn, little-endian)."""
    return _INSN.pack(code, dst | src << 4, off, imm)


def assemble_allow_prefix(rules: Sequence[DeviceRule]) -> bytes:
    """Instructions that return 1 (allow) when the request matches a rule and fall through otherwise.

    Uses r2-r5 as scratch and never writes r1 (the context), which the program that follows reads.
    A request matches when type, major and minor are equal and its access bits lie within the rule's.
    """
    code = [
        insn(OP_LDX_MEM_W, dst=2, src=1, off=CTX_ACCESS_TYPE),  # r2 = ctx->access_type
        insn(OP_MOV64_REG, dst=3, src=2),  # r3 = r2
        insn(OP_AND64_IMM, dst=3, imm=0xFFFF),  # r3 = device type
        insn(OP_RSH64_IMM, dst=2, imm=16),  # r2 = requested access bits
        insn(OP_LDX_MEM_W, dst=4, src=1, off=CTX_MAJOR),  # r4 = major
        insn(OP_LDX_MEM_W, dst=5, src=1, off=CTX_MINOR),  # r5 = minor
    ]
    for rule in rules:
        denied = 0xFFFF & ~rule.access_bits
        code += [
            insn(OP_JNE_IMM, dst=3, off=5, imm=_DEV_TYPES[rule.type]),  # each "off" skips to the next rule
            insn(OP_JNE_IMM, dst=4, off=4, imm=rule.major),
            insn(OP_JNE_IMM, dst=5, off=3, imm=rule.minor),
            insn(OP_JSET_IMM, dst=2, off=2, imm=denied),
            insn(OP_MOV64_IMM, dst=0, imm=1),
            insn(OP_EXIT),
        ]
    return b"".join(code)


def check_relocatable(insns: bytes) -> None:
    """Refuse programs whose translated form can't be loaded again: helper calls and map references are
    rewritten to kernel addresses/ids, and constant blinding (bpf_jit_harden) uses the hidden register 11."""
    if not insns or len(insns) % INSN_SIZE:
        raise RuntimeError(f"device filter has a malformed instruction stream ({len(insns)} bytes)")
    for i in range(0, len(insns), INSN_SIZE):
        code, regs = insns[i], insns[i + 1]
        if code == OP_CALL or (code == OP_LD_IMM64 and regs >> 4):
            raise RuntimeError(f"device filter instruction {i // INSN_SIZE} (opcode {code:#x}) calls a helper "
                               "or references a map: cannot rebuild it")  # fmt: skip
        if regs & 0xF > 10 or regs >> 4 > 10:
            raise RuntimeError("device filter uses a hidden register (constant blinding, "
                               "net.core.bpf_jit_harden): cannot rebuild it")  # fmt: skip


def allow_v2(directory: str, rules: Sequence[DeviceRule]) -> None:
    """Rebuild every BPF_CGROUP_DEVICE program attached to the cgroup `directory` with an allow prefix for
    `rules`, replacing each in place. With no program attached there is no filter and nothing to do."""
    _apply_now(Grant("v2", directory, _open_cgroup("v2", directory), rules))


def _rebuild_v2(cgroup_fd: int, directory: str, rules: Sequence[DeviceRule]) -> None:
    """allow_v2 on the cgroup directory open at `cgroup_fd` (`directory` names it in errors)."""
    from gpuhook import _native as nat

    try:
        prog_ids, attach_flags = nat.bpf_prog_query_flags(cgroup_fd, nat.BPF_CGROUP_DEVICE)
    except OSError as e:
        raise OSError(e.errno, f"BPF_PROG_QUERY: {e.strerror}", directory) from None
    prefix = assemble_allow_prefix(rules)
    for prog_id in prog_ids:
        try:
            _replace_program(nat, cgroup_fd, prog_id, attach_flags, prefix)
        except OSError as e:
            raise OSError(e.errno, f"rebuilding device filter program {prog_id}: {e.strerror}",
                          directory) from None  # fmt: skip


def _replace_program(nat: ModuleType, cgroup_fd: int, prog_id: int, attach_flags: int, prefix: bytes) -> None:
    """Swap program `prog_id` for prefix + its own instructions, in the cgroup's attach mode."""
    old_fd = nat.bpf_prog_get_fd_by_id(prog_id)
    try:
        info = nat.bpf_prog_info(old_fd)
        old = nat.bpf_prog_xlated_insns(old_fd)
        check_relocatable(old)
        license = "GPL" if info.gpl_compatible else "Apache-2.0"  # keeps any GPL-only helper use legal
        new_fd = nat.bpf_prog_load(nat.BPF_PROG_TYPE_CGROUP_DEVICE, prefix + old, license, "gpuhook_devcg")
        try:
            if attach_flags & nat.BPF_F_ALLOW_MULTI:
                flags = nat.BPF_F_ALLOW_MULTI | nat.BPF_F_REPLACE
                nat.bpf_prog_attach(cgroup_fd, new_fd, nat.BPF_CGROUP_DEVICE, flags, old_fd)
            else:  # a single (non-multi) program: attaching another replaces it
                nat.bpf_prog_attach(cgroup_fd, new_fd, nat.BPF_CGROUP_DEVICE, attach_flags)
        finally:
            os.close(new_fd)
    finally:
        os.close(old_fd)
