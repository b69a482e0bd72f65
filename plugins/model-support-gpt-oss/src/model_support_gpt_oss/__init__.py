"""model-support plugin for the gpt-oss family: registers the ``gpt-oss`` handler and its megatron-bridge bridge."""

import importlib
from collections.abc import Callable, Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_gpt_oss.handler import GPT_OSS

__all__ = ["GPT_OSS", "model_support_handlers", "model_support_megatron_bridges"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [GPT_OSS]


@hookimpl
def model_support_megatron_bridges() -> Sequence[Callable[[], object]]:
    # Replaces megatron-bridge's GPTOSSBridge for GptOssForCausalLM (see bridge.py); imported only for Megatron stages.
    return [lambda: importlib.import_module("model_support_gpt_oss.bridge")]
