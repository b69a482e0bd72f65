"""The training API's vocabulary-parallel scores, global token normalisation and resume on a GPU (fp32, one rank).

    python -m benchmarks.gpu_trainer_api [--handler qwen3]

On a tiny replica of the handler built on CUDA in fp32 with a random LoRA: ``forward_backward`` with
``loss_inputs="logprobs"`` against the full-logits path computing the same loss (per-token log-probs, entropy, LoRA
gradients), ``normalize="global_tokens"`` over two unequal micro-batches against one batch's token mean, and
``save_state`` / ``load_state``: the next step after a resume against the uninterrupted one (CUDA RNG included).
Prints one line of numbers per check and exits non-zero if a check misses its tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from model_support.core import api
from model_support.core.megatron.lora import load_lora_state, random_lora_state
from model_support.core.tiny import build_tiny
from model_support.handlers import BUILTIN_HANDLERS


def _model(model_dir: Path) -> api.TrainingModel:
    model = api.build_model(model_dir, handler=api.resolve(model_dir), dtype=torch.float32)
    api.apply_lora(model, rank=4, alpha=8.0)
    load_lora_state(model.chunks, random_lora_state(model.chunks, seed=3, b_std=0.05))
    return model


def _grads(model: api.TrainingModel) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for c in model.chunks for p in c.parameters() if p.grad is not None])


def _zero(model: api.TrainingModel) -> None:
    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handler", default="qwen3")
    args = parser.parse_args()
    (spec,) = [h for h in BUILTIN_HANDLERS if h.name == args.handler]
    work = Path(tempfile.mkdtemp(prefix="gpu-trainer-api-"))
    model_dir = build_tiny(json.loads(spec.reference_config.read_text()), work / "tiny", spec=spec)
    model = _model(model_dir)
    device = next(model.module.parameters()).device
    torch.manual_seed(0)
    tokens = torch.randint(0, 400, (4, 48))
    failed = []

    def check(name: str, value: float, limit: float) -> None:
        print(f"{name}: {value:.2e} (limit {limit:.0e})", flush=True)
        if not value <= limit:
            failed.append(name)

    # 1. vocabulary-parallel scores against log_softmax of the full logits, same loss, same gradients.
    def next_token(logits: torch.Tensor, micro: object) -> torch.Tensor:
        labels = micro.input_ids[:, 1:, None].to(logits.device)
        return -logits.log_softmax(-1)[:, :-1].gather(-1, labels).mean()

    out = api.forward_backward(model, tokens, next_token, keep_logits=True)
    full = out.logits.double().log_softmax(-1)
    want_lp = full[:, :-1].gather(-1, tokens[:, 1:, None].to(full.device))[..., 0]
    want_ent = -(full.exp() * full).sum(-1)[:, :-1]
    grads = _grads(model)
    _zero(model)
    scored = api.forward_backward(model, tokens, lambda s, micro: -s.logprobs.mean(), loss_inputs="logprobs",
                                  keep_logits=True)  # fmt: skip
    check(
        "logprobs vs float64 log_softmax, max abs", (scored.scores.logprobs.double() - want_lp).abs().max().item(), 1e-5
    )
    check("entropy vs float64, max abs", (scored.scores.entropy.double() - want_ent).abs().max().item(), 1e-5)
    check("loss, abs", abs(scored.loss.item() - out.loss.item()), 1e-5)
    check("LoRA grads vs the logits path, max abs", (_grads(model) - grads).abs().max().item(), 1e-6)
    _zero(model)

    # 2. global token normalisation: micro-batches of unequal loss tokens = one batch's token mean.
    mask = torch.zeros(4, 47, dtype=torch.bool)
    mask[:2, :5] = True
    mask[2:, :40] = True

    def masked_mean(s: object, micro: object) -> torch.Tensor:
        kept = micro.loss_mask.to(s.logprobs.device)
        return -s.logprobs[kept].sum() / kept.sum()

    whole = api.forward_backward(model, tokens, masked_mean, loss_inputs="logprobs", loss_mask=mask)
    grads = _grads(model)
    _zero(model)
    split = api.forward_backward(model, tokens, lambda s, micro: -s.logprobs, loss_inputs="logprobs",
                                 normalize="global_tokens", loss_mask=mask, micro_batches=2)  # fmt: skip
    check("global token mean loss vs one batch, abs", abs(split.loss.item() - whole.loss.item()), 1e-6)
    check("its LoRA grads, max abs", (_grads(model) - grads).abs().max().item(), 1e-6)
    _zero(model)

    # 3. resume: 2 steps + 1 uninterrupted vs 2 steps, save, a fresh model, reseed, load, 1 step.
    def step(m: api.TrainingModel, opt: torch.optim.Optimizer) -> None:
        noise = torch.randn(4, 47, device=device)  # the device's RNG takes part in the step
        opt.zero_grad()
        api.forward_backward(
            m, tokens, lambda s, micro: -(s.logprobs * (1 + 0.1 * noise)).mean(), loss_inputs="logprobs"
        )
        opt.step()

    def run(m: api.TrainingModel) -> torch.optim.Optimizer:
        params = [p for c in m.chunks for p in c.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-2)

    torch.manual_seed(1)  # seeds the CUDA generators too
    opt = run(model)
    for _ in range(2):
        step(model, opt)
    api.save_state(model, opt, work / "state", step=2)
    step(model, opt)
    straight = torch.cat([p.detach().flatten() for c in model.chunks for p in c.parameters() if p.requires_grad])
    fresh = _model(model_dir)
    opt2 = run(fresh)
    torch.manual_seed(99)  # what load_state must undo
    assert api.load_state(fresh, opt2, work / "state") == 2
    step(fresh, opt2)
    resumed = torch.cat([p.detach().flatten() for c in fresh.chunks for p in c.parameters() if p.requires_grad])
    check("resumed step vs uninterrupted, max abs (bitwise: 0)", (resumed - straight).abs().max().item(), 0.0)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}: {'FAILED ' + ', '.join(failed) if failed else 'all checks pass'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
