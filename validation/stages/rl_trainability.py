"""Stage `rl_trainability`: an end-to-end RL loop, built only on the training-time API, learns a reward.

The task is ART's yes/no/maybe example: a chat prompt asks a yes/no question, the policy answers with one
token restricted to the first tokens of "yes", "no" and "maybe" (vLLM's ``allowed_token_ids``), and the reward is
ART's: 0.5 for yes, 0.75 for no, 1.0 for maybe. Each step:

1. the run's server (holding the current policy, ``<handler>@N``) samples ``group`` answers per prompt;
2. the Megatron model scores the same prompts in one packed forward (``api.token_logprobs``), and every sampled
   token's server log-probability is compared with the trainer's (same weights): mean / max |delta|, k3 KL,
   and the KL over the server's top-k tokens. A push that put weights in the wrong place shows here;
3. a policy-gradient LoRA step with group-relative advantages (reward minus its group's mean, over the
   group's standard deviation) on the log-probability of the answer among the allowed tokens;
4. the merged weights are pushed in place (``api.push_weights``): the served name advances to ``@N+1``.

It starts from a fresh LoRA (B = 0, so the first push serves the base weights). Pass: the mean reward of a step
reaches ``1 - reward_gap`` within ``max_steps``; the trainer and the server agree on every step within the
serving dtype's limits; the server lists the last pushed name and only it; no base weight changed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from model_support.core.serving.errors import ServingError
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.stages.merged_serving import cannot_serve
from model_support.validation.stages.train_inference_mismatch import mismatch, mismatch_tolerance
from model_support.validation.stages.trainability import base_fingerprints, changed_base, peak_lr

QUESTIONS = (
    "Is the sky blue?",
    "Is fire cold?",
    "Is one less than two?",
    "Do experts route tokens?",
)
# ART's yes-no-maybe rewards.
REWARDS = {"yes": 0.5, "no": 0.75, "maybe": 1.0}
TOP_K = 5


def answer_tokens(tokenizer: Any) -> dict[int, str]:
    """The first token of each answer -> the answer; answers must start with different tokens."""
    first = {answer: tokenizer.encode(answer, add_special_tokens=False)[:1] for answer in REWARDS}
    ids = {ids[0]: answer for answer, ids in first.items() if ids}
    if len(ids) != len(REWARDS):
        raise ValueError(f"the tokenizer does not give yes / no / maybe distinct first tokens: {first}")
    return ids


def topk_kl(top: dict[str, float], trainer: torch.Tensor) -> float:
    """KL(server || trainer) over the server's top-k tokens, both renormalised on that set.

    ``top`` is vLLM's ``top_logprobs`` entry with ``return_tokens_as_token_ids`` (keys ``"token_id:<id>"``).
    """
    ids = torch.tensor([int(key.rpartition(":")[2]) for key in top])
    served = torch.log_softmax(torch.tensor(list(top.values()), dtype=torch.float64), dim=0)
    ours = torch.log_softmax(trainer[ids].double(), dim=0)
    return float((served.exp() * (served - ours)).sum())


class RlTrainabilityStage(Stage):
    name = "rl_trainability"
    title = "An RL loop on the API (sample from vLLM, score in Megatron, LoRA step, push in place) reaches reward 0.9."
    order = 110
    packages = MEGATRON_PACKAGES
    thresholds: ClassVar[dict[str, float]] = {"reward_gap": 0.1, "stale_served_names": 0, "base_params_changed": 0}
    group, max_steps, clip_norm = 8, 30, 1.0

    def skip_reason(self, ctx: CheckContext) -> str | None:
        from model_support.core.serving.session import backend, inplace_gap

        unavailable = backend().unavailable_reason()
        if unavailable is not None:
            return unavailable
        gap = inplace_gap(ctx)
        if gap is not None:
            runtime = backend().version()
            return f"the CPU vLLM build ({runtime}) cannot take {ctx.spec.name}'s weights in place: {gap}"
        return None

    def prepare(self, ctx: CheckContext) -> None:
        from model_support.core.serving.session import start_server

        ctx.chat_renderer()  # loads the tokenizer in its child while earlier stages run
        start_server(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core import api
        from model_support.core.layout import text_config
        from model_support.core.megatron.lora import lora_modules
        from model_support.core.megatron.session import megatron_lora, training_model
        from model_support.core.serving import session

        tokenizer = ctx.tokenizer()
        try:
            answers = answer_tokens(tokenizer)
        except ValueError as exc:
            return self.failed(str(exc))
        allowed = sorted(answers)
        reward_of = torch.tensor([REWARDS[answers[t]] for t in allowed], dtype=torch.float64)
        chats = [[{"role": "user", "content": f"{q} Answer yes, no or maybe."}] for q in QUESTIONS]
        prompts = ctx.chat_prompts(chats)
        prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

        model = training_model(ctx)
        megatron_lora(ctx)
        torch.manual_seed(ctx.seed)
        for module in lora_modules(model.module).values():
            module.reset_parameters()
        base = base_fingerprints(model.module)
        params = [p for p in model.module.parameters() if p.requires_grad]
        tcfg = text_config(ctx.config)
        lr = peak_lr(int(tcfg.hidden_size), int(tcfg.num_hidden_layers))
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

        rewards: list[float] = []
        steps: list[dict[str, float]] = []
        try:
            server = session.server(ctx)
            ctx.artifacts[session.SERVED_KEY] = "rl"
            names = [api.push_weights(server, model)]
            for step in range(self.max_steps + 1):
                samples = [
                    server.choices(
                        ids,
                        n=self.group,
                        max_tokens=1,
                        temperature=1.0,
                        seed=ctx.seed * 1000 + step * len(prompt_ids) + i,
                        allowed_token_ids=allowed,
                        logprobs=TOP_K,
                        return_tokens_as_token_ids=True,
                    )
                    for i, ids in enumerate(prompt_ids)
                ]
                with torch.enable_grad():
                    last = torch.stack([rows[-1] for rows in api.token_logprobs(model, prompt_ids)])
                tokens = torch.tensor([[c["token_ids"][0] for c in group] for group in samples])
                served = torch.tensor(
                    [[c["logprobs"]["token_logprobs"][0] for c in group] for group in samples], dtype=torch.float64
                )
                ours = last.detach().double().cpu()
                delta = served - ours.gather(1, tokens)
                record = mismatch(delta.flatten())
                record["topk_kl_mean"] = (
                    sum(
                        topk_kl(c["logprobs"]["top_logprobs"][0], ours[i])
                        for i, group in enumerate(samples)
                        for c in group
                    )
                    / tokens.numel()
                )
                index = torch.searchsorted(torch.tensor(allowed), tokens)
                reward = reward_of[index]
                record["reward_mean"] = reward.mean().item()
                steps.append(record)
                rewards.append(record["reward_mean"])
                if rewards[-1] >= 1 - self.thresholds["reward_gap"] or step == self.max_steps:
                    break
                advantage = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)
                policy = torch.log_softmax(last[:, allowed], dim=-1)
                chosen = policy.gather(1, index.to(policy.device))
                loss = -(advantage.to(chosen) * chosen).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
                optimizer.step()
                names.append(api.push_weights(server, model))
            listed = server.models()
        except ServingError as exc:
            return cannot_serve(self, ctx, exc)
        finally:
            optimizer.zero_grad(set_to_none=True)
        changed = changed_base(model.module, base)
        worst = {key: max(s[key] for s in steps) for key in ("kl_mean", "abs_delta_logprob_max", "topk_kl_mean")}
        worst["abs_delta_logprob_mean"] = max(s["abs_delta_logprob_mean"] for s in steps)
        metrics = {
            "steps": len(steps) - 1,
            "initial_reward": rewards[0],
            "final_reward": rewards[-1],
            "reward_gap": 1 - rewards[-1],
            **worst,
            "samples_per_step": self.group * len(prompt_ids),
            "stale_served_names": len(set(listed) - {names[-1]}) + (names[-1] not in listed),
            "served_model": names[-1],
            "base_params_changed": len(changed),
            "serving_dtype": server.options.dtype,
            "peak_lr": lr,
        }
        limits = mismatch_tolerance(server.options.dtype)
        thresholds = dict(self.thresholds) | limits | {"topk_kl_mean": limits["kl_mean"]}
        details = [
            "serving dtype {}: {}".format(*session.serving_dtype(ctx)),
            "reward per step: " + ", ".join(f"{r:.3f}" for r in rewards),
            "server vs Megatron per step (mean KL / max |delta|): "
            + ", ".join(f"{s['kl_mean']:.1e}/{s['abs_delta_logprob_max']:.1e}" for s in steps),
            f"served names: {names[0]} -> {names[-1]}; the server lists {listed}",
            f"trainer: {model.describe()}; AdamW lr {lr:.3g}, gradient norm clipped to {self.clip_norm}",
        ]
        if changed:
            details.append(f"base weights changed: {', '.join(changed[:4])}")
        summary = (
            f"reward {rewards[0]:.2f} -> {rewards[-1]:.2f} in {len(steps) - 1} steps, served {names[-1]}, "
            f"max |delta logprob| {worst['abs_delta_logprob_max']:.1e}"
        )
        return self.judge(metrics, thresholds, summary, details, ctx=ctx)
