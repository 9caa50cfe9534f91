"""GPUs through NVML (pynvml), bound to the driver root's own `libnvidia-ml.so.1`.

pynvml would dlopen("libnvidia-ml.so.1") through the host's loader path; binding it to the library found in
the driver root's ld.so.cache makes `--driver-root` mean what it says (and lets the simulated driver's NVML
answer). Imported lazily: pynvml never loads on the hook's path when a cached inventory is fresh.
"""

from __future__ import annotations

import _thread
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from gpuhook.errors import DiscoveryError
from gpuhook.model.inventory import normalize_bus_id
from gpuhook.model.record import Record, field

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2 ms of a cold discovery)
if TYPE_CHECKING:
    from typing import Any, NoReturn

_lock = _thread.allocate_lock()  # (_thread, not threading: this module loads before NVML's child is forked)
LOCK_TIMEOUT_S = 30.0


def import_pynvml() -> Any:
    """pynvml, imported without loading `ctypes.util` for it.

    pynvml does `from ctypes.util import find_library` at import time and never calls it, and `ctypes.util`
    brings subprocess, tempfile and shutil: about 10 ms of every cold discovery here (generate-cdi without its
    cache: 92 -> 82 ms, 10 runs each). While pynvml imports, `ctypes.util` is a stand-in whose `find_library`
    loads the real module at its first call; it is taken out of sys.modules right after, so any later
    `import ctypes.util` gets the real one. Where the real one is already loaded, it is used as it is."""
    if "pynvml" in sys.modules or "ctypes.util" in sys.modules:
        import pynvml

        return pynvml
    stand_in = type(sys)("ctypes.util", "find_library on demand (discover/nvml.import_pynvml)")

    def find_library(name: str) -> str | None:
        import importlib

        if sys.modules.get("ctypes.util") is stand_in:
            del sys.modules["ctypes.util"]
        return importlib.import_module("ctypes.util").find_library(name)

    stand_in.find_library = find_library  # type: ignore[attr-defined]
    sys.modules["ctypes.util"] = stand_in
    try:
        import pynvml
    finally:
        if sys.modules.get("ctypes.util") is stand_in:
            del sys.modules["ctypes.util"]
    return pynvml

BRANDS: dict[int, str] = {
    0: "unknown",
    1: "quadro",
    2: "tesla",
    3: "nvs",
    4: "grid",
    5: "geforce",
    6: "titan",
    7: "nvidia-vapps",
    8: "nvidia-vpc",
    9: "nvidia-vcs",
    10: "nvidia-vws",
    11: "nvidia-cloud-gaming",
    12: "quadro-rtx",
    13: "nvidia-rtx",
    14: "nvidia",
    15: "geforce-rtx",
    16: "titan-rtx",
}


class NvmlMig(Record, frozen=False):
    index: int
    uuid: str
    gi: int
    ci: int
    profile: str
    memory_mib: int


class NvmlGpu(Record, frozen=False):
    index: int
    minor: int
    uuid: str
    pci_bus_id: str
    name: str
    memory_mib: int
    compute_capability: str
    brand: str
    numa_node: int
    mig_enabled: bool
    migs: list[NvmlMig] = field(default_factory=list)
    mig_capable: bool = False
    nvlinks: list[tuple[str, str]] = field(default_factory=list)  # (remote bus id, remote type) per active link
    pci_levels: list[int] = field(default_factory=list)  # common-ancestor level to GPU i; [] when unknown
    p2p_ok: list[bool] = field(default_factory=list)


class NvmlReport(Record, frozen=False):
    driver_version: str
    cuda_version: str
    gpus: list[NvmlGpu]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mig_profile_from_name(name: str) -> str:
    """NVML names a MIG device '<gpu name> MIG 1g.10gb'; the profile is the last word after 'MIG'."""
    head, sep, tail = name.rpartition(" MIG ")
    return tail.strip() if sep else ""


@contextmanager
def bound_nvml(library_path: str) -> Iterator[Any]:
    """pynvml, initialised against exactly `library_path`, shut down and unbound afterwards; NVML cannot create
    device nodes or load modules meanwhile (_without_device_powers)."""
    pynvml = import_pynvml()

    if not _lock.acquire(timeout=LOCK_TIMEOUT_S):
        raise DiscoveryError(f"NVML is in use by another thread of this process for over {LOCK_TIMEOUT_S:.0f} s")
    try:
        with _without_device_powers():
            yield from _bound(pynvml, library_path)
    finally:
        _lock.release()


def _bound(pynvml: Any, library_path: str) -> Iterator[Any]:
    """The body of bound_nvml: load, bind, init, yield, shut down, unbind."""
    import ctypes

    try:
        lib = ctypes.CDLL(library_path)
    except OSError as exc:
        raise DiscoveryError(f"cannot load NVML library {library_path}: {exc}") from None
    pynvml.nvmlLib = lib
    pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise DiscoveryError(f"nvmlInit failed ({library_path}): {exc}") from None
        try:
            yield pynvml
        finally:
            with suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
    finally:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0


def _cuda_version(nv: Any) -> str:
    try:
        v = int(nv.nvmlSystemGetCudaDriverVersion_v2())
    except (nv.NVMLError, AttributeError):
        try:
            v = int(nv.nvmlSystemGetCudaDriverVersion())
        except nv.NVMLError:
            return ""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _optional(call: Any, default: Any, nv: Any) -> Any:
    try:
        return call()
    except nv.NVMLError:
        return default


def _migs(nv: Any, handle: Any) -> list[NvmlMig]:
    migs: list[NvmlMig] = []
    count = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
    for slot in range(count):
        try:
            mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nv.NVMLError_NotFound:
            continue
        name = _text(nv.nvmlDeviceGetName(mh))
        migs.append(
            NvmlMig(
                index=len(migs),
                uuid=_text(nv.nvmlDeviceGetUUID(mh)),
                gi=int(nv.nvmlDeviceGetGpuInstanceId(mh)),
                ci=int(nv.nvmlDeviceGetComputeInstanceId(mh)),
                profile=mig_profile_from_name(name),
                memory_mib=int(_optional(lambda mh=mh: nv.nvmlDeviceGetMemoryInfo(mh).total, 0, nv)) >> 20,
            )
        )
    return migs


def _gpu(nv: Any, index: int) -> NvmlGpu:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    pci = nv.nvmlDeviceGetPciInfo_v3(h)
    major, minor_cc = _optional(lambda: nv.nvmlDeviceGetCudaComputeCapability(h), (0, 0), nv)
    mode = _optional(lambda: nv.nvmlDeviceGetMigMode(h), None, nv)  # NOT_SUPPORTED: not MIG-capable (GFD)
    current, _pending = mode if mode is not None else (0, 0)
    mig_enabled = current == 1
    return NvmlGpu(
        index=index,
        minor=int(nv.nvmlDeviceGetMinorNumber(h)),
        uuid=_text(nv.nvmlDeviceGetUUID(h)),
        pci_bus_id=normalize_bus_id(_text(pci.busId)),
        name=_text(nv.nvmlDeviceGetName(h)),
        memory_mib=int(_optional(lambda: nv.nvmlDeviceGetMemoryInfo(h).total, 0, nv)) >> 20,
        compute_capability=f"{major}.{minor_cc}" if major else "",
        brand=BRANDS.get(int(_optional(lambda: nv.nvmlDeviceGetBrand(h), 0, nv)), "unknown"),
        numa_node=int(_optional(lambda: nv.nvmlDeviceGetNumaNodeId(h), -1, nv)),
        mig_enabled=mig_enabled,
        migs=_migs(nv, h) if mig_enabled else [],
        mig_capable=mode is not None,
    )


# nvmlIntNvLinkDeviceType_t
NVLINK_REMOTE_TYPES: dict[int, str] = {0: "gpu", 1: "ibmnpu", 2: "switch"}
P2P_CAPS_INDEX_READ = 0  # pynvml spells NVML_P2P_CAPS_INDEX_READ as a tuple `(0,)`: use the number
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS of the r550 headers; newer pynvml says 36, the loop stops early


def _nvlinks(nv: Any, handle: Any) -> list[tuple[str, str]]:
    """(remote bus id, remote type) of each active NVLink, as go-gpuallocator reads them (state, then the far
    end's PCI info); a link NVML does not support is skipped, an invalid link number ends the list."""
    links: list[tuple[str, str]] = []
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS)):
        try:
            if not nv.nvmlDeviceGetNvLinkState(handle, link):
                continue
            pci = nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except nv.NVMLError_NotSupported:
            continue
        except nv.NVMLError_InvalidArgument:
            break
        kind = _optional(lambda link=link: nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link), 0, nv)
        links.append((normalize_bus_id(_text(pci.busId)), NVLINK_REMOTE_TYPES.get(int(kind), "unknown")))
    return links


def _topology(nv: Any, gpus: list[NvmlGpu]) -> None:
    """Fill in every GPU's links, common ancestors and P2P status, read once; a query that fails leaves the
    whole topology unknown (the plugin then chooses as it would without it)."""
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(g.index) for g in gpus]
        links = [_nvlinks(nv, h) for h in handles]
        levels = [[0 if a is b else int(nv.nvmlDeviceGetTopologyCommonAncestor(a, b)) for b in handles]
                  for a in handles]
        p2p = [[a is b or _optional(lambda a=a, b=b: nv.nvmlDeviceGetP2PStatus(a, b, P2P_CAPS_INDEX_READ), 1,
                                    nv) == 0 for b in handles] for a in handles]
    except nv.NVMLError:
        return
    for g, li, le, pp in zip(gpus, links, levels, p2p):  # each list was built over `handles`, one per GPU
        g.nvlinks, g.pci_levels, g.p2p_ok = li, le, pp


_CAP_MKNOD = 27
_CAP_SYS_MODULE = 16
_DEVICE_POWERS = (1 << _CAP_MKNOD) | (1 << _CAP_SYS_MODULE)  # what NVML must not have (see below)
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _capabilities() -> tuple[Any, Any, Any]:
    """(libc, header, data) of this thread's capability sets (capget/capset act on the calling thread only)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    return libc, header, data


@contextmanager
def _without_device_powers() -> Iterator[None]:
    """Run NVML with CAP_MKNOD and CAP_SYS_MODULE out of this thread's effective set, put back afterwards.

    Finding no kernel module, NVIDIA's libnvidia-ml running as root creates /dev/nvidiactl in the host's /dev and
    tries to load the module; every in-process use of NVML (the device plugin's health thread) goes through
    bound_nvml, so none can. Capabilities are per thread: the other threads of the process keep theirs, and
    threads NVML starts meanwhile inherit the reduced set. Dropping the permitted set too
    (_drop_device_powers) is for a child that exits afterwards."""
    import ctypes

    libc, header, data = _capabilities()
    saved = data[0].effective
    data[0].effective &= ~_DEVICE_POWERS
    if data[0].effective != saved and libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    try:
        yield
    finally:
        if data[0].effective != saved:
            data[0].effective = saved
            libc.capset(ctypes.byref(header), data)


def _drop_device_powers() -> None:
    """Clear CAP_MKNOD and CAP_SYS_MODULE from this process's effective and permitted sets.

    Finding no kernel driver, NVIDIA's libnvidia-ml running as root creates /dev/nvidiactl on the host and
    tries to load the module; without these it cannot, and reports the driver as not loaded instead.
    """
    import ctypes

    libc, header, data = _capabilities()
    data[0].effective &= ~_DEVICE_POWERS
    data[0].permitted &= ~_DEVICE_POWERS
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


MAX_LIBRARY_PATH = 4096  # what the child reads of the library's path (a host path, PATH_MAX)


def _threads_running() -> bool:
    """Whether this process runs other threads (threading's count; a process that never imported threading
    started none through it)."""
    threading = sys.modules.get("threading")
    return threading is not None and threading.active_count() > 1


class Child:
    """`query` in a forked child that cannot create device nodes or load modules and exits afterwards: no
    gpuhook process keeps libnvidia-ml loaded, and a driver root whose kernel side is absent cannot make NVML
    create /dev/nvidia* on the host. Forked before the library it will ask is known, so that its start overlaps
    the caller's: it drops its device powers and imports pynvml (~10 ms) at once, then waits for `query`'s
    path. A cold discovery forks it before the scan's own modules load (cli/inventory.load_inventory), and the
    scan reads the driver's files while it answers (discover/scan.py). `cancel` ends one that is not needed (a
    procfs discovery, no libnvidia-ml.so.1, an error on the way).

    A single-threaded caller leaves pynvml's import to the child; a process with other threads imports it
    first, since a thread importing at the fork would leave the child a module lock nobody releases. The
    report comes back as plain values through `marshal` (built in; pickle's import is ~2 ms of a cold
    discovery)."""

    def __init__(self) -> None:
        self.asked = False
        if _threads_running():
            import_pynvml()
        path_r, self._path_w = os.pipe()
        self._report_r, report_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._path_w)
            os.close(self._report_r)
            _serve_one_query(path_r, report_w)
        os.close(path_r)
        os.close(report_w)

    def query(self, library_path: str) -> Callable[[], NvmlReport]:
        """Ask the child about `library_path`; the function returned waits for its report, raising
        DiscoveryError with the child's one line."""
        import marshal

        self.asked = True
        with suppress(BrokenPipeError):  # a child that failed before reading: its report says why
            os.write(self._path_w, library_path.encode()[:MAX_LIBRARY_PATH])
        os.close(self._path_w)

        def report() -> NvmlReport:
            with os.fdopen(self._report_r, "rb") as pipe:
                data = pipe.read()
            os.waitpid(self.pid, 0)
            try:
                ok, values = marshal.loads(data)
                if not ok:
                    raise DiscoveryError(str(values))
                return _report_from(values)
            except DiscoveryError:
                raise
            except Exception:  # noqa: BLE001 - a child that died mid-way
                raise DiscoveryError(f"NVML query of {library_path} died without an answer") from None

        return report

    def cancel(self) -> None:
        """End the child unasked (it holds nothing of ours) and reap it."""
        import signal

        os.close(self._path_w)
        os.close(self._report_r)
        with suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def _serve_one_query(path_r: int, report_w: int) -> NoReturn:
    """In the child: no device powers, pynvml imported, then the path read to its end and `query`'s report
    written back; exits (silently, when the parent closed the path unwritten: Child.cancel)."""
    import marshal

    try:
        _drop_device_powers()
        import_pynvml()
        path = b""
        while chunk := os.read(path_r, MAX_LIBRARY_PATH):
            path = (path + chunk)[:MAX_LIBRARY_PATH]
        if not path:
            os._exit(0)
        result: object = (True, _report_values(query(path.decode(errors="surrogateescape"))))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as one line
        result = (False, str(exc) if isinstance(exc, DiscoveryError) else f"NVML query: {exc}")
    try:
        with os.fdopen(report_w, "wb") as out:
            marshal.dump(result, out)
    finally:
        os._exit(0)


def version_in_name(library_path: str) -> str | None:
    """The driver version a `libnvidia-ml.so.<version>` file name carries (the file libnvidia-ml.so.1 leads to),
    else None: what NVML will most likely report, so the driver's files can be scanned while it is asked."""
    name = library_path.rpartition("/")[2]
    prefix = "libnvidia-ml.so."
    version = name[len(prefix):] if name.startswith(prefix) else ""
    parts = version.split(".")
    return version if len(parts) >= 2 and all(p.isdigit() for p in parts) else None


def _report_values(report: NvmlReport) -> tuple[object, ...]:
    """The report as marshal's values: each record a tuple of its fields, in order."""
    def gpu(g: NvmlGpu) -> tuple[object, ...]:
        return tuple([tuple(getattr(m, k) for k in NvmlMig._fields) for m in g.migs] if f == "migs"
                     else getattr(g, f) for f in NvmlGpu._fields)

    return report.driver_version, report.cuda_version, [gpu(g) for g in report.gpus]


def _report_from(values: tuple[object, ...]) -> NvmlReport:
    """_report_values' inverse."""
    driver_version, cuda_version, gpus = values
    out = []
    for fields in gpus:  # type: ignore[attr-defined]
        gpu = dict(zip(NvmlGpu._fields, fields))
        gpu["migs"] = [NvmlMig(*mig) for mig in gpu["migs"]]  # (marshal keeps lists and tuples as they were)
        out.append(NvmlGpu(**gpu))
    return NvmlReport(driver_version, cuda_version, out)  # type: ignore[arg-type]


def query(library_path: str) -> NvmlReport:
    """Everything gpuhook needs from NVML, in one init/shutdown."""
    with bound_nvml(library_path) as nv:
        try:
            count = nv.nvmlDeviceGetCount()
            gpus = [_gpu(nv, i) for i in range(count)]
            _topology(nv, gpus)
            return NvmlReport(
                driver_version=_text(nv.nvmlSystemGetDriverVersion()),
                cuda_version=_cuda_version(nv),
                gpus=gpus,
            )
        except nv.NVMLError as exc:
            raise DiscoveryError(f"NVML query failed ({library_path}): {exc}") from None
