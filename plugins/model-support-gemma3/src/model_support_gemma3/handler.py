"""Gemma 3 text decoders (Gemma3ForCausalLM): 5 sliding-window layers to 1 global, local and global RoPE,
q/k norm, post-attention and post-MLP norms, zero-centred RMSNorm gamma, GeGLU MLP, tied embeddings."""

from pathlib import Path
from typing import Any

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import DependencyFloor, HandlerSpec, Topology, VllmLora

# google/gemma-3-1b-it's config.json: 26 layers, hidden 1152, 4 heads / 1 KV head of 256, sliding window 512.
REFERENCE_CONFIG = Path(__file__).with_name("gemma-3-1b.json")
# megatron-bridge's Gemma3ModelProvider hardcodes this (sliding, full) period instead of reading layer_types.
BRIDGE_PATTERN = (5, 1)


def no_softcapping(config: Any) -> str | None:
    """megatron-bridge's Gemma3 provider drops logit softcapping, which transformers and vLLM apply."""
    capped = [f for f in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(config, f, None)]
    return (
        f"{', '.join(capped)} set: megatron-bridge's Gemma3 model does not apply logit softcapping" if capped else None
    )


def bridge_pattern(config: Any) -> str | None:
    """The layers must be the bridge's (5 sliding, 1 full) period, the only one its Gemma3 model builds."""
    local, full = BRIDGE_PATTERN
    expected = [
        "full_attention" if (i + 1) % (local + full) == 0 else "sliding_attention"
        for i in range(len(config.layer_types))
    ]
    if list(config.layer_types) == expected:
        return None
    return f"layer_types are not megatron-bridge's Gemma3 pattern of {local} sliding to {full} full attention layers"


GEMMA3 = HandlerSpec(
    name="gemma3",
    description="Gemma 3 text decoder (5:1 sliding-window/global attention, q/k norm, post-norms, GeGLU MLP).",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    topology=Topology.DENSE,
    lora_targets=targets.ATTENTION + targets.DENSE_MLP,
    vllm_lora=VllmLora(native=True, reason="vLLM's Gemma3ForCausalLM implements SupportsLoRA"),
    # LoRA splits derived from Gemma3ModelBridge's own mappings (QKV by query group, [gate; up]).
    codec=BridgeLoraCodec("gemma3"),
    dependencies=(
        DependencyFloor("transformers", "4.50.0", "Gemma3ForCausalLM and Gemma3TextConfig"),
        DependencyFloor("megatron-bridge", "0.6.2", "Gemma3ModelBridge weight mappings and provider", extra="megatron"),
    ),
    reference_config=REFERENCE_CONFIG,
    # A sliding-window layer is a full-attention layer with a window (the layer spec sets it).
    config_fields=ConfigFields(layer_kinds={"full_attention": "full_attention", "sliding_attention": "full_attention"}),
    # A window shorter than the test prompts, and the attention scale of the tiny head size.
    tiny_config={"sliding_window": 4, "query_pre_attn_scalar": 32},
    megatron_layer_spec="model_support_gemma3.layer_spec:gemma3_block_spec",
    config_requirements=(no_softcapping, bridge_pattern),
)
