"""The layers of ARCHITECTURE.md, checked: every `gpuhook` import (module level or lazy, inside a function) of
every module goes only to a layer that module may use. An import upward or across front doors fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "gpuhook"

BASE = {"errors", "_native", "fileio", "oci"}
# package (first component under gpuhook) -> the packages it may import besides itself. ARCHITECTURE.md's table.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_native": {"errors"},
    "fileio": {"errors"},
    "oci": {"errors"},
    "model": {"errors"},
    "discover": {"model", "_native", "errors", "fileio"},
    "inject": {"model", "oci", "_native", "errors", "fileio"},
    "cdi": {"model", "discover", "errors", "fileio"},
    "hook": {"inject", "model", "discover", "oci", "_native", "errors", "fileio"},
    "service": {"hook", "inject", "model", "discover", "oci", "_native", "errors", "fileio"},
    "shim": {"service", "hook", "cdi", "inject", "model", "discover", "oci", "errors", "fileio"},
    "plugin": {"cdi", "system", "model", "discover", "errors", "fileio"},
    "dra": {"plugin", "system", "cdi", "model", "discover", "errors", "fileio"},  # plugin: health, planning, endpoints
    "runtimeconfig": {"model", "errors", "fileio"},  # model: its Record base and contract's HOOK_PATH
    "system": {"model", "discover", "errors", "fileio"},
    "doctor": {"service", "shim", "runtimeconfig", "system", "hook", "cdi", "inject", "model", "discover", "oci",
               "_native", "errors", "fileio"},
    "fakedriver": {"model", "discover", "_native", "errors", "fileio"},
    "nodesetup": {"runtimeconfig", "model", "errors", "fileio"},  # model: Record; the cli face hands it the rest
    "cli": {"nodesetup", "service", "doctor", "shim", "plugin", "dra", "runtimeconfig", "system", "hook", "cdi",
            "inject", "model", "discover", "oci", "fakedriver", "_native", "errors", "fileio"},
    "__init__": set(),
}
# Third-party modules a layer must never load (the hook's path and everything under it stays lean).
FORBIDDEN_EXTERNAL = {
    layer: {"click", "yaml", "jsonschema", "grpc", "google"}
    for layer in ("errors", "_native", "fileio", "oci", "model", "discover", "inject", "hook", "shim", "service")
}


def _package(path: Path) -> tuple[str, str]:
    """(layer, dotted module) of a source file."""
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    module = ".".join(["gpuhook", *parts])
    if parts[-1] == "__init__":
        module = module.rsplit(".", 1)[0]
    return parts[0], module


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names if name == "gpuhook"]
    return found


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "_pb2" not in p.name)


def test_every_layer_is_known() -> None:
    layers = {_package(p)[0] for p in _sources()}
    assert layers <= set(ALLOWED), f"packages without a rule: {sorted(layers - set(ALLOWED))}"


def test_no_loose_modules() -> None:
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert loose == ["__init__.py", "errors.py"], loose


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_only_downward(path: Path) -> None:
    layer, module = _package(path)
    bad = []
    for line, name in _imports(path, module):
        parts = name.split(".")
        if parts[0] == "gpuhook":
            if len(parts) == 1:
                continue
            target = parts[1]
            if target != layer and target not in ALLOWED[layer]:
                bad.append(f"line {line}: {layer} imports {name}")
        elif parts[0] in FORBIDDEN_EXTERNAL.get(layer, ()):
            bad.append(f"line {line}: {layer} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_rules_themselves_are_layered() -> None:
    """No two layers may import each other (directly or through others): the table is a partial order."""
    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in ALLOWED[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    for layer in ALLOWED:
        assert layer not in reach(layer), f"{layer} can reach itself through the rules"
    assert "inject" not in reach("cdi") and "hook" not in reach("cdi"), "the CDI package must not reach the hook path"
    assert "cdi" not in reach("hook"), "the hook path must not reach the CDI package"
    assert "discover" not in reach("model"), "the model never discovers"
