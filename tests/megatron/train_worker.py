"""Worker of test_vocab_parallel: run under ``torchrun --nproc_per_node 2`` (gloo on CPU).

For each of tp2, cp2 and pp2 it builds the model in that layout with the canonical random LoRA of :data:`LORA_SEED`
and runs one step of the same loss on the same rows twice through ``api.forward_backward`` (two micro-batches,
``normalize="global_tokens"``): from the full-vocabulary logits, and from ``loss_inputs="logprobs"``. It records how
far apart the two paths' log-probs, entropies, losses and LoRA gradients are (largest over ranks), and writes the
log-probs path's scores. Under dp2 (one model per rank) each rank runs half the rows and ``api.reduce_lora_grads``
must give the gradient of the whole batch's token mean, which every rank computes as the reference. At tp2 it also
saves the run's state after an AdamW step (kept for the test to refuse in a single-rank run) and loads it back.
Usage: train_worker.py <out_dir> <model_dir>   (rank 0 writes <out_dir>/metrics.json and scores.safetensors)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from model_support.core import api
from model_support.core.megatron.forward import MicroBatch, TokenScores
from model_support.core.megatron.lora import load_lora_state, lora_state, random_lora_state

LORA_SEED = 3
ROWS, LENGTH = 4, 16  # 16: a multiple of 2 x cp
# Loss tokens per row (of the 15 predicted positions): micro-batches of rows (0, 1) and (2, 3) hold 6 and 28.
ROW_TOKENS = (2, 4, 15, 13)
ENTROPY_WEIGHT = 0.05


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [4, 16], loss_mask [4, 15], per-row advantage [4, 1]) every run uses."""
    tokens = torch.randint(0, 500, (ROWS, LENGTH), generator=torch.Generator().manual_seed(5))
    mask = torch.arange(LENGTH - 1) < torch.tensor(ROW_TOKENS)[:, None]
    advantage = torch.tensor([[1.0], [-0.5], [0.8], [-1.2]])
    return tokens, mask, advantage


def per_token_loss(logprobs: torch.Tensor, entropy: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """A policy-gradient loss with an entropy bonus, per position ([b, S - 1])."""
    advantage = batch()[2][micro.rows].to(logprobs.device)
    return -advantage * logprobs - ENTROPY_WEIGHT * entropy


def full_vocab_scores(logits: torch.Tensor, input_ids: torch.Tensor) -> TokenScores:
    """The reference: log-probs of the next token and entropies from full-vocabulary logits [b, S, V]."""
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    labels = input_ids[:, 1:].to(logits.device)
    return TokenScores(logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1))


def from_logits(logits: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    scores = full_vocab_scores(logits, micro.input_ids)
    return per_token_loss(scores.logprobs, scores.entropy, micro)


def from_scores(scores: TokenScores, micro: MicroBatch) -> torch.Tensor:
    return per_token_loss(scores.logprobs, scores.entropy, micro)


def _take_grads(model: api.TrainingModel) -> list[torch.Tensor]:
    params = [p for chunk in model.chunks for p in chunk.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in params]
    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)
    return grads


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _build(model_dir: Path, layout: str) -> api.TrainingModel:
    parallel = api.ParallelLayout() if layout == "dp2" else api.ParallelLayout.parse(layout)
    model = api.build_model(model_dir, parallel=parallel, dtype=torch.float32)
    api.apply_lora(model, rank=4, alpha=8.0)
    load_lora_state(model.chunks, random_lora_state(model.chunks, seed=LORA_SEED, b_std=0.05))
    return model


def compare_paths(model: api.TrainingModel) -> tuple[dict[str, float], TokenScores]:
    """The full-vocabulary and the vocabulary-parallel path of one step: their largest differences."""
    tokens, mask, _ = batch()
    options = {"micro_batches": 2, "normalize": "global_tokens", "loss_mask": mask, "keep_logits": True}
    full = api.forward_backward(model, tokens, from_logits, **options)
    full_grads = _take_grads(model)
    parallel = api.forward_backward(model, tokens, from_scores, loss_inputs="logprobs", **options)
    parallel_grads = _take_grads(model)
    reference = full_vocab_scores(full.logits, tokens)
    metrics = {
        "logprobs_err": (parallel.scores.logprobs - reference.logprobs).abs().max().item(),
        "entropy_err": (parallel.scores.entropy - reference.entropy).abs().max().item(),
        "loss_err": (parallel.loss - full.loss).abs().item(),
        "grad_err": max((a - b).abs().max().item() for a, b in zip(full_grads, parallel_grads, strict=True)),
        "grad_max": max(g.abs().max().item() for g in full_grads),
    }
    return {k: _max_over_ranks(v) for k, v in metrics.items()}, parallel.scores


def data_parallel_token_mean(model: api.TrainingModel) -> dict[str, float]:
    """Each rank half the rows (2 and 34 loss tokens): the reduced gradient against the whole batch's token mean."""
    tokens, mask, _ = batch()
    half = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)

    def whole_batch_mean(logits: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        per_token = from_logits(logits, micro)
        return (per_token * mask).sum() / mask.sum()

    reference = api.forward_backward(model, tokens, whole_batch_mean)
    api.reduce_lora_grads(model)
    expected = _take_grads(model)

    def shifted(micro: MicroBatch) -> MicroBatch:  # this rank's rows are rows 2r, 2r + 1 of the whole batch
        rows = slice(micro.rows.start + half.start, micro.rows.stop + half.start)
        return MicroBatch(micro.input_ids, micro.position_ids, rows, micro.loss_mask)

    step = api.forward_backward(
        model,
        tokens[half],
        lambda scores, micro: from_scores(scores, shifted(micro)),
        micro_batches=2,
        normalize="global_tokens",
        loss_mask=mask[half],
        loss_inputs="logprobs",
    )
    api.reduce_lora_grads(model)
    grads = _take_grads(model)
    metrics = {
        "loss_err": (step.loss - reference.loss).abs().item(),
        "grad_err": max((a - b).abs().max().item() for a, b in zip(grads, expected, strict=True)),
        "grad_max": max(g.abs().max().item() for g in expected),
    }
    return {k: _max_over_ranks(v) for k, v in metrics.items()}


def state_round_trip(model: api.TrainingModel, path: Path) -> dict[str, float]:
    """An AdamW step, ``save_state``, another step, ``load_state``: the LoRA is the saved one again, bit for bit."""
    params = [p for chunk in model.chunks for p in chunk.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    tokens, mask, _ = batch()
    api.forward_backward(model, tokens, from_scores, loss_inputs="logprobs", normalize="global_tokens", loss_mask=mask)
    optimizer.step()
    saved = [p.detach().clone() for p in params]
    api.save_state(model, optimizer, path, step=1)
    api.forward_backward(model, tokens, from_scores, loss_inputs="logprobs", normalize="global_tokens", loss_mask=mask)
    optimizer.step()
    step = api.load_state(model, optimizer, path)
    mismatches = sum(not torch.equal(a, b) for a, b in zip(saved, params, strict=True))
    return {"state_step": step, "state_mismatches": _max_over_ranks(mismatches)}


def main(out_dir: Path, model_dir: Path) -> None:
    from megatron.core import parallel_state

    metrics: dict[str, dict[str, float]] = {}
    scores: dict[str, torch.Tensor] = {}
    for layout in ("tp2", "cp2", "pp2", "dp2"):
        model = _build(model_dir, layout)
        if layout == "dp2":
            metrics[layout] = data_parallel_token_mean(model)
        else:
            metrics[layout], got = compare_paths(model)
            scores |= {f"{layout}.logprobs": got.logprobs, f"{layout}.entropy": got.entropy}
        if layout == "tp2":
            metrics[layout] |= state_round_trip(model, out_dir / "state-tp2")
            metrics[layout]["lora_tensors"] = len(lora_state(model.chunks))
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
        save_file({k: v.contiguous() for k, v in scores.items()}, str(out_dir / "scores.safetensors"))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
