"""model-support plugin for DeepSeek-V3: registers the ``deepseek-v3`` handler."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_deepseek_v3.handler import DEEPSEEK_V3

__all__ = ["DEEPSEEK_V3", "model_support_handlers"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [DEEPSEEK_V3]
