"""The whole-model reference's eager attention run a block of queries at a time (``hf_reference._query_blocked_eager``)
computes what the family's own eager attention does: gpt-oss's, with attention sinks and a sliding window."""

from __future__ import annotations

import pytest
import torch

from model_support.core.megatron import hf_reference


def _gpt_oss(attn_implementation: str) -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], attn_implementation=attn_implementation,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # zero-initialised: give the sinks a say
    return model


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(tokens).logits
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "self_attn" in n}
    return out.detach(), grads


def test_blocked_eager_attention_matches_the_familys_own(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    own = _gpt_oss("eager")
    expected, expected_grads = _loss_and_grads(own, tokens)

    blocked = _gpt_oss("eager")
    blocked.set_attn_implementation(hf_reference._register_query_blocked_eager())
    # 4 queries a block (batch 2, 4 heads, 21 keys, 4 bytes): 6 blocks, the last one short.
    monkeypatch.setattr(hf_reference, "QUERY_BLOCK_BYTES", 2 * 4 * 21 * 4 * 4)
    calls = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    got, grads = _loss_and_grads(blocked, tokens)

    assert len(calls) == 2 * 6  # each layer's queries in six blocks
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert expected_grads.keys() == grads.keys() and any("sinks" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_oracle_runs_the_familys_torch_gated_norm(tiny_model_dir) -> None:
    """Where fla is installed transformers builds fla's FusedRMSNormGated (a Triton kernel that autotunes); the fp32
    oracle's layers get the family's torch RMSNormGated instead, on the meta device until their weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir("qwen3.5"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    class FusedRMSNormGated(torch.nn.Module):  # fla's, by name and shape
        def __init__(self, size: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(size))

    gdn = [m for m in model.modules() if hasattr(m, "chunk_gated_delta_rule")]
    assert gdn
    for module in gdn:
        module.norm = FusedRMSNormGated(module.norm.weight.shape[0])
    assert hf_reference._torch_kernels(model) == len(gdn)
    for module in gdn:
        assert type(module.norm).__name__.endswith("RMSNormGated") and type(module.norm) is not FusedRMSNormGated
        assert module.norm.weight.is_meta and module.norm.variance_epsilon == module.layer_norm_epsilon
        assert module.chunk_gated_delta_rule.__name__ == "torch_chunk_gated_delta_rule"


def _gemma2_softcapped(tmp_path) -> tuple[object, torch.nn.Module]:
    """A tiny Gemma 2 checkpoint whose attention soft-capping (0.5) changes every score: its config as a check loads
    it, and transformers' eager model of it."""
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attn_logit_softcapping=0.5, final_logit_softcapping=None,
        query_pre_attn_scalar=16, sliding_window=8, architectures=["Gemma2ForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    return AutoConfig.from_pretrained(tmp_path), eager


@pytest.mark.parametrize("rule", ["kept", "planted: SDPA kept, soft-capping dropped"])
def test_the_reference_applies_attention_soft_capping(rule, tmp_path, monkeypatch) -> None:
    """transformers' SDPA attention drops Gemma 2's soft-capping; the streamed reference runs the family's eager
    attention where a config sets it, and so computes the checkpoint's logits (bit for bit on the CPU). Without the
    rule (planted) the reference computes another model's, O(1) away."""
    config, eager = _gemma2_softcapped(tmp_path)
    if rule != "kept":
        monkeypatch.setattr(hf_reference, "SDPA_IGNORES", ())
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    reference = hf_reference.StreamedReference(tmp_path, config, torch.device("cpu"))
    with torch.no_grad():
        error = (reference.forward(tokens).logits - eager(tokens).logits).abs().max().item()
    if rule == "kept":
        assert reference.attention == "eager (attn_logit_softcapping)"
        assert error == 0.0
    else:
        assert error > 1.0
