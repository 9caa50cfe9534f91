"""What the device plugin leaves on its node, taken off when its DaemonSet is gone (`helm uninstall`,
`kubectl delete`), and left for the next pod when only the pod goes (a rolling update, a restart: taking it off
then would only fail GPU pods created in between, whose CDI devices the runtime resolves from the spec).

The plugin's files on the node: its CDI spec, its NFD feature file (else NFD keeps labelling the node a GPU
node), the /dev/char links to the NVIDIA nodes of its inventory (a link whose target is anything else is not
ours and stays), and the node's marker key in the hooks' state directory. Whether the DaemonSet is gone is asked
of the API with the pod's service account (system/daemonset.py); when that cannot be asked, everything stays.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from gpuhook.model.inventory import Inventory

if TYPE_CHECKING:
    from gpuhook.plugin.lifecycle import PluginConfig

log = logging.getLogger("gpuhook.plugin")


def node_files(config: PluginConfig, inv: Inventory | None) -> list[str]:
    """The plugin's files and links on the node, those that exist."""
    from gpuhook.model.contract import PLUGIN_KEY
    from gpuhook.plugin.cdispec import SPEC_FILE
    from gpuhook.system.devchar import wanted_links

    paths = []
    if config.cdi_spec_dir:
        paths.append(os.path.join(config.cdi_spec_dir, SPEC_FILE))
    if config.feature_file:
        paths.append(config.feature_file)
    if config.hook_state_dir:
        paths.append(os.path.join(config.hook_state_dir, PLUGIN_KEY))
    if config.dev_char_path and inv is not None:
        paths += [link for link, target in wanted_links(inv, config.dev_char_path)
                  if os.path.islink(link) and os.readlink(link) == target]
    return [p for p in paths if os.path.lexists(p)]


def watch(config: PluginConfig) -> Any:
    """From the plugin's start: a watch on its DaemonSet (system/daemonset.Watch), when one is configured."""
    if not config.daemonset:
        return None
    from gpuhook.system import daemonset

    return daemonset.Watch(config.daemonset)


def on_stop(config: PluginConfig, inv: Inventory | None, follower: Any = None) -> None:
    """At the plugin's exit: with `daemonset` configured and that DaemonSet gone, remove `node_files`."""
    if not config.daemonset:
        return
    from gpuhook.system import daemonset

    state, why = follower.state() if follower is not None else daemonset.state(config.daemonset)
    if state != daemonset.GONE:
        log.info("stopping: %s; the node's CDI spec, labels and links stay for the next pod", why)
        return
    removed = []
    for path in node_files(config, inv):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc.strerror)
    log.info("stopping: %s; removed %d file(s) and link(s) of the plugin's from the node", why, len(removed))
