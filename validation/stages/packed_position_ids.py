"""Stage `packed_position_ids`: a packed row computes what its sequences compute alone, in Megatron."""

from __future__ import annotations

import itertools

import torch

# Re-exported so the stage reference (docs/stages.md) lists the tolerances this stage applies.
from model_support.core.megatron.compare import LOWP_TOLERANCE_FACTOR, SAME_MODEL_FP32_TOLERANCES
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import LORA, REFERENCE_LOWP_ERROR, TRAINING_MODEL
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.stages.lora_gradients import REFERENCE_LOWP_GRAD_ERROR

__all__ = ["LOWP_TOLERANCE_FACTOR", "SAME_MODEL_FP32_TOLERANCES", "PackedPositionIdsStage"]


class PackedPositionIdsStage(Stage):
    """Several sequences packed in one row (one of them a long row across every length-dependent structure of the
    model, as in ``hf_parity``), position ids restarting at 0, run through the Megatron model (with LoRA, so
    gradients flow): per-token logits must equal those of each sequence run alone, and the LoRA gradients of the
    packed loss must equal the sum of the per-sequence gradients. Both full attention (block-diagonal mask) and
    Gated DeltaNet layers (``cu_seqlens``: recurrent state and convolution restart at each boundary) derive the
    boundaries from the position ids. In fp32 the tolerances are fixed; below fp32 they are a multiple of
    transformers' own rounding distance from fp32 on this model: the logits' (measured by ``hf_parity``) for the
    logits, the LoRA gradients' (measured by ``lora_gradients``) for the gradients. MoE routers replay, in the
    packed row, the routing the sequences took alone (so a near tie cannot flip between the two runs). As a control,
    the same row run as one sequence must differ by at least the dtype's effect floor (``leak_control_rel_l2``),
    showing the comparison can see state crossing a boundary.
    """

    name = "packed_position_ids"
    title = "Packed rows (position ids restarting at 0) give the same logits and gradients as separate runs."
    order = 50
    sharded = True
    requires = ("hf_parity",)
    needs = (TRAINING_MODEL, LORA, REFERENCE_LOWP_ERROR, REFERENCE_LOWP_GRAD_ERROR)
    packages = MEGATRON_PACKAGES
    # Sequences around a long one (``long_row``: across every GDN chunk boundary, window and rope threshold the model
    # has), so boundaries fall inside GDN chunks and the long sequence's state crosses chunks.
    lengths = (7, 12, 5)

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.megatron.compare import (
            EFFECT_FLOOR,
            gradient_closeness,
            same_model_tolerances,
            worst_closeness,
        )
        from model_support.validation.megatron_session import crossing, long_row, random_tokens, with_random_lora
        from model_support.validation.row_runs import routing_alone, run_alone, run_packed

        built = with_random_lora(ctx, offset=2)
        model, dtype = built.model, built.numerics.dtype
        short, *rest = self.lengths
        lengths = (short, long_row(ctx), *rest)
        seqs = [random_tokens(ctx, (1, n), offset=10 + i) for i, n in enumerate(lengths)]
        row = torch.cat(seqs, dim=1)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        bounds = list(itertools.pairwise(torch.cumsum(torch.tensor((0, *lengths)), 0).tolist()))

        def loss_of(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out[:-1], tokens[0, 1:].to(out.device), reduction="sum")

        routing = routing_alone(model, seqs)
        alone = run_alone(model, seqs, lambda out, i: loss_of(out, seqs[i]), routing)
        packed, unpacked = run_packed(
            model,
            row,
            positions,
            lambda out: sum(loss_of(out[s:e], row[:, s:e]) for s, e in bounds),
            [torch.cat(calls) for calls in routing],
        )
        separate = torch.cat(alone.logits)
        metrics = {
            "dtype": built.numerics.dtype_name,
            "sequences": len(lengths),
            "lengths": "+".join(map(str, lengths)),
            "tokens": row.shape[1],
            "gdn_layers": len(ctx.layout.gdn_layers),
            "attention_layers": len(ctx.layout.attention_layers),
            # Worst sequence: the long one's tokens would dilute an error in a short one (and the control's change).
            **worst_closeness(packed.logits[0], separate, bounds, prefix="logits_"),
            **gradient_closeness(packed.grads, alone.grads),
            "leak_control_rel_l2": worst_closeness(unpacked, separate, bounds)["rel_l2"],
        }
        thresholds = same_model_tolerances(
            dtype, ctx.state.get(REFERENCE_LOWP_ERROR), ctx.state.get(REFERENCE_LOWP_GRAD_ERROR)
        )
        found, limits, missed = crossing(ctx, max(s.shape[1] for s in seqs), prefix="long_sequence_")
        metrics |= found
        thresholds |= limits
        why = "the packed-row comparison cannot tell sequences apart"
        control = metrics["leak_control_rel_l2"]
        return self.blind(
            "leak_control_rel_l2", control, EFFECT_FLOOR[dtype], why, metrics=metrics, thresholds=thresholds
        ) or self.judge(
            metrics,
            thresholds,
            f"{len(lengths)} packed sequences ({metrics['lengths']} tokens): logits rel L2 "
            f"{metrics['logits_rel_l2']:.2e} ({metrics['dtype']})",
            missed,
            ctx=ctx,
        )
