"""Stage `hf_parity`: the bridge-built Megatron model computes the transformers model's logits."""

from __future__ import annotations

# Re-exported so the stage reference (docs/stages.md) lists the tolerances this stage applies.
from model_support.core.megatron.compare import LOGIT_TOLERANCES, LOWP_TOLERANCE_FACTOR
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import HF_REFERENCES, PARITY_ROWS, REFERENCE_LOWP_ERROR, TRAINING_MODEL
from model_support.validation.stage import Requirement, Stage, StageResult

__all__ = ["LOGIT_TOLERANCES", "LOWP_TOLERANCE_FACTOR", "MEGATRON_PACKAGES", "HfParityStage"]

MEGATRON_PACKAGES = (
    Requirement("megatron.core", "megatron-core", "megatron"),
    Requirement("megatron.bridge", "megatron-bridge", "megatron"),
)


class HfParityStage(Stage):
    """The Megatron model as a trainer runs it (bf16, megatron-core's modules and the policy's GDN kernel on
    a GPU; fp32 and the local GDN layer on a CPU) and the fp32 transformers reference, streamed one layer
    at a time on the same device, run the same weights on the same random tokens: a batch of short rows and one long
    row across every length-dependent structure of the model (``core.layout.length_structures``: three GDN chunk
    boundaries, a sliding window, where rope scaling starts; at least 4096 tokens on a GPU). The logits must agree
    within the tolerances of the model's dtype (``core/megatron/compare.py``). MoE routers are compared on
    the reference's router inputs (no top-k flip beyond rounding), and the logits under replay of the
    reference's routing."""

    name = "hf_parity"
    title = "Megatron logits match the fp32 transformers reference on the same weights and tokens."
    order = 30
    sharded = True
    requires = ("weights",)
    packages = MEGATRON_PACKAGES
    needs = (TRAINING_MODEL, HF_REFERENCES)
    provides = (REFERENCE_LOWP_ERROR,)
    batch, seq_len = PARITY_ROWS

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.megatron.compare import tolerance_note
        from model_support.validation.megatron_session import (
            crossing,
            hf_reference,
            megatron_model,
            parity_rows,
            worst_lowp,
        )
        from model_support.validation.reference_rows import compare_with_reference

        built = megatron_model(ctx)
        dtype = built.numerics.dtype
        moe = ctx.layout.moe is not None
        # A batch of short rows, and one row across every length-dependent structure of the model (GDN chunks, a
        # sliding window, where rope scaling starts): a bug that only shows past one of them shows there.
        rows = parity_rows(ctx)
        length = rows[-1][1].shape[1]
        metrics: dict[str, object] = {"dtype": built.numerics.dtype_name, "long_row_tokens": length}
        thresholds: dict[str, float] = {}
        lowps = []
        for prefix, tokens in rows:
            found, limits, lowp = compare_with_reference(ctx, built, tokens, prefix, routers=True)
            metrics |= found
            thresholds |= limits
            lowps.append(lowp)
        found, limits, missed = crossing(ctx, length)
        metrics |= found
        thresholds |= limits
        # Later stages hold same-model comparisons of short and long rows to transformers' own rounding distance.
        ctx.state.set(REFERENCE_LOWP_ERROR, worst_lowp(lowps))
        mtp_built = sum(1 for n, _ in built.model.named_modules() if n.startswith("mtp.layers.") and n.count(".") == 2)
        metrics |= {
            "mapped_params": len(built.mapped),
            "config_mtp_layers": ctx.layout.mtp_layers,
            "mtp_layers_built": mtp_built,
            "build_s": round(ctx.state.origins[TRAINING_MODEL].seconds, 3),
        }
        if ctx.spec.runtime.disable_mtp_for_training:  # the policy keeps MTP out of training: none may be built
            thresholds["mtp_layers_built"] = 0
        details = [
            f"model under test: {built.numerics.describe(bool(ctx.layout.gdn_layers))}",
            "reference: transformers, float32, streamed one decoder layer at a time on the same device, "
            f"{hf_reference(ctx).attention} attention" + self._oracle_kernels(hf_reference(ctx).torch_gdn_layers),
            f"rows: {self.batch} x {self.seq_len} tokens, and 1 x {length} ({self._structures(ctx)})",
            tolerance_note(dtype),
            *missed,
            f"bridge {type(built.bridge).__name__}, {len(built.mapped)} Megatron parameters filled by its mappings",
            f"MTP: {ctx.layout.mtp_layers} layer(s) in the config, {mtp_built} built "
            f"(runtime policy disable_mtp_for_training={ctx.spec.runtime.disable_mtp_for_training})",
        ]
        if ctx.parallel is not None:
            details.insert(
                1,
                f"sharded {ctx.parallel.name} over {ctx.parallel.model_parallel} ranks (check --parallel): each rank "
                "holds its shard, the logits are the whole model's",
            )
        if moe:
            details.append(
                f"routing: {metrics['router_flips']} top-k flips and {metrics['router_near_ties']} near ties in "
                f"{metrics['router_tokens']} token-layers (long row: {metrics['long_router_flips']} flips); logits "
                "compared under replay of the reference's routing"
            )
        summary = (
            f"rel L2 {metrics['rel_l2']:.2e}, long row ({length} tokens) {metrics['long_rel_l2']:.2e}, "
            f"max |Δlogit| {max(metrics['max_abs_err'], metrics['long_max_abs_err']):.2e} ({metrics['dtype']})"
        )
        return self.judge(metrics, thresholds, summary, details, ctx=ctx)

    @staticmethod
    def _oracle_kernels(torch_gdn_layers: int) -> str:
        if not torch_gdn_layers:
            return ""
        return (
            f"; its {torch_gdn_layers} Gated DeltaNet layer(s) on transformers' torch path "
            "(torch_chunk_gated_delta_rule, the torch convolution and gated RMSNorm): no kernel autotunes for it"
        )

    @staticmethod
    def _structures(ctx: CheckContext) -> str:
        from model_support.core.layout import length_structures

        crossed = length_structures(ctx.config, ctx.layout)
        return ", ".join(f"{name} from {n} tokens" for name, n in crossed.items()) or "no length-dependent structure"
