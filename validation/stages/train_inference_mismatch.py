"""Stage `train_inference_mismatch`: the trainer and the server give the same log-probabilities to the same samples.

Completions of random prompts (one across every length-dependent structure of the model) are sampled from the
server holding the policy (its merged weights pushed in place from the Megatron
model; temperature 1, the server seeded); the trainer, the Megatron model carrying the same adapter, scores the same
prompt + completion ids in one packed forward (``api.token_logprobs``). Per sampled token,
``delta = log p_server - log p_trainer``; the report gives mean and max ``|delta|`` and the KL(server || trainer)
estimate ``k3 = exp(-delta) - 1 + delta`` averaged over tokens (unbiased under the server's samples). This is the
number an on-policy RL run depends on, and what catches weights that were pushed but landed in the wrong place.
transformers (fp32, adapter merged) scores the same ids as the oracle each side is also held to on its own: the
server against it (``hf_*``) and the trainer against it (``megatron_hf_*``). Below fp32 (the lower of the server's
and the trainer's dtype) each side may drift from fp32 at least twice transformers' own distance in that dtype from
its fp32 run on the same ids (the KL four times its own), as the Megatron stages' limits are (``mismatch_tolerance``);
where server and trainer both run below fp32 they may drift apart by the sum of their two allowances, and the sides'
own limits are what catches either one going wrong.

Routing replay (R3): for an MoE model whose server returns each token's routed experts (vLLM on a GPU,
``serving_session.routing_gap``), the trainer scores the same samples again with the server's experts replayed
(``replayed_*``, held to the server-vs-trainer limits), and ``routed_as_served`` is the share of token-layers the
trainer routes as the server did on its own; elsewhere the details say why it was not measured.

Beside these, ART's two figures for the same samples, reported with ART's limits and not judged: the mean
``|p_server - p_trainer|`` of the sampled tokens (``art_prob_abs_diff_mean``; ART asks <= 4%) and KL(server ||
trainer) over the server's top 20 tokens at each sampled position (``art_top20_kl_mean``; ART asks <= 0.002).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model_support.core.serving.errors import ServingError
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import HF_REFERENCES
from model_support.validation.serving_session import POLICY, POLICY_SERVER, SERVER
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.stages.merged_serving import cannot_serve

# By serving dtype. fp32 serving must agree to round-off. In bf16 the mean is what matters: single tokens can
# move by a few tenths where bf16 flips an MoE router's top-k choice (measured on the tiny Qwen3.5-MoE: max
# |delta| 0.25 with mean KL 9e-4; dense Qwen3.5: max 0.04, mean KL 5e-5).
MISMATCH_TOLERANCE = {
    "float32": {"abs_delta_logprob_max": 1e-4, "abs_delta_logprob_mean": 1e-5, "kl_mean": 1e-8},
    "bfloat16": {"abs_delta_logprob_max": 0.5, "abs_delta_logprob_mean": 0.05, "kl_mean": 1e-2},
}


def mismatch_tolerance(dtype: str, reference: dict[str, float] | None = None, sides: int = 1) -> dict[str, float]:
    """The limits for ``dtype``; with ``reference`` (transformers' own ``abs_delta_logprob_mean`` / ``_max`` and
    ``kl_mean`` between its run in ``dtype`` and its fp32 run, on the same sampled tokens) each limit is at least
    ``LOWP_TOLERANCE_FACTOR`` times that distance for each of the ``sides`` compared runs that are in ``dtype``, as
    the Megatron stages' are (the KL, quadratic in delta, its square times): a wider or deeper model drifts further in
    bf16 (an MoE model most, where rounding flips its routers' choices), each bf16 implementation of one policy may
    drift that far from fp32, and two of them apart by the sum (per token, ``|a - b| <= |a - f| + |f - b|``)."""
    from model_support.core.megatron.compare import LOWP_TOLERANCE_FACTOR

    limits = dict(MISMATCH_TOLERANCE.get(dtype, MISMATCH_TOLERANCE["bfloat16"]))
    for key, own in (reference or {}).items():
        factor = (sides * LOWP_TOLERANCE_FACTOR) ** (2 if key == "kl_mean" else 1)
        limits[key] = max(limits[key], factor * own)
    return limits


# ART's figures: how many of the server's most likely tokens its top-k KL covers, and its limits.
ART_TOP_K = 20
ART_LIMITS = {"art_prob_abs_diff_mean": 0.04, "art_top20_kl_mean": 0.002}


# The measures whose limits below fp32 scale with transformers' own distance (``mismatch_tolerance``).
CALIBRATED = ("abs_delta_logprob_mean", "abs_delta_logprob_max", "kl_mean")


def calibration(
    dtype: str, reference: dict[str, float] | None, limits: dict[str, float], sides: int = 1, label: str = ""
) -> list[str]:
    """The details line saying how far transformers' own ``dtype`` run keeps from its fp32 one (``reference``, the
    worst over what was compared) and the limits that gave ``sides`` runs in ``dtype`` (none where nothing was
    measured); ``label`` names the comparison."""
    from model_support.core.megatron.compare import LOWP_TOLERANCE_FACTOR

    if reference is None:
        return []
    factor = sides * LOWP_TOLERANCE_FACTOR
    own = (
        f"|delta| mean {reference['abs_delta_logprob_mean']:.2e}, max {reference['abs_delta_logprob_max']:.2e}; the KL "
        f"{factor**2:g}x its {reference['kl_mean']:.2e}"
    )
    held = (
        f"|delta| mean {limits['abs_delta_logprob_mean']:.3g}, max {limits['abs_delta_logprob_max']:.3g}, KL "
        f"{limits['kl_mean']:.3g}"
    )
    runs = "" if sides == 1 else f" ({LOWP_TOLERANCE_FACTOR:g}x for each of {sides} runs in {dtype})"
    return [
        f"limits{label}: at least {factor:g}x transformers' own {dtype} distance from its fp32 run{runs} on the same "
        f"sampled tokens ({own}): {held}"
    ]


def topk_kl(top: dict[int, float], trainer: torch.Tensor) -> float:
    """KL(server || trainer) over the server's top-k tokens (token id -> log-probability), both renormalised on
    that set."""
    ids = torch.tensor(list(top))
    served = torch.log_softmax(torch.tensor(list(top.values()), dtype=torch.float64), dim=0)
    ours = torch.log_softmax(trainer[ids].double(), dim=0)
    return float((served.exp() * (served - ours)).sum())


def art_figures(served: torch.Tensor, ours: torch.Tensor, tops: list[dict[int, float]], rows: torch.Tensor) -> dict:
    """ART's mismatch figures for sampled tokens: ``served`` and ``ours`` their log-probabilities on the server and
    the trainer, ``tops`` the server's top-k at each, ``rows`` the trainer's log-softmax at each."""
    return {
        "art_prob_abs_diff_mean": (served.exp() - ours.double().exp()).abs().mean().item(),
        "art_top20_kl_mean": sum(topk_kl(top, row) for top, row in zip(tops, rows, strict=True)) / len(tops),
    }


def mismatch(delta: torch.Tensor) -> dict[str, float]:
    """mean / max ``|delta|`` and the k3 KL estimate from per-token ``log p_server - log p_trainer``."""
    k3 = torch.exp(-delta) - 1 + delta
    return {
        "kl_mean": k3.mean().item(),
        "kl_max": k3.max().item(),
        "abs_delta_logprob_mean": delta.abs().mean().item(),
        "abs_delta_logprob_max": delta.abs().max().item(),
    }


class TrainInferenceMismatchStage(Stage):
    name = "train_inference_mismatch"
    title = "Per-token logprobs of server samples agree between the Megatron trainer and the server (KL, |delta|)."
    order = 100
    requires = ("merged_serving",)
    packages = MEGATRON_PACKAGES
    needs = (*POLICY, SERVER, POLICY_SERVER, HF_REFERENCES)
    # Three short prompts and one long one (session.random_prompts), 64 tokens sampled from each: 256 tokens. The
    # figures of fewer are not steady enough for limits of twice transformers' own: on 48 tokens its own bf16 run of
    # a Qwen3.5-35B-A3B-width replica is 0.51 to 1.21 (max |delta|) and 0.017 to 0.051 (KL) from fp32 draw to
    # draw, on 192 0.87 to 1.21 and 0.025 to 0.034 (benchmarks/reference_drift.py --draw, docs/gpu-validation.md).
    prompts, prompt_len, max_tokens = 3, 8, 64

    def prepare(self, ctx: CheckContext) -> None:
        from model_support.validation.serving_session import prestart_policy

        prestart_policy(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.validation import serving_session as session

        adapter, origin = session.policy_adapter(ctx)
        prompts = session.random_prompts(ctx, self.prompts, self.prompt_len)
        try:
            server = session.serve_policy(ctx)
            # No per-request seed: vLLM 0.32's CPU build cannot rewind a request's generator when it schedules a long
            # prompt's prefill in parts ("CPU Generator does not use offset"); the server's own seed keeps runs
            # reproducible.
            samples = [
                server.completion(
                    p,
                    max_tokens=self.max_tokens,
                    temperature=1.0,
                    logprobs=ART_TOP_K,
                    return_tokens_as_token_ids=True,  # top-k keyed "token_id:<id>", not by ambiguous text
                    ignore_eos=True,
                )
                for p in prompts
            ]
        except ServingError as exc:
            return cannot_serve(self, ctx, exc)
        sequences = [p + list(s["token_ids"]) for p, s in zip(prompts, samples, strict=True)]
        served = torch.cat([torch.tensor(s["logprobs"]["token_logprobs"], dtype=torch.float64) for s in samples])
        tops = [
            {int(key.removeprefix("token_id:")): lp for key, lp in top.items()}
            for s in samples
            for top in s["logprobs"]["top_logprobs"]
        ]
        trainers = {
            "": session.megatron_logprobs(ctx, sequences),
            "hf_": session.trainer_logprobs(ctx, adapter, sequences),
        }

        def sampled(rows: list[torch.Tensor]) -> torch.Tensor:
            pairs = zip(prompts, sequences, rows, strict=True)
            return torch.cat([session.token_logprobs(ref, seq, len(p)) for p, seq, ref in pairs])

        metrics: dict[str, float | int | str] = {}
        scored = {prefix: sampled(rows) for prefix, rows in trainers.items()}
        for prefix, ours in scored.items():
            metrics |= {prefix + k: v for k, v in mismatch(served - ours).items()}
            if not prefix:  # ART's figures: the server against the Megatron trainer
                pairs = zip(prompts, sequences, trainers[prefix], strict=True)
                at = torch.cat([ref[len(p) - 1 : len(seq) - 1] for p, seq, ref in pairs])
                metrics |= art_figures(served, ours, tops, at)
        metrics |= {f"megatron_hf_{k}": v for k, v in mismatch(scored[""] - scored["hf_"]).items()}
        reference, dtype = None, session.compared_dtype(ctx, server.options.dtype)
        sides = max(1, session.runs_below_fp32(ctx, server.options.dtype))
        if dtype != "float32":  # transformers' own run in that dtype against its fp32 run
            low = session.trainer_logprobs(ctx, adapter, sequences, getattr(torch, dtype))
            own = mismatch(sampled(low) - scored["hf_"])
            metrics |= {f"reference_{k}": v for k, v in own.items()}
            reference = {k: own[k] for k in CALIBRATED}
        metrics |= {
            "sampled_tokens": served.numel(),
            "prompt_lengths": "+".join(str(len(p)) for p in prompts),
            "serving_dtype": server.options.dtype,
            "served_model": server.served_name,
        }
        limits, one_side = mismatch_tolerance(dtype, reference, sides), mismatch_tolerance(dtype, reference)
        thresholds = limits | {p + k: v for p in ("hf_", "megatron_hf_") for k, v in one_side.items()}
        replay = self._replay(ctx, samples, sequences, served, sampled)
        if replay is not None:  # the trainer routing as the server did may drift no further than routing its own way
            metrics |= replay
            thresholds |= {f"replayed_{k}": v for k, v in limits.items()}
        return self.judge(
            metrics,
            thresholds,
            f"{metrics['sampled_tokens']} sampled tokens, server vs Megatron: mean KL {metrics['kl_mean']:.2e}, "
            f"max |delta| {metrics['abs_delta_logprob_max']:.2e}",
            [
                f"ART's figures (server vs Megatron, not judged here): mean |p_server - p_trainer| "
                f"{metrics['art_prob_abs_diff_mean']:.2e} (ART's limit {ART_LIMITS['art_prob_abs_diff_mean']}), "
                f"top-{ART_TOP_K} KL {metrics['art_top20_kl_mean']:.2e} (ART's limit "
                f"{ART_LIMITS['art_top20_kl_mean']})",
                "serving dtype {}: {}".format(*session.serving_dtype(ctx)),
                *calibration(dtype, reference, limits, sides, " (server vs Megatron)"),
                *calibration(dtype, reference, one_side, 1, " (hf_*, megatron_hf_*: each side vs fp32)"),
                self._replay_line(ctx, metrics),
                f"adapter: {origin}",
                f"trainer: the Megatron model ({session.policy_model(ctx).describe()}); hf_*: the server vs "
                "transformers fp32, adapter merged; megatron_hf_*: the trainer vs that",
            ],
            ctx=ctx,
        )

    @staticmethod
    def _replay(
        ctx: CheckContext,
        samples: list[dict],
        sequences: list[list[int]],
        served: torch.Tensor,
        sampled: Callable[[list[torch.Tensor]], torch.Tensor],
    ) -> dict[str, float] | None:
        """Routing replay (R3) where the server returns routed experts: the trainer's mismatch with the server's
        experts replayed (``replayed_*``) and the share of token-layers it routes as the server did on its own."""
        from model_support.core import api
        from model_support.validation import serving_session as session

        if session.routing_gap(ctx) is not None:
            return None
        experts = [api.served_experts(s, len(seq)) for s, seq in zip(samples, sequences, strict=True)]
        replayed = sampled(session.megatron_logprobs(ctx, sequences, experts))
        metrics = {f"replayed_{k}": v for k, v in mismatch(served - replayed).items()}
        return metrics | {"routed_as_served": session.routed_as_served(ctx, sequences, experts)}

    @staticmethod
    def _replay_line(ctx: CheckContext, metrics: dict) -> str:
        from model_support.validation import serving_session as session

        if "replayed_kl_mean" not in metrics:
            return f"routing replay (R3): not measured, {session.routing_gap(ctx)}"
        m = metrics
        return (
            f"routing replay (R3): the trainer routes {m['routed_as_served']:.2%} of token-layers as the server did; "
            f"with the server's experts replayed, mean |delta| {m['replayed_abs_delta_logprob_mean']:.3g} (own "
            f"routing {m['abs_delta_logprob_mean']:.3g}), max {m['replayed_abs_delta_logprob_max']:.3g} "
            f"({m['abs_delta_logprob_max']:.3g}), KL {m['replayed_kl_mean']:.3g} ({m['kl_mean']:.3g})"
        )
