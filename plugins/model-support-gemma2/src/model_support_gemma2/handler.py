"""Gemma 2 decoders (Gemma2ForCausalLM): sliding-window and global attention alternating, attention and final logit
soft-capping, post-attention and post-MLP norms, zero-centred RMSNorm gamma, GeGLU MLP, tied embeddings."""

from pathlib import Path
from typing import Any

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import DependencyFloor, HandlerSpec, Topology, VllmLora

# google/gemma-2-2b's config.json: 26 layers, hidden 2304, 8 heads / 4 KV heads of 256, sliding window 4096, attention
# logits capped at 50 and final logits at 30.
REFERENCE_CONFIG = Path(__file__).with_name("gemma-2-2b.json")


def bridge_pattern(config: Any) -> str | None:
    """The layers must alternate sliding and full attention from a sliding first layer: the only pattern
    megatron-bridge's Gemma2 model builds (its attention takes the window on odd layer numbers)."""
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(config.layer_types))]
    if list(config.layer_types) == expected:
        return None
    return (
        "layer_types do not alternate sliding and full attention from a sliding first layer, as megatron-bridge's "
        "Gemma2 model builds them"
    )


GEMMA2 = HandlerSpec(
    name="gemma2",
    description="Gemma 2 decoder (alternating sliding-window/global attention, logit soft-capping, post-norms, GeGLU).",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    topology=Topology.DENSE,
    lora_targets=targets.ATTENTION + targets.DENSE_MLP,
    vllm_lora=VllmLora(native=True, reason="vLLM's Gemma2ForCausalLM implements SupportsLoRA"),
    # LoRA splits derived from Gemma2Bridge's own mappings (QKV by query group, [gate; up]).
    codec=BridgeLoraCodec("gemma2"),
    dependencies=(
        DependencyFloor("transformers", "4.42.0", "Gemma2ForCausalLM and Gemma2Config"),
        DependencyFloor("megatron-bridge", "0.6.2", "Gemma2Bridge weight mappings and provider", extra="megatron"),
    ),
    reference_config=REFERENCE_CONFIG,
    # A sliding-window layer is a full-attention layer with a window (the layer spec sets it).
    config_fields=ConfigFields(layer_kinds={"full_attention": "full_attention", "sliding_attention": "full_attention"}),
    # A window shorter than the test prompts, the attention scale of the tiny head size, and caps the tiny model's
    # random scores and logits reach, so that a cap left out shows.
    tiny_config={
        "sliding_window": 4,
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 0.5,
        "final_logit_softcapping": 1.0,
    },
    megatron_layer_spec="model_support_gemma2.layer_spec:gemma2_block_spec",
    config_requirements=(bridge_pattern,),
)
