"""What the Megatron stages share within one ``check`` run (kept in ``ctx.artifacts``).

Artifact keys:

* ``megatron_model`` (:class:`~model_support.core.megatron.builder.MegatronModel`): the bridge-built model,
  converted once per run (tensor parallel 1);
* ``megatron_lora`` (:class:`~model_support.core.megatron.lora.LoraReport`): LoRA applied in place on it;
* ``peft_adapter_dir`` (Path): the PEFT adapter exported by ``lora_coverage`` from the Megatron LoRA.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from model_support.core.megatron.builder import MegatronModel, build_megatron_model
from model_support.core.megatron.lora import LoraReport, apply_lora

MODEL_KEY = "megatron_model"
LORA_KEY = "megatron_lora"
ADAPTER_KEY = "peft_adapter_dir"
LORA_RANK = 8
LORA_ALPHA = 16.0


def megatron_model(ctx: Any) -> MegatronModel:
    """The run's Megatron model, built on first use (``build_s`` records the conversion time)."""
    if MODEL_KEY not in ctx.artifacts:
        start = time.perf_counter()
        mtp = bool(ctx.layout.mtp_layers) and not ctx.spec.runtime.disable_mtp_for_training
        built = build_megatron_model(ctx.model_dir, ctx.config, mtp=mtp)
        built.model.eval()
        ctx.artifacts[MODEL_KEY] = built
        ctx.artifacts["megatron_build_s"] = time.perf_counter() - start
    return ctx.artifacts[MODEL_KEY]


def megatron_lora(ctx: Any) -> LoraReport:
    """LoRA on every declared target of the run's Megatron model (applied once)."""
    if LORA_KEY not in ctx.artifacts:
        ctx.artifacts[LORA_KEY] = apply_lora(megatron_model(ctx).model, ctx.spec, rank=LORA_RANK, alpha=LORA_ALPHA)
    return ctx.artifacts[LORA_KEY]


def random_tokens(ctx: Any, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """Token ids drawn from the model's vocabulary with the run's seed."""
    from model_support.core.layout import text_config

    vocab = int(text_config(ctx.config).vocab_size)
    gen = torch.Generator().manual_seed(ctx.seed + offset)
    return torch.randint(0, vocab, shape, generator=gen)
