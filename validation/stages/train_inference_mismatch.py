"""Stage `train_inference_mismatch`: the trainer and the server give the same log-probabilities to the same samples.

Completions are sampled from the server (temperature 1, seeded); the trainer side (transformers + the same
LoRA adapter, unmerged through PEFT where transformers can; see ``core/serving/session.py``) scores the same
prompt + completion ids. Per sampled token, ``delta = log p_server - log p_trainer``; the report gives mean and
max ``|delta|`` and the KL(server || trainer) estimate ``k3 = exp(-delta) - 1 + delta`` averaged over tokens
(unbiased under the server's samples, always >= 0). This is the number an on-policy RL run depends on: it proves
the served weights are the trained weights.
"""

from __future__ import annotations

from model_support.core.serving.errors import ServingError
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.merged_serving import cannot_serve

# By serving dtype. fp32 serving must agree to round-off. In bf16 the mean is what matters: single tokens can
# move by a few tenths where bf16 flips an MoE router's top-k choice (measured on the tiny Qwen3.5-MoE: max
# |delta| 0.25 with mean KL 9e-4; dense Qwen3.5: max 0.04, mean KL 5e-5).
MISMATCH_TOLERANCE = {
    "float32": {"abs_delta_logprob_max": 1e-4, "abs_delta_logprob_mean": 1e-5, "kl_mean": 1e-8},
    "bfloat16": {"abs_delta_logprob_max": 0.5, "abs_delta_logprob_mean": 0.05, "kl_mean": 1e-2},
}


class TrainInferenceMismatchStage(Stage):
    name = "train_inference_mismatch"
    title = "Per-token logprobs of server samples agree between trainer and server (KL, |delta logprob|)."
    order = 100
    requires = ("merged_serving",)
    prompts, prompt_len, max_tokens = 3, 8, 16

    def run(self, ctx: CheckContext) -> StageResult:
        import torch

        from model_support.core.serving import session

        adapter, origin = session.policy_adapter(ctx)
        prompts = session.random_prompts(ctx, self.prompts, self.prompt_len)
        try:
            server = session.policy_server(ctx)
            samples = [
                server.completion(
                    p, max_tokens=self.max_tokens, temperature=1.0, seed=ctx.seed + i, logprobs=0, ignore_eos=True
                )
                for i, p in enumerate(prompts)
            ]
        except ServingError as exc:
            return cannot_serve(self, ctx, exc)
        sequences = [p + list(s["token_ids"]) for p, s in zip(prompts, samples, strict=True)]
        trainer = session.trainer_logprobs(ctx, adapter, sequences)
        deltas = []
        for prompt, sample, seq, ref in zip(prompts, samples, sequences, trainer, strict=True):
            served = torch.tensor(sample["logprobs"]["token_logprobs"], dtype=torch.float64)
            deltas.append(served - session.token_logprobs(ref, seq, len(prompt)))
        delta = torch.cat(deltas)
        k3 = torch.exp(-delta) - 1 + delta
        metrics = {
            "kl_mean": k3.mean().item(),
            "kl_max": k3.max().item(),
            "abs_delta_logprob_mean": delta.abs().mean().item(),
            "abs_delta_logprob_max": delta.abs().max().item(),
            "sampled_tokens": delta.numel(),
            "trainer": "transformers fp32, adapter merged",
            "serving_dtype": server.options.dtype,
        }
        thresholds = MISMATCH_TOLERANCE.get(server.options.dtype, MISMATCH_TOLERANCE["bfloat16"])
        return self.judge(
            metrics,
            thresholds,
            f"{delta.numel()} sampled tokens: mean KL {metrics['kl_mean']:.2e}, "
            f"max |delta| {metrics['abs_delta_logprob_max']:.2e}",
            [f"adapter: {origin}"],
        )
