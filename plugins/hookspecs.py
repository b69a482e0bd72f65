"""The hooks a model-support plugin can implement."""

from __future__ import annotations

from collections.abc import Sequence
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
