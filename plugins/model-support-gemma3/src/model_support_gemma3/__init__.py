"""model-support plugin for the Gemma 3 text family: registers the ``gemma3`` handler."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_gemma3.handler import GEMMA3

__all__ = ["GEMMA3", "model_support_handlers"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [GEMMA3]
