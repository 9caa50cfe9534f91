"""Small in-place edits of a tomlkit document that leave everything else (comments, order, layout) as it was.

A value already equal to the wanted one is never reassigned, so a second run renders byte-identical text. The
result is re-read with tomllib (`check`), because a layout tomlkit mishandles must fail loudly, never be written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import tomlkit
from tomlkit.items import Item

from gpuhook.errors import ConfigError, GpuhookError
from gpuhook.fileio.tomlfile import tomllib

Table = MutableMapping[str, Any]


def dotted(keys: Sequence[str]) -> str:
    """A key path as TOML writes it (`plugins."io.containerd.grpc.v1.cri"`), for messages."""
    return ".".join(k if k.replace("_", "").replace("-", "").isalnum() else f'"{k}"' for k in keys)


def ensure_table(where: str, parent: Table, keys: Sequence[str]) -> tuple[Table, bool]:
    """The table at `keys`, created when absent (parents as super tables, so only `[a.b.c]` is written);
    the flag says whether the last one was created."""
    node, created = parent, False
    for depth, key in enumerate(keys):
        child = node.get(key)
        if child is None:
            node[key] = tomlkit.table(is_super_table=depth < len(keys) - 1)
            child, created = node[key], True
        elif isinstance(child, MutableMapping):
            created = False
        else:
            raise ConfigError(f"{where}: {dotted(keys[: depth + 1])} is not a table")
        node = child
    return node, created


def set_value(table: Table, key: str, value: str | bool | int) -> bool:
    """Set a scalar unless it already has this value (and type: `1` is not `true`); returns whether it changed."""
    current = table.get(key)
    plain = _plain(current)
    if current is not None and type(plain) is type(value) and plain == value:
        return False
    item = tomlkit.item(value)
    if current is None:
        item.trivia.indent = _sibling_indent(table)
    table[key] = item
    return True


def add_items(where: str, table: Table, keys: Sequence[str], wanted: Sequence[str], default: Sequence[str]) -> bool:
    """Make the string list `keys[-1]` contain `wanted`, appending what is missing; an absent list starts from
    `default` (the runtime's built-in value, which setting the key would otherwise drop). Paths compare
    normalised, so `/etc/cdi/` counts as `/etc/cdi`."""
    key = keys[-1]
    current = table.get(key)
    if current is None:
        values = list(dict.fromkeys([*default, *wanted]))
        array = tomlkit.array()
        array.extend(values)
        item = tomlkit.item(array)
        item.trivia.indent = _sibling_indent(table)
        table[key] = item
        return True
    if not isinstance(current, list) or not all(isinstance(v, str) for v in current):
        raise ConfigError(f"{where}: {dotted(keys)} must be a list of strings")
    have = {os.path.normpath(str(v)) for v in current}
    missing = [w for w in wanted if os.path.normpath(w) not in have]
    for value in missing:
        current.append(value)
    return bool(missing)


def lookup(data: Any, keys: Sequence[str]) -> Any:
    """The value at `keys` in plain parsed TOML, None where any part is missing."""
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def check(where: str, text: str, keys: Sequence[str], ok: Callable[[Any], bool]) -> None:
    """Re-read the edited text with tomllib and insist `keys` came out as intended (nothing is written if not)."""
    try:
        value = lookup(tomllib.loads(text), keys)
    except tomllib.TOMLDecodeError as exc:
        raise GpuhookError(f"editing {where} produced invalid TOML ({exc}); nothing was written") from None
    if not ok(value):
        raise GpuhookError(f"editing {where} did not set {dotted(keys)} (got {value!r}); nothing was written")


def _plain(value: Any) -> Any:
    return value.unwrap() if isinstance(value, Item) else value


def _sibling_indent(table: Table) -> str:
    """The indentation of the table's first plain key, so an added key lines up with its neighbours (less the
    table header's own indentation, which tomlkit adds to every appended key by itself)."""
    container = getattr(table, "value", None)
    body = getattr(container, "body", None) or getattr(table, "body", None) or []
    indent = next((item.trivia.indent for key, item in body if key is not None and isinstance(item, Item)
                   and not isinstance(item, (tomlkit.items.Table, tomlkit.items.AoT))), "")
    trivia = getattr(table, "trivia", None)
    header = re.match(r"(?s)^[^ ]*([ ]+)", trivia.indent) if isinstance(table, tomlkit.items.Table) and trivia else None
    return indent.removeprefix(header.group(1)) if header else indent
