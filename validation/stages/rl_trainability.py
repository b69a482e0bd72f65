"""Stage `rl_trainability`: an end-to-end RL loop, built only on the training-time API, learns a reward.

The task is ART's yes/no/maybe example: a chat prompt asks a yes/no question, the policy answers with one
token restricted to the first tokens of "yes", "no" and "maybe" (vLLM's ``allowed_token_ids``), and the reward is
ART's: 0.5 for yes, 0.75 for no, 1.0 for maybe. Each step:

1. the run's server (holding the current policy, ``<handler>@N``) samples ``group`` answers per prompt;
2. the Megatron model scores the same prompts in one packed forward (``api.token_logprobs``), and every sampled
   token's server log-probability is compared with the trainer's (same weights): mean / max |delta|, k3 KL,
   and the KL over the server's top-k tokens. A push that put weights in the wrong place shows here. In merged
   mode the trainer's side is the policy it pushed (``api.lora_merged``: the update merged into the base's
   dtype, as ``api.merged_weights`` sends it): a bf16 base rounds away part of a small update, measured apart
   (``merge_rounding_abs_delta_mean``, the pushed policy against the trainer's base + fp32 LoRA). Below fp32 the
   limits are at least twice transformers' own distance from its fp32 run on the same tokens, the KLs four times
   its own (``_reference_distance``);
3. a policy-gradient LoRA step with group-relative advantages (reward minus its group's mean, over the
   group's standard deviation) on the log-probability of the answer among the allowed tokens;
4. the policy is pushed: in "lora" mode the adapter is hot-swapped (``api.push_adapter``: ``<handler>-lora@N+1``
   beside the untouched base), in "merged" mode the merged weights go in place (``api.push_weights``: the served
   name advances to ``@N+1``).

The loop runs in both modes where the handler's vLLM LoRA is native and the build serves it (merged only
otherwise), each from a fresh LoRA (B = 0: the first merged push serves the base weights). Samples come from
vLLM's token-in-token-out route, so each carries the version of the weights that sampled it. Pass, in every mode:
the mean reward of a step reaches ``1 - reward_gap`` within ``max_steps``; the trainer and the server agree on
every step within the serving dtype's limits; the server lists the last pushed name and no earlier one; every
token was sampled by the weights last pushed (``stale_tokens``); every push served under the next step's name
(``served_names_not_advanced``); no base weight changed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from model_support.core.serving.errors import ServingError
from model_support.validation.context import CHAT_RENDERER, TOKENIZER, CheckContext
from model_support.validation.megatron_session import HF_REFERENCES, LORA, TRAINING_MODEL
from model_support.validation.serving_session import SERVER
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.stages.merged_serving import cannot_serve
from model_support.validation.stages.train_inference_mismatch import (
    CALIBRATED,
    calibration,
    mismatch,
    mismatch_tolerance,
    topk_kl,
)
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


@dataclass
class _Run:
    """One mode's loop: per step the server-vs-trainer record, the rewards, the served names."""

    mode: str
    steps: list[dict[str, float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    stale_tokens: int | None = 0  # None: not measured (the server's vLLM reports no per-token weight versions)
    listed: list[str] = field(default_factory=list)
    # Merged mode: the largest per-step mean |log p| by which merging the update into the base's dtype moved the
    # sampled tokens (the pushed policy against the trainer's base + fp32 LoRA).
    merge_rounding: float = 0.0


def _not_advanced(names: list[str]) -> int:
    """How many pushes did not serve under the next step's name (``model@N`` -> ``model@N+1``): a client told the
    new name must never reach the weights of an earlier step, nor the old name the new weights."""
    from model_support.core.serving.update import parse_served_name

    steps = [parse_served_name(name) for name in names]
    return sum(now != (before[0], before[1] + 1) for before, now in itertools.pairwise(steps))


class RlTrainabilityStage(Stage):
    name = "rl_trainability"
    title = "An RL loop on the API (sample from vLLM, score in Megatron, LoRA step, push) reaches reward 0.9."
    order = 110
    packages = MEGATRON_PACKAGES
    needs = (TRAINING_MODEL, LORA, TOKENIZER, CHAT_RENDERER, SERVER, HF_REFERENCES)
    thresholds: ClassVar[dict[str, float]] = {
        "reward_gap": 0.1,
        "stale_served_names": 0,
        "served_names_not_advanced": 0,
        "stale_tokens": 0,
        "base_params_changed": 0,
    }
    group, max_steps, clip_norm = 8, 30, 1.0

    @staticmethod
    def modes(ctx: CheckContext) -> list[str]:
        """ "lora" (the adapter hot-swapped) where the run's server serves the handler's LoRA natively, "merged"
        (weights pushed in place) where the build takes them in place."""
        from model_support.validation.serving_session import inplace_gap, lora_gap

        lora = ["lora"] if ctx.spec.vllm_lora.native and lora_gap(ctx) is None else []
        return lora + (["merged"] if inplace_gap(ctx) is None else [])

    def skip_reason(self, ctx: CheckContext) -> str | None:
        from model_support.validation.serving_session import backend, inplace_gap

        unavailable = backend().unavailable_reason()
        if unavailable is not None:
            return unavailable
        if not self.modes(ctx):
            runtime = backend().version()
            return f"the CPU vLLM build ({runtime}) cannot take {ctx.spec.name}'s weights in place: {inplace_gap(ctx)}"
        return None

    def prepare(self, ctx: CheckContext) -> None:
        from model_support.validation.serving_session import start_server

        ctx.state.get(CHAT_RENDERER)  # loads the tokenizer in its child while earlier stages run
        start_server(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.layout import text_config
        from model_support.validation import serving_session as session

        tokenizer = ctx.tokenizer()
        try:
            answers = answer_tokens(tokenizer)
        except ValueError as exc:
            return self.failed(str(exc))
        chats = [[{"role": "user", "content": f"{q} Answer yes, no or maybe."}] for q in QUESTIONS]
        prompts = ctx.chat_prompts(chats)
        prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

        model = ctx.state.get(TRAINING_MODEL)
        ctx.state.get(LORA)
        base = base_fingerprints(model.module)
        tcfg = text_config(ctx.config)
        lr = peak_lr(int(tcfg.hidden_size), int(tcfg.num_hidden_layers))
        runs: list[_Run] = []
        try:
            for mode in self.modes(ctx):
                if mode == "lora":
                    server = session.serve_base(ctx)  # the adapter goes onto the checkpoint's own weights
                else:
                    server = session.server(ctx)
                    ctx.state.get(SERVER).holds = "rl"
                runs.append(self._loop(ctx, mode, server, model, prompt_ids, answers, lr))
        except ServingError as exc:
            return cannot_serve(self, ctx, exc)
        changed = changed_base(model.module, base)
        every = [s for run in runs for s in run.steps]
        worst = {key: max(s[key] for s in every) for key in ("kl_mean", "abs_delta_logprob_max", "topk_kl_mean")}
        worst["abs_delta_logprob_mean"] = max(s["abs_delta_logprob_mean"] for s in every)
        metrics: dict[str, Any] = {
            "modes": ", ".join(run.mode for run in runs),
            **{f"{run.mode}_steps": len(run.steps) - 1 for run in runs},
            **{f"{run.mode}_final_reward": run.rewards[-1] for run in runs},
            "initial_reward": min(run.rewards[0] for run in runs),
            "reward_gap": max(1 - run.rewards[-1] for run in runs),
            **worst,
            "samples_per_step": self.group * len(prompt_ids),
            "stale_served_names": sum(len(set(r.listed) - {r.names[-1]}) + (r.names[-1] not in r.listed) for r in runs),
            "served_names_not_advanced": sum(_not_advanced(run.names) for run in runs),
            "stale_tokens": sum(run.stale_tokens or 0 for run in runs),
            "served_model": runs[-1].names[-1],
            "base_params_changed": len(changed),
            "serving_dtype": server.options.dtype,
            "peak_lr": lr,
        }
        merged = next((run for run in runs if run.mode == "merged"), None)
        if merged is not None:
            metrics["merge_rounding_abs_delta_mean"] = merged.merge_rounding
        reference = None
        if "reference_abs_delta_logprob_mean" in every[0]:
            reference = {k: max(s[f"reference_{k}"] for s in every) for k in CALIBRATED}
            metrics |= {f"reference_{k}": v for k, v in reference.items()}
        dtype = session.compared_dtype(ctx, server.options.dtype)
        limits = mismatch_tolerance(dtype, reference)
        thresholds = dict(self.thresholds) | limits | {"topk_kl_mean": limits["kl_mean"]}
        details = ["serving dtype {}: {}".format(*session.serving_dtype(ctx))]
        details += calibration(dtype, reference, limits)
        if any(run.stale_tokens is None for run in runs):  # a limit on what was not measured would pass vacuously
            del thresholds["stale_tokens"]
            metrics["stale_tokens"] = "not measured"
            details.append(
                f"stale_tokens: not measured: vLLM {server.features.version} reports no per-token weight versions "
                "(vLLM 0.32 on)"
            )
        for run in runs:
            push = "adapter hot-swapped (api.push_adapter)" if run.mode == "lora" else "merged weights pushed in place"
            details += [
                f"{run.mode} ({push}): reward per step " + ", ".join(f"{r:.3f}" for r in run.rewards),
                f"{run.mode}: server vs Megatron per step (mean KL / max |delta|): "
                + ", ".join(f"{s['kl_mean']:.1e}/{s['abs_delta_logprob_max']:.1e}" for s in run.steps),
                f"{run.mode}: served names {run.names[0]} -> {run.names[-1]}; the server lists {run.listed}; "
                f"{'?' if run.stale_tokens is None else run.stale_tokens} sampled token(s) from other weights than the "
                "last pushed",
            ]
        if merged is not None:
            details.append(
                "merged: the server is held to the policy it was pushed (the update merged into the base's dtype); "
                f"that policy is {merged.merge_rounding:.2e} (mean |delta logprob| of the sampled tokens, worst step) "
                "from the trainer's base + fp32 LoRA: the part of the update the merge rounds away"
            )
        details.append(f"trainer: {model.describe()}; AdamW lr {lr:.3g}, gradient norm clipped to {self.clip_norm}")
        if changed:
            details.append(f"base weights changed: {', '.join(changed[:4])}")
        summary = (
            ", ".join(
                f"{run.mode}: reward {run.rewards[0]:.2f} -> {run.rewards[-1]:.2f} in {len(run.steps) - 1} steps"
                for run in runs
            )
            + f"; max |delta logprob| {worst['abs_delta_logprob_max']:.1e}"
        )
        return self.judge(metrics, thresholds, summary, details, ctx=ctx)

    @staticmethod
    def _reference_distance(
        ctx: CheckContext, model: Any, prompt_ids: list[list[int]], tokens: torch.Tensor, dtype: str
    ) -> dict[str, float]:
        """transformers' own distance in ``dtype`` (the comparison's lower precision) from its fp32 run, on this
        step's sampled ``tokens`` [prompt, sample], both runs on the trainer's policy (its LoRA exported as an
        adapter) merged and rounded to ``dtype``: how far a correct low-precision implementation of one policy
        drifts, which the limits scale with. The merge's rounding is left out: both sides of the comparison
        hold the same update (merged mode: the pushed, rounded policy; LoRA mode: the adapter unmerged), and merged
        mode measures that rounding apart."""
        import tempfile
        from pathlib import Path

        from model_support.core import api
        from model_support.validation import serving_session as session

        with tempfile.TemporaryDirectory(prefix="rl-reference-") as tmp:
            adapter = api.export_adapter(model, Path(tmp) / "adapter")
            rounded = getattr(torch, dtype)
            low, full = (
                torch.stack([rows[-1] for rows in session.trainer_logprobs(ctx, adapter, prompt_ids, d, rounded)])
                for d in (rounded, torch.float32)
            )
        return {f"reference_{k}": v for k, v in mismatch((low - full).gather(1, tokens).flatten()).items()}

    def _loop(
        self, ctx: CheckContext, mode: str, server: Any, model: Any, prompt_ids: list[list[int]],
        answers: dict[int, str], lr: float,
    ) -> _Run:  # fmt: skip
        """Train a fresh LoRA until the reward is reached, sampling from ``server`` after each push."""
        from model_support.core import api
        from model_support.core.megatron.lora import lora_modules
        from model_support.validation import serving_session as session

        allowed = sorted(answers)
        reward_of = torch.tensor([REWARDS[answers[t]] for t in allowed], dtype=torch.float64)
        torch.manual_seed(ctx.seed)
        for module in lora_modules(model.module).values():
            module.reset_parameters()
        params = [p for p in model.module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        run = _Run(mode)
        dtype = session.compared_dtype(ctx, server.options.dtype)

        def push() -> str:
            if mode == "lora":
                return api.push_adapter(server, model)
            return api.push_weights(server, model, bucket_bytes=session.push_bucket_bytes(ctx))

        try:
            run.names.append(push())
            for step in range(self.max_steps + 1):
                target = run.names[-1]
                # vLLM's token-in-token-out route: each sampled token says which weights sampled it.
                samples = [
                    server.generate(
                        ids,
                        model=target,
                        n=self.group,
                        max_tokens=1,
                        temperature=1.0,
                        seed=ctx.seed * 1000 + step * len(prompt_ids) + i,
                        allowed_token_ids=allowed,
                        logprobs=TOP_K,
                    )
                    for i, ids in enumerate(prompt_ids)
                ]
                if mode == "merged" and run.stale_tokens is not None:
                    version = int(target.rpartition("@")[2])
                    if all("policy_epochs" in c for group in samples for c in group):
                        run.stale_tokens += sum(
                            e != version for group in samples for c in group for e in c["policy_epochs"]
                        )
                    else:  # a vLLM before 0.32 reports no per-token weight versions
                        run.stale_tokens = None
                if mode == "merged":  # the policy the push served: the update merged, rounded to the base's dtype
                    with api.lora_merged(model), torch.no_grad():
                        pushed = torch.stack([rows[-1] for rows in api.token_logprobs(model, prompt_ids)])
                with torch.enable_grad():
                    last = torch.stack([rows[-1] for rows in api.token_logprobs(model, prompt_ids)])
                tokens = torch.tensor([[c["token_ids"][0] for c in group] for group in samples])
                first = [[c["logprobs"]["content"][0] for c in group] for group in samples]
                served = torch.tensor([[f["logprob"] for f in group] for group in first], dtype=torch.float64)
                ours = last.detach().double().cpu()
                if mode == "merged":
                    trained, ours = ours, pushed.double().cpu()
                    rounded = (ours - trained).gather(1, tokens).abs()
                    run.merge_rounding = max(run.merge_rounding, rounded.mean().item())
                record = mismatch((served - ours.gather(1, tokens)).flatten())
                if dtype != "float32":
                    record |= self._reference_distance(ctx, model, prompt_ids, tokens, dtype)
                record["topk_kl_mean"] = (
                    sum(
                        topk_kl({t["token_id"]: t["logprob"] for t in f["top_logprobs"]}, ours[i])
                        for i, group in enumerate(first)
                        for f in group
                    )
                    / tokens.numel()
                )
                index = torch.searchsorted(torch.tensor(allowed), tokens)
                reward = reward_of[index]
                record["reward_mean"] = reward.mean().item()
                run.steps.append(record)
                run.rewards.append(record["reward_mean"])
                if run.rewards[-1] >= 1 - self.thresholds["reward_gap"] or step == self.max_steps:
                    break
                advantage = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)
                policy = torch.log_softmax(last[:, allowed], dim=-1)
                chosen = policy.gather(1, index.to(policy.device))
                loss = -(advantage.to(chosen) * chosen).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
                optimizer.step()
                run.names.append(push())
            models = server.models()
            # The base keeps its name in LoRA mode; what must be listed is the last adapter, and no earlier one.
            run.listed = [m for m in models if "-lora@" in m] if mode == "lora" else models
            if mode == "lora":
                server.remove_adapter()  # it would serve on top of whatever the base holds next
        finally:
            optimizer.zero_grad(set_to_none=True)
        return run
