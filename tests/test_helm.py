"""deploy/helm/gpuhook: `helm lint` passes, `helm template` renders objects that match the Kubernetes API's
OpenAPI schema, every value reaches the fields that carry it, NVIDIA's chart's value names mean the same here,
and with the values of deploy/values/values.env the chart renders the same pods as the kustomize overlays (the
two ways to install cannot drift apart).

helm: $GPUHOOK_HELM_BIN/helm (.ci/build-k8s builds it from helm.sh/helm/v4 and .ci/run exports the folder), else
the one on PATH; CI never skips (GPUHOOK_REQUIRE_E2E=1)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import need
from support.k8sschema import validate
from test_deploy import render

from gpuhook.plugin.config import parse

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "gpuhook"
NVIDIA_NAMES = ("config", "migStrategy", "deviceListStrategy", "deviceIDStrategy", "failOnInitError",
                "runtimeClassName", "nodeSelector", "affinity", "tolerations", "resources", "image",
                "imagePullSecrets", "priorityClassName")


def _helm() -> str:
    folder = os.environ.get("GPUHOOK_HELM_BIN")
    found = os.path.join(folder, "helm") if folder else shutil.which("helm")
    need(bool(found) and os.access(str(found), os.X_OK), "no helm: run .ci/build-k8s and export GPUHOOK_HELM_BIN")
    return str(found)


def helm(*args: str, values: dict[str, Any] | None = None, tmp: Path | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [_helm(), *args]
    if values is not None:
        assert tmp is not None
        (tmp / "values.yaml").write_text(yaml.safe_dump(values))
        argv += ["--values", str(tmp / "values.yaml")]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp or "/nonexistent"),
           "HELM_CACHE_HOME": str(tmp or "/nonexistent"), "HELM_CONFIG_HOME": str(tmp or "/nonexistent"),
           "HELM_DATA_HOME": str(tmp or "/nonexistent")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)
    if check:
        assert out.returncode == 0, f"helm {' '.join(args)}: {out.stderr}{out.stdout}"
    return out


def template(tmp: Path, values: dict[str, Any] | None = None, namespace: str = "gpuhook") -> dict[tuple[str, str], Any]:
    out = helm("template", "gh", str(CHART), "--namespace", namespace, values=values or {}, tmp=tmp)
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    keyed = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(keyed) == len(objects), "two rendered objects share a kind and a name"
    return keyed


def test_lint_passes_with_the_defaults_and_with_everything_on(tmp_path: Path) -> None:
    out = helm("lint", "--strict", str(CHART), tmp=tmp_path)
    assert "0 chart(s) failed" in out.stdout
    out = helm("lint", "--strict", str(CHART), values={"draDriver": {"enabled": True}}, tmp=tmp_path)
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", [{}, {"draDriver": {"enabled": True}, "migStrategy": "mixed"},
                                    {"devicePlugin": {"enabled": False}, "draDriver": {"enabled": True}}],
                         ids=["defaults", "everything", "dra-only"])
def test_every_rendered_object_matches_the_api_schema(tmp_path: Path, values: dict[str, Any]) -> None:
    objects = template(tmp_path, values)
    assert [p for o in objects.values() for p in validate(o)] == []
    assert ("DaemonSet", "gpuhook-node-setup") in objects
    assert (("DaemonSet", "gpuhook-device-plugin") in objects) == values.get("devicePlugin", {}).get("enabled", True)
    assert (("DaemonSet", "gpuhook-dra") in objects) == values.get("draDriver", {}).get("enabled", False)
    for obj in objects.values():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "gh" and labels["app.kubernetes.io/part-of"] == "gpuhook"


def test_nvidia_value_names_are_the_charts_top_level_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(NVIDIA_NAMES) <= set(values)
    assert set(values["config"]) == {"map", "default", "fallbackStrategies", "name"}
    assert set(values["image"]) == {"repository", "tag", "pullPolicy"}


def _pod(objects: dict[tuple[str, str], Any], name: str) -> dict[str, Any]:
    return objects["DaemonSet", name]["spec"]["template"]["spec"]


def test_each_value_reaches_every_field_that_carries_it(tmp_path: Path) -> None:
    values = {
        "image": {"repository": "registry.example/gh/plugin", "tag": "9", "pullPolicy": "Always"},
        "nodeSetup": {"image": {"repository": "registry.example/gh/node-setup", "tag": "8"}, "runtime": "crio",
                      "restart": "signal"},
        "nvidiaDriverRoot": "/run/nvidia/driver", "prefix": "/opt/gh", "kubeletDir": "/data/kubelet",
        "cdiDir": "/etc/cdi", "migStrategy": "mixed", "deviceListStrategy": "volume-mounts",
        "deviceIDStrategy": "index", "failOnInitError": False, "runtimeClassName": "plain",
        "nodeSelector": {"gpu": "yes"}, "tolerations": [{"key": "t", "operator": "Exists"}],
        "resources": {"limits": {"memory": "1Gi"}}, "priorityClassName": "",
        "imagePullSecrets": [{"name": "pull"}],
        "draDriver": {"enabled": True, "namespace": "dra-system",
                      "containers": {"main": {"env": [{"name": "DRA_EXTRA", "value": "2"}]}}},
        "devicePlugin": {"containers": {"main": {"env": [{"name": "PLUGIN_EXTRA", "value": "1"}]}}},
    }
    objects = template(tmp_path, values, namespace="gpu-system")
    setup, plugin, dra = (_pod(objects, n) for n in ("gpuhook-node-setup", "gpuhook-device-plugin", "gpuhook-dra"))
    for pod in (setup, plugin, dra):
        # Helm merges a map value into the default one: the GPU-node label stays unless set to null
        assert pod["runtimeClassName"] == "plain"
        assert pod["nodeSelector"] == {"gpu": "yes", "nvidia.com/gpu.present": "true"}
        assert pod["tolerations"] == [{"key": "t", "operator": "Exists"}] and "priorityClassName" not in pod
        assert pod["imagePullSecrets"] == [{"name": "pull"}]
    (container,) = setup["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == "registry.example/gh/node-setup:8"
    assert (env["GPUHOOK_PREFIX"], env["GPUHOOK_DRIVER_ROOT"], env["GPUHOOK_RUNTIME"], env["GPUHOOK_RESTART"]) == (
        "/opt/gh", "/run/nvidia/driver", "crio", "signal")
    (container,) = plugin["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == plugin["initContainers"][0]["image"] == "registry.example/gh/plugin:9"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"] == {"limits": {"memory": "1Gi"}, "requests": {"cpu": "10m", "memory": "64Mi"}}
    assert (env["NVIDIA_DRIVER_ROOT"], env["GPUHOOK_PREFIX"], env["MIG_STRATEGY"], env["DEVICE_LIST_STRATEGY"],
            env["DEVICE_ID_STRATEGY"], env["FAIL_ON_INIT_ERROR"]) == (
        "/run/nvidia/driver", "/opt/gh", "mixed", "volume-mounts", "index", "false")
    assert "--kubelet-dir=/data/kubelet/device-plugins" in container["args"]
    assert "--cdi-spec-dir=/etc/cdi" in container["args"]
    volumes = {v["name"]: v.get("hostPath", {}).get("path") for v in plugin["volumes"]}
    assert (volumes["driver-root"], volumes["gpuhook-prefix"], volumes["device-plugins"], volumes["cdi"]) == (
        "/run/nvidia/driver", "/opt/gh", "/data/kubelet/device-plugins", "/etc/cdi")
    assert env["PLUGIN_EXTRA"] == "1"
    (container,) = dra["containers"]
    assert "--kubelet-dir=/data/kubelet" in container["args"] and container["image"].endswith("plugin:9")
    assert {"name": "DRA_EXTRA", "value": "2"} in container["env"]
    assert objects["DaemonSet", "gpuhook-dra"]["metadata"]["namespace"] == "dra-system"
    binding = objects["ClusterRoleBinding", "gh-gpuhook-dra"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuhook-dra", "namespace": "dra-system"}]
    assert {o["metadata"].get("namespace") for k, o in objects.items()
            if k[0] in ("DaemonSet", "ConfigMap") and k[1] != "gpuhook-dra"} == {"gpu-system"}


def test_config_map_carries_nvidias_named_configs_picked_by_the_node_label(tmp_path: Path) -> None:
    sliced = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
              "      replicas: 4\n")
    objects = template(tmp_path, {"config": {"map": {"default": "version: v1\n", "time-sliced": sliced},
                                             "default": "time-sliced"}})
    data = objects["ConfigMap", "gh-device-plugin-configs"]["data"]
    assert data == {"default": "version: v1\n", "time-sliced": sliced}  # byte for byte, one key per name
    sharing = parse(data["time-sliced"]).sharing
    assert sharing is not None and [(r.name, r.replicas) for r in sharing.resources] == [("nvidia.com/gpu", 4)]
    pod = _pod(objects, "gpuhook-device-plugin")
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["CONFIG_FILE_SRCDIR"] == "/available-configs" and "CONFIG_FILE" not in env
    assert (env["DEFAULT_CONFIG"], env["FALLBACK_STRATEGIES"]) == ("time-sliced", "named,single")
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]
    assert mounts["config"] == "/available-configs" and "items" not in volume  # every key is a file
    # the label is read with the plugin's own account: nodes, read-only, nothing else
    role = objects["ClusterRole", "gh-gpuhook-device-plugin"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    binding = objects["ClusterRoleBinding", "gh-gpuhook-device-plugin"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuhook-device-plugin",
                                    "namespace": "gpuhook"}]


def test_the_default_config_is_the_strategies_and_parses(tmp_path: Path) -> None:
    objects = template(tmp_path, {"migStrategy": "single", "deviceListStrategy": "cdi-cri,envvar"})
    config = parse(objects["ConfigMap", "gh-device-plugin-configs"]["data"]["config.yaml"])
    assert (config.mig_strategy, config.list_strategies, config.id_strategy, config.fail_on_init_error) == (
        "single", ("cdi-cri", "envvar"), "uuid", True)


def test_an_existing_config_map_is_used_and_none_is_made(tmp_path: Path) -> None:
    objects = template(tmp_path, {"config": {"name": "mine"}})
    assert not [k for k in objects if k[0] == "ConfigMap"]
    pod = _pod(objects, "gpuhook-device-plugin")
    volume = {v["name"]: v for v in pod["volumes"]}["config"]
    assert volume["configMap"] == {"name": "mine"}  # NVIDIA's layout: its keys are the named configs
    assert {"name": "CONFIG_FILE_SRCDIR", "value": "/available-configs"} in pod["containers"][0]["env"]


def test_without_configs_the_plugin_gets_one_file_and_no_node_access(tmp_path: Path) -> None:
    objects = template(tmp_path)
    assert not [k for k in objects if k[0] in ("ClusterRole", "ClusterRoleBinding")]
    env = _pod(objects, "gpuhook-device-plugin")["containers"][0]["env"]
    assert {"name": "CONFIG_FILE", "value": "/config/config.yaml"} in env
    assert not [e for e in env if e["name"] in ("CONFIG_FILE_SRCDIR", "NODE_NAME")]


def _comparable(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod spec without what differs by design between the two installs: images and the config's name."""
    pod = copy.deepcopy(pod)
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        container.pop("image", None)
        container.pop("imagePullPolicy", None)
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            volume["configMap"].pop("name")
    return pod


@pytest.mark.parametrize("overlay,dra", [("device-plugin", False), ("dra", True)])
def test_with_the_kustomize_values_the_chart_renders_the_overlays_pods(tmp_path: Path, overlay: str,
                                                                       dra: bool) -> None:
    env = dict(line.split("=", 1) for line in (REPO / "deploy/values/values.env").read_text().splitlines()
               if line and not line.startswith("#"))
    values = {"nvidiaDriverRoot": env["DRIVER_ROOT"], "prefix": env["PREFIX"], "migStrategy": env["MIG_STRATEGY"],
              "deviceListStrategy": env["DEVICE_LIST_STRATEGY"], "deviceIDStrategy": env["DEVICE_ID_STRATEGY"],
              "nodeSetup": {"runtime": env["RUNTIME"], "restart": env["RESTART"]},
              "devicePlugin": {"enabled": not dra}, "draDriver": {"enabled": dra, "namespace": env["NAMESPACE"]}}
    charted = template(tmp_path, values, namespace=env["NAMESPACE"])
    kustomized = {(o["kind"], o["metadata"]["name"]): o for o in render(REPO / "deploy/overlays" / overlay)}
    daemonsets = sorted(k[1] for k in kustomized if k[0] == "DaemonSet")
    assert daemonsets == sorted(k[1] for k in charted if k[0] == "DaemonSet")
    for name in daemonsets:
        ours, theirs = _pod(charted, name), _pod(kustomized, name)
        if name == "gpuhook-device-plugin":  # the chart also passes failOnInitError, NVIDIA's default
            ours["containers"][0]["env"] = [e for e in ours["containers"][0]["env"]
                                            if e["name"] != "FAIL_ON_INIT_ERROR"]
        assert _comparable(ours) == _comparable(theirs), name
    if dra:
        rules = kustomized["ClusterRole", "gpuhook-dra"]["rules"]
        assert charted["ClusterRole", "gh-gpuhook-dra"]["rules"] == rules
        for cls in ("gpu.nvidia.com", "mig.nvidia.com"):
            assert charted["DeviceClass", cls]["spec"] == kustomized["DeviceClass", cls]["spec"]
