"""``hf_reference.streamed_gradients`` (lora_gradients' oracle, one decoder layer in memory at a time) takes the
gradients plain autograd through the whole transformers model takes: fp32 on its own routing, and bf16 on a routing
replayed from the fp32 run (the forward and the backward's recompute must both run the replayed experts)."""

from __future__ import annotations

import pytest
import torch

from model_support.core.megatron import hf_reference


def _whole_model_gradients(
    model_dir, dtype: torch.dtype, rows: list[torch.Tensor], replay: list[list[torch.Tensor]] | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses and every decoder layer's checkpoint gradients, the rows' losses summed, by plain autograd
    through the whole model (transformers' own loading), on the attention kernel the streamed run takes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.set_attn_implementation(hf_reference._register_repeated_kv_sdpa())  # the streamed run's attention
    losses = []
    for i, tokens in enumerate(rows):
        with hf_reference.routing_hooks(model, None, None if replay is None else replay[i]):
            logits = model(input_ids=tokens, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:], reduction="none")
        loss.sum().backward()
        losses.append(loss.detach().double())
    grads = hf_reference.checkpoint_gradients(model)
    return torch.cat(losses), {k: g.double() for k, g in grads.items() if ".layers." in k}


def _rel_l2(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    names = sorted(ref)
    a, b = (torch.cat([d[n].flatten() for n in names]) for d in (ours, ref))
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("handler", ["qwen3-moe", "qwen3.5-moe"])
def test_streamed_gradients_are_whole_model_autograds(tiny_model_dir, handler: str) -> None:
    from transformers import AutoConfig

    model_dir = tiny_model_dir(handler)
    config = AutoConfig.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(3)
    cases = {
        "long": [torch.randint(0, config.get_text_config().vocab_size, (1, 70), generator=gen)],
        "packed": [torch.randint(0, config.get_text_config().vocab_size, (1, n), generator=gen) for n in (20, 9)],
    }

    def loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:], reduction="none")

    def keep(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: g.detach().double().clone() for k, g in grads.items()}

    fp32 = hf_reference.streamed_gradients(model_dir, config, torch.device("cpu"), torch.float32, {}, cases, loss, keep)
    low = hf_reference.streamed_gradients(
        model_dir, config, torch.device("cpu"), torch.bfloat16, {}, cases, loss, keep, replay=fp32.routing
    )
    for case, rows in cases.items():
        assert len(fp32.routing[case]) == len(rows) and all(fp32.routing[case])  # every MoE block's choice, per row
        losses, grads = _whole_model_gradients(model_dir, torch.float32, rows, None)
        assert fp32.grads[case].keys() == grads.keys()
        torch.testing.assert_close(fp32.losses[case], losses, rtol=1e-6, atol=1e-6)
        assert _rel_l2(fp32.grads[case], grads) < 1e-5, case
        # bf16 on the fp32 run's experts: what plain autograd takes on them, not the bf16 routers' own choice.
        losses, grads = _whole_model_gradients(model_dir, torch.bfloat16, rows, fp32.routing[case])
        torch.testing.assert_close(low.losses[case], losses, rtol=1e-3, atol=1e-3)
        assert _rel_l2(low.grads[case], grads) < 1e-3, case
