"""The hook's config file and its inventory cache (invalidated when the driver changes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpuhook.discover.cache import inventory, load_fresh
from gpuhook.discover.roots import Roots
from gpuhook.errors import ConfigError
from gpuhook.hook.config import Config, load_config, parse_config


def test_defaults_when_default_file_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpuhook.hook.config.DEFAULT_PATH", str(tmp_path / "absent.toml"))
    config = load_config(None)
    assert config == Config()
    assert config.ldconfig == "@/sbin/ldconfig" and config.log_file == "/var/log/gpuhook.log"
    assert config.policy.accept_envvar_unprivileged
    # NVIDIA's accept-nvidia-visible-devices-as-volume-mounts is false by default
    assert not config.accept_volume_mounts and not config.policy.accept_volume_mounts


def test_full_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'driver-root = "/run/nvidia/driver"\nproc-root = "/proc"\nldconfig = "@/usr/sbin/ldconfig"\n'
        'log-file = ""\naccept-envvar-unprivileged = false\naccept-volume-mounts = false\n'
        'disable-require = true\nsupported-capabilities = ["compute", "utility"]\ninventory-cache = ""\n'
    )
    c = load_config(str(path))
    assert (c.driver_root, c.ldconfig, c.log_file, c.inventory_cache) == (
        "/run/nvidia/driver",
        "@/usr/sbin/ldconfig",
        "",
        "",
    )
    assert not c.policy.accept_envvar_unprivileged and c.policy.disable_require
    assert c.policy.supported_capabilities == {"compute", "utility"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("driver-root = ", "invalid TOML"),
        ("bogus = 1", "unknown key 'bogus'"),
        ('accept-envvar-unprivileged = "no"', "must be true or false"),
        ("driver-root = 5", "must be a string"),
        ('supported-capabilities = ["compute", "gpu"]', "unknown capability 'gpu'"),
        ('supported-capabilities = "compute"', "must be a list"),
    ],
)
def test_bad_config_names_the_offending_value(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text, "/etc/gpuhook/config.toml")


def test_relative_root_and_missing_explicit_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('driver-root = "relative/dir"\n')
    with pytest.raises(ConfigError, match="absolute path"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.toml"))


def test_cache_is_reused_then_invalidated_by_driver_change(fake_driver_factory: Any, tmp_path: Path) -> None:
    fake = fake_driver_factory(gpus=2, fresh=True)
    roots = Roots.make(str(fake.root), None, str(Path(fake.root) / "proc"))
    cache = tmp_path / "inventory.json"
    first = inventory(roots, str(cache))
    assert cache.exists() and load_fresh(str(cache), roots) is not None
    # a cached inventory is used as is: prove it by planting a marker in the cache
    data = json.loads(cache.read_text())
    data["cuda_version"] = "from-cache"
    cache.write_text(json.dumps(data))
    assert inventory(roots, str(cache)).cuda_version == "from-cache"
    # a GPU node disappearing changes the fingerprint: rediscovered, cache rewritten
    os.unlink(Path(fake.root) / "dev/nvidia1")
    again = inventory(roots, str(cache))
    assert again.cuda_version == first.cuda_version and len(again.gpus) == 1
    assert json.loads(cache.read_text())["fingerprint"] == again.fingerprint != first.fingerprint


def test_driver_version_change_invalidates(fake_driver_factory: Any, tmp_path: Path) -> None:
    fake = fake_driver_factory(gpus=1, fresh=True)
    roots = Roots.make(str(fake.root), None, str(Path(fake.root) / "proc"))
    cache = tmp_path / "inventory.json"
    inventory(roots, str(cache))
    version = Path(fake.root) / "proc/driver/nvidia/version"
    version.write_text(version.read_text().replace(fake.driver_version, "999.1.2"))
    assert load_fresh(str(cache), roots) is None


def test_unreadable_cache_is_ignored(tmp_path: Path) -> None:
    cache = tmp_path / "inventory.json"
    cache.write_text("{not json")
    assert load_fresh(str(cache), Roots.make("/")) is None
    cache.write_text(json.dumps({"format": 99}))
    assert load_fresh(str(cache), Roots.make("/")) is None


def test_swarm_resource_in_nvidias_comma_form_and_as_a_list() -> None:
    """NVIDIA's config.toml writes swarm-resource as one comma list; it is split once, when the config is read."""
    assert parse_config('swarm-resource = "DOCKER_RESOURCE_GPUS, DOCKER_RESOURCE_GPUS_ADDITIONAL"').swarm_resource == (
        "DOCKER_RESOURCE_GPUS", "DOCKER_RESOURCE_GPUS_ADDITIONAL")
    assert parse_config('swarm-resource = ["A", "B"]').swarm_resource == ("A", "B")
    assert parse_config('swarm-resource = ""').policy.swarm_resource == ()
