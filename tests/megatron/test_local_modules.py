"""Local-spec building blocks a family's layer spec composes: sliding-window SDPAttention, a projection with
its own output norm (and LoRA on it, merged and exported), and rotary embeddings kept on the CPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.megatron.conftest import require_megatron


@pytest.fixture(scope="module", autouse=True)
def parallel() -> None:
    require_megatron()
    from model_support.core.megatron.dist import init_parallel

    init_parallel()


def _transformer_config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8)
    return TransformerConfig(**{**base, **kw, "params_dtype": torch.float32, "use_cpu_initialization": True})


def _reference_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention written out, [S, B, H, D] in and [S, B, H * D] out; ``allowed`` [S, S] (query, key)."""
    k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).flatten(2)


@pytest.mark.parametrize("window", [1, 3, 16])
def test_sdpa_sliding_window_sees_the_last_window_keys(window: int) -> None:
    from model_support.core.megatron.spec import SDPAttention

    seq = 9
    attn = SDPAttention(_transformer_config(), 1, None, "self", window=window)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 2, 4, 8, generator=gen)
    k, v = torch.randn(seq, 2, 2, 8, generator=gen), torch.randn(seq, 2, 2, 8, generator=gen)
    i = torch.arange(seq)
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    torch.testing.assert_close(attn(q, k, v, None), _reference_attention(q, k, v, allowed), rtol=1e-5, atol=1e-6)
    # A window as long as the row is plain causal attention.
    if window >= seq:
        plain = SDPAttention(_transformer_config(), 1, None, "self")
        torch.testing.assert_close(attn(q, k, v, None), plain(q, k, v, None), rtol=0, atol=0)


def test_sdpa_sliding_window_keeps_a_packed_rows_document_boundaries() -> None:
    from model_support.core.megatron.spec import SDPAttention

    seq, window = 8, 3
    doc = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    i = torch.arange(seq)
    causal_docs = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(seq, 1, 4 if n == 0 else 2, 8, generator=gen) for n in range(3))
    attn = SDPAttention(_transformer_config(), 1, None, "self", window=window)
    out = attn(q, k, v, ~causal_docs[None, None])
    allowed = causal_docs & (i[:, None] - i[None, :] < window)
    torch.testing.assert_close(out, _reference_attention(q, k, v, allowed), rtol=1e-5, atol=1e-6)


def test_sdpa_attention_sinks_are_gpt_oss_sinks_in_every_block_layout() -> None:
    """softmax_type "learnable": each head's sink joins every query's softmax with no value, as transformers' gpt-oss
    attention computes it, causal, windowed and over a packed row's documents; "off-by-one" is a sink of 0."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from model_support.core.megatron.spec import SDPAttention

    seq, window = 9, 4
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(seq, 2, 4, 8, generator=gen)
    k, v = torch.randn(seq, 2, 2, 8, generator=gen), torch.randn(seq, 2, 2, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    i = torch.arange(seq)
    doc = (i >= 5).long()
    causal = i[:, None] >= i[None, :]

    def reference(allowed: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        module = SimpleNamespace(sinks=sink, num_key_value_groups=2, training=False)
        mask = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]
        out, _ = eager_attention_forward(
            module, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), mask, scaling=1 / math.sqrt(8), dropout=0.0
        )
        return out.transpose(0, 1).flatten(2)

    for kw, allowed in (
        ({}, causal),
        ({"window": window}, causal & (i[:, None] - i[None, :] < window)),
    ):
        attn = SDPAttention(_transformer_config(softmax_type="learnable"), 1, None, "self", **kw)
        with torch.no_grad():
            attn.softmax_offset.copy_(sinks)
        torch.testing.assert_close(attn(q, k, v, None), reference(allowed, sinks), rtol=1e-5, atol=1e-6)
        packed = allowed & (doc[:, None] == doc[None, :])
        out = attn(q, k, v, ~packed[None, None])
        torch.testing.assert_close(out, reference(packed, sinks), rtol=1e-5, atol=1e-6)
    # The sink takes probability mass: without it the outputs differ by far more than round-off.
    plain = SDPAttention(_transformer_config(), 1, None, "self")
    assert (plain(q, k, v, None) - reference(causal, sinks)).abs().max() > 1e-2
    off_by_one = SDPAttention(_transformer_config(softmax_type="off-by-one"), 1, None, "self")
    torch.testing.assert_close(off_by_one(q, k, v, None), reference(causal, torch.zeros(4)), rtol=1e-5, atol=1e-6)
    # The sinks' gradient flows (a trainer may train them).
    attn.softmax_offset.grad = None
    attn(q, k, v, None).sum().backward()
    assert attn.softmax_offset.grad is not None and attn.softmax_offset.grad.abs().sum() > 0


def test_sdpa_soft_capped_scores_are_gemma_2s_in_every_block_layout() -> None:
    """``softcap``: each score capped as transformers' Gemma 2 eager attention caps it, causal, windowed and over a
    packed row's documents; the cap changes the output by far more than round-off."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from model_support.core.megatron.spec import SDPAttention

    seq, window, cap = 9, 4, 2.0
    gen = torch.Generator().manual_seed(3)
    q = 3 * torch.randn(seq, 2, 4, 8, generator=gen)  # scores well past the cap
    k, v = torch.randn(seq, 2, 2, 8, generator=gen), torch.randn(seq, 2, 2, 8, generator=gen)
    i = torch.arange(seq)
    doc = (i >= 5).long()
    causal = i[:, None] >= i[None, :]

    def reference(allowed: torch.Tensor) -> torch.Tensor:
        module = SimpleNamespace(num_key_value_groups=2, training=False)
        mask = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]
        out, _ = eager_attention_forward(
            module, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), mask, scaling=1 / math.sqrt(8), softcap=cap
        )
        return out.transpose(0, 1).flatten(2)

    for kw, allowed in (({}, causal), ({"window": window}, causal & (i[:, None] - i[None, :] < window))):
        attn = SDPAttention(_transformer_config(), 1, None, "self", softcap=cap, **kw)
        torch.testing.assert_close(attn(q, k, v, None), reference(allowed), rtol=1e-5, atol=1e-6)
        packed = allowed & (doc[:, None] == doc[None, :])
        torch.testing.assert_close(attn(q, k, v, ~packed[None, None]), reference(packed), rtol=1e-5, atol=1e-6)
    plain = SDPAttention(_transformer_config(), 1, None, "self")
    assert (plain(q, k, v, None) - reference(causal)).abs().max() > 1e-2
    with pytest.raises(ValueError, match="soft-cap must be positive and without attention sinks"):
        SDPAttention(_transformer_config(softmax_type="learnable"), 1, None, "self", softcap=cap)


def test_sdpa_rejects_an_empty_window() -> None:
    from model_support.core.megatron.spec import SDPAttention

    with pytest.raises(ValueError, match="at least one key"):
        SDPAttention(_transformer_config(), 1, None, "self", window=0)


def _post_norm_linear(seed: int):
    from model_support.core.megatron.spec import PostNormRowParallelLinear

    config = _transformer_config(add_bias_linear=False, layernorm_epsilon=1e-6)
    linear = PostNormRowParallelLinear(
        16, 32, config=config, init_method=torch.nn.init.zeros_, bias=False, input_is_parallel=True,
        skip_bias_add=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen))
        linear.post_layernorm.weight.copy_(torch.randn(32, generator=gen) * 0.5)
    return linear


def _lora_on(linear, seed: int):
    from model_support.core.megatron.lora import LoraLinear

    lora = LoraLinear(linear, rank=4, alpha=8.0, sections=[32])
    gen = torch.Generator().manual_seed(seed)
    lora.load_canonical(torch.randn(4, 16, generator=gen), torch.randn(32, 4, generator=gen))
    return lora


def test_lora_on_a_post_norm_projection_is_the_merged_weight_under_the_norm() -> None:
    linear = _post_norm_linear(0)
    lora = _lora_on(linear, 1)
    merged = _post_norm_linear(0)
    with torch.no_grad():
        merged.weight += lora.scale * lora.lora_B.weight @ lora.lora_A.weight
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(2))
    out, bias = lora(x)
    expected, _ = merged(x)
    assert bias is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The norm is applied once, after the update: the output rows have the norm's scale, not the update's.
    unnormed, _ = linear.project(x)
    assert not torch.allclose(out, linear.post_layernorm(unnormed))


def test_export_merges_the_wrapped_weight_and_keeps_the_post_norm_under_its_own_name() -> None:
    from model_support.core.megatron.hf_export import _local_shards

    model = torch.nn.Module()
    model.proj = _lora_on(_post_norm_linear(0), 1)
    shards = {name: (shard, module) for name, shard, module in _local_shards(model)}
    assert set(shards) == {"proj.weight", "proj.post_layernorm.weight"}
    lora = model.proj
    weight, owner = shards["proj.weight"]
    expected = lora.base.weight + lora.scale * lora.lora_B.weight @ lora.lora_A.weight
    torch.testing.assert_close(weight, expected.detach(), rtol=0, atol=1e-6)
    assert owner is lora.base
    norm, owner = shards["proj.post_layernorm.weight"]
    assert torch.equal(norm, lora.base.post_layernorm.weight) and owner is lora.base.post_layernorm


def test_every_rotary_embedding_of_a_model_runs_on_the_cpu() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from model_support.core.megatron.builder import _keep_on_cpu

    def rope(base: int) -> RotaryEmbedding:
        return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=base, use_cpu_initialization=True)

    model = torch.nn.Module()
    model.rotary_pos_emb = rope(10_000)
    model.rotary_pos_emb.local = rope(100)  # nested, as a family with local and global RoPE keeps them
    model.decoder = SimpleNamespace()  # not a module: ignored
    _keep_on_cpu(model)
    for module, base in ((model.rotary_pos_emb, 10_000), (model.rotary_pos_emb.local, 100)):
        emb = module(6)
        inv = 1.0 / base ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
        freqs = torch.outer(torch.arange(6, dtype=torch.float32), inv)
        assert emb.device.type == "cpu"
        torch.testing.assert_close(emb[:, 0, 0], torch.cat((freqs, freqs), -1))


def test_a_build_neither_reads_nor_changes_transformer_engines_attention_switches(tiny_model_dir, monkeypatch):
    """megatron-core asserts NVTE_*_ATTN agree with the provider's attention backend, then sets them process-wide:
    one family's build (auto) made the next (Gemma 3: flash) refuse to build, in-process and in child processes."""
    import os

    from transformers import AutoConfig

    from model_support.core.megatron.builder import build_megatron_model

    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")  # what a flash- or local-backend build before this one leaves
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    model_dir = tiny_model_dir("qwen3")
    build_megatron_model(model_dir, AutoConfig.from_pretrained(model_dir))  # qwen3's provider: backend auto
    assert os.environ["NVTE_FLASH_ATTN"] == "0" and "NVTE_FUSED_ATTN" not in os.environ
