"""Stage `lora_coverage`: LoRA covers every declared target, trains, and survives the trip to PEFT and back."""

from __future__ import annotations

from typing import ClassVar

import torch

from model_support.core.layout import ModelLayout
from model_support.core.spec import HandlerSpec, TargetScope
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES

_FUSED = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")


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
    frozen; every LoRA parameter gets a non-zero gradient; the handler's codec splits the fused Megatron
    base weights into exactly the checkpoint's HF tensors (so it mirrors the bridge's layouts); the PEFT
    adapter written from Megatron loads back bit for bit; and that adapter on the transformers model
    gives the Megatron+LoRA logits (PEFT, or merged into the checkpoint where PEFT cannot address
    fused experts)."""

    name = "lora_coverage"
    title = "Every declared target gets a trainable LoRA; the codec round trip is exact; PEFT logits match."
    order = 40
    requires = ("hf_parity",)
    packages = MEGATRON_PACKAGES
    thresholds: ClassVar[dict[str, float]] = {
        "missing_lora_modules": 0,
        "zero_grad_params": 0,
        "trainable_base_params": 0,
        "codec_layout_err": 0.0,
        "roundtrip_mismatches": 0,
        "adapter_logits_max_abs_err": 1e-4,
    }
    batch, seq_len = 2, 32

    def skip_reason(self, ctx: CheckContext) -> str | None:
        if ctx.spec.codec is None:
            return f"handler {ctx.spec.name} declares no LoRA codec"
        return None

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.codecs import load_peft_adapter, save_peft_adapter
        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.hf_reference import adapter_logits
        from model_support.core.megatron.lora import load_lora_state, lora_modules, lora_state, random_lora_state
        from model_support.core.megatron.session import (
            ADAPTER_KEY,
            LORA_ALPHA,
            LORA_RANK,
            megatron_lora,
            megatron_model,
            random_tokens,
        )

        codec, spec, layout = ctx.spec.codec, ctx.spec, ctx.layout
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
        zero_grad = sorted(n for n, p in lora_params.items() if p.grad is None or not p.grad.abs().sum() > 0)
        trainable_base = sorted(n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n)
        model.zero_grad(set_to_none=True)
        if zero_grad:
            details.append(f"no gradient: {', '.join(zero_grad[:4])}")

        adapter_dir = ctx.workdir / "megatron-lora-adapter"
        peft = codec.to_peft(lora_state(model), ctx.config, layout)
        save_peft_adapter(
            adapter_dir,
            peft,
            rank=LORA_RANK,
            alpha=LORA_ALPHA,
            target_modules=list(spec.hf_target_modules),
            base_model=str(ctx.model_dir),
        )
        ctx.artifacts[ADAPTER_KEY] = adapter_dir
        _, on_disk = load_peft_adapter(adapter_dir)
        back = codec.from_peft(on_disk, ctx.config, layout)
        mismatches = len(set(back) ^ set(state)) + sum(
            1 for k in set(back) & set(state) if not torch.equal(back[k], state[k])
        )

        with torch.no_grad():
            ours = logits(model, tokens).cpu()
        method = "merged" if spec.targets(TargetScope.EXPERT) else "peft"
        ref = adapter_logits(ctx.model_dir, ctx.config, adapter_dir, tokens, ctx.workdir, method=method)
        metrics = {
            "lora_modules": len(lora_modules(model)),
            "missing_lora_modules": missing,
            "lora_params": len(lora_params),
            "zero_grad_params": len(zero_grad),
            "trainable_base_params": len(trainable_base),
            "codec_layout_err": layout_err,
            "peft_tensors": len(peft),
            "roundtrip_mismatches": mismatches,
            "adapter_logits_max_abs_err": (ours - ref).abs().max().item(),
            "adapter_effect": (ours - logits_without_lora(model, tokens).cpu()).abs().max().item(),
            "hf_adapter_method": method,
        }
        details.append(f"adapter written to {adapter_dir} ({len(peft)} tensors), applied on transformers by {method}")
        return self.judge(
            metrics, self.thresholds, f"{metrics['lora_modules']} LoRA modules, codec exact, PEFT logits match", details
        )

    @staticmethod
    def _codec_layout_err(ctx: CheckContext, built) -> float:
        """Max |codec split of each fused Megatron base weight - the checkpoint's HF tensor| (exact: 0)."""
        from model_support.core.codecs import PEFT_PREFIX, hf_layers_prefix

        fake: dict[str, torch.Tensor] = {}
        for name, param in built.model.named_parameters():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in _FUSED and ".lora_" not in name:
                module = module.replace(".base", "")
                fake[f"{module}.lora_B.weight"] = param.detach().cpu()
                fake[f"{module}.lora_A.weight"] = torch.zeros(1, param.shape[1])
        peft = ctx.spec.codec.to_peft(fake, ctx.config, ctx.layout)
        worst = 0.0
        prefix = PEFT_PREFIX + hf_layers_prefix(ctx.config)
        for key, value in peft.items():
            if key.endswith(".lora_B.weight"):
                hf_name = "model.layers." + key[len(prefix) : -len(".lora_B.weight")] + ".weight"
                worst = max(worst, (built.checkpoint[hf_name] - value).abs().max().item())
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
