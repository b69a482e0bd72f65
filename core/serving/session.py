"""What the serving stages of one ``check`` run share: the policy adapter, its merged export, the server.

The *policy* is base + one LoRA adapter: the adapter the Megatron trainer wrote in the ``lora_coverage`` stage
when that ran (``ctx.artifacts["peft_adapter_dir"]``), else a seeded random PEFT adapter over the handler's HF
target modules. The trainer-side reference is the fp32 transformers model with that adapter merged
(:class:`model_support.core.megatron.hf_reference.StreamedReference`, one decoder layer in memory at a time).
One server per run serves the merged export; it is started once and
reused by the later stages, and reaped when the run's process exits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from model_support.core.codecs import load_peft_adapter, save_peft_adapter
from model_support.core.serving.backend import Server, ServingBackend, get_backend
from model_support.core.serving.export import base_tensors, export_merged
from model_support.core.serving.runtime import load_runtime
from model_support.core.serving.vllm_backend import ServeOptions
from model_support.core.validate import TargetCoverageError, checkpoint_modules, uncovered_targets
from model_support.validation.context import CheckContext

MEGATRON_ADAPTER_KEY = "peft_adapter_dir"  # written by the lora_coverage stage (core.megatron.session.ADAPTER_KEY)
ADAPTER_KEY = "serving.adapter_dir"
MERGED_KEY = "serving.merged_dir"
SERVER_KEY = "serving.server"
LORA_RANK, LORA_ALPHA = 8, 16.0


def backend() -> ServingBackend:
    return get_backend("vllm")


def serving_workdir(ctx: CheckContext) -> Path:
    path = ctx.workdir / "serving"
    path.mkdir(parents=True, exist_ok=True)
    return path


def serve_options(ctx: CheckContext, *, enable_lora: bool = False) -> ServeOptions:
    """The checkpoint's own dtype (vLLM's "auto" would run fp32 checkpoints in bf16 on CPU), except that CPU
    vLLM runs Gated DeltaNet only in bf16 (its CPU GDN kernel asserts "CPU GDN attention requires BF16")."""
    cpu = load_runtime().flavor == "cpu"
    stored = str(getattr(ctx.config.get_text_config(), "dtype", None) or "auto").removeprefix("torch.")
    dtype = "bfloat16" if cpu and ctx.spec.linear_attention else stored
    return ServeOptions(
        dtype=dtype,
        enable_lora=enable_lora,
        max_lora_rank=LORA_RANK,
        moe=ctx.layout.moe is not None,
        language_model_only=getattr(ctx.config, "vision_config", None) is not None,
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


def policy_adapter(ctx: CheckContext) -> tuple[Path, str]:
    """(adapter dir, where it came from); an adapter that leaves a declared target uncovered is an error."""
    trained = ctx.artifacts.get(MEGATRON_ADAPTER_KEY)
    if trained is not None:
        adapter, origin = Path(trained), "written by the Megatron trainer (lora_coverage)"
    else:
        if ADAPTER_KEY not in ctx.artifacts:
            out = serving_workdir(ctx) / "random-adapter"
            ctx.artifacts[ADAPTER_KEY] = random_adapter(ctx.model_dir, ctx.spec.hf_target_modules, out, ctx.seed + 7)
        adapter, origin = ctx.artifacts[ADAPTER_KEY], f"random PEFT adapter (rank {LORA_RANK}, seed {ctx.seed + 7})"
    _, tensors = load_peft_adapter(adapter)
    uncovered = uncovered_targets(ctx.spec, checkpoint_modules(tensors))
    if uncovered:
        raise TargetCoverageError(
            f"the policy adapter ({origin}) covers no module for {', '.join(uncovered)}: the checkpoint does not "
            "name those targets as the handler declares them (see the architecture stage)"
        )
    return adapter, origin


def merged_export(ctx: CheckContext) -> Path:
    if MERGED_KEY not in ctx.artifacts:
        adapter, _ = policy_adapter(ctx)
        ctx.artifacts[MERGED_KEY] = export_merged(ctx.model_dir, adapter, serving_workdir(ctx) / "merged-step-0")
    return ctx.artifacts[MERGED_KEY]


def policy_server(ctx: CheckContext) -> Server:
    """The run's server on the merged export, served as ``<handler>@0`` (started on first use)."""
    server = ctx.artifacts.get(SERVER_KEY)
    if server is None:
        server = backend().serve(
            merged_export(ctx), f"{ctx.spec.name}@0", serve_options(ctx), serving_workdir(ctx) / "vllm-policy.log"
        )
        ctx.artifacts[SERVER_KEY] = server
    return server


def trainer_logprobs(ctx: CheckContext, adapter: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per-position log-softmax of the fp32 transformers policy (base + adapter merged) for each sequence."""
    from model_support.core.megatron.hf_reference import adapter_deltas
    from model_support.core.megatron.session import hf_reference

    reference, deltas = hf_reference(ctx), adapter_deltas(adapter)
    by_length: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        by_length.setdefault(len(seq), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for rows in by_length.values():  # one forward per length: no padding
        logits = reference.forward(torch.tensor([sequences[i] for i in rows]), adapter=deltas).logits
        out.update(zip(rows, torch.log_softmax(logits.double().cpu(), dim=-1), strict=True))
    return [out[i] for i in range(len(sequences))]


def token_logprobs(logprobs: torch.Tensor, seq: list[int], start: int) -> torch.Tensor:
    """log p(seq[t] | seq[:t]) for t >= start, from per-position log-softmax rows."""
    positions = torch.arange(start, len(seq))
    return logprobs[positions - 1, torch.tensor(seq[start:])]


def served_prompt_logprobs(choice: dict[str, Any], seq: list[int]) -> torch.Tensor:
    """vLLM's prompt_logprobs for tokens 1.. of ``seq`` (entry 0 is None)."""
    rows = choice["prompt_logprobs"][1:]
    return torch.tensor([row[str(tok)]["logprob"] for row, tok in zip(rows, seq[1:], strict=True)], dtype=torch.float64)


def random_prompts(ctx: CheckContext, count: int, length: int) -> list[list[int]]:
    vocab = int(getattr(ctx.config.get_text_config(), "vocab_size", 512))
    gen = torch.Generator().manual_seed(ctx.seed + 11)
    return [torch.randint(10, min(vocab, 500), (length,), generator=gen).tolist() for _ in range(count)]
