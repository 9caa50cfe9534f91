"""The driver's user-space file catalogue: the one list that discovery, the fake driver and planning share.

It reproduces libnvidia-container's per-capability lists (DESIGN.md), completed with what NVIDIA's real
packages ship (docs: the real-driver fact sheet). Discovery takes the files as the truth (every
`*.so.<driver version>` beside libcuda, sonames read from the ELF) and uses this table only to *classify*
them; the simulated driver creates what the table says, with the sonames the real files have.
"""

from __future__ import annotations

from gpuhook.model.record import Record

CAPABILITIES: tuple[str, ...] = ("compute", "utility", "video", "graphics", "display", "compat32", "ngx")
# A driver-version library the table does not know: CDI still mounts it (as nvidia-ctk does), the hook's
# capability lists never select it, `info` shows it under this name.
UNCLASSIFIED = "unclassified"
DEFAULT_CAPABILITIES: tuple[str, ...] = ("utility", "compute")

LIB_DIR = "/usr/lib/x86_64-linux-gnu"
LIB32_DIR = "/usr/lib/i386-linux-gnu"
FIRMWARE_DIR = "/lib/firmware/nvidia"
# Where discovery looks for the driver's libraries besides the ld cache's folders; the inventory's fingerprint
# stamps them (and the ld cache), so a library added, removed, replaced or relinked there invalidates a plan.
LIB64_SCAN_DIRS: tuple[str, ...] = (
    LIB_DIR,
    "/usr/lib64",
    "/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    f"{LIB_DIR}/nvidia/current",
)
LIB32_SCAN_DIRS: tuple[str, ...] = (
    LIB32_DIR,
    "/usr/lib32",
    "/lib32",
    f"{LIB32_DIR}/nvidia/current",
)
LD_CACHE = "/etc/ld.so.cache"


class LibrarySpec(Record):
    """One driver library: `lib<name>.so.<driver version>` (or `.so.<file_version>`).

    `soname_version` is what the real file's DT_SONAME carries and what the simulated driver gives it:
    None the full driver version (libnvidia-glcore & co: soname = file name), "" no soname at all
    (libnvidia-vulkan-producer). Discovery never takes a soname from here: it reads the ELF.
    `file_version` names a library shipped under a fixed name instead of the driver version
    (libnvidia-api.so.1).
    """

    name: str
    capability: str
    soname_version: str | None
    subdir: str = ""  # e.g. "vdpau" for libvdpau_nvidia
    file_version: str = ""

    def file_name(self, driver_version: str) -> str:
        return f"{self.name}.so.{self.file_version or driver_version}"

    def soname(self, driver_version: str) -> str:
        if self.soname_version == "":
            return ""
        return f"{self.name}.so.{self.soname_version or driver_version}"


TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; the aliases are for type checkers only
if TYPE_CHECKING:  # (a runtime `A | B` of classes needs Python 3.10)
    _Entry = tuple[str, str | None] | tuple[str, str | None, str] | tuple[str, str | None, str, str]


def _libs(capability: str, *entries: _Entry) -> list[LibrarySpec]:
    return [LibrarySpec(e[0], capability, *e[1:]) for e in entries]


LIBRARIES: tuple[LibrarySpec, ...] = tuple(
    _libs("utility", ("libnvidia-ml", "1"), ("libnvidia-cfg", "1"), ("libnvidia-nscq", "2"))
    + _libs(
        "compute",
        ("libcuda", "1"),
        ("libcudadebugger", "1"),
        ("libnvidia-opencl", "1"),
        ("libnvidia-gpucomp", None),
        ("libnvidia-ptxjitcompiler", "1"),
        ("libnvidia-fatbinaryloader", None),
        ("libnvidia-allocator", "1"),
        ("libnvidia-compiler", None),
        ("libnvidia-pkcs11", None),
        ("libnvidia-pkcs11-openssl3", None),
        ("libnvidia-nvvm", "4"),
    )
    + _libs(
        "video",
        ("libvdpau_nvidia", "1", "vdpau"),
        ("libnvidia-encode", "1"),
        ("libnvidia-opticalflow", "1"),
        ("libnvcuvid", "1"),
    )
    + _libs(
        "graphics",
        ("libnvidia-eglcore", None),
        ("libnvidia-glcore", None),
        ("libnvidia-tls", None),
        ("libnvidia-glsi", None),
        ("libnvidia-fbc", "1"),
        ("libnvidia-ifr", "1"),
        ("libnvidia-rtcore", None),
        ("libnvoptix", "1"),
        ("libGLX_nvidia", "0"),
        ("libEGL_nvidia", "0"),
        ("libGLESv2_nvidia", "2"),
        ("libGLESv1_CM_nvidia", "1"),
        ("libnvidia-glvkspirv", None),
        ("libnvidia-cbl", None),
        ("libnvidia-vulkan-producer", ""),
        ("libnvidia-vksc-core", "1"),
        ("libnvidia-api", "1", "", "1"),
        ("libnvidia-gtk2", None),
        ("libnvidia-gtk3", None),
    )
    + _libs("ngx", ("libnvidia-ngx", "1"))
)

# Libraries of the driver's packages found by their place, not by the driver version.
# The EGL external platform libraries carry their own versions (libnvidia-egl-gbm.so.1.1.0): the JSON files
# in these folders name them by soname, and mounting a JSON without its library breaks EGL.
EGL_PLATFORM_DIRS: tuple[str, ...] = ("/usr/share/egl/egl_external_platform.d", "/etc/egl/egl_external_platform.d")
EGL_PLATFORM_CAPABILITY = "graphics"
# The GBM backend: <libdir>/gbm/nvidia-drm_gbm.so -> ../<allocator soname> (NVIDIA's create-symlinks hook).
GBM_ALLOCATOR = "libnvidia-allocator"
GBM_BACKEND_LINK = "gbm/nvidia-drm_gbm.so"


class XorgModuleSpec(Record):
    """An X server module of the driver: `{version}` in the name stands for the driver version."""

    folder: str  # "drivers" or "extensions"
    name: str
    capability: str = "display"
    link: str = ""  # an unversioned name the container gets as a link to the file


XORG_MODULES: tuple[XorgModuleSpec, ...] = (
    XorgModuleSpec("drivers", "nvidia_drv.so"),
    XorgModuleSpec("extensions", "libglxserver_nvidia.so.{version}", link="libglxserver_nvidia.so"),
)
# Where the X modules live (NVIDIA's graphics discoverer searches the same, after the library folder's own
# nvidia/xorg and xorg/modules): `{folder}` is drivers or extensions.
XORG_MODULE_DIRS: tuple[str, ...] = (
    "/usr/lib/xorg/modules/{folder}",
    "/usr/lib/xorg/modules/updates/{folder}",
    "/usr/lib64/xorg/modules/{folder}",
    "/usr/lib64/xorg/modules/updates/{folder}",
    "/usr/lib/x86_64-linux-gnu/xorg/modules/{folder}",
    "/usr/X11R6/lib/modules/{folder}",
    "/usr/X11R6/lib64/modules/{folder}",
)

# Development links created in the container: link name -> soname it points to (same directory).
DEV_LINKS: dict[str, str] = {
    "libcuda.so": "libcuda.so.1",
    "libnvidia-ml.so": "libnvidia-ml.so.1",
    "libGLX_indirect.so.0": "libGLX_nvidia.so.0",
    "libnvidia-opticalflow.so": "libnvidia-opticalflow.so.1",
}


class BinarySpec(Record):
    name: str
    capability: str


BINARIES: tuple[BinarySpec, ...] = (
    BinarySpec("nvidia-smi", "utility"),
    BinarySpec("nvidia-debugdump", "utility"),
    BinarySpec("nvidia-persistenced", "utility"),
    BinarySpec("nv-fabricmanager", "utility"),
    BinarySpec("nvidia-imex", "utility"),  # the IMEX daemon and its control client (multi-node NVLink)
    BinarySpec("nvidia-imex-ctl", "utility"),
    BinarySpec("nvidia-cuda-mps-control", "compute"),
    BinarySpec("nvidia-cuda-mps-server", "compute"),
)
BINARY_DIRS: tuple[str, ...] = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")


class IpcSpec(Record):
    """A unix socket or pipe directory; mounted only when present on the host."""

    path: str
    capability: str  # one capability; "compute" also covers "video"
    is_dir: bool = False


# /var/run is a link to /run on current distributions but a folder of its own on some: both are looked at.
RUN_ALIASES: tuple[tuple[str, str], ...] = (("/var/run/", "/run/"),)
IPC: tuple[IpcSpec, ...] = (
    IpcSpec("/var/run/nvidia-persistenced/socket", "utility"),
    IpcSpec("/var/run/nvidia-fabricmanager/socket", "utility"),
    IpcSpec("/tmp/nvidia-mps", "compute", is_dir=True),
)

# Graphics configuration files (canonical container paths); globs allowed in the last component.
GRAPHICS_CONFIGS: tuple[str, ...] = (
    "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    "/usr/share/vulkan/icd.d/nvidia_icd.json",
    "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
    "/usr/share/egl/egl_external_platform.d/*nvidia*.json",
    "/etc/OpenCL/vendors/nvidia.icd",
    "/usr/share/nvidia/nvoptix.bin",
)
# A config file may live under /etc instead of /usr/share on some distributions: same container path.
CONFIG_ALTERNATE_PREFIXES: dict[str, str] = {"/usr/share/vulkan/": "/etc/vulkan/", "/usr/share/glvnd/": "/etc/glvnd/"}

FIRMWARE_GLOB = "gsp*.bin"

# Device nodes (names under /dev).
CTL_NODE = "nvidiactl"  # 195:255
MODESET_NODE = "nvidia-modeset"  # 195:254
UVM_NODES: tuple[str, ...] = ("nvidia-uvm", "nvidia-uvm-tools")
NVIDIA_MAJOR = 195
DRI_MAJOR = 226
CAPS_DIR = "nvidia-caps"

# IMEX channels: /dev/nvidia-caps-imex-channels/channel<N>, minor N, major from /proc/devices (dynamic).
IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
IMEX_CHANNEL_PREFIX = "channel"
IMEX_DEVICES_NAME = "nvidia-caps-imex-channels"
IMEX_CHANNEL_MAX = (1 << 20) - 1  # the driver's channel count


class GatedDevices(Record):
    """A device family a container gets only on request (contract.GATED_DEVICE_ENV), as NVIDIA's
    internal/discover/{nvswitch,gds,mofed,gdrcopy}.go find them: node globs under the dev root, and files under the
    driver root that are mounted read-only only when at least one node was found (gds.go does so)."""

    name: str
    node_globs: tuple[str, ...]  # canonical; a glob only in the last component
    mounts: tuple[str, ...] = ()
    devices_name: str = ""  # the /proc/devices name of its (dynamic) major, for `info`


GATED: tuple[GatedDevices, ...] = (
    GatedDevices("nvswitch", ("/dev/nvidia-nvswitchctl", "/dev/nvidia-nvswitch*"), devices_name="nvidia-nvswitch"),
    GatedDevices("gds", ("/dev/nvidia-fs*",), ("/run/udev", "/etc/cufile.json"), devices_name="nvidia-fs"),
    GatedDevices("mofed", ("/dev/infiniband/uverbs*", "/dev/infiniband/rdma_cm"), devices_name="infiniband_verbs"),
    GatedDevices("gdrcopy", ("/dev/gdrdrv",), devices_name="gdrdrv"),
)

# Which capabilities pull in which others' files (DESIGN.md: video implies compute, display = graphics + modeset).
CAPABILITY_IMPLIES: dict[str, tuple[str, ...]] = {"video": ("compute",), "display": ("graphics",)}


def expand_capabilities(capabilities: frozenset[str] | set[str] | tuple[str, ...]) -> frozenset[str]:
    """Close a capability set under CAPABILITY_IMPLIES."""
    result = set(capabilities)
    for cap in list(result):
        result.update(CAPABILITY_IMPLIES.get(cap, ()))
    return frozenset(result)


def library_by_soname(driver_version: str) -> dict[str, LibrarySpec]:
    return {lib.soname(driver_version): lib for lib in LIBRARIES if lib.soname(driver_version)}


def library_by_name(name: str) -> LibrarySpec | None:
    """The table's entry for `lib<name>` (the file name without `.so.<version>`), None when unknown."""
    return _BY_NAME.get(name)


_BY_NAME: dict[str, LibrarySpec] = {lib.name: lib for lib in LIBRARIES}
