"""README.md says what the product does: the parts a user copies or relies on are checked against the code."""

from __future__ import annotations

import re
from pathlib import Path

from support.cdi_inventory import synthetic_inventory

from gpuhook.cdi.spec import build_spec
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.hook.config import Config
from gpuhook.runtimeconfig.runtimes import DOCKER_RUNTIME, RUNTIME_SHIM, Options, plan

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_cdi_section_names_the_container_hooks_the_spec_has() -> None:
    spec = build_spec(synthetic_inventory(gpus=2), hook_path="/usr/local/bin/gpuhook-hook")
    hooks = [h for e in [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]
             for h in e.get("hooks", [])]
    commands = sorted({" ".join(h["args"][1:3]) for h in hooks})
    assert commands == ["cdi-hook update-container"]
    words = {1: "one", 2: "two", 3: "three"}[len(hooks)]
    assert f"{words} `createContainer` hook" in README
    for command in commands:
        assert f"`gpuhook {command} " in README


def test_config_example_is_the_defaults() -> None:
    """The README's config.toml block shows every key with its default (accept-volume-mounts = false)."""
    block = re.search(r"### Configuration: .*?```toml\n(.*?)```", README, re.S)
    assert block is not None
    shown = tomllib.loads(block.group(1))
    defaults = Config()
    assert {k.replace("-", "_") for k in shown} == {n for n in Config.__slots__ if n != "source"} - {
        "_supported_capabilities"} | {"supported_capabilities"}
    for key, value in shown.items():
        want = getattr(defaults, key.replace("-", "_"))
        assert (list(want) if isinstance(want, tuple) else want) == value, key


def test_docker_hook_mode_registers_the_shim(tmp_path: Path) -> None:
    result = plan(Options("docker", "hook", config=str(tmp_path / "daemon.json"),
                          hook_path="/usr/local/bin/gpuhook-hook"))
    new = result.changes[0].new
    assert f'"{DOCKER_RUNTIME}"' in new and f"/usr/local/bin/{RUNTIME_SHIM}" in new
    assert f"Docker has no hooks directory, so its hook mode registers the `{RUNTIME_SHIM}` shim" in \
        README.replace("\n", " ")
    assert f"docker run --runtime {DOCKER_RUNTIME}" in README
