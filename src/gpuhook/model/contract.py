"""Names of the NVIDIA container contract that one side writes and another reads: the request parser, the
hook's no-GPU check, the device plugin's Allocate and the CDI generator must spell them identically.

Import-free, so the hook's no-GPU fast path can use it at no cost.
"""

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
DRIVER_CAPABILITIES = "NVIDIA_DRIVER_CAPABILITIES"
REQUIRE_PREFIX = "NVIDIA_REQUIRE_"
DISABLE_REQUIRE = "NVIDIA_DISABLE_REQUIRE"
MIG_CONFIG = "NVIDIA_MIG_CONFIG_DEVICES"
MIG_MONITOR = "NVIDIA_MIG_MONITOR_DEVICES"
LEGACY_CUDA_VERSION = "CUDA_VERSION"  # set by CUDA images older than NVIDIA_VISIBLE_DEVICES
VOLUME_MOUNT_DIR = "/var/run/nvidia-container-devices"  # a /dev/null mount at <dir>/<id> requests <id>
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_KIND = "nvidia.com/gpu"
# The device plugin's CDI devices, a kind of their own (NVIDIA's plugin's: k8s-device-plugin v0.20.0,
# cmd/nvidia-device-plugin/plugin-manager.go, cdi.WithVendor; class "gpu"), never the host spec's CDI_KIND.
PLUGIN_CDI_VENDOR = "k8s.device-plugin.nvidia.com"
PLUGIN_CDI_KIND = PLUGIN_CDI_VENDOR + "/gpu"
# Datacenter devices, honoured only in a GPU container (NVIDIA's hook and its feature-gated modifier likewise skip
# a container that asks for no GPU), so has_gpu_signal needs no clause for them.
IMEX_CHANNELS = "NVIDIA_IMEX_CHANNELS"  # comma list of channel ids, channel<N>, or all
IMEX_VOLUME_MOUNT_DIR = VOLUME_MOUNT_DIR + "/imex"  # a /dev/null mount at <dir>/<id> requests channel <id>
IMEX_CDI_CLASS = "imex-channel"  # nvidia-ctk's class for IMEX channels: nvidia.com/imex-channel=<id>
ENABLED = "enabled"  # the one value that turns a gated device family on
# Gated device families: name (also the CDI class, as nvidia-ctk's modes: nvidia.com/<name>=all) -> variable.
GATED_DEVICE_ENV: dict[str, str] = {
    "nvswitch": "NVIDIA_NVSWITCH",
    "gds": "NVIDIA_GDS",
    "mofed": "NVIDIA_MOFED",
    "gdrcopy": "NVIDIA_GDRCOPY",
}
# gpuhook's own, between its device plugin and its hook or shim. Allocate sets the marker to the CDI names it
# returned beside NVIDIA_VISIBLE_DEVICES; the spec those names resolve to sets NVIDIA_VISIBLE_DEVICES=void, so a
# container that still carries the marker with a non-void variable was started by a runtime that ignored its CDI
# devices (model/request.py: Request.cdi_ignored). The hook or shim that injects it then leaves one record,
# CDI_IGNORED_RECORD in the state directory (model/cdiignored.py), which the plugin watches and reports once.
CDI_DEVICES_MARKER = "GPUHOOK_CDI_DEVICES"
# The PATH gpuhook's hooks are given (CDI specs, oci-hooks.d, runc's base spec) and where doctor looks for the
# program `docker run --gpus` runs: systemd's default, which dockerd and containerd start with.
PACKAGED_HOOK_PATH = "/usr/bin/gpuhook-hook"  # the Debian package's hook entry (packaging/build.py)
HOOK_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
LD_CONF_FILE = "/etc/ld.so.conf.d/00-gpuhook.conf"  # in a container: its injected ld folders (inject/ldcache.py)
SERVICE_SOCKET = "/run/gpuhook/service.sock"  # `gpuhook service` and every client (entry.c's DEFAULT_SOCKET too)
SERVICE_SOCKET_ENV = "GPUHOOK_SERVICE_SOCKET"  # names another socket, to the service and its clients alike
SERVED_BY_ENV = "GPUHOOK_SERVED_BY"  # set by the native entry for its Python fallback: why it ran in-process
STATE_DIR = "/run/gpuhook/records"  # node-local, root's: the hook config's state-dir, the plugin's --hook-state-dir
# (a folder of its own: the DaemonSet mounts it into the plugin, never the service socket or inventory beside it)
CDI_IGNORED_RECORD = "cdi-ignored"
# In the state directory, root's alone: the node's secret the device plugin seals its CDI marker with (a MAC over
# the CDI names), so that a record is written only for a marker this node's plugin made, never for one an image
# sets in its own environment (model/cdiignored.seal).
PLUGIN_KEY = "plugin.key"


def has_gpu_signal(env: list[str], mounts: list[dict[str, object]], annotations: dict[str, str],
                   swarm_resource: tuple[str, ...] = (),
                   annotation_prefixes: tuple[str, ...] = (CDI_ANNOTATION_PREFIX,)) -> bool:
    """Whether anything could make this a GPU container: the env var (or a configured swarm-resource variable),
    a legacy CUDA image's CUDA_VERSION, a device volume mount, a CDI annotation. Without any, request.parse_request
    answers "unset" under every policy, so the hook stops here without loading the parser; with one, the parser
    decides."""
    starts = tuple(name + "=" for name in (VISIBLE_DEVICES, LEGACY_CUDA_VERSION, *swarm_resource))
    if any(e.startswith(starts) for e in env):
        return True
    if annotation_prefixes and any(k.startswith(annotation_prefixes) for k in annotations):
        return True
    # Any destination naming the folder (the parser cleans paths as Go's filepath.Clean does: `//var/run/…/0`)
    folder = VOLUME_MOUNT_DIR.rsplit("/", 1)[1]
    return any(isinstance(m.get("destination"), str) and folder in str(m.get("destination")) for m in mounts)
