"""Token rows through the Megatron model under test, alone and packed into one row, for the packing stages
(``packed_position_ids``, ``shared_prefix``): logits, summed loss and LoRA gradients of each way, MoE routers
replaying one given routing in both so that a near tie cannot flip between them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# A run's loss from its [S, V] logits; for runs alone, also given the index of the row.
RowLoss = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class RowRun:
    """Logits ([S, V] per row), the summed loss and every trainable parameter's gradient of one way of running."""

    logits: list[torch.Tensor]
    loss: float
    grads: dict[str, torch.Tensor]


def routing_alone(model: torch.nn.Module, rows: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each MoE router's top-k indices for each of ``rows`` ([1, S] token ids) run alone, forward only:
    ``[router][row]`` ([S, k] each; empty for a model without MoE)."""
    from model_support.core.megatron.compare import recorded_routing, routers
    from model_support.core.megatron.forward import logits

    if not routers(model):
        return []
    with recorded_routing(model) as routing, torch.no_grad():
        for tokens in rows:
            logits(model, tokens)
    return routing


@contextmanager
def routing_of(model: torch.nn.Module, tokens: torch.Tensor) -> Iterator[None]:
    """Inside the block every forward of ``tokens`` ([1, S]) through ``model`` routes as one forward of it did just
    before: two runs compared for what a mode or an adapter changes, not for a near tie that a GPU's unrepeatable
    MoE sums flip (no effect on a model without MoE)."""
    from model_support.core.megatron.compare import replayed_routing

    with replayed_routing(model, [calls[0] for calls in routing_alone(model, [tokens])], batch=1):
        yield


def run_alone(
    model: torch.nn.Module, rows: Sequence[torch.Tensor], loss_of: RowLoss, routing: Sequence[Sequence[torch.Tensor]]
) -> RowRun:
    """Each row alone, forward and backward of its loss in training mode, the gradients summed;
    ``routing[router][row]`` replayed."""
    from model_support.core.megatron.compare import replayed_routing
    from model_support.core.megatron.forward import logits
    from model_support.validation.megatron_session import training_mode

    model.zero_grad(set_to_none=True)
    outs, total = [], 0.0
    for i, tokens in enumerate(rows):
        with replayed_routing(model, [calls[i] for calls in routing], batch=1), training_mode(model):
            out = logits(model, tokens)[0]
            loss = loss_of(out, i)
            loss.backward()
        total += loss.item()
        outs.append(out.detach())
    return RowRun(outs, total, _take_grads(model))


def run_packed(
    model: torch.nn.Module,
    row: torch.Tensor,
    position_ids: torch.Tensor,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    routing: Sequence[torch.Tensor],
    control_position_ids: torch.Tensor | None = None,
) -> tuple[RowRun, torch.Tensor]:
    """The packed ``row`` with its ``position_ids``, forward and backward of its loss, each router replaying its
    ``routing``; and, under the same routing and without gradients, the control: the row's logits with
    ``control_position_ids`` (default: one sequence, no packing)."""
    from model_support.core.megatron.compare import replayed_routing
    from model_support.core.megatron.forward import logits
    from model_support.validation.megatron_session import training_mode

    model.zero_grad(set_to_none=True)
    with replayed_routing(model, routing, batch=1):
        with training_mode(model):
            out = logits(model, row, position_ids)[0]
            loss = loss_of(out)
            loss.backward()
        run = RowRun([out.detach()], loss.item(), _take_grads(model))
        with torch.no_grad():
            control = logits(model, row, control_position_ids)[0]
    return run, control


def _take_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient: the LoRA factors' as the whole model's (:func:`lora_state`: shards
    gathered, each data-parallel replica having run the same rows), any other by this rank's name."""
    from model_support.core.megatron.lora import lora_state, reduce_lora_grads

    reduce_lora_grads(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n}
    grads |= lora_state(model, grads=True)
    model.zero_grad(set_to_none=True)
    return grads
