"""OLMoE's Megatron layer: model-support's local spec with q/k RMSNorm over the whole projection.

OLMoE normalises the query (heads x head_dim) and the key (kv heads x head_dim) each as one vector, where
megatron-core's q/k norm normalises every head on its own. megatron-bridge's ``OLMoESelfAttention`` does the former
only without tensor parallelism and sizes the key norm for MHA alone, so the norm is written here: a drop-in
q/k layernorm of megatron-core's ``SelfAttention`` that sees its rank's heads and all-reduces the sum of squares
over the tensor-parallel group.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from model_support.core.megatron.spec import gpt_block_spec
from torch.distributed.nn.functional import all_reduce


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over all ``heads`` of a q or k projection, applied to this rank's ``[..., heads/TP, head_dim]``.

    The weight is the rank's slice of the checkpoint's ``[heads * head_dim]`` norm weight (column-parallel, as the
    projection's heads are), which is how megatron-bridge loads and exports it.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, *, heads: int, **_: Any) -> None:
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if heads % tp:
            raise ValueError(
                f"a q/k norm over {heads} heads cannot be split over tensor parallel {tp}: each rank needs whole heads "
                "(use a tensor-parallel size that divides the key/value heads)"
            )
        self.eps = eps
        self.width = heads * hidden_size
        self.group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        self.weight = torch.nn.Parameter(torch.ones(heads // tp * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        # How megatron-bridge's AutoMapping tells a column-parallel module.
        self.tensor_model_parallel, self.partition_dim = True, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.group is not None:
            # Every rank's output depends on every rank's squares: all-reduce forward and backward.
            squares = all_reduce(squares, group=self.group)
        out = x32 * torch.rsqrt(squares / self.width + self.eps)
        return (out * self.weight.float().view(x.shape[-2], x.shape[-1])).to(x.dtype)


def layer_spec(config: Any, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """model-support's local GPT layers with :class:`ProjectionRMSNorm` as q and k norm."""
    block = gpt_block_spec(config, vp_stage)
    for spec in {id(s): s for s in block.layer_specs}.values():
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = functools.partial(ProjectionRMSNorm, heads=config.num_attention_heads)
        attention.k_layernorm = functools.partial(ProjectionRMSNorm, heads=config.num_query_groups)
    return block
