"""Built-in validation stages, in pipeline order."""

from model_support.validation.stages.architecture import ArchitectureStage
from model_support.validation.stages.dependencies import DependenciesStage
from model_support.validation.stages.hf_parity import HfParityStage
from model_support.validation.stages.lora_coverage import LoraCoverageStage
from model_support.validation.stages.packed_position_ids import PackedPositionIdsStage
from model_support.validation.stages.trainability import TrainabilityStage

BUILTIN_STAGES = (
    DependenciesStage,
    ArchitectureStage,
    HfParityStage,
    LoraCoverageStage,
    PackedPositionIdsStage,
    TrainabilityStage,
)

__all__ = [
    "BUILTIN_STAGES",
    "ArchitectureStage",
    "DependenciesStage",
    "HfParityStage",
    "LoraCoverageStage",
    "PackedPositionIdsStage",
    "TrainabilityStage",
]
