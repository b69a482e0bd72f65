"""Tests of the Mixtral handler and bridge, through model-support's pytest plugin fixtures."""

import json

import pytest
from model_support.core.registry import load_registry
from model_support.core.tiny import build_tiny
from model_support.core.validate import build_meta_model, missing_targets, stored_names
from transformers import MixtralConfig

from model_support_mixtral.handler import MIXTRAL, REFERENCE_CONFIG


def _reference() -> MixtralConfig:
    return MixtralConfig(**json.loads(REFERENCE_CONFIG.read_text()))


def test_the_installed_plugin_registers_the_handler():
    entry = load_registry().for_architecture("MixtralForCausalLM")
    assert entry.spec == MIXTRAL
    assert (entry.plugin.name, entry.plugin.distribution) == ("mixtral", "model-support-mixtral")


def test_reference_config_has_the_published_mixtral_8x7b_layout():
    config = _reference()
    layout = MIXTRAL.layout(config)
    assert (layout.num_layers, layout.moe.dense_layers, layout.moe.has_shared_expert) == (32, (), False)
    assert (layout.moe.num_experts, layout.moe.top_k, layout.moe.expert_intermediate_size) == (8, 2, 14336)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (4096, 32, 8)


def test_the_targets_are_the_names_mixtral_checkpoints_store():
    assert missing_targets(MIXTRAL, stored_names(build_meta_model(_reference()))) == []


def test_the_bridge_maps_the_checkpoints_expert_names():
    from model_support.core.megatron.imports import MegatronUnavailableError, import_bridge

    try:
        import_bridge()  # megatron-bridge, then the plugins' bridges (this one's among them)
    except MegatronUnavailableError as exc:
        pytest.skip(str(exc))
    from model_support.core.megatron.builder import family_bridge, mapping_registry

    from model_support_mixtral.bridge import MixtralBridge

    bridge, _ = family_bridge(_reference())
    assert isinstance(bridge, MixtralBridge)
    fc1 = mapping_registry(bridge).megatron_to_hf_lookup(
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    )
    assert fc1.hf_param == {
        "gate": "model.layers.3.block_sparse_moe.experts.5.w1.weight",
        "up": "model.layers.3.block_sparse_moe.experts.5.w3.weight",
    }


def test_a_sliding_window_is_built_and_matches_transformers(tmp_path, model_support_check):
    """A Mixtral config with a sliding window: the bridge asks for it (window_size), the local spec builds it on
    every layer, and the logits match transformers' past the window (hf_parity's long row crosses it)."""
    config = {**json.loads(REFERENCE_CONFIG.read_text()), "sliding_window": 8}
    model_dir = build_tiny(config, tmp_path / "windowed", spec=MIXTRAL)
    results = {r.stage: r for r in model_support_check(model_dir, stages=["hf_parity"]).results}
    assert "the built Megatron model implements the config's sliding window" in results["architecture"].details
    parity = results["hf_parity"]
    assert "rows: 2 x 32 tokens, and 1 x 65 (sliding_window from 9 tokens)" in parity.details
    assert parity.metrics["max_abs_err"] < 1e-5 and parity.metrics["long_max_abs_err"] < 1e-5


@pytest.mark.model_support("mixtral", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
