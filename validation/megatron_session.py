"""What the Megatron stages share within one ``check`` run (kept in ``ctx.artifacts``).

Artifact keys:

* ``megatron_model`` (:class:`~model_support.core.api.TrainingModel`): the bridge-built model, converted once
  per run (tensor parallel 1) by the training-time API;
* ``megatron_lora`` (:class:`~model_support.core.megatron.lora.LoraReport`): LoRA applied in place on it;
* ``peft_adapter_dir`` (Path): the PEFT adapter exported by ``lora_coverage`` from the Megatron LoRA;
* ``reference_lowp_error`` (dict or None): how far transformers' own run in the model's dtype lands from its
  fp32 run (:func:`reference_lowp`, measured by ``hf_parity``; None for an fp32 model);
* ``hf_reference:<dtype>`` (:class:`~model_support.core.megatron.hf_reference.StreamedReference`): the
  transformers reference (fp32, and the model's dtype where that is lower, to measure its own rounding error)
  on the Megatron model's device, one decoder layer in memory at a time.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from model_support.core import api, timing
from model_support.core.api import TrainingModel
from model_support.core.megatron.builder import MegatronModel
from model_support.core.megatron.dist import device
from model_support.core.megatron.hf_reference import StreamedReference
from model_support.core.megatron.lora import LoraReport

MODEL_KEY = "megatron_model"
LORA_KEY = "megatron_lora"
ADAPTER_KEY = "peft_adapter_dir"
REFERENCE_KEY = "hf_reference"
LOWP_KEY = "reference_lowp_error"
LORA_RANK = 8
LORA_ALPHA = 16.0


def training_model(ctx: Any) -> TrainingModel:
    """The run's model, built on first use through :func:`model_support.core.api.build_model` (``build_s`` records
    the conversion time), in the dtype ``check --dtype`` asks for (default: the device's)."""
    if MODEL_KEY not in ctx.artifacts:
        start = time.perf_counter()
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[ctx.dtype]
        with timing.phase("build"):
            model = api.build_model(ctx.model_dir, handler=ctx.handler, config=ctx.config, dtype=dtype)
        model.module.eval()
        ctx.artifacts[MODEL_KEY] = model
        ctx.artifacts["megatron_build_s"] = time.perf_counter() - start
    return ctx.artifacts[MODEL_KEY]


def megatron_model(ctx: Any) -> MegatronModel:
    """The bridge-built megatron-core model of the run (:func:`training_model`'s ``built``)."""
    return training_model(ctx).built


def hf_reference(ctx: Any, dtype: torch.dtype = torch.float32) -> StreamedReference:
    """The run's transformers reference in ``dtype`` on the device the Megatron model uses (built on first use)."""
    key = f"{REFERENCE_KEY}:{dtype}"
    if key not in ctx.artifacts:
        with timing.phase("oracle"):
            ctx.artifacts[key] = StreamedReference(ctx.model_dir, ctx.config, device(), dtype)
    return ctx.artifacts[key]


def megatron_lora(ctx: Any) -> LoraReport:
    """LoRA on every declared target of the run's Megatron model (applied once, through the API)."""
    model = training_model(ctx)
    return model.lora or api.apply_lora(model, rank=LORA_RANK, alpha=LORA_ALPHA)


def with_random_lora(ctx: Any, offset: int) -> MegatronModel:
    """The run's model with LoRA on, loaded with a random non-zero adapter (seed: the run's + ``offset``), so a
    comparison sees the adapter and gradients reach every LoRA factor."""
    from model_support.core.megatron.lora import load_lora_state, random_lora_state

    built = megatron_model(ctx)
    megatron_lora(ctx)
    load_lora_state(built.model, random_lora_state(built.model, seed=ctx.seed + offset, b_std=0.05))
    return built


def long_row(ctx: Any) -> int:
    """The length of the run's long rows: across every length-dependent structure of the model
    (:func:`~model_support.core.layout.length_structures`), and at least ``REAL_WIDTH_LONG_ROW`` tokens on a GPU."""
    from model_support.core.layout import REAL_WIDTH_LONG_ROW, long_row_length

    floor = REAL_WIDTH_LONG_ROW if device().type == "cuda" else 0
    return long_row_length(ctx.config, ctx.layout, floor=floor)


def random_tokens(ctx: Any, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """Token ids drawn from the model's vocabulary with the run's seed."""
    from model_support.core.layout import text_config

    vocab = int(text_config(ctx.config).vocab_size)
    gen = torch.Generator().manual_seed(ctx.seed + offset)
    return torch.randint(0, vocab, shape, generator=gen)


def reference_lowp(
    ctx: Any,
    dtype: torch.dtype,
    tokens: torch.Tensor,
    fp32_logits: torch.Tensor,
    *,
    adapter: Any = None,
    routing: list[torch.Tensor] | None = None,
) -> dict[str, float] | None:
    """How far transformers' own ``dtype`` run lands from its fp32 run on ``tokens`` (``None`` for fp32).

    Same weights (and ``adapter``), same routing (``routing`` replayed): the rounding error a correct
    ``dtype`` implementation of the model has, which the model under test is held to a multiple of.
    """
    from model_support.core.megatron.compare import closeness

    if dtype == torch.float32:
        return None
    low = hf_reference(ctx, dtype).forward(tokens, adapter=adapter, replay=routing or None)
    return closeness(low.logits, fp32_logits)
