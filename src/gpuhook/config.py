"""The hook's configuration: /etc/gpuhook/config.toml (TOML, read with tomllib), defaults for every key."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields

from . import driverfiles as catalogue
from .errors import ConfigError
from .request import Policy

DEFAULT_PATH = "/etc/gpuhook/config.toml"


@dataclass(frozen=True)
class Config:
    driver_root: str = "/"
    dev_root: str = ""  # empty: same as driver root
    proc_root: str = "/proc"
    ldconfig: str = "@/sbin/ldconfig"  # '@' = a path on the host, never the image's
    log_file: str = "/var/log/gpuhook.log"  # empty: no log
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = True
    disable_require: bool = False
    supported_capabilities: tuple[str, ...] = catalogue.CAPABILITIES
    inventory_cache: str = "/run/gpuhook/inventory.json"  # empty: rediscover on every start
    source: str = field(default="(defaults)", compare=False)

    @property
    def policy(self) -> Policy:
        return Policy(
            accept_envvar_unprivileged=self.accept_envvar_unprivileged,
            accept_volume_mounts=self.accept_volume_mounts,
            disable_require=self.disable_require,
            supported_capabilities=frozenset(self.supported_capabilities),
        )


_TYPES = {f.name: f.type for f in fields(Config)}


def _convert(path: str, key: str, value: object) -> object:
    attr = key.replace("-", "_")
    kind = _TYPES.get(attr)
    if kind is None or attr == "source":
        raise ConfigError(f"{path}: unknown key {key!r}")
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key} must be true or false, not {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {key} must be a string, not {value!r}")
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: {key} must be a list of strings, not {value!r}")
    unknown = [v for v in value if v not in catalogue.CAPABILITIES]
    if unknown:
        raise ConfigError(f"{path}: {key}: unknown capability {unknown[0]!r}")
    return tuple(value)


def parse_config(text: str, path: str = "<config>") -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    values = {key.replace("-", "_"): _convert(path, key, value) for key, value in data.items()}
    return Config(**values, source=path)  # type: ignore[arg-type]


def load_config(path: str | None) -> Config:
    """`path`, else the default file if it exists, else defaults. An explicit missing path is an error."""
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
    for key in ("driver_root", "proc_root"):
        value = getattr(config, key)
        if not os.path.isabs(value):
            raise ConfigError(f"{target}: {key.replace('_', '-')} must be an absolute path, not {value!r}")
    return config
