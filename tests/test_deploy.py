"""deploy/: every overlay renders with `kubectl kustomize`, every rendered object matches the
Kubernetes API's OpenAPI schema for its apiVersion (tests/data/k8s-openapi/, Kubernetes 1.34), and the one
values file reaches every field it names.

kubectl: the one on PATH when its kustomize can render components, else Debian trixie's from
.ci/fetch-kubectl's cache (Debian 12's kubectl 1.20 cannot). CI runs the fetch (GPUHOOK_REQUIRE_E2E=1: never
skipped there)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from support.k8sschema import validate

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
DEB_CACHE = os.environ.get("GPUHOOK_DEB_CACHE", "/var/cache/gpuhook-test-debs")
CACHED = Path(os.environ.get("GPUHOOK_KUBECTL_CACHE", DEB_CACHE + "/kubectl-trixie")) / "root/usr/bin/kubectl"


def _kubectl() -> str:
    candidates = [c for c in (shutil.which("kubectl"), str(CACHED)) if c and os.access(c, os.X_OK)]
    for candidate in candidates:
        probe = subprocess.run([candidate, "kustomize", str(DEPLOY / "values")], capture_output=True, text=True,
                               timeout=60, check=False)  # fmt: skip
        if probe.returncode == 0:  # a component renders alone only with kustomize >= 3.7
            return candidate
    if os.environ.get("GPUHOOK_REQUIRE_E2E") == "1":
        raise AssertionError(f"no kubectl with a current kustomize (tried {candidates}): run .ci/fetch-kubectl")
    pytest.skip("no kubectl with a current kustomize: run .ci/fetch-kubectl")


def render(overlay: Path) -> list[dict[str, Any]]:
    result = subprocess.run([_kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


def test_there_is_an_overlay() -> None:
    assert "device-plugin" in [p.name for p in OVERLAYS]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_rendered_object_matches_the_api_schema(overlay: Path) -> None:
    objects = render(overlay)
    assert objects
    problems = [p for o in objects for p in validate(o)]
    assert problems == []
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("ConfigMap", "gpuhook-values") not in names  # the values are local to kustomize
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] not in CLUSTER_SCOPED}
    assert len(namespaces) == 1 and None not in namespaces  # every namespaced object in one, named namespace
    if "../../values" in (overlay / "kustomization.yaml").read_text():  # the values file's namespace, made here
        assert namespaces == {"gpuhook"} and ("Namespace", "gpuhook") in names


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "DeviceClass", "PriorityClass"}


def test_the_example_pod_matches_the_api_schema() -> None:
    (pod,) = yaml.safe_load_all((REPO / "plugin/example-pod.yaml").read_text())
    assert validate(pod) == []


def test_the_schema_check_catches_a_misspelt_field_and_a_wrong_type() -> None:
    (ds,) = [o for o in render(DEPLOY / "overlays/device-plugin")
             if (o["kind"], o["metadata"]["name"]) == ("DaemonSet", "gpuhook-node-setup")]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    container["volumeMounts"][0]["mountPropogation"] = "HostToContainer"
    ds["spec"]["template"]["spec"]["hostPID"] = "yes"
    problems = validate(ds)
    assert any("mountPropogation" in p for p in problems), problems
    assert any(p.startswith("DaemonSet/gpuhook-node-setup: spec.template.spec.hostPID: 'yes' is not of type")
               for p in problems), problems
    assert validate({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x"}}) == [
        f"StatefulSet/x: no schema for apps/v1 StatefulSet under {REPO / 'tests/data/k8s-openapi'} "
        "(add it: README there)"]


VALUES = {"NAMESPACE": "gpu-system", "NODE_SETUP_IMAGE": "registry.example/gh/node-setup:9",
          "PLUGIN_IMAGE": "registry.example/gh/plugin:9", "DRIVER_ROOT": "/run/nvidia/driver",
          "PREFIX": "/opt/gh", "RUNTIME": "crio", "RESTART": "signal", "MIG_STRATEGY": "mixed",
          "DEVICE_LIST_STRATEGY": "volume-mounts", "DEVICE_ID_STRATEGY": "index"}


def test_each_value_reaches_every_field_that_carries_it(tmp_path: Path) -> None:
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    lines = (copy / "values/values.env").read_text().splitlines()
    keys = [line.split("=", 1)[0] for line in lines if line and not line.startswith("#")]
    assert sorted(keys) == sorted(VALUES)  # one documented file, every key tested
    (copy / "values/values.env").write_text("".join(f"{k}={v}\n" for k, v in VALUES.items()))
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(copy / "overlays/device-plugin")}
    assert ("Namespace", "gpu-system") in objects
    assert {o["metadata"].get("namespace") for o in objects.values() if o["kind"] != "Namespace"} == {"gpu-system"}
    setup = objects["DaemonSet", "gpuhook-node-setup"]["spec"]["template"]["spec"]
    (container,) = setup["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == VALUES["NODE_SETUP_IMAGE"]
    assert (env["GPUHOOK_PREFIX"], env["GPUHOOK_DRIVER_ROOT"], env["GPUHOOK_RUNTIME"], env["GPUHOOK_RESTART"]) == (
        "/opt/gh", "/run/nvidia/driver", "crio", "signal")
    plugin = objects["DaemonSet", "gpuhook-device-plugin"]["spec"]["template"]["spec"]
    (container,) = plugin["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == plugin["initContainers"][0]["image"] == VALUES["PLUGIN_IMAGE"]
    assert (env["NVIDIA_DRIVER_ROOT"], env["GPUHOOK_PREFIX"], env["MIG_STRATEGY"], env["DEVICE_LIST_STRATEGY"],
            env["DEVICE_ID_STRATEGY"]) == ("/run/nvidia/driver", "/opt/gh", "mixed", "volume-mounts", "index")
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in plugin["volumes"]}
    assert volumes["driver-root"] == "/run/nvidia/driver" and volumes["gpuhook-prefix"] == "/opt/gh"
    assert "--hook-path=$(GPUHOOK_PREFIX)/bin/gpuhook-hook" in [a.split("#")[0].strip() for a in container["args"]]


def test_api_access_is_each_components_read_of_its_own_daemonset_and_options_match_the_command() -> None:
    """RBAC only where a component talks to the API server: node-setup and the device plugin each read their
    own DaemonSet (to tell an uninstall from a rolling update when a pod stops), nothing else; every GPUHOOK_*
    variable node-setup's container sets is one of its command's options, and its probe parses."""
    from gpuhook.cli.nodesetup import node_setup

    objects = render(DEPLOY / "overlays/device-plugin")
    rbac = {(o["kind"], o["metadata"]["name"]): o for o in objects
            if o["kind"] in {"ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}}
    names = ("gpuhook-node-setup", "gpuhook-device-plugin")
    assert sorted(rbac) == sorted((kind, n) for kind in ("Role", "RoleBinding", "ServiceAccount") for n in names)
    for name in names:
        assert rbac["Role", name]["rules"] == [
            {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": [name],
             "verbs": ["get", "list", "watch"]}]
        assert rbac["RoleBinding", name]["subjects"] == [
            {"kind": "ServiceAccount", "name": name, "namespace": "gpuhook"}]
        (ds,) = [o for o in objects if (o["kind"], o["metadata"]["name"]) == ("DaemonSet", name)]
        pod = ds["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == name
        assert {"name": "GPUHOOK_DAEMONSET", "value": name} in pod["containers"][0]["env"]
    (setup,) = [o for o in objects if (o["kind"], o["metadata"]["name"]) == ("DaemonSet", "gpuhook-node-setup")]
    (container,) = setup["spec"]["template"]["spec"]["containers"]
    known = {p.envvar for c in node_setup.commands.values() for p in c.params if getattr(p, "envvar", None)}
    assert {e["name"] for e in container["env"] if e["name"].startswith("GPUHOOK_")} <= known
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[0] == "gpuhook"
    result = CliRunner().invoke(node_setup, [*probe[2:], "--help"])
    assert result.exit_code == 0, result.output
    assert setup["spec"]["template"]["spec"]["hostPID"] is True
