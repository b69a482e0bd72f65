"""The hooks a model-support plugin can implement, and :data:`hookimpl`, the marker of an implementation.

Where a plugin author imports from (``from model_support.plugins import hookimpl`` or from this module); the
specifications themselves live with the layer that calls each hook (docs/architecture.md):

- ``model_support_handlers``, ``model_support_serving_backends``, ``model_support_megatron_bridges``: the core's
  (:mod:`model_support.core.hooks`), re-exported here;
- ``model_support_stages`` (validation stage classes this plugin adds to ``model-support check``): the validation
  harness's (:mod:`model_support.validation.hookspecs`), which this layer does not import.
"""

from model_support.core.hooks import (
    ENTRY_POINT_GROUP,
    PROJECT,
    hookimpl,
    hookspec,
    model_support_handlers,
    model_support_megatron_bridges,
    model_support_serving_backends,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT",
    "hookimpl",
    "hookspec",
    "model_support_handlers",
    "model_support_megatron_bridges",
    "model_support_serving_backends",
]
