"""Stage `hf_parity`: the bridge-built Megatron model computes the transformers model's logits."""

from __future__ import annotations

import torch

# Re-exported so the stage reference (docs/stages.md) lists the tolerances this stage applies.
from model_support.core.megatron.compare import LOGIT_TOLERANCES, LOWP_TOLERANCE_FACTOR
from model_support.validation.context import CheckContext
from model_support.validation.stage import Requirement, Stage, StageResult

__all__ = ["LOGIT_TOLERANCES", "LOWP_TOLERANCE_FACTOR", "MEGATRON_PACKAGES", "HfParityStage"]

MEGATRON_PACKAGES = (
    Requirement("megatron.core", "megatron-core", "megatron"),
    Requirement("megatron.bridge", "megatron-bridge", "megatron"),
)


class HfParityStage(Stage):
    """The Megatron model as a trainer runs it (bf16, megatron-core's modules and the policy's GDN kernel on
    a GPU; fp32 and the local GDN layer on a CPU) and the fp32 transformers reference, streamed one layer
    at a time on the same device, run the same weights on the same random tokens. The logits must agree
    within the tolerances of the model's dtype (``core/megatron/compare.py``). MoE routers are compared on
    the reference's router inputs (no top-k flip beyond rounding), and the logits under replay of the
    reference's routing."""

    name = "hf_parity"
    title = "Megatron logits match the fp32 transformers reference on the same weights and tokens."
    order = 30
    requires = ("weights",)
    packages = MEGATRON_PACKAGES
    batch, seq_len = 2, 32

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.megatron.compare import (
            closeness,
            replayed_routing,
            routing_agreement,
            tolerance_note,
            tolerances,
        )
        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.session import (
            LOWP_KEY,
            hf_reference,
            megatron_model,
            random_tokens,
            reference_lowp,
        )

        built = megatron_model(ctx)
        reference = hf_reference(ctx)
        tokens = random_tokens(ctx, (self.batch, self.seq_len))
        moe = ctx.layout.moe is not None
        ref = reference.forward(tokens, routers=moe)
        routing = [r.indices for r in ref.routers]
        dtype = built.numerics.dtype
        metrics: dict[str, object] = {"dtype": built.numerics.dtype_name, "tokens": tokens.numel()}
        lowp = reference_lowp(ctx, dtype, tokens, ref.logits, routing=routing)
        ctx.artifacts[LOWP_KEY] = lowp
        metrics |= {f"reference_{built.numerics.dtype_name}_{k}": v for k, v in (lowp or {}).items()}
        thresholds = tolerances(dtype, reference_lowp=lowp)
        if moe:
            metrics |= routing_agreement(built.model, ref.routers, self.batch)
            thresholds["router_flips"] = 0
        with torch.no_grad(), replayed_routing(built.model, routing, self.batch):
            ours = logits(built.model, tokens)
        metrics |= closeness(ours, ref.logits)
        metrics |= {
            "mapped_params": len(built.mapped),
            "config_mtp_layers": ctx.layout.mtp_layers,
            "mtp_layers_built": sum(
                1 for n, _ in built.model.named_modules() if n.startswith("mtp.layers.") and n.count(".") == 2
            ),
            "build_s": round(ctx.artifacts.get("megatron_build_s", 0.0), 3),
        }
        details = [
            f"model under test: {built.numerics.describe(bool(ctx.layout.gdn_layers))}",
            "reference: transformers, float32, streamed one decoder layer at a time on the same device",
            tolerance_note(dtype),
            f"bridge {type(built.bridge).__name__}, {len(built.mapped)} Megatron parameters filled by its mappings",
            f"MTP: {ctx.layout.mtp_layers} layer(s) in the config, {metrics['mtp_layers_built']} built "
            f"(runtime policy disable_mtp_for_training={ctx.spec.runtime.disable_mtp_for_training})",
        ]
        if moe:
            details.append(
                f"routing: {metrics['router_flips']} top-k flips and {metrics['router_near_ties']} near ties in "
                f"{metrics['router_tokens']} token-layers; logits compared under replay of the reference's routing"
            )
        summary = f"rel L2 {metrics['rel_l2']:.2e}, max |Δlogit| {metrics['max_abs_err']:.2e} ({metrics['dtype']})"
        return self.judge(metrics, thresholds, summary, details, ctx=ctx)
