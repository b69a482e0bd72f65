"""GRPO with asynchronous rollouts, a KL term to the base policy and gradient clipping, on a tiny random Qwen3
replica with model-support's training-time API and a vLLM server (CPU is enough).

Run from the repository root (CI runs it on two ranks), on one process or under torchrun:

    python docs/examples/grpo.py WORKDIR
    torchrun --nproc-per-node 2 docs/examples/grpo.py WORKDIR --layout tp2

Each step samples a group of answers per prompt from the served adapter (``Server.generate_many``: every prompt's
requests in flight together), while the trainer trains on the previous step's groups: rollouts run one step
behind the policy, and every sampled token says which adapter sampled it (``policy_epoch``), so the loss weighs
each token by the ratio of the trainer's probability to the one it was sampled with (clipped, as PPO does). The KL
term takes the base policy's log-probabilities from the same model with its LoRA switched off
(``api.lora_disabled``); the LoRA gradients are clipped by their norm over the whole model
(``api.clip_lora_grads``, the same on every rank). Rank 0 talks to the server and passes each step's groups to the
other ranks. Pipeline layouts would train through ``api.forward_backward`` instead (there ``token_logprobs`` is not
differentiable).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model_support.core import api
from model_support.core.serving.errors import RuntimeMissingError
from model_support.core.tiny import build_tiny
from model_support.handlers.configs import CONFIGS

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34]]
ANSWERS = [5, 6, 7, 8]  # the tokens an answer may be
GOOD = 7  # reward 1, the other answers 0
GROUP, STEPS, KL_COEF, MAX_NORM, CLIP = 8, 6, 0.05, 1.0, 0.2


def rollout(server: Any, name: str, seed: int) -> list[list[dict[str, Any]]]:
    """A group of one-token answers per prompt from adapter ``name``, every prompt's requests in flight together."""
    return server.generate_many(
        PROMPTS, model=name, n=GROUP, max_tokens=1, temperature=1.0, seed=seed, allowed_token_ids=ANSWERS, logprobs=0
    )


def good_probability(model: api.TrainingModel) -> float:
    """The trainer's mean probability of the good answer among the answers, after each prompt."""
    with torch.no_grad():
        rows = api.token_logprobs(model, PROMPTS)
    return sum(r[-1, ANSWERS].softmax(-1)[ANSWERS.index(GOOD)].item() for r in rows) / len(rows)


def main(work: Path, layout: str) -> int:
    rank = dist.get_rank() if dist.is_initialized() else 0
    say = print if rank == 0 else (lambda *_: None)
    model_dir = work / "tiny-qwen3"
    if rank == 0 and not model_dir.exists():
        build_tiny(json.loads((CONFIGS / "qwen3-0.6b.json").read_text()), model_dir)
    if dist.is_initialized():
        dist.barrier()
    model = api.build_model(model_dir, handler=api.resolve(model_dir), parallel=api.ParallelLayout.parse(layout))
    api.apply_lora(model, rank=8, alpha=16.0)
    params = [p for chunk in model.chunks for p in chunk.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-2)

    server = None
    if rank == 0:
        try:
            options = api.ServeOptions(dtype="float32", enable_lora=True)  # fp32 as the trainer on a CPU
            server = api.serve(model_dir, "qwen3@0", work / "vllm.log", options=options)
        except RuntimeMissingError as exc:
            print(f"no server to sample from: {exc}")
    served = [server is not None]
    if dist.is_initialized():
        dist.broadcast_object_list(served, 0)
    if not served[0]:
        return 0

    sampler = ThreadPoolExecutor(max_workers=1)  # rank 0's rollouts, beside the training step
    try:
        name = api.push_adapter(server, model)  # every rank takes part; rank 0 gets the served name
        before = good_probability(model)
        pending = sampler.submit(rollout, server, name, 0) if server is not None else None
        sampled_by = name
        for step in range(STEPS):
            groups = pending.result() if pending is not None else None
            # The next groups are sampled from the adapter served now while this step trains on these.
            pending = sampler.submit(rollout, server, name, step + 1) if server is not None else None
            box = [None if groups is None else [[_sample(c) for c in g] for g in groups]]
            if dist.is_initialized():
                dist.broadcast_object_list(box, 0)
            batch = box[0]
            tokens = torch.tensor([[t for t, _, _ in g] for g in batch])
            behaviour = torch.tensor([lp for g in batch for _, lp, _ in g])
            reward = (tokens == GOOD).float()
            advantage = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).flatten()

            rows = [[*prompt, int(t)] for prompt, group in zip(PROMPTS, tokens, strict=True) for t in group]
            logp = _answer_logprobs(model, rows)
            with torch.no_grad(), api.lora_disabled(model):  # the base policy, from the same weights
                reference = _answer_logprobs(model, rows)
            ratio = (logp - behaviour.to(logp.device)).exp()  # trainer over sampler, token by token
            adv = advantage.to(logp.device)
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
            log_ratio = reference - logp
            kl = (log_ratio.exp() - log_ratio - 1).mean()  # k3, an unbiased estimate of KL(policy || base)
            loss = -surrogate.mean() + KL_COEF * kl
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            api.reduce_lora_grads(model)
            norm = api.clip_lora_grads(model, MAX_NORM)  # the whole model's norm, the same on every rank
            optimizer.step()
            if pending is not None:
                pending.result()  # the adapter that samples the next groups stays served until they are in
            epochs = sorted({str(e) for g in batch for _, _, e in g})
            trained_on, sampled_by, name = sampled_by, name, api.push_adapter(server, model)
            say(
                f"step {step}: reward {reward.mean().item():.3f}, kl {kl.item():.4f}, grad norm {norm:.3f}, "
                f"trained on groups sampled by {trained_on} (policy_epoch {', '.join(epochs)}), now serving {name}"
            )
        after = good_probability(model)
        say(f"p(good answer): {before:.3f} -> {after:.3f}")
        return 0 if after > before else 1
    finally:
        sampler.shutdown(wait=True)
        if server is not None:
            server.stop()


def _sample(choice: dict[str, Any]) -> tuple[int, float, list[list[int]]]:
    """(the answer, its log-probability where it was sampled, which adapter step sampled it)."""
    return choice["token_ids"][0], choice["logprobs"]["content"][0]["logprob"], choice["policy_epoch"]


def _answer_logprobs(model: api.TrainingModel, rows: list[list[int]]) -> torch.Tensor:
    """The log-probability of each row's last token (the answer) after the tokens before it."""
    return torch.stack([r[-2, row[-1]] for r, row in zip(api.token_logprobs(model, rows), rows, strict=True)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", nargs="?", type=Path)
    parser.add_argument("--layout", default="tp1", help="a ParallelLayout without pipeline stages, e.g. tp2")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the trainer's own process group: build_model joins it
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        if args.workdir is not None:
            code = main(args.workdir, args.layout)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                code = main(Path(tmp), args.layout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    raise SystemExit(code)
