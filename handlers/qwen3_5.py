"""Qwen3.5 dense and MoE: Gated DeltaNet / gated full-attention hybrids (3 GDN : 1 attention)."""

from model_support.core import targets
from model_support.core.codecs import QwenLoraCodec
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
_CODEC = QwenLoraCodec("qwen3.5")
# MTP heads are for speculative decoding; the trainer must not build or train them.
_RUNTIME = RuntimePolicy(disable_mtp_for_training=True)
_VLLM = VllmLora(
    native=False,
    reason="vLLM packs the GDN projections into in_proj_qkvz / in_proj_ba, which an HF-named "
    "PEFT adapter (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) does not address",
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
    dependencies=(_TRANSFORMERS, *_MEGATRON),
    runtime=_RUNTIME,
    reference_config=CONFIGS / "qwen3.6-27b.json",
)

QWEN3_5_MOE = HandlerSpec(
    name="qwen3.5-moe",
    description="Qwen3.5 MoE: Gated DeltaNet hybrid with routed experts and one shared expert.",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    topology=Topology.MOE,
    linear_attention=True,
    lora_targets=targets.ATTENTION + targets.GATED_DELTANET + targets.EXPERTS + targets.SHARED_EXPERT,
    vllm_lora=_VLLM,
    codec=_CODEC,
    dependencies=(_TRANSFORMERS, *_MEGATRON),
    runtime=_RUNTIME,
    reference_config=CONFIGS / "qwen3.5-35b-a3b.json",
)
