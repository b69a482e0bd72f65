"""The project's own plugin: built-in handlers and validation stages."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.handlers import BUILTIN_HANDLERS
from model_support.plugins import hookimpl
from model_support.validation.stage import Stage


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return list(BUILTIN_HANDLERS)


@hookimpl
def model_support_stages() -> Sequence[type[Stage]]:
    # Imported when the stages are asked for: their modules import torch, which `list` and `show` never need.
    from model_support.validation.stages import BUILTIN_STAGES

    return list(BUILTIN_STAGES)


@hookimpl
def model_support_serving_backends() -> Sequence[object]:
    from model_support.core.serving.vllm_backend import VllmBackend

    return [VllmBackend()]
