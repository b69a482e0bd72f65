"""Serving errors (one line each: what failed and what to do)."""

from model_support.core.errors import ModelSupportError


class ServingError(ModelSupportError):
    """Base class of the serving errors."""


class RuntimeMissingError(ServingError):
    """No usable serving runtime is installed."""


class ServerError(ServingError):
    """A server did not start, died, or answered with an error."""


class ExportError(ServingError):
    """A merged export could not be written or read."""
