"""Context parallelism: megatron-core's load-balanced split of a sequence over context-parallel ranks, and back.

A sequence is cut into 2 x cp chunks; rank r holds chunks r and 2 x cp - 1 - r (so causal attention costs every
rank the same). megatron-core's rotary embedding and its ``get_batch_on_this_cp_rank`` use this split; the
functions here give the local modules (attention, Gated DeltaNet) and the logits the same view of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group() -> Any:
    """The context-parallel group, or None when the model is not split along the sequence."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def local_part(tensor: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """This rank's part of a whole sequence along ``dim``: chunks ``rank`` and ``2 cp - 1 - rank``."""
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def sequence_order(tensor: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Every rank's part concatenated in rank order along ``dim`` -> the whole sequence in order."""
    chunks = tensor.chunk(2 * cp, dim=dim)
    ordered: list[torch.Tensor] = [chunks[0]] * (2 * cp)
    for rank in range(cp):
        ordered[rank], ordered[2 * cp - 1 - rank] = chunks[2 * rank], chunks[2 * rank + 1]
    return torch.cat(ordered, dim=dim)


def local_positions(total: int, cp_group: Any, device: torch.device) -> torch.Tensor:
    """The positions in the whole sequence of this rank's ``total / cp`` tokens."""
    return local_part(torch.arange(total, device=device), 0, cp_group.rank(), cp_group.size())


def gather_keys(local: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """[S / cp, ...] keys or values of this rank -> [S, ...] in sequence order; backward sums every rank's gradient
    of them (each rank's queries attend to all of them) and keeps this rank's part."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    gathered = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=cp_group)
    return sequence_order(gathered, 0, cp_group.size())


class _GatherForLoss(torch.autograd.Function):
    """[B, S / cp, ...] of every rank -> [B, S, ...] in order; backward keeps this rank's part of the gradient
    (every rank computes the same loss from the whole sequence)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, cp_group: Any) -> torch.Tensor:
        ctx.cp, ctx.rank = cp_group.size(), cp_group.rank()
        parts = [torch.empty_like(local) for _ in range(ctx.cp)]
        dist.all_gather(parts, local.contiguous(), group=cp_group)
        return sequence_order(torch.cat(parts, dim=1), 1, ctx.cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return local_part(grad, 1, ctx.rank, ctx.cp).contiguous(), None


def whole_sequence(local: torch.Tensor) -> torch.Tensor:
    """[B, S / cp, ...] of this context-parallel rank -> [B, S, ...] in sequence order, on every rank; the
    gradient of a loss every rank computes alike flows back to each rank's own part."""
    cp_group = group()
    return local if cp_group is None else _GatherForLoss.apply(local, cp_group)


def split_batch(tensor: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> this context-parallel rank's [B, S / cp, ...]."""
    cp_group = group()
    return tensor if cp_group is None else local_part(tensor, 1, cp_group.rank(), cp_group.size())
