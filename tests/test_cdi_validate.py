"""`validate_spec`: every generated spec passes; each loader or schema rule, broken once, is caught at its path."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from support.cdi_inventory import synthetic_inventory

from gpuhook.cdi import codec
from gpuhook.cdi.spec import build_spec
from gpuhook.cdi.validate import validate_file, validate_spec

HOOK = "/usr/bin/gpuhook"

GOOD: dict[str, Any] = {
    "cdiVersion": "0.5.0",
    "kind": "nvidia.com/gpu",
    "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [
            {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
             "fileMode": 438, "permissions": "rw", "uid": 0, "gid": 0}]}},
        {"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
    ],
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl", "permissions": "none"}],
        "mounts": [{"hostPath": "/usr/lib/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1", "type": "bind",
                    "options": ["ro", "rbind"]}],
        "hooks": [{"hookName": "createContainer", "path": "/usr/bin/gpuhook", "args": ["gpuhook", "x"],
                   "env": ["PATH=/bin"], "timeout": 5}],
    },
}


def broken(path: str, value: Any = None, *, delete: bool = False) -> dict[str, Any]:
    """GOOD with one change at a dotted path (integers index lists)."""
    spec = copy.deepcopy(GOOD)
    parts = path.split(".")
    target: Any = spec
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if delete:
        del target[last]
    else:
        target[last] = value
    return spec


DN = "devices.0.containerEdits.deviceNodes.0"
JDN = "$.devices[0].containerEdits.deviceNodes[0]"

CASES: list[tuple[str, dict[str, Any] | Any, str, str]] = [
    ("schema: kind required", broken("kind", delete=True), "$", "'kind' is a required property"),
    ("schema: devices is a list", broken("devices", {"name": "0"}), "$.devices", "is not of type 'array'"),
    ("schema: uid is uint32", broken(f"{DN}.uid", -1), f"{JDN}.uid", "less than the minimum"),
    ("schema: mount needs hostPath", broken("containerEdits.mounts.0.hostPath", delete=True),
     "$.containerEdits.mounts[0]", "'hostPath' is a required property"),  # spec level: not in the official schema
    ("schema: device mount needs hostPath", broken("devices.0.containerEdits.mounts", [{"containerPath": "/x"}]),
     "$.devices[0].containerEdits.mounts[0]", "'hostPath' is a required property"),
    ("not a mapping", ["cdiVersion"], "$", "must be a mapping"),
    ("unknown top-level field", broken("vendor", "x"), "$.vendor", "unknown field 'vendor'"),
    ("unknown device field", broken("devices.0.edits", {}), "$.devices[0].edits", "unknown field"),
    ("unknown edits field", broken("containerEdits.devices", []), "$.containerEdits.devices", "unknown field"),
    ("unknown node field", broken(f"{DN}.mode", 1), f"{JDN}.mode", "unknown field 'mode'"),
    ("unknown mount field", broken("containerEdits.mounts.0.readOnly", True), "$.containerEdits.mounts[0].readOnly",
     "unknown field"),
    ("unknown hook field", broken("containerEdits.hooks.0.name", "x"), "$.containerEdits.hooks[0].name",
     "unknown field"),
    ("unknown version", broken("cdiVersion", "0.9.0"), "$.cdiVersion", "unknown cdiVersion '0.9.0'"),
    ("version below content", broken("cdiVersion", "0.4.0"), "$.cdiVersion",
     "0.4.0 is below 0.5.0, needed for a device name not starting with a letter at $.devices[0].name"),
    ("annotations need 0.6.0", broken("annotations", {"a": "b"}), "$.cdiVersion", "below 0.6.0"),
    ("kind without class", broken("kind", "nvidia.com"), "$.kind", "expected vendor/class"),
    ("kind with bad vendor", broken("kind", "-nvidia.com/gpu"), "$.kind", "invalid vendor name"),
    ("kind with bad class", broken("kind", "nvidia.com/gpu-"), "$.kind", "invalid class name"),
    ("device name syntax", broken("devices.1.name", "all!"), "$.devices[1].name", "invalid device name"),
    ("duplicate device name", broken("devices.1.name", "0"), "$.devices[1].name",
     "duplicate device name '0' (also $.devices[0])"),
    ("no devices", broken("devices", []), "$.devices", "at least one device"),
    ("empty device edits", broken("devices.1.containerEdits", {}), "$.devices[1].containerEdits",
     "non-empty containerEdits"),
    ("empty lists are empty edits", broken("devices.1.containerEdits", {"env": [], "mounts": []}),
     "$.devices[1].containerEdits", "non-empty containerEdits"),
    ("env without =", broken("containerEdits.env", ["NVIDIA_VISIBLE_DEVICES"]), "$.containerEdits.env[0]",
     "invalid environment variable"),
    ("env with empty name", broken("containerEdits.env", ["=x"]), "$.containerEdits.env[0]", "NAME=value"),
    ("node path relative", broken(f"{DN}.path", "dev/nvidia0"), f"{JDN}.path", "must be an absolute path"),
    ("node type", broken(f"{DN}.type", "x"), f"{JDN}.type", "invalid device type 'x'"),
    ("node permissions", broken(f"{DN}.permissions", "rwx"), f"{JDN}.permissions", "invalid permissions 'rwx'"),
    ("node major negative", broken(f"{DN}.major", -1), f"{JDN}.major", "negative major"),
    ("node fileMode", broken(f"{DN}.fileMode", "0666"), f"{JDN}.fileMode", "not a non-negative integer"),
    ("mount containerPath relative", broken("containerEdits.mounts.0.containerPath", "usr/lib/x"),
     "$.containerEdits.mounts[0].containerPath", "must be an absolute path"),
    ("mount hostPath empty", broken("containerEdits.mounts.0.hostPath", ""), "$.containerEdits.mounts[0].hostPath",
     "empty hostPath"),
    ("hook name", broken("containerEdits.hooks.0.hookName", "preStart"), "$.containerEdits.hooks[0].hookName",
     "invalid hook name 'preStart'"),
    ("hook path relative", broken("containerEdits.hooks.0.path", "gpuhook"), "$.containerEdits.hooks[0].path",
     "must be an absolute path"),
    ("hook env", broken("containerEdits.hooks.0.env", ["PATH"]), "$.containerEdits.hooks[0].env[0]",
     "invalid environment variable"),
    ("netDevices duplicate", {**broken("cdiVersion", "1.1.0"), "containerEdits": {"netDevices": [
        {"hostInterfaceName": "eth1", "name": "n1"}, {"hostInterfaceName": "eth1", "name": "n2"}]}},
     "$.containerEdits.netDevices[1].hostInterfaceName", "duplicate hostInterfaceName"),
    ("intelRdt closID", {**broken("cdiVersion", "0.7.0"), "containerEdits": {"intelRdt": {"closID": "a/b"}}},
     "$.containerEdits.intelRdt.closID", "invalid closID"),
]


def test_good_spec_is_valid() -> None:
    assert validate_spec(GOOD, "good.yaml") == []


@pytest.mark.parametrize(("spec", "path", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_rule(spec: Any, path: str, message: str) -> None:
    problems = validate_spec(spec, "bad.yaml")
    assert any(p.startswith(f"bad.yaml: {path}: ") and message in p for p in problems), problems


def test_problems_are_single_lines() -> None:
    spec = broken("devices", [{"name": "-x", "containerEdits": {}, "bogus": 1}, {"name": "-x"}])
    problems = validate_spec(spec, "f")
    assert len(problems) >= 4
    assert all("\n" not in p and p.startswith("f: $") for p in problems)


@pytest.mark.parametrize("kwargs", [
    {}, {"name_strategies": ("index", "uuid", "type-index")}, {"name_strategies": ("type-index",)},
    {"vendor": "example.com", "cls": "gpu.h100"}, {"cdi_version": "1.1.0"},
])
@pytest.mark.parametrize(("gpus", "migs"), [(1, 0), (8, 0), (8, 7), (3, 2)])
def test_every_generated_spec_is_accepted(kwargs: dict[str, Any], gpus: int, migs: int) -> None:
    spec = build_spec(synthetic_inventory(gpus, mig_per_gpu=migs), hook_path=HOOK, **kwargs)
    assert validate_spec(spec, "gen") == []
    if kwargs.get("cls") == "gpu.h100":
        assert spec["cdiVersion"] == "0.6.0"  # a dot in the class
    assert validate_spec(json.loads(codec.dumps(spec, "json")), "gen.json") == []


def test_validate_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    good = tmp_path / "good.yaml"
    good.write_text(codec.dumps(GOOD))
    assert validate_file(str(good)) == []
    dup = tmp_path / "dup.yaml"
    dup.write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\nkind: nvidia.com/gpu\ndevices: []\n")
    (line,) = validate_file(str(dup))
    assert line.startswith(f"{dup}: $: ") and "duplicate key 'kind'" in line and "line 3" in line
    syntax = tmp_path / "bad.json"
    syntax.write_text('{"cdiVersion": ')
    (line,) = validate_file(str(syntax))
    assert line.startswith(f"{syntax}: $: not valid YAML/JSON")
    missing = tmp_path / "missing.yaml"
    (line,) = validate_file(str(missing))
    assert line == f"{missing}: $: cannot read: No such file or directory"
