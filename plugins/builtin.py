"""The project's own plugin: the built-in handlers and serving backend.

Its validation stages come from the harness (``model_support.validation.builtin_stages``), which adds them in this
plugin's name wherever it is loaded: this layer does not import the harness (docs/architecture.md).
"""

from collections.abc import Sequence

from model_support.core.errors import HandlerConflictError
from model_support.core.spec import HandlerSpec
from model_support.handlers import BUILTIN_HANDLERS, changed_declarations
from model_support.plugins import hookimpl


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    changed = changed_declarations()
    if changed:  # registered as they are, they would be checked and shown as the project's own
        raise HandlerConflictError(
            f"the built-in declaration of {', '.join(changed)} was changed in this process after it was imported (a "
            "plugin edits it in place): the built-in handlers are not registered; uninstall or fix that plugin"
        )
    return list(BUILTIN_HANDLERS)


@hookimpl
def model_support_serving_backends() -> Sequence[object]:
    from model_support.core.serving.vllm_backend import VllmBackend

    return [VllmBackend()]
