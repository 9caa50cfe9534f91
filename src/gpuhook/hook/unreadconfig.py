"""A start whose config file cannot be read: only a container that asks for a GPU fails with it.

The config is read on every container start on the host, GPU or not, so a broken `/etc/gpuhook/config.toml` must
not stop the containers gpuhook has nothing to do with. Without a config, the request is read under the defaults
(volume mounts accepted, so that a mount request still counts as one); the shim and the prestart hook both ask
here, so the two doors agree on which containers start.
"""

from __future__ import annotations

from gpuhook.hook.config import DEFAULT_LOG, DEFAULT_PATH
from gpuhook.model import contract

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuhook.errors import GpuhookError
    from gpuhook.oci.bundle import Bundle


def fallback_log(config_path: str | None) -> str:
    """Where to log a start whose config could not be read: the default log when the config was the default
    file (the host's own set-up), nothing when a caller named another file (its log-file is unknown)."""
    return DEFAULT_LOG if config_path in (None, "", DEFAULT_PATH) else ""


def asks_for_gpu(bundle: Bundle, annotations: dict[str, str] | None) -> bool:
    """Whether the container asks for GPU set-up under the default config: a request signal, and a request
    the parser reads as one (an unreadable request counts as asking: it would fail the start anyway).
    `annotations`: the bundle's, with the OCI state's over them (None: the bundle's alone)."""
    if annotations is None:
        annotations = bundle.annotations
    if not contract.has_gpu_signal(bundle.env, bundle.mounts, annotations):
        return False
    from gpuhook.errors import GpuhookError
    from gpuhook.model.request import Policy, is_privileged, parse_request

    privileged = is_privileged(bundle.process, bundle.oci_version)
    try:
        request = parse_request(bundle.env, bundle.mounts, annotations, privileged,
                                Policy(accept_volume_mounts=True))
    except GpuhookError:
        return True
    return request.wants_gpu_setup


def note(error: str) -> str:
    """The log summary's note for a container started although the config could not be read."""
    return f" (config not read, no GPU asked: {error})"


def started_without(error: GpuhookError, read: Callable[[], tuple[Bundle, dict[str, str] | None]]) -> str:
    """note() for a container that starts although its config could not be read (`error`): it asks for no GPU.
    Raises `error` for one that asks for a GPU, or whose bundle cannot be read (`read`: the bundle, and the
    annotations asks_for_gpu takes)."""
    from gpuhook.errors import GpuhookError, render

    try:
        gpu = asks_for_gpu(*read())
    except GpuhookError:
        raise error from None
    if gpu:
        raise error
    return note(render(error))
