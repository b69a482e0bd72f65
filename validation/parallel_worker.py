"""Worker of the ``parallel_parity`` stage: one ``torchrun`` job per handler, every layout in turn.

Run as ``python -m torch.distributed.run --nproc_per_node W -m model_support.validation.parallel_worker OUT MODEL_DIR
HANDLER single,tp2,...``. For each layout the job builds the model through the training-time API in that layout
(the rest of the world is data parallel, every rank fed the same tokens), loads the same canonical random LoRA,
runs one forward and backward, syncs the gradients as a trainer does (sequence-parallel factors over the
tensor-parallel group; data-parallel replicas averaged), takes one SGD step on the LoRA, and writes on rank 0
``OUT/<layout>.safetensors``: the logits, the loss, each router's top-k expert sets, and the PEFT adapter the
handler's codec exports before and after the step. ``single`` (one rank's model, the rest data parallel) is the
oracle the stage compares every other layout with.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from model_support.core import api
from model_support.core.megatron import lora
from model_support.core.megatron.dist import ParallelLayout
from model_support.core.megatron.forward import logits
from model_support.core.megatron.lora import load_lora_state, lora_modules, lora_state, random_lora_state
from model_support.core.registry import load_registry
from model_support.validation.selftest import MUTATION_ENV, injected

SEED = 3
LR = 0.5
TOKENS = (2, 16)  # batch, sequence (a multiple of every tensor-parallel size tried)


def _layout(name: str) -> ParallelLayout:
    return ParallelLayout() if name == "single" else ParallelLayout.parse(name)


def _router_topk(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.utils.hooks.RemovableHandle]]:
    """Record each router's top-k expert indices (sorted per token) on every forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    records: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        routing_map = output[1]  # [tokens, experts] bool
        k = int(routing_map.sum(-1).max())
        records.append(routing_map.float().topk(k, dim=-1).indices.sort(-1).values)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]
    return records, handles


def _gather_sequence(local: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Tokens routed on this rank's sequence shard -> every token, in sequence order (sequence parallel)."""
    from megatron.core import parallel_state

    if not layout.sequence_parallel:
        return local
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def _average_replicas(model: torch.nn.Module) -> None:
    """Reduce LoRA gradients over the data-parallel replicas as megatron-core's DistributedDataParallel does: scaled
    by 1 / data-parallel size, summed over the data-parallel group (dense factors) or the expert data-parallel group
    (expert factors, whose tokens the dispatcher already gathered across expert-parallel ranks)."""
    from megatron.core import parallel_state

    scale = 1.0 / parallel_state.get_data_parallel_world_size()
    dense = parallel_state.get_data_parallel_group()
    expert = parallel_state.get_expert_data_parallel_group()
    for module in lora_modules(model).values():
        group = expert if module.expert else dense
        for param in (module.lora_A.weight, module.lora_B.weight):
            if param.grad is not None:
                param.grad *= scale
                dist.all_reduce(param.grad, group=group)


def run_layout(out_dir: Path, model_dir: Path, handler_name: str, name: str) -> None:
    from megatron.core import parallel_state

    layout = _layout(name)
    handler = load_registry().get(handler_name)
    model = api.build_model(model_dir, handler=handler, parallel=layout, dtype=torch.float32)
    api.apply_lora(model, rank=4, alpha=8.0)
    module = model.module
    load_lora_state(module, random_lora_state(module, seed=SEED, b_std=0.05))
    before = handler.spec.codec.to_peft(lora_state(module), model.config, model.layout)
    tokens = torch.randint(0, 500, TOKENS, generator=torch.Generator().manual_seed(SEED + 2))
    records, handles = _router_topk(module)
    out = logits(module, tokens)
    for handle in handles:
        handle.remove()
    # Sequence parallel: the data-parallel replicas see the same tokens, so the mean over them is the single loss.
    loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), tokens[:, 1:].flatten().to(out.device))
    loss.backward()
    lora.sync_sequence_parallel_grads(module)
    _average_replicas(module)
    with torch.no_grad():
        for param in module.parameters():
            if param.requires_grad and param.grad is not None:
                param -= LR * param.grad
    after = handler.spec.codec.to_peft(lora_state(module), model.config, model.layout)
    topk = [_gather_sequence(r, layout) for r in records]
    if dist.get_rank() == 0:
        tensors = {"logits": out.detach(), "loss": loss.detach().reshape(1)}
        tensors |= {f"before.{k}": v for k, v in before.items()} | {f"after.{k}": v for k, v in after.items()}
        tensors |= {f"topk.{i}": t for i, t in enumerate(topk)}
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out_dir / f"{name}.safetensors"))
    dist.barrier()
    parallel_state.destroy_model_parallel()


def main(argv: list[str]) -> None:
    out_dir, model_dir, handler_name, layouts = Path(argv[0]), Path(argv[1]), argv[2], argv[3].split(",")
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        # `model-support selftest` injects its bug into these processes too.
        mutation = os.environ.get(MUTATION_ENV)
        if mutation:
            stack.enter_context(injected(mutation))
        for name in layouts:
            _run_reporting(out_dir, model_dir, handler_name, name)


def _run_reporting(out_dir: Path, model_dir: Path, handler_name: str, name: str) -> None:
    """Run one layout; an error is written to ``OUT/<layout>.error`` (the other layouts still run)."""
    try:
        run_layout(out_dir, model_dir, handler_name, name)
    except Exception as exc:  # reported per layout; the others still run
        from megatron.core import parallel_state

        if dist.get_rank() == 0:  # the error line first, then the traceback for the log
            first = str(exc).splitlines()[0] if str(exc) else ""
            (out_dir / f"{name}.error").write_text(f"{type(exc).__name__}: {first}\n{traceback.format_exc()}")
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main(sys.argv[1:])
