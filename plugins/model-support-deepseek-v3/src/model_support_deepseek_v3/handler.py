"""DeepSeek-V3 (and R1, same architecture): multi-head latent attention, MoE with a shared expert after
``first_k_dense_replace`` dense layers, sigmoid router with group-limited top-k and a score-correction bias."""

from pathlib import Path
from typing import Any

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import (
    DependencyFloor,
    HandlerSpec,
    LoraTarget,
    RuntimePolicy,
    TargetScope,
    Topology,
    VllmLora,
)

# deepseek-ai/DeepSeek-R1's config.json (DeepSeek-V3's architecture) without its fp8 quantization_config.
REFERENCE_CONFIG = Path(__file__).with_name("deepseek-v3.json")

# Multi-head latent attention: megatron-core's MLASelfAttention projections, unfused (the codec copies them).
MLA = (
    LoraTarget("linear_q_down_proj", ("q_a_proj",), TargetScope.ATTENTION),
    LoraTarget("linear_q_up_proj", ("q_b_proj",), TargetScope.ATTENTION),
    LoraTarget("linear_kv_down_proj", ("kv_a_proj_with_mqa",), TargetScope.ATTENTION),
    LoraTarget("linear_kv_up_proj", ("kv_b_proj",), TargetScope.ATTENTION),
    LoraTarget("linear_proj", ("o_proj",), TargetScope.ATTENTION),
)


def _shared_expert_width(cfg: Any) -> int:
    return cfg.moe_intermediate_size * cfg.n_shared_experts


def _dense_layers(cfg: Any) -> range:
    return range(cfg.first_k_dense_replace)


DEEPSEEK_V3 = HandlerSpec(
    name="deepseek-v3",
    description="DeepSeek-V3 (multi-head latent attention, MoE with a shared expert, group-limited sigmoid router).",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    topology=Topology.MOE,
    lora_targets=MLA + targets.DENSE_MLP + targets.EXPERTS + targets.SHARED_EXPERT,
    vllm_lora=VllmLora(
        native=False,
        reason="vLLM applies no LoRA to MLA's kv_b_proj (its weight is absorbed into the attention; "
        "vllm-project/vllm#48974)",
    ),
    # LoRA splits derived from DeepSeekV3Bridge's own mappings.
    codec=BridgeLoraCodec("deepseek-v3"),
    dependencies=(
        DependencyFloor("transformers", "4.51.0", "first release with DeepseekV3ForCausalLM (model_type deepseek_v3)"),
        DependencyFloor(
            "megatron-bridge", "0.6.2", "DeepSeekV3Bridge weight mappings (MLA, expert bias)", extra="megatron"
        ),
    ),
    # transformers' DeepseekV3 has no multi-token-prediction module to compare with.
    runtime=RuntimePolicy(
        disable_mtp_for_training=True,
        cpu_serving_dtype="bfloat16",
        cpu_serving_reason="vLLM's CPU MLA backend (AMX_MLA) takes bf16 weights only",
        # Found by parallel_parity (tp2-sp: kv_a_proj_with_mqa's rope rows of the LoRA gradient off by 3.9e-3, the
        # latent rows exact): with the local spec's column-parallel linear_kv_down_proj, megatron-core gathers the
        # shared rope key and splits its gradient back, dropping the other ranks' heads' part.
        parallel_limits={
            "tensor_parallel": "megatron-core 0.19.2's local multi-latent attention keeps only this rank's heads' "
            "gradient of the shared rope key (k_pos_emb) at tensor parallel > 1"
        },
    ),
    reference_config=REFERENCE_CONFIG,
    config_fields=ConfigFields(
        experts=("n_routed_experts",),
        shared_expert_intermediate_size=_shared_expert_width,
        dense_layers=_dense_layers,
    ),
    # vLLM's CPU MLA needs a 576-wide latent (kv_lora_rank 512 + rope 64); two groups keep group-limited routing.
    tiny_config={
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    },
)
