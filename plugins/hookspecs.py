"""The hooks a model-support plugin can implement."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from model_support.core.spec import HandlerSpec
    from model_support.validation.stage import Stage

PROJECT = "model_support"
ENTRY_POINT_GROUP = "model_support"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def model_support_handlers() -> Sequence[HandlerSpec]:
    """Return the handler declarations this plugin provides."""


@hookspec
def model_support_stages() -> Sequence[type[Stage]]:
    """Return validation stage classes this plugin adds to ``model-support check``."""


@hookspec
def model_support_serving_backends() -> Sequence[object]:
    """Return serving backends (objects shaped like ``model_support.core.serving.backend.ServingBackend``)."""


@hookspec
def model_support_megatron_bridges() -> Sequence[Callable[[], object]]:
    """Return callables that register megatron-bridge bridges, for a family megatron-bridge lacks.

    Typically ``[lambda: importlib.import_module("my_family.bridge")]``, a module whose bridge class carries
    ``@MegatronModelBridge.register_bridge(...)``. They are called once per process, right after megatron-bridge
    is imported for a Megatron stage or the training-time API, never by ``list`` / ``show`` / ``check`` of the
    other stages, which so stay fast and free of Megatron's import-time warnings.
    """
