"""model-support plugin for the GLM-4.5 MoE family: registers the ``glm4-moe`` handler."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_glm4_moe.handler import GLM4_MOE

__all__ = ["GLM4_MOE", "model_support_handlers"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [GLM4_MOE]
