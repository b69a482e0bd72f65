"""The hooks the core calls on plugins: their pluggy markers and specifications.

A plugin is any module registered under the ``model_support`` entry-point group that implements one or more hooks,
each function marked with :data:`hookimpl`. The core declares the hooks it calls itself (handlers, serving backends,
megatron-bridge bridges); the validation harness declares ``model_support_stages`` in
:mod:`model_support.validation.hookspecs` and adds it to the plugin manager before it calls it. Plugin authors import
the marker from :mod:`model_support.plugins.hookspecs` (or :mod:`model_support.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from model_support.core.spec import HandlerSpec

PROJECT = "model_support"
ENTRY_POINT_GROUP = "model_support"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def model_support_handlers() -> Sequence[HandlerSpec]:
    """Return the handler declarations this plugin provides."""


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
