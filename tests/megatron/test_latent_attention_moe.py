"""Core capabilities a multi-latent-attention MoE (DeepSeek-V3's tiny replica) needs, each checked on its own:

megatron-core's block spec (dense layers before the MoE ones, multi-latent attention), ``SDPAttention`` taking
its parent's softmax scale and key heads, a CPU build of a router with expert bias and per-layer yarn rotary
embeddings, mapped persistent buffers loaded, the reference's routing captured at the experts' input (also on
Qwen3-MoE, whose router chooses itself), and tiny replicas giving zero-initialised persistent buffers values.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig

from tests.megatron.conftest import require_megatron

_HANDLER = Path(__file__).parents[2] / "plugins/model-support-deepseek-v3/src/model_support_deepseek_v3/handler.py"


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny replica `check deepseek-v3 --tiny` builds, from the plugin's declaration (not installed here)."""
    from model_support.core.tiny import build_tiny

    loader = importlib.util.spec_from_file_location("deepseek_v3_handler", _HANDLER)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    spec = module.DEEPSEEK_V3
    raw = json.loads(spec.reference_config.read_text())
    return build_tiny(raw, tmp_path_factory.mktemp("tiny-deepseek-v3"), seed=0, spec=spec)


def _tensor(model_dir: Path, name: str) -> torch.Tensor:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def test_tiny_replica_gives_zero_initialised_persistent_buffers_values(deepseek_dir: Path) -> None:
    bias = _tensor(deepseek_dir, "model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.shape == (4,) and bool(bias.ne(0).all())


def test_sdp_attention_takes_the_parents_softmax_scale_and_shares_keys_only_across_fewer_key_heads() -> None:
    from model_support.core.megatron.spec import SDPAttention

    config = SimpleNamespace(
        softmax_scale=None, kv_channels=16, softmax_type="vanilla", num_attention_heads=4, tensor_model_parallel_size=1
    )
    q, k, v = (torch.randn(5, 2, 4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def expected(k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(5, 2, -1)

    scaled = SDPAttention(config, 1, None, "self", softmax_scale=0.7)
    assert torch.allclose(scaled(q, k, v, None), expected(k, v, 0.7), atol=1e-6)
    plain = SDPAttention(config, 1, None, "self")
    assert torch.allclose(plain(q, k, v, None), expected(k, v, 1 / math.sqrt(16)), atol=1e-6)
    # Two key heads for four query heads: each key head serves two consecutive query heads.
    k2, v2 = k[:, :, :2], v[:, :, :2]
    grouped = expected(k2.repeat_interleave(2, dim=2), v2.repeat_interleave(2, dim=2), 0.25)
    assert torch.allclose(plain(q, k2, v2, None), grouped, atol=1e-6)


def _reference(model_dir: Path):
    from model_support.core.megatron.hf_reference import StreamedReference

    config = AutoConfig.from_pretrained(model_dir)
    return config, StreamedReference(model_dir, config, torch.device("cpu"))


@pytest.mark.parametrize("handler", ["deepseek-v3", "qwen3-moe"])
def test_reference_captures_and_replays_the_routing_at_the_experts_input(handler, deepseek_dir, tiny_model_dir):
    model_dir = deepseek_dir if handler == "deepseek-v3" else tiny_model_dir(handler)
    config, reference = _reference(model_dir)
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = reference.forward(tokens, routers=True)
    moe_layers = 1 if handler == "deepseek-v3" else config.num_hidden_layers
    assert len(ref.routers) == moe_layers
    top_k = config.num_experts_per_tok
    for capture in ref.routers:
        assert capture.inputs.shape == (24, config.hidden_size)
        assert capture.logits.shape[0] == 24 and capture.indices.shape == (24, top_k)
    own = reference.forward(tokens, replay=[c.indices for c in ref.routers])
    assert torch.allclose(own.logits, ref.logits, atol=1e-5)
    experts = ref.routers[0].logits.shape[1]
    other = reference.forward(tokens, replay=[(c.indices + 1) % experts for c in ref.routers])
    assert (other.logits - ref.logits).abs().max() > 1e-3


def test_replayed_weights_follow_a_normalised_scaled_sigmoid_router() -> None:
    from model_support.core.megatron.hf_reference import ReferenceError, _replayed_weights

    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    chosen, target = torch.tensor([[0, 3]] * 6), torch.tensor([[5, 1]] * 6)
    score = torch.sigmoid(logits)

    def rule(idx: torch.Tensor) -> torch.Tensor:
        picked = score.gather(1, idx)
        return 2.5 * picked / picked.sum(-1, keepdim=True)

    assert torch.allclose(_replayed_weights("r", logits, chosen, rule(chosen), target), rule(target))
    with pytest.raises(ReferenceError, match="no softmax or sigmoid top-k"):
        _replayed_weights("r", logits, chosen, torch.rand(6, 2) + 0.5, target)


def test_megatron_builds_dense_then_moe_layers_with_latent_attention_on_cpu_and_matches(deepseek_dir) -> None:
    require_megatron()
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from model_support.core.megatron.builder import build_megatron_model, choose_numerics
    from model_support.core.megatron.compare import closeness, replayed_routing
    from model_support.core.megatron.forward import logits

    config, reference = _reference(deepseek_dir)
    built = build_megatron_model(deepseek_dir, config, numerics=choose_numerics(device_=torch.device("cpu")))
    layers = built.model.decoder.layers
    assert [type(layer.mlp) for layer in layers] == [MLP, MoELayer]
    assert all(isinstance(layer.self_attention, MLASelfAttention) for layer in layers)
    router = layers[1].mlp.router
    assert router.expert_bias.device.type == "cpu"
    assert torch.equal(router.expert_bias, _tensor(deepseek_dir, "model.layers.1.mlp.gate.e_score_correction_bias"))
    assert built.mapped["decoder.layers.1.mlp.router.expert_bias"] == "model.layers.1.mlp.gate.e_score_correction_bias"

    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = reference.forward(tokens, routers=True)
    with torch.no_grad(), replayed_routing(built.model, [c.indices for c in ref.routers], 2):
        ours = logits(built.model, tokens)
    assert closeness(ours, ref.logits)["rel_l2"] < 1e-5
