"""``api.build_model(recompute=True)``: in training mode each decoder layer runs again in the backward (megatron-core's
full recompute) and the step computes what it computes without: the same loss and LoRA gradients, MoE routing
replayed in the forward and its recompute alike, Gated DeltaNet layers included, for a plain row, a packed row and a
row of shared prefixes (the recompute runs after the forward's row layout was taken off the layers), through the
trainer's step and through ``logits`` and a backward of its own."""

from __future__ import annotations

import pytest
import torch

from model_support.core import api

TOKENS = 40
# Position ids of the row kinds: one sequence; three packed (restarting at 0); a prompt of 20 with two completions.
ROWS = {
    "plain": None,
    "packed": torch.cat([torch.arange(12), torch.arange(9), torch.arange(19)])[None],
    "shared": torch.cat([torch.arange(20), torch.arange(20, 30), torch.arange(20, 30)])[None],
}


def _loss(logits: torch.Tensor, _micro: object = None) -> torch.Tensor:
    return logits.float().square().mean()


def _steps(model_dir, recompute: bool, tokens: torch.Tensor) -> dict[tuple[str, str], tuple[float, dict, int]]:
    """For each row kind and path (``api.forward_backward``, or ``logits`` and ``backward``): the loss, the LoRA
    gradients and how many times a decoder layer ran forward."""
    from model_support.core.megatron.compare import recorded_routing, replayed_routing, routers
    from model_support.core.megatron.forward import logits
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
    found = {}
    for kind, positions in ROWS.items():
        model.module.eval()
        with recorded_routing(model.module) as routing, torch.no_grad():
            api.forward_backward(model, tokens, _loss, position_ids=positions, forward_only=True)
        replay = [c[0] for c in routing] if routers(model.module) else None
        for path in ("forward_backward", "logits"):
            model.module.zero_grad(set_to_none=True)
            model.module.train()
            calls.clear()
            with replayed_routing(model.module, replay, batch=1):
                if path == "forward_backward":
                    loss = api.forward_backward(model, tokens, _loss, position_ids=positions).loss
                else:
                    loss = _loss(logits(model.module, tokens, positions))
                    loss.backward()
            found[kind, path] = float(loss), lora_state(model.module, grads=True), len(calls)
    for handle in handles:
        handle.remove()
    return found


@pytest.mark.parametrize("handler", ["qwen3-moe", "qwen3.5"])
def test_recompute_takes_the_steps_gradients(tiny_model_dir, handler: str) -> None:
    model_dir = tiny_model_dir(handler)
    tokens = torch.randint(0, 100, (1, TOKENS), generator=torch.Generator().manual_seed(2))
    plain = _steps(model_dir, False, tokens)
    recomputed = _steps(model_dir, True, tokens)
    for case, (loss, grads, calls) in plain.items():
        loss_r, grads_r, calls_r = recomputed[case]
        assert calls_r == 2 * calls, case  # every layer ran again in the backward
        assert loss_r == pytest.approx(loss, rel=1e-6), case
        assert grads_r.keys() == grads.keys() and any(g.abs().max() > 0 for g in grads.values())
        for name, grad in grads.items():
            torch.testing.assert_close(grads_r[name], grad, rtol=1e-5, atol=1e-7, msg=f"{case}: {name}")


def test_shared_prefix_sees_completions_leak_that_a_long_prompt_dilutes(tmp_path) -> None:
    """The recompute bug (a row's layout off the layers when the backward runs them again) after a 2048-token prompt
    in bf16: the completions' gradients move by ~2 % (the intruding tokens are a sliver of what each completion
    attends to, as after 4096 tokens at real width, where it passed), while after ``short_prompt`` tokens they are
    O(1) wrong and the stage fails."""
    from unittest import mock

    from model_support.validation.pytest_plugin import CheckRequest, run_check
    from model_support.validation.stage import Status

    request = CheckRequest(target="qwen3", tiny=True, stages=("shared_prefix",), dtype="bf16")
    with (
        mock.patch("model_support.core.megatron.forward.RowState.again_in_backward", lambda _self, _out: None),
        mock.patch("model_support.validation.megatron_session.long_row", lambda _ctx: 2048),
    ):
        report = run_check(request, tmp_path)
    result = next(r for r in report.results if r.stage == "shared_prefix")
    m, limit = result.metrics, result.thresholds["grad_mean_abs_pct"]
    assert m["prompt_tokens"] == 2048 and m["short_prompt_prompt_tokens"] == 16
    assert result.status is Status.FAIL and "short_prompt_grad_mean_abs_pct" in result.summary
    assert m["short_prompt_grad_mean_abs_pct"] > 10 * limit
    assert m["grad_mean_abs_pct"] < m["short_prompt_grad_mean_abs_pct"] / 10
