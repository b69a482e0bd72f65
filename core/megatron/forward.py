"""Running a built megatron-core model: logits for plain and packed rows.

A packed row holds several sequences back to back, each with position ids restarting at 0. The sequence
boundaries (``cu_seqlens``) are derived from the position ids once, and both kinds of token mixers
use them: full attention gets a block-diagonal causal mask (the local spec's attention takes an explicit
mask), Gated DeltaNet layers get ``cu_seqlens`` so no recurrent or convolution state crosses a boundary.
RoPE depends only on the distance between a query and a key, so within one sequence it is unchanged by
where the sequence sits in the row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model_support.core.megatron.context_parallel import split_batch, whole_sequence


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


def _prepare(
    input_ids: torch.Tensor, position_ids: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(input ids, position ids, attention mask, cu_seqlens) of plain rows or one packed row, on ``device``."""
    input_ids = input_ids.to(device)
    batch, total = input_ids.shape
    if position_ids is None:
        return input_ids, torch.arange(total, device=device).expand(batch, total), None, None
    if batch != 1:
        raise ValueError(f"a packed row has batch size 1, got {batch}")
    position_ids = position_ids.to(device)
    cu_seqlens = cu_seqlens_from_position_ids(position_ids[0])
    return input_ids, position_ids, packed_causal_mask(cu_seqlens, total), cu_seqlens


def _full_vocab(out: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Vocabulary-parallel logits -> the full vocabulary (padding dropped), fp32."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        out = _GatherVocab.apply(out, parallel_state.get_tensor_model_parallel_group())
    vocab = getattr(model.config, "vocab_size", None) or out.shape[-1]
    return out[..., :vocab].float()


def logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, V] fp32 logits on the model's device (full vocabulary on every tensor-parallel rank), for a model
    that is whole on this rank up to tensor, sequence and expert parallelism (see :func:`forward_backward` for
    pipeline and context parallelism).

    ``position_ids`` given: ``input_ids`` is one packed row ([1, S]) and sequences restart at position 0.
    """
    device = next(model.parameters()).device
    input_ids, position_ids, mask, cu_seqlens = _prepare(input_ids, position_ids, device)
    with gdn_packing(model, cu_seqlens):
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
    return _full_vocab(out, model)


@dataclass(frozen=True)
class MicroBatch:
    """What a loss function gets with its logits: the micro-batch's rows of the step's batch."""

    input_ids: torch.Tensor  # [b, S], the whole sequence whatever the context parallelism
    position_ids: torch.Tensor | None
    rows: slice  # which rows of the step's batch


@dataclass
class StepOutput:
    """:func:`forward_backward`'s result on every rank: the mean loss over micro-batches, and the logits when
    asked for ([B, S, V] fp32, full vocabulary and sequence)."""

    loss: torch.Tensor
    logits: torch.Tensor | None


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, MicroBatch], torch.Tensor],
    *,
    position_ids: torch.Tensor | None = None,
    micro_batches: int = 1,
    forward_only: bool = False,
    keep_logits: bool = False,
) -> StepOutput:
    """One forward (and backward) of a batch through megatron-core's own schedule for the layout: no pipelining,
    1F1B, or interleaved 1F1B over the rank's virtual stages.

    ``input_ids`` [B, S] is split into ``micro_batches`` along the batch (a packed row: B = 1 with its
    ``position_ids``). On the last pipeline stage ``loss_fn(logits, micro_batch)`` gets each micro-batch's [b, S, V]
    fp32 logits (full vocabulary, whole sequence) and returns its scalar loss; the gradients are those of the mean
    over micro-batches. A rank's gradient covers the tokens it ran: sum it over context-parallel ranks and average
    it over data-parallel replicas (:func:`model_support.core.megatron.lora.reduce_lora_grads`). Every rank takes
    part and gets the :class:`StepOutput`.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from model_support.core.megatron.builder import on_cpu_device

    chunks = list(chunks)
    batch, seq = input_ids.shape
    if batch % micro_batches:
        raise ValueError(f"a batch of {batch} rows does not split into {micro_batches} micro-batches")
    cp = parallel_state.get_context_parallel_world_size()
    if position_ids is not None and cp > 1:
        raise ValueError("packed rows under context parallelism need THD attention, which the local spec lacks")
    if seq % (2 * cp):
        raise ValueError(f"context parallel {cp} splits sequences into {2 * cp} chunks: {seq} tokens do not")
    size = batch // micro_batches
    device = next(chunks[0].parameters()).device
    batches = [
        MicroBatch(
            input_ids[i * size : (i + 1) * size],
            None if position_ids is None else position_ids[i * size : (i + 1) * size],
            slice(i * size, (i + 1) * size),
        )
        for i in range(micro_batches)
    ]
    kept: list[torch.Tensor] = []

    def step(data: Iterator[MicroBatch], model: torch.nn.Module):
        micro = next(data)
        ids, positions, mask, cu_seqlens = _prepare(micro.input_ids, micro.position_ids, device)
        with gdn_packing(model, cu_seqlens):
            out = model(input_ids=split_batch(ids), position_ids=split_batch(positions), attention_mask=mask)

        def loss(output: torch.Tensor):
            full = whole_sequence(_full_vocab(output, model))
            if keep_logits:
                kept.append(full.detach())
            value = loss_fn(full, micro)
            # (loss, tokens, logged): megatron-core divides by the tokens (1: the loss is already a mean) and the
            # micro-batches, and scales nothing by context parallelism.
            return value, torch.ones((), dtype=torch.int, device=value.device), {"loss": value.detach()}

        return out, loss

    # The interleaved schedule takes one iterator per chunk, each yielding every micro-batch.
    data = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
    with on_cpu_device(device):
        losses = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=micro_batches,
            seq_length=seq,  # the schedule divides by context (and sequence) parallelism itself
            micro_batch_size=size,
            forward_only=forward_only,
        )
    last = parallel_state.is_pipeline_last_stage()
    loss = torch.stack([item["loss"] for item in losses]).mean() if last else torch.zeros((), device=device)
    out = torch.cat(kept) if last and keep_logits else None
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(loss, src=src, group=group)
        if keep_logits:
            vocab = chunks[-1].config.vocab_size
            out = out if last else torch.empty(batch, seq, vocab, device=device)
            dist.broadcast(out, src=src, group=group)
    return StepOutput(loss, out)
