"""``codecs.peft_rank_and_scale`` gives each module of an adapter the rank and scale PEFT itself gives it (PEFT's
LoRA layers built from the same config), rank and alpha patterns and rsLoRA included: what a server of the adapter
applies, which the reference merges."""

from __future__ import annotations

import pytest
import torch

from model_support.core.codecs import peft_rank_and_scale

MODULES = ("layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj", "layers.1.mlp.down_proj", "layers.1.mlp.up_proj")


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.ModuleDict({n: torch.nn.Linear(8, 8) for n in ("q_proj", "v_proj")})
            layer.mlp = torch.nn.ModuleDict({n: torch.nn.Linear(8, 8) for n in ("down_proj", "up_proj")})
            self.layers.append(layer)


@pytest.mark.parametrize(
    "config",
    [
        {"r": 8, "lora_alpha": 16},
        {"r": 8, "lora_alpha": 16, "use_rslora": True},
        {"r": 4, "lora_alpha": 8, "rank_pattern": {"v_proj": 2, "layers.1.mlp.down_proj": 6}},
        {"r": 4, "lora_alpha": 8, "alpha_pattern": {"mlp.up_proj": 3.0}, "use_rslora": True},
    ],
)
def test_each_module_gets_the_rank_and_scale_peft_gives_it(config: dict) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_Tiny(), LoraConfig(target_modules=["q_proj", "v_proj", "down_proj", "up_proj"], **config))
    for module in MODULES:
        layer = model.base_model.model.get_submodule(module)
        assert peft_rank_and_scale(config, module) == (layer.r["default"], pytest.approx(layer.scaling["default"]))
