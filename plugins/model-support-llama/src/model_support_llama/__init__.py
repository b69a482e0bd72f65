"""model-support plugin for the Llama family: registers the ``llama`` handler."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_llama.handler import LLAMA

__all__ = ["LLAMA", "model_support_handlers"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [LLAMA]
