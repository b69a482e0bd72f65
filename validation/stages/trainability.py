"""Stage `trainability`: a few LoRA optimizer steps in Megatron learn a small yes/no task."""

from __future__ import annotations

from typing import ClassVar

import torch

from model_support.validation.context import CheckContext
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
    ``steps`` full-batch steps on eight chat-formatted yes/no questions packed in one row (loss: cross
    entropy between the "yes" and "no" token logits after each prompt). The final loss must be at most
    ``loss_ratio`` times the first, and no base weight may change."""

    name = "trainability"
    title = "A few LoRA optimizer steps cut the loss of a small yes/no task; base weights stay unchanged."
    order = 60
    requires = ("hf_parity",)
    packages = MEGATRON_PACKAGES
    thresholds: ClassVar[dict[str, float]] = {"loss_ratio": 0.5, "base_max_abs_change": 0.0}
    steps, lr = 10, 1e-2

    def run(self, ctx: CheckContext) -> StageResult:
        from transformers import AutoTokenizer

        from model_support.core.megatron.forward import logits
        from model_support.core.megatron.lora import lora_modules
        from model_support.core.megatron.session import megatron_lora, megatron_model

        model = megatron_model(ctx).model
        megatron_lora(ctx)
        torch.manual_seed(ctx.seed)
        for module in lora_modules(model).values():
            torch.nn.init.kaiming_uniform_(module.lora_A.weight, a=5**0.5)
            torch.nn.init.zeros_(module.lora_B.weight)
        tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
        answers = {a: tokenizer.encode(a, add_special_tokens=False)[0] for a in ("yes", "no")}
        if answers["yes"] == answers["no"]:
            return self.failed("the tokenizer gives 'yes' and 'no' the same first token")
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q, _ in QUESTIONS
        ]
        encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        row = torch.tensor([t for ids in encoded for t in ids])[None]
        positions = torch.cat([torch.arange(len(ids)) for ids in encoded])[None]
        ends = torch.cumsum(torch.tensor([len(ids) for ids in encoded]), 0) - 1
        choices = torch.tensor([answers["yes"], answers["no"]])
        targets = torch.tensor([0 if a == "yes" else 1 for _, a in QUESTIONS])

        device = next(model.parameters()).device
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        losses = []
        model.train()
        try:
            for _ in range(self.steps + 1):
                optimizer.zero_grad(set_to_none=True)
                out = logits(model, row, positions)[0, ends.to(device)][:, choices.to(device)]
                loss = torch.nn.functional.cross_entropy(out, targets.to(device))
                losses.append(loss.item())
                accuracy = (out.argmax(-1) == targets.to(device)).float().mean().item()
                if len(losses) <= self.steps:
                    loss.backward()
                    optimizer.step()
        finally:
            model.eval()
            optimizer.zero_grad(set_to_none=True)
        change = max((p.detach() - base[n]).abs().max().item() for n, p in model.named_parameters() if n in base)
        metrics = {
            "steps": self.steps,
            "initial_loss": losses[0],
            "final_loss": losses[-1],
            "loss_ratio": losses[-1] / losses[0],
            "final_accuracy": accuracy,
            "base_max_abs_change": change,
            "trainable_params": sum(p.numel() for p in params),
        }
        details = ["losses: " + ", ".join(f"{x:.3f}" for x in losses)]
        return self.judge(
            metrics, self.thresholds, f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {self.steps} steps", details
        )
