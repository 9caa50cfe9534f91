"""Expected failures: each carries one line for the user; the CLI prints it and exits 1, never a traceback."""

CLIP_LIMIT = 200  # characters of an image-supplied value a message echoes


def clip(value: object, limit: int = CLIP_LIMIT, quote: bool = True) -> str:
    """`value` for a message (its repr, or its text with quote=False), cut to `limit` characters with the full
    length said: an image can put megabytes in an environment variable, and a log line must stay a line."""
    text = repr(value) if quote else str(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str | bytes | list | tuple | dict) else "cut"
    return f"{text[:limit]}… ({size})"


class GpuhookError(Exception):
    """Base of every failure the user can fix (bad input, missing driver, refused request)."""


class DiscoveryError(GpuhookError):
    """The driver root, its files or NVML could not be read."""


class RequestError(GpuhookError):
    """A container asked for something gpuhook cannot or must not give."""


class RequirementError(RequestError):
    """An NVIDIA_REQUIRE_* constraint is not met by the host."""


class ConfigError(GpuhookError):
    """The configuration file or an option value is invalid."""


class InjectionError(GpuhookError):
    """Applying edits to a live container failed."""
