"""Built-in validation stages, in pipeline order."""

from model_support.validation.stages.architecture import ArchitectureStage
from model_support.validation.stages.dependencies import DependenciesStage

BUILTIN_STAGES = (DependenciesStage, ArchitectureStage)

__all__ = ["BUILTIN_STAGES", "ArchitectureStage", "DependenciesStage"]
