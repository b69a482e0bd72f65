"""The LoRA codecs on random tensors: names, exact inverse, and clear errors (no Megatron needed)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from model_support.core.codecs import CodecError, QwenLoraCodec, load_peft_adapter, save_peft_adapter
from model_support.core.layout import derive_layout


def _qwen35_lora(rank: int = 3) -> dict[str, torch.Tensor]:
    """Megatron LoRA tensors of the tiny Qwen3.5 replica's shapes (GDN layer 0, attention layer 3)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {
        # in_proj rows (GDN heads of 128): q 256 + k 256 + v 768 + z 768 + b 6 + a 6;
        # gated qkv: 4 heads x 2 x 32 + k 128 + v 128
        "decoder.layers.0.self_attention.in_proj": (2060, 64),
        "decoder.layers.0.self_attention.out_proj": (64, 768),
        "decoder.layers.0.mlp.linear_fc1": (256, 64),
        "decoder.layers.3.self_attention.linear_qkv": (512, 64),
        "decoder.layers.3.self_attention.linear_proj": (64, 128),
    }
    out = {}
    for name, (rows, cols) in shapes.items():
        out[f"{name}.lora_A.weight"] = torch.randn(rank, cols, generator=gen)
        out[f"{name}.lora_B.weight"] = torch.randn(rows, rank, generator=gen)
    return out


@pytest.fixture(scope="module")
def qwen35(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir("qwen3.5"))
    return config, derive_layout(config)


def test_qwen35_names_and_exact_inverse(qwen35, tmp_path) -> None:
    config, layout = qwen35
    codec, lora = QwenLoraCodec("qwen3.5"), _qwen35_lora()
    peft = codec.to_peft(lora, config, layout)
    prefix = "base_model.model.model.language_model.layers."
    expected = {
        f"{prefix}0.linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    }
    expected |= {f"{prefix}0.mlp.{m}" for m in ("gate_proj", "up_proj")}
    expected |= {f"{prefix}3.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert {k.rsplit(".lora_", 1)[0] for k in peft} == expected
    rows = {k.rsplit(".", 3)[-3]: v.shape[0] for k, v in peft.items() if k.endswith("lora_B.weight")}
    assert rows["in_proj_qkv"] == 1280 and rows["in_proj_z"] == 768 and rows["in_proj_b"] == 6
    assert rows["q_proj"] == 256 and rows["k_proj"] == 128 and rows["gate_proj"] == 128
    save_peft_adapter(tmp_path, peft, rank=3, alpha=6)
    adapter_config, on_disk = load_peft_adapter(tmp_path)
    assert adapter_config["r"] == 3 and adapter_config["peft_type"] == "LORA"
    # adapter_config.json lists exactly the modules whose tensors the adapter holds.
    assert adapter_config["target_modules"] == sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in peft})
    back = codec.from_peft(on_disk, config, layout)
    assert set(back) == set(lora)
    assert all(torch.equal(back[k], lora[k]) for k in lora)


def test_from_peft_refuses_unshareable_lora_a(qwen35) -> None:
    config, layout = qwen35
    codec = QwenLoraCodec("qwen3.5")
    peft = codec.to_peft(_qwen35_lora(), config, layout)
    key = "base_model.model.model.language_model.layers.3.self_attn.k_proj.lora_A.weight"
    peft[key] = peft[key] + 1
    with pytest.raises(CodecError, match=r"k_proj: lora_A differs from q_proj's; the fused Megatron module"):
        codec.from_peft(peft, config, layout)


def test_errors_name_the_problem(qwen35) -> None:
    config, layout = qwen35
    codec = QwenLoraCodec("qwen3.5")
    lora = _qwen35_lora()
    with pytest.raises(CodecError, match=r"layer 9 but the model has 4"):
        codec.to_peft({k.replace("layers.3.", "layers.9."): v for k, v in lora.items()}, config, layout)
    lora["decoder.layers.3.self_attention.linear_qkv.lora_B.weight"] = torch.zeros(500, 3)
    with pytest.raises(CodecError, match=r"lora_B has 500 rows, the qwen3.5 layout for this config covers 512"):
        codec.to_peft(lora, config, layout)
    with pytest.raises(CodecError, match=r"no HF module for Megatron LoRA module 'mlp.router'"):
        codec.to_peft({f"decoder.layers.0.mlp.router.lora_{w}.weight": torch.zeros(1, 1) for w in "AB"}, config, layout)
