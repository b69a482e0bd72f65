"""Core of model-support: the handler specification, the registry, discovery and the CLI."""

from model_support.core.errors import ModelSupportError
from model_support.core.layout import ModelLayout, MoELayout, derive_layout
from model_support.core.spec import (
    DependencyFloor,
    HandlerSpec,
    LoraCodec,
    LoraTarget,
    RuntimePolicy,
    SpecError,
    TargetScope,
    Topology,
    VllmLora,
)

__all__ = [
    "DependencyFloor",
    "HandlerSpec",
    "LoraCodec",
    "LoraTarget",
    "MoELayout",
    "ModelLayout",
    "ModelSupportError",
    "RuntimePolicy",
    "SpecError",
    "TargetScope",
    "Topology",
    "VllmLora",
    "derive_layout",
]
