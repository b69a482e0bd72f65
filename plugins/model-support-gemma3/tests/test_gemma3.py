"""Tests of the Gemma 3 handler, through model-support's pytest plugin fixtures."""

import json
from dataclasses import replace

import pytest
from model_support.core.registry import load_registry
from transformers import Gemma3TextConfig

from model_support_gemma3.handler import GEMMA3, REFERENCE_CONFIG


def _reference() -> Gemma3TextConfig:
    return Gemma3TextConfig(**json.loads(REFERENCE_CONFIG.read_text()))


def test_the_installed_plugin_registers_the_handler():
    registry = load_registry()
    entry = registry.for_architecture("Gemma3ForCausalLM")
    assert entry.spec == GEMMA3
    assert (entry.plugin.name, entry.plugin.distribution) == ("gemma3", "model-support-gemma3")


def test_reference_config_has_the_published_gemma_3_1b_shapes():
    config = _reference()
    layout = GEMMA3.layout(config)
    assert (layout.num_layers, layout.moe, layout.gdn_layers) == (26, None, ())
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (1152, 4, 1)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (256, 6912, 262144)
    # transformers derives the 5 sliding : 1 full pattern from sliding_window_pattern 6.
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config.sliding_window, config.query_pre_attn_scalar) == (512, 256)
    assert GEMMA3.config_problems(config) == []


def test_configs_the_bridge_would_build_wrong_are_refused():
    config = _reference()
    config.final_logit_softcapping = 30.0
    assert GEMMA3.config_problems(config) == [
        "final_logit_softcapping set: megatron-bridge's Gemma3 model does not apply logit softcapping"
    ]
    config = _reference()
    config.layer_types = ["sliding_attention", "full_attention"] * 13
    assert GEMMA3.config_problems(config) == [
        "layer_types are not megatron-bridge's Gemma3 pattern of 5 sliding to 1 full attention layers"
    ]
    assert replace(GEMMA3, config_requirements=()).config_problems(config) == []


@pytest.mark.model_support("gemma3", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
