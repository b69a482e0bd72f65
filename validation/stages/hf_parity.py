"""Stage `hf_parity`: the bridge-built Megatron model computes the transformers model's logits."""

from __future__ import annotations

from typing import ClassVar

import torch

from model_support.validation.context import CheckContext
from model_support.validation.stage import Requirement, Stage, StageResult

MEGATRON_PACKAGES = (
    Requirement("megatron.core", "megatron-core", "megatron"),
    Requirement("megatron.bridge", "megatron-bridge", "megatron"),
)


class HfParityStage(Stage):
    """Megatron (local spec, weights through megatron-bridge) and transformers run the same weights on the
    same random tokens in fp32; the largest logit difference, absolute and relative to the largest
    reference logit, must stay within the fp32 tolerances."""

    name = "hf_parity"
    title = "Megatron logits match transformers logits on the same weights and tokens (fp32)."
    order = 30
    requires = ("architecture",)
    packages = MEGATRON_PACKAGES
    thresholds: ClassVar[dict[str, float]] = {"max_abs_err": 1e-4, "rel_err": 1e-4}
    batch, seq_len = 2, 24

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.hf_reference import hf_logits, load_hf_model
        from model_support.core.megatron.session import megatron_model, random_tokens

        built = megatron_model(ctx)
        tokens = random_tokens(ctx, (self.batch, self.seq_len))
        with torch.no_grad():
            ours = logits(built.model, tokens).cpu()
        ref = hf_logits(load_hf_model(ctx.model_dir, ctx.config), tokens)
        diff = (ours - ref).abs()
        metrics = {
            "max_abs_err": diff.max().item(),
            "rel_err": (diff.max() / ref.abs().max()).item(),
            "mean_abs_err": diff.mean().item(),
            "tokens": tokens.numel(),
            "mapped_params": len(built.mapped),
            "config_mtp_layers": ctx.layout.mtp_layers,
            "mtp_layers_built": sum(
                1 for n, _ in built.model.named_modules() if n.startswith("mtp.layers.") and n.count(".") == 2
            ),
            "build_s": round(ctx.artifacts.get("megatron_build_s", 0.0), 3),
        }
        details = [
            f"bridge {type(built.bridge).__name__}, {len(built.mapped)} Megatron parameters filled by its mappings",
            f"MTP: {ctx.layout.mtp_layers} layer(s) in the config, {metrics['mtp_layers_built']} built "
            f"(runtime policy disable_mtp_for_training={ctx.spec.runtime.disable_mtp_for_training})",
        ]
        return self.judge(metrics, self.thresholds, f"max |Δlogit| {metrics['max_abs_err']:.2e}", details)
