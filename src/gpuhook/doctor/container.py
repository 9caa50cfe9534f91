"""One container, step by step: what gpuhook would inject and why, or why nothing.

The steps are the hook's own (hook.run / shim.prepare): request.parse_request with the config's policy,
selection.resolve, requirements.check, edits.plan. Each is called as they call it; doctor only words the outcome.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuhook.doctor import datacenter
from gpuhook.doctor.model import INFO, OK, PROBLEM, Finding
from gpuhook.errors import RequestError, RequirementError, clip
from gpuhook.hook.config import Config
from gpuhook.model import catalogue
from gpuhook.model import requirements as require
from gpuhook.model.edits import plan
from gpuhook.model.inventory import Gpu, Inventory, MigDevice
from gpuhook.model.record import Record, field
from gpuhook.model.report import edits_to_dict, format_edits
from gpuhook.model.request import (
    CDI_ANNOTATION_PREFIX,
    DISABLE_REQUIRE,
    DRIVER_CAPABILITIES,
    IMEX_CHANNELS,
    LEGACY_CUDA_VERSION,
    VISIBLE_DEVICES,
    VOLUME_MOUNT_DIR,
    Request,
    env_map,
    is_privileged,
    is_true,
    parse_request,
    requirement_keys,
)
from gpuhook.model.selection import device_names, find_device, resolve

NVIDIA_MAJOR = 195
SHOWN_ENV = ("NVIDIA_", LEGACY_CUDA_VERSION)


class ContainerInput(Record):
    """What the hook reads from a bundle: env, mounts, annotations, privilege; plus the nodes config.json has."""

    origin: str
    env: tuple[str, ...] = ()
    mounts: tuple[Mapping[str, Any], ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    privileged: bool = False
    config_devices: tuple[Mapping[str, Any], ...] = ()


def from_bundle(path: str) -> ContainerInput:
    from gpuhook.oci.bundle import load_bundle

    bundle = load_bundle(path)
    linux = bundle.config.get("linux")
    devices = linux.get("devices") if isinstance(linux, dict) else None
    return ContainerInput(f"bundle {path}", tuple(bundle.env), tuple(bundle.mounts), bundle.annotations,
                          is_privileged(bundle.process, bundle.oci_version),
                          tuple(d for d in devices if isinstance(d, dict)) if isinstance(devices, list) else ())


def from_env(env: Sequence[str], annotations: Mapping[str, str] | None = None, privileged: bool = False,
             device_mounts: Sequence[str] = ()) -> ContainerInput:
    mounts = tuple({"destination": f"{VOLUME_MOUNT_DIR}/{d}", "source": "/dev/null", "type": "bind"}
                   for d in device_mounts)
    return ContainerInput("--env", tuple(env), mounts, dict(annotations or {}), privileged)


def describe(device: Gpu | MigDevice) -> str:
    if isinstance(device, Gpu):
        extra = ", ".join(x for x in (device.uuid, device.pci_bus_id) if x)
        return f"GPU {device.index}" + (f" ({extra})" if extra else "")
    return f"MIG device {device.name}" + (f" ({device.uuid}, {device.profile})" if device.uuid else "")


class _Steps:
    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.n = 0

    def add(self, status: str, message: str, fix: str = "", detail: Sequence[str] = ()) -> None:
        self.n += 1
        self.findings.append(Finding("container", status, f"{self.n}. {message}", fix, tuple(detail)))


def _input_line(inp: ContainerInput) -> str:
    """What the container asks with; every value is the image's or the pod's, so each is clipped, and so is
    each list (an image can set thousands of variables)."""
    shown = [clip(e, quote=False) for e in inp.env if e.startswith(SHOWN_ENV)]
    parts = [clip(", ".join(shown), 1000, quote=False) if shown else "no NVIDIA_* variables"]
    devices = [clip(str(m.get("destination")), quote=False) for m in inp.mounts
               if str(m.get("destination", "")).startswith(VOLUME_MOUNT_DIR + "/")]
    if devices:
        parts.append("device mounts " + clip(", ".join(devices), 1000, quote=False))
    cdi = {k: v for k, v in inp.annotations.items() if k.startswith(CDI_ANNOTATION_PREFIX)}
    if cdi:
        shown_cdi = ", ".join(clip(f"{k}={v}", quote=False) for k, v in cdi.items())
        parts.append("annotations " + clip(shown_cdi, 1000, quote=False))
    parts.append("privileged (CAP_SYS_ADMIN)" if inp.privileged else "unprivileged")
    return f"container ({inp.origin}): " + "; ".join(parts)


def _request_fix(message: str) -> str:
    if "capability" in message:
        return (f"set NVIDIA_DRIVER_CAPABILITIES to a comma list of {', '.join(catalogue.CAPABILITIES)} or all "
                "(or add the capability to supported-capabilities in the config)")
    if "IMEX" in message:
        return (f"set {IMEX_CHANNELS} to a comma list of channel numbers "
                f"(0..{catalogue.IMEX_CHANNEL_MAX}), channel<N>, or all")
    if "privileged" in message:
        return "run the container with CAP_SYS_ADMIN, or drop NVIDIA_MIG_CONFIG_DEVICES/NVIDIA_MIG_MONITOR_DEVICES"
    return "correct the variable named above"


def _why_nothing(steps: _Steps, request: Request, inp: ContainerInput, config: Config) -> str:
    """Report a request that gets nothing; returns the outcome word."""
    gpu_nodes = [d.get("path") for d in inp.config_devices if d.get("major") == NVIDIA_MAJOR]
    env = env_map(inp.env)
    if request.notes:
        other = ("a device mount at /var/run/nvidia-container-devices/<id> or a cdi.k8s.io/ annotation"
                 if config.accept_volume_mounts else "a cdi.k8s.io/ annotation")
        steps.add(PROBLEM, f"no GPU: {'; '.join(request.notes)} (policy of {config.source})",
                  f"request the GPUs with {other}, or set accept-envvar-unprivileged = true in {config.source}")
        return "nothing"
    if request.kind == "void":
        value = env.get(VISIBLE_DEVICES, "")
        if gpu_nodes:
            steps.add(OK, f"{VISIBLE_DEVICES}={clip(value)} and config.json already has "
                          f"{', '.join(map(str, gpu_nodes))}: a CDI runtime or gpuhook-runtime applied the edits; "
                          "the hook stays out")
            return "applied"
        steps.add(PROBLEM, f"no GPU: {VISIBLE_DEVICES} is {'void' if value.strip() else 'empty'}, which means "
                           "'leave this container untouched' (CDI specs set it so that no hook injects twice)",
                  f"{VISIBLE_DEVICES}=all (or the GPUs it should get)")
        return "nothing"
    if env.get(LEGACY_CUDA_VERSION):
        why = (f"{VISIBLE_DEVICES} is unset (CUDA_VERSION is set, but with NVIDIA_REQUIRE_CUDA, which makes it no "
               "legacy CUDA image)")
    elif LEGACY_CUDA_VERSION in env:
        why = f"{VISIBLE_DEVICES} is unset (and CUDA_VERSION is empty: no legacy CUDA image either)"
    else:
        why = f"{VISIBLE_DEVICES} is unset (and CUDA_VERSION is not: no legacy CUDA image either)"
    steps.add(PROBLEM, f"no GPU: {why}: gpuhook does not treat it as a GPU container",
              f"{VISIBLE_DEVICES}=all (or the GPUs it should get)")
    return "nothing"


def _request_line(request: Request) -> str:
    what = {"all": "every GPU", "none": "no GPU, only the driver files and control nodes"}.get(
        request.kind, clip(", ".join(request.devices), 1000, quote=False))
    source = {"env": f"from {VISIBLE_DEVICES}", "volume-mounts": "from device volume mounts (they win over the env)",
              "cdi-annotations": "from cdi.k8s.io/ annotations (they win over mounts and env)",
              "legacy-image": "a legacy CUDA image (CUDA_VERSION without NVIDIA_REQUIRE_CUDA) means all GPUs"
              }.get(request.source, request.source)
    mig = [n for n, on in (("MIG config", request.mig_config), ("MIG monitor", request.mig_monitor)) if on]
    return f"request: {what} ({source})" + (f"; plus {' and '.join(mig)} capability nodes" if mig else "")


def _selection_line(inv: Inventory, request: Request, devices: Sequence[Gpu | MigDevice]) -> tuple[str, list[str]]:
    if request.kind == "none":
        return "devices: none", []
    lines = []
    if request.kind == "all":
        for gpu in inv.gpus:
            if gpu.mig_enabled and gpu.mig_devices:
                lines.append(f"all: GPU {gpu.index} is in MIG mode, so it contributes its MIG devices "
                             f"{', '.join(m.name for m in gpu.mig_devices)}")
    else:
        for ident in request.devices:
            found = find_device(inv, ident)
            if found is not None:
                lines.append(f"{clip(ident)} → {describe(found)}")
    return "devices: " + "; ".join(describe(d) for d in devices), lines


def _capability_line(request: Request, env: Mapping[str, str]) -> str:
    caps = sorted(request.capabilities)
    expanded = sorted(catalogue.expand_capabilities(request.capabilities) - request.capabilities)
    source = DRIVER_CAPABILITIES if env.get(DRIVER_CAPABILITIES, "").strip() else "default"
    extra = f" (which bring {', '.join(expanded)} too)" if expanded else ""
    return f"capabilities: {', '.join(caps)} ({source}){extra}"


def explain(inp: ContainerInput, inv: Inventory | None, config: Config) -> tuple[list[Finding], dict[str, Any]]:
    """Findings for each step and a JSON summary: outcome inject | applied | nothing | fail."""
    steps = _Steps()
    summary: dict[str, Any] = {"origin": inp.origin, "outcome": "fail", "request": None, "devices": [], "edits": None}
    steps.add(INFO, _input_line(inp))
    env = env_map(inp.env)
    try:
        request = parse_request(inp.env, inp.mounts, inp.annotations, inp.privileged, config.policy)
    except RequestError as exc:
        steps.add(PROBLEM, f"the start would fail: {exc}", _request_fix(str(exc)))
        return steps.findings, summary
    summary["request"] = {"kind": request.kind, "devices": list(request.devices), "source": request.source,
                          "capabilities": sorted(request.capabilities), "requirements": list(request.requirements),
                          "notes": list(request.notes)}
    if not request.wants_gpu_setup:
        summary["outcome"] = _why_nothing(steps, request, inp, config)
        ignored = datacenter.asked_without_gpu(env)
        if ignored:
            steps.add(INFO, f"{', '.join(ignored)} ignored too: datacenter devices come only with a GPU request "
                            "(as in NVIDIA's hook)")
        return steps.findings, summary
    steps.add(OK, _request_line(request))
    if inv is None:
        steps.add(PROBLEM, "the start would fail: no NVIDIA driver found (see host)", "see the host section")
        return steps.findings, summary
    try:
        selection = resolve(inv, request)
    except RequestError as exc:
        fix = (datacenter.imex_fix(inv) if "IMEX" in str(exc)
               else f"{VISIBLE_DEVICES}=<comma list of: {', '.join(device_names(inv))}>")
        steps.add(PROBLEM, f"the start would fail: {exc}", fix)
        return steps.findings, summary
    line, detail = _selection_line(inv, request, selection.devices)
    steps.add(OK, line, detail=detail)
    summary["devices"] = [describe(d) for d in selection.devices]
    steps.add(OK, _capability_line(request, env))
    failed = _requirements(steps, inv, request, env, selection.devices)
    if failed:
        return steps.findings, summary
    for ok, message, fix in datacenter.lines(inv, request, selection):
        steps.add(OK if ok else PROBLEM, message, fix)
    edits = plan(inv, selection)
    summary["edits"] = edits_to_dict(edits)
    summary["outcome"] = "inject"
    steps.add(OK, f"gpuhook would inject {len(edits.device_nodes)} device node(s), {len(edits.mounts)} mount(s), "
                  f"{len(edits.symlinks)} link(s) and an ld cache for {', '.join(edits.ld_dirs) or 'nothing'}",
              detail=format_edits(edits).splitlines())
    return steps.findings, summary


def _requirements(steps: _Steps, inv: Inventory, request: Request, env: Mapping[str, str],
                  devices: Sequence[Gpu | MigDevice]) -> bool:
    """One step per constraint (each evaluated alone, as require.check does, so every unmet one is named); True if
    one fails."""
    asked = requirement_keys(env)
    if asked and not request.requirements:
        why = DISABLE_REQUIRE if is_true(env.get(DISABLE_REQUIRE)) else "disable-require in the config"
        steps.add(INFO, f"requirements {clip(', '.join(asked), 1000, quote=False)} not checked ({why})")
        return False
    failed = False
    for constraint in request.requirements:
        try:
            outcomes = require.check(inv, (constraint,), tuple(devices))
        except RequirementError as exc:
            failed = True
            steps.add(PROBLEM, f"the start would fail: {exc}",
                      f"a driver that meets it, or {DISABLE_REQUIRE}=true to start without the check")
        except RequestError as exc:
            failed = True
            steps.add(PROBLEM, f"the start would fail: {exc}", "correct the NVIDIA_REQUIRE_* value")
        else:
            steps.add(OK, f"requirement {clip(constraint)} is met: {_deciding(outcomes)}",
                      detail=[_RULE])
    return failed


# How NVIDIA (and gpuhook) read a value, shown under every met requirement: users most often read it backwards.
_RULE = ("space-separated terms are alternatives (OR), comma-separated factors must all hold (AND); "
         "the first term that holds decides; separate NVIDIA_REQUIRE_* variables must all hold")


def _deciding(outcomes: Sequence[require.Outcome]) -> str:
    """Which term decided on each device profile, with the host's values it was judged on."""
    parts = []
    for o in outcomes:
        where = f" on GPU {o.gpu}" if o.gpu is not None else ""
        which = (f"term {o.term + 1} of {len(o.terms)} {clip(o.deciding_term)}" if o.term is not None
                 else "no term")
        parts.append(f"{which} holds{where} ({o.host()})")
    return "; ".join(parts)
