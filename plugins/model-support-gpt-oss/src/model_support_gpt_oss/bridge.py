"""megatron-bridge's GPTOSSBridge building the config's rope scaling and layer kinds, registered in its place.

Hand-written because megatron-bridge 0.6.2's GPTOSSBridge sets gpt-oss-20b's YaRN numbers (factor 32, 4096 original
positions, beta 32 / 1) and "every other layer windowed" whatever the config says: right for OpenAI's checkpoints,
silently wrong for any other rope parameters or layer_types (and for a tiny replica's).
"""

from __future__ import annotations

from typing import Any

from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.gpt_oss.gpt_oss_bridge import GPTOSSBridge
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.models.gpt.gpt_model import GPTModel
from transformers import GptOssForCausalLM

# The config's yarn parameters -> GPTModelProvider's fields.
YARN_FIELDS = {
    "factor": "yarn_rotary_scaling_factor",
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "truncate": "yarn_correction_range_round_to_int",
}


@MegatronModelBridge.register_bridge(source=GptOssForCausalLM, target=GPTModel, model_type="gpt_oss")
class GptOssConfigBridge(GPTOSSBridge):
    """GPTOSSBridge (same weight mappings) whose provider takes the rope parameters and sliding layers of the config."""

    def provider_bridge(self, hf_pretrained: Any) -> GPTModelProvider:
        provider = super().provider_bridge(hf_pretrained)
        config = hf_pretrained.config
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        for name, field in YARN_FIELDS.items():
            if name in rope:
                setattr(provider, field, rope[name])
        # megatron-core's per-layer form: 1 where the layer is windowed.
        provider.window_attn_skip_freq = [int(kind == "sliding_attention") for kind in config.layer_types]
        return provider
