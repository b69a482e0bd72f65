"""model-support plugin for the Mixtral family: registers the ``mixtral`` handler and its megatron-bridge bridge."""

import importlib
from collections.abc import Callable, Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from model_support_mixtral.handler import MIXTRAL

__all__ = ["MIXTRAL", "model_support_handlers", "model_support_megatron_bridges"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [MIXTRAL]


@hookimpl
def model_support_megatron_bridges() -> Sequence[Callable[[], object]]:
    # megatron-bridge 0.6.2 has no Mixtral bridge (see bridge.py); imported only for Megatron stages.
    return [lambda: importlib.import_module("model_support_mixtral.bridge")]
