"""Expected failures: each carries one line for the user; the CLI prints it and exits 1, never a traceback."""


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
