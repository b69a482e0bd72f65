"""What the Megatron stages share within one ``check`` run: the run-state resources (``validation/state.py``) of the
bridge-built model, its LoRA, the transformers references and what lora_coverage and hf_parity leave for later
stages, and the helpers that read them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from model_support.core import api, timing
from model_support.core.api import TrainingModel
from model_support.core.megatron.builder import MegatronModel
from model_support.core.megatron.dist import device
from model_support.core.megatron.hf_reference import StreamedReference
from model_support.core.megatron.lora import LoraReport
from model_support.validation.state import Resource

LORA_RANK = 8
LORA_ALPHA = 16.0


def _build_training_model(ctx: Any) -> TrainingModel:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[ctx.dtype]
    with timing.phase("build"):
        # The training steps recompute each layer's activations in the backward, as trainers at real width run (a
        # 4096-token step of the 48-layer Qwen3-30B-A3B under ep4 holds 40 GB of activations on each H100
        # otherwise), on the CPU too: the check's verdict is on the code path a GPU run takes.
        model = api.build_model(
            ctx.model_dir,
            handler=ctx.handler,
            config=ctx.config,
            dtype=dtype,
            parallel=ctx.parallel,
            recompute=True,
        )
    model.module.eval()
    return model


@contextmanager
def training_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in training mode while open (a trainer's step: megatron-core recomputes activations only in
    it), back to its own mode after."""
    was = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was)


def _apply_lora(ctx: Any) -> LoraReport:
    model = ctx.state.get(TRAINING_MODEL)
    return model.lora or api.apply_lora(model, rank=LORA_RANK, alpha=LORA_ALPHA)


class References:
    """The transformers references of a run, one per dtype, on the device the Megatron model uses (each built on
    first use; one decoder layer in memory at a time)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._by_dtype: dict[torch.dtype, StreamedReference] = {}

    def in_dtype(self, dtype: torch.dtype) -> StreamedReference:
        if dtype not in self._by_dtype:
            with timing.phase("oracle"):
                self._by_dtype[dtype] = StreamedReference(self._ctx.model_dir, self._ctx.config, device(), dtype)
        return self._by_dtype[dtype]


TRAINING_MODEL: Resource[TrainingModel] = Resource(
    "training_model",
    "the bridge-built Megatron model, converted once per run through the training-time API, in the dtype "
    "`check --dtype` asks for (default: the device's): whole in one process, or sharded across the run's ranks in "
    "the layout `check --parallel` names",
    _build_training_model,
)
LORA: Resource[LoraReport] = Resource(
    "lora",
    f"LoRA (rank {LORA_RANK}) applied in place on every declared target of the training model",
    _apply_lora,
    uses=(TRAINING_MODEL,),
)
HF_REFERENCES: Resource[References] = Resource(
    "hf_references",
    "the transformers references (fp32, and the model's dtype where lower), streamed one decoder layer at a time",
    References,
)
TRAINED_ADAPTER: Resource[Path] = Resource(
    "trained_adapter", "the PEFT adapter the Megatron trainer exported from its LoRA (provided by lora_coverage)"
)
PARITY_ROWS = (2, 32)  # hf_parity's batch of short rows (rows, tokens), beside its long row


def parity_rows(ctx: Any) -> list[tuple[str, torch.Tensor]]:
    """The rows ``hf_parity`` compares, under their metric prefixes: a batch of short rows, and one row across every
    length-dependent structure of the model (:func:`long_row`)."""
    return [
        ("", random_tokens(ctx, PARITY_ROWS, offset=0)),
        ("long_", random_tokens(ctx, (1, long_row(ctx)), offset=1)),
    ]


def worst_lowp(lowps: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The largest of each rounding-distance measure over rows (``None`` for an fp32 model)."""
    return None if lowps[0] is None else {k: max(lp[k] for lp in lowps) for k in lowps[0]}


def _measure_reference_lowp(ctx: Any) -> dict[str, float] | None:
    """transformers' own rounding distance on ``hf_parity``'s rows, as ``hf_parity`` measures it while it compares
    (which provides it): measured here only where it has not run, e.g. for a stage run alone."""
    dtype = ctx.state.get(TRAINING_MODEL).built.numerics.dtype
    if dtype == torch.float32:
        return None
    return worst_lowp([reference_and_lowp(ctx, dtype, tokens)[2] for _, tokens in parity_rows(ctx)])


REFERENCE_LOWP_ERROR: Resource[dict[str, float] | None] = Resource(
    "reference_lowp_error",
    "how far transformers' own run in the model's dtype lands from its fp32 run on hf_parity's rows (None for an "
    "fp32 model): provided by hf_parity as it compares, measured on first use where it has not run",
    _measure_reference_lowp,
    uses=(TRAINING_MODEL, HF_REFERENCES),
)


def megatron_model(ctx: Any) -> MegatronModel:
    """The bridge-built megatron-core model of the run (the training model's ``built``)."""
    return ctx.state.get(TRAINING_MODEL).built


def hf_reference(ctx: Any, dtype: torch.dtype = torch.float32) -> StreamedReference:
    """The run's transformers reference in ``dtype``."""
    return ctx.state.get(HF_REFERENCES).in_dtype(dtype)


def with_random_lora(ctx: Any, offset: int) -> MegatronModel:
    """The run's model with LoRA on, loaded with a random non-zero adapter (seed: the run's + ``offset``), so a
    comparison sees the adapter and gradients reach every LoRA factor."""
    from model_support.core.megatron.lora import load_lora_state, random_lora_state

    built = megatron_model(ctx)
    ctx.state.get(LORA)
    load_lora_state(built.model, random_lora_state(built.model, seed=ctx.seed + offset, b_std=0.05))
    return built


def export_random_lora(ctx: Any, offset: int, directory: Path) -> Path:
    """A seeded random adapter (:func:`with_random_lora`) exported through the API to ``directory``, the model's own
    adapter put back after."""
    from model_support.core.megatron.lora import load_lora_state, lora_state

    model = megatron_model(ctx).model
    ctx.state.get(LORA)
    kept = lora_state(model)
    try:
        with_random_lora(ctx, offset)
        return api.export_adapter(ctx.state.get(TRAINING_MODEL), directory)
    finally:
        load_lora_state(model, kept)


def long_row(ctx: Any) -> int:
    """The length of the run's long rows: across every length-dependent structure of the model
    (:func:`~model_support.core.layout.length_structures`), and at least ``REAL_WIDTH_LONG_ROW`` tokens on a GPU."""
    from model_support.core.layout import REAL_WIDTH_LONG_ROW, long_row_length

    floor = REAL_WIDTH_LONG_ROW if device().type == "cuda" else 0
    return long_row_length(ctx.config, ctx.layout, floor=floor)


def crossing(ctx: Any, length: int, prefix: str = "long_row_") -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(metrics, thresholds, details) of the stage's own check that the row it compares for the model's
    length-dependent structures (:func:`~model_support.core.layout.length_structures`), ``length`` tokens as the stage
    ran it, crosses every one: ``<prefix>structures_uncrossed`` held to 0. A row cut short (a cap, a harness bug)
    would compare nothing of the structure it stops before, and pass."""
    from model_support.core.layout import length_structures

    missed = [
        f"{name} (from {n} tokens)" for name, n in length_structures(ctx.config, ctx.layout).items() if length < n
    ]
    key = f"{prefix}structures_uncrossed"
    details = [f"the {length}-token row does not cross {', '.join(missed)}"] if missed else []
    return {key: len(missed)}, {key: 0}, details


def random_tokens(ctx: Any, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """Token ids drawn from the model's vocabulary with the run's seed."""
    from model_support.core.layout import text_config

    vocab = int(text_config(ctx.config).vocab_size)
    gen = torch.Generator().manual_seed(ctx.seed + offset)
    return torch.randint(0, vocab, shape, generator=gen)


def reference_and_lowp(
    ctx: Any, dtype: torch.dtype, tokens: torch.Tensor, *, adapter: Any = None
) -> tuple[Any, list[torch.Tensor], dict[str, float] | None]:
    """The fp32 reference's run on ``tokens`` (carrying ``adapter``; MoE routers recorded), its routing, and how far
    transformers' own ``dtype`` run lands from it (``None`` for fp32).

    Same weights (and ``adapter``), same routing (replayed): the rounding error a correct ``dtype`` implementation
    of the model has, which the model under test is held to a multiple of.
    """
    from model_support.core.megatron.compare import closeness

    ref = hf_reference(ctx).forward(tokens, adapter=adapter, routers=ctx.layout.moe is not None)
    routing = [r.indices for r in ref.routers]
    if dtype == torch.float32:
        return ref, routing, None
    low = hf_reference(ctx, dtype).forward(tokens, adapter=adapter, replay=routing or None)
    return ref, routing, closeness(low.logits, ref.logits)
