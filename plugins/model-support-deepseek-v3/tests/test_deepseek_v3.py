"""Tests of the DeepSeek-V3 handler, through model-support's pytest plugin fixtures."""

import json

import pytest
from model_support.core.registry import load_registry
from transformers import DeepseekV3Config

from model_support_deepseek_v3.handler import DEEPSEEK_V3, REFERENCE_CONFIG


def test_the_installed_plugin_registers_the_handler():
    registry = load_registry()
    entry = registry.for_architecture("DeepseekV3ForCausalLM")
    assert entry.spec == DEEPSEEK_V3
    assert (entry.plugin.name, entry.plugin.distribution) == ("deepseek-v3", "model-support-deepseek-v3")


def test_reference_config_has_the_published_deepseek_v3_shapes():
    config = DeepseekV3Config(**json.loads(REFERENCE_CONFIG.read_text()))
    layout = DEEPSEEK_V3.layout(config)
    assert (layout.num_layers, layout.moe.num_experts, layout.moe.top_k, layout.mtp_layers) == (61, 256, 8, 1)
    assert layout.moe.dense_layers == (0, 1, 2) and layout.moe.shared_expert_intermediate_size == 2048
    assert (config.hidden_size, config.num_attention_heads, config.vocab_size) == (7168, 128, 129280)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim) == (1536, 512, 64)
    assert (config.qk_nope_head_dim, config.v_head_dim) == (128, 128)
    assert (config.n_group, config.topk_group, config.scoring_func) == (8, 4, "sigmoid")


@pytest.mark.model_support("deepseek-v3", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
