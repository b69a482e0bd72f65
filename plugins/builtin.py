"""The project's own plugin: the built-in handlers and serving backend.

Its validation stages come from the harness (``model_support.validation.builtin_stages``), which adds them in this
plugin's name wherever it is loaded: this layer does not import the harness (docs/architecture.md).
"""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.handlers import BUILTIN_HANDLERS
from model_support.plugins import hookimpl


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return list(BUILTIN_HANDLERS)


@hookimpl
def model_support_serving_backends() -> Sequence[object]:
    from model_support.core.serving.vllm_backend import VllmBackend

    return [VllmBackend()]
