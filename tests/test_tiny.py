"""Tiny replicas keep what makes each architecture itself."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from model_support.core.tiny import build_tokenizer, shrink_config
from model_support.handlers import BUILTIN_HANDLERS
from tests.conftest import HANDLER_NAMES


def _load(model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = getattr(transformers, config.architectures[0]).from_pretrained(model_dir)
    return config, model


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_replica_is_small_runs_and_keeps_the_architecture(handler, tiny_model_dir):
    model_dir = tiny_model_dir(handler)
    config, model = _load(model_dir)
    reference = json.loads((model_dir / "config.json").read_text())
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    spec = {h.name: h for h in BUILTIN_HANDLERS}[handler]
    layout = spec.layout(config)
    if handler.startswith("qwen3.5"):
        assert type(model).__name__.endswith("ForConditionalGeneration")  # multimodal checkpoint class kept
        assert layout.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert layout.mtp_layers == 1
        text = config.get_text_config()
        assert text.linear_num_value_heads // text.linear_num_key_heads in (2, 3)  # GDN head grouping kept
        assert text.linear_key_head_dim == text.linear_value_head_dim == 128  # the handler's tiny_config
    else:
        assert layout.gdn_layers == ()
    if handler.endswith("moe"):
        assert (layout.moe.num_experts, layout.moe.top_k) == (4, 2)
        assert layout.moe.has_shared_expert == (handler == "qwen3.5-moe")
    names = {n for n, _ in model.named_modules()}
    assert any(n.endswith("self_attn.q_norm") for n in names)  # qk-norm kept
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, config.get_text_config().vocab_size)
    assert torch.isfinite(logits).all()
    assert reference["architectures"] == [type(model).__name__]


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_no_tensor_of_a_replica_is_constant(handler, tiny_model_dir):
    """Norm gains and biases drawn around their init (1 +- 0.2, 0 +- 0.2): a gain on the wrong channel, head or
    layer changes the output (the selftest's q-norm-gain-permuted is caught so); no tensor is one value repeated."""
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_model_dir(handler) / "model.safetensors"))
    floating = {k: t for k, t in tensors.items() if t.is_floating_point() and t.numel() > 1}
    constant = [k for k, t in floating.items() if (t == t.flatten()[0]).all()]
    assert constant == []
    gains = [t for k, t in tensors.items() if k.endswith("layernorm.weight") or k.endswith("norm.weight")]
    assert gains and all(0.02 < float(g.float().std()) < 0.5 for g in gains)


def test_replicas_are_reproducible(tiny_model_dir, tmp_path):
    from model_support.core.tiny import build_tiny

    raw = json.loads((tiny_model_dir("qwen3") / "config.json").read_text())
    a = build_tiny(raw, tmp_path / "a", seed=3)
    b = build_tiny(raw, tmp_path / "b", seed=3)
    (_, ma), (_, mb) = _load(a), _load(b)
    for (name, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_tokenizer_has_chat_template_and_round_trips(tmp_path):
    tok = build_tokenizer(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "yes"}]
    text = reloaded.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
    ids = reloaded(text, add_special_tokens=False)["input_ids"]
    assert reloaded.decode(ids) == text
    assert reloaded.convert_ids_to_tokens(ids[0]) == "<|im_start|>"
    assert len(tok) <= 512


def test_shrink_scales_mrope_sections_to_the_rotary_dims():
    raw = {
        "architectures": ["X"],
        "text_config": {
            "hidden_size": 4096, "num_attention_heads": 32, "head_dim": 256, "num_hidden_layers": 8,
            "rope_parameters": {"mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25},
        },
    }  # fmt: skip
    tiny = shrink_config(raw, 512, {t: i for i, t in enumerate(["<|endoftext|>", "<|im_end|>"])})
    text = tiny["text_config"]
    assert text["rope_parameters"]["mrope_section"] == [2, 1, 1]  # sums to 32 * 0.25 / 2
    assert (text["hidden_size"], text["head_dim"], text["num_hidden_layers"]) == (64, 32, 2)
    assert raw["text_config"]["hidden_size"] == 4096  # the input is not modified


def test_a_config_without_head_dim_gets_a_head_size_cpu_attention_runs_and_keeps_mha():
    """hidden / heads is the head size when the config names none; multi-head attention stays multi-head."""
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_hidden_layers": 16,
    }
    text = shrink_config(raw, 512, {"<|endoftext|>": 0, "<|im_end|>": 1})
    assert text["hidden_size"] // text["num_attention_heads"] == 32
    assert text["num_key_value_heads"] == text["num_attention_heads"]
    gqa = shrink_config(raw | {"num_key_value_heads": 4}, 512, {"<|endoftext|>": 0, "<|im_end|>": 1})
    assert gqa["num_key_value_heads"] * 2 == gqa["num_attention_heads"]


def test_a_family_declares_its_expert_fields_and_tiny_sizes():
    from model_support.core.layout import ConfigFields

    raw = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_hidden_layers": 61,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "kv_lora_rank": 512,
    }
    fields = ConfigFields(experts=("n_routed_experts",))
    text = shrink_config(raw, 512, {"<|endoftext|>": 0, "<|im_end|>": 1}, fields, {"kv_lora_rank": 16})
    assert (text["n_routed_experts"], text["num_experts_per_tok"], text["kv_lora_rank"]) == (4, 2, 16)
    assert shrink_config(raw, 512, {"<|endoftext|>": 0, "<|im_end|>": 1})["n_routed_experts"] == 256
