"""model-support plugin for the Llama family: registers the ``llama`` handler and its megatron-bridge bridge."""

import importlib
from collections.abc import Callable, Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_llama.handler import LLAMA

__all__ = ["LLAMA", "model_support_handlers", "model_support_megatron_bridges"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [LLAMA]


@hookimpl
def model_support_megatron_bridges() -> Sequence[Callable[[], object]]:
    # Replaces megatron-bridge's LlamaBridge for LlamaForCausalLM (see bridge.py); imported only for Megatron stages.
    return [lambda: importlib.import_module("model_support_llama.bridge")]
