"""Tests of the GLM-4.5 MoE handler, through model-support's pytest plugin fixtures."""

import json

import pytest
from model_support.core.registry import load_registry
from transformers import Glm4MoeConfig

from model_support_glm4_moe.handler import GLM4_MOE, REFERENCE_CONFIG


def test_the_installed_plugin_registers_the_handler():
    entry = load_registry().for_architecture("Glm4MoeForCausalLM")
    assert entry.spec == GLM4_MOE
    assert (entry.plugin.name, entry.plugin.distribution) == ("glm4-moe", "model-support-glm4-moe")


def test_reference_config_has_the_published_glm_4_5_air_layout():
    config = Glm4MoeConfig(**json.loads(REFERENCE_CONFIG.read_text()))
    layout = GLM4_MOE.layout(config)
    assert (layout.num_layers, layout.mtp_layers, layout.moe.dense_layers) == (46, 1, (0,))
    assert (layout.moe.num_experts, layout.moe.top_k, layout.moe.expert_intermediate_size) == (128, 8, 1408)
    assert layout.moe.shared_expert_intermediate_size == 1408
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (4096, 96, 8)
    assert (config.partial_rotary_factor, config.attention_bias, config.use_qk_norm) == (0.5, True, False)
    assert GLM4_MOE.config_problems(config) == []


def test_two_shared_experts_are_refused_by_name():
    config = Glm4MoeConfig(**{**json.loads(REFERENCE_CONFIG.read_text()), "n_shared_experts": 2})
    (problem,) = GLM4_MOE.config_problems(config)
    assert problem.startswith("config sets n_shared_experts=2, the handler supports only 1: megatron-bridge's")


@pytest.mark.model_support("glm4-moe", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
