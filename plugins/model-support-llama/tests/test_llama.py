"""Tests of the Llama handler, through model-support's pytest plugin fixtures."""

import json

import pytest
from model_support.core.registry import load_registry
from transformers import LlamaConfig

from model_support_llama.handler import LLAMA, REFERENCE_CONFIG


def test_the_installed_plugin_registers_the_handler():
    registry = load_registry()
    entry = registry.for_architecture("LlamaForCausalLM")
    assert entry.spec == LLAMA
    assert (entry.plugin.name, entry.plugin.distribution) == ("llama", "model-support-llama")


def test_reference_config_has_the_published_llama_3_2_1b_shapes():
    config = LlamaConfig(**json.loads(REFERENCE_CONFIG.read_text()))
    layout = LLAMA.layout(config)
    assert (layout.num_layers, layout.moe, layout.gdn_layers) == (16, None, ())
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (2048, 32, 8)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 8192, 128256)


@pytest.mark.model_support("llama", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
