"""model-support plugin for the OLMoE family: registers the ``olmoe`` handler."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_olmoe.handler import OLMOE

__all__ = ["OLMOE", "model_support_handlers"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [OLMOE]
