"""Stage `lora_gradients`: the loss and every LoRA factor's gradient match transformers carrying the same adapter."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

# LOWP_TOLERANCE_FACTOR is re-exported so the stage reference (docs/stages.md) lists it for this stage.
from model_support.core.megatron.compare import LOWP_FLOOR, LOWP_TOLERANCE_FACTOR
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import HF_REFERENCES, LORA, TRAINING_MODEL
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.state import Resource

if TYPE_CHECKING:
    from model_support.core.megatron.hf_reference import LoraDelta

__all__ = [
    "GRADIENT_FP32_TOLERANCES",
    "LOWP_TOLERANCE_FACTOR",
    "REFERENCE_LOWP_GRAD_ERROR",
    "LoraGradientsStage",
    "megatron_gradients",
    "reference_gradient_lowp",
]

# fp32 tolerances of each case (metric names take the case's prefix, ``long_`` or ``packed_``): max |ours - reference| /
# max |reference| of the per-token losses, and of the worst LoRA factor's gradient.
GRADIENT_FP32_TOLERANCES = {"loss_rel_err": 1e-4, "grad_worst_factor_rel_err": 1e-4}
# The adapter must change the per-token losses by this many times what their comparison lets pass (the ratio of
# compare.EFFECT_FLOOR for logits).
EFFECT_MARGIN = 10.0
# Seeds (offsets from the run's): this stage's random adapter, its long row and its packed sequences.
ADAPTER_SEED, LONG_ROW_SEED, PACKED_SEED = 5, 30, 31
SHORT_SEQUENCE = 9  # the packed row's middle sequence


@dataclass
class GradientRun:
    """One way of running the rows: each predicted token's cross entropy (the rows' in order; the loss is their sum)
    and each LoRA factor's gradient, keyed by the Megatron factor it is (canonical, tensor-parallel-1 layout)."""

    losses: torch.Tensor
    grads: dict[str, torch.Tensor]


def token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each next token of one sequence (``logits`` [S, V], ``tokens`` [S]): [S - 1]."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), tokens[1:].to(logits.device), reduction="none")


def packed_lengths(length: int) -> tuple[int, int, int]:
    """Three sequences filling a row of ``length`` tokens: a third of it and one token (past a 64-token GDN chunk on
    a 193-token row), a short one, the rest; the later two do not start on a chunk boundary."""
    first = length // 3 + 1
    return first, SHORT_SEQUENCE, length - first - SHORT_SEQUENCE


def factor_gradients(weight_grads: dict[str, torch.Tensor], deltas: dict[str, LoraDelta]) -> dict[str, torch.Tensor]:
    """PEFT-named gradients of the factors of each adapter module whose checkpoint tensor ``weight_grads`` holds the
    gradient ``G`` of: ``W' = W + s B A`` gives ``dL/dA = s B^T G`` and ``dL/dB = s G A^T`` (float64 on ``G``'s
    device, returned on the CPU)."""
    from model_support.core.codecs import PEFT_PREFIX, stack_experts
    from model_support.core.megatron.hf_reference import StackedLoraDelta

    out = {}
    for key, delta in deltas.items():
        if key not in weight_grads:
            continue
        grad = weight_grads[key].detach().double()
        if isinstance(delta, StackedLoraDelta):  # expert e's [in, out] slice holds (s B_e A_e)^T: transposed G_e
            per_expert = []
            for g, (a, b) in zip(grad, delta.factors(), strict=True):
                a, b = a.to(g.device, torch.float64), b.to(g.device, torch.float64)
                per_expert.append(((delta.scale * b.T @ g.T).cpu(), (delta.scale * g.T @ a.T).cpu()))
            grad_a, grad_b = stack_experts(per_expert)
            out[f"{delta.peft_module}.lora_A.weight"], out[f"{delta.peft_module}.lora_B.weight"] = grad_a, grad_b
            continue
        a, b = delta.lora_a.to(grad.device, torch.float64), delta.lora_b.to(grad.device, torch.float64)
        module = PEFT_PREFIX + key.removesuffix(".weight")
        out[f"{module}.lora_A.weight"] = (delta.scale * b.T @ grad).cpu()
        out[f"{module}.lora_B.weight"] = (delta.scale * grad @ a.T).cpu()
    return out


def megatron_gradients(
    ctx: Any, state: dict[str, torch.Tensor], peft: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """PEFT-named factor gradients in Megatron's canonical layout, through the handler's codec: a fused Megatron
    module's one A is shared by the HF modules it covers, so its gradient is the sum of theirs; its B's rows are
    theirs, so its gradient is the codec's assembly of their B gradients (``from_peft``). ``state``: the Megatron
    adapter, whose modules ``to_peft`` maps to the HF modules they cover."""
    from model_support.core.codecs import PEFT_STACKED

    codec, out = ctx.spec.codec, {}
    # Stacked experts' LoRA has one A and one B per expert: their gradients convert as they are.
    stacked = {key: grad for key, grad in peft.items() if PEFT_STACKED.match(key)}
    if stacked:
        out |= codec.from_peft(stacked, ctx.config, ctx.layout)
    for module in sorted({key.rsplit(".lora_", 1)[0] for key in state}):
        if f"{module}.lora_A.weight" in out:
            continue
        factors = {f"{module}.lora_{w}.weight": state[f"{module}.lora_{w}.weight"] for w in "AB"}
        covered = codec.to_peft(factors, ctx.config, ctx.layout)
        a_keys = [key for key in covered if key.endswith(".lora_A.weight")]
        shared_a = sum(peft[key] for key in a_keys)
        grads = {key: shared_a if key in a_keys else peft[key] for key in covered}
        out |= codec.from_peft(grads, ctx.config, ctx.layout)
    return out


def reference_gradient_lowp(ctx: Any) -> dict[str, float] | None:
    """transformers' own distance below fp32 on LoRA gradients (:func:`closeness` of every factor's gradient as one
    vector, in Megatron's layout; the worst of the stage's two cases), on this stage's adapter and rows with the fp32
    run's routing; ``None`` for an fp32 model. The stage measures it as it compares; this is the same measurement
    where the stage has not run. The model's adapter is put back as it was."""
    from model_support.core.megatron.compare import closeness
    from model_support.core.megatron.hf_reference import adapter_deltas
    from model_support.core.megatron.lora import lora_state
    from model_support.validation.megatron_session import export_random_lora, worst_lowp

    model = ctx.state.get(TRAINING_MODEL).built
    dtype = model.numerics.dtype
    if dtype == torch.float32:
        return None
    deltas = adapter_deltas(export_random_lora(ctx, ADAPTER_SEED, ctx.workdir / "gradient-lowp-adapter"))
    state = lora_state(model.model)  # its modules' names: megatron_gradients maps the factors by them
    cases = gradient_cases(ctx)
    exact, routings = reference_runs(ctx, torch.float32, deltas, cases)
    rounded, _ = reference_runs(ctx, dtype, deltas, cases, replay=routings)
    found = []
    for case in cases:
        ref, low = (megatron_gradients(ctx, state, run[case][1]) for run in (exact, rounded))
        found.append(closeness(flat_gradients(low, sorted(ref)), flat_gradients(ref, sorted(ref))))
    return worst_lowp(found)


def flat_gradients(grads: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The gradients of ``names``, in that order, as one vector."""
    return torch.cat([grads[n].flatten() for n in names])


def gradient_cases(ctx: Any) -> dict[str, list[torch.Tensor]]:
    """The stage's rows: ``long``, one row across every length-dependent structure of the model; ``packed``, three
    sequences of the same total length (:func:`packed_lengths`)."""
    from model_support.validation.megatron_session import long_row, random_tokens

    length = long_row(ctx)
    return {
        "long": [random_tokens(ctx, (1, length), offset=LONG_ROW_SEED)],
        "packed": [random_tokens(ctx, (1, n), offset=PACKED_SEED + i) for i, n in enumerate(packed_lengths(length))],
    }


REFERENCE_LOWP_GRAD_ERROR: Resource[dict[str, float] | None] = Resource(
    "reference_lowp_grad_error",
    "how far transformers' own LoRA gradients in the model's dtype land from its fp32 ones, every factor as one "
    "vector, on lora_gradients' rows (None for an fp32 model): provided by lora_gradients as it compares, measured on "
    "first use where it has not run",
    reference_gradient_lowp,
    uses=(TRAINING_MODEL, HF_REFERENCES, LORA),
)


def reference_runs(
    ctx: Any,
    dtype: torch.dtype,
    deltas: dict[str, LoraDelta],
    cases: dict[str, list[torch.Tensor]],
    replay: dict[str, list[list[torch.Tensor]]] | None = None,
) -> tuple[dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]], dict[str, list[list[torch.Tensor]]]]:
    """Each case's rows ([1, S] each) alone through the transformers model in ``dtype`` carrying the adapter, the
    gradient of their summed token cross entropy streamed one layer at a time: per case (its per-token losses, its
    PEFT factor gradients), and each case's routing per row (or takes ``replay``'s)."""
    from model_support.core.megatron.dist import device
    from model_support.core.megatron.hf_reference import streamed_gradients

    def loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return token_losses(logits[0], tokens[0])

    run = streamed_gradients(
        ctx.model_dir, ctx.config, device(), dtype, deltas, cases, loss, lambda g: factor_gradients(g, deltas), replay
    )
    return {case: (run.losses[case], run.grads[case]) for case in cases}, run.routing


def megatron_run(ctx: Any, rows: list[torch.Tensor], routing: list[list[torch.Tensor]]) -> GradientRun:
    """The rows packed into one row (position ids restarting at 0 at each; a single row runs unpacked) through the
    trainer's step (``api.forward_backward``: megatron-core's schedule), the loss each row's summed token cross
    entropy, each MoE router replaying the rows' ``routing`` (:func:`reference_runs`')."""
    from model_support.core import api
    from model_support.core.megatron.compare import replayed_routing
    from model_support.core.megatron.lora import lora_state
    from model_support.validation.megatron_session import training_mode

    trainer = ctx.state.get(TRAINING_MODEL)
    model = trainer.module
    row = torch.cat(rows, dim=1)
    positions = torch.cat([torch.arange(r.shape[1]) for r in rows])[None] if len(rows) > 1 else None
    bounds = list(itertools.pairwise(itertools.accumulate((r.shape[1] for r in rows), initial=0)))

    losses: list[torch.Tensor] = []  # the step's one micro-batch's per-token losses

    def loss_fn(logits: torch.Tensor, _micro: Any) -> torch.Tensor:
        per_token = torch.cat([token_losses(logits[0, s:e], row[0, s:e]) for s, e in bounds])
        losses.append(per_token.detach())
        return per_token.sum()

    model.zero_grad(set_to_none=True)
    replay = [torch.cat(calls) for calls in zip(*routing, strict=True)]
    with replayed_routing(model, replay, batch=1), training_mode(model):
        api.forward_backward(trainer, row, loss_fn, position_ids=positions)
    # The whole model's gradients on every rank (every data-parallel replica ran the same row).
    api.reduce_lora_grads(trainer)
    grads = {name: grad.double().cpu() for name, grad in lora_state(model, grads=True).items()}
    model.zero_grad(set_to_none=True)
    return GradientRun(torch.cat(losses).double().cpu(), grads)


def worst_factor(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[str, float, int]:
    """(name, error) of the factor with the largest max |ours - ref| / max |ref|, and how many factors have an
    all-zero reference gradient (no token reached them; their error is max |ours|, 0 when both are zero)."""
    errors, zero = {}, 0
    for name, grad in ref.items():
        scale, diff = grad.abs().max().item(), (ours[name] - grad).abs().max().item()
        zero += scale == 0
        errors[name] = diff / scale if scale > 0 else diff
    name = max(errors, key=errors.__getitem__)
    return name, errors[name], zero


def tolerance_note(dtype: torch.dtype) -> str:
    """One line saying what the loss and gradients of a ``dtype`` model are held to."""
    if dtype == torch.float32:
        return "tolerances (torch.float32), each case: " + ", ".join(
            f"{k} <= {v:g}" for k, v in GRADIENT_FP32_TOLERANCES.items()
        )
    return (
        f"tolerances ({dtype}), each case: the per-token losses and all factor gradients (as one vector) at most "
        f"{LOWP_TOLERANCE_FACTOR:g}x as far from fp32 as transformers' own {dtype} run (same adapter, tokens and "
        f"routing), floors {LOWP_FLOOR}"
    )


class LoraGradientsStage(Stage):
    """The Megatron model with a random non-zero adapter and the transformers model carrying the same adapter
    (written by the handler's codec as a PEFT adapter, merged into the checkpoint's tensors) run the same loss, the
    summed token cross entropy: on a long row (across every length-dependent structure, e.g. three GDN chunks) and
    on a packed row of three sequences (position ids restarting at 0, through the trainer's step,
    ``api.forward_backward``; transformers runs each sequence alone and sums). Every token's loss and every LoRA
    factor's gradient, A and B, must agree.

    The reference is the fp32 transformers model streamed one decoder layer at a time, forward and then backward
    (``streamed_gradients``: one layer's weights in memory, so a checkpoint larger than the GPU is checked on it,
    each rank of a sharded check doing the same): the gradient ``G`` of each adapted checkpoint tensor
    (transformers' own save-path conversion splits fused expert parameters back into the checkpoint's per-expert
    tensors) gives the PEFT factors' gradients, ``s B^T G`` and ``s G A^T``; the codec maps them into Megatron's
    layout (a fused module's A gradient is the sum over the HF modules sharing it, its B gradient the rows of
    theirs). PEFT's own LoRA layers are not used: PEFT 0.21 cannot place per-expert adapters on transformers 5's
    fused Qwen3.5-MoE experts. MoE routers replay the reference's routing, so a near tie cannot flip. Its attention
    runs the memory-efficient SDPA kernel, or for a family on eager attention (gpt-oss, whose sinks SDPA cannot
    take) the family's own eager attention a block of queries at a time: each layer's backward holds O(S) attention
    memory (a block of queries: at most 256 MiB of scores), not [heads, S, S] scores.

    fp32: max |diff| / max |reference| at most 1e-4 for the per-token losses (``loss_rel_err``) and for the worst
    factor's gradient (``grad_worst_factor_rel_err``, named in ``grad_worst_factor``; a factor no token reached
    has an all-zero reference and is held to max |ours| instead). Below fp32 the per-token losses and all gradients
    as one vector are held (relative L2, mean-abs percent) to ``LOWP_TOLERANCE_FACTOR`` times the distance of
    transformers' own run in that dtype (same adapter, tokens and routing) from fp32, with floors. Control: the
    adapter must change the long row's per-token losses (relative L2, ``adapter_effect_loss_rel_l2``) by ten times
    what their comparison lets pass, so a wrong adapter cannot pass. Catches a LoRA branch whose input is detached
    (no gradient through the branch into earlier layers) and a B gradient missing the LoRA scale, which every
    Megatron-against-itself comparison shares (and Adam's step hides)."""

    name = "lora_gradients"
    title = "The loss and every LoRA factor's gradient match the fp32 transformers model carrying the same adapter."
    order = 45
    sharded = True
    requires = ("lora_coverage",)
    packages = MEGATRON_PACKAGES
    needs = (TRAINING_MODEL, LORA)
    provides = (REFERENCE_LOWP_GRAD_ERROR,)

    def skip_reason(self, ctx: CheckContext) -> str | None:
        if ctx.spec.codec is None:
            return f"handler {ctx.spec.name} declares no LoRA codec"
        return None

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core import api
        from model_support.core.megatron.compare import closeness, replayed_routing, tolerances
        from model_support.core.megatron.hf_reference import adapter_deltas
        from model_support.core.megatron.lora import lora_state
        from model_support.validation.megatron_session import crossing, with_random_lora, worst_lowp
        from model_support.validation.stages.lora_coverage import logits_without_lora

        built = with_random_lora(ctx, offset=ADAPTER_SEED)
        model, dtype = built.model, built.numerics.dtype
        state = lora_state(model)
        adapter_dir = api.export_adapter(ctx.state.get(TRAINING_MODEL), ctx.workdir / "lora-gradients-adapter")
        deltas = adapter_deltas(adapter_dir)
        cases = gradient_cases(ctx)
        length = cases["long"][0].shape[1]
        lengths = [row.shape[1] for row in cases["packed"]]

        def in_megatron_layout(run: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> GradientRun:
            losses, peft = run
            return GradientRun(losses, megatron_gradients(ctx, state, peft))

        # The fp32 reference, then (below fp32) transformers' own run in the model's dtype on the same routing.
        runs, routings = reference_runs(ctx, torch.float32, deltas, cases)
        refs = {case: in_megatron_layout(run) for case, run in runs.items()}
        lows: dict[str, GradientRun] = {}
        if dtype != torch.float32:
            runs, _ = reference_runs(ctx, dtype, deltas, cases, replay=routings)
            lows = {case: in_megatron_layout(run) for case, run in runs.items()}

        metrics: dict[str, Any] = {
            "dtype": built.numerics.dtype_name,
            "long_tokens": length,
            "packed_tokens": sum(lengths),
            "packed_sequences": len(lengths),
        }
        thresholds: dict[str, float] = {}
        lowp_grads: list[dict[str, float]] = []
        details = [f"adapter written to {adapter_dir}, merged into the transformers model's checkpoint tensors"]
        found, limits, missed = crossing(ctx, length)
        metrics |= found
        thresholds |= limits
        details += missed
        for case, rows in cases.items():
            ours, ref = megatron_run(ctx, rows, routings[case]), refs[case]
            if set(ours.grads) != set(ref.grads):
                missing = sorted(set(ours.grads) ^ set(ref.grads))
                return self.failed(f"{case}: the codec's factors differ from the model's LoRA factors: {missing[:3]}")
            names = sorted(ref.grads)

            def flat(run: GradientRun, names: list[str] = names) -> torch.Tensor:
                return flat_gradients(run.grads, names)

            worst, error, zero = worst_factor(ours.grads, ref.grads)
            grads = closeness(flat(ours), flat(ref))
            metrics |= {
                f"{case}_loss": ref.losses.sum().item(),
                **closeness(ours.losses, ref.losses, prefix=f"{case}_loss_"),
                f"{case}_factors": len(names),
                f"{case}_zero_reference_factors": zero,
                f"{case}_grad_worst_factor_rel_err": error,
                f"{case}_grad_worst_factor": worst,
                f"{case}_grad_rel_l2": grads["rel_l2"],
                f"{case}_grad_mean_abs_pct": grads["mean_abs_pct"],
            }
            if case in lows:
                lowp_loss = closeness(lows[case].losses, ref.losses)
                lowp_grad = closeness(flat(lows[case]), flat(ref))
                lowp_grads.append(lowp_grad)
                thresholds |= tolerances(dtype, prefix=f"{case}_loss_", reference_lowp=lowp_loss)
                thresholds |= tolerances(dtype, prefix=f"{case}_grad_", reference_lowp=lowp_grad)
                metrics |= {f"{case}_reference_{metrics['dtype']}_loss_rel_l2": lowp_loss["rel_l2"]}
                metrics |= {f"{case}_reference_{metrics['dtype']}_grad_{k}": v for k, v in lowp_grad.items()}
            else:
                thresholds |= {f"{case}_{k}": v for k, v in GRADIENT_FP32_TOLERANCES.items()}
            details.append(
                f"{case}: {len(rows)} sequence(s) of {[r.shape[1] for r in rows]} tokens, {len(names)} LoRA factors, "
                f"worst {worst} ({error:.2e})"
            )

        ctx.state.set(REFERENCE_LOWP_GRAD_ERROR, worst_lowp(lowp_grads) if lowp_grads else None)
        # Control: the long row's per-token losses without the adapter (every LoRA scaled to zero), same routing.
        tokens = cases["long"][0]
        with torch.no_grad(), replayed_routing(model, routings["long"][0], batch=1):
            base = token_losses(logits_without_lora(model, tokens)[0], tokens[0])
        effect = closeness(refs["long"].losses, base)["rel_l2"]
        metrics["adapter_effect_loss_rel_l2"] = effect
        # What the loss comparison lets pass: its relative L2 limit below fp32, its max-relative one in fp32.
        loss_limit = thresholds.get("long_loss_rel_l2", thresholds.get("long_loss_rel_err"))
        details.append(tolerance_note(dtype))
        why = "the random adapter changes the loss too little for the comparison to see a wrong adapter"
        return self.blind(
            "adapter_effect_loss_rel_l2",
            effect,
            EFFECT_MARGIN * loss_limit,
            why,
            metrics=metrics,
            thresholds=thresholds,
            details=details,
        ) or self.judge(
            metrics,
            thresholds,
            f"loss and {metrics['long_factors']} LoRA factor gradients match transformers on a {length}-token row "
            f"and {len(lengths)} packed sequences ({metrics['dtype']})",
            details,
            ctx=ctx,
        )
