"""Qwen3 dense and Qwen3 MoE."""

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import DependencyFloor, HandlerSpec, Topology, VllmLora
from model_support.handlers.configs import CONFIGS

_TRANSFORMERS = DependencyFloor("transformers", "4.51.0", "first release with model_type qwen3 / qwen3_moe")
# Megatron side: the bridge's Qwen3 / Qwen3-MoE mappings and the megatron-core it was built against.
_MEGATRON = (
    DependencyFloor("megatron-core", "0.19.2", "local-spec GPTModel the bridge targets", extra="megatron"),
    DependencyFloor("megatron-bridge", "0.6.2", "Qwen3Bridge / Qwen3MoEBridge weight mappings", extra="megatron"),
)


def _dense_layers(cfg):
    """Qwen3-MoE layers with a dense MLP: those in mlp_only_layers and those off the decoder_sparse_step."""
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    only = set(getattr(cfg, "mlp_only_layers", None) or ())
    return [i for i in range(cfg.num_hidden_layers) if i in only or (i + 1) % step != 0]


# LoRA splits derived from the Qwen3 / Qwen3-MoE bridges' own mappings.
_CODEC = BridgeLoraCodec("qwen3")

QWEN3 = HandlerSpec(
    name="qwen3",
    description="Qwen3 dense decoder (GQA attention with q/k RMSNorm, SwiGLU MLP).",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    topology=Topology.DENSE,
    lora_targets=targets.ATTENTION + targets.DENSE_MLP,
    vllm_lora=VllmLora(native=True, reason="vLLM's Qwen3ForCausalLM implements SupportsLoRA"),
    codec=_CODEC,
    dependencies=(_TRANSFORMERS, *_MEGATRON),
    reference_config=CONFIGS / "qwen3-0.6b.json",
    # The sliding-window layer count follows a replica's depth.
    config_fields=ConfigFields(layer_counts=("max_window_layers",)),
)

QWEN3_MOE = HandlerSpec(
    name="qwen3-moe",
    description="Qwen3 mixture of experts (routed experts, no shared expert).",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    topology=Topology.MOE,
    lora_targets=targets.ATTENTION + targets.EXPERTS,
    vllm_lora=VllmLora(native=True, reason="vLLM's Qwen3MoeForCausalLM implements SupportsLoRA with fused-MoE LoRA"),
    codec=_CODEC,
    dependencies=(_TRANSFORMERS, *_MEGATRON),
    reference_config=CONFIGS / "qwen3-30b-a3b.json",
    config_fields=ConfigFields(dense_layers=_dense_layers, layer_lists=("mlp_only_layers",)),
)
