"""BridgeLoraCodec, whose splits come from megatron-bridge's mappings, on the tiny replicas of every built-in handler.

It must name and size the HF modules as the checkpoint does, invert itself exactly, split the Megatron base weights
into exactly the checkpoint's tensors (the lora_coverage layout check), and refuse what it cannot represent.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from model_support.core.codecs import (
    PEFT_PREFIX,
    BridgeLoraCodec,
    CodecError,
    hf_layers_prefix,
    load_peft_adapter,
    save_peft_adapter,
)
from model_support.core.layout import ModelLayout
from model_support.handlers import BUILTIN_HANDLERS
from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow

HANDLERS = ("qwen3", "qwen3-moe", "qwen3.5", "qwen3.5-moe")
_SPECS = {h.name: h for h in BUILTIN_HANDLERS}
_FUSED = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")


@dataclass
class Model:
    """A tiny replica built in Megatron through the bridge, with its config and layout."""

    model_dir: Path
    config: Any
    layout: ModelLayout
    built: Any  # MegatronModel


def _build(model_dir: Path, handler: str) -> Model:
    from model_support.core.megatron.builder import build_megatron_model

    config = AutoConfig.from_pretrained(model_dir)
    return Model(model_dir, config, _SPECS[handler].layout(config), build_megatron_model(model_dir, config))


@pytest.fixture(scope="module")
def base_model(tiny_model_dir) -> Callable[[str], Model]:
    """``base_model("qwen3.5")`` -> the replica in Megatron without LoRA (its fused base weights as built)."""
    require_megatron()
    cache: dict[str, Model] = {}

    def get(handler: str) -> Model:
        if handler not in cache:
            cache[handler] = _build(tiny_model_dir(handler), handler)
        return cache[handler]

    return get


@pytest.fixture(scope="module")
def lora(tiny_model_dir) -> Callable[[str], tuple[Model, dict[str, torch.Tensor]]]:
    """``lora("qwen3.5")`` -> (the replica with LoRA on every declared target, its random canonical LoRA tensors)."""
    require_megatron()
    from model_support.core.megatron.lora import apply_lora, load_lora_state, lora_state, random_lora_state

    cache: dict[str, tuple[Model, dict[str, torch.Tensor]]] = {}

    def get(handler: str) -> tuple[Model, dict[str, torch.Tensor]]:
        if handler not in cache:
            model = _build(tiny_model_dir(handler), handler)
            apply_lora(model.built.model, _SPECS[handler], rank=4, alpha=8.0)
            load_lora_state(model.built.model, random_lora_state(model.built.model, seed=3, b_std=0.05))
            cache[handler] = (model, lora_state(model.built.model))
        return cache[handler]

    return get


@pytest.mark.parametrize("handler", HANDLERS)
def test_exact_inverse_with_one_module_per_expert(lora, handler: str) -> None:
    model, tensors = lora(handler)
    codec = BridgeLoraCodec()
    peft = codec.to_peft(tensors, model.config, model.layout)
    if model.layout.moe is not None:  # experts come out one module per expert, as PEFT and vLLM name them
        assert any(".mlp.experts.3.gate_proj.lora_B.weight" in key for key in peft)
    back = codec.from_peft(peft, model.config, model.layout)
    assert set(back) == set(tensors)
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_qwen35_names_row_counts_and_adapter_files(tiny_model_dir, tmp_path: Path) -> None:
    """The HF names and B rows of each split, written out independently of the bridge, and the PEFT files."""
    require_megatron()
    config = AutoConfig.from_pretrained(tiny_model_dir("qwen3.5"))
    layout = _SPECS["qwen3.5"].layout(config)
    gen = torch.Generator().manual_seed(0)
    shapes = {
        # in_proj rows (GDN heads of 128): q 256 + k 256 + v 768 + z 768 + b 6 + a 6;
        # gated qkv: 4 heads x 2 x 32 + k 2 x 32 + v 2 x 32
        "decoder.layers.0.self_attention.in_proj": (2060, 64),
        "decoder.layers.0.self_attention.out_proj": (64, 768),
        "decoder.layers.0.mlp.linear_fc1": (256, 64),
        "decoder.layers.3.self_attention.linear_qkv": (384, 64),
        "decoder.layers.3.self_attention.linear_proj": (64, 128),
    }
    lora = {}
    for name, (rows, cols) in shapes.items():
        lora[f"{name}.lora_A.weight"] = torch.randn(3, cols, generator=gen)
        lora[f"{name}.lora_B.weight"] = torch.randn(rows, 3, generator=gen)
    codec = BridgeLoraCodec("qwen3.5")
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
    assert rows["q_proj"] == 256 and rows["k_proj"] == 64 and rows["gate_proj"] == 128
    save_peft_adapter(tmp_path, peft, rank=3, alpha=6)
    adapter_config, on_disk = load_peft_adapter(tmp_path)
    assert adapter_config["r"] == 3 and adapter_config["peft_type"] == "LORA"
    # adapter_config.json lists exactly the modules whose tensors the adapter holds.
    assert adapter_config["target_modules"] == sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in peft})
    back = codec.from_peft(on_disk, config, layout)
    assert set(back) == set(lora) and all(torch.equal(back[k], lora[k]) for k in lora)


@pytest.mark.parametrize("handler", HANDLERS)
def test_layout_check_splits_base_weights_into_the_checkpoint(base_model, handler: str, tmp_path: Path) -> None:
    """lora_coverage's own layout check passes with 0 error, and the split covers every fused linear's HF tensors."""
    from model_support.core.registry import load_registry
    from model_support.validation.context import CheckContext
    from model_support.validation.stages.lora_coverage import LoraCoverageStage

    model = base_model(handler)
    codec = BridgeLoraCodec(handler)
    registry = load_registry()
    good = registry.get(handler)
    ctx = CheckContext(
        target=handler,
        model_dir=model.model_dir,
        handler=dataclasses.replace(good, spec=dataclasses.replace(good.spec, codec=codec)),
        config=model.config,
        layout=model.layout,
        registry=registry,
        workdir=tmp_path,
        tiny=True,
    )
    assert LoraCoverageStage._codec_layout_err(ctx, model.built) == 0.0

    # The same split over the whole model at once: exactly the checkpoint tensors the bridge loaded them from.
    fake, expected = {}, set()
    for name, param in model.built.model.named_parameters():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in _FUSED:
            fake[f"{module}.lora_A.weight"] = torch.zeros(1, param.shape[1])
            fake[f"{module}.lora_B.weight"] = param.detach()
            expected.update(model.built.mapped[name].split(", "))
    prefix = PEFT_PREFIX + hf_layers_prefix(model.config)
    split = {
        "model.layers." + key[len(prefix) : -len(".lora_B.weight")] + ".weight": value
        for key, value in codec.to_peft(fake, model.config, model.layout).items()
        if key.endswith(".lora_B.weight")
    }
    assert expected and set(split) == expected
    for hf_name, value in split.items():
        assert torch.equal(value, model.built.checkpoint[hf_name].to(value.dtype)), hf_name


@pytest.mark.parametrize(
    ("module", "fused"),
    [
        ("layers.3.self_attn.k_proj", "decoder.layers.3.self_attention.linear_qkv"),
        ("layers.0.linear_attn.in_proj_z", "decoder.layers.0.self_attention.in_proj"),
        ("layers.1.mlp.up_proj", "decoder.layers.1.mlp.linear_fc1"),
    ],
)
def test_from_peft_refuses_lora_a_that_differ_within_a_fused_module(lora, module: str, fused: str) -> None:
    model, tensors = lora("qwen3.5")
    codec = BridgeLoraCodec("qwen3.5")
    peft = codec.to_peft(tensors, model.config, model.layout)
    key = f"{PEFT_PREFIX}model.language_model.{module}.lora_A.weight"
    peft[key] = peft[key] + 1e-3
    leaf = module.rsplit(".", 1)[-1]
    with pytest.raises(CodecError, match=rf"{leaf}: lora_A differs from \w+'s; the fused Megatron module {fused} "):
        codec.from_peft(peft, model.config, model.layout)


def test_errors_name_what_cannot_be_represented(lora) -> None:
    model, tensors = lora("qwen3.5")
    codec, config, layout = BridgeLoraCodec("qwen3.5"), model.config, model.layout
    qkv = "decoder.layers.3.self_attention.linear_qkv"

    peft = codec.to_peft(tensors, config, layout)
    v_proj = f"{PEFT_PREFIX}model.language_model.layers.3.self_attn.v_proj.lora_B.weight"
    with pytest.raises(CodecError, match=rf"{qkv}: needs lora_A and lora_B of all of .*v_proj"):
        codec.from_peft({k: v for k, v in peft.items() if k != v_proj}, config, layout)
    unknown = {
        f"{PEFT_PREFIX}model.language_model.layers.3.self_attn.x_proj.lora_{w}.weight": torch.zeros(1, 1) for w in "AB"
    }
    with pytest.raises(CodecError, match=r"no Megatron module for model\.language_model\.layers\.3\.self_attn\.x_proj"):
        codec.from_peft(unknown, config, layout)

    wrong_rows = dict(tensors) | {f"{qkv}.lora_B.weight": torch.zeros(500, 4)}
    with pytest.raises(CodecError, match=rf"{qkv}: megatron-bridge's QKVMapping cannot split a \[500, 64\] weight"):
        codec.to_peft(wrong_rows, config, layout)
    with pytest.raises(CodecError, match=r"layer 9 but the model has 4"):
        codec.to_peft({k.replace("layers.3.", "layers.9."): v for k, v in tensors.items()}, config, layout)
    with pytest.raises(CodecError, match=r"no HF module for Megatron LoRA module 'mlp.router'"):
        codec.to_peft({f"decoder.layers.0.mlp.router.lora_{w}.weight": torch.zeros(1, 1) for w in "AB"}, config, layout)
    # A bridge mapping that changes values (GDN's zero-centred norm adds 1) is not a row split: refused, not guessed.
    norm = {f"decoder.layers.0.self_attention.out_norm.lora_{w}.weight": torch.zeros(4, 4) for w in "AB"}
    with pytest.raises(
        CodecError, match=r"RMSNorm2ZeroCenteredRMSNormMapping does not place every row of the fused weight"
    ):
        codec.to_peft(norm, config, layout)


def test_creating_the_codec_imports_no_megatron() -> None:
    """Handlers create their codec at import time, which `model-support list` must keep fast."""
    code = (
        "import sys; from model_support.core.codecs import BridgeLoraCodec; BridgeLoraCodec('x'); "
        "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
