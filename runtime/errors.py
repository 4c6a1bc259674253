"""The exceptions edgespec raises. Each message names what was wrong and what to do about it,
so that a robot operator can act on it without reading the code."""


# What a message says when a bundle's manifest is wrong: the command that writes a bundle from checkpoints.
REBUILD_BUNDLE = "rebuild it with `edgespec bundle --target DIR --out DIR` (the zoo: `make bundles`)"


class EdgespecError(Exception):
    """Base of every error edgespec raises on purpose."""


class ConfigError(EdgespecError):
    """A YAML config (or parameter set) has an unknown key, a wrong type or an out-of-range value."""


class BundleError(EdgespecError):
    """A bundle directory is missing a file, has a corrupt file or an unsupported format version."""


class RequestError(EdgespecError):
    """A generation request is invalid (empty prompt, bad temperature, too many tokens, ...).

    `field` names the request field at fault so that callers (CLI, ROS node) can report it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class BudgetExceeded(EdgespecError):
    """The memory budget cannot hold what was asked (weights, KV cache, a request's context)."""


class RequestTooLong(RequestError, BudgetExceeded):
    """A request whose prompt + max_tokens the memory budget cannot hold: the request's fault (it is refused,
    naming its field), not the node's."""


class BackendError(EdgespecError):
    """A backend failed (missing provider, runtime failure mid-generation)."""


class ExportError(EdgespecError):
    """An export produced graphs that do not compute what the numpy reference computes; nothing was written."""
