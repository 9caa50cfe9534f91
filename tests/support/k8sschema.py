"""Kubernetes objects checked against the API's published OpenAPI v3 schemas (a subset committed as data under
tests/data/k8s-openapi/, one file per group-version: the schemas of the kinds we deploy and everything they
reference, descriptions dropped).

`extract` made those files (README there says from what); `validate` checks one rendered object: its
apiVersion/kind must be a kind the data holds, and its fields must match, unknown fields included (object
schemas with `properties` get `additionalProperties: false` unless Kubernetes keeps unknown fields there, as
kubeconform's -strict does: the API server drops unknown fields silently, which is how a typo ships)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data" / "k8s-openapi"
REF = "#/components/schemas/"


def file_name(api_version: str) -> str:
    """The spec's own file naming: core v1 is api__v1, groups apis__<group>__<version>."""
    group, _, version = api_version.rpartition("/")
    return f"apis__{group}__{version}_openapi.json" if group else f"api__{version}_openapi.json"


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF):
            found.add(ref[len(REF):])
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def extract(spec_dir: Path, api_version: str, kinds: list[str]) -> dict[str, Any]:
    """The subset of `spec_dir`'s file for `api_version` that `kinds` need."""
    spec = json.loads((spec_dir / file_name(api_version)).read_text())
    schemas = spec["components"]["schemas"]
    group, _, version = api_version.rpartition("/")
    roots: dict[str, str] = {}
    for name, schema in schemas.items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            if gvk.get("group", "") == group and gvk["version"] == version and gvk["kind"] in kinds:
                roots[gvk["kind"]] = name
    missing = sorted(set(kinds) - set(roots))
    if missing:
        raise SystemExit(f"{api_version} has no schema for {missing}")
    todo, keep = list(roots.values()), {}
    while todo:
        name = todo.pop()
        if name not in keep:
            keep[name] = _strip(schemas[name])
            todo += sorted(_refs(schemas[name]))
    return {"apiVersion": api_version, "kinds": dict(sorted(roots.items())),
            "components": {"schemas": dict(sorted(keep.items()))}}


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


_LOADED: dict[str, dict[str, Any]] = {}


def schema_for(api_version: str, kind: str) -> dict[str, Any] | None:
    path = DATA / file_name(api_version)
    if api_version not in _LOADED:
        if not path.is_file():
            return None
        _LOADED[api_version] = json.loads(path.read_text())
    data = _LOADED[api_version]
    name = data["kinds"].get(kind)
    if name is None:
        return None
    return {"$ref": REF + name, "components": _strict(copy.deepcopy(data["components"]))}


def validate(obj: dict[str, Any]) -> list[str]:
    """Problems with one object, each naming its kind/name and the field; [] when it is valid."""
    import jsonschema

    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    name = f"{kind}/{obj.get('metadata', {}).get('name', '?')}"
    schema = schema_for(api_version, kind)
    if schema is None:
        return [f"{name}: no schema for {api_version} {kind} under {DATA} (add it: README there)"]
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{name}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]
