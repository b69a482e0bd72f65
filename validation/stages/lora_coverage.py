"""Stage `lora_coverage`: LoRA covers every declared target, trains, and survives the trip to PEFT and back."""

from __future__ import annotations

import re
from typing import ClassVar

import torch

from model_support.core.layout import ModelLayout

# LOGIT_TOLERANCES and LOWP_TOLERANCE_FACTOR are re-exported so docs/stages.md lists them for this stage.
from model_support.core.megatron.compare import EFFECT_FLOOR, LOGIT_TOLERANCES, LOWP_TOLERANCE_FACTOR
from model_support.core.spec import HandlerSpec, TargetScope
from model_support.core.validate import checkpoint_modules, uncovered_targets
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES

__all__ = ["LOGIT_TOLERANCES", "LOWP_TOLERANCE_FACTOR", "LoraCoverageStage", "expected_modules"]

_FUSED = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")
# The expert module a LoRA parameter of a routed expert belongs to.
_EXPERT = re.compile(r"^decoder\.layers\.\d+\.mlp\.experts\.local_experts\.\d+")


def expected_modules(spec: HandlerSpec, layout: ModelLayout) -> dict[str, int]:
    """How many Megatron modules each declared target must wrap, from the checkpoint's layout."""
    from model_support.core.megatron.lora import target_key

    moe_layers = 0 if layout.moe is None else layout.num_layers - len(layout.moe.dense_layers)
    dense_layers = layout.num_layers - moe_layers
    per_scope = {
        TargetScope.ATTENTION: len(layout.attention_layers),
        TargetScope.GDN: len(layout.gdn_layers),
        TargetScope.MLP: dense_layers,
        TargetScope.EXPERT: moe_layers * (layout.moe.num_experts if layout.moe else 0),
        TargetScope.SHARED_EXPERT: moe_layers if layout.moe and layout.moe.has_shared_expert else 0,
    }
    return {target_key(t): per_scope[t.scope] for t in spec.lora_targets}


class LoraCoverageStage(Stage):
    """LoRA is applied in Megatron to every declared target (counted against the layout), base weights
    frozen; every LoRA parameter gets a non-zero gradient (an expert the router sent no token to is run
    directly on random tokens, so every expert's LoRA is proven whatever the router does); the handler's
    codec splits the fused Megatron base weights into exactly the checkpoint's HF tensors (so it mirrors
    the bridge's layouts); the PEFT adapter written from Megatron loads back bit for bit; and that adapter,
    merged into the fp32 transformers reference, gives the Megatron+LoRA logits within the tolerances of
    the model's dtype (MoE routing replayed from the reference). The random adapter must change the logits
    by at least the dtype's effect floor, so the comparison can see a wrong split."""

    name = "lora_coverage"
    title = "Every declared target gets a trainable LoRA; the codec round trip is exact; adapter logits match."
    order = 40
    requires = ("hf_parity",)
    packages = MEGATRON_PACKAGES
    thresholds: ClassVar[dict[str, float]] = {
        "missing_lora_modules": 0,
        "zero_grad_params": 0,
        "trainable_base_params": 0,
        "codec_layout_err": 0.0,
        "roundtrip_mismatches": 0,
        "adapter_uncovered_targets": 0,
    }
    batch, seq_len = 2, 32
    expert_tokens = 4  # tokens fed to each expert the router sent none to

    def skip_reason(self, ctx: CheckContext) -> str | None:
        if ctx.spec.codec is None:
            return f"handler {ctx.spec.name} declares no LoRA codec"
        return None

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core import api
        from model_support.core.codecs import load_peft_adapter
        from model_support.core.megatron.compare import closeness, replayed_routing, tolerance_note, tolerances
        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.hf_reference import adapter_deltas
        from model_support.core.megatron.lora import load_lora_state, lora_modules, lora_state, random_lora_state
        from model_support.core.megatron.session import (
            ADAPTER_KEY,
            hf_reference,
            megatron_lora,
            megatron_model,
            random_tokens,
            reference_lowp,
            training_model,
        )

        spec, layout = ctx.spec, ctx.layout
        built = megatron_model(ctx)
        model = built.model
        layout_err = self._codec_layout_err(ctx, built)
        report = megatron_lora(ctx)
        expected = expected_modules(spec, layout)
        got = {key: len(names) for key, names in report.per_target.items()}
        missing = sum(max(expected[k] - got.get(k, 0), 0) for k in expected)
        details = [f"{k}: {got.get(k, 0)}/{n} modules" for k, n in expected.items()]

        state = random_lora_state(model, seed=ctx.seed + 1, b_std=0.05)
        load_lora_state(model, state)
        tokens = random_tokens(ctx, (self.batch, self.seq_len), offset=1)
        model.zero_grad(set_to_none=True)
        out = logits(model, tokens)
        labels = tokens[:, 1:].flatten().to(out.device)
        torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), labels).backward()
        lora_params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
        unrouted = self._exercise_unrouted_experts(model, lora_params, ctx.seed)
        zero_grad = sorted(n for n, p in lora_params.items() if p.grad is None or not p.grad.abs().sum() > 0)
        trainable_base = sorted(n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n)
        model.zero_grad(set_to_none=True)
        if unrouted:
            details.append(
                f"{unrouted} expert(s) got no token from the router; each was run directly on "
                f"{self.expert_tokens} random tokens to reach its LoRA"
            )
        if zero_grad:
            details.append(f"no gradient: {', '.join(zero_grad[:4])}")

        # The trainer's path: export through the API (the handler's codec), then load the file back into the model.
        adapter_dir = api.export_adapter(training_model(ctx), ctx.workdir / "megatron-lora-adapter")
        ctx.artifacts[ADAPTER_KEY] = adapter_dir
        _, on_disk = load_peft_adapter(adapter_dir)
        uncovered = uncovered_targets(spec, checkpoint_modules(on_disk))
        if uncovered:
            details.append(f"the exported adapter has no module for {', '.join(uncovered)}")
        load_lora_state(model, {k: torch.zeros_like(v) for k, v in state.items()})
        api.load_adapter(training_model(ctx), adapter_dir)
        back = lora_state(model)  # on the model's device; ``state`` was drawn on the CPU
        mismatches = len(set(back) ^ set(state)) + sum(
            1 for k in set(back) & set(state) if not torch.equal(back[k].cpu(), state[k])
        )

        deltas = adapter_deltas(adapter_dir)
        ref = hf_reference(ctx).forward(tokens, adapter=deltas, routers=layout.moe is not None)
        routing = [r.indices for r in ref.routers]
        dtype = built.numerics.dtype
        lowp = reference_lowp(ctx, dtype, tokens, ref.logits, adapter=deltas, routing=routing)
        with torch.no_grad(), replayed_routing(model, routing, self.batch):
            ours = logits(model, tokens)
            base = logits_without_lora(model, tokens)
        effect = closeness(ours, base)["rel_l2"]
        thresholds = dict(self.thresholds) | tolerances(dtype, prefix="adapter_logits_", reference_lowp=lowp)
        metrics = {
            "lora_modules": len(lora_modules(model)),
            "missing_lora_modules": missing,
            "lora_params": len(lora_params),
            "zero_grad_params": len(zero_grad),
            "trainable_base_params": len(trainable_base),
            "codec_layout_err": layout_err,
            "peft_tensors": len(on_disk),
            "roundtrip_mismatches": mismatches,
            "adapter_uncovered_targets": len(uncovered),
            "unrouted_experts_run_directly": unrouted,
            "dtype": built.numerics.dtype_name,
            **closeness(ours, ref.logits, prefix="adapter_logits_"),
            "adapter_effect_rel_l2": effect,
            **{f"reference_{built.numerics.dtype_name}_{k}": v for k, v in (lowp or {}).items()},
        }
        details.append(
            f"adapter written to {adapter_dir} ({len(on_disk)} tensors), merged into the fp32 transformers reference"
        )
        details.append(tolerance_note(dtype))
        why = "the random adapter changes the logits too little for the comparison to see a wrong split"
        return self.blind(
            "adapter_effect_rel_l2",
            effect,
            EFFECT_FLOOR[dtype],
            why,
            metrics=metrics,
            thresholds=thresholds,
            details=details,
        ) or self.judge(
            metrics,
            thresholds,
            f"{metrics['lora_modules']} LoRA modules, codec exact, adapter logits match",
            details,
            ctx=ctx,
        )

    def _exercise_unrouted_experts(
        self, model: torch.nn.Module, lora_params: dict[str, torch.nn.Parameter], seed: int
    ) -> int:
        """Run every expert whose LoRA got no gradient (no token routed to it) on random tokens, backward."""
        modules = dict(model.named_modules())
        experts = sorted(
            {
                m.group(0)
                for n, p in lora_params.items()
                if (p.grad is None or not p.grad.abs().sum() > 0) and (m := _EXPERT.match(n))
            }
        )
        gen = torch.Generator().manual_seed(seed + 3)
        hidden = model.config.hidden_size
        for name in experts:
            expert = modules[name]
            weight = next(p for p in expert.parameters() if not p.requires_grad)  # a frozen base weight
            x = torch.randn(self.expert_tokens, 1, hidden, generator=gen).to(weight.device, weight.dtype)
            out, _ = expert(x)
            out.float().square().sum().backward()
        return len(experts)

    @staticmethod
    def _codec_layout_err(ctx: CheckContext, built) -> float:
        """Max |codec split of each fused Megatron base weight - the checkpoint's HF tensor| (exact: 0).

        One decoder layer at a time, so no second copy of the model is held.
        """
        from model_support.core.codecs import PEFT_PREFIX, hf_layers_prefix

        by_layer: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in built.model.named_parameters():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in _FUSED and ".lora_" not in name:
                module = module.replace(".base", "")
                fake = by_layer.setdefault(module.split(".")[2], {})
                fake[f"{module}.lora_B.weight"] = param.detach()
                fake[f"{module}.lora_A.weight"] = torch.zeros(1, param.shape[1])
        worst = 0.0
        prefix = PEFT_PREFIX + hf_layers_prefix(ctx.config)
        for fake in by_layer.values():
            for key, value in ctx.spec.codec.to_peft(fake, ctx.config, ctx.layout).items():
                if key.endswith(".lora_B.weight"):
                    hf_name = "model.layers." + key[len(prefix) : -len(".lora_B.weight")] + ".weight"
                    # The model holds the checkpoint's values in its own dtype: compare in that dtype (exact).
                    expected = built.checkpoint[hf_name].to(value.device, value.dtype)
                    worst = max(worst, (expected.float() - value.float()).abs().max().item())
        return worst


def logits_without_lora(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits with every LoRA update scaled to zero (to show the adapter changes the output)."""
    from model_support.core.megatron.forward import logits
    from model_support.core.megatron.lora import lora_modules

    modules = lora_modules(model).values()
    scales = [m.scale for m in modules]
    for m in modules:
        m.scale = 0.0
    try:
        with torch.no_grad():
            return logits(model, tokens)
    finally:
        for m, s in zip(modules, scales, strict=True):
            m.scale = s
