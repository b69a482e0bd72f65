"""GLM-4.5 MoE (zai-org/GLM-4.5, GLM-4.5-Air): GQA attention with q/k/v bias and half-width rotary embeddings, MoE
with a shared expert after ``first_k_dense_replace`` dense layers, sigmoid router with a score-correction bias."""

from pathlib import Path
from typing import Any

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import (
    ConfigRequirement,
    DependencyFloor,
    HandlerSpec,
    RuntimePolicy,
    Topology,
    VllmLora,
)

# zai-org/GLM-4.5-Air's config.json: 46 layers (the first dense), hidden 4096, 96 heads / 8 KV heads of 128, 128
# routed experts of width 1408 top-8 and one shared expert, one MTP layer.
REFERENCE_CONFIG = Path(__file__).with_name("glm-4.5-air.json")
_BRIDGE = "megatron-bridge's GLM45Bridge"


def _shared_expert_width(cfg: Any) -> int:
    return cfg.moe_intermediate_size * cfg.n_shared_experts


def _dense_layers(cfg: Any) -> range:
    return range(cfg.first_k_dense_replace)


GLM4_MOE = HandlerSpec(
    name="glm4-moe",
    description="GLM-4.5 mixture of experts (GQA with q/k/v bias, partial rotary, shared expert, sigmoid router).",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    topology=Topology.MOE,
    lora_targets=targets.ATTENTION + targets.DENSE_MLP + targets.EXPERTS + targets.SHARED_EXPERT,
    vllm_lora=VllmLora(native=True, reason="vLLM's Glm4MoeForCausalLM implements SupportsLoRA"),
    # LoRA splits derived from GLM45Bridge's own mappings.
    codec=BridgeLoraCodec("glm4-moe"),
    dependencies=(
        DependencyFloor("transformers", "4.54.0", "first release with Glm4MoeForCausalLM (model_type glm4_moe)"),
        DependencyFloor("megatron-core", "0.19.2", "local-spec GPTModel the bridge targets", extra="megatron"),
        DependencyFloor("megatron-bridge", "0.6.2", "GLM45Bridge weight mappings", extra="megatron"),
    ),
    # transformers' Glm4Moe has no multi-token-prediction module to compare with.
    runtime=RuntimePolicy(disable_mtp_for_training=True),
    reference_config=REFERENCE_CONFIG,
    config_fields=ConfigFields(
        experts=("n_routed_experts",),
        shared_expert_intermediate_size=_shared_expert_width,
        dense_layers=_dense_layers,
    ),
    config_requirements=(
        ConfigRequirement("n_shared_experts", (1,), f"{_BRIDGE} builds one shared expert of moe_intermediate_size"),
    ),
    tiny_config={"first_k_dense_replace": 1},
)
