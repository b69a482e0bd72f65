"""Stage `packed_position_ids`: a packed row computes what its sequences compute alone, in Megatron."""

from __future__ import annotations

import itertools
from typing import ClassVar

import torch

from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES


class PackedPositionIdsStage(Stage):
    """Several sequences packed in one row, position ids restarting at 0, run through the Megatron model
    (with LoRA, so gradients flow): per-token logits must equal those of each sequence run alone, and the
    LoRA gradients of the packed loss must equal the sum of the per-sequence gradients. Both full
    attention (block-diagonal mask) and Gated DeltaNet layers (``cu_seqlens``: recurrent state and
    convolution restart at each boundary) derive the boundaries from the position ids. As a control, the
    same row run as one sequence must differ (``leak_control_diff`` at least ``min_leak_control``),
    showing the comparison can see state crossing a boundary."""

    name = "packed_position_ids"
    title = "Packed rows (position ids restarting at 0) give the same logits and gradients as separate runs."
    order = 50
    requires = ("hf_parity",)
    packages = MEGATRON_PACKAGES
    thresholds: ClassVar[dict[str, float]] = {"logits_max_abs_err": 1e-4, "grad_max_rel_err": 1e-4}
    min_leak_control = 1e-3
    lengths = (7, 12, 5)

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.lora import load_lora_state, random_lora_state
        from model_support.core.megatron.session import megatron_lora, megatron_model, random_tokens

        model = megatron_model(ctx).model
        megatron_lora(ctx)
        load_lora_state(model, random_lora_state(model, seed=ctx.seed + 2, b_std=0.05))
        seqs = [random_tokens(ctx, (1, n), offset=10 + i) for i, n in enumerate(self.lengths)]
        row = torch.cat(seqs, dim=1)
        positions = torch.cat([torch.arange(n) for n in self.lengths])[None]
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}

        def loss_of(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out[0, :-1], tokens[0, 1:].to(out.device), reduction="sum")

        model.zero_grad(set_to_none=True)
        packed = logits(model, row, positions)
        bounds = torch.cumsum(torch.tensor((0, *self.lengths)), 0).tolist()
        sum(loss_of(packed[:, s:e], row[:, s:e]) for s, e in itertools.pairwise(bounds)).backward()
        packed_grads = {n: p.grad.clone() for n, p in params.items()}

        model.zero_grad(set_to_none=True)
        alone = []
        for seq in seqs:
            out = logits(model, seq)
            loss_of(out, seq).backward()
            alone.append(out.detach())
        alone_grads = {n: p.grad.clone() for n, p in params.items()}
        model.zero_grad(set_to_none=True)

        with torch.no_grad():
            unpacked = logits(model, row)
        separate = torch.cat(alone, dim=1)
        grad_err = max(
            ((packed_grads[n] - alone_grads[n]).abs().max() / alone_grads[n].abs().max().clamp_min(1e-12)).item()
            for n in params
        )
        metrics = {
            "sequences": len(self.lengths),
            "tokens": row.shape[1],
            "gdn_layers": len(ctx.layout.gdn_layers),
            "attention_layers": len(ctx.layout.attention_layers),
            "logits_max_abs_err": (packed.detach() - separate).abs().max().item(),
            "grad_max_rel_err": grad_err,
            "grad_params": len(params),
            "leak_control_diff": (unpacked - separate).abs().max().item(),
        }
        if metrics["leak_control_diff"] < self.min_leak_control:
            return self.failed(
                f"leak_control_diff={metrics['leak_control_diff']:.3g} < {self.min_leak_control}: the packed-row "
                "comparison cannot tell sequences apart",
                metrics=metrics,
                thresholds=self.thresholds,
            )
        return self.judge(
            metrics,
            self.thresholds,
            f"{len(self.lengths)} packed sequences: max |Δlogit| {metrics['logits_max_abs_err']:.2e}",
        )
