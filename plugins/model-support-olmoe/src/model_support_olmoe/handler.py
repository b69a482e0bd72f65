"""OLMoE (allenai/OLMoE-1B-7B): MHA with q/k RMSNorm over the whole projection, 64 routed experts top-8."""

from pathlib import Path

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import ConfigRequirement, DependencyFloor, HandlerSpec, Topology, VllmLora

# allenai/OLMoE-1B-7B-0924's config.json: 16 layers, hidden 2048, 16 heads (MHA), 64 experts of width 1024, top-8.
REFERENCE_CONFIG = Path(__file__).with_name("olmoe-1b-7b.json")
_BRIDGE = "megatron-bridge's OlMoEBridge"

OLMOE = HandlerSpec(
    name="olmoe",
    description="OLMoE mixture of experts (q/k RMSNorm over the whole projection, routed experts, no shared expert).",
    architectures=("OlmoeForCausalLM",),
    model_types=("olmoe",),
    topology=Topology.MOE,
    lora_targets=targets.ATTENTION + targets.EXPERTS,
    vllm_lora=VllmLora(native=True, reason="vLLM's OlmoeForCausalLM implements SupportsLoRA"),
    # LoRA splits derived from OlMoEBridge's mappings (fused QKV, per-expert [gate; up]).
    codec=BridgeLoraCodec("olmoe"),
    dependencies=(
        DependencyFloor("transformers", "4.45.0", "first release with model_type olmoe"),
        DependencyFloor("megatron-core", "0.19.2", "local-spec GPTModel the bridge targets", extra="megatron"),
        DependencyFloor("megatron-bridge", "0.6.2", "OlMoEBridge weight mappings", extra="megatron"),
    ),
    reference_config=REFERENCE_CONFIG,
    # The experts' width is intermediate_size (OLMoE has no dense MLP).
    config_fields=ConfigFields(expert_intermediate_size="intermediate_size"),
    megatron_layer_spec="model_support_olmoe.megatron:layer_spec",
    config_requirements=(
        ConfigRequirement("norm_topk_prob", (False,), f"{_BRIDGE} does not renormalise the top-k routing weights"),
        ConfigRequirement("clip_qkv", (None,), f"{_BRIDGE} does not clip q/k/v"),
    ),
)
