"""What the serving tests share: random PEFT adapters built on the HF side (independent A per module), the prompt they
score and the log-probabilities a server gives it."""

from __future__ import annotations

from pathlib import Path

import torch

from model_support.core.codecs import save_peft_adapter
from model_support.core.serving.backend import Server
from model_support.core.serving.export import base_tensors
from model_support.handlers import BUILTIN_HANDLERS

LORA_RANK, LORA_ALPHA = 8, 16.0
PROMPT = [17, 101, 44, 250, 9, 311, 66, 140, 23, 77]
# The LoRA target modules of the tiny Qwen3 replica the shared server serves.
TARGETS = next(h for h in BUILTIN_HANDLERS if h.name == "qwen3").hf_target_modules


def served_logprobs(server: Server, model: str | None = None) -> torch.Tensor:
    """The log-probability ``server`` (as ``model``: default its served name) gives each token of :data:`PROMPT` after
    the first."""
    choice = server.completion(PROMPT, model=model, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return torch.tensor(
        [row[str(t)]["logprob"] for row, t in zip(choice["prompt_logprobs"][1:], PROMPT[1:], strict=True)]
    )


def random_adapter(model_dir: Path, target_modules: tuple[str, ...], out_dir: Path, seed: int) -> Path:
    """A PEFT LoRA adapter with random A and B on every 2-D checkpoint weight whose module is a target."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in base_tensors(model_dir):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or weight.ndim != 2 or module.rpartition(".")[2] not in target_modules:
            continue
        out_features, in_features = weight.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = (
            torch.randn(LORA_RANK, in_features, generator=gen) / in_features**0.5
        )
        tensors[f"base_model.model.{module}.lora_B.weight"] = 0.05 * torch.randn(out_features, LORA_RANK, generator=gen)
    return save_peft_adapter(out_dir, tensors, rank=LORA_RANK, alpha=LORA_ALPHA, base_model=str(model_dir))
