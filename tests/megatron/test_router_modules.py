"""The reference finds each MoE block's router where megatron-bridge maps megatron-core's router from, not by its
class name: a family whose router is a plain linear ``gate`` (DeepSeek-V2's in transformers, Mixtral's) is routed and
replayed too."""

from __future__ import annotations

import torch

from model_support.core.bridge_linears import bridge_routers
from model_support.core.discovery import load_config, locate
from model_support.core.megatron import hf_reference
from tests.megatron.conftest import require_megatron


def test_the_router_is_where_the_bridge_maps_it_from(tiny_model_dir) -> None:
    require_megatron()
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("qwen3-moe")
    config = load_config(locate(str(model_dir)))
    assert bridge_routers(config) == ("mlp.gate",)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = config.num_hidden_layers
    assert len(hf_reference._moe_blocks(model)) == layers
    # A router whose class does not say "Router" (a plain gate): found by the bridge's path alone.
    for layer in model.model.layers:
        gate = layer.mlp.gate
        gate.__class__ = type("Gate", (type(gate),), {})
    assert hf_reference._moe_blocks(model) == []
    routers = hf_reference._router_modules(config)
    assert routers == ("mlp.gate",)
    blocks = hf_reference._moe_blocks(model, routers)
    assert [name for name, _, _ in blocks] == [f"model.layers.{i}.mlp" for i in range(layers)]
    assert [len(hf_reference._moe_blocks(layer, routers)) for layer in model.model.layers] == [1] * layers
    # A checkpoint's block that loads into a module named otherwise (Mixtral's block_sparse_moe into transformers'
    # mlp): the router is the block's child of the mapped name.
    assert len(hf_reference._moe_blocks(model, ("block_sparse_moe.gate",))) == layers
    assert hf_reference._moe_blocks(model, ("block_sparse_moe.router",)) == []
    # Its routing is recorded and replayed: the model's own top-k given back leaves the logits as they were.
    tokens = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    captures: list[hf_reference.RouterCapture] = []
    with torch.no_grad(), hf_reference.routing_hooks(model, captures, None, routers):
        plain = model(input_ids=tokens, use_cache=False).logits
    assert len(captures) == layers and captures[0].indices.shape == (12, config.num_experts_per_tok)
    with torch.no_grad(), hf_reference.routing_hooks(model, None, [c.indices for c in captures], routers):
        replayed = model(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-5)
