"""Per-node device-plugin configuration: NVIDIA's named configs (its chart's `config.map`) and the node label
`nvidia.com/device-plugin.config` that picks one (plugin/nodeconfig.py, system/nodelabel.py).

The choice is ported as data from NVIDIA's config-manager (k8s-device-plugin v0.20.0,
cmd/config-manager/main.go, updateConfigName and getConfigFileNameMap). The end-to-end test runs the plugin as a
process against a real kube-apiserver with exactly the RBAC the Helm chart renders, behind a test kubelet: a
relabel switches the advertised devices in place, a label naming no config keeps the current one serving, and
removing the label goes back to the default."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from support.e2e import need
from support.k8s import binaries, control_plane, wait_for
from support.processes import short_tempdir

from gpuhook.errors import ConfigError
from gpuhook.plugin.nodeconfig import available, choose, parse_fallbacks

DEFAULT = "version: v1\nflags:\n  migStrategy: none\n"
SLICED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"

# (label, default, fallbacks, available names) -> chosen name, or the error's words
CHOICES = [
    ("sliced", "", ("named", "single"), ["default", "sliced"], "sliced"),  # the label wins over everything
    ("sliced", "default", (), ["default", "sliced"], "sliced"),
    ("", "sliced", ("named",), ["default", "sliced"], "sliced"),  # no label: the default, before any fallback
    ("", "", ("named", "single"), ["default", "sliced"], "default"),  # named: a config called "default"
    ("", "", ("named", "single"), ["only"], "only"),  # single: the only one
    ("", "", ("single", "named"), ["a", "default"], "default"),  # in the order given
    ("", "", ("named", "empty"), ["a", "b"], ""),  # empty: no file at all
    # a label naming no config is an error, never a fallback
    ("missing", "", ("named", "empty"), ["default"], ConfigError("config='missing': no such config")),
    ("", "missing", ("named",), ["default"], ConfigError("default config 'missing': no such config")),
    ("", "", ("named", "single"), ["a", "b"], ConfigError("no fallback (named, single) found one")),
    ("", "", ("empty",), [], ConfigError("no configuration files")),
]


@pytest.mark.parametrize("label,default,fallbacks,names,expected", CHOICES)
def test_the_config_is_chosen_as_nvidias_config_manager_chooses(label: str, default: str, fallbacks: tuple[str, ...],
                                                                 names: list[str], expected: Any) -> None:
    if isinstance(expected, ConfigError):
        with pytest.raises(ConfigError, match=re.escape(str(expected))):
            choose(label, default, fallbacks, names, "/available-configs")
    else:
        assert choose(label, default, fallbacks, names, "/available-configs") == expected


def test_fallback_strategies_are_nvidias_words() -> None:
    assert parse_fallbacks("named, single,empty") == ("named", "single", "empty")
    with pytest.raises(ConfigError, match="fallback strategy 'first': unknown"):
        parse_fallbacks("named,first")


def configmap_volume(folder: Path, configs: dict[str, str]) -> Path:
    """What kubelet makes of a ConfigMap volume: a timestamped folder, `..data` pointing at it, and one symlink
    per key into `..data`."""
    folder.mkdir()
    stamped = folder / "..2026_12_08_00_00_00.000000001"
    stamped.mkdir()
    for name, text in configs.items():
        (stamped / name).write_text(text)
        (folder / name).symlink_to(Path("..data") / name)
    (folder / "..data").symlink_to(stamped.name)
    return folder


def test_the_configs_are_a_config_map_volumes_keys(tmp_path: Path) -> None:
    folder = configmap_volume(tmp_path / "configs", {"default": DEFAULT, "sliced": SLICED})
    (folder / "a-folder").mkdir()  # folders are no configs (NVIDIA's IsDir)
    assert available(str(folder)) == ["default", "sliced"]
    with pytest.raises(ConfigError, match="config folder .*: No such file"):
        available(str(tmp_path / "absent"))


def _chart_rbac(tmp: Path) -> list[dict[str, Any]]:
    """The device plugin's account, ClusterRole and binding exactly as the chart renders them with named configs."""
    from test_helm import template

    objects = template(tmp, {"config": {"map": {"default": DEFAULT, "sliced": SLICED}}})
    wanted = [o for k, o in objects.items() if k[0] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
              and o["metadata"]["name"].endswith("gpuhook-device-plugin")]
    assert {o["kind"] for o in wanted} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}, wanted
    return wanted


PATHS = {"ServiceAccount": "/api/v1/namespaces/gpuhook/serviceaccounts",
         "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
         "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"}


@pytest.mark.e2e
def test_a_relabelled_node_advertises_its_new_config_in_place(fake_driver: Any, tmp_path: Path) -> None:
    from support.kubelet import PluginProcess, TestKubelet

    found = binaries()
    need(not isinstance(found, str), f"no Kubernetes binaries: {found}")
    assert not isinstance(found, str)
    bin_dir, etcd = found
    rbac = _chart_rbac(tmp_path)
    root = Path(short_tempdir("ncf"))
    try:
        with control_plane(root / "plane", bin_dir, etcd, "node1", scheduler=False) as plane:
            plane.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": "gpuhook"}})
            for doc in rbac:
                plane.ok("POST", PATHS[doc["kind"]], doc)
            plane.ok("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1"}})
            token = plane.service_account_token("gpuhook", "gpuhook-device-plugin")
            ca = next((root / "plane" / "apiserver-certs").glob("*.crt"))
            config = root / "plugin.kubeconfig"
            config.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "pod",
                "clusters": [{"name": "c", "cluster": {"server": plane.server, "certificate-authority": str(ca)}}],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [{"name": "pod", "context": {"cluster": "c", "user": "sa", "namespace": "gpuhook"}}]}))
            configs = configmap_volume(root / "configs", {"default": DEFAULT, "sliced": SLICED})

            def label(value: str | None) -> None:
                plane.ok("PATCH", "/api/v1/nodes/node1",
                         {"metadata": {"labels": {"nvidia.com/device-plugin.config": value}}},
                         content_type="application/merge-patch+json")

            with TestKubelet(str(root / "dp")) as kubelet:
                args = ["--driver-root", str(fake_driver.root), "--kubelet-dir", kubelet.directory,
                        "--cdi-spec-dir", str(root / "cdi"), "--hook-path", "/bin/true",
                        "--sys-root", str(fake_driver.root / "sys"), "--config-file-srcdir", str(configs),
                        "--node-name", "node1", "--kubeconfig", str(config)]
                with PluginProcess(args, str(root / "plugin.log")) as plugin:
                    kubelet.wait_registrations(1, timeout=30)

                    def advertised(count: int) -> Any:
                        return wait_for(f"{count} devices advertised", lambda: kubelet.streams.get("nvidia.com/gpu")
                                        and kubelet.stream().messages
                                        and len(kubelet.stream().messages[-1].devices) == count, timeout=30)

                    advertised(2)
                    assert "config 'default'" in plugin.log()
                    label("sliced")
                    kubelet.wait_registrations(2, timeout=30)
                    advertised(8)
                    ids = sorted(d.ID for d in kubelet.stream().messages[-1].devices)
                    assert all("::" in i for i in ids) and len(set(ids)) == 8
                    registrations = len(kubelet.registrations)
                    label("missing")
                    wait_for("the error naming the label", lambda: "='missing': no such config" in plugin.log(),
                             timeout=30)
                    assert "still serving config 'sliced'" in plugin.log()
                    assert len(kubelet.registrations) == registrations
                    advertised(8)
                    label(None)  # no label: back to the default
                    kubelet.wait_registrations(registrations + 1, timeout=30)
                    advertised(2)
                    assert plugin.proc.poll() is None
                    plugin.signal(signal.SIGTERM)
                    assert plugin.wait(15) == 0, plugin.log()
                    assert "Traceback" not in plugin.log()
    finally:
        shutil.rmtree(root, ignore_errors=True)
