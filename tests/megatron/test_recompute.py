"""``api.build_model(recompute=True)``: in training mode each decoder layer runs again in the backward (megatron-core's
full recompute) and the step computes what it computes without: the same loss and LoRA gradients, MoE routing
replayed in the forward and its recompute alike, Gated DeltaNet layers included."""

from __future__ import annotations

import pytest
import torch

from model_support.core import api


def _step(model_dir, recompute: bool, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], int]:
    """The loss and LoRA gradients of one training step, and how many times a decoder layer ran forward."""
    from model_support.core.megatron.compare import recorded_routing, replayed_routing, routers
    from model_support.core.megatron.lora import lora_state

    model = api.build_model(model_dir, handler=api.resolve(model_dir), recompute=recompute)
    api.apply_lora(model, seed=1)
    with torch.no_grad():  # a non-zero B: the LoRA branch carries gradient into earlier layers
        for name, param in model.module.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    calls = []
    layers = next(m for n, m in model.module.named_modules() if n.endswith("decoder.layers"))
    handles = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in layers]
    with recorded_routing(model.module) as routing, torch.no_grad():
        api.forward_backward(model, tokens, lambda logits, _m: logits.float().square().mean(), forward_only=True)
    calls.clear()
    model.module.train()
    replay = [c[0] for c in routing] if routers(model.module) else None
    with replayed_routing(model.module, replay, batch=1):
        step = api.forward_backward(model, tokens, lambda logits, _m: logits.float().square().mean())
    for handle in handles:
        handle.remove()
    return float(step.loss), lora_state(model.module, grads=True), len(calls)


@pytest.mark.parametrize("handler", ["qwen3-moe", "qwen3.5"])
def test_recompute_takes_the_steps_gradients(tiny_model_dir, handler: str) -> None:
    model_dir = tiny_model_dir(handler)
    tokens = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    loss, grads, calls = _step(model_dir, False, tokens)
    loss_r, grads_r, calls_r = _step(model_dir, True, tokens)
    assert calls_r == 2 * calls  # every layer ran again in the backward
    assert loss_r == pytest.approx(loss, rel=1e-6)
    assert grads_r.keys() == grads.keys() and any(g.abs().max() > 0 for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-5, atol=1e-7, msg=name)
