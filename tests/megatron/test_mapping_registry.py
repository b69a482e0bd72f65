"""A bridge that maps routed experts only under grouped-GEMM names still loads, exports and splits LoRA per expert.

Several megatron-bridge bridges map experts only as ``mlp.experts.linear_fc1.weight*``; the local spec builds
``mlp.experts.local_experts.<e>.linear_fc1``. The test strips the per-expert mappings from the Qwen3-MoE bridge
(which has both) and checks that :func:`mapping_registry` gives back what the bridge itself had.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow

_PER_EXPERT = ".local_experts."


@pytest.fixture
def grouped_only(monkeypatch):
    """Qwen3MoEBridge with its per-expert mappings removed (as OlMoEBridge, GLM-4.5, ... ship); the originals."""
    require_megatron()
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    original = Qwen3MoEBridge.mapping_registry
    full = original(Qwen3MoEBridge())

    def stripped(self):
        return MegatronMappingRegistry(*(m for m in original(self).mappings if _PER_EXPERT not in m.megatron_param))

    monkeypatch.setattr(Qwen3MoEBridge, "mapping_registry", stripped)
    return Qwen3MoEBridge, full


def test_per_expert_twins_resolve_like_the_bridges_own(grouped_only) -> None:
    from model_support.core.megatron.builder import mapping_registry

    bridge_class, full = grouped_only
    bridge = bridge_class()
    assert (
        bridge.mapping_registry().megatron_to_hf_lookup(
            "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
        )
        is None
    )
    completed = mapping_registry(bridge)
    for fc in ("linear_fc1", "linear_fc2"):
        name = f"decoder.layers.1.mlp.experts.local_experts.3.{fc}.weight"
        derived, own = completed.megatron_to_hf_lookup(name), full.megatron_to_hf_lookup(name)
        assert type(derived) is type(own) and derived.hf_param == own.hf_param and derived.megatron_param == name
    # A bridge that has both keeps exactly its own mappings.
    assert len(mapping_registry(type("Full", (), {"mapping_registry": lambda self: full})()).mappings) == len(
        full.mappings
    )


def test_a_grouped_only_bridge_builds_exports_and_splits_lora(grouped_only, tiny_model_dir) -> None:
    from model_support.core.codecs import BridgeLoraCodec
    from model_support.core.megatron.builder import build_megatron_model
    from model_support.core.megatron.hf_export import hf_weights
    from model_support.handlers import QWEN3_MOE

    model_dir = tiny_model_dir("qwen3-moe")
    config = AutoConfig.from_pretrained(model_dir)
    built = build_megatron_model(model_dir, config)
    experts = [n for n in built.mapped if _PER_EXPERT in n]
    assert experts and built.mapped["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"] == (
        "model.layers.0.mlp.experts.1.down_proj.weight"
    )
    exported = dict(hf_weights(built))
    stored = load_file(str(next(model_dir.glob("*.safetensors"))))
    assert set(exported) == set(stored)
    assert all(torch.equal(exported[k], stored[k]) for k in stored)
    layout = QWEN3_MOE.layout(config)
    hidden, width = config.hidden_size, layout.moe.expert_intermediate_size
    generator = torch.Generator().manual_seed(0)
    module = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1"
    b = torch.randn(2 * width, 4, generator=generator)
    lora = {f"{module}.lora_A.weight": torch.randn(4, hidden, generator=generator), f"{module}.lora_B.weight": b}
    codec = BridgeLoraCodec("grouped-only")
    peft = codec.to_peft(lora, config, layout)
    assert torch.equal(peft["base_model.model.model.layers.0.mlp.experts.2.gate_proj.lora_B.weight"], b[:width])
    assert torch.equal(peft["base_model.model.model.layers.0.mlp.experts.2.up_proj.lora_B.weight"], b[width:])
    back = codec.from_peft(peft, config, layout)
    assert set(back) == set(lora) and all(torch.equal(back[k], lora[k]) for k in lora)
