"""README.md and docs/ say what the product does: the parts a user copies or relies on are checked against the
code, and the README stays what a user reads in five minutes."""

from __future__ import annotations

import re
from pathlib import Path

from support.cdi_inventory import synthetic_inventory

from gpuhook.cdi.spec import build_spec
from gpuhook.fileio.tomlfile import tomllib
from gpuhook.hook.config import Config
from gpuhook.runtimeconfig.runtimes import DOCKER_RUNTIME, RUNTIME_SHIM, Options, plan

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
CDI_DOC = (DOCS / "cdi.md").read_text()
HOOK_DOC = (DOCS / "hook.md").read_text()
CONFIG_DOC = (DOCS / "configuration.md").read_text()
# Pages other work adds to docs/ (packages, cluster install, the DRA driver): linked before they exist here.
LINKED_ELSEWHERE = {"docs/install.md", "docs/deploy.md", "docs/dra.md"}


def test_cdi_section_names_the_container_hooks_the_spec_has() -> None:
    spec = build_spec(synthetic_inventory(gpus=2), hook_path="/usr/local/bin/gpuhook-hook")
    hooks = [h for e in [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]
             for h in e.get("hooks", [])]
    commands = sorted({" ".join(h["args"][1:3]) for h in hooks})
    assert commands == ["cdi-hook update-container"]
    words = {1: "one", 2: "two", 3: "three"}[len(hooks)]
    assert f"{words} `createContainer` hook" in CDI_DOC
    for command in commands:
        assert f"`gpuhook {command} " in CDI_DOC


def test_config_example_is_the_defaults() -> None:
    """docs/configuration.md's config.toml block shows every key with its default (accept-volume-mounts = false)."""
    block = re.search(r"## Configuration: .*?```toml\n(.*?)```", CONFIG_DOC, re.S)
    assert block is not None
    shown = tomllib.loads(block.group(1))
    defaults = Config()
    assert {k.replace("-", "_") for k in shown} == {n for n in Config.__slots__ if n not in ("source", "ignored")} - {
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
        HOOK_DOC.replace("\n", " ")
    assert f"docker run --runtime {DOCKER_RUNTIME}" in HOOK_DOC and f"docker run --runtime {DOCKER_RUNTIME}" in README


def test_readme_opens_with_the_two_commands() -> None:
    """The first block: the main job (`gpuhook demo`), then the tests, the command `.ci/run` runs."""
    first = README.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert len(first) == 2
    assert first[0].startswith("python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/gpuhook demo")
    assert first[1].startswith("python3 -m venv .venv && .venv/bin/pip install '.[test]' && "
                               ".venv/bin/python -m pytest -q")


def test_readme_is_short_and_its_links_lead_somewhere() -> None:
    assert len(README.splitlines()) <= 250
    links = set(re.findall(r"\]\(([^)#]+)\)", README))
    local = {link for link in links if not link.startswith("http")}
    assert {"docs/hook.md", "docs/cdi.md", "docs/device-plugin.md", "docs/shim.md", "docs/service.md",
            "docs/configuration.md", "docs/security.md", "docs/performance.md", "docs/architecture.md"} <= local
    assert local >= LINKED_ELSEWHERE
    missing = sorted(link for link in local - LINKED_ELSEWHERE if not (ROOT / link).exists())
    assert missing == []
    for page in DOCS.glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if not link.startswith("http") and f"docs/{link}" not in LINKED_ELSEWHERE:
                assert (page.parent / link).exists(), f"{page.name}: {link}"


def test_user_docs_speak_of_no_issue_numbers() -> None:
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        assert not re.search(r"\bissues? \d+", page.read_text(), re.I), page.name


def test_the_offline_image_recipe_is_what_ci_runs() -> None:
    """docs/deploy.md's offline image recipe is run by .ci/build-images as written (.ci/deploy-recipe.py: its own
    pip, base and tags only), and its wheels hold every extra the Containerfiles install with --no-index."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_recipe", ROOT / ".ci" / "deploy-recipe.py")
    assert spec and spec.loader
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    commands = recipe.commands("/ci/pip", "/ci/base", (DOCS / "deploy.md").read_text())
    assert commands[0] == "/ci/pip wheel --wheel-dir build/wheels '.[plugin,dra]'"
    built = {c.split(" -f ")[1].split()[0]: c for c in commands[1:]}
    assert sorted(built) == ["deploy/node-setup.Containerfile", "plugin/Containerfile"]
    wheel_extras = set(commands[0].split("[")[1].split("]")[0].split(","))
    for path, command in built.items():
        assert "--build-arg BASE=/ci/base --build-arg WHEELS=build/wheels " in command, command
        installed = re.search(r'--no-index --find-links "/src/\$WHEELS" "gpuhook(?:\[([a-z,]*)\])?"',
                              (ROOT / path).read_text())
        assert installed is not None, path
        assert set(filter(None, (installed.group(1) or "").split(","))) <= wheel_extras, path
    assert "deploy-recipe.py" in (ROOT / ".ci" / "build-images").read_text()
