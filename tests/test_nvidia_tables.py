"""NVIDIA's own table tests, as data, run through gpuhook's request, selection and requirement code.

tests/data/nvidia_toolkit_v1.20.0.yaml holds the inputs and expected outcomes of the table-driven Go tests of
NVIDIA/nvidia-container-toolkit v1.20.0 (each case names its file, test and case); the few that pin an internal
structure with no observable behaviour are listed under `left_out` with the reason. tests/data/cuda_images.yaml
holds the requirement strings of published CUDA images and the outcome NVIDIA's rule gives on simulated hosts of
several driver branches. test_tables_e2e.py starts a sample of both in real containers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from support.inv import sample_inventory

from gpuhook.cdi.kinds import build_imex_spec
from gpuhook.errors import ConfigError, RequestError, RequirementError
from gpuhook.hook.config import Config, parse_config
from gpuhook.model import catalogue
from gpuhook.model.contract import CDI_KIND
from gpuhook.model.inventory import DeviceNode, Inventory
from gpuhook.model.record import replace
from gpuhook.model.request import (
    Policy,
    cdi_annotation_devices,
    checked_requirements,
    env_devices,
    foreign_cdi_names,
    imex_channel_request,
    is_privileged,
    legacy_cuda_version,
    parse_request,
    qualified_annotation_name,
    request_capabilities,
    volume_mount_devices,
)
from gpuhook.model.requirements import check
from gpuhook.model.selection import resolve

DATA = Path(__file__).parent / "data"
TABLES = yaml.safe_load((DATA / "nvidia_toolkit_v1.20.0.yaml").read_text())
IMAGES = yaml.safe_load((DATA / "cuda_images.yaml").read_text())
ALL_CAPS = frozenset(catalogue.CAPABILITIES)


def _cases(kind: str) -> list[Any]:
    return [pytest.param(c, id=f"{c['test']}: {c['case']}") for c in TABLES["cases"] if c["kind"] == kind]


def _caps(text: str | None) -> frozenset[str]:
    return ALL_CAPS if text is None else frozenset(w for w in text.split(",") if w)


def _policy(p: dict[str, Any]) -> Policy:
    return Policy(accept_envvar_unprivileged=p["accept_envvar_unprivileged"],
                  accept_volume_mounts=p["accept_volume_mounts"], swarm_resource=tuple(p["swarm_resource"]),
                  annotation_prefixes=tuple(p["annotation_prefixes"]),
                  supported_capabilities=_caps(p.get("supported_capabilities")))


def _request(inp: dict[str, Any]) -> Any:
    env = [f"{k}={v}" for k, v in (inp.get("env") or {}).items()]
    mounts = [{"source": m["source"], "destination": m["destination"]} for m in inp.get("mounts", [])]
    return parse_request(env, mounts, inp.get("annotations") or {}, inp.get("privileged", False),
                         _policy(inp["policy"]))


def _device_list(request: Any) -> list[str] | None:
    """The request as NVIDIA's hook lists it: None (untouched), [""] (none), ["all"], or the ids."""
    if not request.wants_gpu_setup:
        return None
    return {"none": [""], "all": ["all"]}.get(request.kind, list(request.devices))


def test_every_case_is_transcribed_or_left_out_with_a_reason() -> None:
    keys = [(c["file"], c["test"], c["case"]) for c in TABLES["cases"] + TABLES["left_out"]]
    assert len(keys) == len(set(keys)) and len(TABLES["cases"]) >= 160
    assert all(c["reason"].strip() for c in TABLES["left_out"])


def _env(inp: dict[str, Any]) -> dict[str, str]:
    return dict(inp.get("env") or {})


def _mounts(inp: dict[str, Any]) -> list[dict[str, str]]:
    return [{"source": m["source"], "destination": m["destination"]} for m in inp.get("mounts", [])]


def _annotation_names(inp: dict[str, Any]) -> list[str]:
    prefixes = tuple(inp["policy"]["annotation_prefixes"])
    ours = [f"{CDI_KIND}={d}" for d in cdi_annotation_devices(inp.get("annotations") or {}, prefixes)]
    return ours + list(foreign_cdi_names(inp.get("annotations") or {}, prefixes))


def _kind_list(kind: str, ids: tuple[str, ...]) -> list[str] | None:
    return None if kind in ("unset", "void") else {"none": [""], "all": ["all"]}.get(kind, list(ids))


# The Go tests that call one step of NVIDIA's request parsing on its own, and gpuhook's function for that step.
STEPS: dict[str, Any] = {
    "visibleDevicesFromEnvVar": lambda inp: _kind_list(*env_devices(_env(inp), inp["policy"]["swarm_resource"])[:2]),
    "visibleDevicesFromMounts": lambda inp: list(volume_mount_devices(_mounts(inp))) or None,
    "cdiDeviceRequestsFromAnnotations": lambda inp: _annotation_names(inp) or None,
}


@pytest.mark.parametrize("case", _cases("request"))
def test_request(case: dict[str, Any]) -> None:
    inp, expect = case["input"], case["expect"]
    step = STEPS.get(case.get("function", ""))
    if step is not None:
        got = step(inp)
        if expect.get("untouched"):
            assert got is None
        elif case["function"] == "cdiDeviceRequestsFromAnnotations":
            # NVIDIA qualifies a bare name one step later (DeviceRequests, cdi_test.go), gpuhook at once
            assert sorted(got) == sorted(dict.fromkeys(map(qualified_annotation_name, expect["devices"])))
        else:
            assert sorted(got) == sorted(dict.fromkeys(expect["devices"]))
        return
    if case.get("function") == "imexChannelsFromEnvVar":
        notes: list[str] = []
        got = imex_channel_request(_env(inp), _mounts(inp), inp.get("privileged", False), _policy(inp["policy"]),
                                   notes)
        assert list(got) == expect.get("imex_channels", [])
        return
    if case.get("function") == "getDriverCapabilities":  # the Go test passes legacyImage itself
        env = {k: v for k, v in (inp.get("env") or {}).items()}
        supported = _caps(inp["policy"].get("supported_capabilities"))
        if expect.get("error"):
            with pytest.raises(RequestError):
                request_capabilities(env, inp["legacy"], supported)
            return
        assert request_capabilities(env, inp["legacy"], supported) == _caps(expect["capabilities"])
        return
    if case.get("function") == "GetRequirements":  # asked of the image alone, whatever devices it names
        env = dict(inp.get("env") or {})
        assert sorted(checked_requirements(env, _policy(inp["policy"]))) == sorted(expect["requirements"])
        return
    if expect.get("error"):
        with pytest.raises(RequestError):
            _request(inp)
        return
    request = _request(inp)
    if expect.get("untouched"):
        assert _device_list(request) is None, request
        return
    if "devices" in expect:
        assert _device_list(request) == list(dict.fromkeys(expect["devices"])), request
    if "capabilities" in expect:
        assert request.capabilities == _caps(expect["capabilities"])
    if "requirements" in expect:
        assert sorted(request.requirements) == sorted(expect["requirements"])
    if "imex_channels" in expect:
        assert list(request.imex_channels) == expect["imex_channels"]
    if case.get("function") == "getNvidiaConfig":
        assert request.mig_config == bool(expect.get("mig_config"))
        assert request.mig_monitor == bool(expect.get("mig_monitor"))


@pytest.mark.parametrize("case", _cases("cdi_request"))
def test_cdi_device_names(case: dict[str, Any]) -> None:
    """The CDI names a request stands for: ours (kind nvidia.com/gpu, or the runtime's default kind) and other
    vendors' names from annotations, which gpuhook leaves to the CDI-aware runtime (Request.foreign_cdi)."""
    inp, expect = case["input"], case["expect"]
    request = _request(inp)
    kind = inp.get("default_kind") or CDI_KIND
    names: list[str] = []
    if request.wants_gpu_setup:
        ids = {"none": ["none"], "all": ["all"]}.get(request.kind, list(request.devices))
        names = [i if "=" in i else f"{kind}={i}" for i in ids]
    names += list(request.foreign_cdi)
    if expect.get("untouched"):
        assert names == []
        return
    assert sorted(names) == sorted(dict.fromkeys(expect["devices"]))


@pytest.mark.parametrize("case", _cases("privileged"))
def test_privileged(case: dict[str, Any]) -> None:
    spec = case["input"]["spec"]
    assert is_privileged(spec.get("process"), spec.get("ociVersion", "")) is case["expect"]["privileged"]


@pytest.mark.parametrize("case", _cases("cuda_version"))
def test_legacy_cuda_version(case: dict[str, Any]) -> None:
    version, expect = case["input"]["version"], case["expect"]
    if expect.get("error"):
        with pytest.raises(RequestError, match="invalid CUDA_VERSION"):
            legacy_cuda_version(version)
    else:
        assert legacy_cuda_version(version) == expect["major_minor"]


@pytest.mark.parametrize("case", _cases("hook_config"))
def test_hook_config(case: dict[str, Any]) -> None:
    """NVIDIA's config key `supported-driver-capabilities` (a comma string) means the same in gpuhook's config."""
    lines, expect = case["input"].get("lines"), case["expect"]
    if expect.get("error"):
        with pytest.raises(ConfigError, match="unknown capability 'not-compute'"):
            parse_config("\n".join(lines))
        return
    config = Config() if lines is None else parse_config("\n".join(lines))
    assert frozenset(config.supported_capabilities) == _caps(expect["supported_capabilities"])


def _imex_inventory(channels: list[int]) -> Inventory:
    nodes = [DeviceNode(f"{catalogue.IMEX_CHANNEL_DIR}/channel{c}", f"/host{catalogue.IMEX_CHANNEL_DIR}/channel{c}",
                        509, c, 0o666, "c") for c in channels]
    return replace(sample_inventory(), imex_channels=nodes, imex_major=509)


@pytest.mark.parametrize("case", _cases("imex"))
def test_imex(case: dict[str, Any]) -> None:
    inp, expect = case["input"], case["expect"]
    inv = _imex_inventory(inp["host_channels"])
    if "ids" not in inp:  # TestImexMode: the spec NVIDIA writes (gpuhook adds the device `all`)
        spec = build_imex_spec(inv)
        assert spec["kind"] == expect["kind"]
        assert [d["name"] for d in spec["devices"]] == [*expect["device_names"], "all"]
        assert spec["containerEdits"]["env"] == expect["env"]
        paths = [n["path"] for d in spec["devices"][:-1] for n in d["containerEdits"]["deviceNodes"]]
        assert paths == expect["node_paths"]
        return
    if expect.get("ok"):
        request = parse_request(["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_IMEX_CHANNELS={','.join(inp['ids'])}"])
        assert resolve(inv, request).imex_channels
        return
    words = {"invalid channel ID": "invalid IMEX channel", "must be in the range [0, 1048575]": "expected 0..1048575",
             "not found": "does not exist on this host"}[expect["error_contains"]]
    with pytest.raises(RequestError, match=words.replace(".", r"\.")):
        resolve(inv, parse_request(["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_IMEX_CHANNELS={','.join(inp['ids'])}"]))


# --- internal/requirements/constraints: factory_test.go, logical_test.go, constraints_test.go, as host outcomes ---

def _host(cuda: str, driver: str, brand: str = "tesla", arch: str = "9.0", gpus: int = 1) -> Inventory:
    inv = sample_inventory(gpus=gpus, mig_on=None)
    return replace(inv, cuda_version=cuda, driver_version=driver,
                   gpus=[replace(g, brand=brand, compute_capability=arch) for g in inv.gpus])


def _outcome(inv: Inventory, constraints: tuple[str, ...], devices: tuple[Any, ...]) -> str:
    try:
        check(inv, constraints, devices)
    except RequirementError:
        return "refused"
    except RequestError:
        return "invalid"
    return "starts"


REQUIREMENT_CASES = TABLES["requirements"]


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c['test']}: {c['case']}: {c['host']}")
                                  for c in REQUIREMENT_CASES])
def test_requirement(case: dict[str, Any]) -> None:
    inv = _host(**case["host"])
    assert _outcome(inv, tuple(case["requirements"]), tuple(inv.gpus)) == case["expect"]


# --- published CUDA images on hosts of several driver branches ---

def _image_cases() -> list[Any]:
    out = []
    for image in IMAGES["images"]:
        for host, outcome in image["outcomes"].items():
            out.append(pytest.param(image, host, outcome, id=f"{image['image']} on {host}"))
    return out


@pytest.mark.parametrize(("image", "host", "outcome"), _image_cases())
@pytest.mark.parametrize("source", ["env", "cdi-annotation"])
def test_cuda_image(image: dict[str, Any], host: str, outcome: str, source: str) -> None:
    """The image's own environment, the GPU asked for by NVIDIA_VISIBLE_DEVICES or by a CDI annotation (the
    device plugin's way): the hook and the shim plan with exactly these calls (hook/plan.plan_request)."""
    h = IMAGES["hosts"][host]
    inv = _host(h["cuda"], h["driver"], h["brand"])
    env = [f"{k}={v}" for k, v in image["env"].items()]
    annotations: dict[str, str] = {}
    if source == "env":
        env.append("NVIDIA_VISIBLE_DEVICES=0")
    else:
        annotations["cdi.k8s.io/gpuhook_gpu"] = "nvidia.com/gpu=0"
    request = parse_request(env, annotations=annotations)
    selection = resolve(inv, request)
    assert _outcome(inv, request.requirements, selection.devices) == outcome
