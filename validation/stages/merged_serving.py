"""Stage `merged_serving`: the policy's merged weights, pushed in place into vLLM, match transformers + LoRA.

The policy adapter (Megatron's from ``lora_coverage`` when that ran, else a seeded random Megatron LoRA) is
loaded into the Megatron model, whose merged weights (base + LoRA, HF names) are streamed into the run's server
in place through the training-time API (``api.merged_weights`` -> ``Server.update_weights``: ``<handler>@0`` ->
``@1``), as a trainer pushes them. The prompt log-probabilities of a few random prompts (one across every
length-dependent structure of the model, ``session.random_prompts``), plus the greedy next token, are compared with
transformers carrying the same adapter. Tolerances: fp32 serving must agree to
float round-off; CPU vLLM runs Gated DeltaNet models in bf16 only, where the limit is bf16's, raised to twice
the distance transformers' own bf16 run keeps from fp32 on the same prompts (``calibrated_tolerance``). The handler's
``vllm`` floors (``DependencyFloor(..., extra="serve")``) are held against the runtime's vLLM version.

The adapter's own merged export (``export_merged``: the checkpoint plus the exported adapter, at the rank and scale
PEFT and vLLM read from its config, what a user serving that adapter merged runs) must equal the weights the
trainer pushes, tensor by tensor over every tensor the adapter changes, within one rounding to the checkpoint's
dtype and 1e-5 beyond it (``export_merged_beyond_rounding``), none missing (``export_tensors_missing``).

The push must also leave no KV block of the old weights in vLLM's prefix cache: a probe prompt cached before the
push reads none of it after (``prefix_cache_tokens_after_push``: 0), and its greedy next token's log-probabilities
equal those of the same prompt under a cache salt of its own (``serving_session.serve_policy_probed``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from model_support.core.serving.errors import ServingError
from model_support.core.serving.vllm_backend import CPU_MOE_LORA_GAP
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import HF_REFERENCES
from model_support.validation.serving_session import POLICY, POLICY_SERVER, SERVER, VLLM_DTYPES
from model_support.validation.stage import Requirement, Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES

if TYPE_CHECKING:
    import torch

# max |log p_vllm - log p_transformers| over prompt tokens, by serving dtype.
LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
# vLLM's own words for "this build cannot run this", each named. Any other serving error is a failure.
# An architecture vLLM's model registry lacks (any build):
_UNSUPPORTED_ARCH = re.compile(r"Model architectures \[.*\] are not supported")
# The CPU build's known gaps (docs/serving.md):
_CPU_BUILD_GAPS = (
    (
        "its GDN kernel rejects this head size",
        re.compile(r"expect head_dim to be multiples of|Unexpected head dim size"),
    ),
    # api.serve refuses it before starting; a server started with it anyway dies on the kernel's first call
    (CPU_MOE_LORA_GAP, re.compile(rf"{re.escape(CPU_MOE_LORA_GAP)}|module 'triton\.language' has no attribute")),
)


def logprob_tolerance(dtype: str) -> float:
    return LOGPROB_TOLERANCE.get(dtype, LOGPROB_TOLERANCE["bfloat16"])


def calibrated_tolerance(
    ctx: CheckContext, adapter: Path, prompts: list[list[int]], reference: list[torch.Tensor], dtype: str
) -> tuple[float, dict[str, float]]:
    """The limit of a served model's prompt log-probabilities against the fp32 reference, and what it was derived
    from. fp32: ``LOGPROB_TOLERANCE``. Below fp32, as the logits are held (``core/megatron/compare.py``): at least
    ``LOWP_TOLERANCE_FACTOR`` times the largest distance transformers' own run in that dtype keeps from its fp32 run on
    the same prompts (a long prompt through Gated DeltaNet and MoE layers drifts further in bf16 than a short one),
    never less than ``LOGPROB_TOLERANCE``."""
    import torch

    from model_support.core.megatron.compare import LOWP_TOLERANCE_FACTOR
    from model_support.validation import serving_session as session

    floor = logprob_tolerance(dtype)
    if dtype == "float32":
        return floor, {}
    low = session.trainer_logprobs(ctx, adapter, prompts, dtype=getattr(torch, dtype))
    own = max(
        (session.token_logprobs(lo, p, 1) - session.token_logprobs(ref, p, 1)).abs().max().item()
        for p, lo, ref in zip(prompts, low, reference, strict=True)
    )
    return max(floor, LOWP_TOLERANCE_FACTOR * own), {f"reference_{dtype}_prompt_logprob_max_abs_err": own}


def cannot_serve(stage: Stage, ctx: CheckContext, exc: ServingError) -> StageResult:
    """A serving error: a skip only where vLLM itself says the build cannot run the model or feature (an
    architecture its registry lacks, a named gap of the CPU build); any other error fails the stage with
    vLLM's own error line and the path of its log."""
    from model_support.core.serving.runtime import load_runtime

    runtime = load_runtime()
    arch = (getattr(ctx.config, "architectures", None) or ["the model"])[0]
    text = str(exc)
    if _UNSUPPORTED_ARCH.search(text):
        return stage.skipped(f"vLLM {runtime.vllm_version} has no implementation of {arch}: {text}")
    if runtime.flavor == "cpu":
        for gap, pattern in _CPU_BUILD_GAPS:
            if pattern.search(text):
                return stage.skipped(
                    f"the CPU vLLM build ({runtime.distribution} {runtime.vllm_version}) cannot run {arch}: {gap} "
                    f"({text})"
                )
    return stage.failed(f"vLLM {runtime.vllm_version} failed serving {arch}: {text}")


# The adapter's merged export against the trainer's merged weights: beyond one rounding to the checkpoint's dtype (the
# two merge the same fp32 sums in another order), as parallel_parity holds its layouts' merged weights.
EXPORT_BEYOND_ROUNDING = 1e-5


def export_agreement(ctx: CheckContext, adapter: Path) -> dict[str, float | int]:
    """How far ``export_merged`` of the exported adapter (what a user merging the adapter into the checkpoint
    serves) lands from the policy model's own merged weights (``api.merged_weights``, what a push sends), over
    every tensor the adapter changes: the largest distance beyond one rounding (to the training dtype where it is
    coarser than the checkpoint's: a bf16 trainer holds an fp32 checkpoint in bf16 and rounds its merge to bf16),
    and how many of those tensors the trainer's weights lack. Stacked-expert modules (an adapter's
    ``target_parameters``, gpt-oss's experts) name no checkpoint tensor: ``export_merged`` refuses them, and they
    are counted apart (``export_modules_unmerged``)."""
    import torch

    from model_support.core import api
    from model_support.core.megatron.compare import beyond_rounding
    from model_support.core.serving.export import adapter_deltas, checkpoint_names, merged_subset
    from model_support.validation import serving_session as session

    names, every = checkpoint_names(ctx.model_dir), adapter_deltas(adapter)
    deltas = {name: delta for name, delta in every.items() if name in names}
    # The trainer merges into the checkpoint as its model holds it, in the training dtype, and rounds to it.
    held_in = torch.bfloat16 if ctx.training_dtype == "bf16" else None
    worst, seen = 0.0, set[str]()
    for bucket in api.merged_weights(session.policy_model(ctx)):
        for name, exported in merged_subset(ctx.model_dir, deltas, [n for n in bucket if n in deltas], held_in):
            # The export is read from the checkpoint on the host; a push's buckets are on the trainer's device.
            trainer = bucket[name].to(exported.device)
            if held_in is not None:  # the trainer's merge is rounded to its dtype before the checkpoint's
                exported, trainer = exported.to(held_in), trainer.to(held_in)
            worst = max(worst, beyond_rounding(exported, trainer))
            seen.add(name)
    return {
        "export_merged_beyond_rounding": worst,
        "export_tensors_compared": len(seen),
        "export_tensors_missing": len(deltas) - len(seen),
        "export_modules_unmerged": len(every) - len(deltas),
    }


class MergedServingStage(Stage):
    name = "merged_serving"
    title = "vLLM serving the merged LoRA export matches transformers + the adapter (prompt and next-token logprobs)."
    order = 70
    packages: ClassVar = (Requirement("peft", "peft", "dev"), *MEGATRON_PACKAGES)
    needs = (*POLICY, SERVER, POLICY_SERVER, HF_REFERENCES)
    prompts, prompt_len = 2, 24  # and one long prompt (session.random_prompts)

    def skip_reason(self, ctx: CheckContext) -> str | None:
        from model_support.validation.serving_session import backend

        return backend().unavailable_reason()

    def prepare(self, ctx: CheckContext) -> None:
        from model_support.validation.serving_session import prestart_policy

        prestart_policy(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        import torch
        from packaging.version import Version

        from model_support.validation import serving_session as session

        version = session.backend().version()
        for floor in ctx.spec.dependencies:
            if floor.extra == "serve" and floor.package == "vllm" and Version(version) < Version(floor.minimum):
                return self.failed(
                    f"the vLLM runtime has {version} < {floor.minimum} ({floor.reason}); "
                    f"run `model-support runtime install --version {floor.minimum}` or newer"
                )
        adapter, origin = session.policy_adapter(ctx)
        prompts = session.random_prompts(ctx, self.prompts, self.prompt_len)
        try:
            server, cache = session.serve_policy_probed(ctx)
            choices = [
                server.completion(p, max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0) for p in prompts
            ]
        except ServingError as exc:
            return cannot_serve(self, ctx, exc)
        export = export_agreement(ctx, adapter)
        reference = session.trainer_logprobs(ctx, adapter, prompts)
        deltas, regrets = [], []
        for prompt, choice, ref in zip(prompts, choices, reference, strict=True):
            served = session.served_prompt_logprobs(choice, prompt)
            deltas.append((served - session.token_logprobs(ref, prompt, 1)).abs())
            greedy = choice["token_ids"][0]
            regrets.append((ref[-1].max() - ref[-1, greedy]).item())
        delta = torch.cat(deltas)
        dtype = server.options.dtype
        # The served weights are the trainer's: held in bf16, they carry bf16's rounding even where served in fp32.
        judged = dtype if ctx.training_dtype == "fp32" else VLLM_DTYPES[ctx.training_dtype]
        tol, own = calibrated_tolerance(ctx, adapter, prompts, reference, judged)
        metrics = {
            **own,
            **export,
            **(cache or {}),
            "prompt_logprob_max_abs_err": delta.max().item(),
            "prompt_logprob_mean_abs_err": delta.mean().item(),
            "greedy_regret_max": max(regrets),
            "tokens_compared": delta.numel(),
            "prompt_lengths": "+".join(str(len(p)) for p in prompts),
            "serving_dtype": dtype,
            "served_model": server.served_name,
        }
        details = [
            "serving dtype {}: {}".format(*session.serving_dtype(ctx)),
            f"adapter: {origin}; merged into the fp32 transformers reference",
            f"policy weights merged in the Megatron model ({session.policy_model(ctx).describe()}), "
            + (
                f"served from a checkpoint of their own as {server.served_name} ({gap})"
                if (gap := session.inplace_gap(ctx))
                else f"pushed in place: served as {server.served_name}"
            ),
            "greedy_regret = log p_ref(argmax) - log p_ref(vLLM's greedy token), per prompt: "
            + ", ".join(f"{r:.2e}" for r in regrets),
            f"export_merged of the adapter against the trainer's merged weights: {export['export_tensors_compared']} "
            "tensors the adapter changes"
            + (
                f" ({export['export_modules_unmerged']} stacked-expert modules not compared: export_merged does not "
                "merge an adapter's target_parameters)"
                if export["export_modules_unmerged"]
                else ""
            ),
        ]
        limits = {
            "prompt_logprob_max_abs_err": tol,
            "greedy_regret_max": tol,
            "export_merged_beyond_rounding": EXPORT_BEYOND_ROUNDING,
            "export_tensors_missing": 0,
        }
        if cache is None:
            details.append("prefix cache after the push: not probed (no push in place in this stage)")
        elif not cache["prefix_cache_tokens_before_push"]:
            details.append("prefix cache after the push: not probed (the server cached none of the probe's blocks)")
        else:
            details.append(
                f"prefix cache: {cache['prefix_cache_tokens_before_push']} probe tokens read from it before the push, "
                f"{cache['prefix_cache_tokens_after_push']} after; the next token's top log-probabilities against a "
                f"cache salt of its own: {cache['prefix_cache_logprob_max_abs_err']:.2e}"
            )
            limits |= {"prefix_cache_tokens_after_push": 0, "prefix_cache_logprob_max_abs_err": tol}
        return self.judge(
            metrics,
            limits,
            f"{metrics['tokens_compared']} prompt tokens within {tol:g} ({judged})",
            details,
            ctx=ctx,
        )
