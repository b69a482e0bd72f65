"""Tiny replicas keep what makes each architecture itself."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from model_support.core.layout import derive_layout
from model_support.core.tiny import build_tokenizer, shrink_config
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
    layout = derive_layout(config)
    if handler.startswith("qwen3.5"):
        assert type(model).__name__.endswith("ForConditionalGeneration")  # multimodal checkpoint class kept
        assert layout.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert layout.mtp_layers == 1
        text = config.get_text_config()
        assert text.linear_num_value_heads // text.linear_num_key_heads in (2, 3)  # GDN head grouping kept
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
