"""A block-style YAML writer for CDI specs: dicts, lists, strings, ints, bools and None, nothing else.

`generate-cdi` runs at every driver change and in the device plugin's start; PyYAML costs ~10 ms to import and
~15 ms to dump a spec, while a spec needs only a sliver of YAML. Strings are written plain only when they are
unmistakably strings to every YAML reader the runtimes use (Go's YAML 1.1 decoders too: `on`, `y`, `no` are
booleans there), otherwise escaped in double quotes, which YAML reads as the same string.
"""

from __future__ import annotations

import json
import re

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

# Plain scalars: start with a letter, '_' or '/', then path-like characters only (':' but not at the end, so never
# ': '); no ' #', no leading indicator, no space, nothing a resolver could read as a number, date, bool or null.
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./=+@:-]*(?<!:)\Z|[0-9]+\.[0-9]+(\.[0-9]+)+\Z")  # or a dotted version
_RESERVED = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"})
# What JSON leaves raw but a YAML stream may not hold raw: DEL and C1 controls, line/paragraph separators,
# surrogates, the BOM and the non-characters U+FFFE/U+FFFF.
_UNPRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufeff\ufffe\uffff]")
# String scalars already written: a spec repeats its keys and most values thousands of times (8 GPUs x 7 MIG:
# ~8,200 scalars, ~6,800 regex matches without it). Bounded; short strings only.
_WRITTEN: dict[str, str] = {}
_WRITTEN_MAX, _WRITTEN_LEN = 4096, 256


def _quoted(value: str) -> str:
    """A YAML double-quoted scalar: JSON's escapes (a subset of YAML's) plus \\uXXXX for what YAML must not see raw."""
    return _UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def _float(value: float) -> str:
    """YAML 1.1's float forms: .inf/.nan, and a mantissa with a '.' (a bare `1e+16` would read as a string)."""
    if value != value:
        return ".nan"
    if value in (float("inf"), float("-inf")):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    return text if "." in mantissa else f"{mantissa}.0{e}{exponent}"


def scalar(value: object) -> str:
    """One scalar as YAML text."""
    if isinstance(value, str):  # first: nearly every scalar of a spec, and most of them written before
        text = _WRITTEN.get(value)
        if text is None:
            text = value if _PLAIN.match(value) and value.lower() not in _RESERVED else _quoted(value)
            if len(_WRITTEN) < _WRITTEN_MAX and len(value) <= _WRITTEN_LEN:
                _WRITTEN[value] = text
        return text
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):  # not in a spec gpuhook builds, but `cdi validate` rewrites what it reads
        return _float(value)
    raise TypeError(f"a CDI spec holds no {type(value).__name__}")


def _lines(value: Any, indent: int, out: list[str], lead: str) -> None:
    """Append `value` at `indent`; `lead` is the text that already stands before it on the first line."""
    pad = " " * indent
    if isinstance(value, dict) and value:
        first = True
        for key, item in value.items():
            prefix = lead if first else pad
            first = False
            head = f"{prefix}{scalar(key)}:"
            if isinstance(item, dict) and item:
                out.append(head)
                _lines(item, indent + 2, out, " " * (indent + 2))
            elif isinstance(item, list) and item:
                out.append(head)
                _lines(item, indent, out, pad)
            else:
                out.append(f"{head} {_empty_or_scalar(item)}")
    elif isinstance(value, list) and value:
        first = True
        for item in value:
            prefix = lead if first else pad
            first = False
            if isinstance(item, (dict, list)) and item:
                _lines(item, indent + 2, out, f"{prefix}- ")
            else:
                out.append(f"{prefix}- {_empty_or_scalar(item)}")
    else:
        out.append(f"{lead}{_empty_or_scalar(value)}")


def _empty_or_scalar(value: object) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return scalar(value)


def dump(document: Any) -> str:
    """`document` as block-style YAML text ending in a newline."""
    out: list[str] = []
    _lines(document, 0, out, "")
    return "\n".join(out) + "\n"
