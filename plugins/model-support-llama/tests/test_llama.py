"""Tests of the Llama handler, through model-support's pytest plugin fixtures."""

import copy
import json

import pytest
import torch
from model_support.core import api
from model_support.core.registry import load_registry
from model_support.core.tiny import build_tiny
from transformers import AutoConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

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


def test_the_megatron_model_has_the_configs_llama3_frequencies(tmp_path):
    """megatron-bridge's LlamaBridge alone scales with original_max_position_embeddings=8192 whatever the config says;
    the plugin's bridge builds transformers' llama3 frequencies for the tiny replica's 128 and the reference's 8192."""
    from model_support.core.megatron.imports import MegatronUnavailableError, import_bridge

    try:
        import_bridge()  # megatron-bridge, then the plugins' bridges (this one's among them)
    except MegatronUnavailableError as exc:
        pytest.skip(str(exc))
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from model_support.core.megatron.builder import family_bridge

    from model_support_llama.bridge import Llama3RopeBridge

    model_dir = build_tiny(json.loads(REFERENCE_CONFIG.read_text()), tmp_path / "tiny", spec=LLAMA)
    tiny = AutoConfig.from_pretrained(model_dir)
    reference = copy.deepcopy(tiny)  # the tiny shapes, with the published rope parameters
    reference.rope_parameters = dict(LlamaConfig(**json.loads(REFERENCE_CONFIG.read_text())).rope_parameters)
    assert tiny.rope_parameters["original_max_position_embeddings"] == 128
    assert reference.rope_parameters["original_max_position_embeddings"] == 8192
    bridge, _ = family_bridge(tiny)
    assert isinstance(bridge, Llama3RopeBridge)  # registered in place of megatron-bridge's LlamaBridge
    built = {}
    for name, config in (("tiny", tiny), ("reference", reference)):
        model = api.build_model(model_dir, config=config)
        (rope,) = [m for chunk in model.chunks for m in chunk.modules() if isinstance(m, RotaryEmbedding)]
        built[name] = rope.inv_freq
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
        torch.testing.assert_close(rope.inv_freq, expected, rtol=1e-6, atol=0)
        params = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
        assert bridge.megatron_to_hf_config(model.built.provider)["rope_scaling"] == params
    # The reference builds what megatron-core's own llama3 scaling (its defaults) built before; the tiny one differs.
    theta = tiny.rope_parameters["rope_theta"]
    stock = RotaryEmbedding(
        tiny.head_dim, 1.0, rotary_base=theta, rope_scaling=True, rope_scaling_factor=32.0, use_cpu_initialization=True
    ).inv_freq
    torch.testing.assert_close(built["reference"], stock, rtol=0, atol=0)
    assert not torch.allclose(built["tiny"], stock)


@pytest.mark.model_support("llama", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
