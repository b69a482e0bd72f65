"""Built-in validation stages, in pipeline order."""

from model_support.validation.stages.architecture import ArchitectureStage
from model_support.validation.stages.chat_template_rollout import ChatTemplateRolloutStage
from model_support.validation.stages.dependencies import DependenciesStage
from model_support.validation.stages.hf_parity import HfParityStage
from model_support.validation.stages.lora_coverage import LoraCoverageStage
from model_support.validation.stages.lora_gradients import LoraGradientsStage
from model_support.validation.stages.merged_serving import MergedServingStage
from model_support.validation.stages.native_vllm_lora import NativeVllmLoraStage
from model_support.validation.stages.packed_position_ids import PackedPositionIdsStage
from model_support.validation.stages.parallel_parity import ParallelParityStage
from model_support.validation.stages.rl_trainability import RlTrainabilityStage
from model_support.validation.stages.shared_prefix import SharedPrefixStage
from model_support.validation.stages.staleness_boundary import StalenessBoundaryStage
from model_support.validation.stages.train_inference_mismatch import TrainInferenceMismatchStage
from model_support.validation.stages.trainability import TrainabilityStage
from model_support.validation.stages.weights import WeightsStage

BUILTIN_STAGES = (
    DependenciesStage,
    ArchitectureStage,
    WeightsStage,
    HfParityStage,
    LoraCoverageStage,
    LoraGradientsStage,
    PackedPositionIdsStage,
    SharedPrefixStage,
    TrainabilityStage,
    ParallelParityStage,
    NativeVllmLoraStage,
    MergedServingStage,
    ChatTemplateRolloutStage,
    TrainInferenceMismatchStage,
    StalenessBoundaryStage,
    RlTrainabilityStage,
)

__all__ = [
    "BUILTIN_STAGES",
    "ArchitectureStage",
    "ChatTemplateRolloutStage",
    "DependenciesStage",
    "HfParityStage",
    "LoraCoverageStage",
    "LoraGradientsStage",
    "MergedServingStage",
    "NativeVllmLoraStage",
    "PackedPositionIdsStage",
    "ParallelParityStage",
    "RlTrainabilityStage",
    "SharedPrefixStage",
    "StalenessBoundaryStage",
    "TrainInferenceMismatchStage",
    "TrainabilityStage",
    "WeightsStage",
]
