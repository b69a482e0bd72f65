"""A megatron-bridge bridge for Mixtral (``MixtralForCausalLM``), which megatron-bridge 0.6.2 does not map.

Hand-written because no bridge exists: Mistral's attention and norms (megatron-bridge's MistralBridge, less its
dense MLP), the MoE provider settings of its Qwen3-MoE bridge (softmax router over the top-k logits, as Mixtral's
softmax -> top-k -> renormalise computes), and mappings to the names Mixtral checkpoints store
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.<e>.w1 / w3 / w2``: what PEFT and vLLM address), not the
fused ``mlp.experts.gate_up_proj`` transformers >= 5 builds in memory.
"""

from __future__ import annotations

from typing import Any

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping, QKVMapping
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.models.gpt.gpt_model import GPTModel
from transformers import MixtralForCausalLM

_LAYER = "model.layers.*"
_MOE = f"{_LAYER}.block_sparse_moe"


@MegatronModelBridge.register_bridge(source=MixtralForCausalLM, target=GPTModel, model_type="mixtral")
class MixtralBridge(MegatronModelBridge):
    """Mixtral: GQA attention without bias, RMSNorm, every layer a softmax-routed MoE of SwiGLU experts."""

    def provider_bridge(self, hf_pretrained: Any) -> GPTModelProvider:
        # CONFIG_MAPPING reads the shapes, num_local_experts, num_experts_per_tok, router_aux_loss_coef, rope_theta.
        provider = super().provider_bridge(hf_pretrained)
        config = hf_pretrained.config
        provider.normalization = "RMSNorm"
        provider.gated_linear_unit = True
        provider.add_bias_linear = False
        provider.add_qkv_bias = False
        provider.qk_layernorm = False
        provider.hidden_dropout = 0.0
        provider.moe_ffn_hidden_size = config.intermediate_size  # Mixtral's experts are intermediate_size wide
        provider.moe_router_pre_softmax = False  # softmax over the top-k logits = softmax, top-k, renormalise
        provider.moe_router_load_balancing_type = "aux_loss"
        provider.moe_grouped_gemm = True
        if getattr(config, "sliding_window", None) is not None:  # as megatron-bridge's MistralBridge builds it
            provider.window_size = (config.sliding_window - 1, 0)
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        names = {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "output_layer.weight": "lm_head.weight",
            "decoder.final_layernorm.weight": "model.norm.weight",
            "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight": f"{_LAYER}.input_layernorm.weight",
            "decoder.layers.*.self_attention.linear_proj.weight": f"{_LAYER}.self_attn.o_proj.weight",
            "decoder.layers.*.pre_mlp_layernorm.weight": f"{_LAYER}.post_attention_layernorm.weight",
            "decoder.layers.*.mlp.router.weight": f"{_MOE}.gate.weight",
            "decoder.layers.*.mlp.experts.linear_fc2.weight*": f"{_MOE}.experts.*.w2.weight",
        }
        return MegatronMappingRegistry(
            *(AutoMapping(megatron_param=megatron, hf_param=hf) for megatron, hf in names.items()),
            QKVMapping(
                megatron_param="decoder.layers.*.self_attention.linear_qkv.weight",
                q=f"{_LAYER}.self_attn.q_proj.weight",
                k=f"{_LAYER}.self_attn.k_proj.weight",
                v=f"{_LAYER}.self_attn.v_proj.weight",
            ),
            GatedMLPMapping(
                megatron_param="decoder.layers.*.mlp.experts.linear_fc1.weight*",
                gate=f"{_MOE}.experts.*.w1.weight",
                up=f"{_MOE}.experts.*.w3.weight",
            ),
        )
