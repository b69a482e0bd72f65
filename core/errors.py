"""Errors that reach the user as one line: what is wrong and what to do."""


class ModelSupportError(Exception):
    """Base class; the CLI prints ``error: <message>`` and exits with status 2."""


class UnknownArchitectureError(ModelSupportError):
    pass


class HandlerConflictError(ModelSupportError):
    pass


class ModelNotFoundError(ModelSupportError):
    pass


class ConfigError(ModelSupportError):
    pass
