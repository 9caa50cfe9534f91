"""The hook's configuration: /etc/gpuhook/config.toml (TOML), defaults for every key.

Read on every container start, also by containers that ask for no GPU, so this module imports only `os` (and
the import-free model/contract.py the hook loads anyway):
no dataclasses (they pull in `inspect`), no `re`, no tomllib (it pulls in `typing`, `string` and `datetime`)
for the flat `key = value` files gpuhook's config actually is. Anything beyond that subset goes to tomllib, so
every file parses exactly as tomllib parses it.
"""

from __future__ import annotations

import os

from gpuhook.errors import ConfigError, clip
from gpuhook.model.contract import SERVICE_SOCKET, SERVICE_SOCKET_ENV, STATE_DIR

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

    from gpuhook.discover.roots import Roots
    from gpuhook.model.request import Policy

DEFAULT_PATH = "/etc/gpuhook/config.toml"
DEFAULT_LOG = "/var/log/gpuhook.log"
CONFIG_ENV = "GPUHOOK_CONFIG"  # names the file when no --config is given (the shim; the hook under docker --gpus)

# attribute -> (type, default). `supported_capabilities` None = every capability gpuhook knows
# (catalogue.CAPABILITIES), resolved on first use so that reading the config never imports the catalogue.
_FIELDS: dict[str, tuple[type, Any]] = {
    "driver_root": (str, "/"),
    "dev_root": (str, ""),  # empty: same as driver root
    "proc_root": (str, "/proc"),
    "ldconfig": (str, "@/sbin/ldconfig"),  # '@' = a path on the host, never the image's
    "log_file": (str, DEFAULT_LOG),  # empty: no log
    "accept_envvar_unprivileged": (bool, True),
    "accept_volume_mounts": (bool, False),  # NVIDIA: accept-nvidia-visible-devices-as-volume-mounts = false
    "disable_require": (bool, False),
    "supported_capabilities": (tuple, None),
    "inventory_cache": (str, "/run/gpuhook/inventory.json"),  # empty: rediscover on every start
    # NVIDIA's swarm-resource: variables (DOCKER_RESOURCE_GPUS…) that name the devices when set; written as NVIDIA
    # writes it, one comma list, and kept as the tuple of names (the hook's no-GPU check and the request use it)
    "swarm_resource": (list, ()),
    "annotation_prefixes": (list, ("cdi.k8s.io/",)),  # NVIDIA's modes.cdi.annotation-prefixes
    # where a start leaves the device plugin its record of a runtime that ignored CDI devices (hook/cdiignored.py)
    "state_dir": (str, STATE_DIR),  # empty: none
    # the shim's real runtime when $GPUHOOK_RUNTIME is unset: the first found, a name on PATH or a path
    # (NVIDIA's [nvidia-container-runtime] runtimes)
    "runtimes": (list, ("runc",)),
}
# NVIDIA's own spellings, accepted so that a config.toml carried over from the toolkit means the same here.
_ALIASES = {"supported_driver_capabilities": "supported_capabilities",
            "accept_nvidia_visible_devices_as_volume_mounts": "accept_volume_mounts",
            "accept_nvidia_visible_devices_envvar_when_unprivileged": "accept_envvar_unprivileged"}


class Config:
    """Immutable settings (keyword arguments named like the attributes); `source`, the file read, and `ignored`
    take no part in equality. A plain class, not a dataclass: see the module docstring."""

    __slots__ = ("driver_root", "dev_root", "proc_root", "ldconfig", "log_file", "accept_envvar_unprivileged",
                 "accept_volume_mounts", "disable_require", "_supported_capabilities", "inventory_cache",
                 "swarm_resource", "annotation_prefixes", "state_dir", "runtimes", "source", "ignored")
    driver_root: str
    dev_root: str
    proc_root: str
    ldconfig: str
    log_file: str
    accept_envvar_unprivileged: bool
    accept_volume_mounts: bool
    disable_require: bool
    _supported_capabilities: tuple[str, ...] | None
    inventory_cache: str
    swarm_resource: tuple[str, ...]
    annotation_prefixes: tuple[str, ...]
    state_dir: str
    runtimes: tuple[str, ...]
    source: str
    ignored: tuple[str, ...]  # NVIDIA's keys the file sets that gpuhook ignores, `key = value (why)` each

    def __init__(self, source: str = "(defaults)", ignored: tuple[str, ...] = (), **values: Any) -> None:
        unknown = set(values) - set(_FIELDS)
        if unknown:
            raise TypeError(f"Config() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        for name, (_kind, default) in _FIELDS.items():
            slot = "_supported_capabilities" if name == "supported_capabilities" else name
            object.__setattr__(self, slot, values.get(name, default))
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "ignored", ignored)

    @property
    def supported_capabilities(self) -> tuple[str, ...]:
        if self._supported_capabilities is None:
            from gpuhook.model import catalogue

            return catalogue.CAPABILITIES
        return self._supported_capabilities

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Config is immutable: cannot set {name!r}")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        return self._values() == other._values() if isinstance(other, Config) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return "Config(" + "".join(f"{name}={getattr(self, name)!r}, " for name in _FIELDS) + f"source={self.source!r})"

    def roots(self) -> Roots:
        """The driver, dev and proc roots this config names (an empty dev-root: the driver root)."""
        from gpuhook.discover.roots import Roots

        return Roots.make(self.driver_root, self.dev_root or None, self.proc_root)

    @property
    def policy(self) -> Policy:
        from gpuhook.model.request import Policy

        return Policy(
            accept_envvar_unprivileged=self.accept_envvar_unprivileged,
            accept_volume_mounts=self.accept_volume_mounts,
            disable_require=self.disable_require,
            supported_capabilities=frozenset(self.supported_capabilities),
            swarm_resource=tuple(self.swarm_resource),
            annotation_prefixes=tuple(self.annotation_prefixes),
        )


def _attribute(key: str) -> str:
    attr = key.replace("-", "_")
    return _ALIASES.get(attr, attr)


def _capability_words(path: str, key: str, value: str) -> tuple[str, ...] | None:
    """NVIDIA's supported-driver-capabilities: a comma list, `all` for every one (None), empty for none."""
    words = [w.strip() for w in value.split(",") if w.strip()]
    return None if "all" in words else _capabilities(path, key, words)


def _capabilities(path: str, key: str, words: list[str]) -> tuple[str, ...]:
    from gpuhook.model import catalogue

    unknown = [v for v in words if v not in catalogue.CAPABILITIES]
    if unknown:
        raise ConfigError(f"{path}: {key}: unknown capability {unknown[0]!r}")
    return tuple(words)


def _convert(path: str, key: str, value: object) -> object:
    attr = _attribute(key)
    if attr not in _FIELDS:
        raise ConfigError(f"{path}: unknown key {key!r}")
    kind = _FIELDS[attr][0]
    if attr == "swarm_resource" and isinstance(value, str):  # NVIDIA's form: one comma list
        return tuple(v for v in (v.strip() for v in value.split(",")) if v)
    if key.replace("-", "_") == "supported_driver_capabilities":  # NVIDIA's form: a string, not a list
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {key} must be a string (a comma list), not {value!r}")
        return _capability_words(path, key, value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key} must be true or false, not {value!r}")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {key} must be a string, not {value!r}")
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: {key} must be a list of strings, not {value!r}")
    if kind is list:
        return tuple(value)
    return _capabilities(path, key, value)


# The TOML subset read without tomllib (nor `re`): one `bare-key = value` per line, value a string without
# escapes, a boolean or a one-line array of such strings, then an optional comment. TOML whitespace is space and
# tab only; control characters other than tab are invalid in all of these forms, so a line holding one, and
# anything else outside the subset, sends the whole file to tomllib.
_BARE_KEY = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_CONTROL = frozenset(chr(c) for c in (*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F))


class _NotSimple(Exception):
    """The text is outside the subset: tomllib decides (and words any error)."""


def _skip_blanks(line: str, i: int) -> int:
    while i < len(line) and line[i] in " \t":
        i += 1
    return i


def _string(line: str, i: int) -> tuple[str, int]:
    """A basic string without escapes or a literal string starting at `i`: (value, index after it)."""
    quote = line[i : i + 1]
    end = line.find(quote, i + 1) if quote in ('"', "'") else -1
    if end < 0 or (quote == '"' and "\\" in line[i + 1 : end]):
        raise _NotSimple
    return line[i + 1 : end], end + 1


def _value(line: str, i: int) -> tuple[object, int]:
    for word, value in (("true", True), ("false", False)):
        if line.startswith(word, i):
            return value, i + len(word)
    if line[i : i + 1] != "[":
        return _string(line, i)
    items: list[str] = []
    i = _skip_blanks(line, i + 1)
    while line[i : i + 1] != "]":
        item, i = _string(line, i)
        items.append(item)
        i = _skip_blanks(line, i)
        if line[i : i + 1] == ",":
            i = _skip_blanks(line, i + 1)
        elif line[i : i + 1] != "]":
            raise _NotSimple
    return items, i + 1


def _line(line: str) -> tuple[str, object] | None:
    """(key, value), or None for a blank or comment line."""
    if not _CONTROL.isdisjoint(line):
        raise _NotSimple
    i = _skip_blanks(line, 0)
    if i == len(line) or line[i] == "#":
        return None
    start = i
    while i < len(line) and line[i] in _BARE_KEY:
        i += 1
    key = line[start:i]
    i = _skip_blanks(line, i)
    if not key or line[i : i + 1] != "=":
        raise _NotSimple
    value, i = _value(line, _skip_blanks(line, i + 1))
    i = _skip_blanks(line, i)
    if i < len(line) and line[i] != "#":
        raise _NotSimple
    return key, value


def parse_simple(text: str) -> dict[str, object] | None:
    """`text` as tomllib would read it when it is within the flat subset above; None when it is not."""
    data: dict[str, object] = {}
    try:
        for line in text.split("\n"):
            parsed = _line(line)
            if parsed is not None:
                if parsed[0] in data:  # a duplicate key: tomllib's error
                    raise _NotSimple
                data[parsed[0]] = parsed[1]
    except _NotSimple:
        return None
    return data


def _parse_toml(text: str, path: str) -> dict[str, object]:
    simple = parse_simple(text)
    if simple is not None:
        return simple
    from gpuhook.fileio.tomlfile import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _retired_service_socket(path: str, data: dict[str, object]) -> None:
    """`service-socket` is no longer read: the service and the hook entry both use $GPUHOOK_SERVICE_SOCKET, else
    /run/gpuhook/service.sock (one rule, which the native entry can follow without parsing TOML). A file that
    still names that very path means no change; any other path would be a silent slow fallback on every start,
    so it is refused with the way out."""
    for key in ("service-socket", "service_socket"):
        if key in data:
            value = data.pop(key)
            if value != (os.environ.get(SERVICE_SOCKET_ENV) or SERVICE_SOCKET):
                raise ConfigError(f"{path}: {key} {clip(str(value))} is no longer read: the service and the hook "
                                  f"entry both use ${SERVICE_SOCKET_ENV}, else {SERVICE_SOCKET}; remove the key "
                                  f"and set {SERVICE_SOCKET_ENV} in the service's and the hook's environment")


def parse_config(text: str, path: str = "<config>") -> Config:
    """The file's settings. NVIDIA's own config.toml is read too: its tables map to gpuhook's keys
    (hook/nvidiaconfig.py), and what has no gpuhook meaning is kept in `ignored`."""
    data = _parse_toml(text, path)
    _retired_service_socket(path, data)
    ignored: tuple[str, ...] = ()
    if any(isinstance(value, dict) for value in data.values()):
        from gpuhook.hook.nvidiaconfig import expand

        data, ignored = expand(path, data)
    values: dict[str, object] = {}
    named: dict[str, str] = {}
    for key, value in data.items():
        attr, converted = _attribute(key), _convert(path, key, value)
        if attr in values and values[attr] != converted:  # two spellings of one setting
            raise ConfigError(f"{path}: {named[attr]} and {key} both set, to different values: keep one")
        values[attr], named[attr] = converted, key
    return Config(source=path, ignored=ignored, **values)


_warned: set[str] = set()


def warn_ignored(config: Config) -> None:
    """One line on stderr, once per file in a process, naming what of NVIDIA's settings the file holds that
    gpuhook ignores (nothing when there is none)."""
    if config.ignored and config.source not in _warned:
        _warned.add(config.source)
        import sys

        print(f"gpuhook: warning: {config.source}: ignored: " + "; ".join(config.ignored), file=sys.stderr)


def load_config(path: str | None, warn: bool = True) -> Config:
    """`path`, else the default file if it exists, else defaults. An explicit missing path is an error. `warn`:
    name what the file sets that gpuhook ignores (warn_ignored)."""
    target = path or DEFAULT_PATH
    try:
        with open(target, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if path:
            raise ConfigError(f"config file {path} not found") from None
        return Config()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {target}: {exc}") from None
    config = parse_config(text, target)
    if warn:
        warn_ignored(config)
    for key in ("driver_root", "proc_root", "state_dir"):  # a hook's cwd is the bundle: never relative
        value = getattr(config, key)
        if not os.path.isabs(value) and (value or key != "state_dir"):
            raise ConfigError(f"{target}: {key.replace('_', '-')} must be an absolute path, not {value!r}")
    return config
