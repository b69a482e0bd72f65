"""Tests of the gpt-oss handler and bridge, through model-support's pytest plugin fixtures."""

import copy
import json

import pytest
from model_support.core.registry import load_registry
from transformers import GptOssConfig

from model_support_gpt_oss.handler import GPT_OSS, REFERENCE_CONFIG


def _reference() -> GptOssConfig:
    return GptOssConfig(**json.loads(REFERENCE_CONFIG.read_text()))


def test_the_installed_plugin_registers_the_handler():
    entry = load_registry().for_architecture("GptOssForCausalLM")
    assert entry.spec == GPT_OSS
    assert (entry.plugin.name, entry.plugin.distribution) == ("gpt-oss", "model-support-gpt-oss")


def test_reference_config_has_the_published_gpt_oss_20b_layout():
    config = _reference()
    layout = GPT_OSS.layout(config)
    assert (layout.num_layers, layout.moe.num_experts, layout.moe.top_k) == (24, 32, 4)
    assert layout.moe.expert_intermediate_size == 2880 and layout.layer_types == ("full_attention",) * 24
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"] and config.sliding_window == 128
    assert GPT_OSS.config_problems(config) == []


def test_an_mxfp4_checkpoint_is_refused_in_one_line():
    config = _reference()
    config.quantization_config = {"quant_method": "mxfp4"}
    (problem,) = GPT_OSS.config_problems(config)
    assert problem.startswith("config sets quantization_config={'quant_method': 'mxfp4'}, the handler supports only")


def test_the_bridge_builds_the_configs_yarn_and_sliding_layers():
    from model_support.core.megatron.imports import MegatronUnavailableError, import_bridge

    try:
        import_bridge()
    except MegatronUnavailableError as exc:
        pytest.skip(str(exc))
    from model_support.core.megatron.builder import family_bridge
    from model_support.core.megatron.state_source import hf_pretrained

    from model_support_gpt_oss.bridge import GptOssConfigBridge

    config = copy.deepcopy(_reference())
    config.rope_parameters = {**config.rope_parameters, "factor": 8.0, "original_max_position_embeddings": 1024}
    config.layer_types = ["full_attention", "sliding_attention"] * 12
    bridge, tcfg = family_bridge(config)
    assert isinstance(bridge, GptOssConfigBridge)
    provider = bridge.provider_bridge(hf_pretrained(tcfg))
    assert (provider.yarn_rotary_scaling_factor, provider.yarn_original_max_position_embeddings) == (8.0, 1024)
    assert provider.window_attn_skip_freq[:4] == [0, 1, 0, 1] and provider.softmax_type == "learnable"


@pytest.mark.model_support("gpt-oss", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
