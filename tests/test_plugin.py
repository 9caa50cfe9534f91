"""The kubelet device plugin over real gRPC: a test kubelet on a temp kubelet.sock, the fake driver's NVML."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.kubelet import PluginProcess, TestKubelet, health

from gpuhook.cdi import codec
from gpuhook.discover import Inventory, Roots, discover
from gpuhook.errors import ConfigError
from gpuhook.plugin.devices import Options, annotation_key
from gpuhook.plugin.health import HealthConfig
from gpuhook.plugin.lifecycle import Plugin, PluginConfig

GPU = "nvidia.com/gpu"
KIND = "k8s.device-plugin.nvidia.com/gpu"  # the plugin's CDI kind, NVIDIA's
ALL_STRATEGIES = ("cdi-cri", "envvar", "volume-mounts", "cdi-annotations")
FAST_HEALTH = HealthConfig(recovery_window=0.5, interval=0.05, event_wait_ms=20)


def inventory(fake: Any) -> Inventory:
    return discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")))


@contextlib.contextmanager
def running(fake: Any, kubelet: TestKubelet, options: Options = Options(), health_config: HealthConfig = FAST_HEALTH,
            hook_state_dir: str | None = None) -> Iterator[Plugin]:
    """The plugin in this process (its run loop on a thread), against `fake`, registered with `kubelet`; the hooks'
    state dir watched only when given (never the host's /run/gpuhook)."""
    inv = inventory(fake)
    config = PluginConfig(options=options, kubelet_dir=kubelet.directory,
                          cdi_spec_dir=os.path.join(os.path.dirname(kubelet.directory), "cdi"),
                          hook_path="/bin/true", health=health_config, sys_root=str(fake.root / "sys"),
                          hook_state_dir=hook_state_dir)
    plugin = Plugin(config, lambda: inv)
    plugin.start()
    thread = threading.Thread(target=plugin.run, daemon=True)
    thread.start()
    try:
        yield plugin
    finally:
        plugin.request_stop()
        thread.join(10)
        assert not thread.is_alive()


def wait_nvml_events(fake: Any, gpus: int, pid: int | None = None, timeout: float = 5.0) -> None:
    """The fake drops XIDs written before registration: wait until our process registered every GPU."""
    pid = os.getpid() if pid is None else pid
    deadline = time.monotonic() + timeout
    while len({i for p, i, _ in fake.registrations() if p == pid}) < gpus:
        assert time.monotonic() < deadline, f"NVML events never registered: {fake.registrations()}"
        time.sleep(0.01)


def uuids(plugin: Plugin) -> list[str]:
    """GPU UUIDs from the plugin's own inventory (a second discover() would wait for the health thread's NVML)."""
    assert plugin.inventory is not None
    return [g.uuid for g in plugin.inventory.gpus]


# -- registration and the device list --------------------------------------------------------------------------


def test_registration_fields(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet):
        (reg,) = kubelet.wait_registrations(1)
        assert reg.request.version == "v1beta1"
        assert reg.request.resource_name == GPU
        assert reg.request.endpoint == "gpuhook-nvidia.com-gpu.sock"  # a file name in kubelet's directory
        assert "/" not in reg.request.endpoint
        assert os.path.exists(os.path.join(kubelet.directory, reg.request.endpoint))
        assert reg.request.options.get_preferred_allocation_available
        assert not reg.request.options.pre_start_required
        # kubelet dialled us back before Register returned: we were serving first
        assert reg.options is not None and reg.options.get_preferred_allocation_available


def test_list_and_watch_full_list_in_index_order(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet) as plugin:
        kubelet.wait_registrations(1)
        first = kubelet.stream().first()
        assert health(first) == [(u, "Healthy") for u in uuids(plugin)]
        assert [[n.ID for n in d.topology.nodes] for d in first.devices] == [[0], [0]]
        # a second watcher gets the same full list
        again = kubelet.client().watch()
        assert again.first() == first
        again.cancel()


def test_list_and_watch_numa_nodes_from_sysfs(fake_driver_factory: Any, kubelet: TestKubelet) -> None:
    fake = fake_driver_factory(gpus=8)
    with running(fake, kubelet, health_config=HealthConfig(enabled=False)):
        kubelet.wait_registrations(1)
        msg = kubelet.stream().first()
        assert [d.topology.nodes[0].ID for d in msg.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_cdi_spec_written_for_exactly_the_advertised_devices(fake_driver_mig: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver_mig, kubelet, Options(mig_strategy="mixed")) as plugin:
        kubelet.wait_registrations(3)
        spec = codec.read(plugin.spec_path)
        assert os.path.basename(plugin.spec_path) == "k8s.device-plugin.nvidia.com-gpu.json"  # NVIDIA's
        inv = plugin.inventory
        assert inv is not None
        expected = {"all"}
        for gpu in inv.gpus:
            for dev in (gpu.mig_devices if gpu.mig_enabled else (gpu,)):
                expected |= {dev.uuid, str(dev.index) if dev is gpu else dev.name}
        assert {d["name"] for d in spec["devices"]} == expected
        from gpuhook.cdi.validate import validate_file

        assert validate_file(plugin.spec_path) == []


# -- Allocate ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
@pytest.mark.parametrize("strategies", [("cdi-cri",), ("envvar",), ("volume-mounts",), ("cdi-annotations",),
                                        ALL_STRATEGIES], ids=lambda s: "+".join(s))
def test_allocate_one_and_two_devices(fake_driver: Any, kubelet: TestKubelet, id_strategy: str,
                                      strategies: tuple[str, ...]) -> None:
    with running(fake_driver, kubelet, Options(id_strategy=id_strategy, list_strategies=strategies)) as plugin:
        kubelet.wait_registrations(1)
        ids = [d.ID for d in kubelet.stream().first().devices]
        assert ids == (uuids(plugin) if id_strategy == "uuid" else ["0", "1"])
        resp = kubelet.client().allocate(ids[:1], ids)
        assert len(resp.container_responses) == 2
        cdi_named = {"cdi-cri", "cdi-annotations"} & set(strategies)
        # as NVIDIA's: a spec only under a CDI strategy (Allocate names no CDI device otherwise)
        assert bool(plugin.spec_path) == bool(cdi_named)
        spec_dir = str(plugin.config.cdi_spec_dir)
        listed = sorted(os.listdir(spec_dir)) if os.path.isdir(spec_dir) else []
        assert listed == (["k8s.device-plugin.nvidia.com-gpu.json"] if cdi_named else [])
        spec_names = {f"{KIND}={d['name']}" for d in codec.read(plugin.spec_path)["devices"]} if cdi_named else set()
        for want, got in zip((ids[:1], ids), resp.container_responses):
            cdi = [c.name for c in got.cdi_devices]
            assert cdi == ([f"{KIND}={i}" for i in want] if "cdi-cri" in strategies else [])
            assert set(cdi) <= spec_names  # every name Allocate returns resolves in the spec we wrote
            env = dict(got.envs)
            # the marker beside CDI names and the variable, so the hook can tell a runtime that ignored the names
            marker = env.pop("GPUHOOK_CDI_DEVICES", None)
            both = "cdi-cri" in strategies and {"envvar", "volume-mounts"} & set(strategies)
            assert marker == (",".join(cdi) if both else None)
            if "envvar" in strategies:
                assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(want)
            elif "volume-mounts" in strategies:
                assert env["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
            else:
                assert env == {}
            mounts = [(m.container_path, m.host_path, m.read_only) for m in got.mounts]
            assert mounts == ([(f"/var/run/nvidia-container-devices/{i}", "/dev/null", True) for i in want]
                              if "volume-mounts" in strategies else [])
            annotations = dict(got.annotations)
            if "cdi-annotations" in strategies:
                assert annotations == {annotation_key(i): f"{KIND}={i}" for i in want}
                assert all(len(k.split("/", 1)[1]) <= 63 for k in annotations)
            else:
                assert annotations == {}
            assert list(got.devices) == []


def test_annotation_keys_are_valid_names() -> None:
    assert annotation_key("0:1") == "cdi.k8s.io/gpuhook_0_1"
    long_key = annotation_key("MIG-" + "a" * 80)
    assert len(long_key.split("/", 1)[1]) <= 63
    assert long_key == annotation_key("MIG-" + "a" * 80)  # deterministic


def test_allocate_seals_its_cdi_marker_with_the_nodes_key(fake_driver: Any, kubelet: TestKubelet,
                                                          tmp_path: Path) -> None:
    """With the hooks' state dir, the plugin makes the node's key there (root's alone) and seals the marker with
    it: the hook then records what this plugin allocated, and nothing an image sets in its own environment."""
    from gpuhook.fileio.secret import read_secret
    from gpuhook.hook.cdiignored import record
    from gpuhook.model import cdiignored
    from gpuhook.model.contract import PLUGIN_KEY

    state = tmp_path / "records"
    state.mkdir()  # as the DaemonSet's hostPath makes it
    with running(fake_driver, kubelet, Options(list_strategies=ALL_STRATEGIES), hook_state_dir=str(state)):
        kubelet.wait_registrations(1)
        ids = [d.ID for d in kubelet.stream().first().devices]
        marker = dict(kubelet.client().allocate(ids[:1]).container_responses[0].envs)["GPUHOOK_CDI_DEVICES"]
    key = read_secret(str(state / PLUGIN_KEY))
    assert key and (state / PLUGIN_KEY).stat().st_mode & 0o777 == 0o600
    names = cdiignored.names_of(marker)
    assert marker != names and cdiignored.sealed_by(key, marker)
    assert record(str(state), "c1", (names,), marker).endswith(f"recorded in {state / 'cdi-ignored'}")
    assert "no record" in record(str(state), "c2", (names,), names)  # the same names, unsealed: an image's


def test_allocate_unknown_ids_fail_naming_them(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet):
        kubelet.wait_registrations(1)
        good = kubelet.stream().first().devices[0].ID
        with pytest.raises(grpc.RpcError) as err:
            kubelet.client().allocate([good, "GPU-nope", "7"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-nope" in err.value.details() and "7" in err.value.details()
        assert good not in err.value.details()


def test_allocate_unhealthy_id_fails_naming_it(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet, health_config=HealthConfig(recovery_window=30, interval=0.05)):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        ids = [d.ID for d in stream.first().devices]
        wait_nvml_events(fake_driver, 2)
        fake_driver.inject_xid(1, 79)
        stream.wait_for(lambda m: m.devices[1].health == "Unhealthy")
        with pytest.raises(grpc.RpcError) as err:
            kubelet.client().allocate([ids[1]])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unhealthy" in err.value.details() and ids[1] in err.value.details()
        assert kubelet.client().allocate([ids[0]]).container_responses[0].cdi_devices[0].name == f"{KIND}={ids[0]}"


# -- GetPreferredAllocation ------------------------------------------------------------------------------------------


def test_preferred_allocation_numa_and_pci(fake_driver_factory: Any, kubelet: TestKubelet) -> None:
    fake = fake_driver_factory(gpus=8)
    with running(fake, kubelet, Options(id_strategy="index"), HealthConfig(enabled=False)):
        kubelet.wait_registrations(1)
        c = kubelet.client()
        everything = [str(i) for i in range(8)]
        # the fake's bus ids: 18 2a 3a 5d (NUMA 0) 9a ab ba db (NUMA 1): 2a/3a are the closest pair
        assert c.preferred(everything, size=2) == ["1", "2"]
        # must_include on NUMA node 1: the rest comes from node 1, the closest bus ids (ab, 9a) first
        assert c.preferred(everything, must=["6"], size=3) == ["6", "4", "5"]
        # node 0 only has 3 left: a request of 3 fits node 0 exactly, one of 4 moves to node 1 whole
        avail = ["1", "2", "3", "4", "5", "6", "7"]
        assert c.preferred(avail, size=3) == ["1", "2", "3"]
        assert c.preferred(avail, size=4) == ["4", "5", "6", "7"]
        # nothing fits one node: spread, must-include node first
        assert sorted(c.preferred(["0", "1", "4", "5"], must=["4"], size=3)) == ["0", "4", "5"]
        # deterministic whatever the order kubelet lists them in
        assert c.preferred(list(reversed(avail)), size=3) == c.preferred(avail, size=3)
        assert c.preferred(everything, must=["2", "1"], size=2) == ["2", "1"]


def test_preferred_allocation_falls_back_when_topology_fails(fake_driver: Any, kubelet: TestKubelet,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with running(fake_driver, kubelet, Options(id_strategy="index")) as plugin:
        kubelet.wait_registrations(1)
        chooser = plugin.served[0].service.chooser

        def broken(*args: object) -> list[str]:
            raise RuntimeError("topology query failed")

        chooser._pick = broken  # type: ignore[method-assign]
        assert kubelet.client().preferred(["1", "0"], size=1) == ["0"]
        assert "falling back to index order" in caplog.text


# -- health --------------------------------------------------------------------------------------------------------


def test_xid_marks_unhealthy_on_the_stream_then_recovers(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        ids = [d.ID for d in stream.first().devices]
        wait_nvml_events(fake_driver, 2)
        fake_driver.inject_xid(0, 79)  # fallen off the bus: critical
        sick = stream.wait_for(lambda m: m.devices[0].health == "Unhealthy")
        assert health(sick) == [(ids[0], "Unhealthy"), (ids[1], "Healthy")]  # same order as before
        start = len(stream.messages)
        well = stream.wait_for(lambda m: m.devices[0].health == "Healthy", start=start - 1 + 1, timeout=5)
        assert health(well) == [(ids[0], "Healthy"), (ids[1], "Healthy")]


def test_application_xids_are_ignored(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        stream.first()
        wait_nvml_events(fake_driver, 2)
        for xid in (13, 31, 43, 45, 68, 109):
            fake_driver.inject_xid(0, xid)
        fake_driver.inject_xid(1, 48)  # double-bit ECC: critical, and a marker that the queue was read
        stream.wait_for(lambda m: m.devices[1].health == "Unhealthy")
        assert all(m.devices[0].health == "Healthy" for m in stream.messages)


def test_configured_xid_list(fake_driver: Any, kubelet: TestKubelet) -> None:
    config = HealthConfig(ignored_xids=frozenset({79}), recovery_window=0.5, interval=0.05, event_wait_ms=20)
    with running(fake_driver, kubelet, health_config=config):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        stream.first()
        wait_nvml_events(fake_driver, 2)
        fake_driver.inject_xid(0, 79)
        fake_driver.inject_xid(1, 13)  # no longer ignored
        stream.wait_for(lambda m: m.devices[1].health == "Unhealthy")
        assert all(m.devices[0].health == "Healthy" for m in stream.messages)


def test_lost_gpu_unhealthy_until_back(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        stream.first()
        fake_driver.set_gpu_lost(1)
        stream.wait_for(lambda m: m.devices[1].health == "Unhealthy")
        fake_driver.set_gpu_lost(1, False)
        msg = stream.wait_for(lambda m: m.devices[1].health == "Healthy", start=len(stream.messages) - 1)
        assert [d.health for d in msg.devices] == ["Healthy", "Healthy"]


def test_event_wait_answering_at_once_does_not_spin(fake_driver: Any, kubelet: TestKubelet) -> None:
    """A driver whose nvmlEventSetWait returns NVML_ERROR_TIMEOUT without blocking: the health thread waits out
    the rest of its event wait itself (a spinning thread would take the GIL from every RPC), and keeps checking."""
    config = HealthConfig(recovery_window=0.5, interval=0.05, event_wait_ms=50)
    fake_driver.set_wait_at_once()
    with running(fake_driver, kubelet, health_config=config):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        stream.first()
        deadline = time.monotonic() + 10
        while fake_driver.event_waits() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        before = fake_driver.event_waits()
        time.sleep(0.5)
        waits = fake_driver.event_waits() - before
        # ~10 waits of 50 ms fit in 0.5 s; a loop that does not wait makes thousands of calls in that time
        assert 3 <= waits <= 40, waits
        fake_driver.set_gpu_lost(1)
        stream.wait_for(lambda m: m.devices[1].health == "Unhealthy")


def test_vanished_device_node_unhealthy_until_back(fake_driver_factory: Any, kubelet: TestKubelet) -> None:
    fake = fake_driver_factory(fresh=True)
    node = str(fake.root / "dev" / "nvidia0")
    with running(fake, kubelet):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        stream.first()
        os.rename(node, node + ".away")
        try:
            stream.wait_for(lambda m: m.devices[0].health == "Unhealthy")
        finally:
            os.rename(node + ".away", node)
        stream.wait_for(lambda m: m.devices[0].health == "Healthy", start=len(stream.messages) - 1)


def test_health_checks_off(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet, health_config=HealthConfig(enabled=False)):
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        stream.first()
        fake_driver.set_gpu_lost(0)
        fake_driver.inject_xid(0, 79)
        time.sleep(0.3)
        assert len(stream.messages) == 1
        assert fake_driver.registrations() == []


def test_no_nvml_events_degrades_to_node_and_handle_checks(fake_driver: Any, kubelet: TestKubelet,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with running(fake_driver, kubelet, health_config=HealthConfig(recovery_window=0.5, interval=0.05)) as plugin:
        kubelet.wait_registrations(1)
        stream = kubelet.stream()
        stream.first()
        wait_nvml_events(fake_driver, 2)
        monitor = plugin.monitor
        assert monitor is not None and monitor.events_supported
    # Now without the library: only device nodes are watched, and the plugin still runs.
    inv = inventory(fake_driver)
    config = PluginConfig(kubelet_dir=kubelet.directory, cdi_spec_dir=None, hook_path="/bin/true",
                          health=HealthConfig(interval=0.05), nvml_library="/nonexistent/libnvidia-ml.so.1",
                          hook_state_dir=None)
    plugin = Plugin(config, lambda: inv)
    plugin.start()
    try:
        kubelet.wait_registrations(2)
        time.sleep(0.2)
        assert "only device nodes are checked" in caplog.text
        assert [d.health for d in kubelet.stream().first().devices] == ["Healthy", "Healthy"]
    finally:
        plugin.shutdown()


# -- MIG strategies and replicas -------------------------------------------------------------------------------------


def test_mig_strategy_none_advertises_whole_gpus(fake_driver_mig: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver_mig, kubelet, Options(mig_strategy="none", id_strategy="index")):
        (reg,) = kubelet.wait_registrations(1)
        assert [d.ID for d in kubelet.stream().first().devices] == ["0", "1", "2", "3"]


def test_mig_strategy_mixed_one_socket_per_resource(fake_driver_mig: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver_mig, kubelet, Options(mig_strategy="mixed", id_strategy="index")) as plugin:
        regs = kubelet.wait_registrations(3)
        by_name = {r.request.resource_name: r.request.endpoint for r in regs}
        assert by_name == {
            GPU: "gpuhook-nvidia.com-gpu.sock",
            "nvidia.com/mig-1g.10gb": "gpuhook-nvidia.com-mig-1g.10gb.sock",
            "nvidia.com/mig-2g.20gb": "gpuhook-nvidia.com-mig-2g.20gb.sock",
        }
        assert [d.ID for d in kubelet.stream(GPU).first().devices] == ["0", "2", "3"]
        inv = plugin.inventory
        assert inv is not None
        small = [m.name for m in inv.gpus[1].mig_devices if m.profile == "1g.10gb"]
        big = [m.name for m in inv.gpus[1].mig_devices if m.profile == "2g.20gb"]
        assert [d.ID for d in kubelet.stream("nvidia.com/mig-1g.10gb").first().devices] == small
        assert [d.ID for d in kubelet.stream("nvidia.com/mig-2g.20gb").first().devices] == big
        resp = kubelet.client("nvidia.com/mig-1g.10gb").allocate(small)
        assert [c.name for c in resp.container_responses[0].cdi_devices] == [f"{KIND}={n}" for n in small]
        with pytest.raises(grpc.RpcError) as err:  # a GPU id is not a device of the MIG resource
            kubelet.client("nvidia.com/mig-1g.10gb").allocate(["0"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_mig_xid_marks_only_its_instance(fake_driver_mig: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver_mig, kubelet, Options(mig_strategy="mixed", id_strategy="index")) as plugin:
        kubelet.wait_registrations(3)
        inv = plugin.inventory
        assert inv is not None
        small = [m for m in inv.gpus[1].mig_devices if m.profile == "1g.10gb"]
        stream = kubelet.stream("nvidia.com/mig-1g.10gb")
        stream.first()
        wait_nvml_events(fake_driver_mig, 4)
        fake_driver_mig.inject_xid(1, 79, small[1].gi, small[1].ci)
        msg = stream.wait_for(lambda m: any(d.health == "Unhealthy" for d in m.devices))
        assert health(msg) == [(small[0].name, "Healthy"), (small[1].name, "Unhealthy")]
        assert all(d.health == "Healthy" for d in kubelet.stream(GPU).messages[-1].devices)


def test_mig_strategy_single(fake_driver_factory: Any, kubelet: TestKubelet) -> None:
    fake = fake_driver_factory(gpus=2, mig={0: ["1g.10gb", "1g.10gb"], 1: ["1g.10gb"]})
    with running(fake, kubelet, Options(mig_strategy="single")) as plugin:
        (reg,) = kubelet.wait_registrations(1)
        assert reg.request.resource_name == GPU
        inv = plugin.inventory
        assert inv is not None
        migs = [m.uuid for m in inv.all_mig_devices()]
        ids = [d.ID for d in kubelet.stream().first().devices]
        assert ids == migs and all(i.startswith("MIG-") for i in ids)
        resp = kubelet.client().allocate(ids[:2])
        assert [c.name for c in resp.container_responses[0].cdi_devices] == [f"{KIND}={i}" for i in ids[:2]]


def test_mig_strategy_single_refuses_mixed_layouts(fake_driver_mig: Any, kubelet: TestKubelet) -> None:
    with pytest.raises(ConfigError, match="single"), running(fake_driver_mig, kubelet, Options(mig_strategy="single")):
        pass


def test_replicas(fake_driver: Any, kubelet: TestKubelet) -> None:
    with running(fake_driver, kubelet, Options(replicas=3, list_strategies=("cdi-cri", "envvar"))) as plugin:
        kubelet.wait_registrations(1)
        u = uuids(plugin)
        ids = [d.ID for d in kubelet.stream().first().devices]
        assert ids == [f"{g}::{n}" for g in u for n in range(3)]
        c = kubelet.client()
        resp = c.allocate([f"{u[0]}::0", f"{u[0]}::2"], [f"{u[1]}::1"])
        first, second = resp.container_responses
        assert [d.name for d in first.cdi_devices] == [f"{KIND}={u[0]}"]  # two replicas of one GPU: named once
        assert first.envs["NVIDIA_VISIBLE_DEVICES"] == u[0]
        assert [d.name for d in second.cdi_devices] == [f"{KIND}={u[1]}"]
        # time-slicing spreads: two replicas come from two GPUs, the least shared first
        assert c.preferred(ids, size=2) == [f"{u[0]}::0", f"{u[1]}::0"]
        assert c.preferred([i for i in ids if i != f"{u[0]}::0"], size=1) == [f"{u[1]}::0"]
        with pytest.raises(grpc.RpcError):
            c.allocate([f"{u[0]}::3"])


# -- lifecycle: a real `gpuhook device-plugin` process --------------------------------------------------------------


def plugin_args(fake: Any, kubelet: TestKubelet, *extra: str) -> list[str]:
    return ["--driver-root", str(fake.root), "--proc-root", str(fake.root / "proc"), "--kubelet-dir", kubelet.directory,
            "--cdi-spec-dir", os.path.join(os.path.dirname(kubelet.directory), "cdi"), "--hook-path", "/bin/true",
            "--sys-root", str(fake.root / "sys"), "--health-interval", "0.05",
            "--hook-state-dir", os.path.join(os.path.dirname(kubelet.directory), "records"), *extra]


def served_sockets(kubelet: TestKubelet) -> list[str]:
    """The plugin process's sockets in kubelet's folder: each process tags its own names."""
    return sorted(glob.glob(os.path.join(kubelet.directory, "gpuhook-nvidia.com-gpu-*.sock")))


def test_process_registers_serves_and_exits_cleanly_on_sigterm(fake_driver: Any, kubelet: TestKubelet,
                                                               workdir: str) -> None:
    with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
        (reg,) = kubelet.wait_registrations(1, timeout=20)
        (sock,) = served_sockets(kubelet)
        assert re.fullmatch(r"gpuhook-nvidia\.com-gpu-[0-9a-f]{8}\.sock", reg.request.endpoint)
        assert reg.request.endpoint == os.path.basename(sock)
        ids = [d.ID for d in kubelet.stream().first().devices]
        assert kubelet.client().allocate(ids[:1]).container_responses[0].cdi_devices[0].name == f"{KIND}={ids[0]}"
        stream = kubelet.stream()
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.log()
        assert not os.path.exists(sock)
        assert os.path.exists(kubelet.socket)  # kubelet's own socket is not ours to remove
        stream.ended.wait(5)
        assert stream.ended.is_set()


def test_a_new_plugin_serves_beside_the_one_it_replaces(fake_driver: Any, kubelet: TestKubelet,
                                                       workdir: str) -> None:
    """A rolling update with surge: the new process registers on its own socket while the old one still serves,
    the old one's stop removes only its own socket, and each says it is ready only once registered."""
    ready = [os.path.join(workdir, f"ready-{n}") for n in (1, 2)]
    with PluginProcess([*plugin_args(fake_driver, kubelet), "--ready-file", ready[0]],
                       os.path.join(workdir, "log1")) as old:
        kubelet.wait_registrations(1, timeout=20)
        wait_for_path(ready[0])
        (first,) = served_sockets(kubelet)
        with PluginProcess([*plugin_args(fake_driver, kubelet), "--ready-file", ready[1]],
                           os.path.join(workdir, "log2")) as new:
            regs = kubelet.wait_registrations(2, timeout=20)
            wait_for_path(ready[1])
            assert regs[1].request.endpoint != regs[0].request.endpoint
            assert os.path.exists(first)  # the old one's socket was left alone
            old.signal(signal.SIGTERM)
            assert old.wait(10) == 0, old.log()
            assert not os.path.exists(ready[0])
            (second,) = served_sockets(kubelet)
            assert second != first and os.path.basename(second) == regs[1].request.endpoint
            ids = [d.ID for d in kubelet.stream().first().devices]
            assert kubelet.client().allocate(ids[:1]).container_responses  # the new one answers
            new.signal(signal.SIGTERM)
            assert new.wait(10) == 0, new.log()
            assert not os.path.exists(ready[1]) and not served_sockets(kubelet)


def test_a_stream_kubelet_ends_is_answered_by_registering_again(fake_driver: Any, kubelet: TestKubelet,
                                                                 workdir: str) -> None:
    """A kubelet before 1.36 keeps one client per resource: when the plugin this one replaced stops, it
    disconnects this one's stream too and counts the resource unhealthy until a plugin registers again."""
    with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
        (first,) = kubelet.wait_registrations(1, timeout=20)
        dropped = kubelet.stream()
        dropped.first()
        dropped.cancel()  # kubelet closes our stream; our socket and kubelet.sock stay as they were
        regs = kubelet.wait_registrations(2, timeout=20)
        assert regs[1].request.endpoint == first.request.endpoint
        deadline = time.monotonic() + 20
        while kubelet.streams.get(GPU) is dropped:
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.05)
        assert len(kubelet.stream().first().devices) == 2
        assert "kubelet ended our ListAndWatch stream: registering again" in proc.log()
        time.sleep(1.0)  # and once only: the new stream stays open
        assert len(kubelet.registrations) == 2, proc.log()
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_start_removes_only_dead_plugin_sockets(fake_driver: Any, kubelet: TestKubelet, workdir: str) -> None:
    import socket as sockets

    dead = os.path.join(kubelet.directory, "gpuhook-nvidia.com-gpu-deadbeef.sock")
    live = os.path.join(kubelet.directory, "gpuhook-nvidia.com-gpu-0badcafe.sock")
    other = os.path.join(kubelet.directory, "other-vendor.sock")
    for path in (dead, other):
        with sockets.socket(sockets.AF_UNIX) as s:
            s.bind(path)  # closed without unlinking: nobody listens
    listener = sockets.socket(sockets.AF_UNIX)
    listener.bind(live)
    listener.listen(1)
    try:
        with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
            kubelet.wait_registrations(1, timeout=20)
            assert not os.path.exists(dead) and os.path.exists(live) and os.path.exists(other)
            assert f"removed {dead}: no plugin serves it" in proc.log()
            proc.signal(signal.SIGTERM)
            assert proc.wait(10) == 0
    finally:
        listener.close()


def wait_for_path(path: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_process_sigint_exits_zero(fake_driver: Any, kubelet: TestKubelet, workdir: str) -> None:
    with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
        kubelet.wait_registrations(1, timeout=20)
        proc.signal(signal.SIGINT)
        assert proc.wait(10) == 0, proc.log()
        assert os.listdir(kubelet.directory) == ["kubelet.sock"]


@pytest.mark.parametrize("remove_dir", [False, True], ids=["sockets-deleted", "dir-removed"])
def test_kubelet_restart_reregisters(fake_driver: Any, kubelet: TestKubelet, workdir: str,
                                                     remove_dir: bool) -> None:
    with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
        kubelet.wait_registrations(1, timeout=20)
        for _ in range(3):
            restarted = kubelet.restart(remove_dir=remove_dir)
            regs = kubelet.wait_registrations(1, timeout=20)  # how fast: bench/plugin.py (no timed asserts here)
            assert regs[0].at > restarted
            assert regs[0].options is not None  # and kubelet could dial the fresh socket
            ids = [d.ID for d in kubelet.stream().first().devices]
            assert len(ids) == 2
            assert kubelet.client().allocate(ids[:1]).container_responses
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.log()


def test_deleted_plugin_socket_is_served_again(fake_driver: Any, kubelet: TestKubelet, workdir: str) -> None:
    with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
        kubelet.wait_registrations(1, timeout=20)
        (sock,) = served_sockets(kubelet)
        os.unlink(sock)
        kubelet.wait_registrations(2, timeout=20)  # the same kubelet: the plugin noticed by itself
        assert os.path.exists(sock)
        assert kubelet.stream().first().devices
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_registers_once_kubelet_appears(fake_driver: Any, workdir: str) -> None:
    kubelet = TestKubelet(os.path.join(workdir, "dp"))
    os.makedirs(kubelet.directory)
    with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
        deadline = time.monotonic() + 20
        while not served_sockets(kubelet):
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
            time.sleep(0.02)
        time.sleep(0.3)  # a few failed attempts
        with kubelet:
            started = time.monotonic()
            (reg,) = kubelet.wait_registrations(1, timeout=20)
            assert reg.at > started
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_process_health_event_reaches_the_stream(fake_driver: Any, kubelet: TestKubelet, workdir: str) -> None:
    args = plugin_args(fake_driver, kubelet, "--recovery-window", "0.5")
    with PluginProcess(args, os.path.join(workdir, "log")) as proc:
        kubelet.wait_registrations(1, timeout=20)
        stream = kubelet.stream()
        stream.first()
        wait_nvml_events(fake_driver, 2, pid=proc.proc.pid)
        fake_driver.inject_xid(1, 79)
        stream.wait_for(lambda m: m.devices[1].health == "Unhealthy")
        stream.wait_for(lambda m: m.devices[1].health == "Healthy", start=len(stream.messages) - 1)
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_bad_configuration_is_one_line(fake_driver_mig: Any, kubelet: TestKubelet, workdir: str) -> None:
    args = plugin_args(fake_driver_mig, kubelet, "--mig-strategy", "single")
    with PluginProcess(args, os.path.join(workdir, "log")) as proc:
        assert proc.wait(20) == 1
        out = proc.log().strip().splitlines()
        assert out[-1].startswith("gpuhook: MIG strategy single"), out
        assert "Traceback" not in proc.log()
        assert not served_sockets(kubelet)


# -- spec paths, reload, deployment files ---------------------------------------------------------------------------


def test_spec_host_paths_rebased_to_the_host_driver_root(fake_driver: Any, workdir: str) -> None:
    from gpuhook.plugin import cdispec
    from gpuhook.plugin.devices import plan

    inv = inventory(fake_driver)
    resources = plan(inv, Options())
    path = cdispec.write(inv, resources, os.path.join(workdir, "cdi"), "/usr/local/bin/gpuhook", "/")
    text = Path(path).read_text(encoding="utf-8")
    assert str(fake_driver.root) not in text
    spec = codec.read(path)
    nodes = [n for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
    assert {n["hostPath"] for n in nodes if n["path"] == "/dev/nvidia0"} == {"/dev/nvidia0"}
    mounts = spec["containerEdits"]["mounts"]
    assert mounts and all(not m["hostPath"].startswith(str(fake_driver.root)) for m in mounts)
    assert cdispec.rebase("/a/b/c", "/a", "/x") == "/x/b/c"
    assert cdispec.rebase("/ab/c", "/a", "/x") == "/ab/c"
    assert cdispec.rebase("/usr/lib/x", "/", "/run/nvidia/driver") == "/run/nvidia/driver/usr/lib/x"


def test_spec_host_paths_with_a_dev_root_apart(fake_driver: Any, workdir: str) -> None:
    """NVIDIA_DRIVER_ROOT=/run/nvidia/driver (a driver container) with NVIDIA_DEV_ROOT=/: mounts name the driver
    root, device nodes the host's /dev."""
    from gpuhook.plugin import cdispec
    from gpuhook.plugin.devices import plan

    inv = inventory(fake_driver)
    path = cdispec.write(inv, plan(inv, Options()), os.path.join(workdir, "cdi"), "/usr/local/bin/gpuhook",
                         "/run/nvidia/driver", "/")
    spec = codec.read(path)
    nodes = {n["hostPath"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])}
    assert "/dev/nvidia0" in nodes and all(n.startswith("/dev/") for n in nodes)
    mounts = spec["containerEdits"]["mounts"]
    assert mounts and all(m["hostPath"].startswith("/run/nvidia/driver/") for m in mounts)


def test_sighup_rediscovers_and_registers_again(fake_driver: Any, kubelet: TestKubelet, workdir: str) -> None:
    spec = os.path.join(workdir, "cdi", "k8s.device-plugin.nvidia.com-gpu.json")
    with PluginProcess(plugin_args(fake_driver, kubelet), os.path.join(workdir, "log")) as proc:
        kubelet.wait_registrations(1, timeout=20)
        before = os.stat(spec).st_mtime_ns
        time.sleep(0.01)
        proc.signal(signal.SIGHUP)
        kubelet.wait_registrations(2, timeout=5)
        assert os.stat(spec).st_mtime_ns > before
        assert len(kubelet.stream().first().devices) == 2
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.log()


def test_deployment_manifests_parse() -> None:
    import yaml

    base = Path(__file__).parent.parent / "plugin"
    (ds,) = yaml.safe_load_all((base.parent / "deploy/base/device-plugin/daemonset.yaml").read_text(encoding="utf-8"))
    assert ds["kind"] == "DaemonSet"
    pod = ds["spec"]["template"]["spec"]
    paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {"/var/lib/kubelet/device-plugins", "/var/run/cdi", "/dev", "/"} <= paths
    assert pod["serviceAccountName"] == "gpuhook-device-plugin"  # it may read its own DaemonSet, nothing else
    args = pod["containers"][0]["args"]
    assert args[0] == "device-plugin"
    from click.testing import CliRunner

    from gpuhook.cli.plugin import device_plugin

    # every flag the manifest passes exists (parse only: --help after them stops before running)
    result = CliRunner().invoke(device_plugin, [a.split("#")[0].strip() for a in args[1:]] + ["--help"])
    assert result.exit_code == 0, result.output
    (example,) = yaml.safe_load_all((base / "example-pod.yaml").read_text(encoding="utf-8"))
    assert example["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}


# -- pure parts ------------------------------------------------------------------------------------------------------


def test_chooser_is_deterministic_and_honours_must_include() -> None:
    from gpuhook.plugin.topology import Chooser, Place

    class D:
        def __init__(self, i: int) -> None:
            self.id, self.key, self.replica = str(i), (i, -1), 0

    devices = [D(i) for i in range(6)]
    table = {str(i): Place(i // 3, (0, 0x10 * (i + 1), 0, 0)) for i in range(6)}
    chooser = Chooser(devices, table)  # type: ignore[arg-type]
    ids = [str(i) for i in range(6)]
    assert chooser.choose(ids, [], 3) == ["0", "1", "2"]
    assert chooser.choose(ids, ["4"], 2) == ["4", "3"]  # 3 and 5 are equally close: the lower index wins
    assert chooser.choose(ids, ["4"], 3) == ["4", "3", "5"]
    assert chooser.choose(ids, ["1", "2"], 2) == ["1", "2"]
    assert chooser.choose(ids, ["1", "2"], 1) == ["1", "2"]  # never drops what kubelet insists on
    assert chooser.choose(["5", "0", "4"], [], 6) == ["0", "4", "5"]  # asks for more than there is
    assert all(chooser.choose(list(reversed(ids)), [], n) == chooser.choose(ids, [], n) for n in range(1, 7))


def test_plan_errors_are_one_line() -> None:
    from support.inv import sample_inventory

    from gpuhook.plugin.devices import plan
    from gpuhook.plugin.health import parse_xids

    inv = sample_inventory()  # GPU 2 in MIG mode, GPUs 0 and 1 whole
    with pytest.raises(ConfigError, match="GPU 0, 1 is not"):
        plan(inv, Options(mig_strategy="single"))
    with pytest.raises(ConfigError, match="invalid resource name"):
        plan(inv, Options(resource_name="gpu"))
    with pytest.raises(ConfigError, match="unknown device list strategy bogus"):
        plan(inv, Options(list_strategies=("cdi-cri", "bogus")))
    assert parse_xids(" 13, 31 ,") == frozenset({13, 31}) and parse_xids("") == frozenset()
    with pytest.raises(ValueError):
        parse_xids("13,x")


# -- the allocation log ------------------------------------------------------------


def test_allocate_and_preferred_allocation_are_logged(fake_driver: Any, kubelet: TestKubelet,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuhook.plugin.server")
    with running(fake_driver, kubelet, Options(id_strategy="index")):
        kubelet.wait_registrations(1)
        kubelet.client().allocate(["1"], ["0", "1"])
        assert kubelet.client().preferred(["1", "0"], size=1) == ["0"]
        with pytest.raises(grpc.RpcError):
            kubelet.client().allocate(["7"])
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuhook.plugin.server"]
    allocate = [m for m in lines if m.startswith("Allocate ")]
    assert re.fullmatch(rf"Allocate {GPU}: ids \[1\]; \[0,1\] -> \[{KIND}=1\]; \[{KIND}=0,{KIND}=1\] in \d+\.\d ms",
                        allocate[0]), allocate
    assert re.fullmatch(rf"Allocate {GPU}: ids \[7\] refused in \d+\.\d ms: unknown device ids: 7", allocate[1])
    preferred = [m for m in lines if m.startswith("GetPreferredAllocation ")]
    assert re.fullmatch(rf"GetPreferredAllocation {GPU}: available \[1,0\] must \[\] size 1 -> \[0\] \({KIND}=0\) "
                        r"in \d+\.\d ms", preferred[0]), preferred
    info = {r.getMessage(): r.levelno for r in caplog.records}
    assert info[allocate[0]] == logging.INFO and info[preferred[0]] == logging.INFO


@pytest.mark.parametrize("kind", ["fifo", "file", "directory"])
def test_start_never_removes_what_is_not_a_stale_socket(fake_driver: Any, kubelet: TestKubelet, kind: str) -> None:
    """Only a socket left by an earlier run is removed before bind; anything else at the path stays, and the start
    fails naming it (the plugin's own host write)."""
    path = Path(kubelet.directory) / "gpuhook-nvidia.com-gpu.sock"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        path.write_text("keep me")
    else:
        path.mkdir()
    config = PluginConfig(options=Options(), kubelet_dir=kubelet.directory,
                          cdi_spec_dir=os.path.join(os.path.dirname(kubelet.directory), "cdi"),
                          hook_path="/bin/true", health=FAST_HEALTH, sys_root=str(fake_driver.root / "sys"),
                          hook_state_dir=None)
    inv = inventory(fake_driver)
    plugin = Plugin(config, lambda: inv)
    try:
        with pytest.raises(OSError, match=rf"cannot listen on {path}: it is a"):
            plugin.start()
    finally:
        plugin.shutdown()
    assert os.path.lexists(path) and (kind != "file" or path.read_text() == "keep me")


def test_plugin_makes_dev_char_links_at_start(fake_driver: Any, kubelet: TestKubelet, tmp_path: Path) -> None:
    """With --dev-char-path the plugin links every NVIDIA node there at (re)discovery, so systemd's
    daemon-reload leaves containers their GPUs; idempotent across a second start."""
    inv = inventory(fake_driver)
    dev_char = tmp_path / "char"
    config = PluginConfig(kubelet_dir=kubelet.directory, cdi_spec_dir=None, hook_path="/bin/true",
                          health=HealthConfig(enabled=False), dev_char_path=str(dev_char), hook_state_dir=None)
    for _ in range(2):
        plugin = Plugin(config, lambda: inv)
        plugin.start()
        plugin.shutdown()
    gpu0 = inv.gpus[0].node
    assert os.readlink(dev_char / f"{gpu0.major}:{gpu0.minor}") == gpu0.host_path
    ctl = inv.control_nodes["nvidiactl"]
    assert os.readlink(dev_char / f"{ctl.major}:{ctl.minor}") == ctl.host_path
