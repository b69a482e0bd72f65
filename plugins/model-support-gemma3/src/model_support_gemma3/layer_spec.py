"""The Gemma 3 decoder layers in megatron-core, without transformer-engine.

megatron-bridge's ``gemma3_layer_spec`` is built from transformer-engine modules only; this is its twin from
model-support's local building blocks: zero-centred RMSNorms everywhere, the bridge's own ``Gemma3SelfAttention``
(local or global RoPE by layer), sliding-window attention on the local layers, and the post-attention /
post-MLP norms on the output projections (named as the bridge maps them: ``linear_*.post_layernorm``).
"""

from __future__ import annotations

from typing import Any

from megatron.bridge.models.gemma.gemma3_provider import Gemma3SelfAttention, _is_local_attn_layer
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import ModuleSpec, TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from model_support.core.megatron.spec import (
    PostNormRowParallelLinear,
    SDPAttention,
    ZeroCenteredRMSNorm,
    stage_layers,
)


def _layer(window: int | None) -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ZeroCenteredRMSNorm,
            self_attention=ModuleSpec(
                module=Gemma3SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(module=SDPAttention, params={"window": window}),
                    q_layernorm=ZeroCenteredRMSNorm,
                    k_layernorm=ZeroCenteredRMSNorm,
                    linear_proj=PostNormRowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=ZeroCenteredRMSNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=PostNormRowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def gemma3_block_spec(config: Any, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Every layer's spec: sliding window on the layers the provider's ``interleaved_attn_pattern`` makes local
    (the same rule ``Gemma3SelfAttention`` picks the local RoPE by)."""
    layers = [
        _layer(config.window_size if _is_local_attn_layer(number, config.interleaved_attn_pattern) else None)
        for number in range(1, config.num_layers + 1)
    ]
    return TransformerBlockSubmodules(
        layer_specs=stage_layers(config, layers, vp_stage), layer_norm=ZeroCenteredRMSNorm
    )
