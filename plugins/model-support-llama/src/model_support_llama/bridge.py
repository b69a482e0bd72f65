"""LlamaBridge building the config's llama3 rope scaling, registered for LlamaForCausalLM in its place.

Hand-written here because megatron-bridge 0.6.2's LlamaBridge passes megatron-core only the llama3 ``factor``, so its
RotaryEmbedding scales with fixed low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192: right
for Meta's Llama 3.x checkpoints, silently wrong for any other llama3 parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.llama.llama_bridge import LlamaBridge
from megatron.core.models.gpt.gpt_model import GPTModel
from transformers import LlamaForCausalLM

# The llama3 rope_scaling fields, each a keyword of megatron-core's RotaryEmbedding._apply_scaling.
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class Llama3RopeProvider(GPTModelProvider):
    """GPTModelProvider that scales every rotary embedding it builds with all of the config's llama3 parameters."""

    # Set instead of ``rope_scaling`` (then False, so megatron-core does not scale with its defaults first).
    llama3_rope_scaling: dict[str, float] | None = None

    def provide(
        self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None
    ) -> GPTModel:
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if self.llama3_rope_scaling:  # every chunk of every pipeline stage has its own rotary_pos_emb
            rope = model.rotary_pos_emb
            rope.inv_freq = rope._apply_scaling(rope.inv_freq, **self.llama3_rope_scaling)
        return model


@MegatronModelBridge.register_bridge(
    source=LlamaForCausalLM, target=GPTModel, provider=Llama3RopeProvider, model_type="llama"
)
class Llama3RopeBridge(LlamaBridge):
    """LlamaBridge (same weight mappings) whose provider and exported config keep every llama3 rope parameter."""

    def provider_bridge(self, hf_pretrained: Any) -> Llama3RopeProvider:
        provider = super().provider_bridge(hf_pretrained)
        if provider.rope_scaling:  # LlamaBridge saw rope_type llama3
            params = hf_pretrained.config.rope_scaling
            provider.rope_scaling = False
            provider.llama3_rope_scaling = {name: params[name] for name in LLAMA3_FIELDS}
        return provider

    @classmethod
    def megatron_to_hf_config(cls, provider: GPTModelProvider) -> dict:
        hf_config = super().megatron_to_hf_config(provider)
        if getattr(provider, "llama3_rope_scaling", None):
            hf_config["rope_scaling"] = {"rope_type": "llama3", **provider.llama3_rope_scaling}
        return hf_config
