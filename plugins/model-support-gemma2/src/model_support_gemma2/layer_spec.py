"""The Gemma 2 decoder layers in megatron-core, without transformer-engine.

megatron-bridge's ``gemma2_layer_spec`` is built from transformer-engine modules; this is its twin from model-support's
local building blocks: zero-centred RMSNorms everywhere, ``SDPAttention`` with the attention logits soft-capped and
scaled by ``query_pre_attn_scalar``, a sliding window on the odd-numbered layers (the bridge's
``Gemma2DotProductAttention`` rule), and the post-attention / post-MLP norms on the output projections (named as the
bridge maps them: ``linear_*.post_layernorm``). The final logits' cap and the embedding's scaling are the bridge
provider's own (its ``provide``).
"""

from __future__ import annotations

import math
from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import ModuleSpec, TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from model_support.core.megatron.spec import (
    PostNormRowParallelLinear,
    SDPAttention,
    ZeroCenteredRMSNorm,
    stage_layers,
)


class Gemma2CoreAttention(SDPAttention):
    """``SDPAttention`` scaling scores by ``1 / sqrt(query_pre_attn_scalar)``: the bridge's provider keeps that scale
    out of ``softmax_scale`` (its own attention reads ``query_pre_attn_scalar``), so the parent passes none."""

    def __init__(self, config: Any, *args: Any, softmax_scale: float | None = None, **kwargs: Any) -> None:
        super().__init__(config, *args, softmax_scale=1.0 / math.sqrt(config.query_pre_attn_scalar), **kwargs)


def _layer(window: int | None, softcap: float | None) -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ZeroCenteredRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(
                        module=Gemma2CoreAttention, params={"window": window, "softcap": softcap}
                    ),
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


def gemma2_block_spec(config: Any, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Every layer's spec: the bridge's ``window_size`` (``(sliding_window - 1, 0)``) as a window of
    ``sliding_window`` keys on odd layer numbers, scores scaled by ``1 / sqrt(query_pre_attn_scalar)`` and capped at
    ``attn_logit_softcapping``."""
    window = config.window_size[0] + 1
    softcap = config.attn_logit_softcapping or None
    layers = [_layer(window if number % 2 == 1 else None, softcap) for number in range(1, config.num_layers + 1)]
    return TransformerBlockSubmodules(
        layer_specs=stage_layers(config, layers, vp_stage), layer_norm=ZeroCenteredRMSNorm
    )
