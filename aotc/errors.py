"""One error family for user mistakes, kept apart from internal bugs.

An `AotcError` is something the user can fix: a bad file, field, argument or
bundle. Its message says what was received, what was expected and how to fix
it. Anything else that escapes aotc is a bug in aotc.
"""


class AotcError(Exception):
    """A user-facing error; the CLI prints its message without a traceback."""


class ConfigError(AotcError):
    """config.json is missing, malformed, or describes an unsupported model."""


class WeightsError(AotcError):
    """A checkpoint tensor is missing or has the wrong shape or dtype."""


class TraceError(AotcError):
    """A model's entry cannot be traced into one static graph."""


class BundleError(AotcError):
    """A bundle is missing, corrupt, or does not match the model it is run with."""


class BackendError(AotcError):
    """A backend is unavailable here or its compiler failed."""


def did_you_mean(name: str, known) -> str:
    """A suffix for failed lookups: the known names, so the user can pick one."""
    known = sorted(known)
    return f"known: {', '.join(known)}" if known else "none are known"
