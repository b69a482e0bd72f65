"""Stage `lora_coverage`: LoRA covers every declared target, trains, and survives the trip to PEFT and back."""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING, ClassVar

import torch

from model_support.core.layout import ModelLayout

# LOGIT_TOLERANCES and LOWP_TOLERANCE_FACTOR are re-exported so docs/stages.md lists them for this stage.
from model_support.core.megatron.compare import EFFECT_FLOOR, LOGIT_TOLERANCES, LOWP_TOLERANCE_FACTOR
from model_support.core.spec import HandlerSpec, TargetScope
from model_support.core.validate import adapter_targets, uncovered_targets
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import (
    HF_REFERENCES,
    LORA,
    REFERENCE_LOWP_ERROR,
    TRAINED_ADAPTER,
    TRAINING_MODEL,
)
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES

if TYPE_CHECKING:
    from model_support.core.megatron.lora import LoraReport

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
    the model's dtype (MoE routing replayed from the reference), on a short batch and on a long row across every
    length-dependent structure of the model (as in ``hf_parity``). The random adapter must change the logits
    by at least the dtype's effect floor, so the comparison can see a wrong split. On a row across the model's
    length structures: ``api.apply_lora``'s fresh adapter leaves the logits unchanged (bit for bit in fp32), and
    with the random adapter train mode computes what eval mode does (no stochastic layer; the modules that differ
    are named). Both of these compare the model with itself, each pair of runs under one recorded MoE routing: a GPU's
    MoE dispatch does not repeat its sums bitwise, and a near tie that such a sum flips would move whole tokens."""

    name = "lora_coverage"
    title = "Every declared target gets a trainable LoRA; the codec round trip is exact; adapter logits match."
    order = 40
    sharded = True
    requires = ("hf_parity",)
    packages = MEGATRON_PACKAGES
    needs = (TRAINING_MODEL, LORA, HF_REFERENCES, REFERENCE_LOWP_ERROR)
    provides = (TRAINED_ADAPTER,)
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
        from model_support.core.megatron.compare import closeness, tolerance_note
        from model_support.core.megatron.dist import sum_over_ranks, union_over_ranks
        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.hf_reference import adapter_deltas
        from model_support.core.megatron.lora import load_lora_state, lora_modules, lora_state, random_lora_state
        from model_support.core.megatron.names import global_name
        from model_support.validation.megatron_session import crossing, long_row, megatron_model, random_tokens
        from model_support.validation.reference_rows import compare_with_reference

        spec, layout = ctx.spec, ctx.layout
        built = megatron_model(ctx)
        model = built.model
        layout_err = self._codec_layout_err(ctx, built)
        # A row across every length-dependent structure, for what apply_lora and train mode may change.
        long_tokens = random_tokens(ctx, (1, long_row(ctx)), offset=5)
        report, identity, identity_limits, identity_details = self._apply_lora_checked(ctx, long_tokens)
        expected = expected_modules(spec, layout)
        # Each rank wrapped the modules it holds (its experts under expert parallelism): the whole model's count.
        every = union_over_ranks({f"{key}\0{name}" for key, names in report.per_target.items() for name in names})
        got = Counter(entry.split("\0")[0] for entry in every)
        missing = sum(max(expected[k] - got.get(k, 0), 0) for k in expected)
        details = [f"{k}: {got.get(k, 0)}/{n} modules" for k, n in expected.items()]

        state = random_lora_state(model, seed=ctx.seed + 1, b_std=0.05)
        load_lora_state(model, state)
        train_mode, train_limits, train_details = self._train_mode_check(ctx, model, long_tokens)
        tokens = random_tokens(ctx, (self.batch, self.seq_len), offset=1)
        model.zero_grad(set_to_none=True)
        out = logits(model, tokens)
        labels = tokens[:, 1:].flatten().to(out.device)
        torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), labels).backward()
        lora_params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
        unrouted = sum_over_ranks(self._exercise_unrouted_experts(model, lora_params, ctx.seed))
        factors = {
            f"{name}.lora_{which}.weight": factor
            for name, module in lora_modules(model).items()
            for which, factor in (("A", module.lora_A.weight), ("B", module.lora_B.weight))
        }
        n_factors = len(union_over_ranks(factors))
        zero_grad = sorted(
            union_over_ranks({n for n, p in factors.items() if p.grad is None or not p.grad.abs().sum() > 0})
        )
        trainable_base = sorted(
            union_over_ranks(
                {global_name(model, n) for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n}
            )
        )
        model.zero_grad(set_to_none=True)
        if unrouted:
            details.append(
                f"{unrouted} expert(s) got no token from the router; each was run directly on "
                f"{self.expert_tokens} random tokens to reach its LoRA"
            )
        if zero_grad:
            details.append(f"no gradient: {', '.join(zero_grad[:4])}")

        # The trainer's path: export through the API (the handler's codec), then load the file back into the model.
        adapter_dir = api.export_adapter(ctx.state.get(TRAINING_MODEL), ctx.workdir / "megatron-lora-adapter")
        ctx.state.set(TRAINED_ADAPTER, adapter_dir)
        adapter_config, on_disk = load_peft_adapter(adapter_dir)
        uncovered = uncovered_targets(spec, *adapter_targets(adapter_config, on_disk))
        if uncovered:
            details.append(f"the exported adapter has no module for {', '.join(uncovered)}")
        load_lora_state(model, {k: torch.zeros_like(v) for k, v in state.items()})
        api.load_adapter(ctx.state.get(TRAINING_MODEL), adapter_dir)
        back = lora_state(model)  # on the model's device; ``state`` was drawn on the CPU
        mismatches = len(set(back) ^ set(state)) + sum(
            1 for k in set(back) & set(state) if not torch.equal(back[k].cpu(), state[k])
        )

        deltas = adapter_deltas(adapter_dir)
        dtype = built.numerics.dtype
        thresholds = dict(self.thresholds)
        compared: dict[str, object] = {}
        # The short batch, and a row across every length-dependent structure of the model (GDN chunks, windows).
        long_rows = random_tokens(ctx, (1, long_row(ctx)), 4)
        length = long_rows.shape[1]
        for prefix, rows in (("adapter_logits_", tokens), ("long_adapter_logits_", long_rows)):
            found, limits, _ = compare_with_reference(ctx, built, rows, prefix, adapter=deltas)
            compared |= found
            thresholds |= limits
        found, limits, missed = crossing(ctx, length)
        compared |= found
        thresholds |= limits
        details += missed
        with torch.no_grad():
            effect = closeness(logits(model, tokens), logits_without_lora(model, tokens))["rel_l2"]
        metrics = {
            "lora_modules": len(union_over_ranks(lora_modules(model))),
            "missing_lora_modules": missing,
            "lora_params": n_factors,
            "zero_grad_params": len(zero_grad),
            "trainable_base_params": len(trainable_base),
            "codec_layout_err": layout_err,
            "peft_tensors": len(on_disk),
            "roundtrip_mismatches": mismatches,
            "adapter_uncovered_targets": len(uncovered),
            "unrouted_experts_run_directly": unrouted,
            "dtype": built.numerics.dtype_name,
            "long_row_tokens": length,
            **compared,
            "adapter_effect_rel_l2": effect,
            **identity,
            **train_mode,
        }
        thresholds |= identity_limits | train_limits
        details += identity_details + train_details
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

    @staticmethod
    def _apply_lora_checked(
        ctx: CheckContext, tokens: torch.Tensor
    ) -> tuple[LoraReport, dict[str, float], dict[str, float], list[str]]:
        """LoRA applied through the run's session (``api.apply_lora``), with the logits of ``tokens`` just before and
        just after: the fresh adapter (B = 0) must leave them unchanged (``fresh_lora_logits_max_abs_err``), bit for
        bit in fp32; below fp32 (where a GPU's MoE dispatch does not repeat its sums bitwise) within the stage's
        same-model tolerances (``fresh_lora_logits_rel_l2``, ``_mean_abs_pct``). Both runs replay one recorded MoE
        routing: a near tie that such a sum flips would otherwise move whole tokens to other experts."""
        from model_support.core.megatron.compare import closeness, same_model_tolerances
        from model_support.core.megatron.forward import logits
        from model_support.validation.row_runs import routing_of

        model = ctx.state.get(TRAINING_MODEL)
        if model.lora is not None:  # another stage of the run applied it first
            return ctx.state.get(LORA), {}, {}, ["apply_lora's identity not measured: LoRA was on before this stage"]
        exact = model.built.numerics.dtype == torch.float32
        with torch.no_grad(), routing_of(model.module, tokens):
            base = logits(model.module, tokens)
            report = ctx.state.get(LORA)
            fresh = logits(model.module, tokens)
        note = "bit for bit" if exact else "within the same-model tolerances"
        details = [f"apply_lora's fresh adapter (B = 0) on {tokens.shape[1]} tokens: logits unchanged {note}"]
        if exact:
            key = "fresh_lora_logits_max_abs_err"
            return report, {key: (fresh - base).abs().max().item()}, {key: 0.0}, details
        found = closeness(fresh, base, prefix="fresh_lora_logits_")
        limits = same_model_tolerances(model.built.numerics.dtype, ctx.state.get(REFERENCE_LOWP_ERROR))
        limits = {f"fresh_lora_{k}": v for k, v in limits.items() if k.startswith("logits_")}
        return report, found, limits, details

    @staticmethod
    def _train_mode_check(
        ctx: CheckContext, model: torch.nn.Module, tokens: torch.Tensor
    ) -> tuple[dict[str, float], dict[str, float], list[str]]:
        """The model with its random adapter computes in train mode what it does in eval mode (no stochastic layer:
        a trainer's forward in train mode must score what eval measured): ``train_mode_logits_`` closeness, fp32
        within 1e-6, below fp32 within the stage's same-model tolerances, both modes replaying one recorded MoE
        routing (as the fresh adapter's check does). Failing, the modules whose output differs from the same input
        (the innermost) are named."""
        from model_support.core.megatron.compare import closeness, same_model_tolerances
        from model_support.core.megatron.forward import logits
        from model_support.validation.row_runs import routing_of

        dtype = next(model.parameters()).dtype
        if dtype == torch.float32:
            limits = {"train_mode_logits_max_abs_err": 1e-6}
        else:
            same = same_model_tolerances(dtype, ctx.state.get(REFERENCE_LOWP_ERROR))
            limits = {f"train_mode_{k}": v for k, v in same.items() if k.startswith("logits_")}
        dropouts = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        details = [f"Dropout modules with p > 0: {', '.join(dropouts[:4]) or 'none'}"]
        was = model.training
        with routing_of(model, tokens):
            try:
                with torch.no_grad():
                    model.eval()
                    evaluated = logits(model, tokens)
                    model.train()
                    trained = logits(model, tokens)
            finally:
                model.train(was)
            metrics = closeness(trained, evaluated, prefix="train_mode_logits_")
            if any(not metrics[k] <= v for k, v in limits.items()):
                differ = _differing_in_train_mode(model, tokens)
                details.append(f"train mode changes the output of {', '.join(differ[:4]) or 'no single module'}")
        return metrics, limits, details

    def _exercise_unrouted_experts(
        self, model: torch.nn.Module, lora_params: dict[str, torch.nn.Parameter], seed: int
    ) -> int:
        """Run every expert of this rank whose LoRA got no gradient (no token routed to it) on random tokens,
        backward; how many there were."""
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
        from model_support.core.codecs import PEFT_PREFIX, hf_layers_prefix, stacked_target
        from model_support.core.megatron.dist import max_over_ranks
        from model_support.core.megatron.lora import LoraLinear, canonical_weight
        from model_support.core.megatron.names import global_name

        by_layer: dict[str, dict[str, torch.Tensor]] = {}
        modules = dict(built.model.named_modules())
        for name, module in modules.items():
            if name.rsplit(".", 1)[-1] not in _FUSED:
                continue
            linear = module.base if isinstance(module, LoraLinear) else module
            if not isinstance(getattr(linear, "weight", None), torch.Tensor):
                continue
            # The whole weight (a tensor-parallel rank holds a shard), named as in the single-rank model.
            weight = canonical_weight(name, linear, modules[name.rsplit(".", 1)[0]])
            name = global_name(built.model, name)
            fake = by_layer.setdefault(name.split(".")[2], {})
            fake[f"{name}.lora_B.weight"] = weight
            fake[f"{name}.lora_A.weight"] = torch.zeros(1, weight.shape[1])
        worst = 0.0
        prefix = PEFT_PREFIX + hf_layers_prefix(ctx.config)
        stacked = getattr(ctx.spec.codec, "target_parameters", lambda _config: ())(ctx.config)
        experts = ctx.layout.moe.num_experts if ctx.layout.moe else 0
        for fake in by_layer.values():
            for key, value in ctx.spec.codec.to_peft(fake, ctx.config, ctx.layout).items():
                target = stacked_target(key, stacked)
                if target and target[1] == "B":
                    # B of the stacked LoRA [out, in * E] (the base weight as B, rank = in): the checkpoint's
                    # [E, in, out].
                    hf_name = "model.layers." + target[0][len(prefix) :]
                    value = value.reshape(value.shape[0], -1, experts).permute(2, 1, 0)
                elif key.endswith(".lora_B.weight") and not target:
                    hf_name = "model.layers." + key[len(prefix) : -len(".lora_B.weight")] + ".weight"
                else:
                    continue
                # The model holds the checkpoint's values in its own dtype: compare in that dtype (exact).
                expected = built.checkpoint[hf_name].to(value.device, value.dtype)
                worst = max(worst, (expected.float() - value.float()).abs().max().item())
        return max_over_ranks(worst)


def _differing_in_train_mode(model: torch.nn.Module, tokens: torch.Tensor) -> list[str]:
    """The innermost modules that, given the same input in train and eval mode, return different outputs (compared
    by fingerprints of every call's floating-point inputs and outputs)."""
    from model_support.core.megatron.forward import logits
    from model_support.validation.stages.trainability import fingerprint

    def digest(value: object) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return fingerprint(value).cpu() if value.is_floating_point() else torch.zeros(0, dtype=torch.float64)
        if isinstance(value, tuple | list | dict):
            parts = [digest(v) for v in (value.values() if isinstance(value, dict) else value)]
            return torch.cat([torch.zeros(0, dtype=torch.float64), *parts])
        return torch.zeros(0, dtype=torch.float64)

    def record(train: bool) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        handles = [
            module.register_forward_hook(
                lambda _m, args, kwargs, out, name=name: calls.setdefault(name, []).append(
                    (digest((args, kwargs)), digest(out))
                ),
                with_kwargs=True,
            )
            for name, module in model.named_modules()
            if name
        ]
        was = model.training
        try:
            model.train(train)
            with torch.no_grad():
                logits(model, tokens)
        finally:
            model.train(was)
            for handle in handles:
                handle.remove()
        return calls

    evaluated, trained = record(False), record(True)
    sources = [
        name
        for name, calls in evaluated.items()
        if any(
            torch.equal(e_in, t_in) and not torch.equal(e_out, t_out)
            for (e_in, e_out), (t_in, t_out) in zip(calls, trained.get(name, []), strict=False)
        )
    ]
    return [name for name in sources if not any(other.startswith(f"{name}.") for other in sources)]


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
