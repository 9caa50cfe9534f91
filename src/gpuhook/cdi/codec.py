"""Spec (de)serialisation: YAML (written by yamlout.py, read by PyYAML's C parser when present) or JSON, and
strict reading. PyYAML is imported only to read, so generating a spec never loads it.

Reading is as strict as the Go loader's `yaml.UnmarshalStrict`: a duplicated key is an error, not a silent
"last one wins".
"""

from __future__ import annotations

import functools
import json
import os

from gpuhook.cdi.errors import CdiError
from gpuhook.cdi.yamlout import dump

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (generate-cdi's path)
if TYPE_CHECKING:
    from typing import Any

FORMATS: tuple[str, ...] = ("yaml", "json")
SPEC_EXTENSIONS: tuple[str, ...] = (".yaml", ".json")  # what CDI loaders read; `.yml` is ignored by them


@functools.cache
def _strict_loader() -> type:
    """PyYAML's safe loader (C when present) that refuses duplicate mapping keys, as Go's UnmarshalStrict does."""
    import yaml

    base: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class StrictLoader(base):  # type: ignore[valid-type, misc]
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def format_for(path: str | None, fmt: str | None) -> str:
    """An explicit format wins; otherwise JSON for a `.json` file, YAML for anything else."""
    if fmt:
        if fmt not in FORMATS:
            raise CdiError(f"unknown format {fmt!r} (expected yaml or json)")
        return fmt
    return "json" if path and path.endswith(".json") else "yaml"


def dumps(spec: dict[str, Any], fmt: str = "yaml") -> str:
    """The spec as text, keys in the order they were built (stable output for stable input)."""
    if fmt == "json":
        return json.dumps(spec, indent=2) + "\n"
    return dump(spec)


def loads(text: str, origin: str = "<spec>") -> Any:
    """Parse YAML (JSON is YAML too) strictly; CdiError with one line on a syntax error or duplicate key."""
    import yaml

    try:
        return yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except (ValueError, OverflowError, RecursionError) as exc:  # a constructor refusing a scalar (2001-13-01)
        raise CdiError(f"{origin}: not valid YAML/JSON: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CdiError(f"{origin}: not valid YAML/JSON: {problem}{where}") from None


def read(path: str) -> Any:
    """Load one spec file; CdiError naming the path when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise CdiError(f"{path}: cannot read: {why}") from None
    return loads(text, origin=path)


def has_spec_extension(path: str) -> bool:
    return os.path.splitext(path)[1] in SPEC_EXTENSIONS
