"""Expected failures: each carries one line for the user; the CLI prints it and exits 1, never a traceback."""

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

CLIP_LIMIT = 200  # characters of an image-supplied value a message echoes


# Control characters a message must not carry raw (a log line stays one line), as \xNN.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}


def clip(value: object, limit: int = CLIP_LIMIT, quote: bool = True) -> str:
    """`value` for a message (its repr, or its text with quote=False and control characters escaped), cut to
    `limit` characters with the full length said: an image can put megabytes in an environment variable, and a
    log line must stay a line. A long string is cut before it is rendered, so clipping costs the same at any size."""
    whole, cut = value, False
    if isinstance(value, (str, bytes)) and len(value) > limit:
        value, cut = value[:limit], True
    text = repr(value) if quote else str(value).translate(_CONTROL)
    if not cut and len(text) <= limit:
        return text
    size = f"{len(whole)} characters" if isinstance(whole, (str, bytes, list, tuple, dict)) else "cut"
    return f"{text[:limit]}… ({size})"


MESSAGE_LIMIT = 2000  # characters of one door's error line, whatever it holds


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` as one bounded line: control characters escaped (a message that failed to clip an image string
    still cannot forge a log line), cut at `limit`. Text that clip() already rendered passes through unchanged,
    so an image string is escaped once."""
    return clip(text, limit, quote=False)


def render(exc: BaseException) -> str:
    """The one line every door (hook, cdi-hook, shim, the click CLI) prints for a failure that ends it.

    GpuhookError carries its own line. An OSError that escaped the layers below (a read-only or immutable
    image, ENOSPC) is its strerror and file names, each clipped, never a traceback; anything else is an
    internal error with its type."""
    if isinstance(exc, GpuhookError):
        return one_line(str(exc))
    if isinstance(exc, OSError):
        names = [clip(n) for n in (exc.filename, exc.filename2) if n is not None]
        what = exc.strerror or type(exc).__name__
        return one_line(f"{what}: {' -> '.join(names)}" if names else f"{what} ({clip(str(exc), quote=False)})")
    return one_line(f"internal error: {type(exc).__name__}: {clip(str(exc), quote=False)}")


def outcome(work: "Callable[[], object]") -> "tuple[int, str]":
    """Run `work()` as a click-free command does (cli/entry.run_lean; the service's `cdi-hook`): (0, "") when it
    ends, (1, "gpuhook: " + render(exc)) for any failure, (1, "") for a closed pipe: one line, never a traceback."""
    try:
        work()
    except BrokenPipeError:
        return 1, ""
    except Exception as exc:  # noqa: BLE001 - a runtime shows our stderr: one line, whatever happened
        return 1, f"gpuhook: {render(exc)}"
    return 0, ""


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
