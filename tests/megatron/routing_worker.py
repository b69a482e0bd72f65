"""Worker of test_routing: run under ``torchrun --nproc_per_node 2`` (gloo on CPU) on an MoE replica.

For each of ep2, etp2, tp2-sp, cp2 and pp2 it builds the model in that layout with the canonical random LoRA of
:data:`LORA_SEED`, and on rank 0 writes ``<out_dir>/routing.safetensors``: the experts the trainer's routers choose
for :data:`SEQUENCES` (``api.routed_experts``), their log-probs scored with the experts of :func:`planted` replayed
(``api.token_logprobs``), and the logits and LoRA gradients of one step on :func:`step_rows` with theirs replayed
(``api.forward_backward``, two micro-batches). Usage: routing_worker.py <out_dir> <model_dir>
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from model_support.core import api
from model_support.core.megatron.forward import MicroBatch
from model_support.core.megatron.lora import load_lora_state, lora_state, random_lora_state

LORA_SEED = 3
LAYOUTS = ("ep2", "etp2", "tp2-sp", "cp2", "pp2")
SEQUENCES = (list(range(5, 40)), list(range(100, 117)))  # 52 tokens: packed, and padded to each layout's multiple


def planted(length: int, layers: int, top_k: int, experts: int) -> torch.Tensor:
    """[length, layers, k] distinct experts that depend on the position and layer alone (not on what the model
    computes): a server that routed otherwise than the trainer would."""
    base = torch.arange(length)[:, None, None] * 7 + torch.arange(layers)[None, :, None] * 3
    return (base + torch.arange(top_k)) % experts


def step_rows() -> torch.Tensor:
    """[2, 16] rows of the step (16: a multiple of 2 x cp and of tp)."""
    return torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(5))


def build(model_dir: Path, layout: str | None, recompute: bool = False) -> api.TrainingModel:
    parallel = api.ParallelLayout() if layout is None else api.ParallelLayout.parse(layout)
    model = api.build_model(model_dir, parallel=parallel, dtype=torch.float32, recompute=recompute)
    api.apply_lora(model, rank=4, alpha=8.0)
    load_lora_state(model.chunks, random_lora_state(model.chunks, seed=LORA_SEED, b_std=0.05))
    return model


def results(model: api.TrainingModel) -> dict[str, torch.Tensor]:
    """What every run writes: routing, replayed scores, a replayed step's logits and gradients."""
    config = model.chunks[0].config
    shape = (config.num_layers, config.moe_router_topk, config.num_moe_experts)
    own = api.routed_experts(model, SEQUENCES)
    scored = api.token_logprobs(model, SEQUENCES, routed_experts=[planted(len(s), *shape) for s in SEQUENCES])
    rows = step_rows()

    def loss(logits: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        return -logp.gather(-1, micro.input_ids[:, 1:, None].to(logp.device)).mean()

    experts = torch.stack([planted(rows.shape[1], *shape)] * rows.shape[0])
    step = api.forward_backward(model, rows, loss, micro_batches=2, keep_logits=True, routed_experts=experts)
    api.reduce_lora_grads(model)
    grads = {f"grad.{k}": v for k, v in lora_state(model.chunks, grads=True).items()}
    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)
    return {
        **{f"own.{i}": e for i, e in enumerate(own)},
        **{f"scored.{i}": s.detach() for i, s in enumerate(scored)},
        "step_logits": step.logits.detach(),
        **grads,
    }


def main(out_dir: Path, model_dir: Path) -> None:
    from megatron.core import parallel_state

    found: dict[str, torch.Tensor] = {}
    for layout in LAYOUTS:
        model = build(model_dir, layout)
        found |= {f"{layout}.{k}": v.contiguous().cpu() for k, v in results(model).items()}
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        save_file(found, str(out_dir / "routing.safetensors"))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
