"""NVIDIA k8s-device-plugin v0.20.0's flags and environment variables, and what gpuhook's plugin does with each.

The list is NVIDIA's `cmd/nvidia-device-plugin/main.go` (c.Flags: each flag's name, aliases and EnvVars) plus
the variables its code reads itself (`internal/rm/health.go`: DP_DISABLE_HEALTHCHECKS, DP_ENABLE_HEALTHCHECKS),
and what its Helm chart sets (`deployments/helm/nvidia-device-plugin/templates/daemonset-device-plugin.yml`).
A DaemonSet or chart written for NVIDIA's plugin runs gpuhook's unchanged: every entry is either taken with
NVIDIA's meaning (`param`: gpuhook's click parameter that holds it), taken for some values only (`accepted`),
or refused with one line naming what to use instead (`instead`). Data only: cli/plugin.py builds the options.
"""

from __future__ import annotations

from gpuhook.model.contract import CDI_ANNOTATION_PREFIX
from gpuhook.model.record import Record


class NvidiaFlag(Record):
    """One of NVIDIA's flags: `names` (the flag, then its aliases), `env` (its EnvVars, first wins as in
    urfave/cli), `param` (the gpuhook setting it feeds; "" when it has no effect here), `accepted` (the only
    values taken, None: any; anything else is refused with `instead`)."""

    names: tuple[str, ...]
    env: tuple[str, ...]
    param: str
    accepted: tuple[str, ...] | None = None
    instead: str = ""


FLAGS: tuple[NvidiaFlag, ...] = (
    NvidiaFlag(("mig-strategy",), ("MIG_STRATEGY",), "mig_strategy"),
    NvidiaFlag(("fail-on-init-error",), ("FAIL_ON_INIT_ERROR",), "fail_on_init_error"),
    NvidiaFlag(("driver-root", "nvidia-driver-root"), ("NVIDIA_DRIVER_ROOT",), "driver_root"),  # the host's
    NvidiaFlag(("dev-root", "nvidia-dev-root"), ("NVIDIA_DEV_ROOT",), "dev_root"),  # the host's
    NvidiaFlag(("pass-device-specs",), ("PASS_DEVICE_SPECS",), "pass_device_specs"),
    NvidiaFlag(("device-list-strategy",), ("DEVICE_LIST_STRATEGY",), "device_list_strategy"),
    NvidiaFlag(("device-id-strategy",), ("DEVICE_ID_STRATEGY",), "device_id_strategy"),
    NvidiaFlag(("gdrcopy-enabled",), ("GDRCOPY_ENABLED",), "gdrcopy_enabled"),
    NvidiaFlag(("gds-enabled",), ("GDS_ENABLED",), "gds_enabled"),
    NvidiaFlag(("mofed-enabled",), ("MOFED_ENABLED",), "mofed_enabled"),
    NvidiaFlag(("cdi-annotation-prefix",), ("CDI_ANNOTATION_PREFIX",), "cdi_annotation_prefix",
               accepted=(CDI_ANNOTATION_PREFIX,),
               instead=f"gpuhook's annotations use {CDI_ANNOTATION_PREFIX} (what runtimes read): drop the setting"),
    NvidiaFlag(("nvidia-cdi-hook-path", "nvidia-ctk-path"), ("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
               "nvidia_cdi_hook_path", accepted=(),
               instead="the CDI spec's hooks run gpuhook, not nvidia-cdi-hook: use --hook-path (gpuhook's path on "
                       "the host)"),
    NvidiaFlag(("driver-root-ctr-path", "container-driver-root"), ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
               "driver_root_ctr_path"),
    # Used only by MPS sharing (sharing.mps in the config file, refused there); the chart always sets it.
    NvidiaFlag(("mps-root",), ("MPS_ROOT",), "mps_root"),
    NvidiaFlag(("shared-devices-allocation-policy",), ("SHARED_DEVICES_ALLOCATION_POLICY",),
               "shared_devices_allocation_policy", accepted=("distributed",),
               instead="gpuhook spreads replicas over GPUs (distributed) only: drop the setting"),
    NvidiaFlag(("device-discovery-strategy",), ("DEVICE_DISCOVERY_STRATEGY",), "discovery",
               accepted=("auto", "nvml"), instead="gpuhook discovers GPUs through NVML (auto or nvml); Tegra "
                                                  "boards are not supported"),
    NvidiaFlag(("imex-channel-ids",), ("IMEX_CHANNEL_IDS",), "imex_channel_ids", accepted=(),
               instead="gpuhook's plugin gives no IMEX channels: set NVIDIA_IMEX_CHANNELS in the pod (gpuhook's "
                       "hook honours it) or use generate-cdi --mode imex"),
    NvidiaFlag(("imex-required",), ("IMEX_REQUIRED",), "imex_required", accepted=("false",),
               instead="gpuhook's plugin gives no IMEX channels: drop the setting"),
    NvidiaFlag(("kubelet-socket",), ("KUBELET_SOCKET",), "kubelet_socket"),
    NvidiaFlag(("config-file",), ("CONFIG_FILE",), "config_file"),
    NvidiaFlag(("cdi-feature-flags",), ("CDI_FEATURE_FLAGS",), "cdi_feature_flags", accepted=(),
               instead="gpuhook's CDI spec has no nvidia-ctk feature flags: drop the setting"),
    NvidiaFlag(("cdi-disable-hooks",), ("CDI_DISABLE_HOOKS",), "cdi_disable_hooks", accepted=(),
               instead="gpuhook's CDI spec has one hook (links and the ld cache), which containers need: drop "
                       "the setting"),
)

# Read by NVIDIA's code from the environment, not flags (internal/rm/health.go): comma lists of XIDs, or
# `all`/`xids`; an XID enabled wins over one disabled (explicitly or by default).
DISABLE_HEALTHCHECKS = "DP_DISABLE_HEALTHCHECKS"
ENABLE_HEALTHCHECKS = "DP_ENABLE_HEALTHCHECKS"
ALL_XIDS = ("all", "xids")

# The gated families' variables in the plugin's own environment, as Allocate sets them (NVIDIA_GDS=enabled …):
# taken like the *_ENABLED flags, for DaemonSets that set the container-side names on the plugin.
GATED_FLAGS = {"gdrcopy_enabled": "NVIDIA_GDRCOPY", "gds_enabled": "NVIDIA_GDS", "mofed_enabled": "NVIDIA_MOFED"}


def health_settings(ignored: frozenset[int], environ: dict[str, str] | None = None) -> tuple[bool, frozenset[int]]:
    """(health checks on, XIDs ignored) after DP_DISABLE_HEALTHCHECKS/DP_ENABLE_HEALTHCHECKS over the `ignored`
    default, as NVIDIA's getDisabledHealthCheckXids reads them: items trimmed and lower-cased, empty or malformed
    ones skipped; `all` (or `xids`) disabled turns the checks off unless `all` is enabled too; `all` enabled counts
    every XID; an XID named in both is enabled."""
    import os

    env = os.environ if environ is None else environ

    def parse(name: str) -> tuple[bool, frozenset[int]]:
        out: set[int] = set()
        for item in env.get(name, "").lower().split(","):
            item = item.strip()
            if item in ALL_XIDS:
                return True, frozenset()
            if item.isascii() and item.isdigit() and len(item) <= 20:
                out.add(int(item))
        return False, frozenset(out)

    all_off, disabled = parse(DISABLE_HEALTHCHECKS)
    all_on, enabled = parse(ENABLE_HEALTHCHECKS)
    if all_on:
        return True, frozenset()
    if all_off:
        return False, ignored
    return True, (ignored | disabled) - enabled
