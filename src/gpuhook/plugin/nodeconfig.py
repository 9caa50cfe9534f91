"""Per-node configuration: NVIDIA's named configs (its chart's `config.map`, a ConfigMap mounted as a folder,
one file per name) and the node label `nvidia.com/device-plugin.config` that picks one, followed while the plugin
runs.

The choice is NVIDIA's config-manager's (cmd/config-manager of v0.20.0): the label's value, which must name an
available config; no label: `default_config` (DEFAULT_CONFIG), which must exist; neither: the fallback
strategies in order: `named` (a config called "default"), `single` (the only one), `empty` (no file: the flags'
defaults). NVIDIA's sidecar then signals the plugin to restart; here the plugin itself follows the label and
applies the new configuration in place (serve and register the new resources), and a label naming no available
config, or a config that does not parse, is one error line while the current configuration keeps serving.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from gpuhook.errors import ConfigError, GpuhookError, clip
from gpuhook.system.nodelabel import NodeLabel

log = logging.getLogger("gpuhook.plugin")

DEFAULT_LABEL = "nvidia.com/device-plugin.config"
FALLBACKS = ("named", "single", "empty")
DEFAULT_FALLBACKS = ("named", "single")  # NVIDIA's chart's config.fallbackStrategies
NAMED_FALLBACK = "default"

T = TypeVar("T")


def available(folder: str) -> list[str]:
    """The config names in `folder`: its entries that are not folders, without a ConfigMap volume's `..`
    bookkeeping entries (NVIDIA's getConfigFileNameMap)."""
    try:
        with os.scandir(folder) as entries:
            return sorted(e.name for e in entries
                          if not e.name.startswith("..") and not e.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise ConfigError(f"config folder {clip(folder)}: {exc.strerror or exc}") from None


def parse_fallbacks(text: str) -> tuple[str, ...]:
    """NVIDIA's FALLBACK_STRATEGIES: a comma list of named, single, empty."""
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    for item in out:
        if item not in FALLBACKS:
            raise ConfigError(f"fallback strategy {clip(item)}: unknown; use {', '.join(FALLBACKS)}")
    return out


def choose(label: str, default: str, fallbacks: Sequence[str], names: Sequence[str], where: str,
           key: str = DEFAULT_LABEL) -> str:
    """The config name to use ("" for none), NVIDIA's updateConfigName; ConfigError naming what is missing."""
    if not names:
        raise ConfigError(f"no configuration files in {clip(where)}: add configs to config.map")
    if label:
        if label not in names:
            raise ConfigError(f"node label {key}={clip(label)}: no such config in {clip(where)} "
                              f"(configs: {', '.join(clip(n) for n in names)}): label the node with one of them")
        return label
    if default:
        if default not in names:
            raise ConfigError(f"default config {clip(default)}: no such config in {clip(where)} "
                              f"(configs: {', '.join(clip(n) for n in names)})")
        return default
    for fallback in fallbacks:
        if fallback == "named" and NAMED_FALLBACK in names:
            return NAMED_FALLBACK
        if fallback == "single" and len(names) == 1:
            return names[0]
        if fallback == "empty":
            return ""
    raise ConfigError(f"no config label on the node, no default config, and no fallback ({', '.join(fallbacks)}) "
                      f"found one among {', '.join(clip(n) for n in names)}: set config.default")


class NodeConfigs(Generic[T]):
    """The node's configuration by its label: `initial()` before the plugin starts, then `follow(apply)` hands
    each newly selected configuration (built by `build(path or None)`) to `apply`."""

    def __init__(self, folder: str, default: str, fallbacks: Sequence[str], labels: NodeLabel,
                 build: Callable[[str | None], T]) -> None:
        self.folder, self.default, self.fallbacks = folder, default, tuple(fallbacks)
        self.labels, self.build = labels, build
        self.name: str | None = None

    def _select(self, label: str) -> tuple[str, T]:
        name = choose(label, self.default, self.fallbacks, available(self.folder), self.folder, self.labels.label)
        return name, self.build(os.path.join(self.folder, name) if name else None)

    def initial(self) -> T:
        """The configuration to start with; a ConfigError when none can be chosen (as NVIDIA's init container,
        the pod does not start on a configuration it was not given)."""
        label, why = self.labels.current()
        if label is None:
            log.warning("cannot read node %s's label %s (%s): choosing without it", clip(self.labels.node),
                        self.labels.label, why)
            label = ""
        self.name, config = self._select(label)
        log.info("node label %s=%s: config %s", self.labels.label, clip(label), clip(self.name or "(none)"))
        return config

    def follow(self, apply: Callable[[T], None]) -> None:
        def changed(label: str) -> None:
            try:
                name, config = self._select(label)
            except GpuhookError as exc:
                log.error("%s; still serving config %s", exc, clip(self.name or "(none)"))
                return
            if name == self.name:
                return
            log.info("node label %s=%s: switching from config %s to %s", self.labels.label, clip(label),
                     clip(self.name or "(none)"), clip(name or "(none)"))
            self.name = name
            apply(config)

        self.labels.follow(changed)
