"""Stage `trainability`: a few LoRA optimizer steps in Megatron learn a small yes/no task."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from model_support.validation.context import CHAT_RENDERER, TOKENIZER, CheckContext
from model_support.validation.megatron_session import LORA, TRAINING_MODEL
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES

QUESTIONS = (
    ("Is the sky blue?", "yes"),
    ("Is fire cold?", "no"),
    ("Is one less than two?", "yes"),
    ("Is ten less than three?", "no"),
    ("Do experts route tokens?", "yes"),
    ("Are base weights trained?", "no"),
    ("Is the fox quick?", "yes"),
    ("Is the dog quick?", "no"),
)


class TrainabilityStage(Stage):
    """Fresh LoRA (B = 0) on every declared target of the Megatron model; AdamW on the LoRA parameters only,
    full-batch steps on eight chat-formatted yes/no questions packed in one row (loss: cross entropy between
    the "yes" and "no" token logits after each prompt).

    The schedule is scale-aware (:func:`peak_lr`): the peak learning rate shrinks with the square roots of
    the width and the depth (LoRA's update to the residual stream grows with both), reached by a linear
    warm-up; gradients are clipped to norm 1; training stops early once every answer is right and the loss
    is at most ``loss_ratio`` of the first. Pass: that loss ratio within ``max_steps``, and no base weight
    changed. A handler whose LoRA does not reach the loss keeps its first loss and fails."""

    name = "trainability"
    title = "LoRA optimizer steps cut the loss of a small yes/no task; base weights stay unchanged."
    order = 60
    sharded = True
    requires = ("hf_parity",)
    needs = (TRAINING_MODEL, LORA, TOKENIZER, CHAT_RENDERER)
    packages = MEGATRON_PACKAGES
    thresholds: ClassVar[dict[str, float]] = {"loss_ratio": 0.5, "base_params_changed": 0}
    max_steps, warmup_steps, clip_norm = 40, 5, 1.0

    def prepare(self, ctx: CheckContext) -> None:
        ctx.state.get(CHAT_RENDERER)  # loads the tokenizer in its child while earlier stages run

    def run(self, ctx: CheckContext) -> StageResult:

        from model_support.core.layout import text_config
        from model_support.core.megatron.dist import union_over_ranks
        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.lora import fresh_lora, lora_state, reduce_lora_grads

        model = ctx.state.get(TRAINING_MODEL).module
        ctx.state.get(LORA)
        fresh_lora(model, seed=ctx.seed)  # the same adapter whatever the layout the model is sharded in
        tokenizer = ctx.tokenizer()
        encoded_answers = {a: tokenizer.encode(a, add_special_tokens=False) for a in ("yes", "no")}
        if not all(encoded_answers.values()):
            return self.failed("the tokenizer encodes 'yes' or 'no' to no token")
        answers = {a: ids[0] for a, ids in encoded_answers.items()}
        if answers["yes"] == answers["no"]:
            return self.failed("the tokenizer gives 'yes' and 'no' the same first token")
        prompts = ctx.chat_prompts([[{"role": "user", "content": q}] for q, _ in QUESTIONS])
        encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        row = torch.tensor([t for ids in encoded for t in ids])[None]
        positions = torch.cat([torch.arange(len(ids)) for ids in encoded])[None]
        ends = torch.cumsum(torch.tensor([len(ids) for ids in encoded]), 0) - 1
        choices = torch.tensor([answers["yes"], answers["no"]])
        targets = torch.tensor([0 if a == "yes" else 1 for _, a in QUESTIONS])

        device = next(model.parameters()).device
        ends, choices, targets = ends.to(device), choices.to(device), targets.to(device)
        base = base_fingerprints(model)
        params = [p for p in model.parameters() if p.requires_grad]
        tcfg = text_config(ctx.config)
        lr = peak_lr(int(tcfg.hidden_size), int(tcfg.num_hidden_layers))
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / self.warmup_steps))
        losses: list[float] = []
        accuracy = 0.0
        model.train()
        try:
            for step in range(self.max_steps + 1):
                optimizer.zero_grad(set_to_none=True)
                out = logits(model, row, positions)[0, ends][:, choices]
                loss = torch.nn.functional.cross_entropy(out, targets)
                losses.append(loss.item())
                accuracy = (out.argmax(-1) == targets).float().mean().item()
                learned = accuracy == 1.0 and losses[-1] <= self.thresholds["loss_ratio"] * losses[0]
                if learned or step == self.max_steps:
                    break
                loss.backward()
                reduce_lora_grads(model)
                clip_whole_grad_norm(model, params, self.clip_norm)
                optimizer.step()
                warmup.step()
        finally:
            model.eval()
            optimizer.zero_grad(set_to_none=True)
        changed = sorted(union_over_ranks(changed_base(model, base)))
        metrics = {
            "steps": len(losses) - 1,
            "peak_lr": lr,
            "initial_loss": losses[0],
            "final_loss": losses[-1],
            "loss_ratio": losses[-1] / losses[0],
            "final_accuracy": accuracy,
            "base_params_changed": len(changed),
            "trainable_params": sum(t.numel() for t in lora_state(model).values())
            + sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n),
        }
        details = [
            f"peak lr {lr:.3g} (hidden {tcfg.hidden_size}, {tcfg.num_hidden_layers} layers), {self.warmup_steps} "
            f"warm-up steps, gradient norm clipped to {self.clip_norm}, at most {self.max_steps} steps",
            "losses: " + ", ".join(f"{x:.3f}" for x in losses),
        ]
        if changed:
            details.append(f"base weights changed: {', '.join(changed[:4])}")
        summary = f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses) - 1} steps, accuracy {accuracy:.2f}"
        return self.judge(metrics, self.thresholds, summary, details, ctx=ctx)


def clip_whole_grad_norm(model: torch.nn.Module, params: list[torch.nn.Parameter], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients, whatever ranks the model is sharded over
    (this rank's norm alone would clip each rank differently): every rank's gradients scaled alike. Written here
    because megatron-core's ``clip_grad_norm_fp32`` knows its own parameters' sharding, not the LoRA factors'.

    A factor split over a tensor-parallel group (the column-parallel B, the row-parallel A) adds its shards' squares
    over that group; a replicated one counts once. Experts add up over the expert-parallel group, layers over the
    pipeline group. Any other trainable parameter (a base weight left trainable) counts as this rank holds it."""
    from megatron.core import parallel_state

    from model_support.core.megatron.lora import lora_modules

    device = params[0].device
    # [dense split, dense whole, expert split, expert whole]: squared norms
    squares = torch.zeros(4, dtype=torch.float64, device=device)
    for module in lora_modules(model).values():
        for factor, split in ((module.lora_A.weight, not module.column), (module.lora_B.weight, module.column)):
            if factor.grad is not None:
                squares[2 * module.expert + (not split or module.tp == 1)] += factor.grad.double().square().sum()
    for name, param in model.named_parameters():
        if param.grad is not None and ".lora_" not in name:
            squares[1] += param.grad.double().square().sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squares[0:1], group=parallel_state.get_tensor_model_parallel_group())
        dist.all_reduce(squares[2:3], group=parallel_state.get_expert_tensor_parallel_group())
        experts = squares[2:].sum(dim=0, keepdim=True)
        dist.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
        total = squares[:2].sum(dim=0, keepdim=True) + experts
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    else:
        total = squares.sum(dim=0, keepdim=True)
    scale = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0).float()
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.device))


def peak_lr(hidden_size: int, num_layers: int) -> float:
    """1e-2 for a 64-wide, 2-layer model, scaled by 1/sqrt of width and depth beyond that."""
    return 1e-2 * min(1.0, (64 / hidden_size) ** 0.5) * min(1.0, (2 / num_layers) ** 0.5)


def base_fingerprints(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`fingerprint` of every parameter that is not LoRA's, trainable or not (a base weight left trainable
    by mistake must be watched too)."""
    return {n: fingerprint(p) for n, p in model.named_parameters() if ".lora_" not in n}


def changed_base(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The parameters of ``before`` (from :func:`base_fingerprints`) whose fingerprint has changed, sorted."""
    return sorted(n for n, p in model.named_parameters() if n in before and not torch.equal(fingerprint(p), before[n]))


@torch.no_grad()
def fingerprint(param: torch.Tensor) -> torch.Tensor:
    """Two float64 sums of a tensor (plain, and position-weighted): a change to any element, or a permutation,
    changes them, and they cost two numbers instead of a copy of the weight."""
    flat = param.detach().flatten().double()
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(977).add_(1)
    return torch.stack((flat.sum(), (flat * weights).sum()))
