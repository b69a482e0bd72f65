"""Worker of the ``parallel_parity`` stage: one job per handler, every layout in turn.

Run as ``python -m model_support.validation.parallel_worker --world W OUT MODEL_DIR HANDLER single,tp2,...
[--mutation NAME]`` (W ranks forked from this process: see :func:`launch`; without ``--world``, one rank of a job
another launcher such as ``torchrun`` started; ``--mutation``: the selftest's bug, which the stage passes on only
while ``model-support selftest`` injects it in the parent). For each layout the job builds the model through the
training-time API in that layout (the rest of the world is data parallel, every rank fed the same tokens), loads the
same canonical random LoRA, runs one forward and backward through ``api.forward_backward`` (megatron-core's schedule
for the layout, two micro-batches), reduces the gradients as a trainer does (``api.reduce_lora_grads``), takes one
SGD step on the LoRA, and writes on rank 0 ``OUT/<layout>.safetensors``: the logits, the loss, the whole model's
LoRA gradient norm (``api.lora_grad_norm``), each router's top-k expert sets (every token, in sequence order), the
PEFT adapter the handler's codec exports before and after the step, the merged HF weights after it
(``api.merged_weights``: the fp32 ``single`` run writes them, every other fp32 run only its distance from those, see
``compare.merged_distance``), the step's tokens, and, on the adapter before the step, the logits of
shared-prefix rows (a prompt and three completions each; not under context parallelism, which needs THD attention
for packed rows) and the trainer's scoring calls (``api.token_logprobs``, ``api.group_logprobs``) with how far any
rank's rows are from rank 0's; and the adapter ``api.apply_lora`` draws (its seed makes it one canonical adapter in
every layout). fp32 runs are eager (:func:`model_support.core.precision.eager_only`), bf16 runs compile what
megatron-core compiles. ``single`` (one rank's model, the rest data parallel) is the oracle the stage compares every
other layout with; in fp32 it also exports its adapter before the step (``OUT/single.adapter``), for transformers'
run of its rows. A rank's error goes to ``OUT/<layout>.rank<R>.error`` and ends the job (see :func:`_fail`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from model_support.core import api
from model_support.core.layout import long_row_length
from model_support.core.megatron.context_parallel import whole_sequence
from model_support.core.megatron.dist import ParallelLayout
from model_support.core.megatron.forward import MicroBatch
from model_support.core.megatron.lora import load_lora_state, lora_modules, lora_state, random_lora_state
from model_support.core.megatron.names import global_name
from model_support.core.megatron.rows import RowLayout
from model_support.core.precision import eager_only, exact_fp32, settled_fla_kernels
from model_support.core.registry import load_registry
from model_support.validation import ranks
from model_support.validation.selftest import injected

SEED = 3
LR = 0.5
BATCH = 2
# Sequence lengths are a multiple of every tensor- and context-parallel split tried (2 x cp x tp, at most 16).
SPLIT = 16
MICRO_BATCHES = 2  # more than one, so a pipeline schedule interleaves them
# The fp32 single-rank run's adapter (before the step), as PEFT writes it, under OUT.
ORACLE_ADAPTER = "single.adapter"
SHARED_ROW = (10, (6, 4, 6))  # a prompt and its completions in one row (26 tokens: even, for TP)
# A rank that stalls without raising (a deadlock, a lost peer) fails its collectives after this; the longest
# legitimate wait is a peer building its model (a real-width pipeline stage loading from disk).
COLLECTIVE_TIMEOUT_S = 600.0


def _layout(name: str) -> ParallelLayout:
    return ParallelLayout() if name == "single" else ParallelLayout.parse(name)


def parse_run(token: str) -> tuple[str, torch.dtype]:
    """A run of the job: ``tp2`` (the layout in fp32) or ``tp2.bf16`` (in bf16) -> (layout, dtype)."""
    name, _, dtype = token.partition(".")
    if dtype not in ("", "bf16"):
        raise ValueError(f"run {token!r}: the dtype after the layout is bf16 or nothing (fp32)")
    return name, torch.bfloat16 if dtype else torch.float32


def _dtypes_and_rounding(chunks: list[torch.nn.Module]) -> tuple[dict[str, list[str]], torch.Tensor]:
    """(every parameter's dtype and every LoRA gradient's, by single-rank name, as every rank holds them; how many
    LoRA gradients are bf16 values stored in fp32). A gradient reduced or accumulated in bf16 is the only way an fp32
    gradient of 16 or more nonzero elements holds bf16 values alone (by chance: 2^-16 an element)."""
    mine: dict[str, str] = {}
    rounded = 0
    for chunk in chunks:
        for local, param in chunk.named_parameters():
            name = global_name(chunk, local)
            mine[name] = str(param.dtype).removeprefix("torch.")
            grad = param.grad
            if param.requires_grad and grad is not None:
                mine[f"{name}.grad"] = str(grad.dtype).removeprefix("torch.")
                if grad.numel() >= 16 and bool(grad.any()) and torch.equal(grad, grad.bfloat16().to(grad.dtype)):
                    rounded += 1
    parts: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, mine)
    seen: dict[str, set[str]] = {}
    for part in parts:
        for name, dtype in part.items():
            seen.setdefault(name, set()).add(dtype)
    count = torch.tensor(float(rounded), device=next(chunks[0].parameters()).device)
    dist.all_reduce(count)
    return {name: sorted(dtypes) for name, dtypes in seen.items()}, count.cpu().reshape(1)


def _router_topk(chunks: list[torch.nn.Module]) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Record each router's top-k expert indices (sorted per token) on every forward, by the router's name in the
    single-rank model."""
    from megatron.core.transformer.moe.router import TopKRouter

    records: dict[str, list[torch.Tensor]] = {}
    handles = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter):
                calls = records.setdefault(global_name(chunk, name), [])

                def hook(_module, _inputs, output, calls=calls):
                    routing_map = output[1]  # [tokens, experts] bool
                    k = int(routing_map.sum(-1).max())
                    calls.append(routing_map.float().topk(k, dim=-1).indices.sort(-1).values)

                handles.append(module.register_forward_hook(hook))
    return records, handles


def _whole_sequence(local: torch.Tensor, rows: int, sequence_parallel: bool) -> torch.Tensor:
    """One router call's [tokens, k] (sequence-major, this rank's part of the sequence) -> [rows, S, k], every token
    in order: gathered over the tensor-parallel sequence shards, then over context-parallel ranks."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if sequence_parallel:
        local = gather_from_sequence_parallel_region(local)
    per_row = local.reshape(-1, rows, local.shape[-1]).transpose(0, 1)
    return whole_sequence(per_row)


def _stage_results(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's ``tensors`` (CPU), on every rank of the pipeline."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensors
    group = parallel_state.get_pipeline_model_parallel_group()
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(group.size())]
    dist.all_gather_object(parts, {k: v.cpu() for k, v in tensors.items()}, group=group)
    return {k: v for part in parts for k, v in part.items()}


def _next_token_loss(out: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    tokens = micro.input_ids.to(out.device)
    return torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _sequence_length(model: api.TrainingModel) -> int:
    """A row across every length-dependent structure of the model (GDN chunks, a sliding window, where rope scaling
    starts: ``long_row_length``), rounded up to a multiple of ``SPLIT``."""
    return -(-long_row_length(model.config, model.layout) // SPLIT) * SPLIT


def _scored(model: api.TrainingModel) -> dict[str, torch.Tensor]:
    """The trainer's scoring calls: ``api.token_logprobs`` of a row across the model's length structures
    (``long_row_length``) packed with a short one, and ``api.group_logprobs`` of a prompt with a completion reaching
    as far and a short one; and ``logprobs_rank_spread``, the largest distance of any rank's rows from rank 0's
    (every rank gets the rows, the first pipeline stage included)."""
    gen = torch.Generator().manual_seed(SEED + 4)
    long = long_row_length(model.config, model.layout)
    # The short rows make each packed row's length odd, which sequence and context parallelism must pad.
    sequences = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (long, 7 - long % 2)]
    prompt = torch.randint(0, 500, (9,), generator=gen).tolist()
    completions = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (long - 9, 5 - long % 2)]
    with torch.no_grad():
        rows = {f"token_logprobs.{i}": r for i, r in enumerate(api.token_logprobs(model, sequences))}
        rows |= {f"group_logprobs.{i}": r for i, r in enumerate(api.group_logprobs(model, prompt, completions))}
        with api.lora_disabled(model):
            rows |= {f"reference_logprobs.{i}": r for i, r in enumerate(api.token_logprobs(model, sequences))}
        base = _base_logprobs(model, sequences)
    # The reference policy is the model with B = 0 (what the LoRA adds is B A x), on every rank.
    off = max((rows[f"reference_logprobs.{i}"] - r).abs().max() for i, r in enumerate(base)).reshape(1)
    dist.all_reduce(off, op=dist.ReduceOp.MAX)
    shapes: list[list[tuple[int, ...]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(shapes, [tuple(r.shape) for r in rows.values()])
    spread = torch.tensor(0.0 if all(s == shapes[0] for s in shapes) else float("inf"))
    if spread == 0:
        for mine in rows.values():
            first = mine.clone()
            dist.broadcast(first, src=0)
            spread = torch.maximum(spread, (mine - first).abs().max().cpu())
    spread = spread.to(next(iter(rows.values())).device)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return rows | {"logprobs_rank_spread": spread.reshape(1), "reference_logprobs_err": off}


def _base_logprobs(model: api.TrainingModel, sequences: list[list[int]]) -> list[torch.Tensor]:
    """``api.token_logprobs`` of ``sequences`` with every LoRA B zeroed on this rank (every rank does), then put
    back."""
    modules = list(lora_modules(model.chunks).values())
    kept = [module.lora_B.weight.clone() for module in modules]
    for module in modules:
        module.lora_B.weight.zero_()
    try:
        return api.token_logprobs(model, sequences)
    finally:
        for module, weight in zip(modules, kept, strict=True):
            module.lora_B.weight.copy_(weight)


def _merged_results(out_dir: Path, token: str, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a run writes of its merged weights: the fp32 oracle the tensors, every other fp32 run its distance from
    them (the whole model from each run fills a disk: 8 GB a run at 27B width for 4 layers); the bf16 runs, whose
    comparison does not look at merged weights, nothing."""
    from model_support.core.megatron.compare import merged_distance

    if token == "single":
        return {f"merged.{k}": v for k, v in merged.items()}
    if parse_run(token)[1] != torch.float32:
        return {}
    return merged_distance(out_dir / "single.safetensors", merged)


def run_layout(out_dir: Path, model_dir: Path, handler_name: str, token: str, timeout: timedelta | None = None) -> None:
    """One run of the job (``token``: a layout, in fp32 or with ``.bf16`` in bf16; see :func:`parse_run`)."""
    from megatron.core import parallel_state

    name, dtype = parse_run(token)
    layout = _layout(name)
    handler = load_registry().get(handler_name)
    model = api.build_model(model_dir, handler=handler, parallel=layout, dtype=dtype, timeout=timeout)
    api.apply_lora(model, rank=4, alpha=8.0, seed=SEED)
    chunks = model.chunks
    # apply_lora's seed draws one canonical adapter in every layout: its export must match the oracle's bit for bit.
    fresh = handler.spec.codec.to_peft(lora_state(chunks), model.config, model.layout)
    load_lora_state(chunks, random_lora_state(chunks, seed=SEED, b_std=0.05))
    before = handler.spec.codec.to_peft(lora_state(chunks), model.config, model.layout)
    if token == "single":  # the stage runs transformers' fp32 model on the oracle's rows with this adapter
        api.export_adapter(model, out_dir / ORACLE_ADAPTER)
    # The forward-only rows run on the adapter every layout shares, before the step: after it each layout's adapter
    # carries its own gradients' round-off (held to the gradient limits), which a real-width model's packed rows
    # carry on to their logits at 1e-4.
    shared = {}
    if layout.context_parallel == 1:  # a packed row under context parallelism needs THD attention
        # One row per micro-batch (the interleaved schedule needs as many micro-batches as pipeline ranks).
        shared_row = RowLayout.shared_prefix(*SHARED_ROW)
        tokens = torch.randint(
            0, 500, (MICRO_BATCHES, shared_row.length), generator=torch.Generator().manual_seed(SEED + 3)
        )
        positions = shared_row.position_ids().expand(MICRO_BATCHES, -1)
        out = api.forward_backward(
            model,
            tokens,
            _next_token_loss,
            position_ids=positions,
            micro_batches=MICRO_BATCHES,
            forward_only=True,
            keep_logits=True,
        )
        shared = {"shared_logits": out.logits}
    scored = _scored(model)
    shape = (BATCH, _sequence_length(model))
    tokens = torch.randint(0, 500, shape, generator=torch.Generator().manual_seed(SEED + 2))
    records, handles = _router_topk(chunks)
    # Every data-parallel replica sees the same tokens, so the reduced gradient is the single model's.
    step = api.forward_backward(model, tokens, _next_token_loss, micro_batches=MICRO_BATCHES, keep_logits=True)
    for handle in handles:
        handle.remove()
    api.reduce_lora_grads(model)
    grad_norm = torch.tensor([api.lora_grad_norm(model)])
    dtypes, rounded = _dtypes_and_rounding(chunks)
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                if param.requires_grad and param.grad is not None:
                    param -= LR * param.grad
    after = handler.spec.codec.to_peft(lora_state(chunks), model.config, model.layout)
    rows = BATCH // MICRO_BATCHES
    topk = {
        f"topk.{router}.{i}": _whole_sequence(call, rows, layout.sequence_parallel)
        for router, calls in records.items()
        for i, call in enumerate(calls)
    }
    topk = _stage_results(topk)
    merged = {}
    if dtype == torch.float32:  # a gather every rank takes part in; no bf16 comparison reads merged weights
        merged = {name: tensor for bucket in api.merged_weights(model) for name, tensor in bucket.items()}
    if dist.get_rank() == 0:
        tensors = {"tokens": tokens, "logits": step.logits, "loss": step.loss.detach().reshape(1), **shared}
        tensors |= {f"before.{k}": v for k, v in before.items()} | {f"after.{k}": v for k, v in after.items()}
        tensors |= topk | {f"fresh.{k}": v for k, v in fresh.items()} | _merged_results(out_dir, token, merged)
        tensors |= scored | {"grads_rounded_to_bf16": rounded, "grad_norm": grad_norm}
        # safetensors' metadata holds strings only: the dtypes travel as one JSON string.
        metadata = {"dtypes": json.dumps(dtypes)}
        save_file(
            {k: v.contiguous().cpu() for k, v in tensors.items()}, str(out_dir / f"{token}.safetensors"), metadata
        )
    dist.barrier()
    parallel_state.destroy_model_parallel()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="parallel_worker")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("handler")
    parser.add_argument("layouts", help="comma-separated runs, `single` first: a layout, `.bf16` after it for bf16")
    parser.add_argument("--mutation", help="the selftest's bug to inject (passed on by the stage under selftest)")
    parser.add_argument("--world", type=int, help="start this many ranks as forks of this process (no torchrun)")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=COLLECTIVE_TIMEOUT_S,
        help="seconds any collective may wait for its peers before the job fails",
    )
    args = parser.parse_args(argv)
    if args.world is not None:
        launch(args)
    else:
        run(args)


def launch(args: argparse.Namespace) -> None:
    """Run ``args.world`` ranks forked from this process (:func:`model_support.validation.ranks.launch`): exit
    status 1 when one failed, its error in ``OUT/<layout>.rank<R>.error``."""
    try:
        ranks.launch(args.world, run, (args,), args.out_dir)
    except ranks.JobFailed as exc:
        print(f"parallel_worker: the job ended: {exc.line}")
        sys.exit(1)


def run(args: argparse.Namespace) -> None:
    """This rank's part of every layout in ``args.layouts``, in order; the first error ends this rank (exit 1,
    see :func:`_fail`), and with it the job."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        # The layouts are compared with each other, not timed: every tensor-parallel split would tune fla's kernels
        # anew.
        stack.enter_context(settled_fla_kernels(args.out_dir / "fla-configs"))
        stack.enter_context(exact_fp32())  # the layouts are built in fp32 and held to fixed fp32 tolerances
        if args.mutation:
            stack.enter_context(injected(args.mutation))
        for name in args.layouts.split(","):
            try:
                # fp32 runs are held to fixed tolerances: every layout on eager arithmetic (see eager_only); bf16
                # runs compile as a trainer's do.
                with eager_only(parse_run(name)[1] == torch.float32):
                    timeout = timedelta(seconds=args.collective_timeout)
                    run_layout(args.out_dir, args.model_dir, args.handler, name, timeout)
            except Exception as exc:  # reported, then the job ends
                _fail(args.out_dir, name, exc)


def _fail(out_dir: Path, name: str, exc: Exception) -> None:
    """Write this rank's error for layout ``name`` to ``OUT/<layout>.rank<R>.error`` and leave at once (exit 1,
    :func:`model_support.validation.ranks.fail`); the stage starts the layouts left in a new job."""
    ranks.fail(out_dir / f"{name}.rank{os.environ.get('RANK', '0')}.error", exc)


if __name__ == "__main__":
    main(sys.argv[1:])
