"""Tests of the Gemma 2 handler, through model-support's pytest plugin fixtures."""

import json
from dataclasses import replace

import pytest
from model_support.core.registry import load_registry
from transformers import Gemma2Config

from model_support_gemma2.handler import GEMMA2, REFERENCE_CONFIG


def _reference() -> Gemma2Config:
    return Gemma2Config(**json.loads(REFERENCE_CONFIG.read_text()))


def test_the_installed_plugin_registers_the_handler():
    registry = load_registry()
    entry = registry.for_architecture("Gemma2ForCausalLM")
    assert entry.spec == GEMMA2
    assert (entry.plugin.name, entry.plugin.distribution) == ("gemma2", "model-support-gemma2")


def test_reference_config_has_the_published_gemma_2_2b_shapes():
    config = _reference()
    layout = GEMMA2.layout(config)
    assert (layout.num_layers, layout.moe, layout.gdn_layers) == (26, None, ())
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (2304, 8, 4)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (256, 9216, 256000)
    # transformers alternates sliding and full attention from the first layer.
    assert config.layer_types[:4] == ["sliding_attention", "full_attention"] * 2
    assert (config.sliding_window, config.query_pre_attn_scalar) == (4096, 256)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert GEMMA2.config_problems(config) == []


def test_layer_patterns_the_bridge_would_build_wrong_are_refused():
    config = _reference()
    config.layer_types = ["full_attention", "sliding_attention"] * 13
    assert GEMMA2.config_problems(config) == [
        "layer_types do not alternate sliding and full attention from a sliding first layer, as megatron-bridge's "
        "Gemma2 model builds them"
    ]
    assert replace(GEMMA2, config_requirements=()).config_problems(config) == []


@pytest.mark.model_support("gemma2", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
