"""plugin/removal.py: which of the device plugin's files it would take off the node, and that it takes none off
when it cannot learn that its DaemonSet is gone (the cluster end-to-end test runs the removal itself, after
`helm uninstall`, against a real API server)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpuhook.discover import Roots, discover
from gpuhook.model.contract import PLUGIN_KEY
from gpuhook.plugin import removal
from gpuhook.plugin.cdispec import SPEC_FILE
from gpuhook.plugin.lifecycle import PluginConfig
from gpuhook.system.devchar import create_links


def _node(tmp_path: Path, fake: Any) -> tuple[PluginConfig, Any, list[str]]:
    inv = discover(Roots.make(str(fake.root), proc_root=str(fake.root / "proc")))
    cdi, state, dev_char = tmp_path / "cdi", tmp_path / "state", tmp_path / "char"
    for folder in (cdi, state):
        folder.mkdir()
    (cdi / SPEC_FILE).write_text("{}")
    (cdi / "someone-else.json").write_text("{}")
    (state / PLUGIN_KEY).write_bytes(b"k")
    (tmp_path / "features").write_text("nvidia.com/gpu.present=true\n")
    made = create_links(inv, str(dev_char)).created
    (dev_char / "1:3").symlink_to("../null")  # not an NVIDIA node's: never ours
    config = PluginConfig(cdi_spec_dir=str(cdi), feature_file=str(tmp_path / "features"),
                          dev_char_path=str(dev_char), hook_state_dir=str(state), daemonset="gpuhook-device-plugin")
    ours = [str(cdi / SPEC_FILE), str(tmp_path / "features"), str(state / PLUGIN_KEY), *made]
    return config, inv, ours


def test_the_plugins_node_files_are_its_spec_features_key_and_links_to_its_gpus(fake_driver: Any,
                                                                                tmp_path: Path) -> None:
    config, inv, ours = _node(tmp_path, fake_driver)
    assert len(ours) > 4
    assert sorted(removal.node_files(config, inv)) == sorted(ours)


def test_nothing_is_removed_when_the_daemonset_cannot_be_asked(fake_driver: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    config, inv, ours = _node(tmp_path, fake_driver)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with caplog.at_level("INFO", logger="gpuhook.plugin"):
        removal.on_stop(config, inv)
    assert all(os.path.lexists(p) for p in ours)
    assert "stay for the next pod" in caplog.text
