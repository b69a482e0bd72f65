"""Stage `shared_prefix`: a prompt packed once with its completions computes what each prompt + completion does."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import LORA, REFERENCE_LOWP_ERROR, TRAINING_MODEL
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.stages.lora_gradients import REFERENCE_LOWP_GRAD_ERROR


class SharedPrefixStage(Stage):
    """A GRPO-style row, one long prompt (across every length-dependent structure of the model, as in ``hf_parity``) and
    its completions (one crossing a GDN chunk boundary of its own) packed as ``[prompt, c1, ..., cG]`` with each
    completion's position ids continuing the prompt's, through the Megatron model with LoRA: the prompt runs once
    (attention block by block, Gated DeltaNet layers fanning the prompt's state out to every completion, the
    convolution seeing the prompt's last tokens). It must compute what each ``[prompt, c_i]`` row computes alone:
    the prompt's and every completion's logits, the completions' loss (each completion's tokens predicted from the
    prompt's last position and its own), and every LoRA gradient of that loss. The same completions after a
    ``short_prompt``-token prompt (``short_prompt_`` metrics, held to the same limits): there a completion that sees
    another's tokens is O(1) wrong, where after the long prompt the intruding tokens are too few to show. Tolerances as
    ``packed_position_ids``: fixed in fp32, a multiple of transformers' own rounding distance below it. MoE routers
    replay, in both runs, the first unshared row's routing of the prompt and each completion's own
    (``prompt_routing_flips`` counts the prompt tokens whose top-k the other unshared rows had chosen differently on
    their own). Control: the same tokens with every completion restarting at position 0 (not seeing the prompt) must
    differ by at least the dtype's effect floor (``control_rel_l2``). The trainer's GRPO scoring call,
    ``api.group_logprobs`` of the group, must give ``api.token_logprobs`` of each prompt + completion
    (``api_group_logprobs_``, the logits' tolerances)."""

    name = "shared_prefix"
    title = "A prompt packed once with its completions gives the logits, loss and gradients of the unshared rows."
    order = 52
    sharded = True
    requires = ("hf_parity",)
    needs = (TRAINING_MODEL, LORA, REFERENCE_LOWP_ERROR, REFERENCE_LOWP_GRAD_ERROR)
    packages = MEGATRON_PACKAGES
    # The prompt is a long row (``long_row``: across every GDN chunk boundary, window and rope threshold it has);
    # one completion spans a GDN chunk boundary of its own.
    completions = (6, 70, 7)
    # The same completions after a prompt this short: a completion that sees another's tokens (a layout lost in a
    # recompute) is O(1) wrong here, where after a long prompt the intruding tokens are a sliver of what it attends
    # to (0.7 % of the gradients after 4096 tokens at Qwen3-30B-A3B width, under the bf16 limit).
    short_prompt = 16

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.core.megatron.compare import EFFECT_FLOOR, same_model_tolerances
        from model_support.validation.megatron_session import crossing, long_row, random_tokens, with_random_lora

        built = with_random_lora(ctx, offset=3)
        model, dtype = built.model, built.numerics.dtype
        size = long_row(ctx)
        prompt = random_tokens(ctx, (1, size), offset=20)
        completions = [random_tokens(ctx, (1, n), offset=21 + i) for i, n in enumerate(self.completions)]
        metrics, routing = self._compare(model, prompt, completions)
        short_prompt = random_tokens(ctx, (1, self.short_prompt), offset=30)
        short, _ = self._compare(model, short_prompt, completions)
        metrics = {
            "dtype": built.numerics.dtype_name,
            **metrics,
            **{f"short_prompt_{k}": v for k, v in short.items()},
            **self._through_api(ctx, prompt, completions, routing),
        }
        compared = same_model_tolerances(
            dtype, ctx.state.get(REFERENCE_LOWP_ERROR), ctx.state.get(REFERENCE_LOWP_GRAD_ERROR)
        )
        # The loss is a sum of per-token functions of the logits: held to the logits' relative limit.
        compared["loss_rel_err"] = compared.get("logits_rel_l2", compared.get("logits_rel_err", 1e-4))
        thresholds = compared | {f"short_prompt_{k}": v for k, v in compared.items()}
        found, limits, missed = crossing(ctx, prompt.shape[1], prefix="prompt_")
        metrics |= found
        thresholds |= limits
        # The trainer's GRPO scoring call against its per-sequence one: held to the logits' limits.
        thresholds |= {
            k.replace("logits_", "api_group_logprobs_", 1): v for k, v in compared.items() if k.startswith("logits_")
        }
        why = "the comparison cannot tell whether the completions see the prompt"
        control = metrics["control_rel_l2"]
        return self.blind(
            "control_rel_l2", control, EFFECT_FLOOR[dtype], why, metrics=metrics, thresholds=thresholds
        ) or self.judge(
            metrics,
            thresholds,
            f"prompt {size} + {len(self.completions)} completions in {metrics['tokens']} tokens (unshared "
            f"{metrics['unshared_tokens']}), and after a {self.short_prompt}-token prompt: logits rel L2 "
            f"{max(metrics['logits_rel_l2'], metrics['short_prompt_logits_rel_l2']):.2e} ({metrics['dtype']})",
            missed,
            ctx=ctx,
        )

    def _compare(
        self, model: torch.nn.Module, prompt: torch.Tensor, completions: list[torch.Tensor]
    ) -> tuple[dict[str, Any], list[list[torch.Tensor]]]:
        """The shared row ``[prompt, c1, ..., cG]`` against each ``[prompt, c_i]`` alone: (metrics, each MoE
        router's routing of the unshared rows)."""
        from model_support.core.megatron.compare import gradient_closeness, worst_closeness
        from model_support.core.megatron.rows import RowLayout
        from model_support.validation.row_runs import routing_alone, run_alone, run_packed

        size, lengths = prompt.shape[1], [c.shape[1] for c in completions]
        layout = RowLayout.shared_prefix(size, lengths)
        row = torch.cat([prompt, *completions], dim=1)
        unshared = [torch.cat([prompt, completion], dim=1) for completion in completions]

        def completion_loss(prompt_last: torch.Tensor, own: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            """Summed cross-entropy of a completion's tokens: the first from the prompt's last position."""
            predictions = torch.cat([prompt_last[None], own[:-1]])
            return torch.nn.functional.cross_entropy(predictions, tokens[0].to(own.device), reduction="sum")

        routing = routing_alone(model, unshared)
        # Each unshared row routes its copy of the prompt on its own, and in low precision a near tie among many
        # experts can flip between copies (the copies differ in rounding only); the shared row computes the prompt
        # once. So both runs take the first row's routing of the prompt and each completion's own routing.
        row_routing = [[torch.cat([calls[0][:size], c[size:]]) for c in calls] for calls in routing]
        prompt_flips = sum(
            int((c[:size].sort(-1).values != calls[0][:size].sort(-1).values).any(-1).sum())
            for calls in routing
            for c in calls[1:]
        )
        alone = run_alone(
            model, unshared, lambda out, i: completion_loss(out[size - 1], out[size:], completions[i]), row_routing
        )
        reference = torch.cat([alone.logits[0][:size], *(out[size:] for out in alone.logits)])
        restarting = torch.cat([torch.arange(size), *(torch.arange(n) for n in lengths)])[None]
        shared, control = run_packed(
            model,
            row,
            layout.position_ids(),
            lambda out: sum(
                completion_loss(out[size - 1], out[s.start : s.end], c)
                for s, c in zip(layout.groups[0][1:], completions, strict=True)
            ),
            [torch.cat([calls[0][:size], *(c[size:] for c in calls)]) for calls in routing],
            restarting,
        )
        spans = list(itertools.pairwise(itertools.accumulate((0, size, *lengths))))
        return {
            "prompt_tokens": size,
            "completions": len(completions),
            "tokens": row.shape[1],
            "unshared_tokens": sum(size + n for n in lengths),
            "prompt_routing_flips": prompt_flips,
            # Worst of the prompt and each completion: the long prompt's tokens would dilute a completion's error.
            **worst_closeness(shared.logits[0], reference, spans, prefix="logits_"),
            "loss_rel_err": abs(shared.loss - alone.loss) / abs(alone.loss),
            **gradient_closeness(shared.grads, alone.grads),
            "control_rel_l2": worst_closeness(control, reference, spans[1:])["rel_l2"],
        }, routing

    @staticmethod
    def _through_api(
        ctx: CheckContext, prompt: torch.Tensor, completions: list[torch.Tensor], routing: list[list[torch.Tensor]]
    ) -> dict[str, float]:
        """The trainer's calls on the same group: ``api.group_logprobs`` (the prompt once) against
        ``api.token_logprobs`` of each prompt + completion from the prompt's last position on (``api_group_logprobs_``
        closeness), MoE routers replaying the routing the comparison above replays."""
        from model_support.core import api
        from model_support.core.megatron.compare import closeness, replayed_routing

        model, size = ctx.state.get(TRAINING_MODEL), prompt.shape[1]
        tokens, rows = prompt[0].tolist(), [c[0].tolist() for c in completions]
        unshared = [torch.cat([torch.cat([calls[0][:size], c[size:]]) for c in calls]) for calls in routing]
        shared = [torch.cat([calls[0][:size], *(c[size:] for c in calls)]) for calls in routing]
        with torch.no_grad():
            with replayed_routing(model.module, unshared, batch=1):
                full = api.token_logprobs(model, [tokens + row for row in rows])
            with replayed_routing(model.module, shared, batch=1):
                group = api.group_logprobs(model, tokens, rows)
        ours, reference = torch.cat(group), torch.cat([f[size - 1 : -1] for f in full])
        if ours.shape != reference.shape:
            return dict.fromkeys(closeness(reference, reference, prefix="api_group_logprobs_"), float("inf"))
        return closeness(ours, reference, prefix="api_group_logprobs_")
