"""Mixtral (mistralai/Mixtral-8x7B): GQA attention, every layer a mixture of SwiGLU experts (softmax router, top-2)."""

from pathlib import Path

from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import DependencyFloor, HandlerSpec, LoraTarget, TargetScope, Topology, VllmLora
from model_support.core.targets import ATTENTION

# mistralai/Mixtral-8x7B-v0.1's config.json: 32 layers, hidden 4096, 32 heads / 8 KV heads, 8 experts of width 14336,
# top-2, vocab 32000.
REFERENCE_CONFIG = Path(__file__).with_name("mixtral-8x7b.json")

# The experts under the names Mixtral checkpoints store (block_sparse_moe.experts.<e>.w1 / w3 / w2), which PEFT
# adapters and vLLM's Mixtral address; transformers >= 5 fuses them in memory and converts on load and save.
EXPERTS = (
    LoraTarget("linear_fc1", ("w1", "w3"), TargetScope.EXPERT),
    LoraTarget("linear_fc2", ("w2",), TargetScope.EXPERT),
)

MIXTRAL = HandlerSpec(
    name="mixtral",
    description="Mixtral sparse mixture of experts (GQA attention, softmax top-2 router over SwiGLU experts).",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    topology=Topology.MOE,
    lora_targets=ATTENTION + EXPERTS,
    vllm_lora=VllmLora(native=True, reason="vLLM's MixtralForCausalLM implements SupportsLoRA with fused-MoE LoRA"),
    # LoRA splits derived from the plugin's MixtralBridge mappings (bridge.py).
    codec=BridgeLoraCodec("mixtral"),
    dependencies=(
        DependencyFloor("transformers", "5.8.0", "Mixtral's checkpoint conversion mapping (fused experts in memory)"),
        DependencyFloor("megatron-core", "0.19.2", "local-spec GPTModel the bridge targets", extra="megatron"),
        DependencyFloor("megatron-bridge", "0.6.2", "mapping classes of the plugin's MixtralBridge", extra="megatron"),
    ),
    reference_config=REFERENCE_CONFIG,
    # Mixtral's experts are intermediate_size wide (there is no dense MLP).
    config_fields=ConfigFields(expert_intermediate_size="intermediate_size"),
)
