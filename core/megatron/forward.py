"""Running a built megatron-core model: logits for plain and packed rows.

A packed row holds several sequences back to back, each with position ids restarting at 0. The sequence
boundaries (``cu_seqlens``) are derived from the position ids once, and both kinds of token mixers
use them: full attention gets a block-diagonal causal mask (the local spec's attention takes an explicit
mask), Gated DeltaNet layers get ``cu_seqlens`` so no recurrent or convolution state crosses a boundary.
RoPE depends only on the distance between a query and a key, so within one sequence it is unchanged by
where the sequence sits in the row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 cumulative sequence lengths of one packed row: a sequence starts wherever the position id is 0."""
    from model_support.kernels.packing import cu_seqlens_from_position_ids as derive

    return derive(position_ids)


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1, 1, S, S] boolean mask, True where attention is forbidden (other sequence, or the future)."""
    seq_id = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    seq_id[cu_seqlens[1:-1].long()] = 1
    seq_id = seq_id.cumsum(0)
    same = seq_id[:, None] == seq_id[None, :]
    causal = torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).tril()
    return ~(same & causal)[None, None]


@contextmanager
def gdn_packing(model: torch.nn.Module, cu_seqlens: torch.Tensor | None) -> Iterator[None]:
    """Let every Gated DeltaNet layer of ``model`` see the row's sequence boundaries during a forward."""
    from model_support.core.megatron.gdn import GDN_MODULES

    layers = [m for m in model.modules() if isinstance(m, GDN_MODULES)]
    for layer in layers:
        layer.cu_seqlens = cu_seqlens
    try:
        yield
    finally:
        for layer in layers:
            layer.cu_seqlens = None


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary-parallel logits (each rank holds a contiguous slice); backward keeps this
    rank's slice of the gradient. megatron-core's own gather allocates on the current CUDA device."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.width = group.rank(), local.shape[-1]
        parts = [torch.empty_like(local) for _ in range(group.size())]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


def logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, V] fp32 logits on the model's device (full vocabulary on every tensor-parallel rank).

    ``position_ids`` given: ``input_ids`` is one packed row ([1, S]) and sequences restart at position 0.
    """
    from megatron.core import parallel_state

    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    batch, total = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(total, device=input_ids.device).expand(batch, total)
        mask, cu_seqlens = None, None
    else:
        if batch != 1:
            raise ValueError(f"a packed row has batch size 1, got {batch}")
        position_ids = position_ids.to(device)
        cu_seqlens = cu_seqlens_from_position_ids(position_ids[0])
        mask = packed_causal_mask(cu_seqlens, total)
    with gdn_packing(model, cu_seqlens):
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        out = _GatherVocab.apply(out, parallel_state.get_tensor_model_parallel_group())
    vocab = getattr(model.config, "vocab_size", None) or out.shape[-1]
    return out[..., :vocab].float()
