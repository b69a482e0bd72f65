"""model-support plugin for the Gemma 2 text family: registers the ``gemma2`` handler."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_gemma2.handler import GEMMA2

__all__ = ["GEMMA2", "model_support_handlers"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [GEMMA2]
