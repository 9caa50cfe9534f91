"""Names of the NVIDIA container contract that one side writes and another reads: the request parser, the
hook's fast path, the device plugin's Allocate and the CDI generator must spell them identically.

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
