"""Routing replay for a trainer (R3): each MoE router takes the experts a server chose for each token, and the
experts the trainer itself chooses, in one format for both.

The format is vLLM's ``routed_experts``: ``[B, S, L, k]`` integer expert ids, a batch's token ``(b, s)`` at decoder
layer ``l`` (``L``: the model's decoder layers, all of them; a dense layer's entries are not read, and come back as
-1) routed to its ``k`` experts. megatron-core's ``RouterReplay`` (the model is built with
``moe_enable_routing_replay``) does the replaying; what this module adds is which of those tokens each rank's router
sees: its context-parallel part of the sequence (:mod:`.context_parallel`), in megatron-core's sequence-major
order, and under sequence parallelism its tensor-parallel rank's slice of that; each pipeline stage's routers
their own layers (``layer_number``, 1-based over the whole model). Multi-token-prediction routers are left to route
themselves (no trainer samples through them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from model_support.core.megatron.context_parallel import split_batch, whole_sequence


def decoder_routers(chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """The MoE routers of the decoder layers on this rank (every chunk), each with its ``RouterReplay``."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for chunk in chunks:
        layers = chunk.config.num_layers
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and module.layer_number is not None and module.layer_number <= layers:
                if module.router_replay is None:
                    raise ValueError("the model was built without moe_enable_routing_replay: it cannot replay routing")
                found.append(module)
    return found


def check_experts(
    chunks: Sequence[torch.nn.Module], experts: torch.Tensor, tokens: tuple[int, int], backward: bool
) -> None:
    """``experts`` must be ``[B, S, L, k]`` for ``tokens = (B, S)``, with the model's L and k, ids of its experts;
    where a ``backward`` may follow, a model recomputing its layers there would replay the wrong micro-batch's
    experts in the recomputed forward."""
    config = chunks[0].config
    if not config.num_moe_experts:
        raise ValueError("routed experts are given, but the model has no MoE layer")
    shape = (*tokens, config.num_layers, config.moe_router_topk)
    if tuple(experts.shape) != shape:
        raise ValueError(
            f"routed experts are [B, S, layers, top-k] = {list(shape)} for this batch and model, got "
            f"{list(experts.shape)}"
        )
    if experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise ValueError(f"routed experts are integer expert ids, got {experts.dtype}")
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern

    routed = experts[:, :, torch.tensor(get_moe_layer_pattern(config), dtype=torch.bool)]
    if routed.numel() and (routed.min() < 0 or routed.max() >= config.num_moe_experts):
        raise ValueError(
            f"routed experts are ids of the model's {config.num_moe_experts} experts at its MoE layers, got ids from "
            f"{routed.min().item()} to {routed.max().item()}"
        )
    if backward and config.recompute_granularity is not None:
        raise ValueError(
            "routing replay with activation recompute replays only a forward no backward recomputes (forward_only "
            "under torch.no_grad): build the model without recompute to train on replayed routing"
        )


def padded(experts: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """``experts`` with ``count`` padding tokens appended along ``dim``, routed to experts 0 ... k - 1 (the padding of
    a row a layout splits evenly, which no scored token sees)."""
    shape = list(experts.shape)
    shape[dim] = count
    return torch.cat([experts, torch.arange(shape[-1]).to(experts).expand(shape)], dim=dim)


def _local(experts: torch.Tensor, layer_number: int, sequence_parallel: bool) -> torch.Tensor:
    """A micro-batch's ``[b, S, L, k]`` -> the ``[tokens, k]`` the router of ``layer_number`` sees on this rank."""
    from megatron.core import parallel_state

    rows = split_batch(experts[:, :, layer_number - 1])  # [b, S / cp, k]
    rows = rows.transpose(0, 1)  # megatron-core's sequence-major order: [S / cp, b, k]
    if sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rows = rows.chunk(tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
    return rows.reshape(-1, rows.shape[-1]).long()


@contextmanager
def replaying(targets: Sequence[tuple[Any, torch.Tensor]]) -> Iterator[None]:
    """Inside, each ``(router, [tokens, k] experts)`` router takes those experts instead of its own top-k."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router, target in targets:
        router.router_replay.set_target_indices(target.to(router.weight.device))
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router, _ in targets:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


@contextmanager
def recording(routers: Sequence[Any]) -> Iterator[list[list[torch.Tensor]]]:
    """Record each router's top-k, one list per router with one ``[tokens, k]`` entry per forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    records: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = []
    for router, store in zip(routers, records, strict=True):
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        hooks.append(
            router.register_forward_hook(lambda m, _a, _o, s=store: s.append(m.router_replay.recorded_topk_idx))
        )
    try:
        yield records
    finally:
        for router, hook in zip(routers, hooks, strict=True):
            hook.remove()
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def replayed(chunk: torch.nn.Module, experts: torch.Tensor) -> AbstractContextManager[None]:
    """Inside, every decoder router of ``chunk`` takes its tokens' experts from ``experts`` ([b, S, L, k] of the
    micro-batch the chunk runs) instead of its own top-k."""
    sp = chunk.config.sequence_parallel
    return replaying([(r, _local(experts, r.layer_number, sp)) for r in decoder_routers([chunk])])


@contextmanager
def recorded(chunks: Sequence[torch.nn.Module]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Record each decoder router's top-k (``{layer_number: [one [tokens, k] a forward]}``) of this rank."""
    ours = decoder_routers(chunks)
    with recording(ours) as records:
        yield {router.layer_number: calls for router, calls in zip(ours, records, strict=True)}


def assemble(
    chunks: Sequence[torch.nn.Module], records: dict[int, list[torch.Tensor]], batch: int, length: int
) -> torch.Tensor:
    """The first forward's records of every rank -> ``[batch, length, L, k]`` on every rank (-1 at dense layers):
    sequence-parallel slices gathered over the tensor-parallel group, context-parallel parts put back in order,
    each pipeline stage's layers shared with the others. Every rank calls it."""
    from megatron.core import parallel_state

    config = chunks[0].config
    device = next(chunks[0].parameters()).device
    out = torch.full((batch, length, config.num_layers, config.moe_router_topk), -1, dtype=torch.long, device=device)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for layer_number, calls in records.items():
        local = calls[0].long()
        if config.sequence_parallel and tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            local = torch.cat(parts)
        rows = local.reshape(-1, batch, local.shape[-1]).transpose(0, 1)  # [b, S / cp, k]
        out[:, :, layer_number - 1] = whole_sequence(rows.contiguous())[:, :length]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group())
    return out
