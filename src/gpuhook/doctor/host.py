"""Host checks: is there a driver, does NVML answer, are the device nodes there and usable, ModifyDeviceFiles."""

from __future__ import annotations

import os
import stat

from gpuhook.discover import Inventory, Roots, discover, procfs
from gpuhook.discover.devnodes import devices_major
from gpuhook.discover.roots import join
from gpuhook.doctor.model import INFO, OK, PROBLEM, WARN, Finding
from gpuhook.errors import DiscoveryError
from gpuhook.model.inventory import DeviceNode

NVIDIA_MAJOR = 195
CTL_MINOR = 255
MODESET_MINOR = 254


def _f(status: str, message: str, fix: str = "") -> Finding:
    return Finding("host", status, message, fix)


def _create_fix(roots: Roots, canonical: str, major: int | None, minor: int, mode: int, modprobe: str) -> str:
    """nvidia-modprobe on a real host (it knows majors and modes); mknod under a dev root that is not `/`."""
    if roots.dev_root == "/" or major is None:
        return modprobe
    return f"mknod -m {mode:o} {join(roots.dev_root, canonical)} c {major} {minor}"


def _node_state(host_path: str, want_mode: int) -> tuple[str, str] | None:
    """(status, what is wrong) for an existing path, or None when it is a character device with `want_mode`."""
    try:
        st = os.stat(host_path)
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return PROBLEM, f"{host_path} is not a character device"
    mode = stat.S_IMODE(st.st_mode)
    if mode & want_mode != want_mode:
        return WARN, (f"{host_path} has mode {mode:04o} (want {want_mode:04o}): a container process that is not "
                      "root cannot open it")
    return None


def _check_node(roots: Roots, canonical: str, what: str, major: int | None, minor: int, want_mode: int,
                modprobe: str, missing_status: str = PROBLEM) -> list[Finding]:
    host_path = join(roots.dev_root, canonical)
    if not os.path.lexists(host_path):
        return [_f(missing_status, f"{host_path} is missing ({what})",
                   _create_fix(roots, canonical, major, minor, want_mode, modprobe))]
    bad = _node_state(host_path, want_mode)
    if bad is None:
        return []
    status, message = bad
    return [_f(status, message, f"chmod {want_mode:04o} {host_path}" if status == WARN else f"rm {host_path} && "
               + _create_fix(roots, canonical, major, minor, want_mode, modprobe))]


def _gpu_nodes(roots: Roots, inv: Inventory) -> list[Finding]:
    """Every GPU the kernel module knows (procfs) or NVML reports needs /dev/nvidia<minor>: NVML hides a GPU
    without one, so the kernel's list is the one to check against."""
    try:
        kernel = [g for g in procfs.gpus(roots.proc_root) if not g.excluded]
    except DiscoveryError:
        kernel = []
    wanted = {g.minor: f"GPU {g.bus_id}" + (f", {g.uuid}" if g.uuid else "") for g in kernel}
    for g in inv.gpus:
        wanted.setdefault(g.minor, f"GPU {g.index}" + (f", {g.uuid}" if g.uuid else ""))
    out: list[Finding] = []
    for minor, what in sorted(wanted.items()):
        out += _check_node(roots, f"/dev/nvidia{minor}", what, NVIDIA_MAJOR, minor, 0o666,
                           f"nvidia-modprobe -c {minor}")
    return out


def _control_nodes(roots: Roots) -> list[Finding]:
    uvm = devices_major(roots.proc_root, "nvidia-uvm")
    out = _check_node(roots, "/dev/nvidiactl", "the control node every GPU container needs", NVIDIA_MAJOR,
                      CTL_MINOR, 0o666, "nvidia-modprobe -c 0")
    for name, minor in (("nvidia-uvm", 0), ("nvidia-uvm-tools", 1)):
        out += _check_node(roots, f"/dev/{name}", "CUDA needs it: compute containers fail cuInit without it", uvm,
                           minor, 0o666, "nvidia-modprobe -u -c 0")
    out += _check_node(roots, "/dev/nvidia-modeset", "only the display capability uses it", NVIDIA_MAJOR,
                       MODESET_MINOR, 0o666, "nvidia-modprobe -m", missing_status=INFO)
    return out


def _access_mode(access_host: str) -> int:
    try:
        info = procfs.parse_key_values(open(access_host, encoding="utf-8").read())  # noqa: SIM115 - tiny file
        return int(info.get("DeviceFileMode", "292"))
    except (OSError, ValueError):
        return 0o444


def _mig_nodes(roots: Roots, inv: Inventory) -> list[Finding]:
    """Each MIG device's gi/ci capability nodes, with the minor and mode its /proc access file gives."""
    major = devices_major(roots.proc_root, "nvidia-caps")
    out: list[Finding] = []
    for mig in inv.all_mig_devices():
        for access in (mig.gi_access, mig.ci_access):
            host = procfs.proc_host_path(roots.proc_root, access)
            try:
                minor = procfs.cap_minor(host)
            except DiscoveryError:
                continue
            out += _check_node(roots, f"/dev/nvidia-caps/nvidia-cap{minor}", f"MIG device {mig.name}", major, minor,
                               _access_mode(host), f"nvidia-modprobe -f {access}")
    return out


def _modify_device_files(inv: Inventory) -> list[Finding]:
    if not inv.params_host_path:
        return [_f(WARN, "no /proc/driver/nvidia/params: the hook cannot give containers ModifyDeviceFiles: 0",
                   "modprobe nvidia (the params file comes with the kernel module)")]
    try:
        params = procfs.parse_key_values(open(inv.params_host_path, encoding="utf-8").read())  # noqa: SIM115
    except OSError as exc:
        return [_f(WARN, f"cannot read {inv.params_host_path}: {exc.strerror}")]
    value = params.get("ModifyDeviceFiles")
    if value == "1":
        return [_f(INFO, "ModifyDeviceFiles: 1: the driver creates and fixes /dev/nvidia* itself. Containers started "
                         "by gpuhook-hook see a private params with 0; under CDI or gpuhook-runtime they see 1 "
                         "(harmless: a container has no CAP_MKNOD)")]
    if value == "0":
        return [_f(INFO, "ModifyDeviceFiles: 0: nothing creates device nodes on demand; they must exist before "
                         "containers start (any missing one is listed above)")]
    return [_f(WARN, f"{inv.params_host_path} has no ModifyDeviceFiles line")]


def kernel_module_installed(driver_root: str, release: str | None = None) -> bool:
    """An nvidia kernel module on disk for the running kernel (`release`), under the driver root's
    lib/modules or usr/lib/modules: loaded by `modprobe nvidia`, where no module means no driver at all."""
    import glob

    release = release or os.uname().release
    for modules in ("lib/modules", "usr/lib/modules"):
        top = os.path.join(driver_root, modules, release)
        if glob.glob(os.path.join(glob.escape(top), "**", "nvidia.ko*"), recursive=True):
            return True
    return False


def check_host(roots: Roots, method: str = "auto") -> tuple[Inventory | None, list[Finding]]:
    """The inventory (None without a driver) and the host's findings."""
    try:
        inv = discover(roots, method=method)
    except DiscoveryError as exc:
        version = os.path.join(roots.proc_root, "driver/nvidia/version")
        message = f"no usable NVIDIA driver: {exc}"
        if roots.driver_root != "/" and not os.path.isdir(roots.driver_root):
            fix = "pass the driver install's root with --driver-root"
        elif os.path.exists(version):
            fix = "install the NVIDIA driver's user-space libraries"
        elif kernel_module_installed(roots.driver_root):
            fix = "modprobe nvidia"
        else:  # neither the kernel module loaded nor one on disk, nor the libraries: nothing is installed
            message = f"no NVIDIA driver is installed on this host ({exc})"
            fix = ("install the NVIDIA driver (your distribution's package or NVIDIA's installer), then run "
                   "gpuhook doctor again")
        return None, [_f(PROBLEM, message, fix)]
    migs = len(inv.all_mig_devices())
    summary = (f"driver {inv.driver_version}" + (f" (CUDA {inv.cuda_version})" if inv.cuda_version else "")
               + f" found through {'NVML' if inv.source == 'nvml' else '/proc/driver/nvidia'}: {len(inv.gpus)} GPU(s)"
               + (f", {migs} MIG device(s)" if migs else ""))
    out = [_f(OK, summary)]
    if inv.source != "nvml":
        why = "; ".join(inv.notes) or f"--discovery {method}"
        if method == "procfs":
            out.append(_f(INFO, f"NVML not used ({why})"))
        else:
            missing_lib = any("no libnvidia-ml" in n for n in inv.notes)
            out.append(_f(WARN, f"NVML unavailable ({why}): GPUs come from /proc/driver/nvidia, so MIG devices have "
                                "no UUIDs and NVIDIA_REQUIRE_* cannot check arch or brand",
                          "install the driver's user-space libraries (libnvidia-ml.so.1)" if missing_lib
                          else "nvidia-smi (shows why NVML fails to initialise)"))
    if not inv.gpus:
        out.append(_f(PROBLEM, "the driver reports no GPU", "nvidia-smi (and dmesg | grep -i nvrm for the reason)"))
    out += _gpu_nodes(roots, inv) + _control_nodes(roots) + _mig_nodes(roots, inv)
    if not any(f.status in (PROBLEM, WARN) and "/dev/" in f.message for f in out):
        count = sum(1 for g in inv.gpus if g.node) + len(inv.control_nodes)
        out.append(_f(OK, f"device nodes present with usable permissions ({count} GPU and control nodes checked)"))
    out += _modify_device_files(inv)
    return inv, out


def describe_node(node: DeviceNode) -> str:
    return f"{node.path} ({node.type} {node.major}:{node.minor})"


def check_ldconfig(configured: str) -> list[Finding]:
    """The very check a GPU start makes (inject/ldcache.open_ldconfig): the configured ldconfig, or Ubuntu's
    `.real` beside a wrapper script, must be a static ELF; else every GPU start fails."""
    from gpuhook.errors import InjectionError
    from gpuhook.inject.ldcache import host_ldconfig, open_ldconfig

    try:
        os.close(open_ldconfig(configured))
    except InjectionError as exc:
        return [_f(PROBLEM, f"every GPU start would fail: {exc}",
                   "set ldconfig = \"@<a static ldconfig>\" in the hook config (glibc's ldconfig is static)")]
    path = host_ldconfig(configured)
    shown = configured[1:] if configured.startswith("@") else configured
    via = f" (the script {shown} execs it)" if path != shown else ""
    return [_f(OK, f"ldconfig {path} is a static executable{via}")]
