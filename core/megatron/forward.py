"""Running a built megatron-core model: logits for plain and packed rows, and a training step in any layout.

A training step hands its loss function either the full-vocabulary logits or, computed vocabulary-parallel, each
token's log-probability and entropy (:class:`TokenScores`), and normalises the loss per micro-batch or over the
step's loss tokens on every data-parallel replica.

A packed row holds several sequences back to back, each with position ids restarting at 0, and may hold
shared-prefix groups (a prompt followed by completions whose position ids continue it). The row's layout
(:class:`~model_support.core.megatron.rows.RowLayout`) is derived from the position ids once, and every token
mixer uses it: attention block by block (no [S, S] mask), Gated DeltaNet layers with ``cu_seqlens`` (no recurrent
or convolution state crosses a sequence boundary; a prompt's state is computed once for its completions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from model_support.core.megatron.context_parallel import split_batch, whole_sequence
from model_support.core.megatron.rows import RowLayout


def _attention_cores(model: torch.nn.Module) -> list[torch.nn.Module]:
    from model_support.core.megatron.spec import SDPAttention

    return [m for m in model.modules() if isinstance(m, SDPAttention)]


def _gdn_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from model_support.core.megatron.gdn import GDN_MODULES

    return [m for m in model.modules() if isinstance(m, GDN_MODULES)]


def _rotary_at(module: torch.nn.Module, positions: torch.Tensor, length: int) -> Callable[..., object]:
    """A rotary embedding's forward that gives each token the embedding of its true position (``length``: one
    past the largest)."""
    computed = module.forward

    def at_positions(emb: torch.Tensor) -> torch.Tensor:
        # [S, 1, 1, D], or a stack of them ([N, S, 1, 1, D]: Gemma 3's local and global embeddings)
        return emb.index_select(emb.dim() - 4, positions)

    def forward(_max_seq_len: int, *args: object, **kwargs: object) -> object:
        out = computed(length, *args, **kwargs)
        # multi-latent attention's yarn embedding also returns its mscale
        return (at_positions(out[0]), *out[1:]) if isinstance(out, tuple) else at_positions(out)

    return forward


class RowState:
    """What a packed row's layout sets on a model: each attention and Gated DeltaNet layer's ``rows``, and for a
    row with shared prefixes each rotary embedding's forward at the tokens' true positions (a completion's continue
    its prompt's; a plain packed row needs none: within a sequence only distances matter)."""

    def __init__(self, model: torch.nn.Module, rows: RowLayout | None) -> None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.rows = rows
        self.layers = [*_attention_cores(model), *_gdn_layers(model)]
        rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        # Only the outermost: an embedding built from others (Gemma 3's) calls their forward itself.
        inner = {id(child) for m in rotary for child in m.modules() if child is not m}
        self.rotary = [m for m in rotary if id(m) not in inner]
        self._device = next(model.parameters()).device

    def enter(self) -> None:
        self.leave()
        for layer in self.layers:
            layer.rows = self.rows
        if self.rows is not None and self.rows.shared:
            positions = self.rows.positions_on(self._device)
            for module in self.rotary:
                module.forward = _rotary_at(module, positions, int(self.rows.positions.max()) + 1)

    def leave(self) -> None:
        for layer in self.layers:
            layer.rows = None
        for module in self.rotary:
            module.__dict__.pop("forward", None)  # back to the class's forward

    def again_in_backward(self, out: torch.Tensor) -> None:
        """Set the layout again when the backward reaches ``out``: megatron-core's activation recompute runs each
        layer's forward once more inside the backward, after the forward's :func:`packed_rows` has closed. It stays
        set after: the next forward sets its own, and :func:`forward_backward` clears it when the step ends."""
        if self.rows is not None and out.requires_grad:
            out.register_hook(lambda grad: self.enter())


@contextmanager
def packed_rows(model: torch.nn.Module, rows: RowLayout | None) -> Iterator[RowState]:
    """Let ``model``'s token mixers (and, for shared prefixes, its rotary embeddings) see the row's layout during a
    forward (:class:`RowState`)."""
    state = RowState(model, rows)
    state.enter()
    try:
        yield state
    finally:
        state.leave()


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


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelScores(torch.autograd.Function):
    """Each position's log-probability of its label and the entropy of its distribution, from vocabulary-parallel
    logits: this rank holds the contiguous columns ``[rank * W, (rank + 1) * W)`` of the (padded) vocabulary, and only
    per-position values cross ranks (all-reduced over ``group``: the max, the sum of exponentials, the probability-
    weighted logit and the label's logit, which its owner contributes). Backward recomputes this rank's probabilities
    from the saved logits, so nothing vocabulary-sized is kept but them. Hand-written: megatron-core's
    ``vocab_parallel_cross_entropy`` gives no entropy and overwrites fp32 logits in place.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, labels: torch.Tensor, vocab: int, group) -> tuple[torch.Tensor, torch.Tensor]:
        start = (0 if group is None else group.rank()) * local.shape[-1]
        width = min(local.shape[-1], vocab - start)  # columns past the vocabulary are padding
        logits = local[..., :width].float()
        peak = logits.amax(-1)
        _all_reduce(peak, dist.ReduceOp.MAX, group)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        owned = (labels >= start) & (labels < start + width)
        index = torch.where(owned, labels - start, 0).unsqueeze(-1)
        label_logit = torch.where(owned, shifted.gather(-1, index).squeeze(-1), 0.0)
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1), label_logit])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        total, weighted, label_logit = sums
        mean = weighted / total  # E_p[logit - peak]
        ctx.start, ctx.width = start, width
        ctx.save_for_backward(local, labels, peak, total, mean)
        return label_logit - total.log(), total.log() - mean

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        local, labels, peak, total, mean = ctx.saved_tensors
        shifted = local[..., : ctx.width].float() - peak.unsqueeze(-1)
        probs = shifted.exp().div_(total.unsqueeze(-1))
        # d logp / dz = onehot(label) - p;  d entropy / dz = -p (z - E_p[z])
        grad = probs.mul_(-(grad_logprobs.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (shifted - mean.unsqueeze(-1))))
        owned = (labels >= ctx.start) & (labels < ctx.start + ctx.width)
        index = torch.where(owned, labels - ctx.start, 0).unsqueeze(-1)
        grad.scatter_add_(-1, index, torch.where(owned, grad_logprobs, 0.0).unsqueeze(-1))
        grad = torch.nn.functional.pad(grad, (0, local.shape[-1] - ctx.width))  # padding columns get none
        return grad.to(local.dtype), None, None, None


def _prepare(
    input_ids: torch.Tensor, position_ids: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, RowLayout | None]:
    """(input ids, position ids, row layout) of plain rows or one packed row, on ``device``."""
    input_ids = input_ids.to(device)
    batch, total = input_ids.shape
    if position_ids is None:
        return input_ids, torch.arange(total, device=device).expand(batch, total), None
    if batch != 1:
        raise ValueError(f"a packed row has batch size 1, got {batch}")
    return input_ids, position_ids.to(device), RowLayout.from_position_ids(position_ids)


def _full_vocab(out: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Vocabulary-parallel logits -> the full vocabulary (padding dropped), fp32."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        out = _GatherVocab.apply(out, parallel_state.get_tensor_model_parallel_group())
    vocab = getattr(model.config, "vocab_size", None) or out.shape[-1]
    return out[..., :vocab].float()


def _token_scores(out: torch.Tensor, input_ids: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """[b, S - 1, 2] fp32 (log-probability of the next token, entropy) at every position of the micro-batch's whole
    sequence, from this rank's vocabulary-parallel logits of its part of the sequence ([b, S / cp, V / tp]): the
    values are computed on the part and the parts gathered ([b, S] values, never [b, S, V] logits)."""
    from megatron.core import parallel_state

    # Position t's label is the token at t + 1; the last position's (a placeholder) is dropped once gathered.
    labels = split_batch(torch.nn.functional.pad(input_ids[:, 1:], (0, 1)))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    vocab = getattr(model.config, "vocab_size", None) or out.shape[-1] * tp
    # Every rank checks this alike and raises: a rank raising alone would leave the others in the all-reduce.
    if vocab <= (tp - 1) * out.shape[-1]:
        raise ValueError(
            f"the last tensor-parallel rank holds only vocabulary padding (vocabulary {vocab}, {out.shape[-1]} "
            "columns a rank): use loss_inputs='logits', or fewer tensor-parallel ranks"
        )
    logprobs, entropy = _VocabParallelScores.apply(out, labels, vocab, group)
    return whole_sequence(torch.stack([logprobs, entropy], dim=-1))[:, :-1]


def logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, V] fp32 logits on the model's device (full vocabulary on every tensor-parallel rank), for a model
    that is whole on this rank up to tensor, sequence and expert parallelism (see :func:`forward_backward` for
    pipeline and context parallelism).

    ``position_ids`` given: ``input_ids`` is one packed row ([1, S]): sequences restart at position 0, and a run
    continuing a prompt's positions is a completion sharing that prompt (:mod:`.rows`).
    """
    device = next(model.parameters()).device
    input_ids, position_ids, rows = _prepare(input_ids, position_ids, device)
    with packed_rows(model, rows) as layout:
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
    layout.again_in_backward(out)
    return _full_vocab(out, model)


@dataclass(frozen=True)
class MicroBatch:
    """What a loss function gets with its logits (or :class:`TokenScores`): the micro-batch's rows of the step's
    batch."""

    input_ids: torch.Tensor  # [b, S], the whole sequence whatever the context parallelism
    position_ids: torch.Tensor | None
    rows: slice  # which rows of the step's batch
    # [b, S - 1] bool, entry t: whether position t's prediction (of input_ids[:, t + 1]) is a loss token; the step's
    # loss_mask rows (all True under normalize="global_tokens" without one), else None
    loss_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenScores:
    """What ``loss_fn`` gets instead of logits with ``loss_inputs="logprobs"``: [b, S - 1] fp32 per-position values
    of the micro-batch's whole sequence, computed vocabulary-parallel (no rank holds the full vocabulary).

    Entry ``t`` is the prediction made at position ``t``: ``logprobs[:, t] = log p(input_ids[:, t + 1] | what
    position t sees)`` and ``entropy[:, t]`` the entropy of that whole distribution (padding columns of the vocabulary
    excluded). In a packed row position t sees its own sequence only, so where ``t + 1`` starts another sequence
    (its position id is 0) or another completion of a shared prompt, the entry scores a token its position does not
    predict: mask it.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor

    @classmethod
    def of(cls, stacked: torch.Tensor) -> TokenScores:
        """From [..., 2] (log-prob, entropy)."""
        return cls(stacked[..., 0], stacked[..., 1])


@dataclass
class StepOutput:
    """:func:`forward_backward`'s result on every rank: the step's loss, and what ``loss_fn`` got when asked for
    (``keep_logits``): ``logits`` [B, S, V] fp32 (full vocabulary and sequence), or with ``loss_inputs="logprobs"``
    ``scores`` [B, S - 1]."""

    loss: torch.Tensor
    logits: torch.Tensor | None
    scores: TokenScores | None = None


LossInputs = Literal["logits", "logprobs"]
Normalize = Literal["micro_batch", "global_tokens"]


def _global_tokens(loss_mask: torch.Tensor, device: torch.device) -> int:
    """The loss tokens of ``loss_mask`` summed over the data-parallel replicas (at least 1)."""
    from megatron.core import parallel_state

    count = loss_mask.sum().to(device=device, dtype=torch.int64)
    dist.all_reduce(count, group=parallel_state.get_data_parallel_group())
    return max(int(count), 1)


def _masked_sum(per_token: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """The sum of ``loss_fn``'s per-token loss over the micro-batch's loss tokens."""
    expected = (micro.input_ids.shape[0], micro.input_ids.shape[1] - 1)
    if tuple(per_token.shape) != expected:
        raise ValueError(
            f"with normalize='global_tokens' loss_fn returns the per-token loss [b, S - 1] = {list(expected)}, "
            f"got {list(per_token.shape)}: return one value per predicted position, unreduced"
        )
    return torch.where(micro.loss_mask.to(per_token.device), per_token, 0.0).sum()


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    loss_fn: Callable[[torch.Tensor | TokenScores, MicroBatch], torch.Tensor],
    *,
    position_ids: torch.Tensor | None = None,
    micro_batches: int = 1,
    forward_only: bool = False,
    keep_logits: bool = False,
    loss_inputs: LossInputs = "logits",
    normalize: Normalize = "micro_batch",
    loss_mask: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
) -> StepOutput:
    """One forward (and backward) of a batch through megatron-core's own schedule for the layout: no pipelining,
    1F1B, or interleaved 1F1B over the rank's virtual stages.

    ``input_ids`` [B, S] is split into ``micro_batches`` along the batch (a packed row: B = 1 with its
    ``position_ids``, shared prefixes included). On the last pipeline stage ``loss_fn(inputs, micro_batch)`` gets
    each micro-batch's

    * ``loss_inputs="logits"``: [b, S, V] fp32 logits (full vocabulary, whole sequence: gathered over tensor- and
      context-parallel ranks);
    * ``loss_inputs="logprobs"``: :class:`TokenScores`, each position's log-probability of the next token and
      entropy ([b, S - 1]), computed on each tensor-parallel rank's slice of the vocabulary with per-position
      all-reduces; only those values are gathered over context-parallel ranks.

    ``normalize="micro_batch"``: ``loss_fn`` returns the micro-batch's scalar loss, and the gradients are those of the
    mean over micro-batches. ``normalize="global_tokens"``: ``loss_fn`` returns its per-token loss [b, S - 1] (entry
    t: position t's, predicting ``input_ids[:, t + 1]``) and the step's loss is the sum over the loss tokens of every
    micro-batch and data-parallel replica divided by their number: ``loss_mask`` [B, S - 1] (bool; default all True)
    marks them, and its count is all-reduced over the data-parallel group. ``StepOutput.loss`` is then that global
    token mean on every rank, and the gradient after :func:`~model_support.core.megatron.lora.reduce_lora_grads`
    (which averages over replicas) is its gradient. Either way ``micro_batch.loss_mask`` holds the micro-batch's
    mask rows.

    ``routed_experts`` [B, S, L, k] (an MoE model): every decoder layer's router takes these experts for each token
    instead of its own top-k, as the server that sampled the batch routed it (:mod:`.routing`, vLLM's format).

    A rank's gradient covers the tokens it ran: sum it over context-parallel ranks and average it over data-parallel
    replicas (:func:`model_support.core.megatron.lora.reduce_lora_grads`). Every rank takes part and gets the
    :class:`StepOutput` (with ``keep_logits``, what ``loss_fn`` got, of the whole batch).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from model_support.core.megatron.builder import on_cpu_device
    from model_support.core.megatron.routing import check_experts, replayed

    chunks = list(chunks)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids is an integer tensor [B, S], got {got}")
    batch, seq = input_ids.shape
    if batch < 1 or seq < 2:
        raise ValueError(f"input_ids [{batch}, {seq}]: a step needs a row and two tokens (one to predict)")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches is a count of micro-batches (1 or more), got {micro_batches!r}")
    if position_ids is not None and tuple(position_ids.shape) != (batch, seq):
        raise ValueError(f"position_ids is [B, S] = [{batch}, {seq}] like input_ids, got {list(position_ids.shape)}")
    if batch % micro_batches:
        raise ValueError(f"a batch of {batch} rows does not split into {micro_batches} micro-batches")
    if loss_inputs not in ("logits", "logprobs"):
        raise ValueError(f"loss_inputs is 'logits' or 'logprobs', not {loss_inputs!r}")
    if normalize not in ("micro_batch", "global_tokens"):
        raise ValueError(f"normalize is 'micro_batch' or 'global_tokens', not {normalize!r}")
    if loss_mask is not None and tuple(loss_mask.shape) != (batch, seq - 1):
        raise ValueError(
            f"loss_mask is [B, S - 1] = [{batch}, {seq - 1}] (entry t: whether input_ids[:, t + 1] is a loss "
            f"token), got {list(loss_mask.shape)}"
        )
    cp = parallel_state.get_context_parallel_world_size()
    if position_ids is not None and cp > 1:
        raise ValueError("packed rows under context parallelism need THD attention, which the local spec lacks")
    if cp > 1 and seq % (2 * cp):
        raise ValueError(f"context parallel {cp} splits sequences into {2 * cp} chunks: {seq} tokens do not")
    if routed_experts is not None:
        check_experts(chunks, routed_experts, (batch, seq), backward=not forward_only or torch.is_grad_enabled())
    size = batch // micro_batches
    device = next(chunks[0].parameters()).device
    if normalize == "global_tokens" and loss_mask is None:
        loss_mask = torch.ones(batch, seq - 1, dtype=torch.bool)
    mask = None if loss_mask is None else loss_mask.bool()
    tokens = _global_tokens(mask, device) if normalize == "global_tokens" else 1
    # megatron-core divides each micro-batch's loss by the micro-batches, reduce_lora_grads the gradient by the
    # data-parallel replicas: a global token mean's micro-batch loss is its sum / tokens with both undone.
    token_scale = micro_batches * parallel_state.get_data_parallel_world_size() / tokens
    batches = [
        MicroBatch(
            input_ids[i * size : (i + 1) * size],
            None if position_ids is None else position_ids[i * size : (i + 1) * size],
            slice(i * size, (i + 1) * size),
            None if mask is None else mask[i * size : (i + 1) * size],
        )
        for i in range(micro_batches)
    ]
    kept: list[torch.Tensor] = []

    def step(data: Iterator[MicroBatch], model: torch.nn.Module):
        micro = next(data)
        ids, positions, rows = _prepare(micro.input_ids, micro.position_ids, device)
        replay = nullcontext() if routed_experts is None else replayed(model, routed_experts[micro.rows])
        with packed_rows(model, rows) as layout, replay:
            out = model(input_ids=split_batch(ids), position_ids=split_batch(positions), attention_mask=None)
        layout.again_in_backward(out)

        def loss(output: torch.Tensor):
            if loss_inputs == "logits":
                given = whole_sequence(_full_vocab(output, model))
            else:
                given = _token_scores(output, ids, model)
            if keep_logits:
                kept.append(given.detach())
            value = loss_fn(given if loss_inputs == "logits" else TokenScores.of(given), micro)
            if normalize == "global_tokens":
                value = _masked_sum(value, micro)
                logged, value = value.detach(), value * token_scale
            else:
                logged = value.detach()
            # (loss, tokens, logged): megatron-core divides by the tokens (1: scaled above) and the micro-batches,
            # and scales nothing by context parallelism.
            return value, torch.ones((), dtype=torch.int, device=value.device), {"loss": logged}

        return out, loss

    # The interleaved schedule takes one iterator per chunk, each yielding every micro-batch.
    data = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
    try:
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
    finally:
        for chunk in chunks:  # the layouts the backward set again
            RowState(chunk, None).leave()
    last = parallel_state.is_pipeline_last_stage()
    loss = torch.stack([item["loss"] for item in losses]) if last else torch.zeros(1, device=device)
    if normalize == "global_tokens":
        # Every replica's loss-token sum (first stages add zeros: a data-parallel group is one pipeline stage's).
        loss = loss.sum()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss = loss / tokens
    else:
        loss = loss.mean()
    out = torch.cat(kept) if last and keep_logits else None
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(loss, src=src, group=group)
        if keep_logits:
            width = (seq, chunks[-1].config.vocab_size) if loss_inputs == "logits" else (seq - 1, 2)
            out = out if last else torch.empty(batch, *width, device=device)
            dist.broadcast(out, src=src, group=group)
    if loss_inputs == "logprobs":
        return StepOutput(loss, None, None if out is None else TokenScores.of(out))
    return StepOutput(loss, out)


def scored_logits(
    chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, S, V] fp32 logits of ``input_ids`` (plain rows, or one packed row with its ``position_ids``) on every rank,
    in any layout: one forward through :func:`forward_backward`'s schedule, so pipeline stages pass their activations
    and context-parallel ranks their parts of the sequence.

    Differentiable without pipeline parallelism (under context parallelism a rank's gradient covers the tokens it
    ran, as in :func:`forward_backward`). Under pipeline parallelism the last stage's logits are broadcast to every
    stage, detached: no stage can backpropagate through the others outside the schedule (train through
    :func:`forward_backward`'s ``loss_fn``). Rows are padded at the end to a length the layout splits evenly (sequence
    parallel: a multiple of the tensor-parallel size; context parallel: of 2 x cp); a packed row's padding is a
    sequence of its own, so no scored token sees it. ``routed_experts``: as :func:`forward_backward` takes them.
    """
    from megatron.core import parallel_state

    from model_support.core.megatron.routing import padded

    chunks = list(chunks)
    batch, length = input_ids.shape
    cp = parallel_state.get_context_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    multiple = (tp if chunks[0].config.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
    pad = -length % multiple
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        if position_ids is not None:
            position_ids = torch.cat([position_ids, torch.arange(pad).expand(batch, pad)], dim=1)
        if routed_experts is not None:
            routed_experts = padded(routed_experts, pad, dim=1)
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    # The interleaved schedule needs at least as many micro-batches as pipeline stages: the batch runs that often.
    repeats = pipeline if len(chunks) > 1 else 1
    if repeats > 1:
        input_ids = input_ids.repeat(repeats, 1)
        position_ids = None if position_ids is None else position_ids.repeat(repeats, 1)
        routed_experts = None if routed_experts is None else routed_experts.repeat(repeats, 1, 1, 1)
    captured: list[torch.Tensor] = []

    def keep(out: torch.Tensor, _micro: MicroBatch) -> torch.Tensor:
        captured.append(out)
        return out.new_zeros(())

    step = forward_backward(
        chunks,
        input_ids,
        keep,
        position_ids=position_ids,
        micro_batches=repeats,
        forward_only=True,
        keep_logits=pipeline > 1,
        routed_experts=routed_experts,
    )
    out = captured[0] if pipeline == 1 else step.logits[:batch]
    return out[:, :length]
