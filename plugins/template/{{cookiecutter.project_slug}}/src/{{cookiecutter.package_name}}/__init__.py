"""model-support plugin: registers the {{ cookiecutter.handler_name }} handler (entry point group ``model_support``)."""

from collections.abc import Sequence

from model_support.core.spec import HandlerSpec
from model_support.plugins import hookimpl

from {{ cookiecutter.package_name }}.handler import HANDLER

__all__ = ["HANDLER", "model_support_handlers"]


@hookimpl
def model_support_handlers() -> Sequence[HandlerSpec]:
    return [HANDLER]


# If megatron-bridge has no bridge for this family, ship one and register it lazily with the
# `model_support_megatron_bridges` hook (docs/adding-a-model.md, "A family megatron-bridge lacks").
